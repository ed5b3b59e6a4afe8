"""Hand-written XLA:CPU kernels, compiled on first use and registered as FFI targets.

`few_row_matmul(x, w_oi)` is the one kernel: `x [rows, in] @ w_oi.T` for a few rows, reading
each weight row once for all rows (see `few_row_matmul.cc` for why XLA's own products are
slower there). The C++ source ships with the package and is compiled with the system's C++
compiler into a per-user cache the first time it is asked for (a few seconds, once per
source version). Where that is impossible (no compiler, no AVX2/FMA, another platform),
`available()` is False and callers keep XLA's products; set DIVERSED_JAX_CPU_KERNELS=0 to
choose that path on purpose.
"""

from __future__ import annotations

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
from absl import logging

_SOURCE = pathlib.Path(__file__).with_name("few_row_matmul.cc")
_TARGET_NAME = "diversed_jax_few_row_matmul"
_FLAGS = ("-O3", "-std=c++17", "-mavx2", "-mfma", "-fPIC", "-shared")
ENV_SWITCH = "DIVERSED_JAX_CPU_KERNELS"


def _cache_dir() -> pathlib.Path:
  root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return pathlib.Path(root) / "diversed_jax" / "cpu_kernels"


def _compile(compiler: str) -> pathlib.Path:
  """The shared library for this source, jax, compiler and flag set (built once, then
  reused)."""
  key = hashlib.sha256(b"\0".join([_SOURCE.read_bytes(), jax.__version__.encode(),
                                    compiler.encode(), " ".join(_FLAGS).encode()]))
  library = _cache_dir() / f"few_row_matmul-{key.hexdigest()[:16]}.so"
  if library.exists():
    return library
  logging.info("cpu_kernels: compiling the few-row kernel into %s (once)", library)
  library.parent.mkdir(parents=True, exist_ok=True)
  # Build beside the target and rename: concurrent first uses never load a partial file.
  with tempfile.TemporaryDirectory(dir=library.parent) as tmp:
    built = pathlib.Path(tmp) / library.name
    command = [compiler, *_FLAGS, f"-I{jax.ffi.include_dir()}", str(_SOURCE), "-o", str(built)]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
      raise RuntimeError(f"{' '.join(command)} failed:\n{result.stderr[-2000:]}")
    os.replace(built, library)
  return library


def available() -> bool:
  """Whether `few_row_matmul` can run here (compiled, loaded and registered on first call).

  Read when a caller is traced: set DIVERSED_JAX_CPU_KERNELS before the first compilation.
  """
  return os.environ.get(ENV_SWITCH, "1") != "0" and _built()


@functools.cache
def _built() -> bool:
  if platform.machine().lower() not in ("x86_64", "amd64"):
    return False
  compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
  if compiler is None:
    logging.warning("cpu_kernels: no C++ compiler found; XLA's few-row products are used.")
    return False
  try:
    library = ctypes.cdll.LoadLibrary(str(_compile(compiler)))
  except (OSError, RuntimeError) as error:
    logging.warning("cpu_kernels: could not build the few-row kernel (%s); XLA's few-row "
                    "products are used.", error)
    return False
  if not library.FewRowMatmulSupported():
    return False
  jax.ffi.register_ffi_target(_TARGET_NAME, jax.ffi.pycapsule(library.FewRowMatmulHandler),
                              platform="cpu")
  return True


def _call(x_mi: jax.Array, w_oi: jax.Array) -> jax.Array:
  out = jax.ShapeDtypeStruct((x_mi.shape[0], w_oi.shape[0]), jnp.float32)
  # "sequential": under vmap each mapped slice is its own call (correct for any in_axes).
  return jax.ffi.ffi_call(_TARGET_NAME, out, vmap_method="sequential")(x_mi, w_oi)


@jax.custom_vjp
def few_row_matmul(x_mi: jax.Array, w_oi: jax.Array) -> jax.Array:
  """x_mi [rows, in] float32 times w_oi [out, in] float32 on `in`: [rows, out].

  Call only where `available()` is True. Differentiable: the backward pass uses XLA's
  products (training is not what this kernel is for).
  """
  return _call(x_mi, w_oi)


def _forward(x_mi, w_oi):
  return _call(x_mi, w_oi), (x_mi, w_oi)


def _backward(residuals, dy_mo):
  x_mi, w_oi = residuals
  return dy_mo @ w_oi, dy_mo.T @ x_mi


few_row_matmul.defvjp(_forward, _backward)
