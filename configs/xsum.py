"""XSum one-sentence summarisation (ROUGE-2 F). No sample is shipped: the data comes from
the hub (online) or from a local JSON Lines file with the same fields. 'diversed' uses the
shipped CNN/DM head (the other summarisation task; no XSum head ships), and mode=train trains
a head on CNN/DM.

  python -m diversed_jax.main --config=configs/xsum.py                   # EdinburghNLP/xsum
  python -m diversed_jax.main --config=configs/xsum.py --config.task.source=/data/xsum_test.jsonl
"""

from configs import default


def get_config(variant: str = ""):
  c = default.base()
  c.workdir = "runs/xsum"
  c.task.name = "xsum"
  c.task.source = "EdinburghNLP/xsum"  # hub name, or a local .jsonl with the fields below
  c.task.fields.id = "id"  # field of the example id
  c.task.fields.source_text = "document"  # field of the article
  c.task.fields.reference = "summary"  # field of the one-sentence reference summary
  c.task.limit = 4
  c.decode.max_new_tokens = 48
  c.head.task = "cnndm"  # the shipped head of the closest task
  c.train.task = "cnndm"  # no XSum train data ships: the head.task above, unless set
  return default.with_preset(c, variant)
