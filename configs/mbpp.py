"""MBPP (pass@1 of the unit tests, run in the sandbox) on the shipped test split (ids 11-510).

  python -m diversed_jax.main --config=configs/mbpp.py
  python -m diversed_jax.main --config=configs/mbpp.py --config.task.source=sanitized
"""

from configs import default


def get_config(variant: str = ""):
  c = default.base()
  c.workdir = "runs/mbpp"
  c.task.name = "mbpp"
  c.task.fields.source_text = "text"  # field of the problem statement
  c.task.fields.test_list = "test_list"  # field of the list of assert lines
  c.task.limit = 4
  c.decode.max_new_tokens = 128
  return default.with_preset(c, variant)
