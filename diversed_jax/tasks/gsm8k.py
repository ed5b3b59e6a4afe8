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
# Where a completion runs on into a few-shot item of its own ("\n\nQuestion: ..." as our
# prompts lay them out, prompts._gsm8k): nothing after it answers this problem.
_NEW_ITEM = re.compile(r"\n[\s*#>_]*(?:question|q)\s*:", re.IGNORECASE)
# GSM8K's own final-answer marker, with what may stand between it and the number.
_HASHES = re.compile(r"####[ \t*_:]*")
# Statements of the final answer: '\boxed{N}', 'the answer is N', 'answer: N', 'answer = N'
# (any case).
_STATEMENT = re.compile(r"\\boxed\{|\banswer\s*(?:is\b|=|:)", re.IGNORECASE)
# What may stand between a statement and its number ('The answer is: **$18**').
_LEAD = re.compile(r"[\s*_:]*")
# A statement's number must lie in its own sentence: 'The answer is: eighteen. Next, 4'.
_SENTENCE_END = re.compile(r"[.!?;](?=\s|$)|\n|\}")
# A number followed by an operator and another number is an operand, not the result:
# '18' and '2' in 'the answer is 18 * 2 = 36'.
_OPERAND = re.compile(r"\s*[-+*/x\u00d7\u00f7^=\u2212]\s*[(\-\u2212$]*\s*\.?\d")
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


def _cut_at_new_item(text: str) -> str:
  new_item = _NEW_ITEM.search(text)
  return text[:new_item.start()] if new_item else text


def _result_number(sentence: str) -> str | None:
  """The first number of a sentence that is not an operand ('36' in '18 * 2 = 36.')."""
  for m in _NUMBER.finditer(sentence):
    if not _OPERAND.match(sentence, m.end()):
      return _canonical(*m.groups())
  return None


def _statement_sentence(text: str, marker: re.Match) -> str | None:
  """Where a marker states the answer, or None when it is no statement.

  'answer is' and '\\boxed{': to the end of the sentence. 'answer:' / 'answer =': only
  when a number follows at once ('To find the answer: we add 16 ...' is a lead-in). An
  'Answer:' opening a line is the prompt's header: only when a lone number is on its line.
  """
  line_start = text.rfind("\n", 0, marker.start()) + 1
  if _HEADER.fullmatch(text, line_start, marker.end()):
    line_end = text.find("\n", marker.end())
    line = text[marker.end():line_end if line_end >= 0 else len(text)]
    return line if _lone_number(line) is not None else None
  start = _LEAD.match(text, marker.end()).end()
  if marker.group()[-1] in ":=" and not _NUMBER.match(text, start):
    return None
  end = _SENTENCE_END.search(text, start)
  return text[start:end.start() if end else len(text)]


def _hashes_answer(text: str) -> str | None:
  """The number right after the last '####' that has one."""
  for marker in reversed(list(_HASHES.finditer(text))):
    number = _NUMBER.match(text, marker.end())
    if number:
      return _canonical(*number.groups())
  return None


def _last_statement(text: str) -> tuple[int, str | None] | None:
  """(where it starts, its number or None) of the last statement of an answer."""
  last = None
  for marker in _STATEMENT.finditer(text):
    sentence = _statement_sentence(text, marker)
    if sentence is not None:
      last = (marker.start(), _result_number(sentence))
  return last


def extract_answer(text: str) -> str | None:
  """The final numeric answer of a solution or completion, canonical ('1,234.50' -> '1234.5').

  The text is first cut where the model starts a new 'Question:' / 'Q:' item of its own.
  Then the number after the last '####'; else the last statement of the answer ('The
  answer is', 'Final answer:', '\\boxed{'), taking the result in its sentence ('36' in
  'the answer is 18 * 2 = 36'); a statement in words ('The answer is eighteen') takes the
  last number before it. Without either, the last number in the text. Handles commas,
  '$', trailing periods, negatives (also U+2212) and decimals ('.5'). None when there is
  no number.
  """
  text = _cut_at_new_item(text)
  hashes = _hashes_answer(text)
  if hashes is not None:
    return hashes
  statement = _last_statement(text)
  if statement is not None:
    start, number = statement
    if number is not None:
      return number
    text = text[:start]
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
