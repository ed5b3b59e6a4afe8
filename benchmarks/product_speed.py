"""The few-row products of `diversed_jax.models.products`: kernel vs fused form vs dot.

  python benchmarks/product_speed.py [--cases=1x1,1x2,1x3,1x4,1x5,4x1,8x1,8x3] [--repeats=8]

Times the embedded target's forward (the decoder's unrolled [out, in] layout, KV cache of
512 slots half full, 8 steps per call in one compiled loop, caches updated in place: what
`speculative.step_costs` measures) over BATCHxTOKENS new tokens, compiled once per form
(`products.forced_form`: every product in that form where it applies, else a dot): the
hand-written FFI kernel, the fused multiply-and-sum and the plain dot. The programs run
interleaved, each keeping its best repeat; ratios are to the dot and, per form, to that
form's own 1x1 forward when 1x1 is among the cases (what verifying a draft of TOKENS - 1
tokens costs in decoding steps).
"""

from __future__ import annotations

import os
import sys
import time

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_TARGET = flags.DEFINE_string("target", "smollm2-135m-instruct", "target model")
_CASES = flags.DEFINE_list("cases", ["1x1", "1x2", "1x3", "1x4", "1x5", "4x1", "8x1", "8x3"],
                           "BATCHxTOKENS forwards to time")
_REPEATS = flags.DEFINE_integer("repeats", 8, "interleaved repeats (best kept)")
_STEPS = flags.DEFINE_integer("steps", 8, "forwards per timed call")
_CACHE = flags.DEFINE_integer("cache_len", 512, "KV cache slots (half full)")
_FORMS = flags.DEFINE_list("forms", ["kernel", "fused", "dot"], "products.FORMS to time")


def main(_):
  import jax
  import jax.numpy as jnp

  from diversed_jax.models import cpu_kernels, loading, products, transformer
  from diversed_jax.speculative import step_costs

  target = loading.load_model(_TARGET.value)
  params = transformer.unstack_layers(target.params)
  config = target.config
  forms = [form for form in _FORMS.value if form != "kernel" or cpu_kernels.available()]
  if forms != _FORMS.value:
    print("the kernel is unavailable here (cpu_kernels.available() is False): skipped")

  def compiled(batch: int, tokens: int, form: str):
    jax.clear_caches()  # the form is not part of jit's cache key
    with products.forced_form(form):  # read while tracing
      cache = transformer.init_cache(params, config, batch, _CACHE.value).with_lengths(
          jnp.full((batch,), _CACHE.value // 2, jnp.int32))
      tokens_bt = jnp.ones((batch, tokens), jnp.int32)
      run = step_costs._run_steps.lower(params, cache, tokens_bt, model=config,
                                        num_steps=_STEPS.value).compile()
    return run, cache, tokens_bt

  print(" ".join([f"{'batch x tokens':>15} {'rows':>5}"]
                 + [f"{form + ' ms':>10}" for form in forms]
                 + [f"{form + '/dot':>10}" for form in forms
                    if form != "dot" and "dot" in forms]
                 + [f"{form + ' r':>9}" for form in forms]))
  one_token = {}
  for case in sorted(_CASES.value, key=lambda c: c != "1x1"):  # 1x1 first: r divides by it
    batch, tokens = (int(n) for n in case.split("x"))
    variants = {form: compiled(batch, tokens, form) for form in forms}
    best = {form: float("inf") for form in variants}
    state = {form: cache for form, (_, cache, _) in variants.items()}
    for repeat in range(_REPEATS.value + 1):
      for form, (run, _, tokens_bt) in variants.items():
        start = time.perf_counter()
        state[form], acc = run(params, state[form], tokens_bt)
        acc.block_until_ready()
        if repeat:  # the first round warms up
          best[form] = min(best[form], (time.perf_counter() - start) / _STEPS.value)
    if case == "1x1":
      one_token = dict(best)
    ratios = [f"{best[form] / best['dot']:>10.2f}" for form in forms
              if form != "dot" and "dot" in best]
    steps = [f"{best[form] / one_token[form]:>9.2f}" if form in one_token else f"{'':>9}"
             for form in forms]
    print(" ".join([f"{case:>15} {batch * tokens:>5}"]
                   + [f"{1e3 * best[form]:>10.1f}" for form in forms] + ratios + steps),
          flush=True)


if __name__ == "__main__":
  app.run(main)
