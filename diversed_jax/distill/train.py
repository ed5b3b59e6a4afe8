"""The distillation training loop (DistillSpec-style) with resumable orbax checkpoints.

State = trainable draft params, AdamW state, step, RNG key and the number n of training
shards in use (the data position: windows of step s are a pure function of (seed, s, n));
`<workdir>/shards_in_use.txt` records which shards, so a resumed run uses the same ones.
A checkpoint is written every `checkpoint_every` steps; a run killed at any point (even
kill -9) resumes from the latest complete one. `<workdir>/settings.json` keeps what the run
trains under: a resume under other settings (bar RESUMABLE_CHANGES) is refused. The
held-out evaluation keeps the best draft as an asset folder in `<workdir>/best` (see
artifacts.py); `mode=export` copies it out.
`mode=shrink_vocab` writes a trained draft (`train.init_from`) with a smaller kept vocabulary
and no training: the `draft.vocab_keep` of its ids with the most target mass on the training
shards, a cheaper output head for nearly the same acceptance. `mode=fit_copy_gate` adds a
context-copy gate to a trained draft (copy_gate.py).
"""

from __future__ import annotations

import functools
import json
import os
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import orbax.checkpoint as ocp

from diversed_jax import atomic_files
from diversed_jax import run_settings as run_settings_lib
from diversed_jax.distill import architectures, artifacts, batches, copy_gate, data, losses
from diversed_jax.parallel import mesh as mesh_lib

MODES = ("data", "train", "export", "shrink_vocab", "fit_copy_gate")
# Held-out metrics that may pick the exported best draft (train.select_by): the first
# drafting step's acceptance at T = 1, or its greedy agreement.
SELECT_BY = ("accept1", "top11")
# `train` fields a resumed run may change: its length, bookkeeping, the device layout and
# the metric that picks the exported best draft. Any other change (the target, the draft,
# data.dir, the loss, lr, seed...) is refused; fine-tune with train.init_from instead.
RESUMABLE_CHANGES = ("steps", "checkpoint_every", "keep_checkpoints", "log_every",
                     "eval_every", "mesh_data", "min_shards", "rescan_every", "select_by")


def validate(config: ml_collections.ConfigDict) -> None:
  """Raises ValueError naming the first bad field; in mode train also when train.batch
  does not divide over train.mesh_data's devices, and when the checkpoints in
  config.workdir were trained under other settings (`check_resume_settings`)."""
  for field, ok, *why in _checks(config):
    if not ok():  # lazy: a later check may divide by a field an earlier one rejects
      section, _, name = field.rpartition(".")
      value = (config[section] if section else config)[name]
      raise ValueError(f"config.{field}={value!r} is invalid" + "".join(f": {w}" for w in why))
  if config.mode == "train":
    step_mesh(config.train)  # the windows divide over the devices
    check_resume_settings(config)
  # Last, the paths: a typo would fail only after the target loads.
  from diversed_jax.evaluation.validate import check_model
  check_model("config.target", config.target)
  init_from = config.train.init_from
  if init_from and not os.path.isfile(os.path.join(init_from, "draft.json")):
    raise ValueError(f"config.train.init_from={init_from!r} is invalid: not a draft folder "
                     "(no draft.json)")


def _checks(config) -> list[tuple]:
  """(field, () -> bool, optional reason) per check, in the order they are made."""
  c, d, t, cp = config, config.data, config.train, config.copy
  return [
      ("mode", lambda: c.mode in MODES),
      ("data.continuation", lambda: d.continuation in ("reference", "target")),
      ("data.continuations_dir", lambda: c.mode == "fit_copy_gate"
       or not d.continuations_dir or d.continuation == "target",
       "kept ids need data.continuation='target'"),
      ("data.continuations_only",
       lambda: not d.continuations_only or bool(d.continuations_dir),
       "ids-only runs need data.continuations_dir"),
      ("data.cnndm_windows", lambda: len(d.cnndm_windows) > 0
       and all(w >= 0 for w in d.cnndm_windows)),
      ("data.cnndm_windows", lambda: tuple(d.cnndm_windows) == (0,)
       or d.continuation == "target" or c.mode == "fit_copy_gate",
       "windows past an article's start need data.continuation='target' (the reference "
       "summary is the whole article's)"),
      ("data.temperatures", lambda: len(d.temperatures) > 0
       and all(x >= 0 for x in d.temperatures), "one or more temperatures >= 0"),
      ("draft.kind", lambda: config.draft.kind in architectures.KINDS),
      ("train.loss", lambda: t.loss in losses.LOSSES),
      ("train.unroll", lambda: t.unroll >= 1),
      ("train.argmax_weight", lambda: t.argmax_weight >= 0),
      ("train.select_by", lambda: t.select_by in SELECT_BY, f"one of {SELECT_BY}"),
      ("train.batch", lambda: t.batch >= 1),
      ("train.mesh_data", lambda: t.mesh_data == -1 or t.mesh_data >= 1,
       "-1 (all devices) or a positive integer"),
      ("train.window", lambda: t.window >= 2),
      ("draft.vocab_keep", lambda: config.draft.vocab_keep >= 3),
      ("draft.num_layers", lambda: config.draft.num_layers >= 1),
      ("train.checkpoint_every", lambda: t.checkpoint_every >= 1),
      ("train.rescan_every", lambda: t.rescan_every >= 1),
      ("train.log_every", lambda: t.log_every >= 1),
      ("train.grow_layers", lambda: t.grow_layers >= 0),
      ("train.grow_layers", lambda: t.grow_layers == 0 or bool(t.init_from)),
      ("train.init_from", lambda: c.mode not in ("shrink_vocab", "fit_copy_gate")
       or bool(t.init_from), f"{c.mode} needs the draft folder to start from"),
      ("export_dir", lambda: c.mode not in ("export", "shrink_vocab", "fit_copy_gate")
       or bool(c.export_dir), "give the folder to write the draft to"),
      ("data.continuations_dir", lambda: c.mode != "fit_copy_gate"
       or bool(d.continuations_dir), "the gate is fitted on kept continuations"),
      ("copy.max_ngram", lambda: cp.max_ngram >= 1),
      ("copy.unroll", lambda: cp.unroll >= 1),
      ("copy.lam_step", lambda: cp.lam_step > 0),
      ("copy.max_lam", lambda: 0 < cp.max_lam < 1),
      ("copy.lam_step", lambda: cp.lam_step <= cp.max_lam, "at most copy.max_lam"),
      ("copy.max_lam", lambda: abs(round(cp.max_lam / cp.lam_step) * cp.lam_step
                                   - cp.max_lam) < 1e-9,
       "must be a multiple of copy.lam_step (the grid's last point)"),
      ("copy.l2", lambda: cp.l2 >= 0),
      ("copy.fit_steps", lambda: cp.fit_steps >= 1),
      ("copy.learning_rate", lambda: cp.learning_rate > 0),
      ("copy.shards", lambda: c.mode != "fit_copy_gate" or len(cp.shards) > 0),
  ]


def _log_fn(workdir: str):
  os.makedirs(workdir, exist_ok=True)
  path = os.path.join(workdir, "log.txt")

  def log(msg: str):
    line = f"{time.strftime('%H:%M:%S')} {msg}"
    print(line, flush=True)
    with open(path, "a") as f:
      f.write(line + "\n")
  return log


@functools.partial(jax.jit, static_argnames=("draft", "hp"))
def _metrics_and_loss(train_params, frozen, batch, *, draft, hp):
  """(loss, metrics) of one batch; hp = (loss name, feature weight, unroll, argmax weight)."""
  loss_name, feature_weight, unroll, argmax_weight = hp
  params = {"train": train_params, "frozen": frozen}
  logits, hidden = draft.train_forward(params, batch["tokens_bw"], batch["features_bwd"],
                                       unroll=unroll)
  terms = losses.distill_terms(logits, batch["topk_kept_bwk"], batch["topk_logp_bwk"])
  mask = batch["weight_bw"][None]
  main = terms["ce"] if loss_name == "kl" else terms["tv"]
  mask_jbw = jnp.broadcast_to(mask, main.shape)  # every loss term is [J, B, W]
  loss = losses.masked_mean(main, mask_jbw)
  metrics = {}
  if argmax_weight > 0:  # greedy rounds accept the target's argmax only
    loss = loss + argmax_weight * losses.masked_mean(terms["argmax_ce"], mask_jbw)
  if draft.kind == "feature" and feature_weight > 0:
    feat = losses.feature_loss(hidden, batch["target_features_bwd"])
    feat = losses.masked_mean(feat, mask_jbw)
    loss = loss + feature_weight * feat
    metrics["feature"] = feat
  # Generated positions only, whatever prompt_weight: the draft proposes after the prompt.
  gen_mask = batch["generated_bw"].astype(jnp.float32)
  for name in ("accept", "top1"):
    for j in range(logits.shape[0]):
      metrics[f"{name}{j + 1}"] = losses.masked_mean(terms[name][j], gen_mask)
  metrics["loss"] = loss
  return loss, metrics


def _training_pool(config) -> batches.ShardPool:
  """The training shards of `data.dir` (and `data.extra_train_dirs`), held-out ones excluded."""
  return batches.ShardPool(config.data.dir, tuple(config.train.eval_shards),
                           tuple(config.data.extra_train_dirs))


def _hyperparams(tc) -> tuple:
  """The static `hp` of `_metrics_and_loss`: (loss name, feature weight, unroll, argmax
  weight)."""
  return (tc.loss, float(tc.feature_weight), int(tc.unroll), float(tc.argmax_weight))


def _optimizer(tc) -> optax.GradientTransformation:
  schedule = optax.warmup_cosine_decay_schedule(
      0.0, tc.lr, tc.warmup, max(tc.decay_steps, tc.warmup + 1), end_value=0.1 * tc.lr)
  return optax.chain(optax.clip_by_global_norm(tc.clip),
                     optax.adamw(schedule, weight_decay=tc.weight_decay))


@functools.partial(jax.jit, static_argnames=("draft", "hp", "tx"), donate_argnums=(0, 1))
def _train_step(train_params, opt_state, frozen, batch, *, draft, hp, tx):
  (_, metrics), grads = jax.value_and_grad(_metrics_and_loss, has_aux=True)(
      train_params, frozen, batch, draft=draft, hp=hp)
  updates, opt_state = tx.update(grads, opt_state, train_params)
  return optax.apply_updates(train_params, updates), opt_state, metrics


def held_out_batches(config, kept_index) -> dict:
  """Fixed held-out windows per held-out shard, named by its source in the data plan and
  its index (e.g. 'cnndm1')."""
  out = {}
  plan = data.data_plan(config.data)
  for index in config.train.eval_shards:
    path = data.shard_path(config.data.dir, index)
    if not os.path.exists(path):
      continue
    seqs = batches.load_sequences(path)
    rng = np.random.default_rng([12345, index])
    # Past a source's end the plan goes on with the others: the pattern no longer says.
    source = plan[index][0] if index < len(plan) else "shard"
    out[f"{source}{index}"] = batches.window_batch(seqs, rng, 16, config.train.window,
                                                   kept_index, config.train.prompt_weight)
  return out


def evaluate(config, draft, train_params, frozen, kept_index, hp) -> dict:
  """Held-out metrics per held-out shard and their 'score': the mean over the shards of
  train.select_by (one-step acceptance by default), which picks the exported best."""
  results = {}
  for name, batch in held_out_batches(config, kept_index).items():
    _, metrics = _metrics_and_loss(train_params, frozen, batch, draft=draft, hp=hp)
    results[name] = {k: round(float(v), 4) for k, v in metrics.items()}
  if results:
    metric = config.train.select_by
    results["score"] = float(np.mean([r[metric] for r in results.values()]))
  return results


def _draft_from_config(config, target_config) -> architectures.DistilledDraft:
  dc = config.draft
  cfg = architectures.draft_config(dc.kind, target_config, dc.num_layers, dc.hidden_size,
                                   dc.num_heads, dc.num_kv_heads, dc.intermediate_size)
  return architectures.DistilledDraft(kind=dc.kind, config=cfg,
                                      target_hidden=target_config.hidden_size,
                                      vocab_size=target_config.vocab_size)


def run_settings(config) -> dict:
  """What a run trains under, as JSON values, kept in `<workdir>/settings.json`. More shard
  folders (data.extra_train_dirs) may join a run, as shards join its data.dir."""
  # Paths absolute: the same words from another directory name other files.
  where = lambda spec: os.path.abspath(spec) if spec and os.path.exists(spec) else spec
  train = {k: v for k, v in config.train.to_dict().items() if k not in RESUMABLE_CHANGES}
  train["init_from"] = where(train["init_from"])
  return run_settings_lib.as_json({
      "target": where(config.target), "draft": config.draft.to_dict(),
      "data": {"dir": os.path.abspath(config.data.dir)}, "train": train})


def _settings_path(config) -> str:
  return os.path.join(os.path.abspath(config.workdir), "settings.json")


def check_resume_settings(config) -> None:
  """ValueError naming each setting that differs from those the checkpoints in
  config.workdir were trained with; nothing to resume (or a run from before settings were
  kept) is not checked."""
  path = _settings_path(config)
  checkpoints = os.path.join(os.path.abspath(config.workdir), "checkpoints")
  if not (os.path.exists(path) and os.path.isdir(checkpoints)
          and ocp.utils.checkpoint_steps(checkpoints)):
    return
  with open(path) as f:
    changes = run_settings_lib.changes(json.load(f), run_settings(config))
  if changes:
    best = os.path.join(os.path.abspath(config.workdir), "best")
    raise ValueError(f"the checkpoints in {checkpoints} were trained with "
                     f"{', '.join(changes)}: resume with those settings, or fine-tune from "
                     f"the run's best draft (train.init_from={best}) into another workdir")


def step_mesh(tc):
  """The mesh a step's windows are split over (None: one device); ValueError naming the
  field when they do not divide over it."""
  return mesh_lib.data_mesh(tc.mesh_data, tc.batch, field="config.train.mesh_data",
                            rows_field="config.train.batch")


class Trainer:
  """Builds or restores the training state and runs steps; usable from tests.

  Several devices (train.mesh_data): each step's windows are split over a 'data' mesh and
  the state is replicated; jit all-reduces the loss and gradients (one process)."""

  def __init__(self, config, target, log=print):
    validate(config)
    self.config, self.target, self.log = config, target, log
    tc = config.train
    mesh = step_mesh(tc)
    self.placement = mesh_lib.Placement(mesh)
    if mesh is not None:
      log(f"mesh: {tc.batch} windows a step split over data={self.placement.size} devices")
    self.workdir = os.path.abspath(config.workdir)
    os.makedirs(self.workdir, exist_ok=True)
    self.pool = _training_pool(config)
    self.tx = _optimizer(tc)
    self.hp = _hyperparams(tc)
    self.manager = ocp.CheckpointManager(
        os.path.join(self.workdir, "checkpoints"),
        options=ocp.CheckpointManagerOptions(max_to_keep=tc.keep_checkpoints, create=True))
    self._setup()

  # ---- state -------------------------------------------------------------------------
  @property
  def _in_use_path(self) -> str:
    return os.path.join(self.workdir, "shards_in_use.txt")

  def _use_shards(self, num_shards: int, first=()) -> None:
    """Puts `num_shards` training shards in use and records which ones (in the order they
    entered) before a checkpoint counts them: its count n then names the record's first n,
    which a resumed run uses even if the folders grew while it was stopped."""
    dropped = self.pool.num_dropped
    self.pool.use(num_shards, first)
    atomic_files.write_lines(self._in_use_path, self.pool.in_use)
    if self.pool.num_dropped != dropped:
      self.log(f"left out {self.pool.num_dropped} training sequences whose prompt is a "
               f"held-out shard's (of {self.config.data.dir}, shards "
               f"{tuple(self.config.train.eval_shards)})")

  def _recorded_shards(self, num_shards: int) -> list[str]:
    """The first `num_shards` recorded shards in use; [] for a checkpoint written before
    they were recorded (it resumes on the first shards in listing order)."""
    if not os.path.exists(self._in_use_path):
      return []
    with open(self._in_use_path) as f:
      paths = [line.rstrip("\n") for line in f if line.strip()]
    return paths[:num_shards] if len(paths) >= num_shards else []

  def _wait_for_shards(self, needed: int) -> int:
    """Blocks until `needed` shards exist: a data job may be writing them beside this run."""
    hint = (" (write them with the same config and --config.mode=data, which may run beside"
            " this one)")
    while True:
      n = self.pool.available()
      if n >= needed:
        return n
      self.log(f"waiting for {needed} training shards in {self.config.data.dir} (have {n})"
               + hint)
      hint = ""  # said once
      time.sleep(60)

  def _setup(self):
    tc = self.config.train
    vocab_path = os.path.join(self.workdir, "vocab_ids.npy")
    init_meta = None
    if tc.init_from:
      draft, init_train, init_vocab, init_meta = artifacts.read_draft(tc.init_from)
      draft, init_train = architectures.grow_layers(draft, init_train, tc.grow_layers)
    else:
      draft = _draft_from_config(self.config, self.target.config)
    self.draft = draft
    latest = self.manager.latest_step()
    # validate() has refused a resume under other settings than those recorded here.
    atomic_files.write_json(_settings_path(self.config), run_settings(self.config), indent=1,
                            sort_keys=True)
    if latest is None:
      num_shards = self._wait_for_shards(max(1, tc.min_shards))
    else:
      num_shards = None
    if latest is not None and os.path.exists(vocab_path):
      vocab_ids = np.load(vocab_path)
    elif init_meta is not None and not tc.reselect_vocab:
      vocab_ids = init_vocab
    else:
      self._use_shards(num_shards)
      vocab_ids, coverage = batches.choose_vocab(self.pool.sequences, self.config.draft.vocab_keep,
                                                 self.target.config.vocab_size, tc.prompt_weight)
      self.log(f"kept vocabulary {len(vocab_ids)} ids cover {coverage:.4f} of the target's "
               "top-k mass")
    np.save(vocab_path, vocab_ids)
    self.vocab_ids = vocab_ids
    self.kept_index = batches.kept_index(vocab_ids, self.target.config.vocab_size)
    self.frozen = self.placement.params(
        architectures.frozen_params(self.target.params, vocab_ids))
    key = jax.random.PRNGKey(tc.seed)
    if init_meta is not None:
      train_params = init_train
    else:
      train_params = architectures.init_train_params(draft, key, self.target.params)
    opt_state = self.tx.init(train_params)
    # Replicated before a restore, which then reads the checkpoint into the same placement.
    self.state = self.placement.params({
        "params": train_params, "opt_state": opt_state, "step": jnp.zeros((), jnp.int32),
        "rng": key, "num_shards": jnp.asarray(num_shards or 0, jnp.int32)})
    if latest is not None:
      self.state = self.manager.restore(latest, args=ocp.args.StandardRestore(self.state))
      self.log(f"resumed from step {latest}")
    num_shards = int(self.state["num_shards"])
    first = self._recorded_shards(num_shards) if latest is not None else ()
    self._use_shards(num_shards, first)
    artifacts.recover_swapped(self._best_dir)
    self.best = self._read_best()
    if latest is None and self.best > -1.0:  # a fresh run's best is its own
      self.log(f"{self._best_dir} holds a best draft of an earlier run in this workdir: "
               "this run's first evaluation replaces it")
      self.best = -1.0

  @property
  def _best_dir(self) -> str:
    return os.path.join(self.workdir, "best")

  def _read_best(self) -> float:
    path = os.path.join(self._best_dir, "draft.json")
    if not os.path.exists(path):
      return -1.0
    try:
      with open(path) as f:
        meta = json.load(f)
    except (OSError, ValueError) as e:  # e.g. torn by a kill before exports were atomic
      self.log(f"warning: ignoring the unreadable best draft {path} ({e}): the next "
               "evaluation replaces it")
      return -1.0
    if meta.get("recipe", {}).get("select_by", "accept1") != self.config.train.select_by:
      return -1.0  # chosen by another metric: the next evaluation replaces it
    return float(meta.get("eval", {}).get("score", -1.0))

  @property
  def step(self) -> int:
    return int(self.state["step"])

  def save(self) -> None:
    self.manager.save(self.step, args=ocp.args.StandardSave(self.state))
    self.manager.wait_until_finished()

  # ---- data --------------------------------------------------------------------------
  def batch_for_step(self, step: int) -> dict:
    tc = self.config.train
    rng = np.random.default_rng([tc.seed, step, int(self.state["num_shards"])])
    return batches.window_batch(self.pool.sequences, rng, tc.batch, tc.window,
                                self.kept_index, tc.prompt_weight)

  # ---- loop --------------------------------------------------------------------------
  def evaluate(self) -> dict:
    return evaluate(self.config, self.draft, self.state["params"], self.frozen, self.kept_index,
                    self.hp)

  def train(self, num_steps: int | None = None) -> list[float]:
    """Runs until train.steps (or num_steps more steps); returns the per-step losses."""
    tc = self.config.train
    end = tc.steps if num_steps is None else min(tc.steps, self.step + num_steps)
    history, window_metrics = [], []
    start_time, positions = time.time(), 0
    while self.step < end:
      step = self.step
      if step > 0 and step % tc.rescan_every == 0:
        n = self.pool.available()
        if n > int(self.state["num_shards"]):
          self._use_shards(n)
          self.state["num_shards"] = self.placement.params(jnp.asarray(n, jnp.int32))
          self.log(f"step {step}: now training on {n} shards, {len(self.pool.sequences)} "
                   "sequences")
      batch = self.batch_for_step(step)
      positions += int(batch["weight_bw"].astype(bool).sum())
      params, opt_state, metrics = _train_step(
          self.state["params"], self.state["opt_state"], self.frozen,
          self.placement.rows(batch), draft=self.draft, hp=self.hp, tx=self.tx)
      self.state.update(params=params, opt_state=opt_state, step=self.state["step"] + 1,
                        rng=jax.random.fold_in(self.state["rng"], step))
      window_metrics.append(metrics)
      history.append(metrics["loss"])
      if self.step % tc.log_every == 0 or self.step == end:
        mean = {k: float(np.mean([float(m[k]) for m in window_metrics]))
                for k in window_metrics[0]}
        rate = positions / max(time.time() - start_time, 1e-6)
        self.log(f"step {self.step} " + " ".join(f"{k}={v:.4f}" for k, v in sorted(mean.items()))
                 + f" positions/s={rate:.0f}")
        window_metrics, start_time, positions = [], time.time(), 0
      if self.step % tc.checkpoint_every == 0 or self.step == end:
        self.save()
      if tc.eval_every and self.step % tc.eval_every == 0:
        self.maybe_export_best()
    return [float(x) for x in history]

  def maybe_export_best(self) -> dict:
    results = self.evaluate()
    self.log(f"eval step {self.step}: {json.dumps(results)}")
    if results and results["score"] > self.best:
      self.best = results["score"]
      self.export(self._best_dir, {"step": self.step, **results})
    return results

  def export(self, folder: str, eval_results: dict | None = None) -> None:
    """Writes the draft as the folder `folder`, swapped in whole (a kill never leaves a
    mix of two drafts; other files there go)."""
    tc, dc = self.config.train, self.config.data
    # Where the draft came from, so a shipped folder says how to reproduce it.
    recipe = {"init_from": tc.init_from, "grow_layers": tc.grow_layers,
              "reselect_vocab": tc.reselect_vocab, "loss": tc.loss,
              "argmax_weight": tc.argmax_weight, "select_by": tc.select_by,
              "lr": tc.lr, "decay_steps": tc.decay_steps, "window": tc.window,
              "unroll": tc.unroll, "data_dirs": [dc.dir, *dc.extra_train_dirs]}
    artifacts.save_draft_swapped(folder, self.draft, self.state["params"], self.vocab_ids,
                                 self.target.name, extra={"eval": eval_results or {},
                                                          "step": self.step, "recipe": recipe})
    self.log(f"exported draft (step {self.step}) to {folder}")


def shrink_vocab(config: ml_collections.ConfigDict, target, log=print) -> dict:
  """mode=shrink_vocab: writes `train.init_from` with its `draft.vocab_keep` ids of most target
  mass on the training shards to `export_dir`; returns the held-out metrics there."""
  tc = config.train
  draft, train_params, ids, meta = artifacts.read_draft(tc.init_from)
  keep = config.draft.vocab_keep
  if keep > len(ids):
    raise ValueError(f"config.draft.vocab_keep={keep} is invalid: {tc.init_from} keeps "
                     f"{len(ids)} ids, and shrinking cannot add any")
  artifacts.check_export_dir(config.export_dir)
  pool = _training_pool(config)
  pool.use(pool.available())
  if not pool.sequences:
    raise ValueError(f"config.data.dir={config.data.dir!r} holds no training shards")
  # Only the draft's own ids: it was trained to spread its mass over their rows.
  kept, coverage = batches.choose_vocab(pool.sequences, keep, target.config.vocab_size,
                                        tc.prompt_weight, candidates=ids)
  log(f"{len(kept)} of {len(ids)} ids cover {coverage:.4f} of the target's top-k mass on "
      f"{pool.num_shards} training shards ({pool.num_dropped} sequences with a held-out "
      "prompt left out)")
  kept_index = batches.kept_index(kept, target.config.vocab_size)
  frozen = architectures.frozen_params(target.params, kept)
  results = evaluate(config, draft, train_params, frozen, kept_index, _hyperparams(tc))
  log(f"held-out: {json.dumps(results)}")
  # "loss" names the loss of the recorded held-out `loss` column, which may differ from the
  # parent's training loss.
  recipe = {"mode": "shrink_vocab", "init_from": tc.init_from, "vocab_keep": keep,
            "loss": tc.loss,
            "prompt_weight": tc.prompt_weight, "data_dirs": [config.data.dir,
                                                             *config.data.extra_train_dirs],
            "parent_recipe": meta.get("recipe")}
  artifacts.save_draft(config.export_dir, draft, train_params, kept, target.name,
                       extra={"eval": {"step": meta.get("step"), **results},
                              "step": meta.get("step"), "recipe": recipe})
  artifacts.remove_stale_files(config.export_dir, artifacts.SAVED_FILES, log)
  log(f"wrote the shrunk draft to {config.export_dir}")
  return results


def run(config: ml_collections.ConfigDict) -> None:
  """Entry point of `python -m diversed_jax.distill` (see configs/distill_smollm2.py)."""
  from diversed_jax.models.loading import load_model
  validate(config)
  log = _log_fn(config.workdir if config.mode != "data" else config.data.dir)
  if config.mode == "data":
    target = load_model(config.target)
    n = data.generate(config.data, target, config.data.dir, log=log)
    log(f"{n} shards in {config.data.dir}")
    return
  if config.mode == "export":
    src = artifacts.swapped_folder(os.path.join(config.workdir, "best"))
    artifacts.replace_draft_folder(src, config.export_dir, log=log)
    log(f"copied {src} to {config.export_dir}")
    return
  if config.mode == "shrink_vocab":
    shrink_vocab(config, load_model(config.target), log=log)
    return
  if config.mode == "fit_copy_gate":
    copy_gate.run(config, load_model(config.target), log=log)
    return
  trainer = Trainer(config, load_model(config.target), log=log)
  trainer.train()
  trainer.maybe_export_best()
