"""One round of drafting (`speculative.loop.draft_round`) alone, as the loop runs it.

  python benchmarks/draft_round_speed.py [--cases=1x1,1x2,8x1,8x2] [--repeats=9]

For BATCHxK, times the default draft's round: its first call on the two pending tokens
with their target features, K - 1 more steps on its own proposals, a greedy proposal
from each law (the shipped draft: the copy blend too). Each call runs 20 rounds in one
compiled loop (cache 512 slots, 200 filled). `last` is the loop's call, which runs the
head and the blend on the first call's last token alone (`last_only`, session 39); `all`
runs them on both tokens and keeps the last law, as the loop did before. The two programs
run interleaved, each keeping its best repeat, and must give the same proposals and laws.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_TARGET = flags.DEFINE_string("target", "smollm2-135m-instruct", "target model")
_CASES = flags.DEFINE_list("cases", ["1x1", "1x2", "8x1", "8x2"], "BATCHxK rounds to time")
_REPEATS = flags.DEFINE_integer("repeats", 9, "interleaved repeats (best kept)")
_ROUNDS = flags.DEFINE_integer("rounds", 20, "rounds per timed call")


@dataclasses.dataclass(frozen=True)
class AllTokensLaws:
  """`inner` with every fed token's law computed (what `last_only` skips)."""
  inner: object

  def init_cache(self, params, batch: int, max_len: int):
    return self.inner.init_cache(params, batch, max_len)

  def forward(self, params, tokens_bt, cache, target_hidden_btd=None, last_only=False):
    logits, hidden, cache = self.inner.forward(params, tokens_bt, cache, target_hidden_btd)
    return (logits[:, -1:] if last_only else logits), hidden, cache


def main(_):
  import jax
  import jax.numpy as jnp
  import numpy as np

  from diversed_jax.models import loading
  from diversed_jax.speculative import build, loop
  from diversed_jax.speculative.types import VerifyParams

  target = loading.load_model(_TARGET.value)
  decoder, _ = build.build_decoder(target, None)
  params, width = decoder.draft_params, target.config.hidden_size
  drafts = {"last": decoder.draft, "all": AllTokensLaws(decoder.draft)}

  def compiled(draft, batch: int, k: int):
    spec = loop.LoopSpec(verify=VerifyParams(method="sd", temperature=0.0), num_draft=k)
    cache = draft.init_cache(params, batch, 512)

    def rounds(params, cache, key):
      def one(i, outputs):
        # Pending tokens, lengths and features vary by round, as the loop's do.
        drafts_bk, logits_bsv, _, _ = loop.draft_round(
            spec, draft, params, cache, jnp.full((batch,), 200 + i % 2),
            100 + i % 3 + jnp.arange(2 * batch).reshape(batch, 2),
            jnp.full((batch, 2, width), 0.1 * (1 + i % 5)), jax.random.fold_in(key, i))
        tokens, laws = outputs
        return tokens.at[i].set(drafts_bk), laws.at[i].set(logits_bsv.max(-1))

      outputs = (jnp.zeros((_ROUNDS.value, batch, k), jnp.int32),
                 jnp.zeros((_ROUNDS.value, batch, spec.num_draft_steps), jnp.float32))
      return jax.lax.fori_loop(0, _ROUNDS.value, one, outputs)

    key = jax.random.PRNGKey(0)
    run = jax.jit(rounds).lower(params, cache, key).compile()
    return lambda: jax.block_until_ready(run(params, cache, key))

  print(f"draft round, ms ({_ROUNDS.value} rounds a call, best of {_REPEATS.value}):")
  for case in _CASES.value:
    batch, k = (int(x) for x in case.split("x"))
    runs = {name: compiled(draft, batch, k) for name, draft in drafts.items()}
    outputs = {name: run() for name, run in runs.items()}
    same = all(np.array_equal(a, b) for a, b in zip(outputs["last"], outputs["all"]))
    best = dict.fromkeys(runs, np.inf)
    for _ in range(_REPEATS.value):
      for name, run in runs.items():
        start = time.perf_counter()
        run()
        best[name] = min(best[name], (time.perf_counter() - start) / _ROUNDS.value)
    print(f"  {case:>5}: last {best['last'] * 1e3:6.3f}  all {best['all'] * 1e3:6.3f}  "
          f"ratio {best['all'] / best['last']:.2f}  same outputs {same}")


if __name__ == "__main__":
  app.run(main)
