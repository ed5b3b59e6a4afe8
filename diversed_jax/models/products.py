"""Products `x @ W.T` with the weight stored [out, in], in the form XLA:CPU runs fastest.

XLA:CPU runs a product over one row as a GEMV near memory bandwidth, but products over a
few rows (the K+1 tokens one sequence verifies, a small batch's decoding step) go to GEMM
kernels that take 2-3x the GEMV's time, though they read the same weights. Written as a
broadcast multiply and a sum over `in`, the same contraction becomes one fused loop
(XLA:CPU's YNNPACK fusion) that takes 0.7-0.85x the GEMM's time for 2 to 8 rows and
~0.9x for 16 to 32 (measured on the embedded model's matrices; at 40 rows it is no
faster). It is far slower for one row, so one row stays a dot. Rows are padded to a
multiple of 4: the fused loop is slower at 5 or 6 rows than at 8.
`benchmarks/product_speed.py` times both forms in the embedded model's forward.

Other backends (GPU, TPU), other dtypes and more rows keep the plain dot.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

# Row counts (all leading axes of x together) that use the fused form on CPU.
# benchmarks/product_speed.py sets MAX_FUSED_ROWS = 0 for its A/B of whole models.
MIN_FUSED_ROWS = 2
MAX_FUSED_ROWS = 32
_ROW_MULTIPLE = 4


def uses_fused_form(num_rows: int, dtype) -> bool:
  """Whether `matmul_oi` takes the fused multiply-and-sum form (decided at trace time)."""
  return (MIN_FUSED_ROWS <= num_rows <= MAX_FUSED_ROWS
          and jnp.dtype(dtype) == jnp.float32
          and jax.default_backend() == "cpu")


def matmul_oi(x: jax.Array, w_oi: jax.Array, preferred_element_type=None) -> jax.Array:
  """x [..., in] times w_oi [out, in] contracted on `in`: [..., out]."""
  lead = x.shape[:-1]
  rows = math.prod(lead)
  if not uses_fused_form(rows, jnp.result_type(x, w_oi)):
    return jnp.einsum("...i,oi->...o", x, w_oi, preferred_element_type=preferred_element_type)
  x_mi = x.reshape(rows, x.shape[-1])
  padded = -(-rows // _ROW_MULTIPLE) * _ROW_MULTIPLE
  x_mi = jnp.pad(x_mi, ((0, padded - rows), (0, 0)))
  # [out, rows, in] summed over `in`: each weight row is read once for all rows.
  y_om = jnp.sum(w_oi[:, None, :] * x_mi[None, :, :], axis=-1)
  return y_om.T[:rows].reshape(*lead, w_oi.shape[0])
