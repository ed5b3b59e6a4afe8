"""CNN/DailyMail and XSum reward: ROUGE-2 F (rouge-score, Porter stemming); ROUGE-L to report."""

from __future__ import annotations

import functools
import re

ROUGE_TYPES = ("rouge1", "rouge2", "rougeL", "rougeLsum")


@functools.lru_cache(maxsize=None)
def _scorer(*types: str):
  # Built once per set of types; a scorer computes every type it holds on each call, and
  # rougeLsum is the slow one, so the reward's scorer holds only rouge2. Imported here:
  # rouge-score pulls in nltk (~1-2 s), which prompt-only users need not pay for.
  from rouge_score import rouge_scorer
  return rouge_scorer.RougeScorer(list(types), use_stemmer=True)


def rouge_scores(prediction: str, reference: str) -> dict[str, float]:
  """F-measures of rouge1, rouge2, rougeL and rougeLsum (sentences split on newlines, as
  in CNN/DM highlights). Argument order follows rouge-score: score(target, prediction)."""
  scores = _scorer(*ROUGE_TYPES).score(reference, prediction)
  return {name: scores[name].fmeasure for name in ROUGE_TYPES}


def rouge2(prediction: str, reference: str) -> float:
  """ROUGE-2 F-measure of `prediction` against `reference`."""
  return _scorer("rouge2").score(reference, prediction)["rouge2"].fmeasure


def rouge_l(prediction: str, reference: str) -> float:
  """ROUGE-L F-measure (longest common subsequence over the whole text)."""
  return _scorer("rougeL").score(reference, prediction)["rougeL"].fmeasure


# A line that starts a new item of the few-shot format (prompts._summary), where a base
# or few-shot model runs on past its own summary.
_NEW_ITEM = re.compile(r"^[ \t]*(article|summary)[ \t]*:", re.IGNORECASE | re.MULTILINE)


def own_summary(completion: str) -> str:
  """The completion up to a new 'Article:' / 'Summary:' line after its first line (the
  first may repeat the prompt's 'Summary:' header), stripped."""
  text = completion.strip()
  first_end = text.find("\n")
  if first_end >= 0:
    run_on = _NEW_ITEM.search(text, first_end + 1)
    if run_on:
      text = text[:run_on.start()].rstrip()
  return text


def summarization_reward(completion: str, reference: str) -> float:
  """The RL reward and quality metric: ROUGE-2 F of the completion's own summary (cut
  where it runs on into a new article, own_summary), in [0, 1]."""
  return rouge2(own_summary(completion), reference)
