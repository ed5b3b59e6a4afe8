r"""A/B of the batch's tail: shrinking to the unfinished rows vs keeping all rows.

  python benchmarks/tail_speed.py [--batch_size=8] [--queue=48] [--methods=sd,static]

Q GSM8K-test prompts through B rows with continuous batching, greedy, on the embedded
target and its default draft: once the queue is empty, rows finish one by one at
different rounds. `SpeculativeDecoder(shrink_tail=True)` then continues with
the unfinished rows at B/2, B/4, ..., 1; `shrink_tail=False` runs all B rows to the end.
With the autoregressive baseline rows finish together (same length, no early EOS), so
its two figures bound the noise of the comparison.
Prints, per method, the best call time of each (interleaved repeats, compile excluded),
their ratio, that the tokens are identical, the compile times (all rows / shrink: one
more compiled round per width) and the rounds run at each width.
"""

from __future__ import annotations

import collections

import numpy as np
from absl import app, flags

from diversed_jax.speculative.types import VerifyParams

from bench_setup import gsm8k_test_prompts, load_decoder  # benchmarks/, beside this script

_TARGET = flags.DEFINE_string("target", "smollm2-135m-instruct", "Target model.")
_DRAFT = flags.DEFINE_string("draft", None, "Draft spec (default: the target's default).")
_BATCH = flags.DEFINE_integer("batch_size", 8, "Rows decoded at once (B).")
_QUEUE = flags.DEFINE_integer("queue", 48, "Prompts per call (Q > B).")
_NUM_DRAFT = flags.DEFINE_integer("num_draft", 4, "K.")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 64, "Tokens per prompt.")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Interleaved repeats (best kept).")
_METHODS = flags.DEFINE_list("methods", ["ar", "sd", "static"], "Methods.")


def main(argv):
  del argv
  _, tokenizer, decoder, info = load_decoder(_TARGET.value, _DRAFT.value)
  settings = {"all rows": False, "shrink": True}  # decoder.shrink_tail
  prompts = gsm8k_test_prompts(tokenizer, _QUEUE.value)
  print(f"target={info['target']} draft={info['draft']} K={_NUM_DRAFT.value} greedy, "
        f"{len(prompts)} prompts through {_BATCH.value} rows, max_new_tokens="
        f"{_MAX_NEW.value}, best of {_REPEATS.value} interleaved repeats")

  def run(method, name):
    # One decoder, one copy of the weights: its programs are cached per tail setting.
    decoder.shrink_tail = settings[name]
    return decoder.generate(
        prompts, VerifyParams(method=method, temperature=0.0),
        num_draft=0 if method == "ar" else _NUM_DRAFT.value,
        max_new_tokens=_MAX_NEW.value, batch_size=_BATCH.value,
        eos_token_ids=())  # no early EOS: autoregressive rows all end together

  calls = [(m, name) for m in _METHODS.value for name in settings]
  results = {call: run(*call) for call in calls}  # compiles every program
  best = collections.defaultdict(lambda: np.inf)
  order = np.random.default_rng(0)
  for rep in range(_REPEATS.value):
    for i in order.permutation(len(calls)):
      out = run(*calls[i])
      best[calls[i]] = min(best[calls[i]], out.seconds)
    print(f"  repeat {rep + 1}: " + ", ".join(f"{m}/{n} {best[(m, n)]:.1f} s"
                                              for m, n in calls), flush=True)
  print(f"\n{'method':8s} {'all rows s':>10s} {'shrink s':>9s} {'speed-up':>8s} "
        f"{'same tokens':>11s} {'compile s':>9s}  rounds per width (shrink)")
  for m in _METHODS.value:
    kept, shrunk = results[(m, "all rows")], results[(m, "shrink")]
    widths = collections.Counter(shrunk.stats.width_r.tolist())
    same = kept.token_ids == shrunk.token_ids
    print(f"{m:8s} {best[(m, 'all rows')]:10.1f} {best[(m, 'shrink')]:9.1f} "
          f"{best[(m, 'all rows')] / best[(m, 'shrink')]:8.3f} {str(same):>11s} "
          f"{kept.compile_seconds:4.0f}/{shrunk.compile_seconds:<4.0f}  "
          + ", ".join(f"{w}: {widths[w]}" for w in sorted(widths, reverse=True)))


if __name__ == "__main__":
  app.run(main)
