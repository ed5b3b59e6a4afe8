"""The DIVERSED training objective for the ensemble head (Wang et al., AISTATS 2026), as small
pure jittable functions.

Maximised, per rollout x_{1:T} sampled from nu (the speculative loop with the dynamic verifier
samples nu exactly):

  J = sum_t log nu_t(x_t) * A  +  lambda * sum_t (1 - w_t TV(p_t, q_t)),
  nu_t = w_t p_t + (1 - w_t) q_t,

with A the REINFORCE++ advantage of the sequence reward. The first term is the score-function
(REINFORCE) term; the second is the acceptance regulariser, differentiated pathwise:
beta(q_t, nu_t) = 1 - w_t TV(p_t, q_t) is the expected acceptance at t. Both LMs are frozen,
so gradients reach only the head.

Normalisation: per-row sums over time, then a mean over rows (divide by B, not by the token
count), so the gradient is an unbiased estimate of the per-sequence objective above and lambda
has the paper's meaning (a weight per sequence-sum). The released code's two defects are not
reproduced: nu is a mixture of probabilities, not of logits, and the regulariser has the fixed
sign +lambda (no dynamic scale that flips it).

Shape legend: B rows (rollouts), T time (generated tokens), D hidden size (Dq draft, Dp target).
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

PPO_CLIP_EPS = 0.2
_TINY = float(jnp.finfo(jnp.float32).tiny)


# ---------------------------------------------------------------- masked helpers


def masked_sum(x: jax.Array, mask: jax.Array, axis=None) -> jax.Array:
  """sum(x * mask) over `axis` (all axes when None)."""
  return jnp.sum(x * mask, axis=axis)


def masked_mean(x: jax.Array, mask: jax.Array, axis=None) -> jax.Array:
  """sum(x * mask) / sum(mask) over `axis`; 0 where the mask is empty."""
  count = jnp.sum(jnp.broadcast_to(mask, x.shape), axis=axis)
  return masked_sum(x, mask, axis) / jnp.where(count > 0, count, 1.0)


def masked_whiten(x: jax.Array, mask: jax.Array, eps: float = 1e-8,
                  shift_mean: bool = True) -> jax.Array:
  """(x - mean) / (std + eps) with mean and (population) std over the masked entries.

  Returns the shape of x; masked-out entries are set to 0. shift_mean=False adds the mean back.
  """
  mean = masked_mean(x, mask)
  std = jnp.sqrt(masked_mean(jnp.square(x - mean), mask))
  out = (x - mean) / (std + eps)
  if not shift_mean:
    out = out + mean
  return jnp.where(mask > 0, out, 0.0)


# ---------------------------------------------------------------- advantages


def _group_mean(x_b: jax.Array, group_ids_b: jax.Array, mask_b: jax.Array) -> jax.Array:
  """Mean of x over the rows sharing each row's group id. [B] -> [B]. O(B^2), B is small."""
  same_bb = (group_ids_b[:, None] == group_ids_b[None, :]) * mask_b[None, :]
  return (same_bb @ x_b) / jnp.maximum(same_bb.sum(-1), 1.0)


def _group_centred(x_b: jax.Array, group_ids_b: jax.Array, mask_b: jax.Array) -> jax.Array:
  """x minus its group's mean, exactly 0 for a group of equal values: the float32 mean of
  n equal values is not always that value, and whitening would blow the leftover up to O(1).
  So each row first subtracts its group's first (unmasked) value, which is exact."""
  same_bb = (group_ids_b[:, None] == group_ids_b[None, :]) & (mask_b[None, :] > 0)
  offset_b = x_b - x_b[jnp.argmax(same_bb, axis=1)]
  return offset_b - _group_mean(offset_b, group_ids_b, mask_b)


def _row_mask(rewards_b, mask_b):
  return jnp.ones_like(rewards_b) if mask_b is None else mask_b.astype(rewards_b.dtype)


def reinforce_pp_advantages(rewards_b: jax.Array, group_ids_b: jax.Array, eps: float = 1e-8,
                            mask_b: jax.Array | None = None) -> jax.Array:
  """REINFORCE++ (Hu 2025, arXiv 2501.03262) with a group baseline -> A [B].

  A_i = whiten_batch(r_i - mean_{j: g_j = g_i} r_j): the per-prompt group mean (rows sharing a
  group id) is the baseline, then mean/std normalisation over the whole batch.
  mask_b (optional, [B]) drops padding rows from every statistic; their advantage is 0.
  """
  rewards_b = rewards_b.astype(jnp.float32)
  m = _row_mask(rewards_b, mask_b)
  centred = _group_centred(rewards_b, group_ids_b, m)
  return masked_whiten(centred, m, eps)


def reinforce_advantages(rewards_b: jax.Array, group_ids_b: jax.Array, eps: float = 1e-8,
                         mask_b: jax.Array | None = None) -> jax.Array:
  """Plain REINFORCE with a batch-mean baseline: A_i = r_i - mean_j r_j. [B] -> [B]."""
  del group_ids_b, eps
  rewards_b = rewards_b.astype(jnp.float32)
  m = _row_mask(rewards_b, mask_b)
  return (rewards_b - masked_mean(rewards_b, m)) * m


def grpo_advantages(rewards_b: jax.Array, group_ids_b: jax.Array, eps: float = 1e-6,
                    mask_b: jax.Array | None = None) -> jax.Array:
  """GRPO: (r_i - group mean) / (group std + eps), statistics within each group. [B] -> [B]."""
  rewards_b = rewards_b.astype(jnp.float32)
  m = _row_mask(rewards_b, mask_b)
  centred = _group_centred(rewards_b, group_ids_b, m)
  std = jnp.sqrt(_group_mean(jnp.square(centred), group_ids_b, m))
  return centred / (std + eps) * m


ADVANTAGES: dict[str, Callable] = {
    "reinforce_pp": reinforce_pp_advantages,
    "reinforce": reinforce_advantages,
    "grpo": grpo_advantages,
}


def get_advantage_fn(name: str) -> Callable:
  """The estimator registered as `name`; raises ValueError naming the choices."""
  if name not in ADVANTAGES:
    raise ValueError(f"unknown advantage estimator {name!r}; choose from {sorted(ADVANTAGES)}")
  return ADVANTAGES[name]


# ---------------------------------------------------------------- DIVERSED terms


def log_nu(w_bt: jax.Array, p_tok_bt: jax.Array, q_tok_bt: jax.Array) -> jax.Array:
  """log nu_t(x_t) = log(w_t p_t(x_t) + (1 - w_t) q_t(x_t)), float32 [B, T].

  p_tok, q_tok: target/draft probabilities of the emitted token (teacher-forced gather). Both
  terms are non-negative, so the sum has no cancellation; nu is floored at the smallest normal
  float32 so padding positions (p = q = 0) give a finite value with zero gradient.
  """
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  w = f32(w_bt)
  nu = w * f32(p_tok_bt) + (1.0 - w) * f32(q_tok_bt)
  return jnp.log(jnp.maximum(nu, _TINY))


def acceptance_regulariser(w_bt: jax.Array, tv_pq_bt: jax.Array, mask_bt: jax.Array) -> jax.Array:
  """mean_b sum_t mask (1 - w_t TV(p_t, q_t)) -> scalar; 1 - w TV = beta(q_t, nu_t).

  d/dw_t = -TV(p_t, q_t) mask / B <= 0: maximising it lowers w_t wherever p_t != q_t.
  """
  beta_bt = 1.0 - jnp.asarray(w_bt, jnp.float32) * jnp.asarray(tv_pq_bt, jnp.float32)
  return jnp.mean(masked_sum(beta_bt, mask_bt, axis=-1))


def _policy_objective(logp_bt, advantages_b, mask_bt, old_logp_bt, clip_eps):
  """Per-token surrogate [B, T] and its metrics (the clipped one when old_logp_bt is given)."""
  adv_b1 = advantages_b[:, None]
  if old_logp_bt is None:
    return logp_bt * adv_b1, {}
  log_ratio = logp_bt - old_logp_bt
  ratio = jnp.exp(log_ratio)
  clipped = jnp.clip(ratio, 1.0 - clip_eps, 1.0 + clip_eps)
  surr_bt = jnp.minimum(ratio * adv_b1, clipped * adv_b1)
  metrics = {
      "ratio_mean": masked_mean(ratio, mask_bt),
      "ratio_max": jnp.max(jnp.where(mask_bt > 0, ratio, -jnp.inf)),
      "ratio_min": jnp.min(jnp.where(mask_bt > 0, ratio, jnp.inf)),
      "clip_frac": masked_mean((ratio * adv_b1 > clipped * adv_b1).astype(jnp.float32), mask_bt),
      # k3 estimator of KL(old || new): (r - 1) - log r >= 0.
      "approx_kl": masked_mean(ratio - 1.0 - log_ratio, mask_bt),
  }
  return surr_bt, metrics


def diversed_loss(head_params, head_apply: Callable, batch: dict, lam: float,
                  clip_eps: float | None = None) -> tuple[jax.Array, dict]:
  """-J (see module docstring), per-row sums then mean over B rows -> (loss [], metrics).

  head_apply(head_params, h_q [B,T,Dq], h_p [B,T,Dp]) -> w [B,T] (e.g. EnsembleHead.apply).
  batch:
    h_q_btd [B,T,Dq], h_p_btd [B,T,Dp]: last hidden states (post final norm) at the position
      that predicts x_t;
    p_tok_bt, q_tok_bt [B,T]: p_t(x_t), q_t(x_t); tv_pq_bt [B,T]: TV(p_t, q_t);
    mask_bt [B,T]: 1 on generated tokens; advantages_b [B];
    old_logp_bt [B,T] (optional): log nu_t(x_t) under the head that sampled the rollout. When
      present, the policy term is the PPO clipped surrogate
      min(r A, clip(r, 1-eps, 1+eps) A), r = exp(logp - old_logp), eps = clip_eps or 0.2;
      without it clip_eps is ignored and the term is plain REINFORCE (same gradient as r = 1).
  lam: lambda >= 0. The regulariser's gradient is +lambda TV mask / B on the loss wrt w_t,
    whatever the reward term: it always pushes w down, i.e. acceptance up.
  metrics: loss, policy_loss, regulariser, w_mean, acceptance_proxy (token mean of 1 - w TV),
    log_nu_mean; with old_logp_bt also ratio_mean/max/min, clip_frac, approx_kl.
  """
  sg = jax.lax.stop_gradient  # both LMs are frozen: nothing flows back into their outputs
  mask = sg(batch["mask_bt"]).astype(jnp.float32)
  tv = sg(batch["tv_pq_bt"]).astype(jnp.float32)
  w_bt = head_apply(head_params, sg(batch["h_q_btd"]), sg(batch["h_p_btd"])).astype(jnp.float32)
  logp_bt = log_nu(w_bt, sg(batch["p_tok_bt"]), sg(batch["q_tok_bt"]))
  old = batch.get("old_logp_bt")
  old = None if old is None else sg(old).astype(jnp.float32)
  eps = PPO_CLIP_EPS if clip_eps is None else clip_eps
  surr_bt, metrics = _policy_objective(
      logp_bt, sg(batch["advantages_b"]).astype(jnp.float32), mask, old, eps)

  policy_loss = -jnp.mean(masked_sum(surr_bt, mask, axis=-1))
  reg = acceptance_regulariser(w_bt, tv, mask)
  loss = policy_loss - lam * reg
  metrics.update(
      loss=loss,
      policy_loss=policy_loss,
      regulariser=reg,
      w_mean=masked_mean(w_bt, mask),
      acceptance_proxy=masked_mean(1.0 - w_bt * tv, mask),
      log_nu_mean=masked_mean(logp_bt, mask),
  )
  return loss, metrics
