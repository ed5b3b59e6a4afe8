"""The few-row product form of `models.products` against a plain contraction."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from diversed_jax.models import products


def _primitives(fn, *args):
  return {eqn.primitive.name for eqn in jax.make_jaxpr(fn)(*args).eqns}


@pytest.mark.parametrize("lead", [(1,), (2,), (3,), (5,), (1, 5), (2, 4), (4, 4), (3, 7), (33,)])
def test_matmul_oi_equals_the_contraction(lead):
  rng = np.random.default_rng(len(lead) * 10 + lead[-1])
  x = jnp.asarray(rng.standard_normal((*lead, 48)), jnp.float32)
  w_oi = jnp.asarray(rng.standard_normal((40, 48)), jnp.float32)
  got = jax.jit(products.matmul_oi)(x, w_oi)
  want = np.einsum("...i,oi->...o", np.asarray(x, np.float64), np.asarray(w_oi, np.float64))
  assert got.shape == (*lead, 40)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows,fused", [(1, False), (2, True), (5, True), (32, True),
                                        (33, False), (40, False)])
def test_few_rows_take_the_fused_form_on_cpu(rows, fused):
  x = jnp.ones((rows, 8), jnp.float32)
  w_oi = jnp.ones((6, 8), jnp.float32)
  prims = _primitives(products.matmul_oi, x, w_oi)
  assert ("dot_general" not in prims) == fused, prims
  assert products.uses_fused_form(rows, jnp.float32) == fused


def test_other_dtypes_keep_the_dot():
  x = jnp.ones((4, 8), jnp.bfloat16)
  w_oi = jnp.ones((6, 8), jnp.bfloat16)
  assert "dot_general" in _primitives(products.matmul_oi, x, w_oi)


def test_fused_form_has_gradients():
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((3, 8)), jnp.float32)
  w_oi = jnp.asarray(rng.standard_normal((6, 8)), jnp.float32)
  loss = lambda f: lambda x, w: jnp.sum(jnp.sin(f(x, w)))
  plain = lambda x, w: jnp.einsum("mi,oi->mo", x, w)
  for got, want in zip(jax.grad(loss(products.matmul_oi), (0, 1))(x, w_oi),
                       jax.grad(loss(plain), (0, 1))(x, w_oi)):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
