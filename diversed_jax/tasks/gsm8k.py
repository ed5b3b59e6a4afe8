"""GSM8K reward: exact match of the final number."""

from __future__ import annotations

import math
import re

# A number with optional sign and currency; thousands separators only in groups of three,
# so "2,3,4" stays three numbers while "1,234,567" is one; ".5" has no integer part.
# A sign directly before the digits or the '$' ("- 3" in "8 - 3" is not negative).
_NUMBER = re.compile(
    r"(?<![\d.])([-\u2212]?)(?:\$\s?)?([-\u2212]?)(\d{1,3}(?:,\d{3})+|\d+|(?=\.\d))(\.\d+)?"
    r"(?!\d)")
# Statements of the final answer: '#### N', '\boxed{N}', 'the answer is N', 'answer: N',
# 'answer = N' (any case).
_MARKER = re.compile(r"####|\\boxed\{|\banswer\s*(?:is\b|=|:)", re.IGNORECASE)
# 'Answer:' opening a line (after markdown such as '**' or '#'). Our prompts end in
# "Question: ...\nAnswer:" (prompts._gsm8k) and completions often repeat that header
# before their reasoning, so there it introduces reasoning, not the answer.
_HEADER = re.compile(r"[\s*#>_-]*answer\s*:", re.IGNORECASE)
# What may stand beside the number on a line that only states it ('Answer: **$18.**').
_DECORATION = re.compile(r"[\s*_.:$]*")


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


def _lone_number(line: str) -> str | None:
  """The number of a line that holds one number and nothing else but decoration."""
  matches = list(_NUMBER.finditer(line))
  if len(matches) != 1:
    return None
  rest = line[:matches[0].start()] + line[matches[0].end():]
  return _canonical(*matches[0].groups()) if _DECORATION.fullmatch(rest) else None


def _stated_answer(text: str, marker: re.Match) -> str | None:
  """The number a marker states: the first one after it; for an 'Answer:' header, the
  number only when it stands alone on the header's line (else None)."""
  line_start = text.rfind("\n", 0, marker.start()) + 1
  if _HEADER.fullmatch(text, line_start, marker.end()):
    line_end = text.find("\n", marker.end())
    return _lone_number(text[marker.end():line_end if line_end >= 0 else len(text)])
  found = _numbers(text[marker.end():])
  return found[0] if found else None


def extract_answer(text: str) -> str | None:
  """The final numeric answer of a solution or completion, canonical ('1,234.50' -> '1234.5').

  The first marker in the text that states a number wins: '####', '\\boxed{', 'answer is'
  / 'answer =' / 'answer:' (any case: 'The answer is', 'Final answer:'), taking the first
  number after it. First, not last: what follows a model's answer is usually a
  hallucinated next question ("Question: ... #### 7"). An 'Answer:' opening a line is the
  prompt's header, a marker only when a lone number follows on its line ('Answer: 18').
  Without a marker, the last number in the text. Handles commas, '$', trailing periods,
  negatives (also U+2212) and decimals ('.5'). None when there is no number.
  """
  for marker in _MARKER.finditer(text):
    answer = _stated_answer(text, marker)
    if answer is not None:
      return answer
  found = _numbers(text)
  return found[-1] if found else None


def reference_answer(solution: str) -> str | None:
  """The final number of a reference: after its last '####' (a GSM8K worked answer), else
  extract_answer's."""
  _, marker, final = solution.rpartition("####")
  found = _numbers(final) if marker else []
  return found[0] if found else extract_answer(solution)


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
  return float(answers_match(extract_answer(completion), reference_answer(reference)))
