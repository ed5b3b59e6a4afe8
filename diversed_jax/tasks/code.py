"""MBPP and HumanEval rewards: extract the code, build the test program, run it in the sandbox."""

from __future__ import annotations

import re
import textwrap
import warnings
from typing import Sequence

from diversed_jax.tasks import sandbox
from diversed_jax.tasks.datasets import Example

# Seconds a test program may run (the sandbox kills it after): callers may pass their own.
TIMEOUT_S = 5.0
_FENCE = re.compile(r"```[ \t]*([\w+-]*)[^\n]*\n(.*?)(?:```|\Z)", re.DOTALL)
_FENCE_MARK = re.compile(r"```[ \t]*([\w+-]*)")
# Where a base model's plain-text continuation of a function body stops being the body
# (the stop sequences of the HumanEval paper, plus a closing fence).
_BODY_STOPS = ("\nclass ", "\ndef ", "\n#", "\n@", "\nif __name__", "\nprint(", "\n```")


def _is_python(text: str) -> bool:
  """Whether `text` compiles as Python: a module, or a function's body (a base model's
  continuation of the prompt's function)."""
  source = textwrap.dedent(text)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # e.g. invalid escape sequences: still code
    for wrapped in (source, "def _body():\n" + textwrap.indent(source, "  ")):
      try:
        compile(wrapped, "<completion>", "exec")
        return True
      except (SyntaxError, ValueError):
        pass
  return False


def extract_code(completion: str, entry_point: str | None = None) -> str:
  """The Python code in a completion.

  A completion is fenced when its first fence opens a block: nothing but whitespace
  before it, a language tag (```python), or prose before it ("Sure!\n```"). Then: the
  first block that defines `entry_point` (when given), else the first python block, else
  the first block (an unclosed last fence included). A bare fence after code closes
  code written without an opening one (a base model's body, then ``` and prose): the
  code before it. Without a fence, the raw text. Indentation is kept (a body
  continuation needs it).
  """
  first = _FENCE_MARK.search(completion)
  if first is None:
    return completion.rstrip()
  before = completion[:first.start()]
  # (More than one word: a lone "Answer" before a fence compiles too, yet is prose.)
  if len(before.split()) > 1 and not first.group(1) and _is_python(before):
    return before.rstrip()
  blocks = [(lang.lower(), body) for lang, body in _FENCE.findall(completion)]
  if not blocks:
    return completion.rstrip()
  if entry_point is not None:
    defining = [b for _, b in blocks if re.search(rf"^\s*def\s+{re.escape(entry_point)}\s*\(",
                                                   b, re.MULTILINE)]
    if defining:
      return defining[0].rstrip()
  python = [b for lang, b in blocks if lang in ("python", "py", "python3")]
  return (python or [b for _, b in blocks])[0].rstrip()


def _defines(code: str, entry_point: str) -> bool:
  return re.search(rf"^def\s+{re.escape(entry_point)}\s*\(", code, re.MULTILINE) is not None


def mbpp_program(code: str, test_list: Sequence[str], test_setup_code: str = "") -> str:
  """The candidate code, then test_setup_code, then the assert lines.

  Setup after the code: some setups use what the solution defines (tasks 367 and 927
  build trees of its `Node` class), and every reference, full and sanitized, passes so.
  """
  return "\n".join([code, test_setup_code.strip(), "", *test_list, ""])


def humaneval_program(prompt: str, completion: str, test: str, entry_point: str) -> str:
  """prompt + completion + test + check(entry_point), as in HumanEval's harness.

  A completion that defines `entry_point` itself (an instruct model answering with the whole
  function) is placed after the prompt, whose imports and helpers it may use; otherwise it is
  taken as the body continuing the prompt and cut at the first line leaving the function.
  """
  code = extract_code(completion, entry_point)
  if _defines(code, entry_point):
    body = "\n" + code
  else:
    cut = min([i for i in (code.find(s) for s in _BODY_STOPS) if i >= 0], default=len(code))
    body = code[:cut]
  return f"{prompt}{body}\n\n{test}\n\ncheck({entry_point})\n"


def build_program(completion: str, example: Example) -> str:
  """The test program of an MBPP or HumanEval example with `completion` as the solution."""
  if example.task == "mbpp":
    return mbpp_program(extract_code(completion), example.meta["test_list"],
                        example.meta.get("test_setup_code", ""))
  if example.task == "humaneval":
    return humaneval_program(example.source_text, completion, example.reference,
                             example.meta["entry_point"])
  raise ValueError(f"{example.task!r} is not a code task (mbpp, humaneval)")


def mbpp_reward(completion: str, test_list: Sequence[str], test_setup_code: str = "",
                timeout_s: float = TIMEOUT_S) -> float:
  """1.0 when the extracted code passes every assert in the sandbox, else 0.0."""
  program = mbpp_program(extract_code(completion), test_list, test_setup_code)
  return float(sandbox.run_program(program, timeout_s=timeout_s).passed)


def humaneval_reward(completion: str, prompt: str, test: str, entry_point: str,
                     timeout_s: float = TIMEOUT_S) -> float:
  """1.0 when prompt + completion passes `check(entry_point)` in the sandbox, else 0.0."""
  program = humaneval_program(prompt, completion, test, entry_point)
  return float(sandbox.run_program(program, timeout_s=timeout_s).passed)


def pass_rewards(programs: Sequence[str], workers: int | None = None,
                 timeout_s: float = TIMEOUT_S) -> list[float]:
  """1.0 / 0.0 per already-built program, run `workers` at a time."""
  results = sandbox.run_many(programs, workers=workers, timeout_s=timeout_s)
  return [float(r.passed) for r in results]
