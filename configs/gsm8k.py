"""GSM8K (accuracy of the final number) on the embedded pair: the default main-job run,
sized to finish in under 15 minutes on a 2-core CPU.

  python -m diversed_jax.main --config=configs/gsm8k.py
  python -m diversed_jax.main --config=configs/gsm8k.py:qwen3 --config.decode.temperature=0.1
  python -m diversed_jax.main --config=configs/gsm8k.py --config.task.source=/data/gsm8k.jsonl \
      --config.task.fields.source_text=question --config.task.fields.reference=answer
"""

from configs import default


def get_config(variant: str = ""):
  c = default.base()
  c.workdir = "runs/gsm8k"
  c.task.name = "gsm8k"
  c.task.fields.source_text = "question"  # field of the question in the data file
  c.task.fields.reference = "answer"  # field of the worked answer ending in '#### N'
  return default.with_preset(c, variant)
