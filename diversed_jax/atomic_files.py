"""Files written whole or not at all.

A kill in the middle of a write must leave the old file (or none), never a torn one that
the next start then fails to read: every writer here writes a temporary sibling and renames
it over the target (`os.replace` is atomic within one file system).
"""

import contextlib
import json
import os
import shutil
from typing import Iterator

import numpy as np


def temporary_path(path: str) -> str:
  """The sibling a write of `path` goes to first. It keeps `path`'s extension, which some
  writers (np.savez) would otherwise append."""
  root, extension = os.path.splitext(path)
  return f"{root}.tmp{extension}"


@contextlib.contextmanager
def replacing(path: str) -> Iterator[str]:
  """Yields the temporary path to write; moves it over `path` when the block ends, and
  removes it instead when the block raises."""
  tmp = temporary_path(path)
  try:
    yield tmp
  except BaseException:
    with contextlib.suppress(FileNotFoundError):
      os.remove(tmp)
    raise
  os.replace(tmp, path)


def write_text(path: str, text: str) -> None:
  with replacing(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
    f.write(text)


def write_lines(path: str, lines) -> None:
  """Writes `lines`, each ended by one newline."""
  write_text(path, "".join(line if line.endswith("\n") else line + "\n" for line in lines))


def write_json(path: str, obj, **dump_options) -> None:
  """json.dump of `obj` into `path` (dump_options as json.dump's: indent, sort_keys...)."""
  write_text(path, json.dumps(obj, **dump_options))


def save_npz(path: str, arrays: dict, compressed: bool = False) -> None:
  if not path.endswith(".npz"):  # np.savez would write `path` + ".npz"
    raise ValueError(f"an .npz path is needed, got {path!r}")
  save = np.savez_compressed if compressed else np.savez
  with replacing(path) as tmp:
    save(tmp, **arrays)


def copy_file(src: str, dest: str) -> None:
  with replacing(dest) as tmp:
    shutil.copyfile(src, tmp)
