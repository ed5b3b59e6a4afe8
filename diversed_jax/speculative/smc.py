"""SMC speculative decoding: N draft particles per prompt, importance-weighted, no rollback.

methods.md, "Beyond single-draft verification" (Emara et al., arXiv 2604.15672). Each
round, for all Q x N particles at once:
  1. every particle drafts K tokens from q (the loop's `draft_round`);
  2. one target pass over [x0, d_1..d_K] scores them all and gives p_{K+1};
  3. every particle commits all K drafts and a bonus token drawn from p_{K+1} (exact, so
     it weighs 1): K + 1 tokens, nothing rolled back;
  4. its log-weight grows by sum_i log p_i(d_i) - log q_i(d_i) (the scaled laws: the
     temperature and top-p that the output should follow);
  5. a prompt whose effective sample size (sum w)^2 / sum w^2 is at most
     `ess_threshold` x N resamples its particles (systematic resampling: copies of the
     heavy ones replace the light ones, caches and outputs included) and resets their
     weights.
At the end each prompt outputs one particle drawn by weight. The output law approaches
the target's as N grows (self-normalised importance sampling: its bias shrinks as 1/N);
N = 1 outputs the draft's tokens with the target's bonus tokens.

The particles are rows of one batch, so the round is the loop's: the same draft, target
pass and cache convention (loop.py's module doc), with every draft accepted.

Shape legend: Q prompts, N particles per prompt, B = Q x N rows, K drafts per round,
V vocabulary, R rounds.
"""

from __future__ import annotations

import functools
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp

from diversed_jax.models import transformer
from diversed_jax.models.config import ModelConfig
from diversed_jax.speculative import distributions, loop

# Laws below this are taken as this: a draft outside the target's top-p nucleus weighs
# ~e^-69 instead of 0, so a prompt whose particles all left it still has weights to norm.
_MIN_PROB = 1e-30


@flax.struct.dataclass
class _State:
  round: jax.Array
  key: jax.Array
  target_cache: Any
  draft_cache: Any
  last_two_b2: jax.Array  # the last two committed tokens; [:, 1] is the pending x0
  features_b2d: jax.Array  # target hidden states that predicted those two tokens
  out_bn: jax.Array  # each particle's tokens
  num_generated_b: jax.Array
  done_b: jax.Array
  log_weight_b: jax.Array  # log importance weight since the last resampling
  stats: loop.RoundStats  # [R, Q, ...]: one column per prompt


def num_rounds(spec: loop.LoopSpec) -> int:
  """Rounds that always suffice: an unfinished particle commits K + 1 tokens a round."""
  return -(-spec.max_new_tokens // (spec.num_draft + 1))


def log_ratio(draft_logits_bkv, target_logits_bkv, drafts_bk, verify) -> jax.Array:
  """log p_i(d_i) - log q_i(d_i) [B, K] under the scaled (temperature, top-p) laws."""
  def log_law(logits):
    probs = distributions.scaled_probs(logits, verify.temperature, verify.top_p)
    drafted = jnp.take_along_axis(probs, drafts_bk[..., None], axis=-1)[..., 0]
    return jnp.log(jnp.maximum(drafted, _MIN_PROB))
  return log_law(target_logits_bkv) - log_law(draft_logits_bkv)


def effective_sample_size(log_weight_qn: jax.Array) -> jax.Array:
  """(sum w)^2 / sum w^2 per prompt [Q]: N for equal weights, 1 for one heavy particle."""
  w = jax.nn.softmax(log_weight_qn, axis=-1)
  return 1.0 / jnp.sum(w * w, axis=-1)


def systematic_resample(key: jax.Array, log_weight_qn: jax.Array) -> jax.Array:
  """Ancestors [Q, N]: particle i is drawn N w_i times up to rounding (one uniform per
  prompt, N evenly spaced points over the weights' CDF); a zero weight is never drawn."""
  q, n = log_weight_qn.shape
  cdf = jnp.cumsum(jax.nn.softmax(log_weight_qn, axis=-1), axis=-1)
  cdf = cdf.at[:, -1].set(1.0)  # rounding must not leave the last points past the end
  points = (jax.random.uniform(key, (q, 1)) + jnp.arange(n)) / n
  ancestors = jax.vmap(functools.partial(jnp.searchsorted, side="right"))(cdf, points)
  return jnp.minimum(ancestors, n - 1).astype(jnp.int32)


def _copy_rows(cache_q, cache_b, n: int):
  """`cache_b` with row r set to row r // n of `cache_q`, in `cache_b`'s layout (the one
  fastest for its B rows, which `take_rows` alone would not give a one-prompt cache)."""
  def put(row, cache):
    return cache.set_row(row, cache_q.take_rows(jnp.reshape(row // n, (1,))))
  return jax.lax.fori_loop(0, cache_b.lengths_b.shape[0], put, cache_b)


def _take_particles(state: _State, rows_b: jax.Array) -> _State:
  """Every row replaced by row `rows_b[row]` (its ancestor), with caches and outputs."""
  take = lambda x: jnp.take(x, rows_b, axis=0)
  return state.replace(
      target_cache=state.target_cache.take_rows(rows_b),
      draft_cache=state.draft_cache.take_rows(rows_b),
      last_two_b2=take(state.last_two_b2), features_b2d=take(state.features_b2d),
      out_bn=take(state.out_bn), num_generated_b=take(state.num_generated_b),
      done_b=take(state.done_b))


def _commit(spec: loop.LoopSpec, state: _State, round_tokens_bk1, log_ratio_bk) -> _State:
  """Every unfinished particle appends the round's K + 1 tokens, up to its first EOS and
  the length limit, and multiplies its weight by p/q of the drafts it kept."""
  k = spec.num_draft
  b = round_tokens_bk1.shape[0]
  out_bn, kept_b, num_generated, done = loop.commit_tokens(
      spec, state.out_bn, jnp.arange(b), state.num_generated_b, state.done_b,
      round_tokens_bk1, jnp.full((b,), k + 1, jnp.int32))
  # Only the kept drafts weigh (finished particles keep none); the bonus token is the
  # target's own.
  kept_bk = jnp.arange(k) < kept_b[:, None]
  increment = jnp.sum(jnp.where(kept_bk, log_ratio_bk, 0.0), axis=-1)
  return state.replace(out_bn=out_bn, num_generated_b=num_generated, done_b=done,
                       log_weight_b=state.log_weight_b + increment)


def _resample(ess_threshold: float, key, state: _State, q: int, n: int):
  """Resamples the particles of each prompt still decoding whose ESS is at most
  ess_threshold x N, and resets their weights. Returns (state, ESS [Q] before)."""
  log_weight_qn = state.log_weight_b.reshape(q, n)
  ess_q = effective_sample_size(log_weight_qn)
  # Particles of a finished prompt are final; those of one still decoding move on.
  decoding_q = ~jnp.all(state.done_b.reshape(q, n), axis=-1)
  resample_q = decoding_q & (ess_q <= ess_threshold * n)
  ancestors_qn = jnp.where(resample_q[:, None], systematic_resample(key, log_weight_qn),
                           jnp.arange(n))
  rows_b = (jnp.arange(q)[:, None] * n + ancestors_qn).reshape(-1)
  state = jax.lax.cond(jnp.any(resample_q), _take_particles, lambda s, _: s, state, rows_b)
  return state.replace(log_weight_b=jnp.where(jnp.repeat(resample_q, n), 0.0,
                                              state.log_weight_b)), ess_q


def _round(spec: loop.LoopSpec, target_config: ModelConfig, draft, params,
           state: _State) -> _State:
  target_params, draft_params = params
  vp, k = spec.verify, spec.num_draft
  q, n = state.stats.active_rb.shape[1], vp.particles
  key, draft_key, bonus_key, resample_key = jax.random.split(state.key, 4)

  drafts_bk, draft_logits, _, draft_cache = loop.draft_round(
      spec, draft, draft_params, state.draft_cache, state.target_cache.lengths_b,
      state.last_two_b2, state.features_b2d, draft_key)
  target_in = jnp.concatenate([state.last_two_b2[:, 1:], drafts_bk], axis=1)
  target_logits, target_hidden, target_cache = transformer.forward(
      target_params, target_config, target_in, state.target_cache)
  bonus_b = distributions.sample_logits(bonus_key, target_logits[:, k], vp.temperature,
                                        vp.top_p)
  round_tokens = jnp.concatenate([drafts_bk, bonus_b[:, None]], axis=1)

  active = ~state.done_b
  committed = _commit(spec, state, round_tokens,
                      log_ratio(draft_logits[:, :k], target_logits[:, :k], drafts_bk, vp))
  # All K drafts are in the target cache now; the bonus token is the new pending x0.
  keep = lambda new, old: jnp.where(active.reshape((-1,) + (1,) * (new.ndim - 1)), new, old)
  features = target_hidden[:, k - 1:k + 1].astype(state.features_b2d.dtype)
  committed = committed.replace(
      key=key,
      target_cache=target_cache.with_lengths(
          keep(state.target_cache.lengths_b + k + 1, state.target_cache.lengths_b)),
      draft_cache=draft_cache,
      last_two_b2=keep(round_tokens[:, k - 1:], state.last_two_b2),
      features_b2d=keep(features, state.features_b2d))
  state, ess_q = _resample(vp.ess_threshold, resample_key, committed, q, n)

  r, stats = state.round, state.stats
  ones_qk = jnp.ones((q, k), jnp.float32)
  stats = stats.replace(
      active_rb=stats.active_rb.at[r].set(jnp.any(active.reshape(q, n), axis=-1)),
      prompt_rb=stats.prompt_rb.at[r].set(jnp.arange(q, dtype=jnp.int32)),
      num_accepted_rb=stats.num_accepted_rb.at[r].set(k),
      accept_prob_rbk=stats.accept_prob_rbk.at[r].set(ones_qk),
      beta_rbk=stats.beta_rbk.at[r].set(ones_qk),
      width_r=stats.width_r.at[r].set(q * n),
      ess_rb=stats.ess_rb.at[r].set(ess_q / n))
  return state.replace(round=r + 1, stats=stats)


@functools.partial(jax.jit, static_argnames=("spec", "target_config", "draft", "cache_len",
                                             "prefill_chunk"))
def decode(target_params, draft_params, prompt_qp, prompt_lengths_q, key, *,
           spec: loop.LoopSpec, target_config: ModelConfig, draft, cache_len: int,
           prefill_chunk: int = loop.PREFILL_CHUNK) -> loop.DecodeResult:
  """SMC speculative decoding of Q prompts with spec.verify.particles particles each.

  Args as `loop.decode` (all prompts at once, no queue). The statistics have one column
  per prompt: a round is active while any of its particles decodes, every draft counts as
  accepted, and `ess_rb` holds the effective sample size over N before resampling.
  Returns DecodeResult with tokens_qn [Q, max_new_tokens + K + 1], the drawn particles'.
  """
  vp, k = spec.verify, spec.num_draft
  if vp.method != "smc":
    raise ValueError(f"smc.decode runs method 'smc', got {vp.method!r}")
  if draft is None:
    raise ValueError("method 'smc' needs a draft model")
  q, n = prompt_qp.shape[0], vp.particles
  rounds, b = num_rounds(spec), q * n
  target_cache, draft_cache, last_two, features_b2d = loop.prefill(
      target_params, target_config, draft, draft_params, prompt_qp, prompt_lengths_q,
      cache_len, prefill_chunk)
  if n > 1:  # one prefill per prompt, copied to its particles
    target_cache = _copy_rows(target_cache, transformer.init_cache(
        target_params, target_config, b, cache_len), n)
    draft_cache = _copy_rows(draft_cache, draft.init_cache(draft_params, b, cache_len), n)
    last_two, features_b2d = (jnp.repeat(x, n, axis=0) for x in (last_two, features_b2d))
  state = _State(
      round=jnp.zeros((), jnp.int32), key=key,
      target_cache=target_cache, draft_cache=draft_cache,
      last_two_b2=last_two, features_b2d=features_b2d,
      out_bn=jnp.zeros((b, spec.max_new_tokens + k + 1), jnp.int32),
      num_generated_b=jnp.zeros((b,), jnp.int32), done_b=jnp.zeros((b,), bool),
      log_weight_b=jnp.zeros((b,), jnp.float32),
      stats=loop.RoundStats.zeros(rounds, q, k).replace(
          ess_rb=jnp.zeros((rounds, q), jnp.float32)))

  round_fn = functools.partial(_round, spec, target_config, draft,
                               (target_params, draft_params))
  state = jax.lax.while_loop(lambda s: (s.round < rounds) & ~jnp.all(s.done_b), round_fn,
                             state)
  # One particle per prompt, drawn by its weight since the last resampling.
  chosen_q = jax.random.categorical(jax.random.fold_in(state.key, 1),
                                    state.log_weight_b.reshape(q, n), axis=-1)
  rows_q = jnp.arange(q) * n + chosen_q
  return loop.DecodeResult(tokens_qn=state.out_bn[rows_q],
                           num_generated_q=state.num_generated_b[rows_q],
                           num_rounds=state.round, stats=state.stats)
