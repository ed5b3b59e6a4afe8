"""GSM8K reward: exact match of the final number."""

from __future__ import annotations

import math
import re

# A number with optional sign and currency; thousands separators only in groups of three,
# so "2,3,4" stays three numbers while "1,234,567" is one.
# A sign directly before the digits or the '$' ("- 3" in "8 - 3" is not negative).
_NUMBER = re.compile(
    r"(?<![\d.])([-\u2212]?)(?:\$\s?)?([-\u2212]?)(\d{1,3}(?:,\d{3})+|\d+)(\.\d+)?(?!\d)")
# Markers after which the final answer follows, most specific first.
_MARKERS = (
    re.compile(r"####"),
    re.compile(r"\\boxed\{"),
    re.compile(r"\banswer\s*(?:is|=|:)", re.IGNORECASE),
)


def _canonical(sign: str, sign2: str, integer: str, fraction: str | None) -> str:
  negative = bool(sign) != bool(sign2)
  value = integer.replace(",", "") + (fraction or "")
  if "." in value:
    value = value.rstrip("0").rstrip(".")
  value = value.lstrip("0") or "0"
  if value.startswith("."):
    value = "0" + value
  return ("-" if negative and value != "0" else "") + value


def _numbers(text: str) -> list[str]:
  return [_canonical(*m.groups()) for m in _NUMBER.finditer(text)]


def extract_answer(text: str) -> str | None:
  """The final numeric answer of a solution or completion, canonical ('1,234.50' -> '1234.5').

  Takes the first number after the first '####', else '\\boxed{', else 'answer is' /
  'answer:' / 'answer =' marker (any case: 'The answer is', 'Final answer:'), else the
  last number in the text. Handles commas,
  '$', trailing periods, negatives (also U+2212) and decimals. None when there is no number.
  """
  for marker in _MARKERS:
    # The first marker wins: what follows it is usually a hallucinated next question.
    for match in marker.finditer(text):
      found = _numbers(text[match.end():])
      if found:
        return found[0]
  found = _numbers(text)
  return found[-1] if found else None


def answers_match(predicted: str | None, reference: str | None) -> bool:
  """Numeric equality of two canonical answers ('72' == '72.0')."""
  if predicted is None or reference is None:
    return False
  try:
    return math.isclose(float(predicted), float(reference), rel_tol=0, abs_tol=1e-6)
  except ValueError:
    return predicted == reference


def gsm8k_reward(completion: str, reference: str) -> float:
  """1.0 when the completion's final number equals the reference's, else 0.0.

  reference: the final number ('72') or a full GSM8K answer ending in '#### 72'.
  """
  return float(answers_match(extract_answer(completion), extract_answer(reference)))
