"""The few-row products of `diversed_jax.models.products`: fused form vs plain dot.

  python benchmarks/product_speed.py [--cases=1x1,1x3,1x4,1x5,4x1,8x1,8x5] [--repeats=8]

Times the embedded target's forward (the decoder's unrolled [out, in] layout, KV cache of
512 slots half full, 8 steps per call in one compiled loop, caches updated in place: what
`speculative.step_costs` measures) over BATCHxTOKENS new tokens, compiled twice: with the
fused few-row products (the default on CPU) and with every product a plain dot
(`products.MAX_FUSED_ROWS = 0`). The two programs run interleaved, each keeping its best
repeat, and the ratio fused / dot is printed per case.
"""

from __future__ import annotations

import os
import sys
import time

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_TARGET = flags.DEFINE_string("target", "smollm2-135m-instruct", "target model")
_CASES = flags.DEFINE_list("cases", ["1x1", "1x3", "1x4", "1x5", "4x1", "8x1", "8x3", "8x5"],
                           "BATCHxTOKENS forwards to time")
_REPEATS = flags.DEFINE_integer("repeats", 8, "interleaved repeats (best kept)")
_STEPS = flags.DEFINE_integer("steps", 8, "forwards per timed call")
_CACHE = flags.DEFINE_integer("cache_len", 512, "KV cache slots (half full)")
_MAX_FUSED = flags.DEFINE_integer("max_fused_rows", None,
                                  "products.MAX_FUSED_ROWS of the fused variant (default: "
                                  "the library's) to try other thresholds")


def main(_):
  import jax
  import jax.numpy as jnp

  from diversed_jax.models import loading, products, transformer
  from diversed_jax.speculative import step_costs

  target = loading.load_model(_TARGET.value)
  params = transformer.unstack_layers(target.params)
  config = target.config
  default_max = products.MAX_FUSED_ROWS
  fused_max = default_max if _MAX_FUSED.value is None else _MAX_FUSED.value

  def compiled(batch: int, tokens: int, max_fused_rows: int):
    products.MAX_FUSED_ROWS = max_fused_rows  # read while tracing
    jax.clear_caches()  # the setting is not part of jit's cache key
    try:
      cache = transformer.init_cache(params, config, batch, _CACHE.value).with_lengths(
          jnp.full((batch,), _CACHE.value // 2, jnp.int32))
      tokens_bt = jnp.ones((batch, tokens), jnp.int32)
      run = step_costs._run_steps.lower(params, cache, tokens_bt, model=config,
                                        num_steps=_STEPS.value).compile()
    finally:
      products.MAX_FUSED_ROWS = default_max
    return run, cache, tokens_bt

  print(f"fused form up to {fused_max} rows")
  print(f"{'batch x tokens':>15} {'rows':>5} {'fused ms':>9} {'dot ms':>9} {'fused/dot':>9}")
  for case in _CASES.value:
    batch, tokens = (int(n) for n in case.split("x"))
    variants = {"fused": compiled(batch, tokens, fused_max), "dot": compiled(batch, tokens, 0)}
    best = {name: float("inf") for name in variants}
    state = {name: cache for name, (_, cache, _) in variants.items()}
    for repeat in range(_REPEATS.value + 1):
      for name, (run, _, tokens_bt) in variants.items():
        start = time.perf_counter()
        state[name], acc = run(params, state[name], tokens_bt)
        acc.block_until_ready()
        if repeat:  # the first round warms up
          best[name] = min(best[name], (time.perf_counter() - start) / _STEPS.value)
    print(f"{case:>15} {batch * tokens:>5} {1e3 * best['fused']:>9.1f} "
          f"{1e3 * best['dot']:>9.1f} {best['fused'] / best['dot']:>9.2f}", flush=True)


if __name__ == "__main__":
  app.run(main)
