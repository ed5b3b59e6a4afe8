"""SMC speculative decoding (speculative/smc.py) on tiny random models: the output law
against the exact target law, resampling, stopping, the decoder's calls, refusals."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from diversed_jax.speculative import decoder as decoder_lib
from diversed_jax.speculative import drafts, loop, metrics, smc, verification
from diversed_jax.speculative.types import VerifyParams
from tests import tiny_pair, xla_flags
from tests.tiny_pair import PROMPT, VOCAB, next_laws


@pytest.fixture(scope="module")
def models():
  return tiny_pair.peaked_target_flat_draft()


# Thousands of particles: Monte Carlo runs, compiled at XLA's full optimisation.
_optimized_decode = jax.jit(smc.decode, compiler_options=xla_flags.OPTIMIZED,
                            static_argnames=("spec", "target_config", "draft", "cache_len"))


def _decode(models, rows, particles, max_new_tokens, ess_threshold=0.5, seed=3, eos=()):
  target_config, target_params, draft, draft_params = models
  spec = loop.LoopSpec(verify=VerifyParams(method="smc", particles=particles,
                                           ess_threshold=ess_threshold),
                       num_draft=1, max_new_tokens=max_new_tokens, eos_token_ids=eos)
  tokens = jnp.asarray([PROMPT + [0] * 4] * rows, jnp.int32)
  return _optimized_decode(target_params, draft_params, tokens, jnp.full((rows,), len(PROMPT)),
                           jax.random.PRNGKey(seed), spec=spec, target_config=target_config,
                           draft=draft, cache_len=16)


def _tv(counts, law) -> float:
  return 0.5 * float(np.abs(counts / counts.sum() - law).sum())


def _pair_counts(tokens) -> np.ndarray:
  counts = np.zeros((VOCAB, VOCAB))
  np.add.at(counts, (tokens[:, 0], tokens[:, 1]), 1)
  return counts


def test_effective_sample_size_of_equal_and_degenerate_weights():
  log_w = jnp.log(jnp.asarray([[1.0, 1.0, 1.0, 1.0], [1.0, 0.0, 0.0, 0.0],
                               [2.0, 2.0, 0.0, 0.0]]))
  np.testing.assert_allclose(smc.effective_sample_size(log_w), [4.0, 1.0, 2.0], rtol=1e-6)


def test_systematic_resampling_draws_each_particle_about_n_w_times():
  weights = np.asarray([0.5, 0.3, 0.2, 0.0, 0.0])
  log_w = jnp.log(jnp.asarray(np.tile(weights, (2000, 1))))
  ancestors = np.asarray(smc.systematic_resample(jax.random.PRNGKey(0), log_w))
  counts = np.stack([(ancestors == i).sum(1) for i in range(5)], axis=1)
  # Systematic: floor(N w_i) or ceil(N w_i) copies, never a zero weight, N in all.
  expected = 5 * weights
  assert np.all((counts >= np.floor(expected)) & (counts <= np.ceil(expected)))
  assert counts[:, 3:].sum() == 0 and np.all(counts.sum(1) == 5)
  np.testing.assert_allclose(counts.mean(0), expected, atol=0.05)  # unbiased


def _np_scaled(z, temperature, top_p):
  """softmax(z / T), then the smallest top set whose mass reaches top_p, renormalised."""
  probs = np.exp(z / temperature - np.max(z / temperature, -1, keepdims=True))
  probs /= probs.sum(-1, keepdims=True)
  ranked = -np.sort(-probs, axis=-1)
  kept = (np.cumsum(ranked, -1) - ranked) < top_p
  threshold = np.take_along_axis(ranked, kept.sum(-1, keepdims=True) - 1, -1)
  probs = np.where(probs >= threshold, probs, 0.0)
  return probs / probs.sum(-1, keepdims=True)


def test_log_ratio_reads_the_tempered_nucleus_laws():
  """T = 0.7, top_p = 0.8: log p(d) - log q(d) of the scaled, truncated laws; a draft
  outside the target's nucleus (p = 0) weighs log 1e-30 - log q(d)."""
  rng = np.random.default_rng(4)
  zq, zp = rng.normal(size=(2, 2, 3, VOCAB)) * 1.5
  verify = VerifyParams(method="smc", temperature=0.7, top_p=0.8)
  q, p = _np_scaled(zq, 0.7, 0.8), _np_scaled(zp, 0.7, 0.8)
  drafts_bk = np.argmax(q, axis=-1)  # in q's nucleus, as a drafted token is
  drafts_bk[0, 1] = np.flatnonzero((q[0, 1] > 0) & (p[0, 1] == 0))[0]
  pick = lambda law: np.take_along_axis(law, drafts_bk[..., None], -1)[..., 0]
  want = np.log(np.maximum(pick(p), 1e-30)) - np.log(pick(q))
  got = smc.log_ratio(jnp.asarray(zq, jnp.float32), jnp.asarray(zp, jnp.float32),
                      jnp.asarray(drafts_bk), verify)
  np.testing.assert_allclose(got, want, rtol=1e-4)
  plain = np.log(pick(_np_scaled(zp, 1.0, 1.0))) - np.log(pick(_np_scaled(zq, 1.0, 1.0)))
  assert np.abs(plain - want).max() > 0.1  # temperature and top-p matter here


def test_one_round_law_approaches_the_target_as_particles_grow(models):
  """K = 1, two tokens: x1 drafted and weighed by p/q, x2 the target's bonus token.
  One particle outputs q(x1) p(x2|x1); 32 particles, the target's p(x1) p(x2|x1).
  3,000 prompts; tolerance 0.07 (the 121-cell joint's sampling error at this size is about
  0.03, and self-normalised weights over 32 particles leave a bias of about as much)."""
  target_config, target_params, draft, draft_params = models
  p1 = next_laws(target_config, target_params, [PROMPT])[0]
  q1 = next_laws(draft.config, draft_params, [PROMPT])[0]
  p2 = next_laws(target_config, target_params, [PROMPT + [x] for x in range(VOCAB)])
  target_law, draft_then_target = p1[:, None] * p2, q1[:, None] * p2
  assert 0.5 * np.abs(target_law - draft_then_target).sum() > 0.5  # the test can fail
  one = _pair_counts(np.asarray(_decode(models, 3000, 1, 2).tokens_qn))
  # Exact samples of this joint lie 0.045 away on average at N = 3,000 (a numpy multinomial
  # simulation, 200,000 draws: 95th percentile 0.055, 99.9th 0.064), so 0.065; the target's
  # joint lies 0.63 away.
  assert _tv(one, draft_then_target) < 0.065, _tv(one, draft_then_target)
  many = _pair_counts(np.asarray(_decode(models, 3000, 32, 2).tokens_qn))
  assert _tv(many, target_law) < 0.07, _tv(many, target_law)


def test_resampling_keeps_later_rounds_near_the_target(models):
  """Two rounds (4 tokens). Resampling after every round resets the weights, so the
  second round's draft weighs alone; never resampling multiplies both rounds' weights
  and leaves fewer effective particles. 2,000 prompts of 32 particles.

  Tolerances (a numpy multinomial simulation, 100,000 draws of N = 2,000 exact samples):
  the 121-cell joint of tokens 1-2 lies 0.048 away on average (sd 0.0067, 99.9th
  percentile 0.071), token 3's 11-cell marginal 0.026 (sd 0.0066, 99.9th 0.049). Each bound
  is that 99.9th percentile plus 0.03 for the self-normalised weights' bias at 32
  particles (as in the test above; this seed gives 0.071 and 0.052, an excess over the
  exact mean of 0.022 and 0.027). Never resampling lies 0.17 away here: it must exceed
  always by 0.07, 7 sd of the difference of two sampled TVs (sd 0.0094)."""
  target_config, target_params, _, _ = models
  p1 = next_laws(target_config, target_params, [PROMPT])[0]
  p2 = next_laws(target_config, target_params, [PROMPT + [x] for x in range(VOCAB)])
  joint12 = p1[:, None] * p2
  p3 = next_laws(target_config, target_params,
                  [PROMPT + [a, b] for a in range(VOCAB) for b in range(VOCAB)])
  law3 = joint12.reshape(-1) @ p3
  always = _decode(models, 2000, 32, 4, ess_threshold=1.0)
  never = _decode(models, 2000, 32, 4, ess_threshold=0.0)
  tokens_always, tokens_never = np.asarray(always.tokens_qn), np.asarray(never.tokens_qn)
  tv_always = _tv(_pair_counts(tokens_always), joint12)
  assert tv_always < 0.071 + 0.03, tv_always
  tv3 = _tv(np.bincount(tokens_always[:, 2], minlength=VOCAB).astype(float), law3)
  assert tv3 < 0.049 + 0.03, tv3
  tv_never = _tv(_pair_counts(tokens_never), joint12)
  assert tv_always + 0.07 < tv_never, (tv_always, tv_never)
  # The weights before each resampling: a flat draft leaves few effective particles.
  ess = np.asarray(always.stats.ess_rb)
  assert np.all((ess > 0) & (ess <= 1)) and ess.mean() < 0.5


def test_a_draft_equal_to_the_target_weighs_every_particle_alike(models):
  """q = p at every drafted position iff the draft's and the target's caches hold the
  same committed tokens; then every weight is 1 and the ESS stays at N."""
  target_config, target_params, _, _ = models
  clone = (target_config, target_params, drafts.LMDraft(target_config), target_params)
  result = _decode(clone, 8, 4, 9)
  assert int(result.num_rounds) == 5
  np.testing.assert_allclose(np.asarray(result.stats.ess_rb), 1.0, rtol=1e-5)


def test_particles_stop_at_eos_and_the_length_limit(models):
  """K = 2 and 7 tokens, not a multiple of K + 1 = 3: outputs end at their first EOS or
  at 7 tokens, within ceil(7 / 3) rounds."""
  target_config, target_params, draft, draft_params = models
  eos = 10
  spec = loop.LoopSpec(verify=VerifyParams(method="smc", particles=4), num_draft=2,
                       max_new_tokens=7, eos_token_ids=(eos,))
  rows = 64
  result = smc.decode(target_params, draft_params, jnp.asarray([PROMPT + [0] * 4] * rows),
                      jnp.full((rows,), 4), jax.random.PRNGKey(0), spec=spec,
                      target_config=target_config, draft=draft, cache_len=16)
  assert int(result.num_rounds) <= 3 == smc.num_rounds(spec)
  lengths = np.asarray(result.num_generated_q)
  tokens = np.asarray(result.tokens_qn)
  assert lengths.max() == 7 and lengths.min() < 7  # both stops happen
  for row, n in zip(tokens, lengths):
    assert eos not in row[:n - 1].tolist()
    assert n == 7 or row[n - 1] == eos


def test_a_particle_weighs_only_the_drafts_it_keeps():
  """K = 2, EOS 7, 10 tokens at most. Row 0 keeps its round; row 1 drafts EOS first; row
  2 has room for one token; row 3 had finished. p/q of a cut draft must not weigh."""
  spec = loop.LoopSpec(verify=VerifyParams(method="smc"), num_draft=2, max_new_tokens=10,
                       eos_token_ids=(7,))
  state = smc._State(
      round=None, key=None, target_cache=None, draft_cache=None, last_two_b2=None,
      features_b2d=None, stats=None, out_bn=jnp.zeros((4, 13), jnp.int32),
      num_generated_b=jnp.asarray([0, 0, 9, 4]), done_b=jnp.asarray([False] * 3 + [True]),
      log_weight_b=jnp.asarray([0.0, 0.0, 0.0, -1.0]))
  tokens = jnp.asarray([[3, 4, 5], [7, 4, 5], [3, 4, 5], [3, 4, 5]])
  log_ratio = jnp.asarray([[0.1, 0.2], [0.3, 0.4], [0.5, 0.6], [0.7, 0.8]])
  out = smc._commit(spec, state, tokens, log_ratio)
  np.testing.assert_allclose(out.log_weight_b, [0.3, 0.3, 0.5, -1.0], rtol=1e-6)
  assert out.num_generated_b.tolist() == [3, 1, 10, 4]
  assert out.done_b.tolist() == [False, True, True, True]
  assert out.out_bn[0, :3].tolist() == [3, 4, 5] and out.out_bn[1, 0] == 7
  assert out.out_bn[2, 9] == 3 and not out.out_bn[3].any()


def test_the_decoder_runs_smc_batch_size_prompts_a_call(models):
  target_config, target_params, draft, draft_params = models
  dec = decoder_lib.SpeculativeDecoder(decoder_lib.ModelHandle(target_config, target_params),
                                       draft, draft_params)
  prompts = [[1, 2, 3, 4, 5], [7, 3], [2, 9, 9, 1, 4], [5, 6, 7], [3, 3]]
  verify = VerifyParams(method="smc", particles=4)
  out = dec.generate(prompts, verify, num_draft=2, max_new_tokens=6, eos_token_ids=(),
                     batch_size=2, seed=5)
  assert [len(t) for t in out.token_ids] == [6] * 5
  assert len(dec.programs) == 1  # three calls, the last padded to two prompts
  # The first call alone draws the same tokens (its key is the seed's, folded with 0).
  first = dec.generate(prompts[:2], verify, num_draft=2, max_new_tokens=6, eos_token_ids=(),
                       seed=5)
  assert first.token_ids == out.token_ids[:2]
  # Rounds of the three calls follow each other, each prompt served in two (3 tokens each).
  assert out.rounds == 6 and all(a == [2, 2] for a in out.accepted_per_round)
  summary = metrics.summarize_generation(out, speculative=True)
  assert summary["acceptance_rate"] == 1.0 and summary["tokens_per_round"] == 3.0
  assert 0 < summary["ess"] <= 1


def test_smc_refuses_greedy_decoding_and_bad_particles(models):
  with pytest.raises(ValueError, match=r"temperature must be > 0 with method 'smc', got 0"):
    verification.validate_params(VerifyParams(method="smc", temperature=0.0))
  with pytest.raises(ValueError, match=r"particles must be >= 1, got 0"):
    verification.validate_params(VerifyParams(method="smc", particles=0))
  with pytest.raises(ValueError, match=r"ess_threshold must be in \[0, 1\], got 1.5"):
    verification.validate_params(VerifyParams(method="smc", ess_threshold=1.5))
  target_config, target_params, draft, draft_params = models
  args = (jnp.asarray([PROMPT + [0] * 4]), jnp.asarray([4]), jax.random.PRNGKey(0))
  kwargs = dict(target_config=target_config, draft=draft, cache_len=16)
  with pytest.raises(ValueError, match=re.escape(  # the spec checks it, for every method
      "LoopSpec.verify.temperature must be > 0 with method 'smc', got 0.0")):
    loop.LoopSpec(verify=VerifyParams(method="smc", temperature=0.0), num_draft=1)
  sampled = loop.LoopSpec(verify=VerifyParams(method="smc"), num_draft=1)
  with pytest.raises(ValueError, match="smc.decode runs it"):
    loop.decode(target_params, draft_params, None, *args, spec=sampled, **kwargs)
