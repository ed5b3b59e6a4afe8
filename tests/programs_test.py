"""Compiled decoding programs: kept per decoder, released before they exhaust the mappings."""

import os

import jax
import pytest

from diversed_jax.models import ModelConfig, init_params
from diversed_jax.speculative import decoder as decoder_lib
from diversed_jax.speculative import drafts, programs
from diversed_jax.speculative.types import VerifyParams


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
  first, second = programs.ProgramCache(), programs.ProgramCache()
  for cache, names in ((first, "abc"), (second, "xy")):
    for name in names:
      cache._programs[name] = name
  monkeypatch.setattr(programs, "mapping_count", lambda: 500)  # at half the limit: kept
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


def _tiny(seed, layers):
  config = ModelConfig(family="llama", vocab_size=11, hidden_size=32, num_layers=layers,
                       num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=48)
  return config, init_params(config, jax.random.PRNGKey(seed), std=0.5)


@pytest.fixture(scope="module")
def decoder_args():
  target = decoder_lib.ModelHandle(*_tiny(0, 2))
  draft_config, draft_params = _tiny(1, 1)
  return target, drafts.LMDraft(draft_config), draft_params


SETTINGS = [VerifyParams(method="lossy", lenience=lenience) for lenience in (0.3, 0.5, 0.7)]


def _decode_all(dec):
  return [dec.generate([[1, 2, 3, 4]], vp, num_draft=2, max_new_tokens=6, seed=1).token_ids
          for vp in SETTINGS]


def test_a_decoder_under_pressure_keeps_few_programs_and_the_same_results(decoder_args,
                                                                          monkeypatch):
  expected = _decode_all(decoder_lib.SpeculativeDecoder(*decoder_args))
  monkeypatch.setattr(programs, "mapping_limit", lambda: 0)  # every compile releases
  dec = decoder_lib.SpeculativeDecoder(*decoder_args)
  assert _decode_all(dec) == expected
  assert len(dec.programs) == 2  # the latest before the last compile, and the last
  assert _decode_all(dec) == expected  # recompiled where dropped


@pytest.mark.skipif(not os.path.exists(programs._MAPS), reason="needs Linux's /proc")
def test_releasing_frees_the_programs_mappings(decoder_args):
  """What the release is for: the mappings of dropped programs go back to the system
  (jax's caches hold every program too, so trimming the decoder's alone frees none)."""
  jax.clear_caches()
  dec = decoder_lib.SpeculativeDecoder(*decoder_args)
  before = programs.mapping_count()
  _decode_all(dec)
  grown = programs.mapping_count() - before
  assert grown > 100, grown  # three programs of a few dozen kernels each
  assert programs.release_under_pressure(fraction=0.0)
  assert len(dec.programs) == 1
  assert programs.mapping_count() - before < grown / 2
