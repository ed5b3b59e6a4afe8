"""The few-row product forms of `models.products` against a plain contraction."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from diversed_jax.models import cpu_kernels, products

from tests.q8 import q8_0_weights


def _primitives(fn, *args):
  return {eqn.primitive.name for eqn in jax.make_jaxpr(fn)(*args).eqns}


@pytest.fixture(params=["kernel", "fused"])
def few_row_form(request, monkeypatch):
  """Runs a test with the kernel and, separately, with the fused fallback."""
  if request.param == "kernel" and not cpu_kernels.available():
    pytest.skip("the few-row kernel cannot be built here")
  if request.param == "fused":
    monkeypatch.setattr(cpu_kernels, "available", lambda: False)
  jax.clear_caches()  # the form is chosen at trace time
  yield request.param
  jax.clear_caches()


@pytest.mark.parametrize("lead", [(1,), (2,), (3,), (5,), (1, 5), (2, 4), (4, 4), (3, 7), (33,)])
def test_matmul_oi_equals_the_contraction(lead, few_row_form):
  rng = np.random.default_rng(len(lead) * 10 + lead[-1])
  x = jnp.asarray(rng.standard_normal((*lead, 48)), jnp.float32)
  w_oi = jnp.asarray(rng.standard_normal((40, 48)), jnp.float32)
  got = jax.jit(products.matmul_oi)(x, w_oi)
  want = np.einsum("...i,oi->...o", np.asarray(x, np.float64), np.asarray(w_oi, np.float64))
  assert got.shape == (*lead, 40)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [0, 1, 2, 5, 32, 33, 40, 64, 65])
def test_few_rows_take_the_kernel_or_the_fused_form_on_cpu(rows, few_row_form):
  x = jnp.ones((rows, 8), jnp.float32)
  w_oi = jnp.ones((6, 8), jnp.float32)
  prims = _primitives(products.matmul_oi, x, w_oi)
  # The kernel takes 1-64 rows (one row as fast as XLA's GEMV, a 64-token prefill pass
  # faster than XLA's GEMM); the fused form 2-32.
  has_form = {"kernel": 1 <= rows <= 64, "fused": 2 <= rows <= 32}[few_row_form]
  form = few_row_form if has_form else "dot"
  assert products.product_form(rows, jnp.float32) == form
  assert ("dot_general" in prims) == (form == "dot"), prims
  assert ("custom_vjp_call" in prims) == (form == "kernel"), prims


@pytest.mark.parametrize("rows", [65, 80, 200])
def test_row_independent_products_take_the_kernel_past_its_row_limit(rows, few_row_form):
  """Inside `row_independent` every row rounds as it would alone (the kernel for any row
  count where it runs); outside, more than 64 rows take XLA's dot."""
  rng = np.random.default_rng(rows)
  x = jnp.asarray(rng.standard_normal((rows, 96)), jnp.float32)
  w_oi = jnp.asarray(rng.standard_normal((40, 96)), jnp.float32)
  # Fresh functions: a traced function is cached without the context in its key.
  matmul = lambda: lambda x, w: products.matmul_oi(x, w)
  assert "dot_general" in _primitives(matmul(), x, w_oi)
  with products.row_independent():
    form = products.product_form(rows, jnp.float32)
    prims = _primitives(matmul(), x, w_oi)
    together = jax.jit(matmul())(x, w_oi)
    alone = [jax.jit(matmul())(x[i:i + 1], w_oi) for i in (0, rows // 2, rows - 1)]
  assert products.product_form(rows, jnp.float32) == "dot"  # the context has ended
  if few_row_form == "fused":  # no kernel: nothing to make row-independent
    assert form == "dot" and "dot_general" in prims
    return
  assert form == "kernel" and "dot_general" not in prims, prims
  for i, row in zip((0, rows // 2, rows - 1), alone):
    np.testing.assert_array_equal(together[i:i + 1], row)


def test_forced_forms_apply_only_where_they_can():
  unforced = products.product_form(4, jnp.float32)
  with products.forced_form("fused"):
    assert products.product_form(1, jnp.float32) == "dot"  # one row has no fused form
    assert products.product_form(4, jnp.float32) == "fused"
    with products.forced_form("dot"):
      assert products.product_form(4, jnp.float32) == "dot"
    assert products.product_form(4, jnp.float32) == "fused"
  assert products.product_form(4, jnp.float32) == unforced
  with pytest.raises(ValueError, match="form must be one of .*'gemm'"):
    with products.forced_form("gemm"):
      pass


def test_other_dtypes_keep_the_dot():
  x = jnp.ones((4, 8), jnp.bfloat16)
  w_oi = jnp.ones((6, 8), jnp.bfloat16)
  assert "dot_general" in _primitives(products.matmul_oi, x, w_oi)


@pytest.mark.parametrize("x_dtype,w_dtype", [("float32", "bfloat16"), ("bfloat16", "float32"),
                                             ("float16", "float32"), ("float32", "int8")])
def test_operands_the_kernel_does_not_take_keep_the_dot(x_dtype, w_dtype, few_row_form):
  # Their promoted dtype is float32, but the kernel's handlers take float32 x with float32
  # or float16 weights only; choosing it by the promoted dtype failed at run time.
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((3, 64)), x_dtype)
  w_oi = jnp.asarray(rng.standard_normal((16, 64)) * (10 if w_dtype == "int8" else 1), w_dtype)
  got = jax.jit(products.matmul_oi)(x, w_oi)
  want = np.asarray(x, np.float64) @ np.asarray(w_oi, np.float64).T
  np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=2e-2, atol=2e-1)


def test_few_row_forms_have_gradients(few_row_form):
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((3, 8)), jnp.float32)
  w_oi = jnp.asarray(rng.standard_normal((6, 8)), jnp.float32)
  loss = lambda f: lambda x, w: jnp.sum(jnp.sin(f(x, w)))
  plain = lambda x, w: jnp.einsum("mi,oi->mo", x, w)
  for got, want in zip(jax.grad(loss(products.matmul_oi), (0, 1))(x, w_oi),
                       jax.grad(loss(plain), (0, 1))(x, w_oi)):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_int8_rows_keep_exactly_what_they_can():
  rng = np.random.default_rng(3)
  _, _, w = q8_0_weights(rng, 6, 64)
  rows = products.Int8Rows.from_exact(w)
  assert rows is not None and rows.q_oi.dtype == jnp.int8 and rows.shape == (6, 64)
  np.testing.assert_array_equal(rows.dequantize(), w)
  w[2, 5] += 1e-4  # off the block's grid
  assert products.Int8Rows.from_exact(w) is None
  assert products.Int8Rows.from_exact(w[:, :48]) is None  # no whole blocks


def test_narrow_weights_give_the_float32_products(few_row_form):
  rng = np.random.default_rng(4)
  x = jnp.asarray(rng.standard_normal((3, 64)), jnp.float32)
  w16 = jnp.asarray(rng.standard_normal((10, 64)), jnp.float16)
  np.testing.assert_array_equal(jax.jit(products.matmul_oi)(x, w16),
                                jax.jit(products.matmul_oi)(x, w16.astype(jnp.float32)))
  _, _, w = q8_0_weights(rng, 10, 64)
  rows = products.Int8Rows.from_exact(w)
  np.testing.assert_array_equal(jax.jit(products.matmul_oi)(x, rows),
                                jax.jit(products.matmul_oi)(x, jnp.asarray(w)))
