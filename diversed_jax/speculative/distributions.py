"""Distributions over the vocabulary: temperature/top-p scaling, TV, residuals, sampling.

Shape legend: B rows, K drafted tokens per round, V vocabulary; `...` any leading axes.
Every function works on the last axis (V) and broadcasts over the leading ones; all are
float32 and jittable (temperature and top_p are static Python floats in the loop, but a traced
temperature also works).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


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
  greedy = jax.nn.one_hot(jnp.argmax(logits, axis=-1), logits.shape[-1], dtype=jnp.float32)
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


def sample_categorical(key: jax.Array, probs_v: jax.Array) -> jax.Array:
  """One draw per leading index from probs [..., V]; returns int32 [...].

  Exponential trick: argmax_x log probs(x) - log E_x with E_x ~ Exp(1) i.i.d., which is exact
  for unnormalised probabilities and never picks a zero-probability token (its score is -inf).
  """
  e = jax.random.exponential(key, probs_v.shape, jnp.float32)
  e = jnp.maximum(e, jnp.finfo(jnp.float32).tiny)  # Exp(1) can round to 0: keep log finite
  score = jnp.where(probs_v > 0, jnp.log(jnp.where(probs_v > 0, probs_v, 1.0)) - jnp.log(e),
                    -jnp.inf)
  return jnp.argmax(score, axis=-1).astype(jnp.int32)
