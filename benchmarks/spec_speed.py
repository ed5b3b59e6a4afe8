r"""Speculative loop benchmark: measured vs predicted speed-up of every method.

  python benchmarks/spec_speed.py [--target=smollm2-135m-instruct] [--draft=...]
      [--batch_sizes=1,8] [--num_draft=4] [--max_new_tokens=64] [--num_prompts=8]

For the target and a draft on GSM8K-test prompts (the shipped sample) it prints, per batch
size and method: tokens/s, the measured speed-up over autoregressive decoding, and the
speed-up predicted from three measured quantities,

  predicted = tokens_per_round / (draft_steps * c + r)

with tokens_per_round the mean committed tokens per round (acceptance), c the draft/target
cost ratio of one decoding step, r the verify/decode cost ratio (a target forward over K+1
tokens vs over 1 token) and draft_steps = K (K+1 for rules whose bonus needs q_{K+1}).
Loop efficiency = measured / predicted says how much the loop itself (sampling,
verification, bookkeeping) costs beyond the model calls; the goal is >= 0.9.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from diversed_jax import tokenizer as tokenizer_lib
from diversed_jax.models import KVCache, loading, transformer
from diversed_jax.speculative import build, loop, metrics
from diversed_jax.speculative.types import VerifyParams
from diversed_jax.tasks.registry import get_task

_TARGET = flags.DEFINE_string("target", "smollm2-135m-instruct", "Target model.")
_DRAFT = flags.DEFINE_string("draft", None, "Draft spec (default: the target's default).")
_BATCH_SIZES = flags.DEFINE_list("batch_sizes", ["1", "8"], "Batch sizes.")
_NUM_DRAFT = flags.DEFINE_integer("num_draft", 4, "K.")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 64, "Tokens per row.")
_NUM_PROMPTS = flags.DEFINE_integer("num_prompts", 8, "GSM8K-test prompts per batch size.")
_TEMPERATURE = flags.DEFINE_float("temperature", 0.0, "Sampling temperature.")
_METHODS = flags.DEFINE_list("methods", ["sd", "lossy", "static", "diversed", "cascade",
                                         "mentored", "typical"], "Methods besides ar.")


def _time(fn, repeats=5):
  jax.block_until_ready(fn())  # compile and warm up
  start = time.perf_counter()
  for _ in range(repeats):
    jax.block_until_ready(fn())
  return (time.perf_counter() - start) / repeats


def step_costs(target, draft, draft_params, batch, k, cache_len):
  """Seconds of: a target decode step, a target verify step over K+1 tokens, a draft step."""
  dtype = target.params["embed"].dtype
  t_cache = KVCache.create(target.config, batch, cache_len, dtype).with_lengths(
      jnp.full((batch,), cache_len // 2, jnp.int32))
  d_cache = draft.init_cache(batch, cache_len, dtype).with_lengths(
      jnp.full((batch,), cache_len // 2, jnp.int32))
  fwd = jax.jit(transformer.forward, static_argnames="config")
  draft_fwd = jax.jit(draft.forward)
  one = jnp.ones((batch, 1), jnp.int32)
  many = jnp.ones((batch, k + 1), jnp.int32)
  decode = _time(lambda: fwd(target.params, target.config, one, t_cache)[0])
  verify = _time(lambda: fwd(target.params, target.config, many, t_cache)[0])
  draft_step = _time(lambda: draft_fwd(draft_params, one, d_cache, None)[0])
  return decode, verify, draft_step


def main(argv):
  del argv
  target = loading.load_model(_TARGET.value)
  tokenizer = tokenizer_lib.load_tokenizer(_TARGET.value)
  decoder, info = build.build_decoder(target, _DRAFT.value)
  task = get_task("gsm8k")
  examples = task.load(split="test", limit=max(int(b) for b in _BATCH_SIZES.value) *
                       max(1, _NUM_PROMPTS.value // min(int(b) for b in _BATCH_SIZES.value)))
  prompts = [tokenizer_lib.encode_prompt(tokenizer, task.prompt(e), chat=True) for e in examples]
  k = _NUM_DRAFT.value
  print(f"target={info['target']} draft={info['draft']} K={k} T={_TEMPERATURE.value} "
        f"max_new_tokens={_MAX_NEW.value}")
  for batch in (int(b) for b in _BATCH_SIZES.value):
    batches = [prompts[i:i + batch] for i in range(0, max(_NUM_PROMPTS.value, batch), batch)]
    batches = [b for b in batches if len(b) == batch]
    cache_len = 512
    decode_s, verify_s, draft_s = step_costs(target, decoder.draft, decoder.draft_params,
                                             batch, k, cache_len)
    c, r = draft_s / decode_s, verify_s / decode_s
    print(f"\nbatch {batch}: target step {decode_s * 1e3:.1f} ms, verify/decode r={r:.2f}, "
          f"draft/target c={c:.3f}")
    print(f"{'method':10s} {'tok/s':>8s} {'speedup':>8s} {'predicted':>9s} {'efficiency':>10s} "
          f"{'accept':>7s} {'tok/round':>9s}")
    ar_rate = None
    for method in ["ar"] + list(_METHODS.value):
      verify = VerifyParams(method=method, temperature=_TEMPERATURE.value)
      tokens = seconds = 0
      summaries = []
      for chunk in batches:  # compile time is excluded from out.seconds
        out = decoder.generate(chunk, verify, num_draft=k, max_new_tokens=_MAX_NEW.value)
        tokens += out.num_tokens
        seconds += out.seconds
        summaries.append(metrics.summarize(out.stats, out.num_tokens, method != "ar"))
      rate = tokens / seconds
      tpr = tokens / sum(s["rounds"] for s in summaries)  # per row and round
      if method == "ar":
        ar_rate = rate
        print(f"{method:10s} {rate:8.1f} {1.0:8.2f}")
        continue
      steps = loop.LoopSpec(verify, k).num_draft_steps
      predicted = tpr / (steps * c + r)
      accept = np.mean([s["acceptance_rate"] for s in summaries])
      print(f"{method:10s} {rate:8.1f} {rate / ar_rate:8.2f} {predicted:9.2f} "
            f"{rate / ar_rate / predicted:10.2f} {accept:7.3f} {tpr:9.2f}")


if __name__ == "__main__":
  app.run(main)
