"""Benchmark examples as one canonical record, from the shipped sample, a local file or the hub.

`load_examples('gsm8k')` reads the sample shipped in `diversed_jax/data`;
`load_examples('xsum', source='EdinburghNLP/xsum')` loads the full dataset from the Hugging
Face hub (online only); `load_examples('xsum', source='my.jsonl', fields={...})` reads any
local JSON Lines file (or a JSON array), mapping its field names onto ours.
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import json
import os
from typing import Any, Mapping

from diversed_jax.tasks import gsm8k

TASKS = ("gsm8k", "cnndm", "xsum", "mbpp", "humaneval")


@dataclasses.dataclass(frozen=True)
class Example:
  """One benchmark item, the same shape for every task.

  source_text: what the model is given (question / article / problem / function prompt).
  reference: what it is scored against: gsm8k the final number, cnndm/xsum the reference
    summary, mbpp the assert lines (one per line), humaneval the `check` test code.
  meta: task extras: gsm8k `solution` (worked answer); mbpp `test_list`, `test_setup_code`,
    `challenge_test_list`, `solution`; humaneval `entry_point`, `solution`.
  """
  id: str
  task: str
  source_text: str
  reference: str
  meta: Mapping[str, Any] = dataclasses.field(default_factory=dict, hash=False)


@dataclasses.dataclass(frozen=True)
class _Layout:
  """Where a task's data lives and how its records are named."""
  fields: Mapping[str, str]  # canonical name -> name in the file / hub record
  optional: tuple[str, ...]  # canonical names that may be missing
  shipped: Mapping[str, str]  # split -> file under diversed_jax/data/<task>/
  hub_config: str | None


_LAYOUTS = {
    "gsm8k": _Layout(
        fields={"source_text": "question", "reference": "answer"},
        optional=("id",), shipped={"train": "train.jsonl", "test": "test.jsonl"},
        hub_config="main"),
    "cnndm": _Layout(
        fields={"id": "id", "source_text": "article", "reference": "highlights"},
        optional=("id",),
        shipped={"test": "test.jsonl", "train": "train.jsonl",
                 "train_more": "train_more.jsonl"},
        hub_config="3.0.0"),
    "xsum": _Layout(
        fields={"id": "id", "source_text": "document", "reference": "summary"},
        optional=("id",), shipped={}, hub_config=None),
    "mbpp": _Layout(
        fields={"id": "task_id", "source_text": "text", "test_list": "test_list",
                "test_setup_code": "test_setup_code", "solution": "code",
                "challenge_test_list": "challenge_test_list"},
        optional=("id", "test_setup_code", "solution", "challenge_test_list"),
        shipped={s: "mbpp.jsonl" for s in ("prompt", "test", "validation", "train", "all")},
        hub_config="full"),
    "humaneval": _Layout(
        fields={"id": "task_id", "source_text": "prompt", "reference": "test",
                "entry_point": "entry_point", "solution": "canonical_solution"},
        optional=("id", "solution"), shipped={"test": "HumanEval.jsonl"}, hub_config=None),
}

# The sanitized MBPP set names things differently (recognised by its `prompt` field);
# `source='sanitized'` selects the shipped copy.
_MBPP_SANITIZED_FIELDS = {"source_text": "prompt", "test_setup_code": "test_imports"}

# Upstream MBPP README (and the HF `full` config): task_id ranges of each split; 'all' keeps
# every record.
MBPP_SPLITS = {"prompt": (1, 10), "test": (11, 510), "validation": (511, 600),
               "train": (601, 974)}


def default_fields(task: str) -> dict[str, str]:
  """The task's canonical -> file field mapping (what `fields=` overrides)."""
  if task not in _LAYOUTS:
    raise ValueError(f"unknown task {task!r}; choose one of {list(TASKS)}")
  return dict(_LAYOUTS[task].fields)


def shipped_path(task: str, filename: str) -> str:
  """Path of a file shipped in diversed_jax/data/<task>/."""
  return str(importlib.resources.files("diversed_jax") / "data" / task / filename)


def is_local(source: str) -> bool:
  """A local file rather than a hub name: an existing path, a .json/.jsonl name, or an
  explicit path start. The one test of it, so that loading, validation and the choice of
  few-shot examples agree on what a source is."""
  return (os.path.exists(os.path.expanduser(source)) or source.endswith((".json", ".jsonl"))
          or source.startswith(("/", ".", "~")))


def shipped_split_path(task: str, split: str) -> str | None:
  """The shipped file that holds `split` of `task`, or None when none ships."""
  filename = _LAYOUTS[task].shipped.get(split)
  return shipped_path(task, filename) if filename else None


def _read_local(path: str) -> list[dict]:
  path = os.path.expanduser(path)
  if not os.path.isfile(path):
    raise FileNotFoundError(f"dataset file not found: {path}")
  with open(path, encoding="utf-8") as f:
    text = f.read()
  stripped = text.lstrip()
  if stripped.startswith("["):  # a JSON array, e.g. sanitized-mbpp.json
    return json.loads(stripped)
  records = []
  for number, line in enumerate(text.splitlines(), 1):
    if line.strip():
      try:
        records.append(json.loads(line))
      except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{number}: not a JSON line ({e})") from e
  return records


def _read_hub(task: str, name: str, split: str, limit: int | None) -> list[dict]:
  config = _LAYOUTS[task].hub_config
  if ":" in name:  # "google-research-datasets/mbpp:sanitized"
    name, config = name.split(":", 1)
  sliced = f"{split}[:{limit}]" if limit is not None else split
  try:
    import datasets as hf_datasets  # HF `datasets`, imported only when a hub name is used
    rows = hf_datasets.load_dataset(name, config, split=sliced)
  except Exception as e:  # offline, unknown name, wrong split: all end here
    raise RuntimeError(
        f"could not load {name!r} (config {config!r}, split {split!r}) from the Hugging Face "
        f"hub: {type(e).__name__}: {e}. Offline? Pass a local JSON/JSONL file as "
        f"source='/path/to/{task}.jsonl' (with fields=... if its names differ), or "
        f"source=None for the shipped sample.") from e
  return [dict(row) for row in rows]


def _field(record: dict, canonical: str, name: str, task: str, origin: str, index: int,
           optional: bool):
  if name in record:
    return record[name]
  if optional:
    return None
  raise ValueError(
      f"{task}: field {name!r} (for {canonical}) not found in record {index} of {origin}; "
      f"fields found: {sorted(record)}. Pass fields={{{canonical!r}: '<name in the file>'}}.")


def _as_lines(value) -> str:
  if isinstance(value, (list, tuple)):
    return "\n".join(str(v) for v in value)
  return "" if value is None else str(value)


def _to_example(task: str, record: dict, fields: Mapping[str, str],
                optional: tuple[str, ...], origin: str, index: int, split: str) -> Example:
  values = {c: _field(record, c, n, task, origin, index, c in optional)
            for c, n in fields.items()}
  raw_id = values.pop("id", None)
  ex_id = f"{task}/{split}/{index}" if raw_id is None else str(raw_id)
  source_text = str(values.pop("source_text"))
  meta = {}
  if task == "gsm8k":
    solution = str(values.pop("reference"))
    # Parsed with the reward's own parser, so reference and prediction agree on format.
    reference = gsm8k.reference_answer(solution) or solution.strip()
    meta["solution"] = solution
  elif task == "mbpp":
    tests = values.pop("test_list")
    tests = [tests] if isinstance(tests, str) else list(tests)
    reference = "\n".join(tests)
    meta = {"test_list": tests, "test_setup_code": _as_lines(values.pop("test_setup_code")),
            "challenge_test_list": list(values.pop("challenge_test_list") or []),
            "solution": _as_lines(values.pop("solution"))}
  else:
    reference = _as_lines(values.pop("reference"))
    meta = {k: ("" if v is None else v) for k, v in values.items()}
  return Example(id=ex_id, task=task, source_text=source_text, reference=reference, meta=meta)


def load_examples(task: str, source: str | None = None, split: str = "test",
                  limit: int | None = None,
                  fields: Mapping[str, str] | None = None) -> list[Example]:
  """Loads `task` examples as canonical Example records.

  source: None = the shipped sample (MBPP split by task_id, see MBPP_SPLITS; 'sanitized'
    for the shipped sanitized MBPP set, split the same way); a path to a local .jsonl /
    .json file (read whole: `split` only names the ids); otherwise a Hugging Face hub name,
    optionally 'name:config'.
  fields: canonical name -> the file's name, merged over the task's defaults, e.g.
    {'source_text': 'document', 'reference': 'summary'} (canonical names: id, source_text,
    reference, and mbpp test_list / test_setup_code / solution, humaneval entry_point /
    solution).
  limit: keep the first `limit` examples (>= 1; None = all).
  Raises ValueError (unknown task or split, missing field, limit < 1, an id repeated in a
  file), FileNotFoundError (local path), RuntimeError (hub unreachable, with a hint to
  use a local file).
  """
  if task not in _LAYOUTS:
    raise ValueError(f"unknown task {task!r}; choose one of {list(TASKS)}")
  if limit is not None and limit < 1:
    # A negative limit would drop examples from the end, 0 would keep none.
    raise ValueError(f"limit={limit!r}: must be >= 1 (None = all examples)")
  layout = _LAYOUTS[task]
  mapping = dict(layout.fields)
  mbpp_range = None
  if source == "sanitized" and task == "mbpp":
    if split not in layout.shipped:  # an unknown split would keep every record
      raise ValueError(f"mbpp: split {split!r} of the sanitized set: choose one of "
                       f"{list(layout.shipped)}")
    origin = shipped_path(task, "sanitized-mbpp.json")
    records = _read_local(origin)
    mbpp_range = MBPP_SPLITS.get(split)
  elif source is None:
    if split not in layout.shipped:
      where = (f"its shipped splits are {sorted(layout.shipped)}" if layout.shipped
               else "nothing is shipped for it")
      raise ValueError(f"{task}: no shipped sample for split {split!r} ({where}); pass a hub "
                       f"name or a local file as source=")
    origin = shipped_path(task, layout.shipped[split])
    records = _read_local(origin)
    mbpp_range = MBPP_SPLITS.get(split) if task == "mbpp" else None
  elif is_local(source):
    origin = source
    records = _read_local(source)
  else:
    origin = f"hub:{source}"
    records = _read_hub(task, source, split, limit)
  if task == "mbpp" and records and "prompt" in records[0] and "text" not in records[0]:
    mapping.update(_MBPP_SANITIZED_FIELDS)
  mapping.update(fields or {})
  if mbpp_range is not None:
    low, high = mbpp_range
    records = [r for r in records if low <= int(r["task_id"]) <= high]
  if limit is not None:
    records = records[:limit]
  examples = [_to_example(task, r, mapping, layout.optional, origin, i, split)
              for i, r in enumerate(records)]
  if not origin.startswith("hub:"):  # a file: its ids are the user's to fix
    _check_unique_ids(examples, origin)
  return examples


def _check_unique_ids(examples: list[Example], origin: str) -> None:
  # Results and resumed runs are keyed by example id: a repeated one would be scored once.
  seen = set()
  for ex in examples:
    if ex.id in seen:
      raise ValueError(f"{ex.task}: example id {ex.id!r} appears more than once in {origin}; "
                       "ids key the results, so each must be unique")
    seen.add(ex.id)
