"""`metrics.greedy_tokens_per_round` (what `draft_speed.py --compare` ranks drafts by), on a
tiny random target, and `metrics.summarize` on hand-made round statistics."""

import types

import jax
import numpy as np
import pytest

from diversed_jax.models import ModelConfig, init_params
from diversed_jax.speculative import drafts, metrics
from diversed_jax.speculative.decoder import ModelHandle, SpeculativeDecoder
from tests import padded_forward

VOCAB = 64


def _greedy_sd_rounds(config, params, draft_config, draft_params, prompt, k, max_new_tokens):
  """Rounds of greedy exact SD for one prompt, by plain forwards (no KV cache): the draft
  proposes its K greedy tokens, the target keeps the longest prefix it agrees with and adds
  its own next token; the last round is cut at max_new_tokens."""
  tokens, end = list(prompt), len(prompt) + max_new_tokens
  rounds = 0
  while len(tokens) < end:
    drafted = []
    for _ in range(k):
      drafted.append(padded_forward.greedy_next(draft_params, draft_config, tokens + drafted))
    for token in drafted + [None]:  # None: the bonus position
      target_token = padded_forward.greedy_next(params, config, tokens)
      tokens.append(target_token)
      if target_token != token:
        break
    rounds += 1
  return rounds


def test_greedy_tokens_per_round_counts_the_loops_rounds():
  config = ModelConfig(family="llama", vocab_size=VOCAB, hidden_size=32, num_layers=2,
                       num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=48,
                       eos_token_ids=())
  params = init_params(config, jax.random.PRNGKey(0), std=0.5)
  handle = ModelHandle(config, params)
  # The target as its own draft: every draft is accepted, so 9 tokens take ceil(9 / (K + 1))
  # rounds: 3 at K = 3, the last one cut short (one token of four). A one-layer self draft
  # is right less often: its rounds as counted by plain forwards.
  itself = SpeculativeDecoder(handle, drafts.LMDraft(config), params)
  draft, draft_params = drafts.self_draft(config, params, 1)
  self_1 = SpeculativeDecoder(handle, draft, draft_params)
  prompts = [[1, 2, 3, 4, 5], [7, 3], [2, 9, 9, 1, 4, 4, 8]]
  k = 3
  assert metrics.greedy_tokens_per_round(itself, prompts, k, max_new_tokens=9) == 3.0
  rounds = sum(_greedy_sd_rounds(config, params, draft.config, draft_params, p, k, 9)
               for p in prompts)
  assert rounds > 9  # the one-layer draft is wrong somewhere
  assert metrics.greedy_tokens_per_round(self_1, prompts, k, max_new_tokens=9) == 27 / rounds


def test_summarize_counts_only_active_row_rounds():
  # R = 3 rounds, B = 2 rows, K = 3; row 1 is idle in the last round.
  stats = types.SimpleNamespace(
      active_rb=np.array([[1, 1], [1, 1], [1, 0]], bool),
      prompt_rb=np.zeros((3, 2), np.int32),
      num_accepted_rb=np.array([[3, 0], [1, 0], [0, 3]], np.int32),
      accept_prob_rbk=np.array([[[1.0, 0.5, 0.5], [0.2, 0.2, 0.2]],
                                [[1.0, 0.0, 0.5], [0.0, 1.0, 1.0]],
                                [[0.5, 0.5, 0.5], [1.0, 1.0, 1.0]]], np.float32),
      beta_rbk=np.array([[[0.8, 0.6, 0.4], [0.5, 0.5, 0.5]],
                         [[0.9, 0.3, 0.7], [0.1, 0.9, 0.9]],
                         [[0.4, 0.4, 0.4], [1.0, 1.0, 1.0]]], np.float32),
      ess_rb=None, hit_rb=None)
  out = metrics.summarize(stats, num_tokens=9, speculative=True)
  assert "ess" not in out and "hit_rate" not in out  # SMC's and SSD's figures only
  assert out["rounds"] == 5
  assert out["tokens_per_round"] == 9 / 5
  assert out["acceptance_rate"] == 4 / 15  # (3 + 1 + 0 + 0) accepted of 5 x 3 drafts
  assert out["mean_accepted"] == 4 / 5
  # sum_n (prod_{i<n} a_i) beta_n, row-round by row-round, the idle one left out.
  by_hand = [0.8 + 1.0 * 0.6 + 0.5 * 0.4, 0.5 + 0.2 * 0.5 + 0.04 * 0.5,
             0.9 + 1.0 * 0.3 + 0.0, 0.1 + 0.0 + 0.0, 0.4 + 0.5 * 0.4 + 0.25 * 0.4]
  np.testing.assert_allclose(out["expected_accepted_theory"], np.mean(by_hand), rtol=1e-6)
  plain = metrics.summarize(stats, num_tokens=9, speculative=False)
  assert plain["acceptance_rate"] == 0.0 and plain["tokens_per_round"] == 9 / 5
  stats.ess_rb = np.array([[0.5, 1.0], [0.25, 1.0], [0.75, 0.0]], np.float32)
  ess = metrics.summarize(stats, 9, speculative=True)["ess"]  # the idle row-round left out
  assert ess == pytest.approx((0.5 + 1 + 0.25 + 1 + 0.75) / 5)
  # SSD: rows 0 and 1 serve prompts 0 and 1; their first rounds cannot be pre-drafted, so
  # 2 hits of the 5 - 2 rounds that could be (the idle row-round's flag ignored).
  stats.prompt_rb = np.array([[0, 1], [0, 1], [0, 1]], np.int32)
  stats.hit_rb = np.array([[0, 0], [1, 0], [1, 1]], bool)
  out = metrics.summarize(stats, 9, speculative=True)
  assert (out["hits"], out["hit_rate"]) == (2, 2 / 3)
