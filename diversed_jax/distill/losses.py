"""DistillSpec divergences between the target's top-k distribution and the draft's.

p is known only on the target's top-k ids (the rest of its mass, usually a few percent, is
ignored); q is the draft's softmax over its kept vocabulary. Both are at temperature 1.

Shape legend: J unrolled draft steps, B windows, T positions, K target top-k, Vs kept
vocabulary, D target width.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

LOSSES = ("kl", "tvd")


def masked_mean(x, mask):
  return jnp.sum(x * mask) / jnp.maximum(jnp.sum(mask), 1e-6)


def distill_terms(logits_jbtv, topk_kept_btk, topk_logp_btk):
  """Per-position terms, each [J, B, T].

  Args:
    logits_jbtv: draft logits over the kept vocabulary.
    topk_kept_btk: the target's top-k ids as kept-vocabulary indices (-1 when not kept).
    topk_logp_btk: the target's log-probabilities of those ids.
  Returns dict with
    ce: -sum_k p_k log q_k (forward KL up to the target's entropy);
    tv: sum_k max(0, p_k - q_k), TV(p, q) restricted to the target's top-k;
    accept: sum_k min(p_k, q_k), a lower bound of beta = 1 - TV(p, q) (the acceptance rate
      of exact speculative sampling at temperature 1);
    top1: 1 when the draft's argmax is the target's argmax;
    argmax_ce: -log q of the target's argmax (0 where it is not kept), the cross-entropy
      to the token a greedy round accepts.
  """
  logq = jax.nn.log_softmax(logits_jbtv, axis=-1)
  kept = topk_kept_btk >= 0
  idx = jnp.maximum(topk_kept_btk, 0)
  logq_k = jnp.take_along_axis(logq, jnp.broadcast_to(idx, logq.shape[:-1] + idx.shape[-1:]),
                               axis=-1)
  p_k = jnp.exp(topk_logp_btk.astype(jnp.float32)) * kept
  q_k = jnp.exp(logq_k) * kept
  ce = -jnp.sum(p_k * jnp.where(kept, logq_k, 0.0), axis=-1)
  tv = jnp.sum(jnp.maximum(p_k - q_k, 0.0), axis=-1)
  accept = jnp.sum(jnp.minimum(p_k, q_k), axis=-1)
  top1 = (jnp.argmax(logits_jbtv, axis=-1) == topk_kept_btk[..., 0]).astype(jnp.float32)
  argmax_ce = -jnp.where(kept[..., 0], logq_k[..., 0], 0.0)
  return {"ce": ce, "tv": tv, "accept": accept, "top1": top1, "argmax_ce": argmax_ce}


def feature_loss(hidden_jbtd, target_btd):
  """Smooth-L1 (Huber, delta 1) between predicted and target features, mean over D: [J,B,T]."""
  diff = jnp.abs(hidden_jbtd.astype(jnp.float32) - target_btd.astype(jnp.float32))
  return jnp.mean(jnp.where(diff < 1.0, 0.5 * diff * diff, diff - 0.5), axis=-1)
