"""One description per task: data, prompt, reward, quality metric."""

from __future__ import annotations

import dataclasses
from typing import Callable, Mapping, Sequence

from diversed_jax.tasks import code, datasets, gsm8k, prompts, summarization
from diversed_jax.tasks.datasets import Example


@dataclasses.dataclass(frozen=True)
class Task:
  """Everything the training and evaluation loops need to know about a benchmark.

  name: 'gsm8k', 'cnndm', 'xsum', 'mbpp' or 'humaneval'.
  fields: the default canonical -> file field mapping (override per call in load()).
  metric: the quality metric, the mean reward: 'accuracy', 'rouge2' or 'pass@1'.
  max_source_words: article truncation in the prompt (summarization), else None.
  eval_split: the split evaluated by default.
  scoring_version: raised whenever the reward of a completion changes (e.g. the answer
    extraction), so that stored results scored before are not reused (the main job's
    fingerprint reads it).
  """
  name: str
  fields: Mapping[str, str]
  metric: str
  max_source_words: int | None = None
  eval_split: str = "test"
  scoring_version: int = 0

  def load(self, source: str | None = None, split: str | None = None,
           limit: int | None = None, fields: Mapping[str, str] | None = None) -> list[Example]:
    """datasets.load_examples for this task (source None = the shipped sample)."""
    return datasets.load_examples(self.name, source=source, split=split or self.eval_split,
                                  limit=limit, fields=fields)

  def prompt(self, example: Example, shots: Sequence[Example] = (), chat: bool = True) -> str:
    """The user-turn text, with this task's article truncation."""
    return prompts.build_prompt(example, shots, max_source_words=self.max_source_words,
                                chat=chat)

  def prompt_ids(self, example: Example, shots: Sequence[Example], tokenizer,
                 max_tokens: int, chat: bool = True) -> tuple[list[int], bool]:
    """(ids, shortened) of the prompt in at most `max_tokens` ids where it fits, the
    template kept whole (prompts.fit_prompt_ids, with this task's article truncation)."""
    return prompts.fit_prompt_ids(example, shots, tokenizer, max_tokens, chat=chat,
                                  max_source_words=self.max_source_words)

  def reward(self, completion: str, example: Example) -> float:
    """The RL reward of one completion, in [0, 1]."""
    return self.rewards([completion], [example], workers=1)[0]

  def rewards(self, completions: Sequence[str], examples: Sequence[Example],
              workers: int | None = None, timeout_s: float = code.TIMEOUT_S) -> list[float]:
    """Rewards of a batch; code tasks run their programs `workers` at a time, each for at
    most `timeout_s` seconds."""
    if len(completions) != len(examples):
      raise ValueError(f"{len(completions)} completions for {len(examples)} examples")
    if self.name in ("mbpp", "humaneval"):
      programs = [code.build_program(c, e) for c, e in zip(completions, examples)]
      return code.pass_rewards(programs, workers=workers, timeout_s=timeout_s)
    score: Callable[[str, str], float] = (
        gsm8k.gsm8k_reward if self.name == "gsm8k" else summarization.summarization_reward)
    return [score(c, e.reference) for c, e in zip(completions, examples)]

  def quality(self, completions: Sequence[str], examples: Sequence[Example],
              workers: int | None = None, timeout_s: float = code.TIMEOUT_S) -> float:
    """The task metric (`self.metric`) over a batch: the mean reward."""
    if not completions:  # a mean of nothing: 0.0 would read as a measured score
      raise ValueError(f"{self.name}: quality of 0 completions; pass at least one")
    values = self.rewards(completions, examples, workers, timeout_s)
    return sum(values) / len(values)


# Generation budgets and data sources are the configs' (decode.max_new_tokens, task.source).
_TASKS = {
    # Version 1 (session 51): the last statement of the answer, before any new question.
    "gsm8k": Task("gsm8k", datasets.default_fields("gsm8k"), metric="accuracy",
                  scoring_version=1),
    # ~400 words keep a CNN/DM or XSum prompt near 600 tokens: most of the lead, which is
    # where the reference summaries come from, at a prefill cost a CPU run can afford.
    # Version 1: the completion cut before a new 'Article:' / 'Summary:' line it runs on into.
    "cnndm": Task("cnndm", datasets.default_fields("cnndm"), metric="rouge2",
                  max_source_words=400, scoring_version=1),
    "xsum": Task("xsum", datasets.default_fields("xsum"), metric="rouge2",
                 max_source_words=400, scoring_version=1),
    # Version 1 (session 52): MBPP's setup code runs after the solution (tasks 367 and 927
    # define the class their setup builds); a body continuation's closing fence ends it.
    "mbpp": Task("mbpp", datasets.default_fields("mbpp"), metric="pass@1",
                 scoring_version=1),
    "humaneval": Task("humaneval", datasets.default_fields("humaneval"), metric="pass@1",
                      scoring_version=1),
}
TASK_NAMES = datasets.TASKS  # the same names, in the same order (tasks_test checks)


def get_task(name: str) -> Task:
  """The Task called `name`; ValueError listing the choices otherwise."""
  try:
    return _TASKS[name]
  except KeyError:
    raise ValueError(f"unknown task {name!r}; choose one of {list(TASK_NAMES)}") from None
