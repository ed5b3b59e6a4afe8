"""Measured per-step costs of a decoder's model calls: what speed-up predictions use.

The speed-up of speculative decoding over autoregressive decoding is predicted from the
mean committed tokens per round and two cost ratios (methods.md):

  predicted = tokens_per_round / (draft_steps * c + r),

c = draft step / target decoding step, r = target verification over K+1 tokens / target
decoding step. `measure` times the three calls as the loop makes them: in the parameter
layouts the decoder uses for each, with the caches donated (updated in place; undonated,
XLA copies the whole cache every call and a step looks up to 2x slower at batch 8).
"""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from diversed_jax.models import transformer


@dataclasses.dataclass(frozen=True)
class StepCosts:
  """Seconds of one call of each kind (best of the repeats)."""
  decode_s: float  # target, one token per row
  verify_s: float  # target, K+1 tokens per row
  draft_s: float  # draft, one token per row

  @property
  def c(self) -> float:
    return self.draft_s / self.decode_s

  @property
  def r(self) -> float:
    return self.verify_s / self.decode_s

  def predicted_speedup(self, tokens_per_round: float, draft_steps: int) -> float:
    return tokens_per_round / (draft_steps * self.c + self.r)

  @staticmethod
  def best(samples: list["StepCosts"]) -> "StepCosts":
    """Each call's fastest sample (the host's speed drifts between samples)."""
    return StepCosts(*(min(getattr(s, f.name) for s in samples)
                       for f in dataclasses.fields(StepCosts)))


@functools.partial(jax.jit, static_argnames="config", donate_argnums=(1,))
def _target_step(params, cache, tokens_bt, *, config):
  """One target forward; the cache is written in place and rolled back, as in the loop."""
  logits, _, new_cache = transformer.forward(params, config, tokens_bt, cache)
  return logits, new_cache.with_lengths(cache.lengths_b)


@functools.partial(jax.jit, static_argnames="draft", donate_argnums=(1,))
def _draft_step(params, cache, tokens_bt, *, draft):
  logits, _, new_cache = draft.forward(params, tokens_bt, cache, None)
  return logits, new_cache.with_lengths(cache.lengths_b)


def _best_time(step, params, cache, tokens_bt, repeats: int) -> float:
  logits, cache = step(params, cache, tokens_bt)  # compile (first call only) and warm up
  logits.block_until_ready()
  best = np.inf
  for _ in range(repeats):
    start = time.perf_counter()
    logits, cache = step(params, cache, tokens_bt)
    logits.block_until_ready()
    best = min(best, time.perf_counter() - start)
  return best


def measure(decoder, batch: int, num_draft: int, cache_len: int,
            repeats: int = 5) -> StepCosts:
  """Best-of-`repeats` seconds of a SpeculativeDecoder's three calls at `batch` rows, with
  caches of `cache_len` slots half full. Needs a decoder with a draft."""
  if decoder.draft is None:
    raise ValueError("step_costs.measure needs a decoder with a draft (draft=None)")
  target, draft = decoder.target, decoder.draft
  half = lambda: jnp.full((batch,), cache_len // 2, jnp.int32)
  new_cache = lambda params: transformer.init_cache(
      params, target.config, batch, cache_len).with_lengths(half())
  target_step = functools.partial(_target_step, config=target.config)
  one = jnp.ones((batch, 1), jnp.int32)
  many = jnp.ones((batch, num_draft + 1), jnp.int32)
  decode_params, verify_params = decoder.target_params(0), decoder.target_params(num_draft)
  decode = _best_time(target_step, decode_params, new_cache(decode_params), one, repeats)
  verify = _best_time(target_step, verify_params, new_cache(verify_params), many, repeats)
  draft_cache = draft.init_cache(decoder.draft_params, batch, cache_len).with_lengths(half())
  draft_s = _best_time(functools.partial(_draft_step, draft=draft), decoder.draft_params,
                       draft_cache, one, repeats)
  return StepCosts(decode, verify, draft_s)
