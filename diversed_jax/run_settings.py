"""What a training run trains under, compared when it resumes.

Head training keeps its settings in each checkpoint's metadata and distillation in
`<workdir>/settings.json`; a resume under other settings is refused rather than mixing two
runs in one model. Settings are nested dicts of JSON values; they are compared by dotted
name (`train.lr`).
"""

from __future__ import annotations

import json


def as_json(settings: dict) -> dict:
  """`settings` as they read back from JSON (tuples become lists), ready to compare."""
  return json.loads(json.dumps(settings))


def flatten(settings: dict, prefix: str = "") -> dict:
  """{'train.lr': 1e-3, ...}: nested dicts by dotted name; other values as they are."""
  flat = {}
  for name, value in settings.items():
    if isinstance(value, dict):
      flat.update(flatten(value, f"{prefix}{name}."))
    else:
      flat[f"{prefix}{name}"] = value
  return flat


def changes(saved: dict, current: dict) -> list[str]:
  """'name=saved (now current)' for each setting both record and disagree on, sorted by
  name (a setting added after `saved` was written is not compared)."""
  saved, current = flatten(saved), flatten(current)
  return [f"{name}={saved[name]!r} (now {current[name]!r})"
          for name in sorted(saved.keys() & current.keys()) if saved[name] != current[name]]
