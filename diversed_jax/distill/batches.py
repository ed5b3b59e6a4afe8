"""Training windows drawn from distillation shards.

`ShardPool` holds the sequences of the training shards in use, in sorted-path order, so
the pool is a function of the set of shards in use (not of when each was loaded), and the
checkpoint's count n of shards plus the trainer's record of which paths they were
(`Trainer`, shards_in_use.txt) give a resumed run exactly the same windows: those of step
s depend only on (seed, s, n), never on earlier draws. Sequences whose prompt is a
held-out shard's are never in the pool, whichever folder or shard index they come from.
The held-out shards are read at each `use`: one written after training started counts
from the next rescan in a live run but from the start in a resumed one, so only then can
the two draw different windows (the data job writes shards in index order, and the
default held-out ones, `train.eval_shards`, are 0 and 1).

Shape legend: B windows, W window length, K top-k, D target width, V vocabulary.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np

from diversed_jax.distill import continuations, data


@dataclasses.dataclass
class Sequence:
  tokens: np.ndarray  # [L] int32
  prompt_length: int
  hidden: np.ndarray  # [L, D] float16
  topk_ids: np.ndarray  # [L, K]
  topk_logp: np.ndarray  # [L, K] float16
  source: str


def load_sequences(path: str) -> list[Sequence]:
  with np.load(path) as z:
    arrays = {k: z[k] for k in z.files}
  out = []
  for i, n in enumerate(arrays["lengths"]):
    out.append(Sequence(tokens=arrays["tokens"][i, :n],
                        prompt_length=int(arrays["prompt_lengths"][i]),
                        hidden=arrays["hidden"][i, :n], topk_ids=arrays["topk_ids"][i, :n],
                        topk_logp=arrays["topk_logp"][i, :n], source=""))
  return out


def prompt_digest(tokens, prompt_length: int) -> str:
  """The digest of one sequence's prompt ids (`continuations.prompt_digest` of it alone)."""
  return continuations.prompt_digest([tokens[:prompt_length]])


def shard_prompt_digests(path: str) -> set[str]:
  """The prompt digests of a shard's sequences (reads its small arrays only)."""
  with np.load(path) as z:
    tokens, prompt_lengths = z["tokens"], z["prompt_lengths"]
  return {prompt_digest(row, int(n)) for row, n in zip(tokens, prompt_lengths)}


class ShardPool:
  """The training shards of a folder and its extra folders, loaded lazily.

  Held-out shards (indices of `folder`) are never loaded for training, and neither is any
  sequence whose prompt is a held-out one: another data plan (another seed, pattern or
  folder) shuffles the same prompts into other shard indices.
  """

  def __init__(self, folder: str, held_out: tuple[int, ...], extra_folders=()):
    self.folder = folder
    self.extra_folders = tuple(extra_folders)
    self.held_out = set(held_out)
    self.sequences: list[Sequence] = []
    self.num_shards = 0
    self.num_dropped = 0  # training sequences left out for a held-out prompt
    self.in_use: list[str] = []  # paths in the order they entered the pool
    self._paths: list[str] = []
    self._by_path: dict[str, list[tuple[Sequence, str]]] = {}  # with prompt digests
    self._held_out_digests: dict[str, set[str]] = {}

  def available(self) -> int:
    """How many training shards exist on disk now."""
    # Absolute: the paths in use are recorded, and a resumed run may start elsewhere.
    paths = [p for p in data.list_shards(os.path.abspath(self.folder))
             if int(p[-9:-4]) not in self.held_out]
    for folder in self.extra_folders:  # every shard of an extra folder is for training
      paths += data.list_shards(os.path.abspath(folder))
    # Interleave the folders by shard index so that a growing folder keeps earlier order.
    self._paths = sorted(paths, key=_path_order)
    return len(self._paths)

  def use(self, num_shards: int, first=()) -> None:
    """Loads training shards until `num_shards` are in use: the paths in `first` (those a
    checkpoint was trained on), then others in listing order."""
    if num_shards > len(self._paths):
      self.available()
    if num_shards > len(self._paths):
      raise ValueError(f"need {num_shards} training shards in {self.folder}, "
                       f"found {len(self._paths)}")
    missing = [p for p in first if not os.path.exists(p)]
    if missing:
      raise ValueError(f"training shards in use at the checkpoint are gone: {missing}")
    for path in [*first, *self._paths]:
      if len(self.in_use) >= num_shards:
        break
      if path not in self._by_path:
        self._by_path[path] = [(s, prompt_digest(s.tokens, s.prompt_length))
                               for s in load_sequences(path)]
        self.in_use.append(path)
    self.num_shards = len(self.in_use)
    self._rebuild()

  def _rebuild(self) -> None:
    """`sequences`: those of the shards in use in sorted-path order, held-out prompts out."""
    held_out = self._read_held_out_digests()
    self.sequences, self.num_dropped = [], 0
    for path in sorted(self.in_use, key=_path_order):
      for s, digest in self._by_path[path]:
        if digest in held_out:
          self.num_dropped += 1
        else:
          self.sequences.append(s)

  def _read_held_out_digests(self) -> set[str]:
    """Prompt digests of the held-out shards on disk now (one written late counts from the
    next `use`)."""
    for index in sorted(self.held_out):
      path = data.shard_path(self.folder, index)
      if path not in self._held_out_digests and os.path.exists(path):
        self._held_out_digests[path] = shard_prompt_digests(path)
    return set().union(*self._held_out_digests.values())


def _path_order(path: str):
  """Shard index first, then the path: folders interleave and keep their order as they grow."""
  return int(path[-9:-4]), path


def position_weights(s: Sequence, prompt_weight: float) -> np.ndarray:
  """[L] weight of each position's next-token prediction: prompt_weight while the next token
  is still in the prompt, 1 once it is generated."""
  return np.where(np.arange(len(s.tokens)) + 1 < s.prompt_length, prompt_weight, 1.0)


def window_batch(sequences: list[Sequence], rng: np.random.Generator, batch: int, window: int,
                 kept_index_v: np.ndarray, prompt_weight: float) -> dict:
  """A batch of windows.

  Returns numpy arrays: tokens_bw, features_bwd (f_{t-1}, zeros before the sequence start),
  target_features_bwd (f_t), topk_kept_bwk (kept-vocabulary index or -1), topk_logp_bwk,
  weight_bw (0 where there is no next token, prompt_weight inside the prompt, else 1),
  generated_bw (1 where the next token is a generated one, else 0: the positions the draft
  proposes at, whatever prompt_weight).
  """
  d = sequences[0].hidden.shape[-1]
  k = sequences[0].topk_ids.shape[-1]
  out = {
      "tokens_bw": np.zeros((batch, window), np.int32),
      "features_bwd": np.zeros((batch, window, d), np.float32),
      "target_features_bwd": np.zeros((batch, window, d), np.float32),
      "topk_kept_bwk": np.full((batch, window, k), -1, np.int32),
      "topk_logp_bwk": np.zeros((batch, window, k), np.float32),
      "weight_bw": np.zeros((batch, window), np.float32),
      "generated_bw": np.zeros((batch, window), np.float32),
  }
  lengths = np.asarray([len(s.tokens) for s in sequences], np.float64)
  picks = rng.choice(len(sequences), size=batch, p=lengths / lengths.sum())
  for row, i in enumerate(picks):
    s = sequences[i]
    n = len(s.tokens)
    hi = max(0, n - window)
    lo = min(max(0, s.prompt_length - window // 4), hi)
    start = int(rng.integers(lo, hi + 1))
    stop = min(n, start + window)
    m = stop - start
    out["tokens_bw"][row, :m] = s.tokens[start:stop]
    out["target_features_bwd"][row, :m] = s.hidden[start:stop]
    prev = s.hidden[max(start - 1, 0):stop - 1]
    out["features_bwd"][row, m - len(prev):m] = prev
    out["topk_kept_bwk"][row, :m] = kept_index_v[s.topk_ids[start:stop].astype(np.int64)]
    out["topk_logp_bwk"][row, :m] = s.topk_logp[start:stop]
    next_position = np.arange(start, stop) + 1
    w = position_weights(s, prompt_weight)[start:stop]
    w[next_position >= n] = 0.0
    out["weight_bw"][row, :m] = w
    out["generated_bw"][row, :m] = (next_position >= s.prompt_length) & (next_position < n)
  return out


def choose_vocab(sequences: list[Sequence], keep: int, vocab_size: int, prompt_weight: float = 1.0,
                 always=(0, 1, 2), candidates=None) -> tuple[np.ndarray, float]:
  """The `keep` ids with the largest total target probability mass over the data (plus the
  special ids in `always`), drawn from `candidates` when given; returns (sorted ids, fraction
  of the top-k mass they cover).

  Positions that predict a prompt token count `prompt_weight` times, as in the loss: the draft
  proposes after the prompt, and a CNN/DM article's vocabulary is not its summary's.
  """
  mass = np.zeros(vocab_size, np.float64)
  for s in sequences:
    probs = np.exp(s.topk_logp.astype(np.float64)) * position_weights(s, prompt_weight)[:, None]
    np.add.at(mass, s.topk_ids.astype(np.int64).ravel(), probs.ravel())
  ranked = np.argsort(-mass)
  if candidates is not None:
    ranked = ranked[np.isin(ranked, candidates)]
  chosen = set(int(i) for i in always if i < vocab_size)
  for i in ranked:
    if len(chosen) >= keep:
      break
    chosen.add(int(i))
  ids = np.asarray(sorted(chosen), np.int32)
  return ids, float(mass[ids].sum() / max(mass.sum(), 1e-12))


def kept_index(vocab_ids: np.ndarray, vocab_size: int) -> np.ndarray:
  """[V] int32: the kept-vocabulary index of each id, -1 when not kept."""
  index = np.full(vocab_size, -1, np.int32)
  index[np.asarray(vocab_ids)] = np.arange(len(vocab_ids), dtype=np.int32)
  return index
