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
lam (0 without a match) comes from a gate: a logistic probe of the lookup (n, how often the
suffix occurred, whether every occurrence continued with c), the draft's own law (q(c),
max q) and the draft's hidden state, which tells quoting from composing
(`diversed_jax.distill.copy_gate` fits it). q' is a distribution that the draft samples
from and reports, so every verification rule stays as exact (or as relaxed) as with q. The
cost is a comparison of a few suffix tokens with the history and one dot product per
drafted token: small next to a draft layer.

Shape legend: B batch, T tokens per call, S cache slots (the history's length), V vocabulary,
D the draft's hidden width, F gate features.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import flax.struct
import jax
import jax.numpy as jnp


class Lookup(NamedTuple):
  token_bt: jax.Array  # c, the copy token (0 without a match)
  length_bt: jax.Array  # n, the matched suffix's length (0: no match)
  count_bt: jax.Array  # earlier occurrences of the matched suffix
  agree_bt: jax.Array  # whether every one of them was followed by c


def suffix_lookup(history_bs, positions_bt, max_ngram: int) -> Lookup:
  """For each query position t: the token after the most recent occurrence ending at j < t
  of the longest suffix history[t-n+1 .. t] (1 <= n <= max_ngram), with n, the number of
  such occurrences and whether all were followed by that token. Only slots before t are
  read (slots past it may be stale)."""
  s = history_bs.shape[1]
  slots = jnp.arange(s)
  # run_bts[j] = how many of the suffix's last tokens (up to max_ngram) end at slot j too;
  # only slots whose continuation j + 1 is known (j < t) are candidates.
  match_bts = slots < positions_bt[:, :, None]
  run_bts = jnp.zeros(match_bts.shape, jnp.int32)
  for k in range(max_ngram):
    # The suffix's k-th token from the end, against history[j - k] for every candidate j.
    suffix_bt = jnp.take_along_axis(history_bs, jnp.maximum(positions_bt - k, 0), axis=1)
    shifted_bs = jnp.roll(history_bs, k, axis=1)
    match_bts &= (shifted_bs[:, None, :] == suffix_bt[:, :, None]) & (slots >= k)
    match_bts &= (positions_bt >= k)[:, :, None]
    run_bts += match_bts
  # The reductions run once, on the longest run: its latest slot gives the copy token.
  length_bt = jnp.max(run_bts, axis=-1)
  longest_bts = (run_bts == length_bt[:, :, None]) & (length_bt > 0)[:, :, None]
  latest_bt = jnp.max(jnp.where(longest_bts, slots, -1), axis=-1)
  token_bt = jnp.take_along_axis(history_bs, jnp.clip(latest_bt + 1, 0, s - 1), axis=1)
  token_bt = jnp.where(length_bt > 0, token_bt, 0)
  after_bs = jnp.roll(history_bs, -1, axis=1)  # the token after slot j (read for j < t only)
  agree_bt = jnp.all(~longest_bts | (after_bs[:, None, :] == token_bt[:, :, None]), axis=-1)
  return Lookup(token_bt, length_bt, jnp.sum(longest_bts, axis=-1, dtype=jnp.int32),
                agree_bt & (length_bt > 0))


_LOG_FLOOR = math.log(1e-6)  # log-probabilities below this read as this
# Per position: one-hot n (max_ngram of them), then these, then the hidden state (D).
SCALAR_FEATURES = ("log_q_copy", "log_q_max", "copy_is_argmax", "all_agree", "log_count",
                   "proposing")
_HIDDEN_SCALE = 4.0  # the unit-norm hidden state's scale among the O(1) scalar features


def gate_features(lookup: Lookup, log_q_btv, hidden_btd, proposing: bool, max_ngram: int):
  """[B, T, F] features of the gate; `proposing`: the draft is extending its own proposals
  (drafting step 2 on), where it reads its own features rather than the target's."""
  log_q_copy = _at(log_q_btv, lookup.token_bt)
  log_q_max = jnp.max(log_q_btv, axis=-1)
  scalars = [jnp.maximum(log_q_copy, _LOG_FLOOR) / 10, jnp.maximum(log_q_max, _LOG_FLOOR) / 5,
             (log_q_copy >= log_q_max).astype(jnp.float32),
             lookup.agree_bt.astype(jnp.float32), jnp.log1p(lookup.count_bt) / 3,
             jnp.full(log_q_copy.shape, float(proposing))]
  one_hot = lookup.length_bt[..., None] == jnp.arange(1, max_ngram + 1)
  hidden = hidden_btd.astype(jnp.float32)
  hidden = hidden * _HIDDEN_SCALE / (jnp.linalg.norm(hidden, axis=-1, keepdims=True) + 1e-6)
  return jnp.concatenate([one_hot.astype(jnp.float32), jnp.stack(scalars, axis=-1), hidden],
                         axis=-1)


@dataclasses.dataclass(frozen=True)
class CopyGate:
  """lam = max_lam * sigmoid(weights . features + bias) where the lookup matched, else 0
  (features: `gate_features`). Tuples, so that a draft holding it stays hashable."""
  max_ngram: int
  weights: tuple[float, ...]
  bias: float
  max_lam: float = 0.95

  def __post_init__(self):
    if self.max_ngram < 1:
      raise ValueError(f"copy gate max_ngram must be >= 1, got {self.max_ngram}")
    if not 0.0 < self.max_lam < 1.0:
      raise ValueError(f"copy gate max_lam must be in (0, 1), got {self.max_lam}")
    if self.hidden_size < 1:
      raise ValueError(f"copy gate has {len(self.weights)} weights; max_ngram "
                       f"{self.max_ngram} needs {self.max_ngram + len(SCALAR_FEATURES)} "
                       "plus one per hidden unit")
    if not all(math.isfinite(x) for x in (*self.weights, self.bias)):
      raise ValueError("copy gate weights and bias must be finite")

  @classmethod
  def by_length(cls, lams: tuple[float, ...], hidden_size: int,
                max_lam: float = 0.95) -> "CopyGate":
    """A hand-set gate: lam = lams[n - 1] for a match of length n, whatever else holds
    (for ablations and tests; 0 < lam < max_lam)."""
    if not all(0.0 < lam < max_lam for lam in lams):
      raise ValueError(f"by_length lams {lams} must lie in (0, max_lam={max_lam})")
    logits = tuple(math.log(lam / (max_lam - lam)) for lam in lams)
    zeros = (0.0,) * (len(SCALAR_FEATURES) + hidden_size)
    return cls(len(lams), logits + zeros, 0.0, max_lam)

  @property
  def hidden_size(self) -> int:
    """The width of the draft hidden state the gate reads."""
    return len(self.weights) - self.max_ngram - len(SCALAR_FEATURES)

  def to_json(self) -> dict:
    return {"max_ngram": self.max_ngram, "max_lam": self.max_lam, "bias": self.bias,
            "features": ["n=%d" % n for n in range(1, self.max_ngram + 1)]
            + list(SCALAR_FEATURES) + [f"hidden[{self.hidden_size}]"],
            "weights": list(self.weights)}

  @classmethod
  def from_json(cls, data: dict) -> "CopyGate":
    return cls(int(data["max_ngram"]), tuple(float(x) for x in data["weights"]),
               float(data["bias"]), float(data["max_lam"]))

  def weight(self, features_btf, length_bt):
    if features_btf.shape[-1] != len(self.weights):
      raise ValueError(f"copy gate reads {len(self.weights)} features (a hidden state of "
                       f"{self.hidden_size}); the draft gives {features_btf.shape[-1]}")
    lam = self.max_lam * jax.nn.sigmoid(features_btf @ jnp.asarray(self.weights, jnp.float32)
                                        + self.bias)
    return jnp.where(length_bt > 0, lam, 0.0)


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


def copy_logits(gate: CopyGate, logits_btv, hidden_btd, history_bs, positions_bt,
                proposing: bool):
  """The blended logits at `positions_bt` (the positions of the tokens just fed), from the
  draft's logits and hidden states there."""
  lookup = suffix_lookup(history_bs, positions_bt, gate.max_ngram)
  log_q = _log_q(logits_btv)  # one pass over the vocabulary for the features and the blend
  features = gate_features(lookup, log_q, hidden_btd, proposing, gate.max_ngram)
  return _mix(logits_btv, log_q, lookup.token_bt, gate.weight(features, lookup.length_bt))


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

  def forward(self, params, tokens_bt, cache: CopyCache, target_hidden_btd=None,
              last_only=False):
    s = cache.history_bs.shape[1]
    positions_bt = cache.lengths_b[:, None] + jnp.arange(tokens_bt.shape[1])
    rows_b1 = jnp.arange(tokens_bt.shape[0])[:, None]
    # Writes past the last slot are dropped (as the KV cache's are).
    history = cache.history_bs.at[rows_b1, positions_bt].set(tokens_bt, mode="drop")
    logits, hidden, inner = self.inner.forward(params, tokens_bt, cache.inner,
                                               target_hidden_btd, last_only=last_only)
    at = slice(-1, None) if last_only else slice(None)
    logits = copy_logits(self.gate, logits, hidden[:, at], history,
                         jnp.minimum(positions_bt[:, at], s - 1),
                         proposing=target_hidden_btd is None)
    return logits, hidden, CopyCache(inner, history)
