r"""The main job: train and evaluate every method, write tables and the Pareto frontier.

  python -m diversed_jax.main --config=configs/gsm8k.py --workdir=runs/gsm8k
  python -m diversed_jax.main --config=configs/cnndm.py:qwen3 --config.mode=train_and_eval \
      --config.decode.temperature=0.1

Modes, config fields and outputs: see configs/default.py and evaluation/runner.py.
Several GPUs or a TPU pod slice: launch/gpu_node.sh, launch/tpu_pod.sh (README).
"""

from absl import app, flags
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Config file, configs/NAME.py[:VARIANT].", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Output folder (default: config.workdir).")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  from diversed_jax import cli
  from diversed_jax.evaluation import runner
  from diversed_jax.parallel import hosts
  with cli.usage_errors():
    hosts.initialize_distributed()  # first: before anything touches a device
    workdir = runner.preflight(_CONFIG.value, _WORKDIR.value)
  runner.run(_CONFIG.value, workdir)


if __name__ == "__main__":
  flags.mark_flag_as_required("config")
  app.run(main)
