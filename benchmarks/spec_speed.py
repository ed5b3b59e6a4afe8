r"""Speculative loop benchmark: measured vs predicted speed-up of every method.

  python benchmarks/spec_speed.py [--target=smollm2-135m-instruct] [--draft=...]
      [--batch_sizes=1,8] [--num_draft=4] [--max_new_tokens=64] [--num_prompts=8]

For the target and a draft on GSM8K-test prompts (the shipped sample) it prints, per batch
size and method: tokens/s, the measured speed-up over autoregressive decoding, and the
speed-up predicted from three measured quantities,

  predicted = tokens_per_round / (c2 + (draft_steps - 1) * c + r)

with tokens_per_round the mean committed tokens per round (acceptance), c the draft/target
cost ratio of one decoding step, c2 that of the round's first draft call (a two-token
catch-up on the last committed tokens), r the verify/decode cost ratio (a target forward
over K+1 tokens vs over 1 token) and draft_steps = K (K+1 for rules whose bonus needs
q_{K+1}); `speculative.step_costs` times the four calls. (Before session 18 the prediction
took the catch-up call as a one-token step, draft_steps * c + r: 1-2% more optimistic.)
Loop efficiency = measured / predicted says how much the loop itself (sampling,
verification, bookkeeping) costs beyond the model calls; the goal is >= 0.9.

Timing protocol (session 20; `speculative.paired_timing`): this host's speed drifts by
10-25% over minutes, more than the loop's own cost, so every method call is timed between
two autoregressive calls (AR, m1, AR, m2, ..., AR; the methods in a new random order
every repeat) and compared with the mean of the two; the step costs are sampled and a
one-token call is made just before each call. The prediction takes the median of all the
step-cost samples of a batch size (only their ratios matter, and one short sample's are
noisy); `calls` takes the sample beside the call. Every figure printed is the median over a
method's `--repeats` pairs, and `(range)` spans its efficiencies; a last line pools every
method's pairs (the loop is shared: its efficiency with the most samples). (Until session
19 each method kept its fastest repeat and the step costs their fastest sample, so a
method's and AR's best times could come from different phases of the host.)

The prediction models the rounds only, so the speed-ups it is compared with are those of
the decoding phase: each call's time minus its prompt prefills, measured by one-token calls
(max_new_tokens=1) minus their rounds' step costs: an autoregressive one for the target's
prefills, an `sd` one for both models' (every draft method prefills the same way). The
draft's prefill is measured, not taken as c times the target's: a prefill is a many-token
forward, whose draft/target cost ratio is not the one-token c (0.08-0.19 in direct timings
of the shipped draft's, c ~ 0.08), and with a queue the prefills are up to half a call.
The end-to-end tokens/s and speed-up (prefill included) are printed too.

In a batch, rows commit different numbers of tokens per round and a static batch runs
until its slowest row is done, so from batch 2 on the per-row tokens_per_round overstates
what a batch round yields. `pred/batch` and `eff/batch` use instead the per-row tokens per
BATCH round (tokens / the rows the rounds ran), relative to the same figure of
autoregressive decoding (below 1 when rows stop early on EOS): the loop's own overhead
without the raggedness of the batch. `--queue=Q` (Q > B) decodes Q prompts per call with B rows and
continuous batching instead (a finished row takes the next prompt), which removes most of
that raggedness: only the last prompts' tail is ragged. `busy` = the rows' occupancy, active
row-rounds / the rows the rounds ran (batch rounds x B without `--shrink_tail`), so
pred/batch = predicted x busy(method) / busy(ar): a per-row efficiency below eff/batch is a
method's rows idling more than AR's (a lossy rule changes the text, hence every prompt's
length and when the tail runs out), not loop cost.

`calls` = the model calls' share of the decoding phase: loop iterations x (catch-up call +
(draft_steps - 1) x draft step + verification) / measured seconds (for ar: iterations x
decoding step; a shrunk tail's rounds are counted at the whole batch's cost, so with
`--shrink_tail` it reads a few per cent high for every method, ar included). It
splits the efficiency into two factors, efficiency ~= calls(method) / calls(ar): a `calls`
above 1 means the step costs were sampled in a slower phase of the host than the decoding,
so read the pair, not one figure.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
from absl import app, flags

from diversed_jax.models.kv_cache import bucket_length
from diversed_jax.speculative import build, loop, metrics, paired_timing, step_costs
from diversed_jax.speculative.decoder import PROMPT_BUCKETS
from diversed_jax.speculative.types import METHODS, VerifyParams

from bench_setup import gsm8k_test_prompts, host_info, load_decoder  # benchmarks/, beside it

_TARGET = flags.DEFINE_string("target", "smollm2-135m-instruct", "Target model.")
_DRAFT = flags.DEFINE_string("draft", None, "Draft spec (default: the target's default).")
_BATCH_SIZES = flags.DEFINE_list("batch_sizes", ["1", "8"], "Batch sizes.")
_NUM_DRAFT = flags.DEFINE_integer("num_draft", 4, "K.")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 64, "Tokens per row.")
_NUM_PROMPTS = flags.DEFINE_integer("num_prompts", 8, "GSM8K-test prompts per batch size.")
_QUEUE = flags.DEFINE_integer(
    "queue", 0, "At batch sizes B > 1: prompts per call, decoded by B rows with continuous "
    "batching (0: static batches of B prompts).")
_TEMPERATURE = flags.DEFINE_float("temperature", 0.0, "Sampling temperature.")
_REPEATS = flags.DEFINE_integer(
    "repeats", 3, "Timed calls of each method, each between two autoregressive calls.")
_OUT = flags.DEFINE_string(
    "out", None, "JSON file for every pair's raw timings and step costs (re-analysis).")
_SHRINK_TAIL = flags.DEFINE_bool(
    "shrink_tail", True, "Batch sizes > 1: once no prompt is queued, continue with the "
    "unfinished rows only (SpeculativeDecoder's shrink_tail; more compile time, which is "
    "not timed).")
_METHODS = flags.DEFINE_list("methods", ["sd", "lossy", "static", "diversed", "cascade",
                                         "mentored", "typical"], "Methods besides ar.")


def run_method(decoder, batches, verify, k, batch_size=None, max_new_tokens=None):
  """(tokens, seconds, batch rounds, row rounds, row slots, summaries) of one pass over
  all batches of prompts; compile time excluded. Row slots = the rows the rounds ran,
  summed (a shrunk tail's rounds run fewer than the batch's)."""
  tokens = seconds = batch_rounds = row_slots = 0
  summaries = []
  for chunk in batches:
    out = decoder.generate(chunk, verify, num_draft=k, batch_size=batch_size,
                           max_new_tokens=max_new_tokens or _MAX_NEW.value)
    tokens += out.num_tokens
    seconds += out.seconds
    batch_rounds += out.rounds
    row_slots += int(np.sum(out.stats.width_r))
    summaries.append(metrics.summarize(out.stats, out.num_tokens, verify.method != "ar"))
  row_rounds = sum(s["rounds"] for s in summaries)  # rounds in which a row was active
  return tokens, seconds, batch_rounds, row_rounds, row_slots, summaries


def _median(values) -> float:
  return float(np.median(list(values)))


# The methods whose rounds the prediction models (smc weighs particles, ssd pre-drafts on a
# second device: benchmarks/ssd_speed.py times it).
TIMED_METHODS = tuple(m for m in METHODS if m not in ("ar", "smc", "ssd"))


def check_flags() -> list[int]:
  """The batch sizes, after usage errors for values that would fail, or silently change the
  prompts a batch size decodes, only after the models load."""
  try:
    sizes = [int(b) for b in _BATCH_SIZES.value]
  except ValueError:
    raise app.UsageError(f"--batch_sizes must be integers, got {_BATCH_SIZES.value}") from None
  for flag, value in (("batch_sizes", min(sizes, default=0)), ("repeats", _REPEATS.value),
                      ("num_draft", _NUM_DRAFT.value), ("max_new_tokens", _MAX_NEW.value),
                      ("num_prompts", _NUM_PROMPTS.value)):
    if value < 1:
      raise app.UsageError(f"--{flag} must be >= 1, got {value}")
  unknown = [m for m in _METHODS.value if m not in TIMED_METHODS]
  if unknown or not _METHODS.value:
    raise app.UsageError(f"--methods must be one or more of {TIMED_METHODS} (ar is every "
                         f"method's baseline), got {','.join(_METHODS.value)}")
  for b in sizes:
    if b > 1 and 0 < _QUEUE.value <= b:
      raise app.UsageError(f"--queue must exceed every batch size above 1 (or be 0), got "
                           f"{_QUEUE.value} with batch size {b}")
    if not (b > 1 and _QUEUE.value) and _NUM_PROMPTS.value % b:
      raise app.UsageError(f"--num_prompts must be a multiple of each batch size without "
                           f"a queue, got {_NUM_PROMPTS.value} with batch size {b}")
  return sizes


def main(argv):
  del argv
  sizes = check_flags()
  target, tokenizer, decoder, info = load_decoder(_TARGET.value, _DRAFT.value)
  if "diversed" in _METHODS.value and info["head"] == build.FIXED_HEAD:  # a static ensemble
    print(f"warning: {build.fixed_weight_warning(target.name, info['draft'], None)}",
          flush=True)
  decoder.shrink_tail = _SHRINK_TAIL.value
  prompts = gsm8k_test_prompts(tokenizer, max(_QUEUE.value, _NUM_PROMPTS.value))
  k = _NUM_DRAFT.value
  methods = list(_METHODS.value)
  print(f"target={info['target']} draft={info['draft']} K={k} T={_TEMPERATURE.value} "
        f"max_new_tokens={_MAX_NEW.value}, shrink_tail={_SHRINK_TAIL.value}, "
        f"{_REPEATS.value} pairs per method")
  results = {"host": host_info()}  # written to --out after each batch size
  for batch in sizes:
    queued = batch > 1 and _QUEUE.value > batch
    if queued:  # one call: Q prompts through B rows
      batches, rows = [prompts[:_QUEUE.value]], batch
    else:
      batches, rows = [prompts[i:i + batch]
                       for i in range(0, _NUM_PROMPTS.value, batch)], None
    width = max(len(p) for p in prompts)
    cache_len = bucket_length(bucket_length(width, PROMPT_BUCKETS) + _MAX_NEW.value + k + 2)
    verify_params = {m: VerifyParams(method=m, temperature=_TEMPERATURE.value)
                     for m in ["ar"] + methods}
    # One-token calls time the prefills: without the draft (ar) and with it (sd; every
    # draft method prefills the same way).
    prefill_calls = {name: (VerifyParams(method=name, temperature=_TEMPERATURE.value), steps)
                     for name, steps in (("ar", 0), ("sd", k))}
    one_token = {m: prefill_calls["ar" if m == "ar" else "sd"] for m in verify_params}
    for m, verify in verify_params.items():  # compile every program before timing
      decoder.generate(batches[0], verify, num_draft=k, batch_size=rows,
                       max_new_tokens=_MAX_NEW.value)
    for verify, steps in prefill_calls.values():
      decoder.generate(batches[0], verify, num_draft=steps, batch_size=rows,
                       max_new_tokens=1)

    def timed_slot(m):
      """Step costs, then the one-token call, then the call itself: adjacent in time."""
      costs = step_costs.measure(decoder, batch, k, cache_len, repeats=3,
                                 greedy=_TEMPERATURE.value == 0)
      verify, steps = one_token[m]
      one_token_s, one_token_rounds = run_method(decoder, batches, verify, steps, rows, 1)[1:3]
      round_s = costs.decode_s if m == "ar" else costs.round_s(steps)
      prefill_s = paired_timing.prefill_seconds(one_token_s, one_token_rounds, round_s)
      tokens, seconds, batch_rounds, row_rounds, row_slots, summaries = run_method(
          decoder, batches, verify_params[m], k, rows)
      timing = paired_timing.CallTiming(
          seconds=seconds, prefill_s=prefill_s, tokens=tokens, batch_rounds=batch_rounds,
          row_rounds=row_rounds, row_slots=row_slots)
      return timing, costs, summaries

    # Every method call sits between two AR calls, in a new random order of the methods
    # every repeat: AR, m1, AR, m2, ..., AR.
    pairs = {m: [] for m in methods}
    ar_slots, accept = [], {m: [] for m in methods}
    shuffle = np.random.default_rng(0)
    for rep in range(_REPEATS.value):
      ar_slots.append(timed_slot("ar")[:2])
      for m in shuffle.permutation(methods):
        timing, costs, summaries = timed_slot(m)
        ar_slots.append(timed_slot("ar")[:2])
        pairs[m].append(paired_timing.Pair(
            method=timing, ar_before=ar_slots[-2][0], ar_after=ar_slots[-1][0], costs=costs,
            local_costs=costs, draft_steps=loop.LoopSpec(verify_params[m], k).num_draft_steps))
        accept[m] += [s["acceptance_rate"] for s in summaries]
        print(f"  batch {batch}, repeat {rep + 1}/{_REPEATS.value}: {m} "
              f"{timing.seconds:.1f} s between ar {ar_slots[-2][0].seconds:.1f} s and "
              f"{ar_slots[-1][0].seconds:.1f} s: efficiency {pairs[m][-1].efficiency:.2f} "
              "(from this pair's step costs)", flush=True)
    # The prediction takes the median of every step-cost sample of the batch size: a
    # 3-repeat sample's ratios are noisy (see paired_timing.Pair).
    all_costs = [c for _, c in ar_slots] + [p.local_costs for ps in pairs.values() for p in ps]
    median_costs = step_costs.StepCosts.median(all_costs)
    pairs = {m: [dataclasses.replace(p, costs=median_costs) for p in ps]
             for m, ps in pairs.items()}
    if _OUT.value:
      results[f"batch_{batch}"] = {
          "median_costs": dataclasses.asdict(median_costs),
          "ar_slots": [{"timing": dataclasses.asdict(t), "costs": dataclasses.asdict(c)}
                       for t, c in ar_slots],
          "pairs": {m: [dataclasses.asdict(p) for p in ps] for m, ps in pairs.items()}}
      with open(_OUT.value, "w") as f:
        json.dump(results, f, indent=1)
    decode_s = median_costs.decode_s
    ar_timings = [t for t, _ in ar_slots]
    sd_prefill_s = _median(p.method.prefill_s for ps in pairs.values() for p in ps)
    ar_prefill_s = _median(t.prefill_s for t in ar_timings)
    layout = (f"{len(batches[0])} prompts per call, continuous batching" if queued
              else f"{len(batches)} calls")
    print(f"\nbatch {batch} ({layout}), medians over the samples: target step "
          f"{decode_s * 1e3:.1f} ms, verify/decode r={median_costs.r:.2f}, "
          f"draft/target c={median_costs.c:.3f} (catch-up call "
          f"c2={median_costs.catchup_s / decode_s:.3f}), cache {cache_len} slots, prefills "
          f"per call: target {ar_prefill_s / len(batches) * 1e3:.0f} ms, both models "
          f"{sd_prefill_s / len(batches) * 1e3:.0f} ms")
    # A prefill estimate is a one-token call less its rounds' step costs: where the calls'
    # decoding is short beside it, their difference is noise (it even went negative).
    calls = ar_timings + [p.method for ps in pairs.values() for p in ps]
    short = sum(t.phase_s <= 0.1 * t.seconds for t in calls)
    if short:
      print(f"warning: in {short} of {len(calls)} calls the prefills came to 90% or more of "
            "the call: their decoding-phase columns are noise (raise --max_new_tokens)")
    print(f"{'method':10s} {'tok/s':>7s} {'speedup':>7s} {'| decoding phase:':>17s} "
          f"{'tok/s':>6s} {'speedup':>7s} {'predicted':>9s} {'efficiency':>10s} "
          f"{'(range)':>11s} {'pred/batch':>10s} {'eff/batch':>9s} {'calls':>6s} "
          f"{'busy':>5s} {'accept':>7s} {'tok/round':>9s}")
    print(f"{'ar':10s} {_median(t.tokens / t.seconds for t in ar_timings):7.1f} "
          f"{1.0:7.2f} {'':17s} {_median(t.tokens / t.phase_s for t in ar_timings):6.1f} "
          f"{1.0:7.2f} {'':53s} "
          f"{_median(paired_timing.ar_calls(t, c) for t, c in ar_slots):6.2f} "
          f"{_median(t.busy for t in ar_timings):5.2f}")
    for m in methods:
      ps = pairs[m]
      figure = lambda name: _median(getattr(p, name) for p in ps)
      effs = [p.efficiency for p in ps]
      print(f"{m:10s} {_median(p.method.tokens / p.method.seconds for p in ps):7.1f} "
            f"{figure('speedup'):7.2f} {'':17s} "
            f"{_median(p.method.tokens / p.method.phase_s for p in ps):6.1f} "
            f"{figure('phase_speedup'):7.2f} {figure('predicted'):9.2f} "
            f"{figure('efficiency'):10.2f} {f'{min(effs):.2f}-{max(effs):.2f}':>11s} "
            f"{figure('predicted_batch'):10.2f} {figure('efficiency_batch'):9.2f} "
            f"{figure('calls'):6.2f} {_median(p.method.busy for p in ps):5.2f} "
            f"{np.mean(accept[m]):7.3f} "
            f"{_median(p.method.tokens_per_round for p in ps):9.2f}", flush=True)
    # The loop is shared by every method; pooled, its efficiency has the most samples.
    pooled = [p.efficiency for ps in pairs.values() for p in ps]
    quartiles = np.percentile(pooled, [25, 50, 75])
    print(f"all methods: efficiency median {quartiles[1]:.2f} (quartiles {quartiles[0]:.2f}-"
          f"{quartiles[2]:.2f}) over {len(pooled)} pairs", flush=True)


if __name__ == "__main__":
  app.run(main)
