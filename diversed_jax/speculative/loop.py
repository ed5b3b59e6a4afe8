"""The speculative decoding loop: prefill, then one `lax.while_loop` over rounds.

Each round (all rows at once, no host synchronisation):
  1. draft: a `lax.scan` proposes K tokens from q (K+1 draft steps for the ensemble and
     cascade rules, whose bonus token comes from their own law at K+1, needing q_{K+1});
  2. verify: one target forward over the K+1 positions [x0, d_1..d_K];
  3. the vectorised verification rule and `resolve_round` give each row its n leading
     accepts and one residual or bonus token;
  4. commit: each row appends its n + 1 tokens at its own write head and rolls its caches
     back by moving their lengths; rows stop on EOS or max_new_tokens;
  5. refill (continuous batching, when more prompts than rows are given): every finished
     row takes the next queued prompt, prefilled into that row's cache slots, so no row
     idles while its batch waits for the slowest one.
Tail: once no prompt is queued and at most W rows are still decoding, the batch shrinks
to those rows (`tail_widths`, e.g. B/2, B/4, ..., 1), so the rounds that only a few slow
rows need stop paying for the finished ones (a round's cost grows with its rows).
With K = 0 the same loop is plain autoregressive decoding (the baseline).

Cache convention: after every round the target cache holds all committed tokens except
the last one (the "pending" token x0, whose logits are not yet computed). The draft cache
is valid up to the last two committed tokens: each round's first draft call writes those
two at their positions (with the target's features for a feature draft). That call fills
the draft's gaps: d_K when all K drafts were accepted and the rule drafted K steps (never
fed), and the residual token; entries the draft wrote for tokens before them stay (for a
feature draft, computed from its own features).

Shape legend: Q prompts, B rows decoded at once (B = Q without a queue), P prompt bucket,
K drafts per round, V vocabulary, D hidden, R rounds (see `max_rounds`), N output buffer
(max_new_tokens + K + 1).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Any, Callable, NamedTuple

import flax.struct
import jax
import jax.numpy as jnp

from diversed_jax.models import products, transformer
from diversed_jax.models.config import ModelConfig
from diversed_jax.models.kv_cache import KVCache
from diversed_jax.speculative import distributions, verification
from diversed_jax.speculative.policy_trace import PolicyTrace
from diversed_jax.speculative.types import METHODS, VerifyParams

# Rules whose bonus token comes from their own law at K+1, which needs q_{K+1}.
BONUS_NEEDS_DRAFT = ("static", "static_logit", "diversed", "cascade")
# Methods that draft q_{K+1} too: those rules, and 'ssd', which guesses the bonus from it.
DRAFTS_LAW_AT_BONUS = BONUS_NEEDS_DRAFT + ("ssd",)

# Prompt tokens per prefill pass: divides every prompt bucket from 64 up, and is short
# enough that a short prompt in a wide bucket skips most of its padding (see `prefill`).
PREFILL_CHUNK = 64

# (head_params, h_q [..., Dq], h_p [..., Dp]) -> w [...], the weight on the target.
WeightFn = Callable[[Any, jax.Array, jax.Array], jax.Array]


@dataclasses.dataclass(frozen=True)
class LoopSpec:
  """Static description of a decoding run (hashable: a jit static argument)."""
  verify: VerifyParams
  num_draft: int = 4
  max_new_tokens: int = 64
  eos_token_ids: tuple[int, ...] = ()
  # Keep each generated token's law inputs (`policy_trace`): the head's RL reads them.
  record_policy: bool = False

  def __post_init__(self):
    # A tuple, so that the spec stays hashable (a jit static argument) when given a list.
    object.__setattr__(self, "eos_token_ids", tuple(self.eos_token_ids))
    if self.verify.method not in METHODS:
      raise ValueError(f"method={self.verify.method!r} is not one of {METHODS}")
    # Here, not only in the rules: 'ar' calls none, and would sample from NaN laws.
    verification.validate_params(self.verify, prefix="LoopSpec.verify.")
    if self.num_draft < 0:
      raise ValueError(f"num_draft={self.num_draft} must be >= 0")
    if self.verify.method != "ar" and self.num_draft == 0:
      raise ValueError(f"method={self.verify.method!r} needs num_draft >= 1")
    if self.verify.method == "ar" and self.num_draft:
      raise ValueError(f"method='ar' drafts nothing: num_draft={self.num_draft} must be 0")
    if self.max_new_tokens < 1:
      raise ValueError(f"max_new_tokens={self.max_new_tokens} must be >= 1")
    if self.record_policy and self.verify.method not in BONUS_NEEDS_DRAFT:
      raise ValueError(f"record_policy needs a rule that commits every token under a law "
                       f"mixing q, one of {BONUS_NEEDS_DRAFT}; got "
                       f"method={self.verify.method!r}")

  def program_key(self) -> "LoopSpec":
    """This spec with its rule's TRACED_FIELDS at their defaults (`decode`'s static spec
    when the values come as `rule_values`)."""
    return dataclasses.replace(self, verify=self.verify.program_key())

  @property
  def num_draft_steps(self) -> int:
    """Draft forward steps per round: K, plus one for q_{K+1} (DRAFTS_LAW_AT_BONUS)."""
    return self.num_draft + (self.verify.method in DRAFTS_LAW_AT_BONUS)

  def max_rounds(self, num_prompts: int, batch_size: int) -> int:
    """Rounds that always suffice: every active row commits >= 1 token per round, and
    while prompts are queued all B rows are active."""
    if num_prompts == batch_size:
      return self.max_new_tokens
    return -(-num_prompts * self.max_new_tokens // batch_size) + self.max_new_tokens


@flax.struct.dataclass
class RoundStats:
  """Per-round statistics, [R, B, ...] (column b: the row that started as row b, also
  after the tail shrinks the batch); rows inactive in a round have active_rb False."""
  active_rb: jax.Array  # bool
  prompt_rb: jax.Array  # int32, the prompt (index into the queue) a row served
  num_accepted_rb: jax.Array  # int32, n: the rule's accepts (an EOS or the length limit may
  # then cut the committed tokens short; acceptance figures measure the rule)
  accept_prob_rbk: jax.Array  # a_i(x_i)
  beta_rbk: jax.Array  # sum_x q_i a_i, the expected acceptance (Verdict.beta_bk)
  weights_rbk: jax.Array  # w_i on the target (K+1 positions; zeros for rules without a w)
  width_r: jax.Array  # int32, the rows the round ran: B, or a tail width (`tail_widths`)
  ess_rb: jax.Array | None = None  # 'smc' only: effective sample size / particles
  hit_rb: Any = None  # 'ssd' only (numpy, bool): the round's drafts were pre-drafted

  @classmethod
  def zeros(cls, rounds: int, columns: int, k: int) -> "RoundStats":
    """Statistics of `rounds` rounds of `columns` columns, all inactive."""
    return cls(active_rb=jnp.zeros((rounds, columns), bool),
               prompt_rb=jnp.zeros((rounds, columns), jnp.int32),
               num_accepted_rb=jnp.zeros((rounds, columns), jnp.int32),
               accept_prob_rbk=jnp.zeros((rounds, columns, k), jnp.float32),
               beta_rbk=jnp.zeros((rounds, columns, k), jnp.float32),
               weights_rbk=jnp.zeros((rounds, columns, k + 1), jnp.float32),
               width_r=jnp.zeros((rounds,), jnp.int32))


@flax.struct.dataclass
class DecodeResult:
  tokens_qn: jax.Array  # generated ids per prompt; entries past num_generated_q are not
  # output (leftover drafts, tokens after EOS or the length limit)
  num_generated_q: jax.Array
  num_rounds: jax.Array  # rounds the loop ran (scalar)
  stats: RoundStats
  policy: PolicyTrace | None = None  # with LoopSpec.record_policy


@flax.struct.dataclass
class _State:
  round: jax.Array
  key: jax.Array
  target_cache: KVCache
  draft_cache: Any
  last_two_b2: jax.Array  # the last two committed tokens; [:, 1] is the pending x0
  features_b2d: jax.Array  # target hidden states that predicted those two tokens
  prompt_b: jax.Array  # the prompt each row decodes
  slot_b: jax.Array  # the row each row started as (its column of the statistics)
  next_prompt: jax.Array  # the first queued prompt (Q when the queue is empty)
  out_qn: jax.Array
  num_generated_q: jax.Array
  num_generated_b: jax.Array
  done_b: jax.Array
  stats: RoundStats
  policy: PolicyTrace | None = None  # with LoopSpec.record_policy


def first_index(mask_bk: jax.Array) -> jax.Array:
  """Index of the first True along the last axis, or its length when none."""
  k = mask_bk.shape[-1]
  return jnp.min(jnp.where(mask_bk, jnp.arange(k), k), axis=-1)


def commit_tokens(spec: LoopSpec, out_qn, rows_b, num_generated_b, done_b, tokens_bk1,
                  num_committed_b):
  """Each unfinished row appends the first `num_committed_b` of its round's tokens at its
  write head, in output row `rows_b`, kept up to its first EOS among them and the length
  limit; finished rows change nothing. Tokens past the kept ones are written too (the
  next round overwrites them; they are never output).

  Returns (out_qn, kept_b: the tokens each row kept (0 when finished), num_generated_b,
  done_b).
  """
  positions_k1 = jnp.arange(tokens_bk1.shape[1])
  count_b = num_committed_b
  if spec.eos_token_ids:
    is_eos = (jnp.isin(tokens_bk1, jnp.asarray(spec.eos_token_ids))
              & (positions_k1 < num_committed_b[:, None]))
    first_eos = first_index(is_eos)
    hit_eos = first_eos < num_committed_b
    count_b = jnp.where(hit_eos, first_eos + 1, count_b)
  else:
    hit_eos = jnp.zeros(count_b.shape, bool)
  active = ~done_b
  kept_b = jnp.where(active, jnp.minimum(count_b, spec.max_new_tokens - num_generated_b), 0)
  # Finished rows write past the buffer's end, where the writes are dropped.
  cols_bk1 = jnp.where(active[:, None], num_generated_b[:, None] + positions_k1,
                       out_qn.shape[1])
  out_qn = out_qn.at[rows_b[:, None], cols_bk1].set(tokens_bk1, mode="drop")
  num_generated_b = num_generated_b + kept_b
  done_b = done_b | (active & (hit_eos | (num_generated_b >= spec.max_new_tokens)))
  return out_qn, kept_b, num_generated_b, done_b


def draft_round(spec: LoopSpec, draft, draft_params, draft_cache, target_lengths_b,
                last_two_b2, features_b2d, key, proposal=None):
  """Runs the draft for one round from the loop's cache convention (module doc): the
  draft catches up on the last two committed tokens, then samples `spec.num_draft_steps`.
  `proposal` (logits -> logits), if given, is the law the drafts are sampled from as a
  function of the draft's logits; a verification must then apply it too.

  Returns drafts_bk [B, K], draft_logits_bsv [B, steps, V] (the draft's own),
  draft_hidden_bsd, cache.
  """
  vp = spec.verify
  cache = draft_cache.with_lengths(target_lengths_b - 1)
  # Two tokens in, the last one's law out (see drafts.py).
  logits, hidden, cache = draft.forward(draft_params, last_two_b2, cache, features_b2d,
                                        last_only=True)
  first = (logits[:, -1], hidden[:, -1])

  def sample(step_key, logits_bv):
    law = logits_bv if proposal is None else proposal(logits_bv)
    return distributions.sample_logits(step_key, law, temperature=vp.temperature,
                                       top_p=vp.top_p)

  def step(carry, step_key):
    logits_bv, hidden_bd, cache = carry
    token_b = sample(step_key, logits_bv)
    logits, hidden, cache = draft.forward(draft_params, token_b[:, None], cache, None)
    return (logits[:, 0], hidden[:, 0], cache), (token_b, logits_bv, hidden_bd)

  steps = spec.num_draft_steps
  keys = jax.random.split(key, steps)
  # The first K-1 (or K) steps both sample and feed; the last step only samples.
  (last_logits, last_hidden, cache), (tokens, logits_s, hidden_s) = jax.lax.scan(
      step, (*first, cache), keys[:steps - 1])
  last_token = sample(keys[-1], last_logits)
  tokens_sb = jnp.concatenate([tokens, last_token[None]], 0)
  logits_sbv = jnp.concatenate([logits_s, last_logits[None]], 0)
  hidden_sbd = jnp.concatenate([hidden_s, last_hidden[None]], 0)
  drafts_bk = tokens_sb.T[:, :spec.num_draft]
  return drafts_bk, logits_sbv.swapaxes(0, 1), hidden_sbd.swapaxes(0, 1), cache


def _round(spec: LoopSpec, target_config: ModelConfig, draft, weight_fn, params, state):
  """One round: the draft proposes (`draft_round`), then `verify_and_commit`."""
  target_params, draft_params, head_params = params
  key, draft_key, verify_key = jax.random.split(state.key, 3)
  if spec.num_draft == 0:
    b = state.num_generated_b.shape[0]
    drafts_bk, draft_logits, draft_hidden = jnp.zeros((b, 0), jnp.int32), None, None
    draft_cache = state.draft_cache
  else:
    drafts_bk, draft_logits, draft_hidden, draft_cache = draft_round(
        spec, draft, draft_params, state.draft_cache, state.target_cache.lengths_b,
        state.last_two_b2, state.features_b2d, draft_key)
  return verify_and_commit(spec, target_config, weight_fn, target_params, head_params,
                           state.replace(key=key, draft_cache=draft_cache), drafts_bk,
                           draft_logits, draft_hidden, verify_key)


class _Decision(NamedTuple):
  """What a round's rule decided, per row."""
  num_accepted_b: jax.Array  # n, the leading drafts accepted
  next_token_b: jax.Array  # the residual (n < K) or bonus (n = K) token, at index n
  accept_prob_bk: jax.Array
  beta_bk: jax.Array
  weights_bk1: jax.Array  # w on the target (zeros for rules without one)


def _decide(spec: LoopSpec, weight_fn, head_params, drafts_bk, draft_logits, draft_hidden,
            target_logits, target_hidden, key) -> _Decision:
  """Step 3 of a round: the rule and its resolution (plain sampling with K = 0)."""
  vp = spec.verify
  b, k = drafts_bk.shape
  zeros_bk = jnp.zeros((b, k), jnp.float32)
  weights = jnp.zeros((b, k + 1), jnp.float32)
  if k == 0:
    next_token = distributions.sample_logits(key, target_logits[:, 0], vp.temperature,
                                             vp.top_p)
    return _Decision(jnp.zeros((b,), jnp.int32), next_token, zeros_bk, zeros_bk, weights)
  if vp.method == "diversed":
    weights = weight_fn(head_params, draft_hidden, target_hidden)
  elif vp.method in ("static", "static_logit"):  # recorded for the reports' mean w
    weights = jnp.full((b, k + 1), vp.weight, jnp.float32)
  weights_bk1 = weights if vp.method == "diversed" else None
  if vp.temperature == 0 and vp.method in verification.TWO_TOKEN_RULES:
    # Greedy drafts and one-hot laws: the rule runs on two tokens per position.
    verdict, outcome = verification.greedy_round(draft_logits, target_logits, vp,
                                                 weights_bk1, key)
  else:
    verdict = verification.get_rule(vp.method)(draft_logits, target_logits, drafts_bk, vp,
                                               weights_bk1)
    outcome = verification.resolve_round(verdict, drafts_bk, key)
  return _Decision(outcome.num_accepted_b, outcome.next_token_b, verdict.accept_prob_bk,
                   verdict.beta_bk, weights.astype(jnp.float32))


def _last_two_after(state: _State, round_tokens_bk1, decision: _Decision, target_hidden,
                    active_b):
  """The last two committed tokens of each active row after its round, and the target
  features that predicted them: at indices n - 1 and n of the round's pass (for n = 0 the
  first one is the old second)."""
  n = decision.num_accepted_b
  before_n = jnp.maximum(n - 1, 0)
  prev = jnp.where(n > 0, jnp.take_along_axis(round_tokens_bk1, before_n[:, None], axis=1)[:, 0],
                   state.last_two_b2[:, 1])
  last_two = jnp.stack([prev, decision.next_token_b], axis=1)
  at_n = jnp.take_along_axis(target_hidden, n[:, None, None], axis=1)[:, 0]
  feature_before = jnp.take_along_axis(target_hidden, before_n[:, None, None], axis=1)[:, 0]
  feature_before = jnp.where((n > 0)[:, None], feature_before, state.features_b2d[:, 1])
  features = jnp.stack([feature_before, at_n], axis=1).astype(state.features_b2d.dtype)
  return (jnp.where(active_b[:, None], last_two, state.last_two_b2),
          jnp.where(active_b[:, None, None], features, state.features_b2d))


def _stats_with_round(state: _State, active_b, decision: _Decision) -> RoundStats:
  """The statistics with this round's in the rows' columns (rows dropped by a shrunk tail
  keep their columns' zeros: inactive)."""
  stats, r, slots = state.stats, state.round, state.slot_b
  return stats.replace(
      active_rb=stats.active_rb.at[r, slots].set(active_b),
      prompt_rb=stats.prompt_rb.at[r, slots].set(state.prompt_b),
      num_accepted_rb=stats.num_accepted_rb.at[r, slots].set(decision.num_accepted_b),
      accept_prob_rbk=stats.accept_prob_rbk.at[r, slots].set(decision.accept_prob_bk),
      beta_rbk=stats.beta_rbk.at[r, slots].set(decision.beta_bk),
      weights_rbk=stats.weights_rbk.at[r, slots].set(decision.weights_bk1),
      width_r=stats.width_r.at[r].set(active_b.shape[0]),
  )


def verify_and_commit(spec: LoopSpec, target_config: ModelConfig, weight_fn, target_params,
                      head_params, state: _State, drafts_bk, draft_logits, draft_hidden,
                      key) -> _State:
  """Steps 2-4 of a round (module doc) for drafts `drafts_bk` that the draft sampled
  from `draft_logits` [B, steps, V] (None with K = 0): the target pass, the rule, the commit and
  the roll-back of the target cache. `state.draft_cache` passes through untouched, and
  `state.key` is not used (`key` is the rule's)."""
  k = spec.num_draft
  target_in = jnp.concatenate([state.last_two_b2[:, 1:], drafts_bk], axis=1)
  target_logits, target_hidden, target_cache = transformer.forward(
      target_params, target_config, target_in, state.target_cache)
  decision = _decide(spec, weight_fn, head_params, drafts_bk, draft_logits, draft_hidden,
                     target_logits, target_hidden, key)
  n = decision.num_accepted_b

  # The round's tokens: d_1..d_n, then the residual/bonus token at index n.
  positions_k1 = jnp.arange(k + 1)
  b = drafts_bk.shape[0]
  round_tokens = jnp.concatenate([drafts_bk, jnp.zeros((b, 1), drafts_bk.dtype)], axis=1)
  round_tokens = jnp.where(positions_k1 == n[:, None], decision.next_token_b[:, None],
                           round_tokens)
  active = ~state.done_b
  policy = state.policy
  if policy is not None:
    policy = policy.record(state.prompt_b, state.num_generated_b[:, None] + positions_k1,
                           active, round_tokens, draft_logits, target_logits, draft_hidden,
                           target_hidden, spec.verify.temperature, spec.verify.top_p)
  # Rows write into their prompts' output rows.
  out_qn, _, num_generated, done = commit_tokens(
      spec, state.out_qn, state.prompt_b, state.num_generated_b, state.done_b, round_tokens,
      n + 1)
  # Roll back: x0 and the n accepted drafts are now in the target cache; the new pending
  # token is next_token. Finished rows keep their lengths.
  lengths = jnp.where(active, state.target_cache.lengths_b + n + 1,
                      state.target_cache.lengths_b)
  last_two, features = _last_two_after(state, round_tokens, decision, target_hidden, active)
  return state.replace(
      round=state.round + 1,
      target_cache=target_cache.with_lengths(lengths),
      last_two_b2=last_two,
      features_b2d=features,
      out_qn=out_qn, num_generated_q=state.num_generated_q.at[state.prompt_b].set(num_generated),
      num_generated_b=num_generated, done_b=done,
      stats=_stats_with_round(state, active, decision), policy=policy)


def _pass_counts(num_tokens, chunk: int) -> tuple[jax.Array, jax.Array]:
  """(whole chunks, quarter-chunk passes) that prefill `num_tokens` prompt tokens: the
  rest after the whole chunks in up to two passes of a quarter chunk, or one more whole
  chunk when longer.

  A pass of few tokens costs more per token (the weights are read once a pass), but less
  in all: on a 2-core host a 64-token pass took 97 ms and a 16-token pass 32 ms, so a GSM8K
  prompt of 134 tokens prefills in 2 x 64 + 16 (215 against 288 ms). Each pass size is
  one more copy of both models' forward in the compiled loop (+3-4 s of compilation for
  the 30-layer target), hence one shorter size. A chunk that 4 does not divide has none.
  """
  whole, rest = num_tokens // chunk, num_tokens % chunk
  if chunk % 4:
    return whole + (rest > 0), jnp.zeros_like(whole)
  quarters = (rest + chunk // 4 - 1) // (chunk // 4)
  return whole + (quarters > 2), jnp.where(quarters > 2, 0, quarters)


def prefill(target_params, target_config: ModelConfig, draft, draft_params, prompt_bp,
             prompt_lengths_b, cache_len: int, chunk: int):
  """Fresh caches of both models holding each prompt but its last token (the pending x0);
  the draft cache's lengths are left as the passes set them (each round sets its own).

  The prompts go through both models `chunk` tokens at a time, as far as the longest
  prompt of the call needs: a short prompt in a wide bucket skips most of its padding
  (one pass over the whole width made the one-row refills up to half of a queued call's
  time). The rest after the whole chunks may take shorter passes (`_pass_counts`).
  Slots written past a row's length are stale, as after any roll-back. A width that
  `chunk` does not divide is taken as one chunk of the whole width (its rest may still take
  the shorter passes).

  Returns (target_cache, draft_cache or None, last_two_b2, features_b2d).
  """
  b, width = prompt_bp.shape
  if width % chunk:
    chunk = width
  target_cache = transformer.init_cache(target_params, target_config, b, cache_len)
  draft_cache = None if draft is None else draft.init_cache(draft_params, b, cache_len)
  # features_btd[:, t] = the target hidden state that predicted prompt token t (zeros at 0).
  features_btd = jnp.zeros((b, width + 1, target_config.hidden_size),
                           target_params["embed"].dtype)

  def run_pass(start, size: int, caches_and_features):
    """Prompt slots [start, start + size) through both models."""
    target_cache, draft_cache, features_btd = caches_and_features
    at_start = lambda cache: cache.with_lengths(jnp.full((b,), start, jnp.int32))
    tokens_bc = jax.lax.dynamic_slice_in_dim(prompt_bp, start, size, axis=1)
    hidden, target_cache = transformer.forward_hidden(target_params, target_config, tokens_bc,
                                                      at_start(target_cache))
    features_btd = jax.lax.dynamic_update_slice_in_dim(
        features_btd, hidden.astype(features_btd.dtype), start + 1, axis=1)
    if draft is not None:
      _, _, draft_cache = draft.forward(
          draft_params, tokens_bc, at_start(draft_cache),
          jax.lax.dynamic_slice_in_dim(features_btd, start, size, axis=1))
    return target_cache, draft_cache, features_btd

  num_chunks, num_quarters = _pass_counts(jnp.max(prompt_lengths_b) - 1, chunk)
  carry = jax.lax.fori_loop(0, num_chunks, lambda i, c: run_pass(i * chunk, chunk, c),
                            (target_cache, draft_cache, features_btd))
  if chunk % 4 == 0:
    # In bounds: quarter passes lie in the chunk after the whole ones, inside the width.
    quarter = chunk // 4
    carry = jax.lax.fori_loop(
        0, num_quarters, lambda i, c: run_pass(num_chunks * chunk + i * quarter, quarter, c),
        carry)
  target_cache, draft_cache, features_btd = carry
  target_cache = target_cache.with_lengths(prompt_lengths_b - 1)
  last_idx_b2 = (prompt_lengths_b[:, None] - 2) + jnp.arange(2)
  last_two = jnp.take_along_axis(prompt_bp, last_idx_b2, axis=1).astype(jnp.int32)
  features_b2d = jnp.take_along_axis(features_btd, last_idx_b2[:, :, None], axis=1)
  return target_cache, draft_cache, last_two, features_b2d


def _refill(target_config: ModelConfig, draft, params, prompt_qp, prompt_lengths_q,
            cache_len: int, prefill_chunk: int, state: _State) -> _State:
  """Continuous batching: moves queued prompts into finished rows, one row at a time.

  A refilled row gets a one-row prefill written over its cache slots (stale slots past the
  new length are masked as after any roll-back) and starts with the next round.
  """
  target_params, draft_params, _ = params
  num_prompts = prompt_qp.shape[0]

  def refill_one(s: _State) -> _State:
    row, n = jnp.argmax(s.done_b), s.next_prompt
    target_cache, draft_cache, last_two, features = prefill(
        target_params, target_config, draft, draft_params,
        jax.lax.dynamic_slice_in_dim(prompt_qp, n, 1),
        jax.lax.dynamic_slice_in_dim(prompt_lengths_q, n, 1), cache_len, prefill_chunk)
    return s.replace(
        target_cache=s.target_cache.set_row(row, target_cache),
        draft_cache=None if draft is None else s.draft_cache.set_row(row, draft_cache),
        last_two_b2=s.last_two_b2.at[row].set(last_two[0]),
        features_b2d=s.features_b2d.at[row].set(features[0].astype(s.features_b2d.dtype)),
        prompt_b=s.prompt_b.at[row].set(n), next_prompt=n + 1,
        num_generated_b=s.num_generated_b.at[row].set(0), done_b=s.done_b.at[row].set(False))

  return jax.lax.while_loop(lambda s: jnp.any(s.done_b) & (s.next_prompt < num_prompts),
                            refill_one, state)


def _shrink(state: _State, width: int) -> _State:
  """Keeps `width` rows, the unfinished ones first (the caller ensures they fit), each
  with its caches, tokens and counters; finished rows fill any remaining places."""
  rows_w = jnp.argsort(state.done_b, stable=True)[:width]
  take = lambda x: jnp.take(x, rows_w, axis=0)
  return state.replace(
      target_cache=state.target_cache.take_rows(rows_w),
      draft_cache=None if state.draft_cache is None else state.draft_cache.take_rows(rows_w),
      last_two_b2=take(state.last_two_b2), features_b2d=take(state.features_b2d),
      prompt_b=take(state.prompt_b), slot_b=take(state.slot_b),
      num_generated_b=take(state.num_generated_b),
      done_b=take(state.done_b))


def start_state(spec: LoopSpec, key, target_cache, draft_cache, last_two_b2, features_b2d,
                num_prompts: int, rounds: int, draft_dim: int = 0) -> _State:
  """The loop's state after `prefill` of the first B prompts (B = the rows of
  `last_two_b2`), with room for `rounds` rounds of statistics; `draft_dim`: the draft's
  hidden size, for `spec.record_policy`."""
  b, k = last_two_b2.shape[0], spec.num_draft
  positions = spec.max_new_tokens + k + 1
  policy = (PolicyTrace.zeros(num_prompts, positions, draft_dim, features_b2d.shape[-1])
            if spec.record_policy else None)
  return _State(
      round=jnp.zeros((), jnp.int32), key=key,
      target_cache=target_cache, draft_cache=draft_cache,
      last_two_b2=last_two_b2, features_b2d=features_b2d,
      prompt_b=jnp.arange(b, dtype=jnp.int32), slot_b=jnp.arange(b, dtype=jnp.int32),
      next_prompt=jnp.asarray(b, jnp.int32),
      out_qn=jnp.zeros((num_prompts, positions), jnp.int32),
      num_generated_q=jnp.zeros((num_prompts,), jnp.int32),
      num_generated_b=jnp.zeros((b,), jnp.int32), done_b=jnp.zeros((b,), bool),
      stats=RoundStats.zeros(rounds, b, k), policy=policy)


def default_tail_widths(batch_size: int, multiple_of: int = 1) -> tuple[int, ...]:
  """B/2, B/4, ... down to `multiple_of` (a sharded batch keeps whole shards)."""
  widths, width = [], batch_size // 2
  while width >= multiple_of and width % multiple_of == 0:
    widths.append(width)
    width //= 2
  return tuple(widths)


@functools.partial(jax.jit, static_argnames=("spec", "target_config", "draft", "weight_fn",
                                             "cache_len", "batch_size", "prefill_chunk",
                                             "tail_widths"))
def decode(target_params, draft_params, head_params, prompt_qp, prompt_lengths_q, key,
           rule_values=None, *, spec: LoopSpec, target_config: ModelConfig, draft=None,
           weight_fn: WeightFn | None = None, cache_len: int,
           batch_size: int | None = None, prefill_chunk: int = PREFILL_CHUNK,
           tail_widths: tuple[int, ...] = ()) -> DecodeResult:
  """Prefills both models and runs the speculative loop; everything in one program.

  Args:
    head_params: the ensemble head's parameters (`weight_fn`'s first argument), or None.
    prompt_qp: right-padded prompts [Q, P] (P a bucket length), prompt_lengths_q >= 2.
    key: the call's PRNG key (each round splits its own from it).
    rule_values: None, or values of the rule's TRACED_FIELDS (float32 scalars) that
      replace spec.verify's, as arguments of the program: one compiled program serves
      every value (pass `spec.program_key()` and `spec.verify.traced_values()`).
    draft: a draft object (see drafts.py) or None for autoregressive decoding.
    weight_fn: the ensemble head for method 'diversed'.
    cache_len: static cache slots, >= P + max_new_tokens + K + 1.
    batch_size: rows decoded at once, B <= Q (None: all Q). With B < Q the first B
      prompts start and the others queue; each finished row takes the next queued
      prompt (continuous batching).
    prefill_chunk: prompt tokens per prefill pass (see `prefill`).
    tail_widths: decreasing batch widths below B: once the queue is empty and at most W
      rows are unfinished, the loop continues with those rows only (one more compiled
      round per width; `default_tail_widths` halves). () keeps all B rows to the end.
  Returns:
    DecodeResult with tokens_qn [Q, max_new_tokens + K + 1].
  """
  num_prompts = prompt_qp.shape[0]
  b = num_prompts if batch_size is None else batch_size
  if not 1 <= b <= num_prompts:
    raise ValueError(f"batch_size={batch_size} must be in [1, {num_prompts}] (the prompts)")
  if prefill_chunk < 1:
    raise ValueError(f"prefill_chunk={prefill_chunk} must be >= 1")
  tail_widths = tuple(tail_widths)
  if any(not 1 <= w < v for w, v in zip(tail_widths, (b,) + tail_widths)):
    raise ValueError(f"tail_widths={tail_widths} must decrease from below the batch size "
                     f"{b} to >= 1")
  if spec.verify.method == "smc":
    raise ValueError("method 'smc' weighs particles instead of verifying: smc.decode runs it")
  if spec.verify.method == "ssd":
    raise ValueError("method 'ssd' drafts ahead from the host, one prompt at a time: "
                     "ssd.decode runs it")
  if spec.verify.method == "diversed" and weight_fn is None:
    raise ValueError("method 'diversed' needs an ensemble head (weight_fn)")
  if spec.num_draft and draft is None:
    raise ValueError(f"method={spec.verify.method!r} with num_draft={spec.num_draft} needs "
                     "a draft (draft=None)")
  # Writes past the cache's end would be dropped silently, and the tokens go wrong.
  needed = prompt_qp.shape[1] + spec.max_new_tokens + spec.num_draft + 1
  if cache_len < needed:
    raise ValueError(f"cache_len={cache_len} must be >= the prompt bucket "
                     f"{prompt_qp.shape[1]} + max_new_tokens {spec.max_new_tokens} + "
                     f"num_draft {spec.num_draft} + 1 = {needed}")
  if rule_values is not None:  # traced from here on: one program for every value
    spec = dataclasses.replace(spec, verify=dataclasses.replace(spec.verify, **rule_values))

  # Greedy output must equal plain greedy decoding's bit for bit at any B and K, whatever
  # the prompts beside it: each row of a verification of B (K + 1) rows (and of a prefill
  # pass of B chunks) must round as in a plain step of one row, which past 64 rows only
  # the kernel does. Sampled calls keep XLA's dot there: at 80-128 rows on a 2-core host
  # it ran rounds 6-23% faster (a batch-8 GSM8K prefill 13% faster), and a rounding
  # difference changes no law.
  greedy = spec.verify.temperature == 0
  with products.row_independent() if greedy else contextlib.nullcontext():
    return _prefill_and_loop(target_params, draft_params, head_params, prompt_qp,
                             prompt_lengths_q, key, spec=spec, target_config=target_config,
                             draft=draft, weight_fn=weight_fn, cache_len=cache_len,
                             batch_size=b, prefill_chunk=prefill_chunk,
                             tail_widths=tail_widths)


def _prefill_and_loop(target_params, draft_params, head_params, prompt_qp, prompt_lengths_q,
                      key, *, spec, target_config, draft, weight_fn, cache_len, batch_size,
                      prefill_chunk, tail_widths) -> DecodeResult:
  """`decode`'s program once its arguments are checked: the first B prompts' prefill,
  then the rounds (with refills while prompts are queued), then the tail's widths."""
  num_prompts, b = prompt_qp.shape[0], batch_size
  target_cache, draft_cache, last_two, features_b2d = prefill(
      target_params, target_config, draft, draft_params, prompt_qp[:b],
      prompt_lengths_q[:b], cache_len, prefill_chunk)

  rounds = spec.max_rounds(num_prompts, b)
  draft_dim = 0
  if spec.record_policy:
    _, hidden, _ = jax.eval_shape(draft.forward, draft_params, last_two, draft_cache,
                                  features_b2d)
    draft_dim = hidden.shape[-1]
  state = start_state(spec, key, target_cache, draft_cache, last_two, features_b2d,
                      num_prompts, rounds, draft_dim)
  params = (target_params, draft_params, head_params)
  round_fn = functools.partial(_round, spec, target_config, draft, weight_fn, params)
  if b < num_prompts:
    refill = functools.partial(_refill, target_config, draft, params, prompt_qp,
                               prompt_lengths_q, cache_len, prefill_chunk)
    body = lambda s: refill(round_fn(s))
  else:
    body = round_fn
  def running(s: _State, next_width: int | None):
    go = (s.round < rounds) & ~jnp.all(s.done_b)
    if next_width is None:
      return go
    fits = (s.next_prompt >= num_prompts) & (jnp.sum(~s.done_b) <= next_width)
    return go & ~fits

  next_widths = tail_widths + (None,)  # each phase runs until the next width fits
  state = jax.lax.while_loop(functools.partial(running, next_width=next_widths[0]),
                             body, state)
  for width, next_width in zip(tail_widths, next_widths[1:]):  # queue empty: no refill
    state = jax.lax.while_loop(functools.partial(running, next_width=next_width),
                               round_fn, _shrink(state, width))
  return DecodeResult(tokens_qn=state.out_qn, num_generated_q=state.num_generated_q,
                      num_rounds=state.round, stats=state.stats, policy=state.policy)
