"""Target-generated continuations kept as token ids, so each one is generated only once.

Generating a continuation costs the target as much as the teacher-forced pass that turns
it into a shard, but the shard (hidden states and top-k log-probs at every position) is
~1,000x larger than the ids: shards live in git-ignored `runs/` and have been lost between
sessions, while the ids of a few hundred shards fit in the repository. `data.generate`
writes `cont_NNNNN.npz` next to (or instead of) shard NNNNN and rebuilds a missing shard
from it by teacher forcing alone.

A file holds one shard's continuations concatenated (`ids`, with `offsets` [N + 1]), the
sampling temperature and a digest of the prompt ids they continue: the prompts are not
stored (they follow from the data plan), so a changed plan, tokenizer or template is caught
instead of pairing continuations with the wrong prompts.
"""

from __future__ import annotations

import glob
import hashlib
import os
from typing import Sequence

import numpy as np

from diversed_jax import atomic_files


def path(folder: str, index: int) -> str:
  return os.path.join(folder, f"cont_{index:05d}.npz")


def prompt_digest(prompts: Sequence[Sequence[int]]) -> str:
  """A digest of token-id lists (their order and boundaries included)."""
  h = hashlib.sha256()
  for prompt in prompts:
    h.update(np.asarray(prompt, np.int64).tobytes())
    h.update(b"|")
  return h.hexdigest()


def save(folder: str, index: int, prompts, continuations, temperature: float) -> None:
  """Writes one shard's continuations atomically."""
  if len(prompts) != len(continuations):
    raise ValueError(f"{len(prompts)} prompts but {len(continuations)} continuations")
  os.makedirs(folder, exist_ok=True)
  flat = [t for c in continuations for t in c]
  dtype = np.uint16 if max(flat, default=0) < 65536 else np.int32
  atomic_files.save_npz(path(folder, index), dict(
      ids=np.asarray(flat, dtype),
      offsets=np.cumsum([0] + [len(c) for c in continuations]).astype(np.int64),
      temperature=np.float32(temperature), prompt_digest=np.asarray(prompt_digest(prompts))),
      compressed=True)


def load(folder: str, index: int, prompts, temperature: float) -> list[list[int]]:
  """The continuations of shard `index` for `prompts`.

  Raises:
    ValueError: the file was written for other prompts or another temperature.
  """
  file = path(folder, index)
  with np.load(file) as f:
    if str(f["prompt_digest"]) != prompt_digest(prompts):
      raise ValueError(
          f"{file} continues other prompts than shard {index} of this data plan (changed "
          "data files, seed, batch, pattern, tokenizer or prompt template?): use another "
          "data.continuations_dir or the plan it was written with")
    if not np.isclose(float(f["temperature"]), temperature):
      raise ValueError(f"{file} was sampled at temperature {float(f['temperature'])}, "
                       f"the plan asks for {temperature}")
    ids, offsets = f["ids"].astype(np.int64), f["offsets"]
  return [ids[a:b].tolist() for a, b in zip(offsets[:-1], offsets[1:])]


def from_shard(arrays) -> tuple[list[list[int]], list[list[int]]]:
  """(prompts, continuations) of a teacher-forced shard's records."""
  prompts, conts = [], []
  for row, n, p in zip(arrays["tokens"], arrays["lengths"], arrays["prompt_lengths"]):
    prompts.append(row[:p].tolist())
    conts.append(row[p:n].tolist())
  return prompts, conts


def count(folder: str) -> int:
  """Complete continuation files in `folder` (temporary ones excluded)."""
  return len(glob.glob(os.path.join(folder, "cont_[0-9][0-9][0-9][0-9][0-9].npz")))
