"""`metrics.greedy_tokens_per_round` (what `draft_speed.py --compare` ranks drafts by), on a
tiny random target."""

import jax

from diversed_jax.models import ModelConfig, init_params
from diversed_jax.speculative import drafts, metrics
from diversed_jax.speculative.decoder import ModelHandle, SpeculativeDecoder

VOCAB = 64


def test_greedy_tokens_per_round_counts_the_loops_rounds():
  config = ModelConfig(family="llama", vocab_size=VOCAB, hidden_size=32, num_layers=2,
                       num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=48,
                       eos_token_ids=())
  params = init_params(config, jax.random.PRNGKey(0), std=0.5)
  handle = ModelHandle(config, params)
  # The target as its own draft: every draft is accepted, so 9 tokens take ceil(9 / (K + 1))
  # rounds. A one-layer self draft is right less often.
  itself = SpeculativeDecoder(handle, drafts.LMDraft(config), params)
  self_1 = SpeculativeDecoder(handle, *drafts.self_draft(config, params, 1))
  prompts = [[1, 2, 3, 4, 5], [7, 3], [2, 9, 9, 1, 4, 4, 8]]
  for k, expected in ((2, 3.0), (4, 4.5)):
    assert metrics.greedy_tokens_per_round(itself, prompts, k, max_new_tokens=9) == expected
    assert 1.0 <= metrics.greedy_tokens_per_round(self_1, prompts, k, max_new_tokens=9) < expected
