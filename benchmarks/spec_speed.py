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
above 1 means the step costs were timed in a slower phase of the host than the decoding
(this shared host's speed drifts), so read the pair, not one figure. `eff/rep` is the same
efficiency computed within each repeat (its own step costs, prefills and calls, measured
minutes apart at most; methods run in a new random order every repeat), median over the
repeats: a check on `efficiency`, whose best-of figures may come from different phases.
"""

from __future__ import annotations

import numpy as np
from absl import app, flags

from diversed_jax.models.kv_cache import bucket_length
from diversed_jax.speculative import loop, metrics, step_costs
from diversed_jax.speculative.decoder import PROMPT_BUCKETS
from diversed_jax.speculative.types import VerifyParams

from bench_setup import gsm8k_test_prompts, load_decoder  # benchmarks/, beside this script

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
_REPEATS = flags.DEFINE_integer("repeats", 3, "Interleaved timing repeats (best kept).")
_SHRINK_TAIL = flags.DEFINE_bool(
    "shrink_tail", True, "Batch sizes > 1: once no prompt is queued, continue with the "
    "unfinished rows only (SpeculativeDecoder's shrink_tail; more compile time, which is "
    "not timed).")
_METHODS = flags.DEFINE_list("methods", ["sd", "lossy", "static", "diversed", "cascade",
                                         "mentored", "typical"], "Methods besides ar.")


def run_method(decoder, batches, verify, k, batch_size=None, max_new_tokens=None):
  """(tokens, seconds per batch [n], batch rounds, row slots, summaries) over all batches;
  compile time excluded. Row slots = the rows the rounds ran, summed (a shrunk tail's
  rounds run fewer than the batch's)."""
  tokens = batch_rounds = row_slots = 0
  seconds, summaries = [], []
  for chunk in batches:
    out = decoder.generate(chunk, verify, num_draft=k, batch_size=batch_size,
                           max_new_tokens=max_new_tokens or _MAX_NEW.value)
    tokens += out.num_tokens
    seconds.append(out.seconds)
    batch_rounds += out.rounds
    row_slots += int(np.sum(out.stats.width_r))
    summaries.append(metrics.summarize(out.stats, out.num_tokens, verify.method != "ar"))
  return tokens, np.asarray(seconds), batch_rounds, row_slots, summaries


def main(argv):
  del argv
  _, tokenizer, decoder, info = load_decoder(_TARGET.value, _DRAFT.value)
  decoder.shrink_tail = _SHRINK_TAIL.value
  prompts = gsm8k_test_prompts(tokenizer, max(
      _QUEUE.value, max(int(b) for b in _BATCH_SIZES.value) *
      max(1, _NUM_PROMPTS.value // min(int(b) for b in _BATCH_SIZES.value))))
  k = _NUM_DRAFT.value
  methods = ["ar"] + list(_METHODS.value)
  print(f"target={info['target']} draft={info['draft']} K={k} T={_TEMPERATURE.value} "
        f"max_new_tokens={_MAX_NEW.value}, shrink_tail={_SHRINK_TAIL.value}, best of "
        f"{_REPEATS.value} interleaved repeats")
  for batch in (int(b) for b in _BATCH_SIZES.value):
    queued = batch > 1 and _QUEUE.value > batch
    if queued:  # one call: Q prompts through B rows
      batches, rows = [prompts[:_QUEUE.value]], batch
    else:
      batches, rows = [prompts[i:i + batch]
                       for i in range(0, max(_NUM_PROMPTS.value, batch), batch)], None
      batches = [b for b in batches if len(b) == batch]
    width = max(len(p) for p in prompts)
    cache_len = bucket_length(bucket_length(width, PROMPT_BUCKETS) + _MAX_NEW.value + k + 2)
    verify_params = {m: VerifyParams(method=m, temperature=_TEMPERATURE.value) for m in methods}
    for m in methods:  # compile every program before timing anything
      decoder.generate(batches[0], verify_params[m], num_draft=k, batch_size=rows,
                       max_new_tokens=_MAX_NEW.value)
    # One-token calls time the prefills: without the draft (ar) and with it (sd).
    one_token = {False: (VerifyParams(method="ar", temperature=_TEMPERATURE.value), 0),
                 True: (VerifyParams(method="sd", temperature=_TEMPERATURE.value), k)}
    for verify, steps in one_token.values():
      decoder.generate(batches[0], verify, num_draft=steps, batch_size=rows, max_new_tokens=1)
    # Timings interleave methods and step costs over the repeats (the machine's speed
    # drifts), in a new random order every repeat; every call (method and batch of
    # prompts) keeps its best repeat, so a slow phase of the host spoils one call's
    # sample, not a whole method's. Each repeat's own times are kept too (`eff/rep`).
    best_s = {m: np.full(len(batches), np.inf) for m in methods}
    rep_s = {m: [] for m in methods}
    runs, costs = {}, []
    one_token_reps, one_token_rounds = {False: [], True: []}, {}
    shuffle = np.random.default_rng(0)
    for rep in range(_REPEATS.value):
      costs.append(step_costs.measure(decoder, batch, k, cache_len))
      # One-token calls: the prefills (every prompt's, refills included) plus their rounds.
      for with_draft, (verify, steps) in one_token.items():
        _, seconds, one_token_rounds[with_draft], _, _ = run_method(decoder, batches, verify,
                                                                    steps, rows, 1)
        one_token_reps[with_draft].append(seconds)
      for m in shuffle.permutation(methods):
        runs[m] = run_method(decoder, batches, verify_params[m], k, rows)
        best_s[m] = np.minimum(best_s[m], runs[m][1])
        rep_s[m].append(float(runs[m][1].sum()))
      print(f"  batch {batch}, repeat {rep + 1}/{_REPEATS.value}: "
            + ", ".join(f"{m} {rep_s[m][-1]:.1f} s" for m in methods), flush=True)
    best_s = {m: float(s.sum()) for m, s in best_s.items()}
    best_costs = step_costs.StepCosts.best(costs)
    decode_s, c, r = best_costs.decode_s, best_costs.c, best_costs.r

    def prefill_seconds(one_token_s, with_draft: bool, cost: step_costs.StepCosts):
      # The prompts' prefills are a fixed cost outside the rounds that the prediction
      # models: the decoding phase = a call's time minus its prefills = a one-token call's
      # time (`one_token_s`, per batch) minus its rounds (one step, or one sd round, each).
      round_s = cost.round_s(k) if with_draft else cost.decode_s
      return max(float(np.sum(one_token_s)) - one_token_rounds[with_draft] * round_s, 0.0)

    prefill_s = {d: prefill_seconds(np.min(one_token_reps[d], axis=0), d, best_costs)
                 for d in (False, True)}

    def repeat_efficiency(m, tpr, steps):
      """Median over repeats of the efficiency from that repeat's own times and costs."""
      effs = []
      for i, cost in enumerate(costs):
        pre = {d: prefill_seconds(one_token_reps[d][i], d, cost) for d in (False, True)}
        ar_phase = rep_s["ar"][i] - pre[False]
        phase = rep_s[m][i] - pre[True]
        effs.append(ar_phase / phase / cost.predicted_speedup(tpr, steps))
      return float(np.median(effs))
    layout = (f"{len(batches[0])} prompts per call, continuous batching" if queued
              else f"{len(batches)} calls")
    print(f"\nbatch {batch} ({layout}): target step {decode_s * 1e3:.1f} ms, verify/decode "
          f"r={r:.2f}, draft/target c={c:.3f} (catch-up call "
          f"c2={best_costs.catchup_s / decode_s:.3f}), cache {cache_len} slots, prefills per call: "
          f"target {prefill_s[False] / len(batches) * 1e3:.0f} ms, both models "
          f"{prefill_s[True] / len(batches) * 1e3:.0f} ms (draft/target "
          f"{prefill_s[True] / prefill_s[False] - 1:.3f})")
    print(f"{'method':10s} {'tok/s':>7s} {'speedup':>7s} {'| decoding phase:':>17s} "
          f"{'tok/s':>6s} {'speedup':>7s} {'predicted':>9s} {'efficiency':>10s} "
          f"{'eff/rep':>7s} {'pred/batch':>10s} {'eff/batch':>9s} {'calls':>6s} "
          f"{'busy':>5s} {'accept':>7s} {'tok/round':>9s}")
    ar_rate = ar_phase_rate = ar_tpr_batch = None
    for m in methods:
      tokens, _, batch_rounds, row_slots, summaries = runs[m]
      rate = tokens / best_s[m]
      phase_rate = tokens / (best_s[m] - prefill_s[m != "ar"])
      row_rounds = sum(s["rounds"] for s in summaries)  # rounds in which a row was active
      tpr = tokens / row_rounds  # per row and round
      # A batch runs until its slowest row is done: per-row tokens per BATCH round (per
      # row the rounds ran: a shrunk tail runs fewer).
      tpr_batch = tokens / row_slots
      busy = row_rounds / row_slots
      if m == "ar":
        ar_rate, ar_phase_rate, ar_tpr_batch = rate, phase_rate, tpr_batch
        calls = batch_rounds * decode_s * phase_rate / tokens
        print(f"{m:10s} {rate:7.1f} {1.0:7.2f} {'':17s} {phase_rate:6.1f} {1.0:7.2f} "
              f"{'':49s} {calls:6.2f} {busy:5.2f}")
        continue
      steps = loop.LoopSpec(verify_params[m], k).num_draft_steps
      calls = batch_rounds * best_costs.round_s(steps) * phase_rate / tokens
      predicted = best_costs.predicted_speedup(tpr, steps)
      predicted_batch = best_costs.predicted_speedup(tpr_batch / ar_tpr_batch, steps)
      accept = np.mean([s["acceptance_rate"] for s in summaries])
      speedup = phase_rate / ar_phase_rate
      print(f"{m:10s} {rate:7.1f} {rate / ar_rate:7.2f} {'':17s} {phase_rate:6.1f} "
            f"{speedup:7.2f} {predicted:9.2f} {speedup / predicted:10.2f} "
            f"{repeat_efficiency(m, tpr, steps):7.2f} "
            f"{predicted_batch:10.2f} {speedup / predicted_batch:9.2f} {calls:6.2f} "
            f"{busy:5.2f} {accept:7.3f} {tpr:9.2f}", flush=True)


if __name__ == "__main__":
  app.run(main)
