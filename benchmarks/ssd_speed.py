r"""Speculative speculative decoding (method 'ssd') on a target and its draft: hit rate,
acceptance, and the speed-up a second device for the draft would give.

  python benchmarks/ssd_speed.py [--target=smollm2-135m-instruct] [--draft=...]
      [--num_prompts=4] [--max_new_tokens=64] [--num_draft=4] [--fanout=2]
      [--saguaro_scales=1,0.5] [--temperatures=0,1]

Per temperature, GSM8K-test prompts are decoded one at a time by exact speculative
decoding ('sd', batch 1) and by 'ssd' at each Saguaro scale C. Printed per method:
acceptance, tokens per round, the hit rate (rounds whose drafts were pre-drafted) and
tokens/s as measured here. On one device the speculation runs in turn with the target, so
the measured 'ssd' pays for it instead of hiding it.

`two_devices` predicts the speed-up over 'sd' with the draft on a device of its own, from
the step costs measured here (`speculative.step_costs`; t = one target decoding step):

  sd round  = c2 + (K - 1) c + r
  ssd round = max(r, s) + (1 - hit) (c2 + K c),   s = c2' + K c'

r the verification, c2 + K c the draft's own round (K + 1 steps: 'ssd' also drafts
q_{K+1} for its guesses), and s the speculation: the same calls over the C = (K + 1) F
guessed outcomes' rows (c2', c' measured at C rows). A hit's next drafts are ready when
the speculation ends; a miss drafts after it. Transfers between the devices and the
host's per-round dispatch are not in the model. On this CPU a C-row draft step costs
about C / 3 one-row steps; `rows_free` takes c2' = c2 and c' = c instead, as on a
device where a small model's step is latency-bound at C rows (the H200 of session 28
decoded SmolLM2-135M so).
"""

from __future__ import annotations

import json
import os
import sys

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_setup  # noqa: E402

from diversed_jax.models.kv_cache import bucket_length  # noqa: E402
from diversed_jax.speculative import metrics, step_costs  # noqa: E402
from diversed_jax.speculative.types import VerifyParams  # noqa: E402

_TARGET = flags.DEFINE_string("target", "smollm2-135m-instruct", "Target model.")
_DRAFT = flags.DEFINE_string("draft", None, "Draft spec (default: the target's).")
_NUM_PROMPTS = flags.DEFINE_integer("num_prompts", 4, "GSM8K-test prompts.")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 64, "Tokens per prompt at most.")
_NUM_DRAFT = flags.DEFINE_integer("num_draft", 4, "K.")
_FANOUT = flags.DEFINE_integer("fanout", 2, "Guesses per accepted length (F).")
_SCALES = flags.DEFINE_list("saguaro_scales", ["1", "0.5"], "Saguaro scales C.")
_TEMPERATURES = flags.DEFINE_list("temperatures", ["0", "1"], "Temperatures.")


def two_device_round(costs, guessed: step_costs.StepCosts, k: int, hit_rate: float) -> float:
  """Seconds of an 'ssd' round with the draft on its own device (module doc)."""
  own_round = costs.catchup_s + k * costs.draft_s
  speculation = guessed.catchup_s + k * guessed.draft_s
  return max(costs.verify_s, speculation) + (1.0 - hit_rate) * own_round


def main(argv):
  del argv
  _, tokenizer, decoder, info = bench_setup.load_decoder(_TARGET.value, _DRAFT.value)
  prompts = bench_setup.gsm8k_test_prompts(tokenizer, _NUM_PROMPTS.value)
  k, fanout = _NUM_DRAFT.value, _FANOUT.value
  cache_len = bucket_length(max(map(len, prompts)) + _MAX_NEW.value + k + 2)
  costs = step_costs.measure(decoder, 1, k, cache_len)
  guessed = step_costs.measure(decoder, (k + 1) * fanout, k, cache_len)
  print(json.dumps({"host": bench_setup.host_info(), "draft": info.get("draft"),
                    "step_costs_batch1": costs.__dict__,
                    f"step_costs_batch{(k + 1) * fanout}": guessed.__dict__}))
  sd_round = costs.round_s(k)
  for temperature in map(float, _TEMPERATURES.value):
    settings = [("sd", VerifyParams(method="sd", temperature=temperature))]
    settings += [(f"ssd(f={fanout},c={c})",
                  VerifyParams(method="ssd", temperature=temperature, fanout=fanout,
                               saguaro_scale=float(c))) for c in _SCALES.value]
    sd_per_s = None
    for name, verify in settings:
      out = decoder.generate(prompts, verify, num_draft=k, max_new_tokens=_MAX_NEW.value,
                             batch_size=1, seed=0)
      summary = metrics.summarize(out.stats, out.num_tokens, speculative=True)
      row = {"temperature": temperature, "method": name,
             "acceptance": round(summary["acceptance_rate"], 3),
             "tokens_per_round": round(summary["tokens_per_round"], 3),
             "tokens_per_s_here": round(out.num_tokens / out.seconds, 1)}
      if verify.method == "sd":
        sd_per_s = summary["tokens_per_round"] / sd_round
      else:
        hit = summary["hit_rate"]
        per_s = summary["tokens_per_round"] / two_device_round(costs, guessed, k, hit)
        rows_free = summary["tokens_per_round"] / two_device_round(costs, costs, k, hit)
        row.update(hit_rate=round(hit, 3), two_devices_vs_sd=round(per_s / sd_per_s, 3),
                   two_devices_vs_ar=round(per_s * costs.decode_s, 3),
                   rows_free_vs_sd=round(rows_free / sd_per_s, 3))
      print(json.dumps(row), flush=True)


if __name__ == "__main__":
  app.run(main)
