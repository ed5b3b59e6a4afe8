"""Context copying for any draft: prompt lookup blended into the draft's law.

Summaries quote their article and worked answers repeat their question's numbers, so the
token that followed the latest earlier occurrence of the current suffix is often the
target's next token, and a small draft often misses it (on CNN/DM-test the shipped draft's
greedy guess agreed with the target's 0.36 of the time, and the lookup was right where the
draft was wrong another 0.29 of the time). `ContextCopyDraft` wraps a draft and proposes
from

  q'(x) = (1 - lam) q(x) + lam [x == c]

where c is the token after the most recent earlier occurrence, in the prompt and the
tokens so far, of the longest suffix of n <= max_ngram tokens that occurred before, and
lam = gate[n][bin(q(c))] (0 without a match) is fitted per match length and per the
draft's own probability of c (`diversed_jax.distill.copy_gate`). q' is a distribution
that the draft samples from and reports, so every verification rule stays as exact (or as
relaxed) as with q. The cost is a comparison of a few suffix tokens with the history:
negligible next to a draft layer.

Shape legend: B batch, T tokens per call, S cache slots (the history's length), V vocabulary.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp


def suffix_lookup(history_bs, positions_bt, max_ngram: int):
  """For each query position t: (c, n), the token after the most recent occurrence ending
  at j < t of the longest suffix history[t-n+1 .. t] (1 <= n <= max_ngram), or (0, 0)
  without one. Only slots before t are read (slots past it may be stale)."""
  b, s = history_bs.shape
  slots = jnp.arange(s)
  token_bt = jnp.zeros(positions_bt.shape, jnp.int32)
  length_bt = jnp.zeros(positions_bt.shape, jnp.int32)
  match_bts = slots < positions_bt[:, :, None]  # the continuation j + 1 is known
  for k in range(max_ngram):
    # The suffix's k-th token from the end, against history[j - k] for every candidate j.
    suffix_bt = jnp.take_along_axis(history_bs, jnp.maximum(positions_bt - k, 0), axis=1)
    shifted_bs = jnp.roll(history_bs, k, axis=1)
    match_bts &= (shifted_bs[:, None, :] == suffix_bt[:, :, None]) & (slots >= k)
    match_bts &= (positions_bt >= k)[:, :, None]
    found_bt = jnp.any(match_bts, axis=-1)
    latest_bt = jnp.max(jnp.where(match_bts, slots, -1), axis=-1)
    next_bt = jnp.take_along_axis(history_bs, jnp.clip(latest_bt + 1, 0, s - 1), axis=1)
    # Longer suffixes match a subset of the shorter ones' slots: the last found wins.
    token_bt = jnp.where(found_bt, next_bt, token_bt)
    length_bt = jnp.where(found_bt, k + 1, length_bt)
  return token_bt, length_bt


@dataclasses.dataclass(frozen=True)
class CopyGate:
  """lam = lambdas[n][bin], bin = number of `q_edges` at or below q(c); n = 0 means no
  match (its row must be zeros). Tuples, so that a draft holding it stays hashable."""
  q_edges: tuple[float, ...]
  lambdas: tuple[tuple[float, ...], ...]

  def __post_init__(self):
    rows = len(self.lambdas)
    if rows < 2:
      raise ValueError(f"copy gate needs rows for n = 0..max_ngram (max_ngram >= 1), got {rows}")
    for n, row in enumerate(self.lambdas):
      if len(row) != len(self.q_edges) + 1:
        raise ValueError(f"copy gate row n={n} has {len(row)} entries; q_edges "
                         f"{self.q_edges} need {len(self.q_edges) + 1}")
      if any(not 0.0 <= lam < 1.0 for lam in row):
        raise ValueError(f"copy gate row n={n} = {row}: every lam must be in [0, 1)")
    if any(self.lambdas[0]):
      raise ValueError(f"copy gate row n=0 (no match) must be zeros, got {self.lambdas[0]}")
    if list(self.q_edges) != sorted(self.q_edges):
      raise ValueError(f"copy gate q_edges must be increasing, got {self.q_edges}")

  @property
  def max_ngram(self) -> int:
    return len(self.lambdas) - 1

  def to_json(self) -> dict:
    return {"q_edges": list(self.q_edges), "lambdas": [list(r) for r in self.lambdas]}

  @classmethod
  def from_json(cls, data: dict) -> "CopyGate":
    return cls(tuple(float(e) for e in data["q_edges"]),
               tuple(tuple(float(x) for x in row) for row in data["lambdas"]))

  def weight(self, length_bt, q_copy_bt):
    table = jnp.asarray(self.lambdas, jnp.float32)
    bins = jnp.searchsorted(jnp.asarray(self.q_edges, jnp.float32), q_copy_bt, side="right")
    return table[length_bt, bins]


def _log_q(logits_btv):
  return jax.nn.log_softmax(logits_btv.astype(jnp.float32), axis=-1)


def _at(values_btv, token_bt):
  return jnp.take_along_axis(values_btv, token_bt[..., None], axis=-1)[..., 0]


def _mix(logits_btv, log_q_btv, token_bt, lam_bt):
  at_copy = jnp.log((1 - lam_bt) * jnp.exp(_at(log_q_btv, token_bt)) + lam_bt)
  mixed = jnp.log1p(-lam_bt)[..., None] + log_q_btv
  is_copy = jnp.arange(log_q_btv.shape[-1]) == token_bt[..., None]
  mixed = jnp.where(is_copy, at_copy[..., None], mixed)
  return jnp.where((lam_bt > 0)[..., None], mixed, logits_btv.astype(jnp.float32))


def blend(logits_btv, token_bt, lam_bt):
  """log q' for q = softmax(logits): (1 - lam) q + lam at `token_bt` (exact where lam = 0)."""
  return _mix(logits_btv, _log_q(logits_btv), token_bt, lam_bt)


def copy_logits(gate: CopyGate, logits_btv, history_bs, positions_bt):
  """The blended logits at `positions_bt` (the positions of the tokens just fed)."""
  token_bt, length_bt = suffix_lookup(history_bs, positions_bt, gate.max_ngram)
  log_q = _log_q(logits_btv)  # one pass over the vocabulary for q(c) and the blend
  lam_bt = gate.weight(length_bt, jnp.exp(_at(log_q, token_bt)))
  return _mix(logits_btv, log_q, token_bt, lam_bt)


@flax.struct.dataclass
class CopyCache:
  """The wrapped draft's cache plus the tokens fed so far (slot t holds token t)."""
  inner: Any
  history_bs: jax.Array

  @property
  def lengths_b(self):
    return self.inner.lengths_b

  def with_lengths(self, lengths_b) -> "CopyCache":
    return self.replace(inner=self.inner.with_lengths(lengths_b))

  def set_row(self, row, row_cache: "CopyCache") -> "CopyCache":
    return CopyCache(self.inner.set_row(row, row_cache.inner),
                     self.history_bs.at[row].set(row_cache.history_bs[0]))

  def take_rows(self, rows_w) -> "CopyCache":
    return CopyCache(self.inner.take_rows(rows_w), jnp.take(self.history_bs, rows_w, axis=0))


@dataclasses.dataclass(frozen=True)
class ContextCopyDraft:
  """`inner` (any draft, see drafts.py) with context copying blended into its law; the
  same params, hidden states and cache (wrapped) as `inner`."""
  inner: Any
  gate: CopyGate

  def init_cache(self, params, batch: int, max_len: int) -> CopyCache:
    return CopyCache(self.inner.init_cache(params, batch, max_len),
                     jnp.zeros((batch, max_len), jnp.int32))

  def inference_params(self, params):
    inner = getattr(self.inner, "inference_params", None)
    return params if inner is None else inner(params)

  def forward(self, params, tokens_bt, cache: CopyCache, target_hidden_btd=None):
    s = cache.history_bs.shape[1]
    positions_bt = cache.lengths_b[:, None] + jnp.arange(tokens_bt.shape[1])
    rows_b1 = jnp.arange(tokens_bt.shape[0])[:, None]
    # Writes past the last slot are dropped (as the KV cache's are).
    history = cache.history_bs.at[rows_b1, positions_bt].set(tokens_bt, mode="drop")
    logits, hidden, inner = self.inner.forward(params, tokens_bt, cache.inner,
                                               target_hidden_btd)
    logits = copy_logits(self.gate, logits, history, jnp.minimum(positions_bt, s - 1))
    return logits, hidden, CopyCache(inner, history)
