"""XLA flags of the test subprocesses: fast compiles.

The subprocesses (entry points end to end, fake-device meshes, two-process jobs) compile
many programs for tiny models and run each briefly, and LLVM's optimisation of XLA:CPU's
generated code (level 3, XLA's default) costs them more than it saves: without it (level
0) the 4-device sharding script took 60 s instead of 111 s, the notebook 52 s instead of
67 s. The level leaves XLA's graph passes alone (fusion, the library calls of products),
and LLVM keeps IEEE results at every level (XLA:CPU does not enable fast-math), so they
check the programs users run. The test processes keep XLA's default: their Monte Carlo
tests run programs over 10^5 rounds, up to 8x slower at level 0.
"""

import os

import jax

FAST_COMPILE = "--xla_backend_optimization_level=0"


def flags(devices: int = 1) -> str:
  """XLA_FLAGS for a test subprocess: fast compiles, and `devices` fake CPU devices."""
  extra = [f"--xla_force_host_platform_device_count={devices}"] if devices > 1 else []
  return " ".join([FAST_COMPILE] + extra)


def for_subprocesses() -> None:
  """Adds FAST_COMPILE to os.environ's XLA_FLAGS, which subprocesses inherit, after this
  process has compiled a program: XLA reads the variable once, at its first compile, so
  this process keeps its own flags."""
  jax.jit(lambda x: x + 1)(0).block_until_ready()
  current = os.environ.get("XLA_FLAGS", "")
  if FAST_COMPILE not in current:
    os.environ["XLA_FLAGS"] = f"{current} {FAST_COMPILE}".strip()
