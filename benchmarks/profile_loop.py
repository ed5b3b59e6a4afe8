"""Where a decoding call's time goes: per-op times of the compiled loop, grouped per round.

  python benchmarks/profile_loop.py --method=sd --batch_size=8

Runs one decoding call under `jax.profiler` (after a warm-up call), sums the XLA ops' own
times from the trace and groups every op by how often it ran per round of the loop: an op
of the verification's scanned layers runs L times a round, one of the draft's scan K - 1
(or K) times, the rule, sampling and commit once (a branch taken in some rounds only, a
fraction). Per-round runs are counted beyond a profiled one-token call of the same
prompts, which runs the prefills (`loop.PREFILL_CHUNK` tokens a pass) and set-up alike.
Times are op times with the profiler on (inflated, and summed over the host's threads), so
read them as shares, not as wall-clock.
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import tempfile

from absl import app, flags
import jax

from diversed_jax.speculative.types import VerifyParams

from bench_setup import gsm8k_test_prompts, load_decoder  # benchmarks/, beside this script

_TARGET = flags.DEFINE_string("target", "smollm2-135m-instruct", "Target model.")
_DRAFT = flags.DEFINE_string("draft", None, "Draft spec (default: the target's default).")
_METHOD = flags.DEFINE_string("method", "sd", "Verification method (ar, sd, ...).")
_BATCH = flags.DEFINE_integer("batch_size", 8, "Rows decoded at once (= prompts).")
_NUM_DRAFT = flags.DEFINE_integer("num_draft", 4, "K.")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 64, "Tokens per row (EOS ignored).")
_TEMPERATURE = flags.DEFINE_float("temperature", 0.0, "Sampling temperature.")
_TOP = flags.DEFINE_integer("top", 8, "Ops listed per group.")


def op_times(trace_dir: str) -> tuple[collections.Counter, collections.Counter]:
  """(microseconds, calls) per XLA op name in the trace written under `trace_dir`."""
  files = glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True)
  if not files:
    raise FileNotFoundError(f"no *.trace.json.gz under {trace_dir}")
  with gzip.open(files[0]) as f:
    events = json.load(f)["traceEvents"]
  micros, calls = collections.Counter(), collections.Counter()
  for event in events:
    if event.get("ph") == "X" and "dur" in event and event.get("args", {}).get("hlo_op"):
      micros[event["name"]] += event["dur"]
      calls[event["name"]] += 1
  return micros, calls


def main(argv):
  del argv
  target, tokenizer, decoder, info = load_decoder(_TARGET.value, _DRAFT.value)
  prompts = gsm8k_test_prompts(tokenizer, _BATCH.value)
  verify = VerifyParams(method=_METHOD.value, temperature=_TEMPERATURE.value)
  k = 0 if _METHOD.value == "ar" else _NUM_DRAFT.value
  run = lambda n: decoder.generate(prompts, verify, num_draft=k, max_new_tokens=n,
                                  eos_token_ids=())

  def profiled(n: int):
    with tempfile.TemporaryDirectory() as trace_dir:
      with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
        out = run(n)
      return (out, *op_times(trace_dir))

  run(_MAX_NEW.value), run(1)  # compile
  warm = run(_MAX_NEW.value)
  out, micros, calls = profiled(_MAX_NEW.value)
  # A one-token call runs the same prefills and set-up and (almost) no rounds: an op's
  # runs beyond that call's are its per-round runs.
  short, _, short_calls = profiled(1)
  rounds, extra_rounds = out.rounds, out.rounds - short.rounds
  layers = target.config.num_layers
  print(f"target={info['target']} draft={info['draft']} method={_METHOD.value} "
        f"batch={_BATCH.value} K={k}: {rounds} rounds, {out.num_tokens} tokens, "
        f"{warm.seconds:.2f} s unprofiled, {out.seconds:.2f} s profiled")

  def group(name: str) -> str:
    per_round = (calls[name] - short_calls[name]) / extra_rounds
    if per_round <= 0:
      return "per call, not per round (the prefill's passes, set-up)"
    if per_round == layers:
      return f"{layers} per round (the verification's layers, or AR's)"
    return f"{per_round:.3g} per round"

  totals, members = collections.Counter(), collections.defaultdict(list)
  for name, us in micros.items():
    totals[group(name)] += us
    members[group(name)].append((us, name))
  print(f"op time per round (ms, profiled): {sum(micros.values()) / rounds / 1e3:.1f}")
  for label, us in totals.most_common():
    print(f"{us / rounds / 1e3:9.2f}  {label}")
    for op_us, name in sorted(members[label], reverse=True)[:_TOP.value]:
      print(f"           {op_us / rounds / 1e3:7.2f}  {name}")


if __name__ == "__main__":
  app.run(main)
