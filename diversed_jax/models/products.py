"""Products `x @ W.T` with the weight stored [out, in], in the form XLA:CPU runs fastest.

XLA:CPU runs a product over one row as a GEMV near memory bandwidth, but products over a
few rows (the K+1 tokens one sequence verifies, a small batch's decoding step) go to GEMM
kernels that take 2-3x the GEMV's time, though they read the same weights. Three forms:

- "kernel": `cpu_kernels.few_row_matmul`, a hand-written FFI kernel that streams each
  weight row once for all rows on XLA's threads. Used on a single CPU device for 1 to
  MAX_KERNEL_ROWS float32 rows whenever it could be built (`cpu_kernels.available()`): a
  batch-1 prefill pass of 64 tokens too (1.1-1.3x faster than XLA's dot there), one row
  too, where it streams as fast as XLA's GEMV or faster, so plain decoding and verification
  share one product and each row's result is bitwise the same whatever the number of rows
  beside it. Several devices keep XLA's forms, which its SPMD partitioner can split (it
  would gather a custom call's operands).
- "fused": the contraction written as a broadcast multiply and a sum over `in`, which
  XLA:CPU turns into one fused loop (its YNNPACK fusion) that takes 0.7-0.85x the GEMM's
  time for 2 to 8 rows and ~0.9x for 16 to 32; far slower for one row. The CPU fallback
  for 2 to MAX_FEW_ROWS rows where the kernel is unavailable; rows padded to a multiple
  of 4 (the loop is slower at 5 or 6 rows than at 8).
- "dot": everything else (other backends and dtypes, more rows).

The speculative loop traces its greedy rounds inside `row_independent()`, where the kernel
takes any number of rows: a verification of B (K + 1) rows then rounds each row as a plain
decoding step of B rows does, even past MAX_KERNEL_ROWS, so greedy speculative decoding
stays plain greedy decoding at any batch size and K. Everything else keeps XLA's dot for
many rows, where it is faster.

Weights may also be stored narrower, for fewer bytes read a step with the same results:
float16 (where it holds every value) or `Int8Rows`; the kernel widens them exactly as it
reads them, and the other forms widen them first.

`benchmarks/product_speed.py` times the forms in the embedded model's forward.
"""

from __future__ import annotations

import contextlib
import contextvars
import math

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from diversed_jax.models import cpu_kernels

# Row counts (all leading axes of x together) that take the kernel (1 to MAX_KERNEL_ROWS)
# or the fused form (MIN_FUSED_ROWS to MAX_FEW_ROWS) on CPU. Beyond 64 rows XLA's GEMM is
# as fast as the kernel's tiles or faster (their rows of x no longer stay in L2).
MIN_FUSED_ROWS = 2
MAX_FEW_ROWS = 32
MAX_KERNEL_ROWS = 64
_ROW_MULTIPLE = 4
FORMS = ("kernel", "fused", "dot")

# Read at trace time: the form set by `forced_form()`, and True within `row_independent()`.
_FORCED_FORM = contextvars.ContextVar("forced_form", default=None)
_ANY_ROWS_TO_KERNEL = contextvars.ContextVar("any_rows_to_kernel", default=False)


@contextlib.contextmanager
def forced_form(form: str):
  """Products traced within it take `form` (one of FORMS) wherever that form applies, else
  a dot: benchmarks compile one model per form. Like `row_independent()`, it changes only
  functions traced inside (jit's cache key does not see it: jax.clear_caches() first)."""
  if form not in FORMS:
    raise ValueError(f"form must be one of {FORMS}, got {form!r}")
  token = _FORCED_FORM.set(form)
  try:
    yield
  finally:
    _FORCED_FORM.reset(token)


@contextlib.contextmanager
def row_independent():
  """Products traced within it take the kernel wherever it runs, whatever their number of
  rows, so each row's result is bitwise the same however many rows share the call (the
  kernel accumulates every output in one order); attention takes its kernel for any number
  of tokens likewise (`attention.attention_form`). Only functions traced inside are
  affected; a jitted function traced before keeps its forms."""
  token = _ANY_ROWS_TO_KERNEL.set(True)
  try:
    yield
  finally:
    _ANY_ROWS_TO_KERNEL.reset(token)


def in_row_independent() -> bool:
  """Whether tracing is inside `row_independent()`."""
  return _ANY_ROWS_TO_KERNEL.get()


INT8_BLOCK = 32  # weights per scale in Int8Rows


@flax.struct.dataclass
class Int8Rows:
  """A weight matrix [out, in] stored as int8 q and a float32 scale per 32 weights of a row:
  w = q * scale, exact in float32 for a scale with at most 16 significant bits, as GGUF's
  Q8_0 blocks (a float16 scale). A quarter of float32's bytes, plus 1/32 for the scales."""
  q_oi: jax.Array  # int8 [out, in]
  scale_ob: jax.Array  # float32 [out, in / INT8_BLOCK]

  @property
  def shape(self) -> tuple[int, int]:
    return self.q_oi.shape

  def dequantize(self) -> jax.Array:
    q_obk = self.q_oi.reshape(self.shape[0], -1, INT8_BLOCK).astype(jnp.float32)
    return (q_obk * self.scale_ob[:, :, None]).reshape(self.shape)

  @staticmethod
  def from_exact(w_oi) -> "Int8Rows | None":
    """`w_oi` [out, in] float32 as Int8Rows, or None unless that keeps every value: each
    block of 32 has a float16 scale (its largest magnitude / 127) and integer multiples
    of it in [-127, 127], as a Q8_0 tensor dequantized."""
    w = np.asarray(w_oi)
    if w.ndim != 2 or w.shape[1] % INT8_BLOCK or w.dtype != np.float32:
      return None
    blocks = w.reshape(w.shape[0], -1, INT8_BLOCK)
    scale = (np.abs(blocks).max(-1) / 127).astype(np.float16).astype(np.float32)
    q = np.round(blocks / np.where(scale == 0, 1, scale)[:, :, None])
    if np.abs(q).max(initial=0) > 127:
      return None
    q = q.astype(np.int8)
    if not np.array_equal(q.astype(np.float32) * scale[:, :, None], blocks):
      return None
    return Int8Rows(jnp.asarray(q.reshape(w.shape)), jnp.asarray(scale))


def product_form(num_rows: int, dtype, kernel_operands: bool = True) -> str:
  """The form `matmul_oi` takes for `num_rows` rows of `dtype` (decided at trace time).
  kernel_operands: whether the kernel's handlers take the operands themselves (float32 x;
  float32 or float16 weights), not only their promoted dtype."""
  on_cpu_f32 = jnp.dtype(dtype) == jnp.float32 and jax.default_backend() == "cpu"
  row_limit = math.inf if in_row_independent() else MAX_KERNEL_ROWS
  kernel = (1 <= num_rows <= row_limit and kernel_operands
            and cpu_kernels.runs_here(dtype))
  fused = on_cpu_f32 and MIN_FUSED_ROWS <= num_rows <= MAX_FEW_ROWS
  forced = _FORCED_FORM.get()
  if forced is not None:
    return forced if {"kernel": kernel, "fused": fused, "dot": True}[forced] else "dot"
  return "kernel" if kernel else "fused" if fused else "dot"


def matmul_oi(x: jax.Array, w_oi: jax.Array, preferred_element_type=None) -> jax.Array:
  """x [..., in] times w_oi [out, in] (an array, or `Int8Rows`) contracted on `in`:
  [..., out]."""
  lead = x.shape[:-1]
  rows = math.prod(lead)
  if isinstance(w_oi, Int8Rows):
    if product_form(rows, x.dtype) != "kernel":
      return matmul_oi(x, w_oi.dequantize(), preferred_element_type)
    return cpu_kernels.few_row_matmul_int8(x.reshape(rows, x.shape[-1]), w_oi.q_oi,
                                           w_oi.scale_ob).reshape(*lead, w_oi.shape[0])
  form = product_form(rows, jnp.result_type(x, w_oi),
                      x.dtype == jnp.float32 and w_oi.dtype in (jnp.float32, jnp.float16))
  if form == "dot":
    return jnp.einsum("...i,oi->...o", x, w_oi, preferred_element_type=preferred_element_type)
  x_mi = x.reshape(rows, x.shape[-1])
  if form == "kernel":
    return cpu_kernels.few_row_matmul(x_mi, w_oi).reshape(*lead, w_oi.shape[0])
  padded = -(-rows // _ROW_MULTIPLE) * _ROW_MULTIPLE
  x_mi = jnp.pad(x_mi, ((0, padded - rows), (0, 0)))
  # [out, rows, in] summed over `in`: each weight row is read once for all rows.
  y_om = jnp.sum(w_oi[:, None, :] * x_mi[None, :, :], axis=-1)
  return y_om.T[:rows].reshape(*lead, w_oi.shape[0])
