"""Test set-up: CPU only, no network, fast compiles (tests/xla_flags.py), and compiled
programs released before they exhaust the process's memory mappings."""

import gc
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from tests import xla_flags  # noqa: E402

xla_flags.use_fast_compiles()  # before jax compiles anything, in every pytest-xdist worker

import jax  # noqa: E402  (after the platform is chosen)
import pytest  # noqa: E402

from diversed_jax.speculative.programs import mapping_count, mapping_limit  # noqa: E402


# XLA:CPU maps each compiled kernel's code and data into the process, and jit's caches keep
# every program alive. A pytest-xdist worker runs half the suite in one process: thousands
# of programs, past Linux's limit on mappings (vm.max_map_count, 65530 by default), and the
# next compile then segfaults. So once the mappings grow by a quarter of the limit, the
# caches are dropped, which frees the programs no test holds any more (tests recompile what
# they need); growth is counted from the last drop, so programs a module's fixtures still
# hold do not make every later test drop the caches again.
_GROWTH_ALLOWED = mapping_limit() // 4
_drop_above = [mapping_count() + _GROWTH_ALLOWED]


@pytest.fixture(autouse=True)
def _release_compiled_programs():
  yield
  if mapping_count() > _drop_above[0]:
    jax.clear_caches()
    gc.collect()
    _drop_above[0] = mapping_count() + _GROWTH_ALLOWED
