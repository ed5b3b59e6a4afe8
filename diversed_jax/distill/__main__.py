"""python -m diversed_jax.distill --config=configs/distill_smollm2.py [--config.mode=data]"""

from absl import app
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", None, "distillation config file",
                                          lock_config=True)


def main(argv):
  del argv
  from diversed_jax.distill import train
  train.run(_CONFIG.value)


if __name__ == "__main__":
  app.run(main)
