"""Compiled decoding programs, kept per decoder and released before they exhaust the host.

XLA:CPU maps each compiled kernel's code and data into the process: one speculative
decoding program of SmolLM2-135M (30 unrolled layers) adds ~2,000 memory mappings, a plain
decoding one ~1,100, and Linux refuses new mappings past `vm.max_map_count` (65,530 by
default). A CPU run that compiles a program per method, K and prompt bucket (the main job
over a method sweep, a benchmark over many K) passes that: a sweep of one method over 40
values crashed compiling its 33rd program ("LLVM compilation error: Cannot allocate
memory"), when each value of a rule's numbers still took its own program (they are
arguments now: `types.TRACED_FIELDS`).

So every `ProgramCache` (one per decoder) registers itself, and before each compile
`release_under_pressure` checks the process's mappings: past half of the limit, every
registered cache drops all but its most recently used program, and jax's own caches
(which also hold every program compiled) are cleared, which frees the rest. A dropped
program is compiled again when it is next needed. Where /proc is absent (not Linux), the
count reads 0 and nothing is ever released.
"""

from __future__ import annotations

import collections
import gc
import weakref
from typing import Any, Callable, Hashable

import jax
from absl import logging

_MAPS = "/proc/self/maps"
_MAX_MAP_COUNT = "/proc/sys/vm/max_map_count"
LINUX_DEFAULT_MAX_MAP_COUNT = 65530

_caches: "weakref.WeakSet[ProgramCache]" = weakref.WeakSet()


def mapping_count() -> int:
  """Memory mappings of this process (0 where /proc is absent)."""
  try:
    with open(_MAPS) as f:
      return sum(1 for _ in f)
  except OSError:
    return 0


def mapping_limit() -> int:
  """Linux's limit on one process's mappings (its default where unreadable)."""
  try:
    with open(_MAX_MAP_COUNT) as f:
      return int(f.read())
  except (OSError, ValueError):
    return LINUX_DEFAULT_MAX_MAP_COUNT


def release_under_pressure(fraction: float = 0.5) -> bool:
  """Frees compiled programs when the mappings exceed `fraction` of the limit: every
  cache keeps only its most recently used program, then jax's caches are cleared.
  Returns whether it released anything."""
  before = mapping_count()
  if before <= fraction * mapping_limit():
    return False
  dropped = sum(cache.keep_latest() for cache in list(_caches))
  jax.clear_caches()
  gc.collect()
  logging.info("released %d compiled decoding programs and jax's caches: %d -> %d memory "
               "mappings (limit %d)", dropped, before, mapping_count(), mapping_limit())
  return True


class ProgramCache:
  """Compiled programs by signature, least recently used first."""

  def __init__(self):
    self._programs: collections.OrderedDict[Hashable, Any] = collections.OrderedDict()
    _caches.add(self)

  def __len__(self) -> int:
    return len(self._programs)

  def __contains__(self, signature: Hashable) -> bool:
    return signature in self._programs

  def values(self) -> list:
    """The programs, least recently used first."""
    return list(self._programs.values())

  def get(self, signature: Hashable, compile_fn: Callable[[], Any]) -> tuple[Any, bool]:
    """The program for `signature`, compiled by `compile_fn` when missing (after
    `release_under_pressure`); returns (program, whether it was compiled now)."""
    if signature in self._programs:
      self._programs.move_to_end(signature)
      return self._programs[signature], False
    release_under_pressure()
    program = self._programs[signature] = compile_fn()
    return program, True

  def keep_latest(self) -> int:
    """Drops every program but the most recently used one; returns how many it dropped."""
    dropped = max(len(self._programs) - 1, 0)
    for _ in range(dropped):
      self._programs.popitem(last=False)
    return dropped
