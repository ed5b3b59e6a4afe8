"""The DIVERSED head-training loop (tunix-style: rollouts -> rewards -> advantages -> update).

Each step:
  1. take prompts_per_step prompts from a seeded, per-epoch shuffled stream (its position is
     checkpointed);
  2. sample G rollouts per prompt from nu with the speculative loop and the current head;
     the loop also records, per generated token, the head inputs h_q,t, h_p,t and
     p_t(x_t), q_t(x_t), TV(p_t, q_t) it sampled under (exact for every draft kind);
  3. rewards from the task, REINFORCE++ (or the configured) advantages per prompt group;
  4. ppo_epochs jitted optax updates of rl.losses.diversed_loss (clipped ratio when > 1).
Metrics go to `progress` (stdout by default), TensorBoard (workdir/tb) and
workdir/metrics.jsonl; orbax checkpoints go to workdir/checkpoints and a restart resumes from
the latest one with the same subsequent metrics (one under other settings, bar
RESUMABLE_CHANGES, is refused); the trained head is written to
workdir/head (see head_io).

Several devices (train.mesh_data): each step's rows are split over a 'data' mesh, the head
and both models replicated; rollouts and the updates run SPMD and
the loss and gradients are all-reduced by jit, so the run matches a one-device run. Several
processes (parallel/hosts.py): each runs the same steps; process 0 alone scores the
rollouts (its rewards are broadcast), keeps the checkpoints (its restored state is
broadcast) and writes the workdir.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import os
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from diversed_jax import atomic_files
from diversed_jax import run_settings as run_settings_lib
from diversed_jax.digest import folder_digest
from diversed_jax.parallel import hosts
from diversed_jax.parallel import mesh as mesh_lib
from diversed_jax.rl.head import EnsembleHead, init_head
from diversed_jax.rl.losses import get_advantage_fn, log_nu
from diversed_jax.rl.optim import make_optimizer, make_train_step
from diversed_jax.training import head_io
from diversed_jax.training.checkpoint import Checkpointer
from diversed_jax.training.config import HParams
from diversed_jax.training.rollouts import RolloutSampler, head_weight_fn, policy_batch

# Metrics that measure wall-clock time: the only ones that differ between identical runs.
TIMING_KEYS = ("tokens_per_s", "rollout_seconds", "step_seconds", "compile_seconds")
# PPO's ratio diagnostics (rl.losses): logged from the last epoch, see ppo_update.
PPO_RATIO_KEYS = ("ratio_mean", "ratio_max", "ratio_min", "clip_frac", "approx_kl")
# `train` fields a resumed run may change: bookkeeping and the device layout, not the head
# it trains. Any other change (seed, lam, total_steps' schedule, the prompts...) is refused.
RESUMABLE_CHANGES = ("checkpoint_every", "keep_checkpoints", "log_every", "mesh_data")


@dataclasses.dataclass(frozen=True)
class TokenTask:
  """The trainer's view of a task: prompt token ids and rewards of generated token ids."""
  name: str
  prompt_ids: Callable[[Any], list[int]]  # example -> prompt ids
  rewards: Callable[[Sequence[Sequence[int]], Sequence[Any]], list[float]]  # ids, examples


def text_task(task, tokenizer, chat: bool | None = None, shots: Sequence[Any] = ()) -> TokenTask:
  """A TokenTask from a diversed_jax.tasks Task (or its name): prompts through the model's
  chat template, completions decoded without special tokens and scored by the task."""
  from diversed_jax import tokenizer as tokenizer_lib
  from diversed_jax.tasks.registry import get_task
  if isinstance(task, str):
    task = get_task(task)
  if tokenizer is None:
    raise ValueError(f"task {task.name!r} scores text: pass a tokenizer")

  def prompt_ids(example):
    return tokenizer_lib.encode_prompt(
        tokenizer, task.prompt(example, shots, chat=chat is not False), chat=chat)

  def rewards(generated, examples):
    texts = [tokenizer.decode(list(g), skip_special_tokens=True) for g in generated]
    return [float(r) for r in task.rewards(texts, examples)]

  return TokenTask(task.name, prompt_ids, rewards)


def example_order(position: int, num_examples: int, seed: int) -> int:
  """Index of the example at stream `position`: a fresh seeded permutation per epoch."""
  epoch, offset = divmod(position, num_examples)
  return int(_permutation(num_examples, seed, epoch)[offset])


@functools.lru_cache(maxsize=4)
def _permutation(n: int, seed: int, epoch: int) -> np.ndarray:
  return np.random.default_rng([seed, epoch]).permutation(n)


def hidden_sizes(target_config, draft, draft_params) -> tuple[int, int]:
  """(Dq, Dp), the head's input sizes: the draft's last hidden size (from an abstract
  forward) and the target's."""
  tokens = jnp.zeros((1, 2), jnp.int32)
  features = jnp.zeros((1, 2, target_config.hidden_size), jnp.float32)
  _, hidden, _ = jax.eval_shape(
      lambda p: draft.forward(p, tokens, draft.init_cache(p, 1, 2), features), draft_params)
  return int(hidden.shape[-1]), target_config.hidden_size


def _last_logged(workdir: str) -> dict:
  path = os.path.join(workdir, "metrics.jsonl")
  if not os.path.isfile(path):
    return {}
  with open(path) as f:
    lines = [line for line in f if line.strip()]
  return json.loads(lines[-1]) if lines else {}


def _scalar(x) -> float:
  return float(np.asarray(x))


def run_settings(train_cfg, *, task: str, target: str, draft_spec: str,
                 prompts: Sequence[Sequence[int]]) -> dict:
  """What a run trains under, as JSON values: kept with each checkpoint, so that a resumed
  run with other settings is refused instead of mixing two runs in one head."""
  from diversed_jax.training.artifacts import portable_draft_spec
  train = {k: v for k, v in train_cfg.to_dict().items() if k not in RESUMABLE_CHANGES}
  prompts_digest = hashlib.sha1(json.dumps([list(map(int, p)) for p in prompts]).encode())
  return run_settings_lib.as_json({
      "train": train, "task": task, "target": target,
      "draft": portable_draft_spec(draft_spec), "draft_digest": folder_digest(draft_spec),
      "prompts_digest": prompts_digest.hexdigest()[:12]})


def _resume(ckpt: Checkpointer | None, state, settings: dict) -> tuple[Any, int, int]:
  """(state, step, data position) of the latest checkpoint, else (`state`, 0, 0). Process 0
  keeps the checkpoints (`ckpt` None elsewhere); every process continues from its state.
  Raises ValueError, on every process, if the checkpoint was trained under other
  `settings` (checkpoints written before settings were kept are not checked)."""
  counters = np.zeros((2,), np.int64)
  refusal = ""
  latest = ckpt.latest_step() if ckpt else None
  if latest is not None:
    state, meta = ckpt.restore(latest, state)
    counters = np.asarray([meta["step"], meta["data_pos"]], np.int64)
    changes = run_settings_lib.changes(meta.get("settings", {}), settings)
    if changes:
      refusal = (f"the checkpoint of step {latest} in {ckpt.directory} was trained with "
                 f"{', '.join(changes)}: resume with those settings, or train into "
                 "another workdir")
  refusal = hosts.broadcast_bytes(refusal.encode()).decode()
  if refusal:
    raise ValueError(refusal)
  state, counters = hosts.broadcast((state, counters))
  return state, int(counters[0]), int(counters[1])


def _step_record(metrics, rewards_b: np.ndarray, roll, seconds: float) -> dict[str, float]:
  """One logged step: the update's metrics, the rollouts' rewards and decoding figures."""
  s = roll.summary
  return {**{k: _scalar(v) for k, v in hosts.fetch(metrics).items()},
          "reward": float(rewards_b.mean()), "reward_std": float(rewards_b.std()),
          "acceptance_rate": float(s["acceptance_rate"]),
          "tokens_per_round": float(s["tokens_per_round"]),
          "w_mean_committed": float(s["w_mean_committed"]),
          "gen_tokens": float(roll.num_tokens), "tokens_per_s": float(s["tokens_per_s"]),
          "rollout_seconds": float(s["seconds"]),
          "compile_seconds": float(s["compile_seconds"]), "step_seconds": seconds}


def ppo_update(train_step, params, opt_state, batch, epochs: int):
  """`epochs` train_step updates on one batch -> (params, opt_state, metrics).

  metrics: the first epoch's (the loss of the head that sampled the rollouts), except the
  ratio diagnostics, taken from the last epoch as last_epoch_<name>: the first epoch's head
  is the one that computed old_logp_bt, so its ratio is always 1 and its KL 0.
  """
  first = last = None
  for _ in range(epochs):
    params, opt_state, last = train_step(params, opt_state, batch)
    first = last if first is None else first
  metrics = {k: v for k, v in first.items() if k not in PPO_RATIO_KEYS}
  metrics.update({f"last_epoch_{k}": last[k] for k in PPO_RATIO_KEYS if k in last})
  return params, opt_state, metrics


def drop_logged_after(path: str, step: int) -> None:
  """Rewrites the JSON-lines log `path` without the lines past `step` (and any torn line):
  a resumed run logs again the steps its killed predecessor took after the checkpoint."""
  if not os.path.isfile(path):
    return
  with open(path) as f:
    lines = [line for line in f if line.strip()]
  kept = [line for line in lines if _logged_step(line) <= step]
  if len(kept) == len(lines):
    return
  atomic_files.write_lines(path, kept)


def _logged_step(line: str) -> float:
  """The step of a metrics.jsonl line; inf for a line a kill tore."""
  try:
    return json.loads(line)["step"]
  except (ValueError, KeyError, TypeError):
    return math.inf


class _Logger:
  """stdout progress, TensorBoard scalars and a JSON-lines file, once per log interval;
  `files=False` (a multi-host job's other processes): progress only. Both files continue
  from `step`, the restored one: what a killed run logged after it is dropped."""

  def __init__(self, workdir: str, progress: Callable[[str], Any] | None, files: bool = True,
               step: int = 0):
    self.writer = self.jsonl = None
    if files:
      from tensorboardX import SummaryWriter
      self.writer = SummaryWriter(os.path.join(workdir, "tb"), purge_step=step + 1)
      path = os.path.join(workdir, "metrics.jsonl")
      drop_logged_after(path, step)
      self.jsonl = open(path, "a")
    self.progress = progress or (lambda line: None)

  def log(self, step: int, total: int, m: dict) -> None:
    if self.writer is not None:
      for k, v in m.items():
        self.writer.add_scalar(f"train/{k}", v, step)
      self.writer.flush()
      self.jsonl.write(json.dumps({"step": step, **m}) + "\n")
      self.jsonl.flush()
    self.progress(
        f"step {step}/{total} reward {m['reward']:.4f} acc {m['acceptance_rate']:.3f} "
        f"tok/round {m['tokens_per_round']:.2f} proxy {m['acceptance_proxy']:.4f} "
        f"w {m['w_mean']:.4f} loss {m['loss']:.4f} (pg {m['policy_loss']:.4f} "
        f"reg {m['regulariser']:.3f}) tok/s {m['tokens_per_s']:.1f}")

  def close(self) -> None:
    if self.writer is not None:
      self.writer.close()
      self.jsonl.close()


def train_head(train_cfg, *, target, draft, draft_params, task, examples: Sequence[Any],
               workdir: str, tokenizer=None, draft_spec: str = "",
               eos_token_ids: Sequence[int] | None = None,
               progress: Callable[[str], Any] | None = print) -> str:
  """Trains a DIVERSED ensemble head; returns the head folder (workdir/head).

  train_cfg: the `train` ConfigDict (config.default_config()).
  target: anything with .config (ModelConfig) and .params (a LoadedModel or ModelHandle);
    its .name, if any, is recorded in head.json.
  draft, draft_params: a draft object (speculative/drafts.py interface) and its params.
  task: a TokenTask, or a diversed_jax.tasks Task / task name (then `tokenizer` is needed).
  examples: the training examples, in the task's format.
  workdir: checkpoints/, tb/, metrics.jsonl and head/ go here; an existing checkpoint is
    resumed from.
  draft_spec: recorded in head.json (the key of the shipped-default registration).
  eos_token_ids: rollout stop tokens (default: the target config's).
  progress: called with one line per log interval (None: silent).
  """
  hp = HParams.from_config(train_cfg)
  mesh = hp.mesh()
  placement = mesh_lib.Placement(mesh)
  writer = hosts.is_writer()
  if not isinstance(task, TokenTask):
    task = text_task(task, tokenizer)
  if writer:
    os.makedirs(workdir, exist_ok=True)
  target_config, target_params = target.config, target.params
  if mesh is not None and progress:
    progress(f"mesh: {hp.batch_rows} rows a step split over data={placement.size} devices "
             f"({jax.process_count()} process{'es' if jax.process_count() > 1 else ''})")

  prompts = [task.prompt_ids(e) for e in examples]
  usable = [i for i, p in enumerate(prompts) if 2 <= len(p) <= hp.max_prompt_tokens]
  if not usable:
    raise ValueError(f"no example has a prompt of 2..{hp.max_prompt_tokens} tokens "
                     f"(train.max_prompt_tokens)")

  module = EnsembleHead(kind=hp.head_kind, hidden_dim=hp.head_hidden_dim,
                        init_weight=hp.init_weight, layer_norm=hp.head_layer_norm)
  dq, dp = hidden_sizes(target_config, draft, draft_params)
  key, init_key = jax.random.split(jax.random.PRNGKey(hp.seed))
  params = init_head(module, init_key, dq, dp)
  # optax counts updates, and each rollout step makes ppo_epochs of them: a schedule in
  # rollout steps would reach 0 after total_steps / ppo_epochs of them.
  optimizer = make_optimizer(hp.learning_rate, hp.warmup_steps * hp.ppo_epochs,
                             hp.total_steps * hp.ppo_epochs, hp.weight_decay, hp.grad_clip)
  state = jax.device_get({"params": params, "opt_state": optimizer.init(params), "key": key})
  ckpt = (Checkpointer(os.path.join(workdir, "checkpoints"), hp.keep_checkpoints)
          if writer else None)
  settings = run_settings(train_cfg, task=task.name, target=getattr(target, "name", ""),
                          draft_spec=draft_spec, prompts=[prompts[i] for i in usable])
  state, step, data_pos = _resume(ckpt, state, settings)
  if step and progress and writer:
    progress(f"resumed from {workdir}/checkpoints at step {step} (data position {data_pos})")
  params, opt_state = placement.params((state["params"], state["opt_state"]))
  key = jnp.asarray(state["key"])

  clip = hp.clip_eps if hp.ppo_epochs > 1 else None
  train_step = jax.jit(make_train_step(module.apply, optimizer, hp.lam, clip))
  old_logp_fn = jax.jit(lambda p, b: log_nu(module.apply(p, b["h_q_btd"], b["h_p_btd"]),
                                            b["p_tok_bt"], b["q_tok_bt"]))
  advantage_fn = jax.jit(get_advantage_fn(hp.advantage))
  sampler = RolloutSampler(
      target_config, target_params, draft, draft_params,
      head_weight_fn(**head_io.module_fields(module)), temperature=hp.temperature,
      num_draft=hp.num_draft, max_new_tokens=hp.max_new_tokens, eos_token_ids=eos_token_ids,
      pad_id=target_config.pad_token_id, mesh=mesh)
  logger = _Logger(workdir, progress, files=writer, step=step)
  last = {}
  try:
    while step < hp.total_steps:
      start = time.perf_counter()
      key, roll_key = jax.random.split(key)
      chosen = [usable[example_order(data_pos + i, len(usable), hp.seed)]
                for i in range(hp.prompts_per_step)]
      data_pos += hp.prompts_per_step
      seed = int(jax.random.randint(roll_key, (), 0, np.iinfo(np.int32).max))
      roll = sampler.sample(params, [prompts[i] for i in chosen], hp.rollouts_per_prompt, seed)
      row_examples = [examples[i] for i in chosen for _ in range(hp.rollouts_per_prompt)]
      # Scored once (process 0), so that every process takes the same update even where
      # scoring is not deterministic (a code task's time limits).
      rewards_b = (np.asarray(task.rewards(roll.generated, row_examples), np.float32)
                   if writer else np.zeros((len(row_examples),), np.float32))
      rewards_b = hosts.broadcast(rewards_b)

      batch = placement.rows(policy_batch(roll.generation, hp.max_new_tokens))
      batch["advantages_b"] = placement.rows(np.asarray(
          advantage_fn(jnp.asarray(rewards_b), jnp.asarray(roll.group_ids))))
      if hp.ppo_epochs > 1:
        batch["old_logp_bt"] = old_logp_fn(params, batch)
      params, opt_state, metrics = ppo_update(train_step, params, opt_state, batch,
                                              hp.ppo_epochs)
      step += 1

      if step % hp.log_every == 0 or step == hp.total_steps:
        last = _step_record(metrics, rewards_b, roll, time.perf_counter() - start)
        logger.log(step, hp.total_steps, last)
      if step % hp.checkpoint_every == 0 or step == hp.total_steps:
        state = hosts.fetch({"params": params, "opt_state": opt_state, "key": key})
        if ckpt:
          ckpt.save(step, state, {"step": step, "data_pos": data_pos, "settings": settings})
  finally:
    logger.close()
    if ckpt:
      ckpt.close()

  folder = os.path.join(workdir, "head")
  params = hosts.fetch(params)
  if not writer:
    return folder
  if not last:  # resumed a finished run: the last logged metrics
    last = {k: v for k, v in _last_logged(workdir).items() if k != "step"}
  return head_io.save_head(  # the draft as the run's settings recorded it (hashed once)
      folder, module, params, dq, dp,
      target=settings["target"], draft_spec=settings["draft"],
      draft_digest=settings["draft_digest"], task=task.name,
      steps=step, train=train_cfg.to_dict(),
      final={k: v for k, v in last.items() if k not in TIMING_KEYS and math.isfinite(v)})
