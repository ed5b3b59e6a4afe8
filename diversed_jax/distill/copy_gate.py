"""Fitting a draft's context-copy gate (`diversed_jax.speculative.context_copy`).

For every generated position of the target's own T = 1 continuations of train prompts
(the kept ids of the distillation plan: nothing is generated) and every drafting step
1 .. copy.unroll (step j > 1 reads the draft's own features, as in training's unroll),
the acceptance sum_x min(p, q') of the blended law q' = (1 - lam) q + lam [x == c] is
computed on a grid of lam, together with the gate's features there. The gate's logistic
probe is then fitted by gradient ascent on the mean acceptance, read off the grid by
linear interpolation, each task weighted equally (an L2 penalty keeps the hidden-state
weights small).

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
import optax

from diversed_jax import atomic_files
from diversed_jax.distill import architectures
from diversed_jax.models import transformer
from diversed_jax.speculative import context_copy

GATE_FILE = "copy_gate.json"
_WIDTH_STEP = 64  # sequences are padded to a multiple of this (few distinct shapes)


@functools.partial(jax.jit, static_argnames=("target_config", "draft", "span", "max_ngram",
                                             "steps"))
def _position_data(target_params, draft_params, tokens_1w, start, lams_g, *, target_config,
                   draft, span: int, max_ngram: int, steps: int):
  """For positions start .. start + span - 1 (each predicting the next token): the
  acceptance of the blend at every lam [span, steps, G], the gate's features
  [span, steps, F] and the match length [span]."""
  hidden, _ = transformer.forward_hidden(target_params, target_config, tokens_1w)
  features = jnp.pad(hidden[:, :-1], ((0, 0), (1, 0), (0, 0)))  # f_{t-1} at t
  logits_j, hidden_j = draft.train_forward(draft_params, tokens_1w, features, unroll=steps)
  take = lambda x: jax.lax.dynamic_slice_in_dim(x, start, span, axis=-2)
  p = jax.nn.softmax(transformer.logits_from_hidden(target_params, target_config,
                                                    take(hidden)).astype(jnp.float32), -1)
  lookup = context_copy.suffix_lookup(tokens_1w, start + jnp.arange(span)[None], max_ngram)
  is_copy = jnp.arange(p.shape[-1]) == lookup.token_bt[..., None]
  curves, gate_features = [], []
  for j in range(steps):
    pass_j = min(j, logits_j.shape[0] - 1)  # an independent draft has one pass for all steps
    full = architectures.to_full_vocab(take(logits_j[pass_j]),  # the blend needs every id
                                       draft_params["frozen"]["vocab_ids"], p.shape[-1])
    log_q = jax.nn.log_softmax(full, axis=-1)
    q = jnp.exp(log_q)
    gate_features.append(context_copy.gate_features(lookup, log_q, take(hidden_j[pass_j]),
                                                    proposing=j > 0, max_ngram=max_ngram)[0])
    acceptance = lambda lam: jnp.sum(jnp.minimum(p, (1 - lam) * q + lam * is_copy), -1)[0]
    curves.append(jax.lax.map(acceptance, lams_g).T)  # [span, G]
  return jnp.stack(curves, 1), jnp.stack(gate_features, 1), lookup.length_bt[0]


def position_data(target, draft, draft_params, records, lams, max_ngram: int, steps: int,
                  log=print):
  """Per task: (curves [P, steps, G], features [P, steps, F], match lengths [P]) over the
  generated positions of `records` ((source, temperature, prompts, continuations), see
  `data.kept_records`)."""
  out = {}
  span = max(len(c) for _, _, _, conts in records for c in conts)
  for source, _, prompts, conts in records:
    for prompt, cont in zip(prompts, conts):
      seq = list(prompt) + list(cont)
      width = -(-(len(prompt) + span) // _WIDTH_STEP) * _WIDTH_STEP
      tokens = np.zeros((1, width), np.int32)
      tokens[0, :len(seq)] = seq
      values = _position_data(
          target.params, draft_params, jnp.asarray(tokens), len(prompt) - 1,
          jnp.asarray(lams, jnp.float32), target_config=target.config, draft=draft,
          span=span, max_ngram=max_ngram, steps=steps)
      n = len(cont)  # positions past the continuation are padding
      parts = out.setdefault(source, ([], [], []))
      for part, value in zip(parts, values):
        part.append(np.asarray(value)[:n])
    log(f"copy gate: {source} shard of {len(prompts)} prompts read")
  return {task: tuple(np.concatenate(p) for p in parts) for task, parts in out.items()}


def _on_grid(curves, lam, lam_step):
  """curves [..., G] (lam = 0, lam_step, ...) read at lam [...] by linear interpolation."""
  x = lam / lam_step
  i = jnp.clip(jnp.floor(x).astype(jnp.int32), 0, curves.shape[-1] - 2)
  below = jnp.take_along_axis(curves, i[..., None], -1)[..., 0]
  above = jnp.take_along_axis(curves, i[..., None] + 1, -1)[..., 0]
  return below + (x - i) * (above - below)


def fit(data_by_task: dict, lams, max_ngram: int, max_lam: float, l2: float = 1e-5,
        steps: int = 2000, learning_rate: float = 3e-3,
        log=print) -> tuple[context_copy.CopyGate, dict]:
  """The gate maximising the task-balanced mean acceptance (Adam on the whole data), and a
  report of each task's mean acceptance without copying (lam = 0) and with the gate."""
  lams = np.asarray(lams, np.float64)
  lam_step = lams[1] - lams[0] if len(lams) > 1 else 0.0
  if len(lams) < 2 or lams[0] != 0 or not np.allclose(np.diff(lams), lam_step):
    raise ValueError(f"the lam grid must be 0, step, 2 step, ... (got {lams.tolist()})")
  if lams[-1] < max_lam - 1e-9:
    raise ValueError(f"the lam grid ends at {lams[-1]}, below max_lam {max_lam}")
  tasks = sorted(data_by_task)
  curves = jnp.asarray(np.concatenate([data_by_task[t][0] for t in tasks]))
  features = jnp.asarray(np.concatenate([data_by_task[t][1] for t in tasks]))
  matched = jnp.asarray(np.concatenate([data_by_task[t][2] for t in tasks]) > 0)
  # Each task's positions share weight 1 / len(tasks); steps are averaged.
  sizes = [len(data_by_task[t][0]) for t in tasks]
  weight = jnp.asarray(np.concatenate([np.full(n, 1 / (n * len(tasks))) for n in sizes]))

  def gate_lam(params):
    lam = max_lam * jax.nn.sigmoid(features @ params["weights"] + params["bias"])
    return jnp.where(matched[:, None], lam, 0.0)

  def loss(params):
    acceptance = _on_grid(curves, gate_lam(params), lam_step).mean(-1)
    return -jnp.sum(acceptance * weight) + l2 * jnp.sum(params["weights"] ** 2)

  optimizer = optax.adam(learning_rate)

  @jax.jit
  def update(params, opt_state):
    value, grads = jax.value_and_grad(loss)(params)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value

  # Start near "copy a little everywhere" (lam ~ 0.1 max_lam), weights at zero.
  params = {"weights": jnp.zeros(features.shape[-1]), "bias": jnp.asarray(-2.0)}
  opt_state = optimizer.init(params)
  for step in range(steps):
    params, opt_state, value = update(params, opt_state)
    if (step + 1) % max(steps // 4, 1) == 0:
      log(f"copy gate fit: step {step + 1}/{steps}, mean acceptance {-float(value):.4f}")
  gate = context_copy.CopyGate(max_ngram, tuple(float(w) for w in params["weights"]),
                               float(params["bias"]), float(max_lam))
  with_gate = np.asarray(_on_grid(curves, gate_lam(params), lam_step))
  report, offset = {}, 0
  for t in tasks:
    n = len(data_by_task[t][0])
    rows = slice(offset, offset + n)
    offset += n
    report[t] = {"positions": n,
                 "accept_without": float(np.asarray(curves[rows, :, 0]).mean()),
                 "accept_with": float(with_gate[rows].mean()),
                 "accept_with_by_step": [round(float(v), 4) for v in with_gate[rows].mean(0)],
                 "matched": float(np.asarray(matched[rows]).mean())}
  return gate, report


def save_gate(folder: str, gate: context_copy.CopyGate, report: dict | None = None) -> None:
  atomic_files.write_json(os.path.join(folder, GATE_FILE),
                          {**gate.to_json(), "fit": report or {}}, indent=1)


def read_gate(folder: str) -> context_copy.CopyGate | None:
  """The folder's gate, or None when it has none."""
  path = os.path.join(folder, GATE_FILE)
  if not os.path.isfile(path):
    return None
  with open(path) as f:
    data = json.load(f)
  if "lambdas" in data:  # session 29's per-cell table
    raise ValueError(f"{path} is an old table gate (lam per match length and q(c) bin); "
                     "refit it with --config.mode=fit_copy_gate, or load the folder as "
                     "nocopy:FOLDER")
  try:
    return context_copy.CopyGate.from_json(data)
  except (KeyError, TypeError, ValueError) as e:
    raise ValueError(f"{path} is not a valid copy gate: {e!r}") from e


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
  per_task = position_data(target, draft, draft_params, records, lams, cc.max_ngram,
                           cc.unroll, log)
  gate, report = fit(per_task, lams, cc.max_ngram, cc.max_lam, cc.l2, cc.fit_steps,
                     cc.learning_rate, log)
  log(f"copy gate: {json.dumps(report)}")
  if os.path.realpath(out) != os.path.realpath(source_folder):
    shutil.copytree(source_folder, out, dirs_exist_ok=True)
  save_gate(out, gate, {"shards": list(cc.shards), **report})
  log(f"wrote {os.path.join(out, GATE_FILE)}")
  return report
