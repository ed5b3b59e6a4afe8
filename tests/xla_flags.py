"""XLA flags of the tests: fast compiles, with full optimisation where a program runs long.

The suite compiles thousands of programs for tiny models and runs most of them briefly, and
LLVM's optimisation of XLA:CPU's generated code (level 3, XLA's default) costs more than it
saves: without it (level 0) the 4-device sharding script of session 50 took 60 s instead
of 111 s, the notebook 52 s instead of 67 s; loop_test.py 345 s instead of 452 s, and the
whole suite 2,374 CPU seconds instead of 2,637 (session 54). The level leaves XLA's
graph passes alone (fusion, the library calls of products), and LLVM keeps IEEE results at
every level (XLA:CPU does not enable fast-math), so the tests check the programs users run.

Monte Carlo harnesses that run a program over 10^5 rounds are up to 8x slower at level 0
(verification_test.py: 1,211 s instead of 325 s), so they compile with `OPTIMIZED`, which
overrides the process's level for one jit.
"""

import os

FAST_COMPILE = "--xla_backend_optimization_level=0"

# jax.jit(..., compiler_options=OPTIMIZED): XLA's default level for this program only.
OPTIMIZED = {"xla_backend_optimization_level": 3}


def flags(devices: int = 1) -> str:
  """XLA_FLAGS for a test subprocess: fast compiles, and `devices` fake CPU devices."""
  extra = [f"--xla_force_host_platform_device_count={devices}"] if devices > 1 else []
  return " ".join([FAST_COMPILE] + extra)


def use_fast_compiles() -> None:
  """Adds FAST_COMPILE to os.environ's XLA_FLAGS: this process's compiles (XLA reads the
  variable at its first compile, so call this before any) and its subprocesses'."""
  current = os.environ.get("XLA_FLAGS", "")
  if FAST_COMPILE not in current:
    os.environ["XLA_FLAGS"] = f"{current} {FAST_COMPILE}".strip()
