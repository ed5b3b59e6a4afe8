"""The user-turn text of each task, optional few-shot examples, and its token ids."""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Sequence

from diversed_jax import tokenizer as tokenizer_lib
from diversed_jax.tasks import datasets
from diversed_jax.tasks.datasets import Example

GSM8K_INSTRUCTION = ("Solve the following math problem. Let's think step by step, then end "
                     "your answer with \"The answer is N\", where N is the final number.")
SUMMARY_INSTRUCTION = {
    "cnndm": "Summarize the following news article in three sentences.",
    "xsum": "Summarize the following article in one sentence.",
}
MBPP_INSTRUCTION = ("You are an expert Python programmer. Write a Python function for the "
                    "task below, in a ```python code block.")
HUMANEVAL_INSTRUCTION = ("Complete the following Python function. Answer with the whole "
                         "function in a ```python code block.")
# The few-shot MBPP problems of the original paper (Austin et al. 2021): task_ids 2, 3, 4.
MBPP_SHOT_IDS = ("2", "3", "4")
# A prompt over its token budget keeps fewer article words, but not fewer than this: a
# shorter article says too little to summarise, so shots go instead.
MIN_SOURCE_WORDS = 32


def truncate(text: str, max_words: int | None = None, max_chars: int | None = None) -> str:
  """Keeps the first `max_words` words and then at most `max_chars` characters, marking a cut
  with ' ...'. Whitespace inside the kept part is preserved (CNN/DM uses newlines)."""
  cut = False
  if max_words is not None:
    spans = list(re.finditer(r"\S+", text))
    if len(spans) > max_words:
      text, cut = text[:spans[max_words - 1].end()] if max_words > 0 else "", True
  if max_chars is not None and len(text) > max_chars:
    text, cut = text[:max_chars].rstrip(), True
  return text + " ..." if cut else text


def _gsm8k_solution(solution: str) -> str:
  # Worked answers carry calculator annotations (<<48/2=24>>) and end in '#### N'; shots
  # show the format the model is asked for instead.
  solution = re.sub(r"<<[^>]*>>", "", solution)
  body, _, final = solution.rpartition("####")
  return f"{body.strip()}\nThe answer is {final.strip()}." if body else solution.strip()


def _gsm8k(example: Example, shots: Sequence[Example]) -> str:
  parts = [GSM8K_INSTRUCTION]
  for shot in shots:
    parts.append(f"Question: {shot.source_text}\nAnswer: "
                 f"{_gsm8k_solution(shot.meta.get('solution', shot.reference))}")
  parts.append(f"Question: {example.source_text}\nAnswer:")
  return "\n\n".join(parts)


def _summary(example: Example, shots: Sequence[Example], max_words: int | None,
             max_chars: int | None) -> str:
  parts = [SUMMARY_INSTRUCTION[example.task]]
  for shot in shots:
    parts.append(f"Article: {truncate(shot.source_text, max_words, max_chars)}\n"
                 f"Summary: {shot.reference.strip()}")
  parts.append(f"Article: {truncate(example.source_text, max_words, max_chars)}\nSummary:")
  return "\n\n".join(parts)


def _mbpp_problem(example: Example) -> str:
  tests = example.meta.get("test_list") or example.reference.splitlines()
  # One assert shows the function's name and signature without handing over every test.
  return (f"{example.source_text.strip()}\nYour code should pass this test:\n"
          f"{tests[0] if tests else ''}")


def _mbpp(example: Example, shots: Sequence[Example]) -> str:
  parts = [MBPP_INSTRUCTION]
  for shot in shots:
    code = shot.meta.get("solution", "").replace("\r\n", "\n").strip()
    parts.append(f"{_mbpp_problem(shot)}\n```python\n{code}\n```")
  parts.append(_mbpp_problem(example))
  return "\n\n".join(parts)


def _humaneval(example: Example, chat: bool) -> str:
  if not chat:  # a base model continues the function body directly
    return example.source_text
  return f"{HUMANEVAL_INSTRUCTION}\n\n```python\n{example.source_text.rstrip()}\n```"


def build_prompt(example: Example, shots: Sequence[Example] = (), *,
                 max_source_words: int | None = None, max_source_chars: int | None = None,
                 chat: bool = True) -> str:
  """The user-turn text for `example`.

  shots: solved examples of the same task shown first (from its train split; see
    load_shots). HumanEval takes none.
  max_source_words / max_source_chars: truncation of CNN/DM and XSum articles.
  chat: False for a base model; only HumanEval changes (the bare function prompt, to be
    continued as code completion).
  """
  task = example.task
  if task == "gsm8k":
    return _gsm8k(example, shots)
  if task in SUMMARY_INSTRUCTION:
    return _summary(example, shots, max_source_words, max_source_chars)
  if task == "mbpp":
    return _mbpp(example, shots)
  if task == "humaneval":
    if shots:
      raise ValueError("humaneval has no train split to draw few-shot examples from")
    return _humaneval(example, chat)
  raise ValueError(f"no prompt for task {task!r}; choose one of {list(datasets.TASKS)}")


def shot_origin(task: str, source: str | None) -> tuple[str | None, str]:
  """(source, split) the few-shot examples of prompts on `source` come from: a hub
  dataset's own train split; for the shipped sample or a local file, the shipped train
  split (MBPP: its 'prompt' split). Never the local file itself, whose split is unknown."""
  if source and not datasets.is_local(source):
    return source, "train"
  return None, "prompt" if task == "mbpp" else "train"


def load_shots(task: str, k: int, source: str | None = None, split: str = "train",
               fields: dict[str, str] | None = None) -> list[Example]:
  """The first `k` solved examples for few-shot prompts (MBPP: task_ids 2, 3, 4, ...).

  source/fields as in datasets.load_examples; the default is the shipped train split
  (MBPP's 'prompt' split). Raises ValueError for humaneval, which has no train split.
  """
  if k <= 0:
    return []
  if task == "humaneval":
    raise ValueError("humaneval has no train split to draw few-shot examples from")
  if task == "mbpp" and source is None:
    pool = datasets.load_examples("mbpp", split="prompt")
    ordered = sorted(pool, key=lambda e: (e.id not in MBPP_SHOT_IDS, int(e.id)))
    return ordered[:k]
  return datasets.load_examples(task, source=source, split=split, limit=k, fields=fields)


def check_shots_disjoint(examples: Sequence[Example], shots: Sequence[Example]) -> None:
  """Raises ValueError when a few-shot example is also one of the evaluated `examples`
  (the same id, or the same source text): its prompt would show it solved. Positional
  ids (`task/split/index`, of files without ids) name places, not items: only real ids
  and texts are compared."""
  if not shots:
    return
  by_id = {e.id: e for e in examples if not _positional_id(e)}
  by_text = {e.source_text.strip(): e for e in examples}
  for shot in shots:
    same = by_id.get(shot.id) if not _positional_id(shot) else None
    what = "id"
    if same is None:
      same, what = by_text.get(shot.source_text.strip()), "text"
    if same is not None:
      raise ValueError(
          f"task.num_shots={len(shots)}: few-shot example {shot.id!r} is also an evaluated "
          f"example ({same.id!r}, the same {what}): its prompt would show it solved. "
          "Evaluate other data (task.source / task.split / task.offset) or set "
          "task.num_shots=0")


def _positional_id(example: Example) -> bool:
  return re.fullmatch(rf"{re.escape(example.task)}/.*/\d+", example.id) is not None


def fit_prompt_ids(example: Example, shots: Sequence[Example], tokenizer: Any,
                   max_tokens: int, *, chat: bool = True,
                   max_source_words: int | None = None) -> tuple[list[int], bool]:
  """(ids, shortened): tokenizer.encode_prompt(build_prompt(...)) in at most `max_tokens` ids where
  it can be, and whether it had to be shortened.

  Only the variable part gives, before the chat template is applied, so the template's
  header (BOS, role markers) and the instruction always stay: first the articles of a
  summarization prompt keep fewer words (down to MIN_SOURCE_WORDS), then shots are
  dropped, the last first, and last of all the example's own text is cut (_cut_source).
  When the template and instruction alone are too long the prompt comes back whole and
  unshortened (len(ids) > max_tokens): the caller decides whether to refuse or skip it.
  """
  def encode(ex, kept_shots, words):
    text = build_prompt(ex, kept_shots, max_source_words=words, chat=chat)
    return tokenizer_lib.encode_prompt(tokenizer, text, chat=chat)

  shots = list(shots)
  whole = ids = encode(example, shots, max_source_words)
  if len(ids) <= max_tokens:
    return ids, False
  words = max_source_words
  if example.task in SUMMARY_INSTRUCTION:
    ids, words = _shrink_articles(lambda w: encode(example, shots, w), example, shots, ids,
                                  words, max_tokens)
  while len(ids) > max_tokens and shots:
    shots.pop()
    ids = encode(example, shots, words)
  if len(ids) > max_tokens:
    ids = _cut_source(lambda ex: encode(ex, shots, words), example, max_tokens)
  return (ids, True) if len(ids) <= max_tokens else (whole, False)


def _cut_source(encode, example: Example, max_tokens: int) -> list[int]:
  """The prompt with as many words of the example's own text as fit: an article keeps
  its start (where summaries come from), a question or problem its end (where it asks).
  A last resort, for budgets below a whole prompt (the tiny test preset's)."""
  text = example.source_text
  spans = list(re.finditer(r"\S+", text))

  def prompt_keeping(k):
    if example.task in SUMMARY_INSTRUCTION:
      kept = truncate(text, max_words=k)
    else:
      kept = "... " + text[spans[-k].start():] if k else "..."
    return encode(dataclasses.replace(example, source_text=kept))

  low, high, best = 0, len(spans), prompt_keeping(0)
  while low < high:  # the most words that fit; prompt_keeping(low) fits once low > 0
    mid = (low + high + 1) // 2
    ids = prompt_keeping(mid)
    if len(ids) <= max_tokens:
      low, best = mid, ids
    else:
      high = mid - 1
  return best


def _shrink_articles(encode, example: Example, shots: list[Example], ids: list[int],
                     words: int | None, max_tokens: int) -> tuple[list[int], int]:
  """Fewer words per article until the prompt fits or they are down to MIN_SOURCE_WORDS
  (`encode`: word budget -> ids); returns the ids and the word budget reached."""
  words = words or max(len(e.source_text.split()) for e in [example, *shots])
  while len(ids) > max_tokens and words > MIN_SOURCE_WORDS:
    # Tokens grow about linearly with the words kept, plus a fixed part the scaling
    # ignores: aim a little low, and always cut at least a word so that this ends.
    aim = int(words * max_tokens / len(ids) * 0.95)
    words = max(MIN_SOURCE_WORDS, min(words - 1, aim))
    ids = encode(words)
  return ids, words
