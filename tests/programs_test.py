"""Compiled decoding programs: kept per decoder, released before they exhaust the mappings
(a decoder under pressure: tests/loop_test.py)."""

import os

import jax

from diversed_jax.speculative import programs


def test_a_program_is_compiled_once_and_the_latest_kept(monkeypatch):
  monkeypatch.setattr(programs, "release_under_pressure", lambda: False)
  cache = programs.ProgramCache()
  compiled = []
  compile_as = lambda name: lambda: compiled.append(name) or name
  assert cache.get("a", compile_as("a")) == ("a", True)
  assert cache.get("b", compile_as("b")) == ("b", True)
  assert cache.get("a", compile_as("a")) == ("a", False)  # used again: now the latest
  assert compiled == ["a", "b"] and len(cache) == 2
  assert cache.keep_latest() == 1
  assert cache.values() == ["a"] and "b" not in cache
  assert programs.ProgramCache().keep_latest() == 0


def test_pressure_trims_every_cache_and_clears_jax_caches(monkeypatch):
  cleared = []
  monkeypatch.setattr(jax, "clear_caches", lambda: cleared.append(True))
  monkeypatch.setattr(programs, "mapping_limit", lambda: 1000)
  monkeypatch.setattr(programs, "mapping_count", lambda: 500)  # at half the limit: kept
  first, second = programs.ProgramCache(), programs.ProgramCache()
  for cache, names in ((first, "abc"), (second, "xy")):
    for name in names:
      cache.get(name, lambda name=name: name)
  assert not programs.release_under_pressure()
  assert len(first) == 3 and len(second) == 2 and not cleared
  monkeypatch.setattr(programs, "mapping_count", lambda: 501)
  assert programs.release_under_pressure()
  assert first.values() == ["c"] and second.values() == ["y"] and cleared == [True]


def test_the_mapping_figures_read_linux_or_fall_back(monkeypatch):
  if os.path.exists(programs._MAPS):
    assert programs.mapping_count() > 0
  monkeypatch.setattr(programs, "_MAPS", "/nonexistent/maps")
  monkeypatch.setattr(programs, "_MAX_MAP_COUNT", "/nonexistent/max_map_count")
  assert programs.mapping_count() == 0
  assert programs.mapping_limit() == programs.LINUX_DEFAULT_MAX_MAP_COUNT
