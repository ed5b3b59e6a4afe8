"""Speculative speculative decoding (speculative/ssd.py) on tiny random models: the
guessed outcomes' pre-drafts against fresh drafting, exactness (greedy and the sampled
law), hits, Saguaro sampling, two devices, refusals."""

import dataclasses
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats

from diversed_jax.distill import architectures
from diversed_jax.models import transformer
from diversed_jax.parallel import mesh as mesh_lib
from diversed_jax.speculative import decoder as decoder_lib
from diversed_jax.speculative import drafts, loop, metrics, ssd, verification
from diversed_jax.speculative.types import VerifyParams
from tests import tiny_pair, xla_flags
from tests.tiny_pair import PROMPT, VOCAB, next_laws


@pytest.fixture(scope="module")
def models():
  """A peaked target and a flat draft: rejections, and the residual tokens that the
  guesses must cover, are common."""
  return tiny_pair.peaked_target_flat_draft()


def _decoder(models):
  target_config, target_params, draft, draft_params = models
  return decoder_lib.SpeculativeDecoder(decoder_lib.ModelHandle(target_config, target_params),
                                        draft, draft_params)


def test_guesses_skip_the_rejected_draft_and_follow_the_draft_law():
  logits = jnp.log(jnp.asarray([[[0.5, 0.3, 0.2, 0.0 + 1e-9],
                                 [0.1, 0.2, 0.3, 0.4],
                                 [0.4, 0.1, 0.2, 0.3]]]))
  guesses = np.asarray(ssd.guess_bonus(jnp.asarray([[0, 3]]), logits, 2))
  # a = 0: d_1 = 0 rejected, so 1 then 2; a = 1: d_2 = 3 rejected; a = K: q_{K+1}'s top 2.
  np.testing.assert_array_equal(guesses, [[[1, 2], [2, 1], [0, 3]]])


def test_hit_row_finds_the_verified_outcome_among_the_guesses():
  accepted = np.asarray([0, 0, 1, 1, 2, 2])  # K = 2, F = 2
  bonus = np.asarray([3, 5, 7, 3, 1, 2])
  assert ssd.hit_row(accepted, bonus, 0, 5) == 1
  assert ssd.hit_row(accepted, bonus, 1, 3) == 3
  assert ssd.hit_row(accepted, bonus, 2, 1) == 4
  assert ssd.hit_row(accepted, bonus, 1, 5) is None  # guessed after another accepted length


@pytest.mark.parametrize("temperature", [0.0, 0.5])
def test_a_budget_keeps_the_outcomes_the_draft_finds_likeliest(temperature):
  """guess_budget B: of the (K + 1) F top-F guesses, the B with the largest draft
  probability of the committed tokens, q_1(d_1) ... q_a(d_a) q_{a+1}(t), in that order;
  budget 0 keeps all of them, a-major."""
  k, fanout, budget = 3, 2, 5
  logits = jax.random.normal(jax.random.PRNGKey(3), (1, k + 1, VOCAB)) * 2.0
  logits = logits.at[0, 0, 4].add(6.0)  # d_1 likely: outcomes after it outrank a = 0's
  drafts_1k = jnp.asarray([[4, 0, 9]])
  every = ssd.guess_outcomes(drafts_1k, logits, fanout)
  guesses = np.asarray(ssd.guess_bonus(drafts_1k, logits, fanout))[0]
  np.testing.assert_array_equal(every[0], np.repeat(np.arange(k + 1), fanout))
  np.testing.assert_array_equal(every[1], guesses.reshape(-1))

  scale = temperature or 1.0
  q = np.asarray(jax.nn.softmax(np.asarray(logits[0], np.float64) / scale), np.float64)
  chance = {}
  for a in range(k + 1):
    path = np.prod([q[i, d] for i, d in enumerate([4, 0, 9][:a])])
    for t in guesses[a]:
      chance[(a, int(t))] = path * q[a, t]
  want = sorted(chance, key=chance.get, reverse=True)[:budget]
  accepted, bonus = ssd.guess_outcomes(drafts_1k, logits, fanout, budget, temperature)
  assert list(zip(np.asarray(accepted).tolist(), np.asarray(bonus).tolist())) == want
  assert want[0][0] == 1  # the likeliest comes after d_1: not the a-major order


def _first_round_drafts(models, spec):
  """The state after PROMPT's prefill and the first round's drafts (`ssd._draft`'s output)."""
  target_config, target_params, draft, draft_params = models
  prompt = jnp.asarray([PROMPT + [0] * 4], jnp.int32)
  state, draft_cache = ssd._start(target_params, draft_params, prompt, jnp.asarray([4]),
                                  spec=spec, target_config=target_config, draft=draft,
                                  cache_len=32, prefill_chunk=loop.PREFILL_CHUNK)
  inputs = (state.target_cache.lengths_b, state.last_two_b2, state.features_b2d)
  return state, ssd._draft(draft_params, draft_cache, *inputs, jax.random.PRNGKey(1),
                           spec=spec, draft=draft)


@pytest.mark.parametrize("budget", [0, 5])
def test_each_guessed_outcome_is_drafted_as_fresh_drafting_would(models, budget):
  """Every candidate row g, accepting a drafts then token t, must hold the draft's laws
  after the prefix that outcome commits, prompt + d_1..d_a + t: its K + 1 laws against one
  plain forward of the draft over prompt + d_1..d_a + t + the row's own drafts."""
  _, _, draft, draft_params = models
  k, fanout = 3, 2
  spec = loop.LoopSpec(verify=VerifyParams(method="ssd", fanout=fanout, guess_budget=budget),
                       num_draft=k, max_new_tokens=8)
  state, (drafts_1k, logits, hidden, draft_cache) = _first_round_drafts(models, spec)
  assert logits.shape[1] == k + 1  # q_{K+1} too, for the a = K guesses
  outcomes = ssd._guess(drafts_1k, logits, fanout=fanout, budget=budget, temperature=1.0)
  cand_drafts, cand_logits, _, _ = ssd._speculate(
      draft_params, draft_cache, drafts_1k, hidden, outcomes, state.target_cache.lengths_b,
      state.last_two_b2, state.features_b2d, jax.random.PRNGKey(2), spec=spec, draft=draft)
  assert cand_drafts.shape == (budget or (k + 1) * fanout, k)
  d = np.asarray(drafts_1k)[0].tolist()
  accepted, bonus = (np.asarray(x).tolist() for x in outcomes)
  assert len(set(accepted)) > 1  # outcomes after several accepted lengths
  for row, (a, t) in enumerate(zip(accepted, bonus)):
    committed = PROMPT + d[:a] + [t]
    sequence = committed + np.asarray(cand_drafts[row]).tolist()
    plain = transformer.forward_jit(draft_params, draft.config, jnp.asarray([sequence]))[0]
    expected = plain[0, len(committed) - 1:]  # the laws of the K drafts and of K + 1
    np.testing.assert_allclose(cand_logits[row], expected, atol=2e-4,
                               err_msg=f"accepted {a}, guess {t}")


def test_saguaro_sampling_scales_the_top_probabilities_by_c():
  temperature, scale, fanout = 0.7, 0.25, 3
  verify = VerifyParams(method="ssd", temperature=temperature, fanout=fanout,
                        saguaro_scale=scale)
  law = ssd.proposal(verify)
  assert ssd.proposal(VerifyParams(method="ssd", temperature=temperature)) is None  # C = 1
  assert ssd.proposal(dataclasses.replace(verify, temperature=0.0)) is None  # greedy
  logits = np.asarray(jax.random.normal(jax.random.PRNGKey(0), (2, VOCAB)), np.float64)
  scaled = np.asarray(law(jnp.asarray(logits, jnp.float32)), np.float64)
  for row in range(2):
    q = np.exp(logits[row] / temperature) / np.exp(logits[row] / temperature).sum()
    expected = q.copy()
    expected[np.argsort(-q)[:fanout]] *= scale
    expected /= expected.sum()
    got = np.exp(scaled[row] / temperature) / np.exp(scaled[row] / temperature).sum()
    np.testing.assert_allclose(got, expected, rtol=1e-5)


def test_verification_accepts_by_the_saguaro_law(models):
  """Saguaro sampling draws the drafts from q', so the exact rule must accept d_i with
  min(1, p_i(d_i) / q'_i(d_i)), q' re-derived here from the draft's own logits. Verified
  against q instead, the output joint of the sampled-law test below lies only 0.08 from
  the target: too close for its tolerance, hence this direct check."""
  target_config, target_params, draft, draft_params = models
  k, fanout, scale, temperature = 3, 3, 0.25, 0.7
  spec = loop.LoopSpec(verify=VerifyParams(method="ssd", temperature=temperature,
                                           fanout=fanout, saguaro_scale=scale),
                       num_draft=k, max_new_tokens=8)
  state, (drafts_1k, logits, _, _) = _first_round_drafts(models, spec)
  state, _ = ssd._verify(target_params, state, drafts_1k, logits, jax.random.PRNGKey(2),
                         spec=spec, target_config=target_config)
  got = np.asarray(state.stats.accept_prob_rbk)[0, 0]

  softmax = lambda z: np.exp(z - z.max(-1, keepdims=True)) / np.exp(
      z - z.max(-1, keepdims=True)).sum(-1, keepdims=True)
  d = np.asarray(drafts_1k)[0]
  q = softmax(np.asarray(logits[0, :k], np.float64) / temperature)
  q_saguaro = q.copy()
  for i in range(k):  # the top-F probabilities scaled by C, renormalised
    q_saguaro[i, np.argsort(-q[i])[:fanout]] *= scale
  q_saguaro /= q_saguaro.sum(-1, keepdims=True)
  target = transformer.forward_jit(target_params, target_config,
                                   jnp.asarray([PROMPT + d.tolist()]))[0][0]
  p = softmax(np.asarray(target[len(PROMPT) - 1:len(PROMPT) - 1 + k], np.float64)
              / temperature)
  drafted = lambda law: law[np.arange(k), d]
  want = np.minimum(1.0, drafted(p) / drafted(q_saguaro))
  np.testing.assert_allclose(got, want, atol=1e-5)
  assert np.abs(np.minimum(1.0, drafted(p) / drafted(q)) - want).max() > 0.01  # can fail


def test_greedy_ssd_reproduces_plain_greedy_decoding(models):
  decoder = _decoder(models)
  prompts = [PROMPT, [5, 6, 7], [9, 1, 2, 8, 3]]
  plain = decoder.generate(prompts, VerifyParams(method="ar", temperature=0.0),
                           max_new_tokens=12, eos_token_ids=(3,))
  ahead = decoder.generate(prompts, VerifyParams(method="ssd", temperature=0.0, fanout=3),
                           num_draft=3, max_new_tokens=12, eos_token_ids=(3,))
  assert ahead.token_ids == plain.token_ids
  budgeted = decoder.generate(prompts, VerifyParams(method="ssd", temperature=0.0, fanout=3,
                                                    guess_budget=2),
                              num_draft=3, max_new_tokens=12, eos_token_ids=(3,))
  assert budgeted.token_ids == plain.token_ids
  assert any(3 in t for t in plain.token_ids)  # one stops on EOS
  summary = metrics.summarize(ahead.stats, ahead.num_tokens, speculative=True)
  assert 0.0 <= summary["hit_rate"] <= 1.0
  assert ahead.stats.hit_rb.shape == ahead.stats.active_rb.shape


def test_a_feature_draft_pre_drafts_from_its_own_features(models):
  """An EAGLE-style draft reads target features that a pre-draft cannot know; its guessed
  rows read its own hidden states instead. Greedy output stays plain decoding's, and the
  pre-drafted rounds occur."""
  target_config, target_params, _, _ = models
  kind_config = architectures.draft_config("feature", target_config, 1, 16, 2, 1, 24)
  draft = architectures.DistilledDraft("feature", kind_config, target_config.hidden_size,
                                       VOCAB)
  params = {"train": architectures.init_train_params(draft, jax.random.PRNGKey(1),
                                                     target_params, std=0.3),
            "frozen": architectures.frozen_params(target_params, np.arange(VOCAB))}
  decoder = decoder_lib.SpeculativeDecoder(
      decoder_lib.ModelHandle(target_config, target_params), draft, params)
  prompts = [PROMPT, [5, 6, 7], [9, 1, 2, 8, 3]]
  plain = decoder.generate(prompts, VerifyParams(method="ar", temperature=0.0),
                           max_new_tokens=16, eos_token_ids=())
  ahead = decoder.generate(prompts, VerifyParams(method="ssd", temperature=0.0, fanout=3),
                           num_draft=2, max_new_tokens=16, eos_token_ids=())
  assert ahead.token_ids == plain.token_ids
  assert ahead.stats.hit_rb.sum() > 0


def test_a_draft_equal_to_the_target_has_every_round_pre_drafted(models):
  """Greedy, q = p: every draft is accepted, and the bonus token is the draft's argmax of
  q_{K+1}, its first guess; so every round after a prompt's first is a hit."""
  target_config, target_params, _, _ = models
  decoder = decoder_lib.SpeculativeDecoder(
      decoder_lib.ModelHandle(target_config, target_params), drafts.LMDraft(target_config),
      target_params)
  out = decoder.generate([PROMPT, [5, 6, 7]], VerifyParams(method="ssd", temperature=0.0),
                         num_draft=3, max_new_tokens=16, eos_token_ids=())
  summary = metrics.summarize(out.stats, out.num_tokens, speculative=True)
  assert summary["hit_rate"] == 1.0 and summary["hits"] == summary["rounds"] - 2
  assert summary["acceptance_rate"] == 1.0


def test_sampled_ssd_output_follows_the_target_law(models):
  """K = 1, two tokens, fanout 3 and Saguaro scale 0.5: a rejected first draft leaves the
  second token to a round that a guess usually pre-drafted. 1,000 prompts, against the
  121-cell joint by Pearson's chi-square (cells expected < 5 pooled: 25 bins here) at
  p > 1e-3. Exact samples lie 0.067 away in TV on average, so the former check, TV < 0.1,
  caught a 10% admixture of the draft's joint (TV 0.08 off; 0.81 away in all) only 88% of
  the time and a 6% one 17%; the chi-square catches 6% 79% and 8% 99% of the time, at the
  same 0.1% false alarm for exact samples (a numpy multinomial simulation; this seed:
  p = 0.33). (Exact verification is exact for any proposal, so this checks that the
  pre-drafts are verified against the law they were drawn from, with keys of their own.)"""
  target_config, target_params, draft, draft_params = models
  p1 = next_laws(target_config, target_params, [PROMPT])[0]
  p2 = next_laws(target_config, target_params, [PROMPT + [x] for x in range(VOCAB)])
  q1 = next_laws(draft.config, draft_params, [PROMPT])[0]
  q2 = next_laws(draft.config, draft_params, [PROMPT + [x] for x in range(VOCAB)])
  target_law = p1[:, None] * p2
  assert 0.5 * np.abs(target_law - q1[:, None] * q2).sum() > 0.5  # the test can fail
  out = _decoder(models).generate(
      [PROMPT] * 1000, VerifyParams(method="ssd", temperature=1.0, fanout=3,
                                    saguaro_scale=0.5),
      num_draft=1, max_new_tokens=2, eos_token_ids=(), seed=5)
  counts = np.zeros((VOCAB, VOCAB))
  tokens = np.asarray(out.token_ids)
  np.add.at(counts, (tokens[:, 0], tokens[:, 1]), 1)
  tv = 0.5 * np.abs(counts / counts.sum() - target_law).sum()
  statistic, bins = _chi_square(counts.ravel(), target_law.ravel())
  assert scipy.stats.chi2.sf(statistic, bins - 1) > 1e-3, (statistic, bins, tv)
  assert out.stats.hit_rb.sum() > 100  # the pre-drafted path was taken, and is exact


def _chi_square(counts, law):
  """Pearson's statistic, the cells expected below 5 pooled into one bin; and the bins."""
  expected = law * counts.sum()
  big = expected >= 5
  observed = np.append(counts[big], counts[~big].sum())
  expected = np.append(expected[big], expected[~big].sum())
  return float(((observed - expected) ** 2 / expected).sum()), len(observed)


def test_the_draft_runs_on_the_second_device():
  """Two (fake CPU) devices: the target's programs on the first, the draft's on the
  second, and the output still plain greedy decoding's."""
  script = r"""
import json, jax
from diversed_jax.models import ModelConfig, init_params
from diversed_jax.speculative import decoder as decoder_lib, drafts, ssd
from diversed_jax.speculative.types import VerifyParams
config = lambda layers: ModelConfig(family="llama", vocab_size=11, hidden_size=32,
    num_layers=layers, num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=48)
target = decoder_lib.ModelHandle(config(2), init_params(config(2), jax.random.PRNGKey(0), std=0.5))
decoder = decoder_lib.SpeculativeDecoder(
    target, drafts.LMDraft(config(1)), init_params(config(1), jax.random.PRNGKey(1), std=0.1))
ran_on = {}
original = ssd.decode
def recording_decode(*args, run, **kwargs):
  def record(name, fn, fn_args, fn_kwargs):
    out = run(name, fn, fn_args, fn_kwargs)
    ran_on.setdefault(name, set()).update(
        d.id for leaf in jax.tree.leaves(out) for d in leaf.devices())
    return out
  return original(*args, run=record, **kwargs)
ssd.decode = recording_decode
prompts = [[1, 2, 3, 4], [5, 6, 7]]
ahead = decoder.generate(prompts, VerifyParams(method="ssd", temperature=0.0), num_draft=2,
                         max_new_tokens=10, eos_token_ids=())
plain = decoder.generate(prompts, VerifyParams(method="ar", temperature=0.0),
                         max_new_tokens=10, eos_token_ids=())
print(json.dumps({"same": ahead.token_ids == plain.token_ids,
                  "ran_on": {k: sorted(v) for k, v in ran_on.items()}}))
"""
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS=xla_flags.flags(devices=2))
  proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                        env=env, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  result = json.loads(proc.stdout.strip().splitlines()[-1])
  assert result["same"]
  ran_on = result["ran_on"]
  assert ran_on["start"] == [0] and ran_on["verify"] == [0]
  assert ran_on["draft"] == [1] and ran_on["speculate"] == [1] and ran_on["guess"] == [1]


def test_refusals(models):
  with pytest.raises(ValueError, match="ssd.decode runs it"):
    target_config, target_params, draft, draft_params = models
    loop.decode(target_params, draft_params, None, jnp.asarray([PROMPT]),
                jnp.asarray([4]),
                jax.random.PRNGKey(0), spec=loop.LoopSpec(VerifyParams(method="ssd")),
                target_config=target_config, draft=draft, cache_len=16)
  for field, value, want in (("fanout", 0, ">= 1"), ("guess_budget", -1, ">= 0"),
                             ("saguaro_scale", 0.0, "in (0, 1]"),
                             ("saguaro_scale", 1.5, "in (0, 1]")):
    want = want.replace("(", "[(]")
    with pytest.raises(ValueError, match=rf"VerifyParams.{field} must be {want}"):
      verification.validate_params(VerifyParams(method="ssd", **{field: value}))
  with pytest.raises(ValueError, match=r"guess_budget=9 exceeds the \(K \+ 1\) x fanout = 8"):
    ssd.check_budget(VerifyParams(method="ssd", fanout=2, guess_budget=9), 3)
  ssd.check_budget(VerifyParams(method="ssd", fanout=2, guess_budget=8), 3)
  with pytest.raises(ValueError, match="no verification rule for method 'ssd'.*'sd'"):
    verification.get_rule("ssd")
  decoder = _decoder(models)
  decoder.mesh = mesh_lib.make_mesh(1)
  with pytest.raises(ValueError, match="does not run over a mesh"):
    decoder.generate([PROMPT], VerifyParams(method="ssd"))
