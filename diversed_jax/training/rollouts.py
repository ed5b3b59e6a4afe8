"""Rollouts for the head's policy gradient, from the real speculative loop.

With method 'diversed' and the CURRENT head, speculative decoding samples nu_t = w_t p_t +
(1 - w_t) q_t exactly, so rollouts cost what decoding costs. The head's parameters are an
argument of the compiled loop (not constants), so one program serves every training step.
The loop also records what each token's law was made of (`speculative.policy_trace`), the
inputs of the head's loss, so no second pass over the rollouts is needed.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import numpy as np

from diversed_jax.rl.head import EnsembleHead
from diversed_jax.speculative import metrics as metrics_lib
from diversed_jax.speculative.decoder import Generation, ModelHandle, SpeculativeDecoder
from diversed_jax.speculative.types import VerifyParams


@functools.lru_cache(maxsize=None)
def head_weight_fn(kind: str, hidden_dim: int, init_weight: float, layer_norm: bool):
  """The loop's weight_fn (head_params, h_q [..., Dq], h_p [..., Dp]) -> w [...] for an
  EnsembleHead; cached, so equal heads share one function and compiled programs."""
  module = EnsembleHead(kind=kind, hidden_dim=hidden_dim, init_weight=init_weight,
                        layer_norm=layer_norm)

  def weight_fn(head_params, h_q, h_p):
    return module.apply(head_params, h_q, h_p)
  return weight_fn


@dataclasses.dataclass
class Rollouts:
  """G rollouts of each of a step's prompts; rows are grouped by prompt (row = i * G + g)."""
  prompts: list[list[int]]  # [B] prompt ids per row
  group_ids: np.ndarray  # [B] int32, the prompt index of each row
  summary: dict  # acceptance_rate, tokens_per_round, w_mean_committed, ... (see `summarize`)
  generation: Generation

  @property
  def generated(self) -> list[list[int]]:
    """[B] generated ids per row (EOS included when hit)."""
    return self.generation.token_ids

  @property
  def num_tokens(self) -> int:
    return self.generation.num_tokens


def policy_batch(generation: Generation, max_new_tokens: int) -> dict:
  """The `rl.losses.diversed_loss` batch (numpy, [B, N] / [B, N, D], N = max_new_tokens)
  from a generation's policy record (`generate(..., record_policy=True)`): exactly the
  laws and head inputs its tokens were sampled under, zero past each row's tokens."""
  trace = generation.policy
  if trace is None:
    raise ValueError("the generation has no policy record: generate with record_policy=True")
  n = max_new_tokens
  lengths_b = np.asarray([len(t) for t in generation.token_ids])
  mask_bn = (np.arange(n)[None, :] < lengths_b[:, None]).astype(np.float32)
  masked = lambda x: x[:, :n] * (mask_bn if x.ndim == 2 else mask_bn[..., None])
  return {"h_q_btd": masked(trace.h_q_qnd), "h_p_btd": masked(trace.h_p_qnd),
          "p_tok_bt": masked(trace.p_tok_qn), "q_tok_bt": masked(trace.q_tok_qn),
          "tv_pq_bt": masked(trace.tv_pq_qn), "mask_bt": mask_bn}


def mean_committed_weight(stats) -> float:
  """Mean w_t over the positions a round committed (i <= n, active rows): the weights that
  shaped the emitted tokens."""
  active = np.asarray(stats.active_rb, bool)
  w_rbk = np.asarray(stats.weights_rbk)
  n_rb = np.asarray(stats.num_accepted_rb)
  used = active[..., None] & (np.arange(w_rbk.shape[-1]) <= n_rb[..., None])
  return float(w_rbk[used].mean()) if used.any() else float("nan")


class RolloutSampler:
  """Samples rollouts with the current head; build once, call `sample` every step."""

  def __init__(self, target_config, target_params, draft, draft_params, weight_fn, *,
               temperature: float, num_draft: int, max_new_tokens: int,
               eos_token_ids: Sequence[int] | None = None, pad_id: int = 0, mesh=None):
    """`mesh`: split the rows over its 'data' axis (see SpeculativeDecoder)."""
    self.decoder = SpeculativeDecoder(ModelHandle(target_config, target_params), draft,
                                      draft_params, weight_fn, None, mesh=mesh)
    self.verify = VerifyParams(method="diversed", temperature=float(temperature))
    self.num_draft = num_draft
    self.max_new_tokens = max_new_tokens
    self.eos_token_ids = (tuple(target_config.eos_token_ids) if eos_token_ids is None
                          else tuple(eos_token_ids))
    self.pad_id = pad_id

  def sample(self, head_params, prompts: Sequence[Sequence[int]], group_size: int,
             seed: int) -> Rollouts:
    """group_size rollouts of each prompt, sampled from nu under `head_params`."""
    rows = [list(p) for p in prompts for _ in range(group_size)]
    self.decoder.head_params = head_params
    gen = self.decoder.generate(rows, self.verify, num_draft=self.num_draft,
                                max_new_tokens=self.max_new_tokens, seed=int(seed),
                                eos_token_ids=self.eos_token_ids, pad_id=self.pad_id,
                                record_policy=True)
    summary = metrics_lib.summarize(gen.stats, gen.num_tokens, speculative=True)
    summary.update(w_mean_committed=mean_committed_weight(gen.stats),
                   seconds=gen.seconds, compile_seconds=gen.compile_seconds,
                   tokens_per_s=gen.num_tokens / max(gen.seconds, 1e-9))
    group_ids = np.repeat(np.arange(len(prompts), dtype=np.int32), group_size)
    return Rollouts(prompts=rows, group_ids=group_ids, summary=summary, generation=gen)
