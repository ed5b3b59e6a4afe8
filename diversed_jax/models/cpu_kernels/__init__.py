"""Hand-written XLA:CPU kernels, compiled on first use and registered as FFI targets.

- `few_row_matmul(x, w_oi)`: `x [rows, in] @ w_oi.T` for a few rows, reading each weight
  row once for all rows (see `few_row_matmul.cc` for why XLA's own products are slower);
  `w_oi` float32, or float16 (widened as it is read: the float32 result on the widened
  weights, for half the bytes); `few_row_matmul_int8(x, q, scale)` for int8 weights with a
  scale per 32 (`products.Int8Rows`).
- `few_query_attention(q, k, v, positions, scale, layer=None)`: grouped-query attention of
  a few new tokens over a KV cache in its stored layout, one layer's or, given `layer`,
  that layer of a stacked cache read in place (see `few_query_attention.cc`).

The C++ sources ship with the package and are compiled with the system's C++ compiler into
one library in a per-user cache the first time a kernel is asked for (a few seconds, once
per source version). Where that is impossible (no compiler, no AVX2/FMA, another platform),
`available()` is False and callers keep XLA's own ops; set DIVERSED_JAX_CPU_KERNELS=0 to
choose that path on purpose.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import os
import pathlib
import platform
import shutil
import subprocess
import tempfile

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np
from absl import logging

_SOURCES = tuple(pathlib.Path(__file__).with_name(name)
                 for name in ("few_row_matmul.cc", "few_query_attention.cc"))
_HEADERS = (pathlib.Path(__file__).with_name("parallel_chunks.h"),)
_MATMUL_TARGET = "diversed_jax_few_row_matmul"
_MATMUL_F16_TARGET = "diversed_jax_few_row_matmul_f16"
_MATMUL_INT8_TARGET = "diversed_jax_few_row_matmul_int8"
_ATTENTION_TARGET = "diversed_jax_few_query_attention"
# No FMA contraction of the scalar tails: their rounding must not depend on the compiler's
# choices in each kernel path.
_FLAGS = ("-O3", "-std=c++17", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-fPIC",
          "-shared")
ENV_SWITCH = "DIVERSED_JAX_CPU_KERNELS"


def _cache_dir() -> pathlib.Path:
  root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return pathlib.Path(root) / "diversed_jax" / "cpu_kernels"


def _compile(compiler: str) -> pathlib.Path:
  """The shared library for this source, jax, compiler and flag set (built once, then
  reused)."""
  key = hashlib.sha256(b"\0".join([*(path.read_bytes() for path in _SOURCES + _HEADERS),
                                    jax.__version__.encode(), jaxlib.__version__.encode(),
                                    compiler.encode(),
                                    " ".join(_FLAGS).encode()]))
  library = _cache_dir() / f"cpu_kernels-{key.hexdigest()[:16]}.so"
  if library.exists():
    return library
  logging.info("cpu_kernels: compiling the kernels into %s (once)", library)
  library.parent.mkdir(parents=True, exist_ok=True)
  # Build beside the target and rename: concurrent first uses never load a partial file.
  with tempfile.TemporaryDirectory(dir=library.parent) as tmp:
    built = pathlib.Path(tmp) / library.name
    command = [compiler, *_FLAGS, f"-I{jax.ffi.include_dir()}", *map(str, _SOURCES), "-o",
               str(built)]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
      raise RuntimeError(f"{' '.join(command)} failed:\n{result.stderr[-2000:]}")
    os.replace(built, library)
  return library


def runs_here(dtype) -> bool:
  """Whether the kernels serve arrays of `dtype` in the program being traced: float32 on
  a single CPU device (several devices keep XLA's ops, which its SPMD partitioner can split;
  it would gather a custom call's operands) where `available()`."""
  return (jnp.dtype(dtype) == jnp.float32 and jax.default_backend() == "cpu"
          and jax.device_count() == 1 and available())


def available() -> bool:
  """Whether the kernels can run here (compiled, loaded and registered on first call).

  Read when a caller is traced: set DIVERSED_JAX_CPU_KERNELS before the first compilation.
  """
  return os.environ.get(ENV_SWITCH, "1") != "0" and _library() is not None


@functools.cache
def _library() -> ctypes.CDLL | None:
  """The kernels' library, compiled, loaded and registered; None where they cannot run."""
  if platform.machine().lower() not in ("x86_64", "amd64"):
    return None
  compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
  if compiler is None:
    logging.warning("cpu_kernels: no C++ compiler found; XLA's own ops are used.")
    return None
  try:
    library = ctypes.cdll.LoadLibrary(str(_compile(compiler)))
  except (OSError, RuntimeError) as error:
    logging.warning("cpu_kernels: could not build the kernels (%s); XLA's own ops are used.",
                    error)
    return None
  if not library.FewRowMatmulSupported():
    logging.warning("cpu_kernels: this CPU lacks AVX2, FMA or F16C; XLA's own ops are used.")
    return None
  library.FewRowMatmulMinTileRows.restype = ctypes.c_int64
  library.FewRowMatmulSetMinTileRows.argtypes = [ctypes.c_int64]
  jax.ffi.register_ffi_target(_MATMUL_TARGET, jax.ffi.pycapsule(library.FewRowMatmulHandler),
                              platform="cpu")
  jax.ffi.register_ffi_target(_MATMUL_F16_TARGET,
                              jax.ffi.pycapsule(library.FewRowMatmulF16Handler), platform="cpu")
  jax.ffi.register_ffi_target(_MATMUL_INT8_TARGET,
                              jax.ffi.pycapsule(library.FewRowMatmulInt8Handler), platform="cpu")
  jax.ffi.register_ffi_target(_ATTENTION_TARGET,
                              jax.ffi.pycapsule(library.FewQueryAttentionHandler), platform="cpu")
  return library


@contextlib.contextmanager
def min_tile_rows(rows: int):
  """Within it, `few_row_matmul` multiplies `rows` or more rows in register tiles and
  fewer in row streams (on AVX-512 hosts; elsewhere always row streams). Outside it the
  kernel uses its host's measured default (see `few_row_matmul.cc`, `MinTileRows`): the
  results are bitwise the same either way, only the speed differs. For tests and
  measurements.
  """
  if rows < 1:
    raise ValueError(f"min_tile_rows: rows must be at least 1, got {rows}")
  library = _library()
  if library is None:
    raise RuntimeError("min_tile_rows: the CPU kernels are not available on this host")
  outer = int(library.FewRowMatmulMinTileRows())  # restored on exit, so contexts nest
  library.FewRowMatmulSetMinTileRows(rows)
  try:
    yield
  finally:
    library.FewRowMatmulSetMinTileRows(outer)


def tile_rows() -> int:
  """The rows from which `few_row_matmul` now uses register tiles: the host's default, or
  `min_tile_rows`' within it; 0 where it never does (no AVX-512, or the kernels not
  `available()`)."""
  return int(_library().FewRowMatmulMinTileRows()) if available() else 0


def _call(x_mi: jax.Array, w_oi: jax.Array) -> jax.Array:
  out = jax.ShapeDtypeStruct((x_mi.shape[0], w_oi.shape[0]), jnp.float32)
  target = _MATMUL_F16_TARGET if w_oi.dtype == jnp.float16 else _MATMUL_TARGET
  # "sequential": under vmap each mapped slice is its own call (correct for any in_axes).
  return jax.ffi.ffi_call(target, out, vmap_method="sequential")(x_mi, w_oi)


@jax.custom_vjp
def few_row_matmul(x_mi: jax.Array, w_oi: jax.Array) -> jax.Array:
  """x_mi [rows, in] float32 times w_oi [out, in] float32 or float16 on `in`: [rows, out]
  float32 (float16 weights widened exactly: the float32 product of the widened weights).

  Call only where `available()` is True. Differentiable: the backward pass uses XLA's
  products (training is not what this kernel is for).
  """
  return _call(x_mi, w_oi)


def _forward(x_mi, w_oi):
  return _call(x_mi, w_oi), (x_mi, w_oi)


def _backward(residuals, dy_mo):
  x_mi, w_oi = residuals
  return dy_mo @ w_oi.astype(jnp.float32), (dy_mo.T @ x_mi).astype(w_oi.dtype)


few_row_matmul.defvjp(_forward, _backward)


def few_row_matmul_int8(x_mi: jax.Array, q_oi: jax.Array, scale_ob: jax.Array) -> jax.Array:
  """x_mi [rows, in] float32 times the weights q_oi [out, in] int8 * scale_ob [out, in / 32]
  float32 (one scale per 32 weights; `in` a multiple of 32): [rows, out] float32, bitwise
  `few_row_matmul` of the float32 weights where q * scale is exact in float32.

  Call only where `available()` is True. Not differentiable (inference only).
  """
  out = jax.ShapeDtypeStruct((x_mi.shape[0], q_oi.shape[0]), jnp.float32)
  return jax.ffi.ffi_call(_MATMUL_INT8_TARGET, out, vmap_method="sequential")(
      x_mi, q_oi, scale_ob)


def few_query_attention(q_btkgd: jax.Array, k_bskd: jax.Array, v_bskd: jax.Array,
                        positions_bt: jax.Array, scale: float,
                        layer: jax.Array | int | None = None) -> jax.Array:
  """softmax(scale * q . k) v over the slots s <= positions_bt[b, t], per kv head k and its
  G query heads: q [B, T, Hkv, G, Dh], k and v [B, S, Hkv, Dh] float32, positions [B, T]
  int32 (at least 0); returns [B, T, Hkv, G, Dh] float32. Dh must be a multiple of 8.

  With `layer` (an int32 scalar, traced or not), k and v are stacked caches
  [L, B, S, Hkv, Dh] and the kernel reads layer `layer` of them in place, with the same
  bits as on that layer alone: slicing it out first would copy it.

  Call only where `available()` is True. Not differentiable: `models.attention` wraps it
  with a gradient through XLA's grouped form.
  """
  if layer is None:  # one layer's cache: a stack of one (a reshape, no copy)
    k_bskd, v_bskd, layer = k_bskd[None], v_bskd[None], 0
  out = jax.ShapeDtypeStruct(q_btkgd.shape, jnp.float32)
  return jax.ffi.ffi_call(_ATTENTION_TARGET, out, vmap_method="sequential")(
      q_btkgd, k_bskd, v_bskd, positions_bt.astype(jnp.int32), jnp.asarray(layer, jnp.int32),
      scale=np.float32(scale))
