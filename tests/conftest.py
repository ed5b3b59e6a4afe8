"""Test set-up: CPU only, several fake devices for sharding tests, no network, and compiled
programs released after each test module."""

import gc
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import jax  # noqa: E402  (after the platform is chosen)
import pytest  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
  """XLA:CPU maps each compiled kernel's code and data into the process. A pytest-xdist
  worker runs half the suite, thousands of programs, in one process, and, with every
  program kept in jit's caches, passes the kernel's limit on memory mappings
  (vm.max_map_count, 65530 by default): the next compile then segfaults. Dropping the
  caches after each module frees the programs that module's tests no longer hold."""
  yield
  jax.clear_caches()
  gc.collect()
