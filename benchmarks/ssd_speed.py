r"""Speculative speculative decoding (method 'ssd') on a target and its draft: hit rate,
acceptance, and the speed a second device for the draft would give.

  python benchmarks/ssd_speed.py [--target=smollm2-135m-instruct] [--draft=...]
      [--num_prompts=8] [--max_new_tokens=64] [--num_draft=4] [--fanout=2]
      [--guess_budgets=0,3] [--saguaro_scales=1,0.5] [--temperatures=0,1]

Per temperature, GSM8K-test prompts are decoded one at a time by autoregressive decoding
and exact speculative decoding ('ar', 'sd': the compiled loop, a one-row queue) and by
'ssd' at each guess budget B (0: all (K + 1) F guesses) and Saguaro scale C. Printed per
method: acceptance, tokens per round, the hit rate and tokens/s as measured here,
prefills included; for 'ssd' also its programs' mean times a call (`ms`).

On one device the draft's programs run after the target's instead of beside them, so the
measured 'ssd' pays for its speculation. `two_devices` estimates its tokens/s with the
draft on a device of its own: each program of a second, timed pass (`ssd.decode` with a
runner that waits for every program) is timed alone, and a round then takes

  max(verify, guess + speculate) + (the next round's draft on a miss, or its take on a hit)

(the draft's device starts the next round's drafts when both its speculation and the
verified outcome are there), plus each prompt's prefill and first draft. The programs and
their costs are this host's; only the overlap is assumed. Transfers between two real
devices are not in it.
"""

from __future__ import annotations

import collections
import json
import os
import sys
import time

import jax
from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_setup  # noqa: E402

from diversed_jax.evaluation import methods  # noqa: E402
from diversed_jax.models.kv_cache import bucket_length  # noqa: E402
from diversed_jax.speculative import decoder as decoder_lib  # noqa: E402
from diversed_jax.speculative import loop, metrics, ssd  # noqa: E402
from diversed_jax.speculative.types import VerifyParams  # noqa: E402

_TARGET = flags.DEFINE_string("target", "smollm2-135m-instruct", "Target model.")
_DRAFT = flags.DEFINE_string("draft", None, "Draft spec (default: the target's).")
_NUM_PROMPTS = flags.DEFINE_integer("num_prompts", 8, "GSM8K-test prompts.")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 64, "Tokens per prompt at most.")
_NUM_DRAFT = flags.DEFINE_integer("num_draft", 4, "K.")
_FANOUT = flags.DEFINE_integer("fanout", 2, "Guesses per accepted length (F).")
_BUDGETS = flags.DEFINE_list("guess_budgets", ["0", "3"],
                             "Guess budgets B (0: all (K + 1) F guesses).")
_SCALES = flags.DEFINE_list("saguaro_scales", ["1", "0.5"], "Saguaro scales C.")
_TEMPERATURES = flags.DEFINE_list("temperatures", ["0", "1"], "Temperatures.")


def two_device_seconds(calls: list[tuple[str, float]]) -> float:
  """Seconds of one prompt's 'ssd' programs, each timed alone and in call order, with the
  draft's device working beside the target's (module doc)."""
  seconds = collections.defaultdict(float)
  total = 0.0
  for name, took in calls:
    if name == "verify" and seconds:  # a round ends: the previous one's programs overlap
      total += max(seconds["verify"], seconds["guess"] + seconds["speculate"])
      total += seconds["draft"] + seconds["take"] + seconds["start"]
      seconds.clear()
    seconds[name] += took
  total += max(seconds["verify"], seconds["guess"] + seconds["speculate"])
  return total + seconds["draft"] + seconds["take"]


def timed_ssd(decoder, prompts, verify, k: int, max_new_tokens: int):
  """(two-device seconds of decoding `prompts` by 'ssd', each program's mean milliseconds
  a call), after an untimed pass compiles."""
  tokens, lengths = decoder_lib.pad_prompts(prompts)
  spec = loop.LoopSpec(verify=verify, num_draft=k, max_new_tokens=max_new_tokens,
                       eos_token_ids=tuple(decoder.target.config.eos_token_ids))
  cache_len = bucket_length(tokens.shape[1] + max_new_tokens + k + 2)
  target_params, draft_params, draft_params_d = decoder._ssd_models

  def decode_all(calls):
    def run(name, fn, args, kwargs):
      start = time.perf_counter()
      out = jax.block_until_ready(fn(*args, **kwargs))
      calls.append((name, time.perf_counter() - start))
      return out
    for row in range(len(prompts)):
      ssd.decode(target_params, draft_params, tokens[row:row + 1], lengths[row:row + 1],
                 jax.random.fold_in(jax.random.PRNGKey(0), row), spec=spec,
                 target_config=decoder.target.config, draft=decoder.draft,
                 cache_len=cache_len, prefill_chunk=decoder.prefill_chunk,
                 draft_device=decoder.draft_device, draft_params_on_device=draft_params_d,
                 run=run)
      calls.append(("end", 0.0))

  decode_all([])  # compiles
  calls = []
  decode_all(calls)
  seconds, prompt_calls = 0.0, []
  per_program = collections.defaultdict(list)
  for name, took in calls:
    if name == "end":
      seconds += two_device_seconds(prompt_calls)
      prompt_calls = []
    else:
      prompt_calls.append((name, took))
      per_program[name].append(took)
  return seconds, {name: round(1e3 * sum(t) / len(t), 1) for name, t in per_program.items()}


def main(argv):
  del argv
  _, tokenizer, decoder, info = bench_setup.load_decoder(_TARGET.value, _DRAFT.value)
  prompts = bench_setup.gsm8k_test_prompts(tokenizer, _NUM_PROMPTS.value)
  k, fanout = _NUM_DRAFT.value, _FANOUT.value
  print(json.dumps({"host": bench_setup.host_info(), "draft": info.get("draft"),
                    "draft_device": str(decoder.draft_device)}))
  for temperature in map(float, _TEMPERATURES.value):
    settings = [(m, VerifyParams(method=m, temperature=temperature)) for m in ("ar", "sd")]
    settings += [(methods.ssd_name(fanout, int(b), float(c)),
                  VerifyParams(method="ssd", temperature=temperature, fanout=fanout,
                               guess_budget=int(b), saguaro_scale=float(c)))
                 for b in _BUDGETS.value for c in _SCALES.value]
    per_s = {}
    for name, verify in settings:
      out = decoder.generate(prompts, verify, num_draft=k, max_new_tokens=_MAX_NEW.value,
                             batch_size=1, seed=0)
      if out.compile_seconds:  # timed again, compiled
        out = decoder.generate(prompts, verify, num_draft=k, max_new_tokens=_MAX_NEW.value,
                               batch_size=1, seed=0)
      summary = metrics.summarize(out.stats, out.num_tokens, verify.method != "ar")
      per_s[name] = out.num_tokens / out.seconds
      row = {"temperature": temperature, "method": name,
             "acceptance": round(summary["acceptance_rate"], 3),
             "tokens_per_round": round(summary["tokens_per_round"], 3),
             "tokens_per_s_here": round(per_s[name], 1)}
      if verify.method == "ssd":
        seconds, ms = timed_ssd(decoder, prompts, verify, k, _MAX_NEW.value)
        two = out.num_tokens / seconds
        row.update(hit_rate=round(summary["hit_rate"], 3), ms=ms,
                   two_devices_tokens_per_s=round(two, 1),
                   two_devices_vs_sd=round(two / per_s["sd"], 3),
                   two_devices_vs_ar=round(two / per_s["ar"], 3))
      elif verify.method == "sd":
        row["vs_ar"] = round(per_s["sd"] / per_s["ar"], 3)
      print(json.dumps(row), flush=True)


if __name__ == "__main__":
  app.run(main)
