"""benchmarks/draft_speed.py's greedy tokens per round (`--compare`), on a tiny random target."""

import importlib.util
import os

import jax
import pytest

from diversed_jax.models import ModelConfig, init_params
from diversed_jax.models.loading import LoadedModel
from diversed_jax.speculative import drafts
from diversed_jax.speculative.decoder import ModelHandle, SpeculativeDecoder

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VOCAB = 64


@pytest.fixture(scope="module")
def draft_speed():
  spec = importlib.util.spec_from_file_location(
      "draft_speed", os.path.join(ROOT, "benchmarks", "draft_speed.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_greedy_tokens_per_round_counts_the_loops_rounds(draft_speed):
  config = ModelConfig(family="llama", vocab_size=VOCAB, hidden_size=32, num_layers=2,
                       num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=48,
                       eos_token_ids=())
  target = LoadedModel(config, init_params(config, jax.random.PRNGKey(0), std=0.5), "tiny", "")
  # The target as its own draft: every draft is accepted, so 9 tokens take ceil(9 / (K + 1))
  # rounds. A one-layer self draft is right less often.
  handle = ModelHandle(config, target.params)
  decoders = {"itself": SpeculativeDecoder(handle, drafts.LMDraft(config), target.params),
              "self:1": SpeculativeDecoder(handle, *drafts.self_draft(config, target.params, 1))}
  prompts = [[1, 2, 3, 4, 5], [7, 3], [2, 9, 9, 1, 4, 4, 8]]
  got = draft_speed.greedy_tokens_per_round(decoders, prompts, [2, 4], max_new_tokens=9)
  assert got["itself"] == {2: 3.0, 4: 4.5}
  for k in (2, 4):
    assert 1.0 <= got["self:1"][k] < got["itself"][k]
