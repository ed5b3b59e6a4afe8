"""Measured per-step costs of a decoder's model calls: what speed-up predictions use.

The speed-up of speculative decoding over autoregressive decoding is predicted from the
mean committed tokens per round and the cost ratios of a round's model calls:

  predicted = tokens_per_round / (c2 + (draft_steps - 1) * c + r),

c = draft step / target decoding step, r = target verification over K+1 tokens / target
decoding step, and c2 = the round's first draft call / target decoding step: that call
catches the draft up on the last two committed tokens (with the target's features of
them), so it is a two-token forward, 1.3-1.6x a one-token draft step here. `measure`
times the four calls as the loop makes them: in the parameter and cache layouts the
decoder uses for each, inside one compiled loop (updated in place; undonated, XLA copies
the whole cache every call and a step looks up to 2x slower at batch 8; called one step at
a time, the unrolled layout's dispatch added milliseconds a step).
"""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from diversed_jax.models import transformer
from diversed_jax.models.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class StepCosts:
  """Seconds of one call of each kind (best of the repeats)."""
  decode_s: float  # target, one token per row
  verify_s: float  # target, K+1 tokens per row
  draft_s: float  # draft, one token per row
  catchup_s: float  # draft, a round's first call: two tokens per row with their features

  @property
  def c(self) -> float:
    return self.draft_s / self.decode_s

  @property
  def r(self) -> float:
    return self.verify_s / self.decode_s

  def round_s(self, draft_steps: int) -> float:
    """Seconds of one round's model calls: the draft's catch-up call, its further steps
    and the verification."""
    return self.catchup_s + (draft_steps - 1) * self.draft_s + self.verify_s

  def predicted_speedup(self, tokens_per_round: float, draft_steps: int) -> float:
    return tokens_per_round * self.decode_s / self.round_s(draft_steps)

  @staticmethod
  def best(samples: list["StepCosts"]) -> "StepCosts":
    """Each call's fastest sample (the host's speed drifts between samples)."""
    return StepCosts(*(min(getattr(s, f.name) for s in samples)
                       for f in dataclasses.fields(StepCosts)))


@functools.partial(jax.jit, static_argnames=("model", "num_steps"), donate_argnums=(1,))
def _run_steps(params, cache, tokens_bt, features_btd=None, *, model, num_steps: int):
  """`num_steps` forwards of `model` (the target's ModelConfig or a draft object) in one
  `fori_loop`, the cache updated in place and rolled back after each step, as the
  speculative loop does. One call per measurement: a jitted call's own dispatch costs
  milliseconds with the unrolled layout's hundreds of arrays, which the loop never pays per
  step. Every step's logits are reduced (max) so no part of the forward is left out.
  `features_btd`: the target features a draft's catch-up call reads (None: own ones)."""

  def step(_, carry):
    cache, acc = carry
    if isinstance(model, ModelConfig):
      logits, _, new_cache = transformer.forward(params, model, tokens_bt, cache)
    else:
      logits, _, new_cache = model.forward(params, tokens_bt, cache, features_btd)
    return new_cache.with_lengths(cache.lengths_b), acc + jnp.max(logits)

  return jax.lax.fori_loop(0, num_steps, step, (cache, jnp.zeros((), jnp.float32)))


def _best_time(model, params, cache, tokens_bt, repeats: int, num_steps: int,
               features_btd=None) -> float:
  """Best-of-`repeats` seconds per step."""
  run = functools.partial(_run_steps, model=model, num_steps=num_steps)
  cache, acc = run(params, cache, tokens_bt, features_btd)  # compile (once) and warm up
  acc.block_until_ready()
  best = np.inf
  for _ in range(repeats):
    start = time.perf_counter()
    cache, acc = run(params, cache, tokens_bt, features_btd)
    acc.block_until_ready()
    best = min(best, (time.perf_counter() - start) / num_steps)
  return best


def measure(decoder, batch: int, num_draft: int, cache_len: int, repeats: int = 5,
            steps_per_call: int = 8) -> StepCosts:
  """Best-of-`repeats` seconds of a SpeculativeDecoder's four calls at `batch` rows, with
  caches of `cache_len` slots half full, each timed over `steps_per_call` steps in one
  compiled loop. Needs a decoder with a draft."""
  if decoder.draft is None:
    raise ValueError("step_costs.measure needs a decoder with a draft (draft=None)")
  target, draft = decoder.target, decoder.draft
  half = lambda cache: cache.with_lengths(jnp.full((batch,), cache_len // 2, jnp.int32))
  time_it = lambda model, params, cache, tokens, features=None: _best_time(
      model, params, half(cache), tokens, repeats, steps_per_call, features)
  one = jnp.ones((batch, 1), jnp.int32)
  many = jnp.ones((batch, num_draft + 1), jnp.int32)
  params = decoder.target_params()
  new_cache = lambda: transformer.init_cache(params, target.config, batch, cache_len)
  decode = time_it(target.config, params, new_cache(), one)
  verify = time_it(target.config, params, new_cache(), many)
  draft_params = decoder.draft_params
  new_draft_cache = lambda: draft.init_cache(draft_params, batch, cache_len)
  draft_s = time_it(draft, draft_params, new_draft_cache(), one)
  features = jnp.zeros((batch, 2, target.config.hidden_size), params["embed"].dtype)
  catchup = time_it(draft, draft_params, new_draft_cache(), jnp.ones((batch, 2), jnp.int32),
                    features)
  return StepCosts(decode, verify, draft_s, catchup)
