"""The forms of `models.attention.attend`: the kernel against XLA's, and when each runs."""

import contextlib
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from diversed_jax.models import attention, cpu_kernels, products
from diversed_jax.models.config import ModelConfig

from tests.cpu_kernels_test import needs_kernel


def _config(**changes) -> ModelConfig:
  base = ModelConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_layers=2,
                     num_heads=6, num_kv_heads=2, head_dim=16)
  return dataclasses.replace(base, **changes)


def _inputs(seed, b=2, t=3, s=40, config=None):
  config = config or _config()
  rng = np.random.default_rng(seed)
  q = jnp.asarray(rng.standard_normal((b, t, config.num_heads, config.head_dim)), jnp.float32)
  kv = rng.standard_normal((2, b, s, config.num_kv_heads, config.head_dim))
  positions = jnp.asarray(rng.integers(0, s, (b, t)), jnp.int32)
  return q, jnp.asarray(kv[0], jnp.float32), jnp.asarray(kv[1], jnp.float32), positions


def _attend(config, *inputs, use_kernel=True):
  """attend(config, q, k, v, positions[, layer]) compiled with or without the kernel."""
  with contextlib.nullcontext() if use_kernel else attention.without_kernel():
    return jax.jit(lambda q, k, v, p, *layer: attention.attend(config, q, k, v, p, False,
                                                               *layer))(*inputs)


@needs_kernel
@pytest.mark.parametrize("t", [1, 3, 64])  # XLA's flat form for 1 and 3 tokens, grouped for 64
def test_kernel_form_matches_xlas_forms(t):
  config = _config()
  inputs = _inputs(t, t=t)
  assert attention.attention_form(config, t, jnp.float32) == "kernel"
  np.testing.assert_allclose(_attend(config, *inputs), _attend(config, *inputs, use_kernel=False),
                             rtol=0, atol=2e-6)


def test_form_choice():
  config = _config()
  kernel = "kernel" if cpu_kernels.available() else "flat"
  assert attention.attention_form(config, 1, jnp.float32) == kernel
  assert attention.attention_form(config, attention.KERNEL_MAX_TOKENS + 1, jnp.float32) == "grouped"
  with products.row_independent():  # the kernel for any number of tokens, where it runs
    assert attention.attention_form(config, 256, jnp.float32) == (
        "kernel" if cpu_kernels.available() else "grouped")
  # XLA's forms where the kernel does not apply: another dtype, a sliding window, soft-capping,
  # a head dim that is not a multiple of 8.
  assert attention.attention_form(config, 1, jnp.bfloat16) == "flat"
  assert attention.attention_form(_config(sliding_window=8), 1, jnp.float32) == "flat"
  assert attention.attention_form(_config(attn_logit_softcap=5.0), 1, jnp.float32) == "flat"
  assert attention.attention_form(_config(head_dim=12), 1, jnp.float32) == "flat"
  with attention.without_kernel():
    assert attention.attention_form(config, 6, jnp.float32) == "flat"  # 36 query rows
    assert attention.attention_form(config, 7, jnp.float32) == "grouped"  # 42
  assert attention.attention_form(config, 6, jnp.float32) == kernel  # restored on exit


@needs_kernel
def test_float32_queries_over_a_bfloat16_cache_keep_xlas_form():
  # The kernel takes one dtype for all three; choosing it by the promoted dtype (float32)
  # failed at run time.
  config = _config()
  q, k, v, positions = _inputs(5)
  k16, v16 = k.astype(jnp.bfloat16), v.astype(jnp.bfloat16)
  assert attention.attention_form(config, 3, jnp.float32, kernel_operands=False) == "flat"
  np.testing.assert_array_equal(_attend(config, q, k16, v16, positions),
                                _attend(config, q, k16, v16, positions, use_kernel=False))


@needs_kernel
def test_kernel_form_is_differentiable():
  config = _config()
  q, k, v, positions = _inputs(5)

  def loss(use_kernel):
    def f(q, k, v):
      with contextlib.nullcontext() if use_kernel else attention.without_kernel():
        return jnp.sum(jnp.sin(attention.attend(config, q, k, v, positions, sliding=False)))
    return f

  for got, want in zip(jax.grad(loss(True), (0, 1, 2))(q, k, v),
                       jax.grad(loss(False), (0, 1, 2))(q, k, v)):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@needs_kernel
def test_a_stacked_caches_layer_attends_as_that_layer_alone_with_its_gradient():
  # `attend(..., layer)` reads the layer of stacked caches in place (the kernel) or sliced
  # out (XLA's forms): the same outputs as on the layer alone, and gradients that land in
  # that layer of the stack only.
  config = _config()
  q, _, _, positions = _inputs(6)
  rng = np.random.default_rng(6)
  k, v = (jnp.asarray(rng.standard_normal((3, *q.shape[:1], 40, config.num_kv_heads,
                                           config.head_dim)), jnp.float32) for _ in range(2))
  for use_kernel in (True, False):
    stacked = _attend(config, q, k, v, positions, jnp.int32(1), use_kernel=use_kernel)
    alone = _attend(config, q, k[1], v[1], positions, use_kernel=use_kernel)
    np.testing.assert_array_equal(np.asarray(stacked), np.asarray(alone))

  def loss(k, v):
    return jnp.sum(jnp.sin(attention.attend(config, q, k, v, positions, False, jnp.int32(1))))

  d_k, d_v = jax.grad(loss, (0, 1))(k, v)
  d_k1, d_v1 = jax.grad(lambda k1, v1: loss(k.at[1].set(k1), v.at[1].set(v1)), (0, 1))(k[1], v[1])
  for d, d1 in ((d_k, d_k1), (d_v, d_v1)):
    np.testing.assert_array_equal(np.asarray(d[1]), np.asarray(d1))
    assert not np.any(np.asarray(d[0])) and not np.any(np.asarray(d[2]))
    assert np.any(np.asarray(d1))
