"""Grouped-query attention of new tokens over one layer's KV cache, in the form that runs
fastest where it runs.

- "kernel": `cpu_kernels.few_query_attention`, for up to KERNEL_MAX_TOKENS new tokens per
  sequence (decoding, drafting, verifying, prefill chunks) on a single CPU device, float32,
  without a sliding window or logit soft-capping. It reads each head's visible slots in place and
  computes every query in a fixed order, so a token's attention is bitwise the same
  whether it is decoded alone or verified among drafts.
- "flat": `_scores_values_flat`, XLA's form for a few query rows elsewhere.
- "grouped": the grouped einsum, for longer passes.

Shape legend: B batch, T new tokens, S cache slots, H query heads, Hkv kv heads, G = H /
Hkv query heads per kv head, Dh head dim.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math

import jax
import jax.numpy as jnp

from diversed_jax.models import cpu_kernels, products
from diversed_jax.models.config import ModelConfig

# New tokens per sequence up to which the kernel runs (when it applies): every verification
# and the prefill's 64-token chunks (`loop.PREFILL_CHUNK`), where XLA's grouped einsum
# spends as long on transposed copies and masks as on the products (a [8, 64] pass: 974
# against 1,142 ms). Longer passes (training windows) keep XLA's grouped form, except
# within `products.row_independent()` (greedy rounds), where the kernel takes any number
# of tokens, so a verification of more than 64 tokens still attends as decoding does.
KERNEL_MAX_TOKENS = 64

# Up to this many query rows (T * H) per sequence, XLA's forms use `_scores_values_flat`:
# decoding and verifying up to 3 drafts with H = 9 (T = 4: 61 against 82 ms per
# verification at 640 slots). Beyond it the wasted factor Hkv of compute outweighs the
# copies saved (T = 5 with H = 9 is no faster flat).
_FLAT_ATTENTION_ROWS = 36

# False within `without_kernel()` (read at trace time).
_KERNEL_ALLOWED = contextvars.ContextVar("attention_kernel_allowed", default=True)


@contextlib.contextmanager
def without_kernel():
  """Attention traced within it takes XLA's forms, never the kernel (tests compare the
  two). Only functions traced inside are affected, as with `products.row_independent()`."""
  token = _KERNEL_ALLOWED.set(False)
  try:
    yield
  finally:
    _KERNEL_ALLOWED.reset(token)


def attention_form(config: ModelConfig, num_tokens: int, dtype,
                   kernel_operands: bool = True) -> str:
  """"kernel", "flat" or "grouped": the form `attend` takes (decided at trace time).
  kernel_operands: whether the queries and both caches all have `dtype` (the kernel takes
  one dtype for all three)."""
  token_limit = math.inf if products.in_row_independent() else KERNEL_MAX_TOKENS
  kernel = (_KERNEL_ALLOWED.get() and kernel_operands and num_tokens <= token_limit
            and config.sliding_window is None and config.attn_logit_softcap is None
            and config.head_dim % 8 == 0 and cpu_kernels.runs_here(dtype))
  if kernel:
    return "kernel"
  return "flat" if num_tokens * config.num_heads <= _FLAT_ATTENTION_ROWS else "grouped"


def _scores_values_flat(q_btkgd, k_cache_bshd, v_cache_bshd, probs_fn):
  """Attention for a few queries that reads the cache in its stored [B, S, Hkv, Dh] layout:
  every query head is scored against every kv head in one batched matmul per row and the
  matching head is kept. It wastes a factor Hkv of a small product but avoids the
  per-layer transposed copies of the cache that the grouped einsum costs XLA:CPU (1.3-2x
  faster attention when decoding). The cache is the matmul's left operand: XLA:CPU runs
  [S*Hkv, Dh] x [Dh, few] twice as fast as the transposed product."""
  b, t, hkv, g, dh = q_btkgd.shape
  s = k_cache_bshd.shape[1]
  same_head_jk = jnp.eye(hkv, dtype=bool)
  scores = jnp.einsum("bmd,bnd->bmn", k_cache_bshd.reshape(b, s * hkv, dh),
                      q_btkgd.reshape(b, t * hkv * g, dh), preferred_element_type=jnp.float32)
  scores = scores.reshape(b, s, hkv, t, hkv, g)  # [b, s, j (key head), t, k (query group), g]
  scores_bstkg = jnp.sum(jnp.where(same_head_jk[:, None, :, None], scores, 0.0), axis=2)
  probs_btkgs = probs_fn(jnp.transpose(scores_bstkg, (0, 2, 3, 4, 1)))
  out = jnp.einsum("bns,bsm->bnm", probs_btkgs.astype(v_cache_bshd.dtype).reshape(b, -1, s),
                   v_cache_bshd.reshape(b, s, hkv * dh))
  out = out.reshape(b, t, hkv, g, hkv, dh)
  return jnp.sum(jnp.where(same_head_jk[:, None, :, None], out, 0.0), axis=-2)


def _attend_xla(config, q_btkgd, k_cache_bshd, v_cache_bshd, positions_bt, sliding, form):
  """XLA's forms; [B, T, Hkv, G, Dh]."""
  s = k_cache_bshd.shape[1]
  slots = jnp.arange(s)
  visible_bts = slots[None, None, :] <= positions_bt[:, :, None]
  if config.sliding_window is not None:
    in_window = slots[None, None, :] > positions_bt[:, :, None] - config.sliding_window
    visible_bts = visible_bts & (in_window | ~sliding)

  def probs(scores, visible):
    scores = scores.astype(jnp.float32) * config.scale
    if config.attn_logit_softcap is not None:
      scores = jnp.tanh(scores / config.attn_logit_softcap) * config.attn_logit_softcap
    return jax.nn.softmax(jnp.where(visible, scores, -1e30), axis=-1)

  if form == "flat":
    return _scores_values_flat(q_btkgd, k_cache_bshd, v_cache_bshd,
                               lambda x: probs(x, visible_bts[:, :, None, None]))
  scores = jnp.einsum("btkgd,bskd->bkgts", q_btkgd, k_cache_bshd,
                      preferred_element_type=jnp.float32)
  p = probs(scores, visible_bts[:, None, None]).astype(v_cache_bshd.dtype)
  return jnp.einsum("bkgts,bskd->btkgd", p, v_cache_bshd)


def _layer_of(cache, layer):
  """One layer's cache [B, S, Hkv, Dh]: the cache itself (layer None), or layer `layer` of
  a stacked cache [L, B, S, Hkv, Dh] (a copy)."""
  return cache if layer is None else jax.lax.dynamic_index_in_dim(cache, layer, keepdims=False)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _kernel_attention(config, q_btkgd, k_cache, v_cache, positions_bt, layer):
  return cpu_kernels.few_query_attention(q_btkgd, k_cache, v_cache, positions_bt,
                                         float(config.scale), layer)


def _kernel_forward(config, q_btkgd, k_cache, v_cache, positions_bt, layer):
  out = _kernel_attention(config, q_btkgd, k_cache, v_cache, positions_bt, layer)
  return out, (q_btkgd, k_cache, v_cache, positions_bt, layer)


def _kernel_backward(config, residuals, d_out):
  # The kernel is for inference; a gradient (rare: few-token training passes) takes XLA's
  # grouped form, the same function up to float rounding (the kernel runs only without a
  # sliding window, so `sliding` does not matter).
  q, k_cache, v_cache, positions_bt, layer = residuals
  _, vjp = jax.vjp(lambda q, k, v: _attend_xla(config, q, k, v, positions_bt, False,
                                               "grouped"),
                   q, _layer_of(k_cache, layer), _layer_of(v_cache, layer))
  d_q, d_k, d_v = vjp(d_out)
  if layer is not None:  # into the stacked caches' layer
    into = lambda d, cache: jax.lax.dynamic_update_index_in_dim(jnp.zeros_like(cache), d,
                                                                layer, 0)
    d_k, d_v = into(d_k, k_cache), into(d_v, v_cache)
  return d_q, d_k, d_v, None, None


_kernel_attention.defvjp(_kernel_forward, _kernel_backward)


def attend(config: ModelConfig, q_bthd, k_cache, v_cache, positions_bt, sliding, layer=None):
  """Attention of the new tokens' queries (at `positions_bt`) over one layer's cache, which
  already holds their own keys and values; [B, T, H*Dh]. `sliding` says whether this layer
  uses the config's sliding window.

  The caches are that layer's [B, S, Hkv, Dh], or, given `layer` (an int32 scalar), stacked
  caches [L, B, S, Hkv, Dh] of which the layer is read: in place by the kernel, sliced out
  (a copy) for XLA's forms."""
  b, t, h, dh = q_bthd.shape
  q_btkgd = q_bthd.reshape(b, t, config.num_kv_heads, h // config.num_kv_heads, dh)
  form = attention_form(config, t, jnp.result_type(q_bthd, k_cache),
                        q_bthd.dtype == k_cache.dtype == v_cache.dtype)
  if form == "kernel":
    out = _kernel_attention(config, q_btkgd, k_cache, v_cache, positions_bt, layer)
  else:
    out = _attend_xla(config, q_btkgd, _layer_of(k_cache, layer), _layer_of(v_cache, layer),
                      positions_bt, sliding, form)
  return out.reshape(b, t, h * dh)
