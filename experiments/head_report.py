"""Acceptance vs quality of exact SD, static ensembles and trained DIVERSED heads.

For each task, the same test prompts are decoded by the speculative loop with
  sd          exact speculative decoding (w = 1),
  static w    nu = w p + (1 - w) q for a few fixed w,
  diversed    a trained head (w_t = head(h_q,t, h_p,t)), one row per head given,
and the script prints acceptance rate (accepted / drafted), tokens per round, the task quality
(GSM8K accuracy, CNN/DM ROUGE-2 F), mean w_t and the mean per-token bias TV(nu_t, p_t) =
(1 - w_t) TV(p_t, q_t) along the generated path (from the loop's record of each committed
token's laws, `Generation.policy`; 0 for exact SD). A head listed for another task gives
the cross-task row.

  python experiments/head_report.py --num_prompts=4 --draft=self:4 \
      --head=gsm8k:gsm8k-lam0.05:runs/heads/gsm8k_lam0.05/head \
      --head=cnndm:cnndm-lam0.05:runs/heads/cnndm_lam0.05/head \
      --head=cnndm:gsm8k-head:runs/heads/gsm8k_lam0.05/head     # cross-task
"""

from __future__ import annotations

import dataclasses
import os
import sys

import numpy as np
from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_TARGET = flags.DEFINE_string("target", "smollm2-135m-instruct", "target model")
_DRAFT = flags.DEFINE_string("draft", None, "draft spec (default: the target's default)")
_TASKS = flags.DEFINE_list("tasks", ["gsm8k", "cnndm"], "tasks to evaluate")
_NUM_PROMPTS = flags.DEFINE_integer("num_prompts", 4, "test prompts per task")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 48, "generated tokens per prompt")
_NUM_DRAFT = flags.DEFINE_integer("num_draft", 4, "K drafts per round")
_TEMPERATURE = flags.DEFINE_float("temperature", 0.7, "sampling temperature")
_WEIGHTS = flags.DEFINE_list("static_weights", ["0.25", "0.5", "0.75"], "static w values")
_HEADS = flags.DEFINE_multi_string("head", [], "TASK:LABEL:FOLDER, a trained head to evaluate")
_MAX_WORDS = flags.DEFINE_integer("max_source_words", 150, "CNN/DM article truncation")
_BASELINES = flags.DEFINE_bool("baselines", True, "include exact SD and the static rows")
_SEED = flags.DEFINE_integer("seed", 0, "sampling seed")


def main(argv):
  del argv
  from diversed_jax import cli
  from diversed_jax.models import loading
  from diversed_jax.speculative import build
  from diversed_jax.speculative import metrics as metrics_lib
  from diversed_jax.speculative.decoder import ModelHandle, SpeculativeDecoder
  from diversed_jax.speculative.types import VerifyParams
  from diversed_jax.tasks.registry import get_task
  from diversed_jax.tokenizer import encode_prompt, load_tokenizer
  from diversed_jax.training import head_io
  from diversed_jax.training.rollouts import mean_committed_weight, policy_batch

  target = loading.load_model(_TARGET.value)
  draft, draft_params, draft_spec = build.load_draft(_DRAFT.value, target)
  tokenizer = load_tokenizer(_TARGET.value)
  handle = ModelHandle(target.config, target.params)
  print(f"target {target.name}, draft {draft_spec}, T={_TEMPERATURE.value}, "
        f"K={_NUM_DRAFT.value}, {_NUM_PROMPTS.value} prompts x {_MAX_NEW.value} tokens",
        flush=True)
  heads = [h.split(":", 2) for h in _HEADS.value]
  with cli.usage_errors("--head: "):  # a head reads its own draft's hidden states
    for head in heads:
      if len(head) != 3:
        raise ValueError(f"{':'.join(head)!r} is not TASK:LABEL:FOLDER")
      head_io.check_pair(head[2], target.name, draft_spec, head[0])

  rows = []
  for task_name in _TASKS.value:
    task = get_task(task_name)
    if task.max_source_words is not None:
      task = dataclasses.replace(task, max_source_words=_MAX_WORDS.value)
    examples = task.load(split="test", limit=_NUM_PROMPTS.value)
    prompts = [encode_prompt(tokenizer, task.prompt(e)) for e in examples]
    settings = []
    if _BASELINES.value:
      settings = [("sd", "exact SD", None)]
      settings += [("static", f"static w={w}", float(w)) for w in _WEIGHTS.value]
    settings += [("diversed", f"DIVERSED {label}", folder)
                 for t, label, folder in heads if t == task_name]
    for method, label, arg in settings:
      if method == "diversed":
        weight_fn, head_params = head_io.load_head_folder(arg)
        verify = VerifyParams(method="diversed", temperature=_TEMPERATURE.value)
      else:
        weight_fn, head_params = None, None
        verify = VerifyParams(method=method, temperature=_TEMPERATURE.value,
                              weight=arg if arg is not None else 1.0)
      dec = SpeculativeDecoder(handle, draft, draft_params, weight_fn, head_params)
      # The ensembles' record: the head inputs and TV(p, q) each token was committed under.
      ensemble = method != "sd"
      gen = dec.generate(prompts, verify, num_draft=_NUM_DRAFT.value,
                         max_new_tokens=_MAX_NEW.value, seed=_SEED.value,
                         record_policy=ensemble)
      summary = metrics_lib.summarize(gen.stats, gen.num_tokens, speculative=True)
      texts = [tokenizer.decode(t, skip_special_tokens=True) for t in gen.token_ids]
      quality = task.quality(texts, examples)
      # Bias along the path: TV(nu_t, p_t) = (1 - w_t) TV(p_t, q_t); exact SD has none.
      bias = 0.0
      if ensemble:
        batch = policy_batch(gen, _MAX_NEW.value)
        mask, tv = batch["mask_bt"], batch["tv_pq_bt"]
        w = (np.asarray(weight_fn(head_params, batch["h_q_btd"], batch["h_p_btd"]))
             if method == "diversed" else arg)
        bias = float(((1 - w) * tv * mask).sum() / mask.sum())
      w_mean = (mean_committed_weight(gen.stats) if method == "diversed"
                else (1.0 if method == "sd" else arg))
      rows.append(dict(task=task_name, method=label, acceptance=summary["acceptance_rate"],
                       tokens_per_round=summary["tokens_per_round"], quality=quality,
                       metric=task.metric, w_mean=w_mean, bias=bias))
      r = rows[-1]
      print(f"  {task_name:6s} {label:28s} acc {r['acceptance']:.3f} tok/round "
            f"{r['tokens_per_round']:.2f} {task.metric} {quality:.4f} w {w_mean:.3f} "
            f"TV(nu,p) {bias:.4f}", flush=True)

  print("\n| task | method | acceptance rate | tokens / round | quality | mean w | "
        "TV(nu,p) per token |")
  print("|---|---|---|---|---|---|---|")
  for r in rows:
    print(f"| {r['task']} | {r['method']} | {r['acceptance']:.3f} | "
          f"{r['tokens_per_round']:.2f} | {r['metric']} {r['quality']:.4f} | "
          f"{r['w_mean']:.3f} | {r['bias']:.4f} |")


if __name__ == "__main__":
  app.run(main)
