"""Distributions over the vocabulary: temperature/top-p scaling, TV, residuals, sampling.

Shape legend: B rows, K drafted tokens per round, V vocabulary; `...` any leading axes.
Every function works on the last axis (V) and broadcasts over the leading ones; all are
float32 and jittable (temperature and top_p are static Python floats in the loop, but a traced
temperature also works).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


# Vocabulary-wide reductions run in blocks of this many tokens: XLA:CPU vectorises a plain
# max or sum over a block but not the (value, index) reduction of argmax, and float32
# running sums over a block stay accurate (see `sample_categorical`).
_BLOCK = 256


def _blocked(x_v: jax.Array, fill) -> jax.Array:
  """x [..., V] padded with `fill` to whole blocks: [..., V / _BLOCK, _BLOCK]."""
  *lead, v = x_v.shape
  blocks = -(-v // _BLOCK)
  padded = jnp.pad(x_v, [(0, 0)] * len(lead) + [(0, blocks * _BLOCK - v)], constant_values=fill)
  return padded.reshape(*lead, blocks, _BLOCK)


def argmax(x_v: jax.Array) -> jax.Array:
  """jnp.argmax(x, axis=-1) as int32 for float x without NaN (the first maximal index).

  The block holding the first maximum, then the index within it: 7x faster than
  jnp.argmax over a 49k vocabulary on CPU (0.4 vs 2.9 ms for 8 x 4 rows), where
  greedy decoding pays it for every drafted and verified position.
  """
  blocked = _blocked(x_v, -jnp.inf)
  block = jnp.argmax(jnp.max(blocked, axis=-1), axis=-1)
  within = jnp.take_along_axis(blocked, block[..., None, None], axis=-2)[..., 0, :]
  return (block * _BLOCK + jnp.argmax(within, axis=-1)).astype(jnp.int32)


def sample_logits(key: jax.Array, logits_v: jax.Array, temperature: float,
                  top_p: float = 1.0) -> jax.Array:
  """One token per leading index from softmax(logits / T) with top-p; argmax at T = 0
  (no random draws). `temperature` is a Python float (static under jit). int32 [...]."""
  if temperature == 0:
    return argmax(logits_v)
  return sample_categorical(key, scaled_probs(logits_v, temperature, top_p))


def _top_p_filter(probs_v: jax.Array, top_p: float) -> jax.Array:
  """Keeps the smallest set of most likely tokens whose mass reaches top_p, renormalised.

  Ties at the cut-off probability are all kept, so the result does not depend on sort order.
  """
  sorted_desc = -jnp.sort(-probs_v, axis=-1)
  mass_before = jnp.cumsum(sorted_desc, axis=-1) - sorted_desc
  keep_sorted = mass_before < top_p  # the top-1 token always has mass_before = 0
  num_kept = jnp.sum(keep_sorted, axis=-1, keepdims=True)
  threshold = jnp.take_along_axis(sorted_desc, num_kept - 1, axis=-1)
  kept = jnp.where(probs_v >= threshold, probs_v, 0.0)
  return kept / jnp.sum(kept, axis=-1, keepdims=True)


def scaled_probs(logits_v: jax.Array, temperature, top_p: float = 1.0) -> jax.Array:
  """The sampling law softmax(z / T), then nucleus (top-p) truncation.

  logits_v [..., V]; returns probs [..., V] float32. Temperature 0 gives the one-hot argmax
  (greedy; never a division by zero); top-p is applied after the temperature and is a no-op
  at temperature 0. Logits may hold -inf for masked tokens (not all of them).
  """
  if not 0.0 < top_p <= 1.0:
    raise ValueError(f"top_p must be in (0, 1], got {top_p}")
  logits = jnp.asarray(logits_v, jnp.float32)
  greedy = jax.nn.one_hot(argmax(logits), logits.shape[-1], dtype=jnp.float32)
  if isinstance(temperature, (int, float)):
    if temperature < 0:
      raise ValueError(f"temperature must be >= 0, got {temperature}")
    if temperature == 0:
      return greedy
    probs = jax.nn.softmax(logits / temperature, axis=-1)
  else:  # traced temperature, scalar or [...]: both branches, a safe denominator for each
    t = jnp.asarray(temperature, jnp.float32)[..., None]
    probs = jnp.where(t > 0, jax.nn.softmax(logits / jnp.where(t > 0, t, 1.0), axis=-1), greedy)
  if top_p < 1.0:
    probs = _top_p_filter(probs, top_p)
  return probs


def tv_distance(a_v: jax.Array, b_v: jax.Array) -> jax.Array:
  """TV(a, b) = 1/2 sum_x |a(x) - b(x)|; [..., V] x [..., V] -> [...]."""
  return 0.5 * jnp.sum(jnp.abs(a_v - b_v), axis=-1)


def overlap(a_v: jax.Array, b_v: jax.Array) -> jax.Array:
  """beta(a, b) = sum_x min(a(x), b(x)) = 1 - TV(a, b); [..., V] x [..., V] -> [...]."""
  return jnp.sum(jnp.minimum(a_v, b_v), axis=-1)


def normalize_positive(x_v: jax.Array, fallback_v: jax.Array) -> jax.Array:
  """norm((x)+) = max(x, 0) / sum max(x, 0), or `fallback_v` where that sum is zero.

  x_v [..., V], fallback_v broadcastable to it; returns [..., V]. The residual of a rule is
  only sampled after a rejection, which has positive probability exactly when the positive
  part is non-zero; the fallback only keeps the unused branch a valid distribution (no NaN).
  """
  pos = jnp.maximum(x_v, 0.0)
  total = jnp.sum(pos, axis=-1, keepdims=True)
  ok = total > 0
  return jnp.where(ok, pos / jnp.where(ok, total, 1.0), fallback_v)


def _first_above(key: jax.Array, weights_n: jax.Array) -> jax.Array:
  """One draw per leading index from non-negative `weights_n` [..., n] by inverse CDF.

  The first positive-weight index whose running sum exceeds u ~ U(0, total): a
  zero-weight index is never chosen, whatever the rounding; when rounding puts u at the
  total, the last positive index.
  """
  positive = weights_n > 0
  cdf = jnp.cumsum(weights_n, axis=-1)
  u = jax.random.uniform(key, weights_n.shape[:-1] + (1,), jnp.float32) * cdf[..., -1:]
  hit = positive & (cdf > u)
  n = weights_n.shape[-1]
  last_positive = n - 1 - jnp.argmax(positive[..., ::-1], axis=-1)
  return jnp.where(jnp.any(hit, axis=-1), jnp.argmax(hit, axis=-1), last_positive)


def sample_categorical(key: jax.Array, probs_v: jax.Array) -> jax.Array:
  """One draw per leading index from probs [..., V] (unnormalised is fine); int32 [...].

  Inverse CDF in two levels (a block of tokens by its mass, then a token within it): two
  uniforms per row instead of the V random draws of the Gumbel or exponential trick, which
  cost 6x more on CPU (1.9 vs 0.3 ms per 49k-token row). Zero-probability tokens are never
  drawn; a row must have positive mass (an all-zero row returns an index past V).
  """
  # Two levels keep each running sum short: float32 rounding stays ~1e-5 of a block's
  # mass instead of ~1e-3 of the total over a 49k vocabulary.
  blocked = _blocked(probs_v.astype(jnp.float32), 0.0)
  key_block, key_token = jax.random.split(key)
  block = _first_above(key_block, jnp.sum(blocked, axis=-1))
  within = jnp.take_along_axis(blocked, block[..., None, None], axis=-2)[..., 0, :]
  token = _first_above(key_token, within)
  return (block * _BLOCK + token).astype(jnp.int32)
