"""HumanEval (pass@1 of `check(entry_point)`, run in the sandbox) on the shipped 164 problems.
It has no train split: 'diversed' uses the shipped GSM8K head (cross-task evaluation), and
mode=train trains a head on MBPP.

  python -m diversed_jax.main --config=configs/humaneval.py
  python -m diversed_jax.main --config=configs/humaneval.py --config.head.task=cnndm
"""

from configs import default


def get_config(variant: str = ""):
  c = default.base()
  c.workdir = "runs/humaneval"
  c.task.name = "humaneval"
  c.task.fields.source_text = "prompt"  # field of the function signature and docstring
  c.task.fields.reference = "test"  # field of the test code defining check()
  c.task.fields.entry_point = "entry_point"  # field of the function name
  c.task.limit = 4
  c.decode.max_new_tokens = 128
  c.head.task = "gsm8k"  # a shipped head (gsm8k and cnndm ship; none for code tasks)
  c.train.task = "mbpp"  # no train split: train the head on MBPP
  return default.with_preset(c, variant)
