"""The hand-written few-row kernel (`models.cpu_kernels`) against float64 contractions."""

import contextlib
import platform
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from diversed_jax.models import cpu_kernels

from tests.q8 import q8_0_weights

_CAN_BUILD = platform.machine().lower() in ("x86_64", "amd64") and shutil.which("g++")


def test_builds_where_a_compiler_and_x86_64_exist():
  # Where it can be built it must be: a silent fallback would hide a broken kernel.
  if not _CAN_BUILD:
    pytest.skip("no g++ or not x86_64: the fallback is the intended path")
  assert cpu_kernels.available()


needs_kernel = pytest.mark.skipif(not (_CAN_BUILD and cpu_kernels.available()),
                                  reason="the few-row kernel cannot be built here")


def _random(rng, *shape):
  return jnp.asarray(rng.standard_normal(shape), jnp.float32)


# Shapes cover every row group (1-4 rows in one pass; more in groups of up to 4 and a
# remainder; groups of 2 and 1 where `in` is long) and, on AVX-512 hosts, the tiles (from 3
# rows: groups of 3 to 6 rows, full and partial columns), `in` with and without a last
# 8-float step past a multiple of 16 and a scalar tail, `out` split into uneven chunks. On
# AVX-512 hosts `streams` forces row streams for every row count (else tiles take >= 3).
@needs_kernel
@pytest.mark.parametrize("streams", [False, True])
@pytest.mark.parametrize("rows,size_in,size_out", [
    (1, 576, 960), (2, 64, 13), (3, 40, 7), (4, 576, 3072), (5, 1536, 576), (6, 24, 30),
    (7, 8, 9), (8, 100, 50), (13, 37, 19), (32, 576, 960), (3, 5, 3), (4, 1536, 33),
    (3, 5000, 7)])
def test_kernel_equals_the_float64_contraction(rows, size_in, size_out, streams):
  if streams and cpu_kernels.tile_rows() == 0:
    pytest.skip("no AVX-512: row streams only, as in the other case")
  rng = np.random.default_rng(rows * 1000 + size_in)
  x, w_oi = _random(rng, rows, size_in), _random(rng, size_out, size_in)
  with cpu_kernels.min_tile_rows(1 << 30) if streams else contextlib.nullcontext():
    got = np.asarray(jax.jit(cpu_kernels.few_row_matmul)(x, w_oi))
  want = np.asarray(x, np.float64) @ np.asarray(w_oi, np.float64).T
  assert got.shape == (rows, size_out) and got.dtype == jnp.float32
  # float32 accumulation over `in` terms of unit scale: error ~ sqrt(in) * 2^-24 * |terms|.
  np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * size_in ** 0.5 * 4)


@needs_kernel
@pytest.mark.parametrize("size_in", [576, 1536, 4100, 45])  # rows grouped by 4, 2, 1; tails
def test_a_rows_result_does_not_depend_on_its_companions(size_in):
  # What makes one row's logits the same whether 1 or K + 1 tokens are verified with it.
  rng = np.random.default_rng(1)
  x, w_oi = _random(rng, 11, size_in), _random(rng, 1000, size_in)
  together = np.asarray(jax.jit(cpu_kernels.few_row_matmul)(x, w_oi))
  for start, stop in [(0, 1), (3, 4), (4, 6), (2, 5), (0, 8), (5, 11)]:
    alone = np.asarray(jax.jit(cpu_kernels.few_row_matmul)(x[start:stop], w_oi))
    np.testing.assert_array_equal(alone, together[start:stop])


@needs_kernel
@pytest.mark.parametrize("dtype", ["float32", "float16", "int8"])
def test_tiles_and_row_streams_give_the_same_bits(dtype):
  # Each vendor's cores take register tiles from a different number of rows (measured);
  # a row's logits, and so greedy decoding, must not depend on which path a host takes.
  if cpu_kernels.tile_rows() == 0:
    pytest.skip("no AVX-512: row streams only")
  rng = np.random.default_rng(4)
  size_in = 576 + 8 + 3  # 16-float steps, a last 8-float step and a scalar tail
  if dtype == "int8":
    size_in = 576
    q, scale, _ = q8_0_weights(rng, 300, size_in)
    product = jax.jit(lambda x: cpu_kernels.few_row_matmul_int8(x, q, scale))
  else:
    w_oi = _random(rng, 300, size_in).astype(dtype)
    product = jax.jit(lambda x: cpu_kernels.few_row_matmul(x, w_oi))
  x = _random(rng, 7, size_in)
  for rows in range(1, 8):
    with cpu_kernels.min_tile_rows(1):  # materialised inside: dispatch is asynchronous
      tiled = np.asarray(product(x[:rows]))
      assert cpu_kernels.tile_rows() == 1
    with cpu_kernels.min_tile_rows(1 << 30):
      streamed = np.asarray(product(x[:rows]))
      assert cpu_kernels.tile_rows() == 1 << 30
    np.testing.assert_array_equal(tiled, streamed, err_msg=f"{rows} rows")
  assert cpu_kernels.tile_rows() in (1, 3)  # the host's default is back


@needs_kernel
def test_min_tile_rows_contexts_nest():
  default = cpu_kernels.tile_rows()
  with cpu_kernels.min_tile_rows(5):
    with cpu_kernels.min_tile_rows(1 << 30):
      pass
    assert cpu_kernels.tile_rows() == (5 if default else 0)
  assert cpu_kernels.tile_rows() == default


@needs_kernel
def test_min_tile_rows_names_a_bad_value():
  with pytest.raises(ValueError, match="rows must be at least 1, got 0"):
    with cpu_kernels.min_tile_rows(0):
      pass


@needs_kernel
def test_kernel_gradients_and_vmap_match_the_plain_product():
  rng = np.random.default_rng(2)
  x, w_oi = _random(rng, 3, 16), _random(rng, 5, 16)
  plain = lambda x, w: x @ w.T
  loss = lambda f: lambda x, w: jnp.sum(jnp.sin(f(x, w)))
  for got, want in zip(jax.grad(loss(cpu_kernels.few_row_matmul), (0, 1))(x, w_oi),
                       jax.grad(loss(plain), (0, 1))(x, w_oi)):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  xs = _random(rng, 4, 3, 16)
  np.testing.assert_allclose(jax.vmap(cpu_kernels.few_row_matmul, (0, None))(xs, w_oi),
                             jnp.einsum("bmi,oi->bmo", xs, w_oi), rtol=1e-5, atol=1e-5)


def test_switched_off_by_the_environment(monkeypatch):
  monkeypatch.setenv(cpu_kernels.ENV_SWITCH, "0")
  assert not cpu_kernels.available()
  assert cpu_kernels.tile_rows() == 0  # no kernel, no tiles


def _attention_float64(q, k, v, positions, scale):
  """softmax(scale q.k) v over slots s <= position, per kv head and its query group."""
  q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
  out = np.zeros(q.shape)
  for b, t in np.ndindex(*positions.shape):
    visible = min(positions[b, t] + 1, k.shape[1])
    for j in range(q.shape[2]):
      scores = scale * q[b, t, j] @ k[b, :visible, j].T  # [G, visible]
      probs = np.exp(scores - scores.max(-1, keepdims=True))
      out[b, t, j] = (probs / probs.sum(-1, keepdims=True)) @ v[b, :visible, j]
  return out


_attention = jax.jit(cpu_kernels.few_query_attention, static_argnums=4)


# (B, T, Hkv, G, Dh, S): the embedded model's decoding and verification shapes, slots that
# are not a multiple of 8 (a last block read past the cache's end), Dh of one 8-float
# vector and of more than 8 (values in two slices), one query head per kv head.
@needs_kernel
@pytest.mark.parametrize("shape", [(1, 1, 3, 3, 64, 512), (2, 4, 3, 3, 64, 37),
                                   (1, 3, 2, 4, 16, 9), (3, 2, 1, 1, 8, 100),
                                   (8, 2, 3, 3, 64, 640), (1, 2, 2, 2, 128, 20),
                                   (2, 64, 3, 3, 64, 100)])  # a prefill chunk
def test_attention_kernel_equals_the_float64_reference(shape):
  b, t, hkv, g, dh, s = shape
  rng = np.random.default_rng(s)
  q, k, v = _random(rng, b, t, hkv, g, dh), _random(rng, b, s, hkv, dh), _random(rng, b, s, hkv, dh)
  # Every visibility: the first slot only, a partial last block, past the cache's end.
  positions = rng.integers(0, s + 3, (b, t)).astype(np.int32)
  positions[0, 0] = 0
  positions[-1, -1] = s - 1
  got = _attention(q, k, v, positions, 0.125)
  assert got.shape == q.shape and got.dtype == jnp.float32
  # Probabilities sum to 1 and values are O(1): errors are a few float32 ulps of O(1).
  np.testing.assert_allclose(got, _attention_float64(q, k, v, positions, 0.125), rtol=0,
                             atol=2e-6)


@needs_kernel
def test_a_querys_attention_does_not_depend_on_its_companions():
  # What makes a token's attention the same decoded alone or verified among drafts, and a
  # row's the same in a batch of 1 or 8.
  rng = np.random.default_rng(3)
  q, k, v = _random(rng, 4, 5, 3, 3, 64), _random(rng, 4, 300, 3, 64), _random(rng, 4, 300, 3, 64)
  positions = np.asarray(rng.integers(50, 300, (4, 5)), np.int32)
  together = np.asarray(_attention(q, k, v, positions, 0.125))
  for rows, tokens in [(slice(0, 1), slice(0, 1)), (slice(2, 3), slice(1, 4)),
                       (slice(1, 4), slice(4, 5)), (slice(3, 4), slice(0, 5))]:
    alone = _attention(q[rows, tokens], k[rows], v[rows], positions[rows, tokens], 0.125)
    np.testing.assert_array_equal(np.asarray(alone), together[rows, tokens])


@needs_kernel
def test_attention_over_a_stacked_caches_layer_equals_that_layer_alone():
  # The decoder's stacked cache [L, B, S, Hkv, Dh] is read in place: the same bits as the
  # layer sliced out, for a static and a traced layer index.
  rng = np.random.default_rng(4)
  q = _random(rng, 2, 3, 3, 3, 64)
  k, v = _random(rng, 4, 2, 50, 3, 64), _random(rng, 4, 2, 50, 3, 64)
  positions = np.asarray(rng.integers(0, 50, (2, 3)), np.int32)
  stacked = jax.jit(cpu_kernels.few_query_attention, static_argnums=4)
  static = jax.jit(lambda q, k, v, p: cpu_kernels.few_query_attention(q, k, v, p, 0.125, 3))
  for layer in range(4):
    alone = np.asarray(_attention(q, k[layer], v[layer], positions, 0.125))
    np.testing.assert_array_equal(
        np.asarray(stacked(q, k, v, positions, 0.125, jnp.int32(layer))), alone)
  np.testing.assert_array_equal(np.asarray(static(q, k, v, positions)),
                                np.asarray(_attention(q, k[3], v[3], positions, 0.125)))
  with pytest.raises(Exception, match="layer index out of range"):
    jax.block_until_ready(stacked(q, k, v, positions, 0.125, jnp.int32(4)))


# Narrow storage goes through every path the float32 weights take (row groups, blocks,
# tiles, lone 8-float steps, scalar tails): its results must keep the float32 kernel's bits.
@needs_kernel
@pytest.mark.parametrize("rows,size_in,size_out", [
    (1, 576, 960), (2, 64, 13), (3, 40, 7), (4, 1536, 33), (5, 1536, 576), (8, 100, 50),
    (13, 37, 19), (32, 576, 960), (3, 5, 3)])
def test_float16_weights_give_the_float32_kernels_bits(rows, size_in, size_out):
  rng = np.random.default_rng(rows + size_in)
  x = _random(rng, rows, size_in)
  w16 = jnp.asarray(rng.standard_normal((size_out, size_in)), jnp.float16)
  got = np.asarray(jax.jit(cpu_kernels.few_row_matmul)(x, w16))
  want = np.asarray(jax.jit(cpu_kernels.few_row_matmul)(x, w16.astype(jnp.float32)))
  np.testing.assert_array_equal(got, want)


@needs_kernel
@pytest.mark.parametrize("rows,size_in,size_out", [
    (1, 576, 960), (2, 64, 13), (3, 96, 7), (4, 1536, 33), (8, 576, 50), (17, 32, 19)])
def test_int8_weights_give_the_float32_kernels_bits(rows, size_in, size_out):
  rng = np.random.default_rng(rows + size_in)
  x = _random(rng, rows, size_in)
  q, scale, w = q8_0_weights(rng, size_out, size_in)
  got = np.asarray(jax.jit(cpu_kernels.few_row_matmul_int8)(x, q, scale))
  want = np.asarray(jax.jit(cpu_kernels.few_row_matmul)(x, w))
  np.testing.assert_array_equal(got, want)


@needs_kernel
def test_int8_weights_need_a_scale_per_32():
  x = jnp.ones((2, 48), jnp.float32)
  with pytest.raises(Exception, match="multiple of 32"):
    jax.jit(cpu_kernels.few_row_matmul_int8)(x, jnp.ones((4, 48), jnp.int8),
                                             jnp.ones((4, 1), jnp.float32))
