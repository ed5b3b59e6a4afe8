"""The DIVERSED ensemble head: w_t = head([h_q,t ; h_p,t]) in (0, 1), the weight on the TARGET.

nu_t = w_t p_t + (1 - w_t) q_t (a mixture of probabilities, see docs/methods.md), so w_t = 1 is
exact speculative decoding and w_t = 0 accepts every draft.

Shape legend: B rows, T time, Dq draft hidden size, Dp target hidden size, H head hidden size.
Inputs may carry any leading dims [...]; the head maps [..., Dq], [..., Dp] -> [...].
"""

from __future__ import annotations

import math
from typing import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

HEAD_KINDS = ("linear", "mlp")


def _two_logit_bias(init_weight: float):
  """Bias [logit_draft, logit_target] = [0, logit(w0)] so softmax(.)[1] = w0."""
  def init(key, shape, dtype=jnp.float32):
    del key
    assert shape == (2,), shape
    return jnp.array([0.0, math.log(init_weight) - math.log1p(-init_weight)], dtype)
  return init


class EnsembleHead(nn.Module):
  """w_t from the last hidden states (post final norm) of both LMs.

  kind: 'linear' = the released head, one dense layer [Dq+Dp] -> 2 logits (draft, target) and a
    softmax; 'mlp' = dense(H)-gelu-dense(2). In both the last layer has a zero kernel and bias
    [0, logit(init_weight)], so w_t = init_weight for every input at initialisation.
  hidden_dim: H, for 'mlp' only.
  init_weight: w at initialisation, in (0, 1); the released code starts at 0.5.
  layer_norm: LayerNorm the concatenated features first (draft and target hidden states can
    differ in scale by orders of magnitude).
  """
  kind: str = "linear"
  hidden_dim: int = 256
  init_weight: float = 0.5
  layer_norm: bool = False

  @nn.compact
  def __call__(self, h_q: jax.Array, h_p: jax.Array) -> jax.Array:
    """h_q [..., Dq], h_p [..., Dp] -> w [...] float32 in (0, 1) (up to float32 rounding)."""
    if self.kind not in HEAD_KINDS:
      raise ValueError(f"EnsembleHead.kind must be one of {HEAD_KINDS}, got {self.kind!r}")
    if not 0.0 < self.init_weight < 1.0:
      raise ValueError(f"EnsembleHead.init_weight must be in (0, 1), got {self.init_weight!r}")
    x = jnp.concatenate([h_q.astype(jnp.float32), h_p.astype(jnp.float32)], axis=-1)
    if self.layer_norm:
      x = nn.LayerNorm(name="norm")(x)
    if self.kind == "mlp":
      x = nn.gelu(nn.Dense(self.hidden_dim, name="hidden")(x))
    logits = nn.Dense(2, kernel_init=nn.initializers.zeros,
                      bias_init=_two_logit_bias(self.init_weight), name="out")(x)
    # softmax over 2 logits, weight on the target = sigmoid(z_target - z_draft).
    return jax.nn.sigmoid(logits[..., 1] - logits[..., 0])


def init_head(module: EnsembleHead, key: jax.Array, dq: int, dp: int) -> dict:
  """Variables {'params': ...} of `module` for draft/target hidden sizes dq, dp.

  Shapes: linear: out/kernel [Dq+Dp, 2], out/bias [2]; mlp adds hidden/kernel [Dq+Dp, H],
  hidden/bias [H] and out/kernel is [H, 2]; layer_norm adds norm/scale, norm/bias [Dq+Dp].
  """
  return module.init(key, jnp.zeros((1, dq), jnp.float32), jnp.zeros((1, dp), jnp.float32))


def make_head_fn(module: EnsembleHead, params: dict) -> Callable[[jax.Array, jax.Array], jax.Array]:
  """A pure (h_q [..., Dq], h_p [..., Dp]) -> w [...] for the speculative loop.

  `params` is closed over (constants under jit); to trace them as arguments use
  `module.apply(params, h_q, h_p)`, which is also the `head_apply` the RL losses take.
  """
  def head_fn(h_q, h_p):
    return module.apply(params, h_q, h_p)
  return head_fn
