"""Optimiser and the jittable training step of the ensemble head."""

from __future__ import annotations

from typing import Callable

import jax
import optax

from diversed_jax.rl.losses import diversed_loss


def _decay_mask(params):
  """Weight decay on dense kernels only: decaying the biases would drag w_t towards 0.5, not
  towards init_weight, and LayerNorm scales towards 0."""
  return jax.tree_util.tree_map_with_path(
      lambda path, _: getattr(path[-1], "key", None) == "kernel", params)


def make_optimizer(learning_rate: float, warmup_steps: int, total_steps: int,
                   weight_decay: float = 0.0, grad_clip: float = 1.0
                   ) -> optax.GradientTransformation:
  """clip_by_global_norm(grad_clip) then AdamW with a linear warm-up from 0 over warmup_steps
  and a cosine decay to 0 at total_steps (warm-up included). grad_clip <= 0 disables clipping.
  """
  if total_steps <= 0 or not 0 <= warmup_steps < total_steps:
    raise ValueError(f"need 0 <= warmup_steps < total_steps, got warmup_steps={warmup_steps}, "
                     f"total_steps={total_steps}")
  schedule = optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=learning_rate, warmup_steps=warmup_steps,
      decay_steps=total_steps, end_value=0.0)
  adamw = optax.adamw(schedule, weight_decay=weight_decay, mask=_decay_mask)
  if grad_clip and grad_clip > 0:
    return optax.chain(optax.clip_by_global_norm(grad_clip), adamw)
  return adamw


def make_train_step(head_apply: Callable, optimizer: optax.GradientTransformation, lam: float,
                    clip_eps: float | None = None) -> Callable:
  """A pure train_step(params, opt_state, batch) -> (params, opt_state, metrics).

  One gradient step on diversed_loss (see losses.py for the batch keys). lam (lambda) and
  clip_eps are baked in; jit it with donation:
    step = jax.jit(make_train_step(head.apply, opt, lam=0.1), donate_argnums=(0, 1)).
  metrics: diversed_loss's metrics (before the update) plus grad_norm.
  """
  grad_fn = jax.grad(lambda p, b: diversed_loss(p, head_apply, b, lam, clip_eps), has_aux=True)

  def train_step(params, opt_state, batch):
    grads, metrics = grad_fn(params, batch)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    metrics = dict(metrics, grad_norm=optax.global_norm(grads))
    return params, opt_state, metrics

  return train_step
