"""Config files outside absl: what `--config=configs/NAME.py:VARIANT --config.a.b=v` does,
for notebooks and tests."""

from __future__ import annotations

import importlib.util
import os
import sys
from typing import Mapping

import ml_collections


def load_config(spec: str, overrides: Mapping[str, object] | None = None,
                lock: bool = True) -> ml_collections.ConfigDict:
  """Loads 'path/to/configs/NAME.py[:VARIANT]' and applies {'decode.temperature': 0.1, ...}.

  The folder above the config file goes on sys.path first, so `from configs import default`
  inside a config file works from any working directory.
  """
  path, _, variant = spec.partition(":")
  path = os.path.abspath(path)
  if not os.path.isfile(path):
    raise FileNotFoundError(f"no config file {path}")
  root = os.path.dirname(os.path.dirname(path))
  if root not in sys.path:
    sys.path.insert(0, root)
  module_spec = importlib.util.spec_from_file_location(
      "_config_" + os.path.splitext(os.path.basename(path))[0], path)
  module = importlib.util.module_from_spec(module_spec)
  module_spec.loader.exec_module(module)
  config = module.get_config(variant) if variant else module.get_config()
  if lock:
    config.lock()
  for key, value in (overrides or {}).items():
    node = config
    *parents, leaf = key.split(".")
    for part in parents:
      node = node[part]
    if leaf not in node:
      raise KeyError(f"{key}: no such config field")
    node[leaf] = value
  return config
