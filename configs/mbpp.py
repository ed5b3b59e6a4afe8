"""MBPP (pass@1 of the unit tests, run in the sandbox) on the shipped test split (ids 11-510).
No MBPP head ships: 'diversed' uses the shipped GSM8K head (cross-task evaluation) unless
mode=train_and_eval trains one here or --config.head.path names one.
The data fields are left to the loader, which tells the original set (`text`) from the
sanitized one (`prompt`).

  python -m diversed_jax.main --config=configs/mbpp.py
  python -m diversed_jax.main --config=configs/mbpp.py --config.task.source=sanitized
"""

from configs import default


def get_config(variant: str = ""):
  c = default.base()
  c.workdir = "runs/mbpp"
  c.task.name = "mbpp"
  c.task.limit = 4
  c.decode.max_new_tokens = 128
  c.head.task = "gsm8k"  # no MBPP head ships; a head trained here (train/head) wins
  return default.with_preset(c, variant)
