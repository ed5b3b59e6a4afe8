"""Fitting a draft's context-copy gate (`diversed_jax.speculative.context_copy`).

For every generated position of the target's own T = 1 continuations of train prompts
(the kept ids of the distillation plan: nothing is generated), the acceptance
sum_x min(p, q') of the blended law q' = (1 - lam) q + lam [x == c] is computed for a grid
of lam; each gate cell (match length n, bin of the draft's q(c)) takes the lam with the
highest mean over its positions, each task weighted equally. q is the draft's first
drafting step (it reads the target's features), teacher forced.

  python -m diversed_jax.distill --config=configs/distill_smollm2.py --config.mode=fit_copy_gate \
      --config.train.init_from=FOLDER --config.export_dir=OUT   # OUT may be FOLDER
"""

from __future__ import annotations

import functools
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np

from diversed_jax.models import transformer
from diversed_jax.speculative import context_copy

GATE_FILE = "copy_gate.json"
_WIDTH_STEP = 64  # sequences are padded to a multiple of this (few distinct shapes)


@functools.partial(jax.jit, static_argnames=("target_config", "draft", "span", "max_ngram"))
def _position_curves(target_params, draft_params, tokens_1w, start, lams_g, *, target_config,
                     draft, span: int, max_ngram: int):
  """For positions start .. start + span - 1 (each predicting the next token): the
  acceptance of the blend at every lam of `lams_g` [span, G], the match length n and the
  draft's q(c)."""
  w = tokens_1w.shape[1]
  hidden, _ = transformer.forward_hidden(target_params, target_config, tokens_1w)
  features = jnp.pad(hidden[:, :-1], ((0, 0), (1, 0), (0, 0)))  # f_{t-1} at t
  logits, _, _ = draft.forward(draft_params, tokens_1w, draft.init_cache(draft_params, 1, w),
                               features)
  take = lambda x: jax.lax.dynamic_slice_in_dim(x, start, span, axis=1)
  p = jax.nn.softmax(transformer.logits_from_hidden(target_params, target_config,
                                                    take(hidden)).astype(jnp.float32), -1)
  q = jax.nn.softmax(take(logits).astype(jnp.float32), -1)
  positions = start + jnp.arange(span)[None]
  copy_token, length = context_copy.suffix_lookup(tokens_1w, positions, max_ngram)
  is_copy = jnp.arange(q.shape[-1]) == copy_token[..., None]

  def acceptance(lam):
    return jnp.sum(jnp.minimum(p, (1 - lam) * q + lam * is_copy), axis=-1)[0]

  curves = jax.lax.map(acceptance, lams_g).T  # [span, G]
  q_copy = jnp.take_along_axis(q, copy_token[..., None], axis=-1)[0, :, 0]
  return curves, length[0], q_copy


def position_curves(target, draft, draft_params, records, lams, max_ngram: int, log=print):
  """Per task: (curves [P, G], match lengths [P], q(c) [P]) over the generated positions of
  `records` ((source, temperature, prompts, continuations), see `data.kept_records`)."""
  out = {}
  span = max(len(c) for _, _, _, conts in records for c in conts)
  for source, _, prompts, conts in records:
    for prompt, cont in zip(prompts, conts):
      seq = list(prompt) + list(cont)
      width = -(-(len(prompt) + span) // _WIDTH_STEP) * _WIDTH_STEP
      tokens = np.zeros((1, width), np.int32)
      tokens[0, :len(seq)] = seq
      curves, length, q_copy = _position_curves(
          target.params, draft_params, jnp.asarray(tokens), len(prompt) - 1,
          jnp.asarray(lams, jnp.float32), target_config=target.config, draft=draft,
          span=span, max_ngram=max_ngram)
      n = len(cont)  # positions past the continuation are padding
      parts = out.setdefault(source, ([], [], []))
      for part, value in zip(parts, (curves, length, q_copy)):
        part.append(np.asarray(value)[:n])
    log(f"copy gate: {source} shard of {len(prompts)} prompts read")
  return {task: tuple(np.concatenate(p) for p in parts) for task, parts in out.items()}


def fit(curves_by_task: dict, lams, max_ngram: int, q_edges) -> tuple[context_copy.CopyGate,
                                                                       dict]:
  """The gate maximising the task-balanced mean acceptance, and a report of each task's
  mean acceptance without copying (lam = 0) and with the fitted gate."""
  lams = np.asarray(lams)
  if lams[0] != 0:
    raise ValueError(f"the lam grid must start at 0 (no copying), got {lams[0]}")
  bins = len(q_edges) + 1
  totals = np.zeros((max_ngram + 1, bins, len(lams)))
  cells = {}
  for task, (curves, length, q_copy) in curves_by_task.items():
    b = np.searchsorted(np.asarray(q_edges), q_copy, side="right")
    cells[task] = (length, b)
    np.add.at(totals, (length, b), curves / len(curves))
  best = totals.argmax(-1)
  best[0] = 0  # no match: no copying
  table = lams[best]
  gate = context_copy.CopyGate(tuple(float(e) for e in q_edges),
                               tuple(tuple(float(x) for x in row) for row in table))
  report = {}
  for task, (curves, length, q_copy) in curves_by_task.items():
    chosen = best[cells[task]]
    report[task] = {"positions": int(len(curves)),
                    "accept_without": float(curves[:, 0].mean()),
                    "accept_with": float(np.take_along_axis(curves, chosen[:, None], 1).mean()),
                    "matched": float((length > 0).mean())}
  return gate, report


def save_gate(folder: str, gate: context_copy.CopyGate, report: dict | None = None) -> None:
  with open(os.path.join(folder, GATE_FILE), "w") as f:
    json.dump({**gate.to_json(), "fit": report or {}}, f, indent=1)


def read_gate(folder: str) -> context_copy.CopyGate | None:
  """The folder's gate, or None when it has none."""
  path = os.path.join(folder, GATE_FILE)
  if not os.path.isfile(path):
    return None
  with open(path) as f:
    return context_copy.CopyGate.from_json(json.load(f))


def run(config, target, log=print, tokenizer=None) -> dict:
  """mode=fit_copy_gate: fits the gate of draft folder `train.init_from` on the kept ids of
  shards `copy.shards` and writes the folder, with the gate, to `export_dir`."""
  from diversed_jax.distill import artifacts, data
  from diversed_jax.tokenizer import load_tokenizer
  cc = config.copy
  source_folder, out = config.train.init_from, config.export_dir
  draft, draft_params = artifacts.load_draft_folder(source_folder, target, copy=False)
  tokenizer = tokenizer or load_tokenizer(config.data.tokenizer or target.name)
  records = data.kept_records(config.data, tokenizer, tuple(cc.shards))
  lams = np.round(np.arange(0.0, cc.max_lam + 1e-9, cc.lam_step), 6)
  curves = position_curves(target, draft, draft_params, records, lams, cc.max_ngram, log)
  gate, report = fit(curves, lams, cc.max_ngram, tuple(cc.q_edges))
  log(f"copy gate: {json.dumps(report)}")
  log(f"copy gate lambdas (rows n = 0..{cc.max_ngram}, columns q(c) bins at edges "
      f"{tuple(cc.q_edges)}): {gate.lambdas}")
  if os.path.realpath(out) != os.path.realpath(source_folder):
    shutil.copytree(source_folder, out, dirs_exist_ok=True)
  save_gate(out, gate, {"shards": list(cc.shards), **report})
  log(f"wrote {os.path.join(out, GATE_FILE)}")
  return report
