"""The main job: `run(config, workdir)` dispatches on config.mode.

  eval            evaluate every method setting on the task slice, write the reports
  train           train the DIVERSED head (diversed_jax.training) into WORKDIR/train/head
  train_and_eval  both; the evaluation's 'diversed' uses the head just trained
  distill         run the draft distillation job (diversed_jax.distill) with distill.config
  bench           time every setting on a few prompts (no scoring), write bench.json / .md
"""

from __future__ import annotations

import json
import os
import time
from typing import Callable

from diversed_jax.evaluation import context as context_lib
from diversed_jax.evaluation import evaluate as evaluate_lib
from diversed_jax.evaluation import report
from diversed_jax.evaluation.validate import validate


def _log(message: str) -> None:
  print(time.strftime("%H:%M:%S"), message, flush=True)


def train(config, workdir: str, target=None, log: Callable = _log) -> str:
  """Trains a head on train.task (default task.name); returns the head folder."""
  from diversed_jax import tokenizer as tokenizer_lib
  from diversed_jax import training
  from diversed_jax.models import loading
  from diversed_jax.speculative import build
  from diversed_jax.tasks.registry import get_task

  task = get_task(config.train.task or config.task.name)
  examples = task.load(source=config.train.source or None, split=config.train.split,
                       limit=config.train.limit or None)
  if target is None:
    log(f"loading target {config.model.target}")
    target = loading.load_model(config.model.target)
  tokenizer = tokenizer_lib.load_tokenizer(config.model.tokenizer or config.model.target)
  draft, draft_params, draft_spec = build.load_draft(config.model.draft or None, target)
  log(f"training the head on {len(examples)} {task.name} examples, draft {draft_spec}")
  return training.train_head(
      config.train, target=target, draft=draft, draft_params=draft_params, task=task,
      examples=examples, workdir=os.path.join(workdir, context_lib.TRAIN_SUBDIR),
      tokenizer=tokenizer, draft_spec=draft_spec, progress=log)


def evaluate_and_report(config, workdir: str, models=None, target=None,
                        log: Callable = _log) -> list[dict]:
  """Evaluation, then summary.json / .csv / .md and pareto.png; prints the table."""
  rows = evaluate_lib.evaluate(config, workdir, models=models, target=target, log=log)
  paths = report.write_reports(rows, workdir, plot=config.eval.plot)
  print("\n" + report.markdown_table(rows), flush=True)
  log("wrote " + ", ".join(sorted(paths.values())))
  return rows


def bench(config, workdir: str, log: Callable = _log) -> list[dict]:
  """Tokens per second of every setting on the first bench.num_prompts prompts."""
  settings = evaluate_lib.settings_for(config, log)
  task, examples = context_lib.load_slice(config.task, limit=config.bench.num_prompts)
  models = context_lib.load_models(config, settings, workdir, log=log)
  prompts = context_lib.encode_prompts(config, task, examples, models.tokenizer)
  rows = []
  for setting in settings:
    kwargs = dict(num_draft=config.decode.num_draft,
                  max_new_tokens=config.decode.max_new_tokens, seed=config.seed)
    decoder = models.decoder_for(setting)
    first = decoder.generate(prompts, setting.verify, **kwargs)
    runs = [decoder.generate(prompts, setting.verify, **kwargs)
            for _ in range(config.bench.repeats)]
    tokens, seconds = sum(r.num_tokens for r in runs), sum(r.seconds for r in runs)
    from diversed_jax.speculative import metrics
    figures = metrics.summarize(runs[-1].stats, runs[-1].num_tokens, setting.family != "ar")
    rows.append({"setting": setting.name, "method": setting.family,
                 "tokens_per_second": tokens / seconds if seconds else 0.0,
                 "compile_seconds": first.compile_seconds,
                 "acceptance_rate": figures["acceptance_rate"],
                 "tokens_per_round": figures["tokens_per_round"]})
    log(f"{setting.name}: {rows[-1]['tokens_per_second']:.1f} tokens/s")
  ar = next((r for r in rows if r["method"] == "ar"), None)
  lines = ["| setting | tokens/s | speed-up | acceptance | tokens/round | compile s |",
           "|---|---|---|---|---|---|"]
  for r in rows:
    r["speedup_vs_ar"] = r["tokens_per_second"] / ar["tokens_per_second"] if ar else None
    lines.append(f"| {r['setting']} | {r['tokens_per_second']:.1f} | "
                 f"{'-' if r['speedup_vs_ar'] is None else format(r['speedup_vs_ar'], '.2f')} "
                 f"| {r['acceptance_rate']:.3f} | {r['tokens_per_round']:.2f} | "
                 f"{r['compile_seconds']:.1f} |")
  with open(os.path.join(workdir, "bench.json"), "w") as f:
    json.dump(rows, f, indent=1)
  with open(os.path.join(workdir, "bench.md"), "w") as f:
    f.write("\n".join(lines) + "\n")
  print("\n" + "\n".join(lines), flush=True)
  return rows


def distill(config, log: Callable = _log) -> None:
  """`python -m diversed_jax.distill --config=<distill.config> --config.mode=<distill.mode>`."""
  from diversed_jax.distill import train as distill_train
  from diversed_jax.evaluation.config_io import load_config
  log(f"distillation: {config.distill.config} (mode {config.distill.mode})")
  distill_train.run(load_config(config.distill.config, {"mode": config.distill.mode}))


def run(config, workdir: str | None = None, log: Callable = _log):
  """Validates `config` (before loading anything) and runs config.mode in `workdir`
  (default config.workdir). Returns the summary rows of eval modes, the head folder of
  train, the bench rows of bench."""
  validate(config)
  workdir = workdir or config.workdir
  os.makedirs(workdir, exist_ok=True)
  with open(os.path.join(workdir, "config.json"), "w") as f:
    f.write(config.to_json_best_effort(indent=1, sort_keys=True))
  log(f"mode {config.mode}, workdir {workdir}")
  if config.mode == "eval":
    return evaluate_and_report(config, workdir, log=log)
  if config.mode == "bench":
    return bench(config, workdir, log=log)
  if config.mode == "distill":
    return distill(config, log=log)
  from diversed_jax.models import loading
  log(f"loading target {config.model.target}")
  target = loading.load_model(config.model.target)
  head = train(config, workdir, target=target, log=log)
  log(f"head written to {head}")
  if config.mode == "train":
    return head
  return evaluate_and_report(config, workdir, target=target, log=log)
