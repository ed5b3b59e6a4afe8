"""CNN/DailyMail summarisation (ROUGE-2 F) on the shipped 100-article test sample.

  python -m diversed_jax.main --config=configs/cnndm.py
  python -m diversed_jax.main --config=configs/cnndm.py:llama \
      --config.task.source=abisee/cnn_dailymail
"""

from configs import default


def get_config(variant: str = ""):
  c = default.base()
  c.workdir = "runs/cnndm"
  c.task.name = "cnndm"
  c.task.fields.source_text = "article"  # field of the news article
  c.task.fields.reference = "highlights"  # field of the reference summary
  c.task.limit = 4
  c.decode.max_new_tokens = 96
  return default.with_preset(c, variant)
