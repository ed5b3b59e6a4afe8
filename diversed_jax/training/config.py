"""The `train` section of a head-training job: defaults, validation, frozen hyper-parameters.

`default_config()` is an ml_collections.ConfigDict (override on the command line as
`--train.lam=0.3`); `validate(cfg)` raises ValueError naming the bad field and value;
`HParams.from_config(cfg)` is the frozen, hashable view the jitted code receives (a ConfigDict
never enters jit).
"""

from __future__ import annotations

import dataclasses
import math

import ml_collections

from diversed_jax.rl.head import HEAD_KINDS
from diversed_jax.rl.losses import ADVANTAGES


def default_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  # Ensemble head w_t = head([h_q,t ; h_p,t]).
  c.head_kind = "linear"  # 'linear' (the released head) or 'mlp'
  c.head_hidden_dim = 64  # H of the 'mlp' head
  c.head_layer_norm = False  # LayerNorm on [h_q ; h_p] before the head
  c.init_weight = 0.5  # w_t at initialisation, in (0, 1)
  # Objective E[R + lambda sum_t (1 - w_t TV(p_t, q_t))].
  c.lam = 0.1  # lambda, weight of the acceptance regulariser per sequence-sum (>= 0)
  c.advantage = "reinforce_pp"  # estimator name in rl.losses.ADVANTAGES
  c.ppo_epochs = 1  # updates per rollout batch; > 1 uses the PPO clipped ratio
  c.clip_eps = 0.2  # PPO clip epsilon (used when ppo_epochs > 1)
  # Optimiser: clip, AdamW, linear warm-up then cosine decay to 0 at total_steps.
  c.learning_rate = 3e-4  # peak learning rate (Adam moves all ~D kernel entries at once)
  c.warmup_steps = 2  # linear warm-up steps
  c.total_steps = 40  # rollout steps (each: rollouts -> rewards -> ppo_epochs updates)
  c.weight_decay = 0.0  # AdamW decay of the dense kernels
  c.grad_clip = 1.0  # global-norm clip (<= 0: off)
  # Rollouts from the speculative loop with method 'diversed' (samples nu exactly).
  c.prompts_per_step = 4  # distinct prompts per step
  c.rollouts_per_prompt = 4  # G rollouts per prompt (the REINFORCE++ group)
  c.temperature = 1.0  # rollout temperature (also of p_t, q_t in the loss)
  c.max_new_tokens = 32  # generated tokens per rollout
  c.num_draft = 4  # K drafts per speculative round
  c.max_prompt_tokens = 1024  # prompts longer than this are skipped
  # Devices: each step's rows (rollouts and updates) are split over a
  # 'data' mesh of mesh_data devices (-1: all, over every process; 1: one device).
  c.mesh_data = -1
  # Bookkeeping.
  c.checkpoint_every = 10  # steps between orbax checkpoints (and at the end)
  c.keep_checkpoints = 2  # checkpoints kept
  c.log_every = 1  # steps between progress lines / TensorBoard points
  c.seed = 0  # head init, data order and rollout sampling
  return c


@dataclasses.dataclass(frozen=True)
class HParams:
  """Frozen, hashable copy of the `train` section (field names as in default_config)."""
  head_kind: str
  head_hidden_dim: int
  head_layer_norm: bool
  init_weight: float
  lam: float
  advantage: str
  ppo_epochs: int
  clip_eps: float
  learning_rate: float
  warmup_steps: int
  total_steps: int
  weight_decay: float
  grad_clip: float
  prompts_per_step: int
  rollouts_per_prompt: int
  temperature: float
  max_new_tokens: int
  num_draft: int
  max_prompt_tokens: int
  mesh_data: int
  checkpoint_every: int
  keep_checkpoints: int
  log_every: int
  seed: int

  @classmethod
  def from_config(cls, cfg) -> "HParams":
    validate(cfg)
    return cls(**{f.name: cfg[f.name] for f in dataclasses.fields(cls)})

  @property
  def batch_rows(self) -> int:
    return self.prompts_per_step * self.rollouts_per_prompt

  def mesh(self):
    """The 'data' mesh of the step's rows (`mesh_data`), or None on one device; ValueError
    naming the field when the rows do not divide over it."""
    from diversed_jax.parallel import mesh as mesh_lib
    return mesh_lib.data_mesh(
        self.mesh_data, self.batch_rows, field="train.mesh_data",
        rows_field="train.prompts_per_step * train.rollouts_per_prompt")


def _fail(field, value, why):
  raise ValueError(f"train.{field}={value!r}: {why}")


def validate(cfg) -> None:
  """Raises ValueError naming the first bad field and its value."""
  missing = [f.name for f in dataclasses.fields(HParams) if f.name not in cfg]
  if missing:
    raise ValueError(f"train config lacks fields {missing}")
  if cfg.head_kind not in HEAD_KINDS:
    _fail("head_kind", cfg.head_kind, f"must be one of {HEAD_KINDS}")
  if cfg.advantage not in ADVANTAGES:
    _fail("advantage", cfg.advantage, f"must be one of {sorted(ADVANTAGES)}")
  if not 0.0 < cfg.init_weight < 1.0:
    _fail("init_weight", cfg.init_weight, "must be in (0, 1)")
  if not 0 <= cfg.lam < math.inf:  # also rejects NaN
    _fail("lam", cfg.lam, "must be finite and >= 0")
  if not 0 < cfg.temperature < math.inf:
    _fail("temperature", cfg.temperature,
          "must be > 0 (at temperature 0 nu is one-hot and log nu has no gradient)")
  if not 0.0 < cfg.clip_eps < 1.0:
    _fail("clip_eps", cfg.clip_eps, "must be in (0, 1)")
  if not 0 < cfg.learning_rate < math.inf:
    _fail("learning_rate", cfg.learning_rate, "must be finite and > 0")
  if not 0 <= cfg.weight_decay < math.inf:
    _fail("weight_decay", cfg.weight_decay, "must be finite and >= 0")
  if not math.isfinite(cfg.grad_clip):
    _fail("grad_clip", cfg.grad_clip, "must be finite (<= 0 turns clipping off)")
  if int(cfg.mesh_data) != cfg.mesh_data or not (cfg.mesh_data == -1 or cfg.mesh_data >= 1):
    _fail("mesh_data", cfg.mesh_data, "must be -1 (all devices) or a positive integer")
  if int(cfg.seed) != cfg.seed or cfg.seed < 0:
    _fail("seed", cfg.seed, "must be an integer >= 0")
  positive = ("head_hidden_dim", "ppo_epochs", "total_steps", "prompts_per_step",
              "rollouts_per_prompt", "max_new_tokens", "num_draft", "max_prompt_tokens",
              "checkpoint_every", "keep_checkpoints", "log_every")
  for name in positive:
    if int(cfg[name]) != cfg[name] or cfg[name] < 1:
      _fail(name, cfg[name], "must be a positive integer")
  if not 0 <= cfg.warmup_steps < cfg.total_steps:
    _fail("warmup_steps", cfg.warmup_steps, f"must be in [0, total_steps={cfg.total_steps})")
  if cfg.rollouts_per_prompt < 2 and cfg.advantage in ("reinforce_pp", "grpo"):
    _fail("rollouts_per_prompt", cfg.rollouts_per_prompt,
          f"the group baseline of {cfg.advantage!r} needs >= 2 rollouts per prompt")
