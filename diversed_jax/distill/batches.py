"""Training windows drawn from distillation shards.

`ShardPool` holds the sequences of the first n training shards (n is part of the
checkpointed state, so a resumed run draws exactly the same windows); the windows of step s
depend only on (seed, s, n), never on earlier draws.

Shape legend: B windows, W window length, K top-k, D target width, V vocabulary.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from diversed_jax.distill import data


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


class ShardPool:
  """The training shards of a folder (held-out indices excluded), loaded lazily."""

  def __init__(self, folder: str, held_out: tuple[int, ...], extra_folders=()):
    self.folder = folder
    self.extra_folders = tuple(extra_folders)
    self.held_out = set(held_out)
    self.sequences: list[Sequence] = []
    self.num_shards = 0
    self._paths: list[str] = []
    self._loaded: set[str] = set()

  def available(self) -> int:
    """How many training shards exist on disk now."""
    paths = [p for p in data.list_shards(self.folder) if int(p[-9:-4]) not in self.held_out]
    for folder in self.extra_folders:  # every shard of an extra folder is for training
      paths += data.list_shards(folder)
    # Interleave the folders by shard index so that a growing folder keeps earlier order.
    self._paths = sorted(paths, key=lambda p: (int(p[-9:-4]), p))
    return len(self._paths)

  def use(self, num_shards: int) -> None:
    """Loads training shards (in listing order) until `num_shards` are in use. Windows are
    reproducible for a fixed set of shard files; shards appearing while a run is stopped can
    change which n files a resumed run uses."""
    if num_shards > len(self._paths):
      self.available()
    if num_shards > len(self._paths):
      raise ValueError(f"need {num_shards} training shards in {self.folder}, "
                       f"found {len(self._paths)}")
    for path in self._paths:
      if self.num_shards >= num_shards:
        break
      if path not in self._loaded:
        self.sequences.extend(load_sequences(path))
        self._loaded.add(path)
        self.num_shards += 1


def position_weights(s: Sequence, prompt_weight: float) -> np.ndarray:
  """[L] weight of each position's next-token prediction: prompt_weight while the next token
  is still in the prompt, 1 once it is generated."""
  return np.where(np.arange(len(s.tokens)) + 1 < s.prompt_length, prompt_weight, 1.0)


def window_batch(sequences: list[Sequence], rng: np.random.Generator, batch: int, window: int,
                 kept_index_v: np.ndarray, prompt_weight: float) -> dict:
  """A batch of windows.

  Returns numpy arrays: tokens_bw, features_bwd (f_{t-1}, zeros before the sequence start),
  target_features_bwd (f_t), topk_kept_bwk (kept-vocabulary index or -1), topk_logp_bwk,
  weight_bw (0 where there is no next token, prompt_weight inside the prompt, else 1).
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
    w = position_weights(s, prompt_weight)[start:stop]
    w[np.arange(start, stop) + 1 >= n] = 0.0
    out["weight_bw"][row, :m] = w
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
