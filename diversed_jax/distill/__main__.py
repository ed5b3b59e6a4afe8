"""python -m diversed_jax.distill --config=configs/distill_smollm2.py [--config.mode=data]"""

from absl import app, flags
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", None, "distillation config file",
                                          lock_config=True)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  from diversed_jax import cli
  from diversed_jax.distill import train
  with cli.usage_errors():
    train.validate(_CONFIG.value)
  train.run(_CONFIG.value)


if __name__ == "__main__":
  flags.mark_flag_as_required("config")
  app.run(main)
