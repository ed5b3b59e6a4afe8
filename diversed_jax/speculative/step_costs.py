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

import contextlib
import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from diversed_jax.models import products, transformer
from diversed_jax.models.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class StepCosts:
  """Seconds of one call of each kind (`measure`: each call's median sample)."""
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
  def median(samples: list["StepCosts"]) -> "StepCosts":
    """Each call's median sample: the typical cost (only the ratios feed a prediction)."""
    return StepCosts(*np.median([dataclasses.astuple(s) for s in samples], axis=0).tolist())

  @staticmethod
  def best(samples: list["StepCosts"]) -> "StepCosts":
    """Each call's fastest sample (the host's speed drifts between samples)."""
    return StepCosts(*(min(getattr(s, f.name) for s in samples)
                       for f in dataclasses.fields(StepCosts)))


@functools.partial(jax.jit, static_argnames=("model", "num_steps", "greedy"),
                   donate_argnums=(1,))
def _run_steps(params, cache, tokens_bt, features_btd=None, *, model, num_steps: int,
               greedy: bool = False):
  """`num_steps` forwards of `model` (the target's ModelConfig or a draft object) in one
  `fori_loop`, the cache updated in place and rolled back after each step, as the
  speculative loop does. One call per measurement: a jitted call's own dispatch costs
  milliseconds with the unrolled layout's hundreds of arrays, which the loop never pays per
  step. Every step's logits are reduced (max) so no part of the forward is left out.
  `features_btd`: the target features a draft's catch-up call reads (None: own ones).
  `greedy`: traced in `products.row_independent()`, as the loop traces greedy calls (a
  static argument: a program traced outside keeps its products)."""

  def step(_, carry):
    cache, acc = carry
    if isinstance(model, ModelConfig):
      logits, _, new_cache = transformer.forward(params, model, tokens_bt, cache)
    else:
      # The catch-up call (with the target's features) wants only its last token's logits.
      logits, _, new_cache = model.forward(params, tokens_bt, cache, features_btd,
                                           last_only=features_btd is not None)
    return new_cache.with_lengths(cache.lengths_b), acc + jnp.max(logits)

  with products.row_independent() if greedy else contextlib.nullcontext():
    return jax.lax.fori_loop(0, num_steps, step, (cache, jnp.zeros((), jnp.float32)))


def sample_calls(decoder, batch: int, num_draft: int, cache_len: int, repeats: int = 7,
                 steps_per_call: int = 8, greedy: bool = False) -> np.ndarray:
  """Seconds per step of a SpeculativeDecoder's four calls (StepCosts' field order) at
  `batch` rows, caches of `cache_len` slots half full, each sample one compiled loop of
  `steps_per_call` steps; [repeats, 4]. The four calls take turns, one sample of each per
  repeat, so that all four are sampled in the same phases of the host (its speed drifts by
  10-20% over seconds). `greedy`: the products a greedy loop takes (row-independent past
  64 rows, `loop.decode`). Needs a decoder with a draft."""
  if decoder.draft is None:
    raise ValueError("step_costs needs a decoder with a draft (draft=None)")
  target, draft = decoder.target, decoder.draft
  params, draft_params = decoder.target_params(), decoder.draft_params
  half_full = lambda cache: cache.with_lengths(jnp.full((batch,), cache_len // 2, jnp.int32))
  target_cache = lambda: half_full(transformer.init_cache(params, target.config, batch,
                                                          cache_len))
  draft_cache = lambda: half_full(draft.init_cache(draft_params, batch, cache_len))
  tokens = lambda n: jnp.ones((batch, n), jnp.int32)
  features = jnp.zeros((batch, 2, target.config.hidden_size), params["embed"].dtype)
  # (model, params, cache, tokens, features) of each call, in StepCosts' field order.
  calls = [[target.config, params, target_cache(), tokens(1), None],
           [target.config, params, target_cache(), tokens(num_draft + 1), None],
           [draft, draft_params, draft_cache(), tokens(1), None],
           [draft, draft_params, draft_cache(), tokens(2), features]]

  def run(call):  # one timed call; its (donated) cache is replaced by the returned one
    model, call_params, cache, call_tokens, call_features = call
    start = time.perf_counter()
    cache, acc = _run_steps(call_params, cache, call_tokens, call_features, model=model,
                            num_steps=steps_per_call, greedy=greedy)
    acc.block_until_ready()
    call[2] = cache
    return (time.perf_counter() - start) / steps_per_call

  # The decoder's precision is part of the programs' cache key: traced as the loop is.
  with jax.default_matmul_precision(decoder.matmul_precision):
    for call in calls:  # compile (once) and warm up
      run(call)
    return np.array([[run(call) for call in calls] for _ in range(repeats)])


def measure(decoder, batch: int, num_draft: int, cache_len: int, repeats: int = 7,
            steps_per_call: int = 8, greedy: bool = False) -> StepCosts:
  """Each call's median over `sample_calls`' samples (at batch 8, quiet, one measurement's
  decoding samples spread over 58-76 ms, verification 142-181 ms).

  The median, not the fastest sample: a decoding run pays each call's typical cost, which
  is what `calls` in benchmarks/spec_speed.py compares its time with; the fastest of a few
  short samples is a lucky moment of the host. (The predicted speed-up reads only the
  ratios of the four, which are within noise either way.)
  """
  samples = sample_calls(decoder, batch, num_draft, cache_len, repeats, steps_per_call, greedy)
  return StepCosts(*np.median(samples, axis=0).tolist())
