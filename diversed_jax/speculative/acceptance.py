"""Acceptance statistics of speculative rounds: measured rates and the expected-length theory.

Shape legend: R rounds, B rows, K drafted tokens per round; `...` any leading axes.
Small pure jnp functions (jittable, also fine on numpy inputs); see methods.md, "Expected
acceptance length without the i.i.d. assumption". a_i = a_i(x_i) is `Verdict.accept_prob_bk`,
beta_i = sum_x q_i a_i (the expected acceptance; sum_x min(q_i, pi_i) for all rules but
'typical') is `Verdict.beta_bk`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def masked_mean(x: jax.Array, mask: jax.Array) -> jax.Array:
  """sum(x * mask) / sum(mask), 0 when the mask is empty; any shapes that broadcast -> []."""
  mask = jnp.asarray(mask, jnp.float32)
  x = jnp.asarray(x, jnp.float32)
  total = jnp.sum(jnp.broadcast_to(mask, jnp.broadcast_shapes(x.shape, mask.shape)))
  return jnp.sum(x * mask) / jnp.maximum(total, 1.0)


def acceptance_rate(num_accepted_rb: jax.Array, active_rb: jax.Array, num_draft: int):
  """Accepted drafts / proposed drafts over the (round, row) pairs where the row was active.

  num_accepted_rb [R, B] (or any shape) int: n per round; active_rb same shape bool (False
  once a row has finished); num_draft K. Returns [] float32 (0 when nothing was proposed).
  """
  return masked_mean(jnp.asarray(num_accepted_rb, jnp.float32) / num_draft, active_rb)


def tokens_per_round(num_accepted_rb: jax.Array, active_rb: jax.Array,
                     num_emitted_rb: jax.Array | None = None):
  """Mean tokens committed per active round: n + 1 (the drafts plus the residual/bonus token),
  or `num_emitted_rb` when given (e.g. cut short by EOS or the length limit). Returns []."""
  if num_emitted_rb is None:
    num_emitted_rb = jnp.asarray(num_accepted_rb, jnp.float32) + 1.0
  return masked_mean(num_emitted_rb, active_rb)


def path_accepted_length(accept_prob_k: jax.Array) -> jax.Array:
  """Unbiased estimator of E[accepted drafts] along the drafted path:
  sum_{n=1..K} prod_{i<=n} a_i(x_i). accept_prob [..., K] -> [...]."""
  return jnp.sum(jnp.cumprod(jnp.asarray(accept_prob_k, jnp.float32), axis=-1), axis=-1)


def path_accepted_length_beta(accept_prob_k: jax.Array, beta_k: jax.Array) -> jax.Array:
  """Lower-variance unbiased estimator sum_{n=1..K} (prod_{i<n} a_i(x_i)) beta_n, which
  replaces the last factor a_n(x_n) by its conditional mean beta_n. [..., K] x2 -> [...]."""
  a = jnp.asarray(accept_prob_k, jnp.float32)
  before = jnp.cumprod(jnp.concatenate([jnp.ones_like(a[..., :1]), a[..., :-1]], -1), -1)
  return jnp.sum(before * jnp.asarray(beta_k, jnp.float32), axis=-1)


def independent_accepted_length(beta_k: jax.Array) -> jax.Array:
  """E[accepted drafts] = sum_n prod_{i<=n} beta_i when the positions' laws do not depend on
  the drafted prefix (the min-kernel formula with m_i independent of x_<i). [..., K] -> [...]."""
  return jnp.sum(jnp.cumprod(jnp.asarray(beta_k, jnp.float32), axis=-1), axis=-1)


def iid_accepted_drafts(alpha: jax.Array, num_draft: int) -> jax.Array:
  """i.i.d. rate alpha: E[accepted drafts] = alpha (1 - alpha^K) / (1 - alpha) (= K at 1).

  Computed as the sum alpha + ... + alpha^K, which is the same number without the 0/0 at
  alpha = 1. alpha [...] -> [...].
  """
  alpha = jnp.asarray(alpha, jnp.float32)
  powers = jnp.arange(1, num_draft + 1, dtype=jnp.float32)
  return jnp.sum(alpha[..., None] ** powers, axis=-1)


def iid_tokens_per_round(alpha: jax.Array, num_draft: int) -> jax.Array:
  """i.i.d. rate alpha: E[tokens per round] = (1 - alpha^(K+1)) / (1 - alpha) (= K+1 at 1).
  alpha [...] -> [...]."""
  return 1.0 + iid_accepted_drafts(alpha, num_draft)
