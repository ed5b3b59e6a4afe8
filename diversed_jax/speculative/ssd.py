"""Speculative speculative decoding (Saguaro): while the target verifies a round on its
device, the draft pre-drafts the next round on its own.

methods.md, "Beyond single-draft verification" (Kumar, Dao, May, arXiv 2603.03251). The
rule is exact speculative decoding ('sd'); what changes is when the drafting happens.
Each round of one prompt:
  1. the target device verifies d_1..d_K (the loop's `verify_and_commit`);
  2. meanwhile the draft device guesses the outcome: for every accepted length a in
     0..K, the F tokens it finds likeliest to follow (`guess_bonus`: its top F at
     position a + 1 except the rejected d_{a+1}; at a = K its top F of q_{K+1}), and
     drafts the next round after each of those (K + 1) F outcomes at once, as the rows of
     one batch (`speculate`); with a budget B (`VerifyParams.guess_budget`), after the B
     of them it finds likeliest (`guess_outcomes`);
  3. if the verified outcome (n, token) is among the guesses, the next round's drafts are
     ready (a hit); otherwise the draft drafts them after the outcome (a miss: the serial
     path of plain speculative decoding).
The drafts of a hit were sampled with keys independent of the verification, so given the
outcome they are distributed as fresh drafts would be: the output law is the target's.

Saguaro sampling (`VerifyParams.saguaro_scale` C < 1) drafts from q', the draft's law
with its top-F probabilities scaled by C and renormalised (`saguaro_logits`), and
verifies against q' (exact for any proposal). The residual norm((p - q')+) that a
rejection samples from then puts more of its mass on those top-F tokens, which the
guesses (still the draft's own top F) cover.

A feature draft (EAGLE-style) reads target hidden states that a pre-draft cannot know
yet: the guesses' rows read the draft's own predicted features in their place (a law of
the prefix all the same, so the rule stays exact; a hit's drafts may accept less).

The loop runs from the host, one prompt at a time (the method is about one sequence's
latency): the target's and the draft's programs run on their own devices and overlap by
JAX's asynchronous dispatch. With one device both run there in turn: correct, with
nothing to overlap.

Shape legend: K drafts per round, F guesses per accepted length, G guessed outcomes
(candidate rows: (K + 1) F, or `VerifyParams.guess_budget`), P prompt bucket, S draft
steps (K + 1), V vocabulary.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from diversed_jax.models import products
from diversed_jax.models.config import ModelConfig
from diversed_jax.speculative import loop

_NEG_LOGIT = -1e30

# (name, jitted function, args, static kwargs) -> its outputs; the decoder's compiles
# each program once, ahead of its first call, to report compilation apart.
Runner = Callable[[str, Callable, tuple, dict], Any]


def _call(name: str, fn: Callable, args: tuple, kwargs: dict):
  del name
  return fn(*args, **kwargs)


def saguaro_logits(logits, fanout: int, logit_offset: float):
  """q' of Saguaro sampling from the draft's logits: the probabilities of the tokens whose
  logit is among the `fanout` largest distinct values (more than F tokens where logits
  tie) scaled by C and renormalised. At temperature T
  that is log-probability + log C on those tokens, so logits + T log C (`logit_offset`)."""
  kth = _kth_largest(logits, fanout)
  return jnp.where(logits >= kth, logits + logit_offset, logits)


def proposal(verify):
  """The law 'ssd' drafts from and verifies against, as a function of the draft's logits:
  `saguaro_logits` with C = `verify.saguaro_scale`, or None (q itself) with C = 1 or
  greedy drafting (whose argmax Saguaro sampling is not meant to move)."""
  if verify.saguaro_scale == 1.0 or verify.temperature == 0:
    return None
  return functools.partial(saguaro_logits, fanout=verify.fanout,
                           logit_offset=verify.temperature * math.log(verify.saguaro_scale))


def _kth_largest(x, k: int):
  """The k-th largest distinct value along the last axis, [..., 1], by k maxima. (Inside
  the draft's `lax.scan`, `lax.top_k` over 49,152 logits took 6 ms a step on a 2-core
  CPU, 4x the whole draft step; two maxima take 0.4 ms.)"""
  top = jnp.max(x, axis=-1, keepdims=True)
  for _ in range(k - 1):
    top = jnp.max(jnp.where(x >= top, -jnp.inf, x), axis=-1, keepdims=True)
  return top


def guess_bonus(drafts_bk: jax.Array, draft_logits_bsv: jax.Array, fanout: int) -> jax.Array:
  """[B, K + 1, F] token guesses per accepted length a, from the draft's own logits
  (under Saguaro sampling, the tokens q' scales down): the draft's top F at position
  a + 1 without d_{a+1} (a rejected draft has p < q there, so no residual mass), and at
  a = K its top F of q_{K+1} (the bonus law p_{K+1} is the target's)."""
  return _top_guesses(drafts_bk, draft_logits_bsv, fanout)[1]


def _top_guesses(drafts_bk, draft_logits_bsv, fanout: int):
  """(their logits [B, K + 1, F], token guesses [B, K + 1, F]) of `guess_bonus`."""
  b, k = drafts_bk.shape
  logits = draft_logits_bsv[:, :k + 1]
  logits = logits.at[jnp.arange(b)[:, None], jnp.arange(k)[None], drafts_bk].set(_NEG_LOGIT)
  top, tokens = jax.lax.top_k(logits, fanout)
  return top, tokens.astype(jnp.int32)


def guess_outcomes(drafts_1k, draft_logits_1sv, fanout: int, budget: int = 0,
                   temperature: float = 1.0):
  """The guessed outcomes of one row's round: (accepted lengths [G], bonus tokens [G]).

  budget 0: all of `guess_bonus`'s (K + 1) F, outcome g = a F + f accepting a drafts
  then guesses[a, f]. budget B > 0: the B of them that the draft finds likeliest, in
  that order. Saguaro allocates its budget by a geometric law of the accepted length;
  here each outcome's chance is estimated from the draft alone: P(a, t) = P(d_1..d_a
  accepted, then t) ~ q_1(d_1) ... q_a(d_a) q_{a+1}(t) (q's acceptance chance standing in
  for min(1, p/q), and its residual q(t) / (1 - q(d)) for the target's), the draft's
  probability of the committed tokens. Greedy (temperature 0) reads q at temperature 1.
  """
  k = drafts_1k.shape[1]
  top, tokens = _top_guesses(drafts_1k, draft_logits_1sv, fanout)
  if not budget:
    return jnp.repeat(jnp.arange(k + 1), fanout), tokens[0].reshape(-1)
  scale = temperature if temperature > 0 else 1.0
  logits = draft_logits_1sv[0, :k + 1].astype(jnp.float32) / scale
  log_norm = jax.nn.logsumexp(logits, axis=-1)  # [K + 1]
  drafted = jnp.take_along_axis(logits[:k], drafts_1k[0, :, None], axis=-1)[:, 0]
  path = jnp.concatenate([jnp.zeros(1), jnp.cumsum(drafted - log_norm[:k])])  # [K + 1]
  score = path[:, None] + top[0].astype(jnp.float32) / scale - log_norm[:, None]
  best = jax.lax.top_k(score.reshape(-1), budget)[1]
  return best // fanout, tokens[0].reshape(-1)[best]


def candidates(drafts_1k, accepted_g, bonus_g, target_length_1, last_two_12, features_12d,
               draft_hidden_1sd):
  """The G guessed outcomes of one row's round (`guess_outcomes`), outcome g accepting
  accepted_g[g] drafts then bonus_g[g], in the loop's convention (loop.py's module doc):
  (target lengths [G], last two committed tokens [G, 2], the features that predicted
  them [G, 2, D])."""
  x0 = last_two_12[0, 1]
  prev_g = jnp.where(accepted_g == 0, x0, drafts_1k[0, jnp.maximum(accepted_g - 1, 0)])
  features = features_12d[0]
  if draft_hidden_1sd.shape[-1] == features.shape[-1]:
    # The draft's hidden state at a step stands in for the target's that predicted the
    # same token (what a feature draft is trained to predict).
    guessed = draft_hidden_1sd[0].astype(features.dtype)
    prev_feature = jnp.where((accepted_g == 0)[:, None], features[1],
                             guessed[jnp.maximum(accepted_g - 1, 0)])
    bonus_feature = guessed[accepted_g]
  else:  # a draft of another width cannot read target features: it ignores them
    prev_feature = bonus_feature = jnp.zeros((accepted_g.shape[0], features.shape[-1]),
                                             features.dtype)
  return (target_length_1[0] + accepted_g + 1, jnp.stack([prev_g, bonus_g], axis=1),
          jnp.stack([prev_feature, bonus_feature], axis=1))


def _row_independent(spec: loop.LoopSpec):
  # As `loop.decode`: greedy verification must round as a plain step does.
  greedy = spec.verify.temperature == 0
  return products.row_independent() if greedy else contextlib.nullcontext()


def _exact(spec: loop.LoopSpec) -> loop.LoopSpec:
  """The spec the target verifies with: the exact rule."""
  return dataclasses.replace(spec, verify=dataclasses.replace(spec.verify, method="sd"))


@functools.partial(jax.jit, static_argnames=("spec", "target_config", "draft", "cache_len",
                                             "prefill_chunk"))
def _start(target_params, draft_params, prompt_1p, length_1, *, spec, target_config, draft,
           cache_len, prefill_chunk):
  """Prefills both models (on the target's device); (loop state, draft cache)."""
  target_cache, draft_cache, last_two, features = loop.prefill(
      target_params, target_config, draft, draft_params, prompt_1p, length_1, cache_len,
      prefill_chunk)
  state = loop.start_state(spec, jax.random.PRNGKey(0), target_cache, None, last_two,
                           features, 1, spec.max_rounds(1, 1))
  return state, draft_cache


@functools.partial(jax.jit, static_argnames=("spec", "draft"))
def _draft(draft_params, draft_cache, target_lengths_b, last_two_b2, features_b2d, key, *,
           spec, draft):
  with _row_independent(spec):
    return loop.draft_round(spec, draft, draft_params, draft_cache, target_lengths_b,
                            last_two_b2, features_b2d, key, proposal(spec.verify))


# The state is donated: its caches are updated in place (undonated, XLA copies the whole
# target cache every round: 59 -> 47 ms a round on SmolLM2-135M, 2-core CPU).
@functools.partial(jax.jit, static_argnames=("spec", "target_config"), donate_argnames=("state",))
def _verify(target_params, state, drafts_bk, draft_logits_bsv, key, *, spec, target_config):
  """The round on the target's device; (state, [n, next token, done] of the row)."""
  k = spec.num_draft
  law = proposal(spec.verify)
  draft_logits = draft_logits_bsv[:, :k] if law is None else law(draft_logits_bsv[:, :k])
  with _row_independent(spec):
    state = loop.verify_and_commit(_exact(spec), target_config, None, target_params, None,
                                   state, drafts_bk, draft_logits, None, key)
  outcome = jnp.stack([state.stats.num_accepted_rb[state.round - 1, 0],
                       state.last_two_b2[0, 1], state.done_b[0].astype(jnp.int32)])
  return state, outcome


@functools.partial(jax.jit, static_argnames=("fanout", "budget", "temperature"))
def _guess(drafts_1k, draft_logits_1sv, *, fanout, budget, temperature):
  """(accepted lengths [G], bonus tokens [G]) of `guess_outcomes`."""
  return guess_outcomes(drafts_1k, draft_logits_1sv, fanout, budget, temperature)


@functools.partial(jax.jit, static_argnames=("spec", "draft"))
def _speculate(draft_params, draft_cache, drafts_1k, draft_hidden_1sd, outcomes,
               target_length_1, last_two_12, features_12d, key, *, spec, draft):
  """Drafts the next round after every guessed outcome: the G rows' drafts, laws, hidden
  states and caches (the round's draft cache copied to each row)."""
  lengths_c, last_two_c2, features_c2d = candidates(
      drafts_1k, *outcomes, target_length_1, last_two_12, features_12d, draft_hidden_1sd)
  cache_c = draft_cache.take_rows(jnp.zeros(lengths_c.shape, jnp.int32))
  with _row_independent(spec):
    return loop.draft_round(spec, draft, draft_params, cache_c, lengths_c, last_two_c2,
                            features_c2d, key, proposal(spec.verify))


@jax.jit
def _take(speculation, row):
  """Candidate `row` of a speculation, as one row's drafting."""
  drafts, logits, hidden, cache = speculation
  one = lambda x: jax.lax.dynamic_slice_in_dim(x, row, 1)
  return one(drafts), one(logits), one(hidden), cache.take_rows(row[None])


def hit_row(accepted_g: np.ndarray, bonus_g: np.ndarray, num_accepted: int,
            token: int) -> int | None:
  """The candidate row of the verified outcome among the guessed ones, or None (a miss)."""
  found = np.flatnonzero((accepted_g == num_accepted) & (bonus_g == token))
  return None if found.size == 0 else int(found[0])


def check_budget(verify, num_draft: int, prefix: str = "VerifyParams.") -> None:
  """Raises ValueError unless `verify.guess_budget` is 0 or at most the (K + 1) F guesses
  it chooses from (naming it as `prefix` + guess_budget)."""
  guesses = (num_draft + 1) * verify.fanout
  if verify.guess_budget > guesses:
    raise ValueError(f"{prefix}guess_budget={verify.guess_budget} exceeds the "
                     f"(K + 1) x fanout = {guesses} guesses it chooses from (K = {num_draft}, "
                     f"fanout {verify.fanout})")


def decode(target_params, draft_params, prompt_1p, length_1, key, *, spec: loop.LoopSpec,
           target_config: ModelConfig, draft, cache_len: int,
           prefill_chunk: int = loop.PREFILL_CHUNK, draft_device=None,
           draft_params_on_device=None, run: Runner = _call) -> loop.DecodeResult:
  """Decodes one prompt by speculative speculative decoding.

  Args:
    target_params, draft_params: on the target's device (it prefills both models).
    draft_device: where the draft runs (None: the target's device);
      `draft_params_on_device` its copy of `draft_params` (None: copied here).
    prompt_1p, length_1: one right-padded prompt [1, P] and its length [1].
    spec: method 'ssd'; `spec.verify.fanout` guesses per accepted length, of which
      `guess_budget` (if > 0) are pre-drafted, and `saguaro_scale` (see the module doc).
    run: calls each program (see `Runner`).
  Returns:
    DecodeResult of one row, its `stats.hit_rb` [R, 1] True where a round's drafts were
    pre-drafted.
  """
  vp = spec.verify
  if vp.method != "ssd":
    raise ValueError(f"ssd.decode runs method 'ssd', got {vp.method!r}")
  if prompt_1p.shape[0] != 1:
    raise ValueError(f"ssd.decode decodes one prompt at a time, got {prompt_1p.shape[0]}")
  check_budget(vp, spec.num_draft)
  target_device = next(iter(jax.tree.leaves(target_params)[0].devices()))
  draft_device = draft_device or target_device
  on_draft = lambda x: jax.device_put(x, draft_device)
  on_target = lambda x: jax.device_put(x, target_device)
  draft_params_d = (on_draft(draft_params) if draft_params_on_device is None
                    else draft_params_on_device)
  state, draft_cache = run("start", _start, (target_params, draft_params, prompt_1p, length_1),
                           dict(spec=spec, target_config=target_config, draft=draft,
                                cache_len=cache_len, prefill_chunk=prefill_chunk))
  rounds = spec.max_rounds(1, 1)
  # Per round: (draft, speculate, verify) keys, on the host (one transfer, not 3 R ops).
  keys = np.asarray(jax.vmap(lambda r: jax.random.split(jax.random.fold_in(key, r), 3))(
      jnp.arange(rounds + 1)))

  def row_inputs(state):
    """What the draft's device needs of the target's state: lengths, last two, features
    (copies even on the same device: the next verification donates the state)."""
    return jax.device_put((state.target_cache.lengths_b, state.last_two_b2,
                           state.features_b2d), draft_device, may_alias=False)

  draft_kwargs = dict(spec=spec, draft=draft)
  inputs = row_inputs(state)
  drafting = run("draft", _draft, (draft_params_d, on_draft(draft_cache), *inputs,
                                   on_draft(keys[0, 0])), draft_kwargs)
  hits = np.zeros((rounds, 1), bool)
  for r in range(rounds):
    _, speculate_key, verify_key = keys[r]
    drafts, logits, hidden, draft_cache = drafting
    state, outcome = run("verify", _verify,
                         (target_params, state, *on_target((drafts, logits, verify_key))),
                         dict(spec=spec, target_config=target_config))
    outcomes = run("guess", _guess, (drafts, logits),
                   dict(fanout=vp.fanout, budget=vp.guess_budget, temperature=vp.temperature))
    speculation = run("speculate", _speculate,
                      (draft_params_d, draft_cache, drafts, hidden, outcomes, *inputs,
                       on_draft(speculate_key)), draft_kwargs)
    num_accepted, token, done = np.asarray(outcome).tolist()  # waits for the target
    if done:
      break
    inputs = row_inputs(state)
    row = hit_row(*jax.device_get(outcomes), num_accepted, token)
    if row is not None:
      hits[r + 1] = True
      drafting = run("take", _take, (speculation, on_draft(jnp.int32(row))), {})
    else:
      drafting = run("draft", _draft, (draft_params_d, draft_cache, *inputs,
                                       on_draft(keys[r + 1, 0])), draft_kwargs)
  return loop.DecodeResult(tokens_qn=state.out_qn, num_generated_q=state.num_generated_q,
                           num_rounds=state.round, stats=state.stats.replace(hit_rb=hits))
