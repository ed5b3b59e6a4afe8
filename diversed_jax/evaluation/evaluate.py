"""Runs every method setting over the task slice, batch by batch, resumably.

For each setting and each call's worth of examples not yet in the results file: decode
(compile time excluded from the timing), score the completions with the task's reward,
append one JSON line per example. A call decodes `decode.batch_size` examples, or with
`decode.queue` > batch_size that many examples through batch_size rows with continuous
batching. Summary rows are computed from the file (report.summarize).

Per-example record: fingerprint, setting, method, params, example_id, index (in the split,
not the slice), completion, num_tokens, rounds, accepted, num_draft, theory (sum over rounds
of the expected accepted drafts), weight (mean w_t on the target over the positions whose
law committed a token, d_1..d_n and the token at n; static, static_logit and diversed
only), seconds (the call's decode seconds shared by row-rounds: an example's rounds over all
the rounds the rows ran, so padding prompts keep their share out of the records), reward.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Callable

import numpy as np

from diversed_jax.digest import folder_digest
from diversed_jax.evaluation import context as context_lib
from diversed_jax.evaluation import methods as methods_lib
from diversed_jax.evaluation.results import ResultStore, fingerprint
from diversed_jax.speculative import build, metrics
from diversed_jax.tasks.registry import get_task

# Rules whose emitted law blends target and draft with a weight w_t on the target
# (cascade defers instead: it has no w, so its records carry no weight).
WEIGHTED_METHODS = ("static", "static_logit", "diversed")


def settings_for(config, log: Callable = print) -> list[methods_lib.MethodSetting]:
  """The expanded settings, without 'sd_finetuned' when no fine-tuned draft is set."""
  settings = methods_lib.expand(config)
  if not config.model.finetuned_draft and any(s.draft == "finetuned" for s in settings):
    log("skipping sd_finetuned: model.finetuned_draft is not set")
    settings = [s for s in settings if s.draft != "finetuned"]
  return settings


# VerifyParams fields added after results were first written, with the values that keep
# the earlier behaviour: they enter a fingerprint only when they differ from these, so
# records of the methods that do not read them still count (as with matmul_precision).
_LATER_VERIFY_FIELDS = {"particles": 4, "ess_threshold": 0.5, "divergence": "tv",
                        "fanout": 2, "guess_budget": 0, "saguaro_scale": 1.0}


def verify_fields(verify) -> dict:
  """The VerifyParams fields that a setting's fingerprint hashes."""
  return {name: value for name, value in dataclasses.asdict(verify).items()
          if _LATER_VERIFY_FIELDS.get(name, object()) != value}


def setting_fingerprint(config, setting, models) -> str:
  """Hash of everything that changes a setting's per-example result (not the slice)."""
  draft = (None if setting.family == "ar" else
           models.info.get("finetuned_draft" if setting.draft == "finetuned" else "draft"))
  head = models.info.get("head") if setting.family == "diversed" else None
  digests = (folder_digest(draft), folder_digest(head))
  task = config.task
  # A lower precision changes results off the CPU; "highest" adds nothing, so that records
  # written before the field existed still count. The call layout is always in: records
  # written before session 46 shared their seconds and averaged w differently, so they
  # are decoded again once rather than mixed with new ones.
  precision = (() if config.decode.matmul_precision == "highest"
               else (config.decode.matmul_precision,))
  # Likewise a task's scoring version, once raised: what it scored before is redone.
  scoring = get_task(task.name).scoring_version
  scoring = (("scoring", scoring),) if scoring else ()
  return fingerprint(setting.name, verify_fields(setting.verify), draft, head, digests,
                     config.model.target, config.model.tokenizer, config.model.chat,
                     config.decode.num_draft, config.decode.max_new_tokens, config.seed,
                     task.name, task.source, task.split, task.num_shots,
                     task.max_prompt_tokens, context_lib.field_overrides(task.fields),
                     *precision, call_layout(config.decode), *scoring)


def call_layout(decode) -> dict:
  """The decode settings that shape each call: they change the seconds, and at T > 0 the
  samples (each call's seed is seed + its first example's index in the split)."""
  return {"batch_size": decode.batch_size, "examples_per_call": examples_per_call(decode),
          "shrink_tail": decode.shrink_tail}


def examples_per_call(decode) -> int:
  """Examples a decoding call takes: decode.queue when it exceeds batch_size."""
  return max(decode.batch_size, decode.queue)


def padded_call_size(num_prompts: int, decode) -> int:
  """Prompts a call decodes: `num_prompts` padded to batch_size times a power of two, at
  most examples_per_call.

  The queue length is a static shape of the compiled program. Padding every call to the
  full queue kept one program but ran up to queue - 1 dummy prompts through the rows;
  padding to the exact length would compile one program per distinct tail. Power-of-two
  multiples of batch_size compile at most log2(queue / batch_size) + 1 programs per
  setting and decode fewer dummy prompts than real ones (beyond the first batch).
  """
  padded = decode.batch_size
  while padded < num_prompts:
    padded *= 2
  return min(padded, examples_per_call(decode))


def mean_committed_weight(stats, served) -> float:
  """Mean w_t on the target over the positions of the `served` [R, B] row-rounds whose
  law committed a token: d_1..d_n and the residual or bonus token at n."""
  weights_nk = np.asarray(stats.weights_rbk)[served]
  accepted_n = np.asarray(stats.num_accepted_rb)[served]
  committed_nk = np.arange(weights_nk.shape[-1]) <= accepted_n[:, None]
  return float(weights_nk[committed_nk].mean())


def row_figures(stats, prompt: int, num_tokens: int, speculative: bool,
                with_weights: bool) -> dict:
  """Acceptance sums of one prompt of a call (see the module doc), via metrics.summarize:
  the rounds in which a row decoded that prompt."""
  served = metrics.served_mask(stats, prompt)
  prompt_stats = stats.replace(active_rb=served)
  figures = metrics.summarize(prompt_stats, num_tokens, speculative)
  rounds = figures["rounds"]
  out = {"rounds": rounds,
         "num_draft": int(np.asarray(stats.accept_prob_rbk).shape[-1]) if speculative else 0,
         "accepted": figures["accepted"],
         "theory": figures["expected_accepted_theory"] * rounds}
  if with_weights and served.any():
    out["weight"] = mean_committed_weight(stats, served)
  if "ess" in figures:
    out["ess"] = figures["ess"]
  if "hits" in figures:
    out["hits"] = figures["hits"]
  return out


def seconds_share(stats, seconds: float, prompt_rounds: int) -> float:
  """A prompt's share of a call's seconds: its row-rounds over all the active row-rounds,
  padding prompts' included (the call ran them), so their share stays out of the records."""
  return seconds * prompt_rounds / max(1, int(np.asarray(stats.active_rb, bool).sum()))


def run_setting(setting, fp: str, config, models, task, examples, prompts, store: ResultStore,
                log: Callable = print, after_batch: Callable | None = None) -> None:
  """Decodes the examples of `setting` not yet in `store`, one call at a time."""
  done = store.done(fp)
  decoder = models.decoder_for(setting)
  size = examples_per_call(config.decode)
  rows_at_once = config.decode.batch_size if size > config.decode.batch_size else None
  # Positions in the whole split: a call's seed and a record's index do not depend on
  # where the slice starts, so disjoint slices never reuse keys and an example decoded in
  # any slice aligned to the call size gets the same key.
  offset = config.task.offset
  batches = range(0, len(examples), size)
  for number, start in enumerate(batches, 1):
    rows = [i for i in range(start, min(start + size, len(examples)))
            if examples[i].id not in done]
    if not rows:
      continue
    batch = [prompts[i] for i in rows]
    batch += [batch[-1]] * (padded_call_size(len(batch), config.decode) - len(batch))
    out = decoder.generate(batch, setting.verify, num_draft=config.decode.num_draft,
                           max_new_tokens=config.decode.max_new_tokens,
                           seed=config.seed + offset + start, batch_size=rows_at_once)
    texts = [models.tokenizer.decode(out.token_ids[j], skip_special_tokens=True)
             for j in range(len(rows))]
    rewards = task.rewards(texts, [examples[i] for i in rows],
                           workers=config.eval.score_workers)
    weighted = setting.verify.method in WEIGHTED_METHODS
    records = []
    for j, i in enumerate(rows):
      figures = row_figures(out.stats, j, len(out.token_ids[j]), setting.family != "ar",
                            weighted)
      records.append({
          "fingerprint": fp, "setting": setting.name, "method": setting.family,
          "params": setting.params_dict, "example_id": examples[i].id, "index": offset + i,
          "completion": texts[j], "num_tokens": len(out.token_ids[j]),
          "seconds": seconds_share(out.stats, out.seconds, figures["rounds"]),
          "reward": float(rewards[j]), **figures})
    store.append(records)
    tokens = sum(r["num_tokens"] for r in records)
    seconds = sum(r["seconds"] for r in records)
    rate = sum(r["accepted"] for r in records) / max(
        1, sum(r["rounds"] * r["num_draft"] for r in records))
    log(f"  {setting.name}: batch {number}/{len(batches)} ({len(rows)} examples) "
        f"{tokens / max(seconds, 1e-9):.1f} tokens/s, acceptance {rate:.2f}, "
        f"reward {np.mean(rewards[:len(rows)]):.2f}"
        + (f", compiled in {out.compile_seconds:.1f}s" if out.compile_seconds else ""))
    if after_batch is not None:
      after_batch(setting, records)


def evaluate(config, workdir: str, models=None, log: Callable = print,
             after_batch: Callable | None = None, target=None) -> list[dict]:
  """Evaluates every setting of `config` on the task slice; returns the summary rows.

  models: a context.Models to reuse (the notebook), else loaded here (reusing `target`,
    a LoadedModel, when given).
  after_batch: called with (setting, records) after each batch is written (tests).
  """
  from diversed_jax.evaluation import report

  settings = settings_for(config, log)
  task, examples = context_lib.load_slice(config.task)
  if not examples:
    raise ValueError(f"task.offset={config.task.offset}: the slice of {config.task.name} "
                     "is empty")
  if models is None:
    models = context_lib.load_models(config, settings, workdir, target=target, log=log)
  prompts = context_lib.encode_prompts(config, task, examples, models.tokenizer)
  store = ResultStore(os.path.join(workdir, config.eval.results_file))
  log(f"evaluating {len(settings)} settings on {len(examples)} {task.name} examples "
      f"(temperature {config.decode.temperature}, K={config.decode.num_draft}, "
      f"max_new_tokens={config.decode.max_new_tokens}) -> {store.path}")
  slice_ids = {e.id for e in examples}
  per_setting = []
  for number, setting in enumerate(settings, 1):
    fp = setting_fingerprint(config, setting, models)
    log(f"[{number}/{len(settings)}] {setting.name}")
    if setting.family == "diversed" and models.info.get("head") == build.FIXED_HEAD:
      log("WARNING: " + build.fixed_weight_warning(
          models.info["target"], models.info.get("draft"), config.head.task or task.name))
    start = time.perf_counter()
    run_setting(setting, fp, config, models, task, examples, prompts, store, log, after_batch)
    records = [r for r in store.records(fp) if r["example_id"] in slice_ids]
    extra = {"head": models.info.get("head")} if setting.family == "diversed" else {}
    per_setting.append((setting, records, extra))
    log(f"  done in {time.perf_counter() - start:.1f}s")
  dataset = f"{task.name}:{config.task.source or 'shipped'}:{config.task.split}"
  return report.summarize(per_setting, dataset, task.metric)
