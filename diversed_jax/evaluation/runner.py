"""The main job: `run(config, workdir)` dispatches on config.mode.

  eval            evaluate every method setting on the task slice, write the reports
  train           train the DIVERSED head (diversed_jax.training) into WORKDIR/train/head
  train_and_eval  both; the evaluation's 'diversed' uses the head just trained
  distill         run the draft distillation job (diversed_jax.distill) with distill.config
  bench           time every setting on a few prompts (no scoring), write bench.json / .md

Several devices: each decoding call's rows are split over a 'data' mesh of them
(decode.mesh_data, context.decode_mesh), and so are each head-training step's
(train.mesh_data). Several processes (a multi-host job, see parallel/hosts.py): every mode
but distill; every process runs the same computations and only process 0 writes the
workdir's files and prints the tables.
"""

from __future__ import annotations

import dataclasses
import os
import re
import time
from typing import Callable

import jax

from diversed_jax import atomic_files
from diversed_jax.evaluation import context as context_lib
from diversed_jax.evaluation import evaluate as evaluate_lib
from diversed_jax.evaluation import report
from diversed_jax.evaluation.validate import validate
from diversed_jax.parallel import hosts

MULTI_PROCESS_MODES = ("eval", "bench", "train", "train_and_eval")
_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def _log(message: str) -> None:
  print(time.strftime("%H:%M:%S"), message, flush=True)


def check_workdir(workdir: str) -> str:
  """The workdir, or ValueError for an object-store URL (gs://, s3://, any scheme://):
  results are appended with fsync and reports written with open(), which need a file
  system; os.makedirs would make a local folder named 'gs:' instead."""
  if not workdir:
    raise ValueError("workdir='': give --workdir or config.workdir")
  if _URL.match(workdir):
    raise ValueError(f"workdir={workdir!r}: object-store URLs are not supported; use a "
                     "local folder or a mounted bucket (e.g. gcsfuse: "
                     "--workdir=/mnt/bucket/run)")
  return workdir


def preflight(config, workdir: str | None = None) -> str:
  """Every check that loads no model: the config (validate), the workdir (returned,
  default config.workdir), the mode under several processes, and the meshes' split of
  the rows (decode.mesh_data, train.mesh_data). Raises ValueError naming the bad value."""
  validate(config)
  workdir = check_workdir(workdir or config.workdir)
  if jax.process_count() > 1 and config.mode not in MULTI_PROCESS_MODES:
    raise ValueError(f"mode={config.mode!r}: a job of {jax.process_count()} processes runs "
                     f"modes {list(MULTI_PROCESS_MODES)} only (distillation runs on one "
                     "host)")
  if config.mode in ("eval", "bench", "train_and_eval"):
    context_lib.decode_mesh(config)
  if config.mode in ("train", "train_and_eval"):
    from diversed_jax.training.config import HParams
    HParams.from_config(config.train).mesh()
  return workdir


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
      config.train, target=target, draft=draft, draft_params=draft_params,
      task=training_task(config, task, tokenizer), examples=examples,
      workdir=os.path.join(workdir, context_lib.TRAIN_SUBDIR), draft_spec=draft_spec,
      progress=log)


def training_task(config, task, tokenizer):
  """The trainer's TokenTask of `task`, with the evaluation's prompts: model.chat,
  task.num_shots shots and the template kept whole (context.encode_prompts). A prompt
  that does not fit comes at its shortest, and the trainer skips those over
  train.max_prompt_tokens."""
  from diversed_jax import training
  shots = context_lib.prompt_shots(config, task.name)
  max_tokens = min(config.task.max_prompt_tokens, config.train.max_prompt_tokens)

  def prompt_ids(example):
    return task.prompt_ids(example, shots, tokenizer, max_tokens, chat=config.model.chat)[0]

  return dataclasses.replace(training.text_task(task, tokenizer), prompt_ids=prompt_ids)


def evaluate_and_report(config, workdir: str, models=None, target=None,
                        log: Callable = _log) -> list[dict]:
  """Evaluation, then summary.json / .csv / .md and pareto.png; prints the table."""
  rows = evaluate_lib.evaluate(config, workdir, models=models, target=target, log=log)
  if hosts.is_writer():
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
  if hosts.is_writer():
    atomic_files.write_json(os.path.join(workdir, "bench.json"), rows, indent=1)
    atomic_files.write_lines(os.path.join(workdir, "bench.md"), lines)
    print("\n" + "\n".join(lines), flush=True)
  return rows


def distill(config, log: Callable = _log) -> None:
  """`python -m diversed_jax.distill --config=<distill.config> --config.mode=<distill.mode>`."""
  from diversed_jax.distill import train as distill_train
  from diversed_jax.evaluation.config_io import load_config
  log(f"distillation: {config.distill.config} (mode {config.distill.mode})")
  distill_train.run(load_config(config.distill.config, {"mode": config.distill.mode}))


def run(config, workdir: str | None = None, log: Callable = _log):
  """Checks `config` and the workdir (`preflight`, before loading anything) and runs
  config.mode in `workdir` (default config.workdir). Returns the summary rows of eval
  modes, the head folder of train, the bench rows of bench (on every process)."""
  workdir = preflight(config, workdir)
  if hosts.is_writer():
    os.makedirs(workdir, exist_ok=True)
    atomic_files.write_text(os.path.join(workdir, "config.json"),
                            config.to_json_best_effort(indent=1, sort_keys=True))
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
  if hosts.is_writer():
    log(f"head written to {head}")
  if config.mode == "train":
    return head
  return evaluate_and_report(config, workdir, target=target, log=log)
