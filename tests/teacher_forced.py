"""A reference for the loop's policy record: one teacher-forced pass of both frozen models
over prompt + generated text.

For every generated token x_t it gives what `rl.losses.diversed_loss` reads: p_t(x_t),
q_t(x_t) and TV(p_t, q_t) at a temperature, and the last hidden states h_q,t, h_p,t (post
final norm) at the position that predicts x_t, where the speculative loop evaluates the
head too. (Head training read this pass until session 51; it now reads the loop's own
record, `speculative.policy_trace`, which this pass reproduces for independent drafts.)

The draft is fed the target's hidden states shifted right by one (zeros at 0), the features
the loop gives it for committed tokens. For an independent draft q_t is then exactly the law
the loop drafted from. A feature (EAGLE-style) draft drafts a round's later positions from
its own features and keeps them in its cache, so the loop's laws differ from this pass's.

Shape legend: B rows, L prompt bucket + N, N max new tokens, V vocabulary, D hidden
(Dq draft, Dp target).
"""

from __future__ import annotations

import functools
from typing import Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from diversed_jax.models import transformer
from diversed_jax.models.config import ModelConfig
from diversed_jax.models.kv_cache import bucket_length
from diversed_jax.speculative import distributions
from diversed_jax.speculative.decoder import PROMPT_BUCKETS


@flax.struct.dataclass
class TeacherForced:
  """Per generated position; keys as `diversed_loss` reads them (see `as_batch`)."""
  h_q_btd: jax.Array  # [B, N, Dq] float32
  h_p_btd: jax.Array  # [B, N, Dp] float32
  p_tok_bt: jax.Array  # [B, N] p_t(x_t)
  q_tok_bt: jax.Array  # [B, N] q_t(x_t)
  tv_pq_bt: jax.Array  # [B, N] TV(p_t, q_t)
  mask_bt: jax.Array  # [B, N] 1.0 on generated tokens

  def as_batch(self) -> dict:
    return {k: getattr(self, k) for k in
            ("h_q_btd", "h_p_btd", "p_tok_bt", "q_tok_bt", "tv_pq_bt", "mask_bt")}


def _gather_t(x_bl, idx_bn):
  """x [B, L, ...] at per-row indices [B, N] -> [B, N, ...]."""
  idx = idx_bn.reshape(idx_bn.shape + (1,) * (x_bl.ndim - 2))
  return jnp.take_along_axis(x_bl, idx, axis=1)


@functools.partial(jax.jit, static_argnames=("target_config", "draft", "temperature",
                                             "num_new"))
def teacher_forced(target_params, draft_params, tokens_bl, prompt_lengths_b, gen_lengths_b, *,
                   target_config: ModelConfig, draft, temperature: float,
                   num_new: int) -> TeacherForced:
  """tokens_bl [B, L]: row b is its prompt (prompt_lengths_b[b] >= 1 tokens), then its
  generated tokens (gen_lengths_b[b] <= num_new), then padding. Returns TeacherForced [B, N]."""
  b, l = tokens_bl.shape
  hidden_p_bld, _ = transformer.forward_hidden(target_params, target_config, tokens_bl)
  features_bld = jnp.pad(hidden_p_bld[:, :-1], ((0, 0), (1, 0), (0, 0)))
  draft_logits_blv, hidden_q_bld, _ = draft.forward(
      draft_params, tokens_bl, draft.init_cache(draft_params, b, l), features_bld)

  # Generated token j of row b sits at P_b + j and is predicted at P_b + j - 1.
  j_n = jnp.arange(num_new, dtype=jnp.int32)
  mask_bn = j_n[None, :] < gen_lengths_b[:, None]
  pred_bn = jnp.minimum(prompt_lengths_b[:, None] - 1 + j_n[None, :], l - 2)
  tok_bn = jnp.take_along_axis(tokens_bl, pred_bn + 1, axis=1)

  h_p_bnd = _gather_t(hidden_p_bld, pred_bn)
  h_q_bnd = _gather_t(hidden_q_bld, pred_bn)
  p_bnv = distributions.scaled_probs(
      transformer.logits_from_hidden(target_params, target_config, h_p_bnd), temperature)
  q_bnv = distributions.scaled_probs(_gather_t(draft_logits_blv, pred_bn), temperature)
  take = lambda probs: jnp.take_along_axis(probs, tok_bn[..., None], axis=-1)[..., 0]
  m = mask_bn.astype(jnp.float32)
  return TeacherForced(
      h_q_btd=h_q_bnd.astype(jnp.float32), h_p_btd=h_p_bnd.astype(jnp.float32),
      p_tok_bt=take(p_bnv) * m, q_tok_bt=take(q_bnv) * m,
      tv_pq_bt=distributions.tv_distance(p_bnv, q_bnv) * m, mask_bt=m)


def pack(prompts: Sequence[Sequence[int]], generated: Sequence[Sequence[int]], num_new: int,
         pad_id: int = 0, rows: int | None = None):
  """Host side: (tokens [B', L], prompt_lengths [B'], gen_lengths [B']) with L = the prompt
  bucket + num_new and B' = rows (>= B; extra rows are empty padding rows)."""
  if len(prompts) != len(generated):
    raise ValueError(f"{len(prompts)} prompts for {len(generated)} rollouts")
  rows = len(prompts) if rows is None else rows
  width = bucket_length(max(len(p) for p in prompts), PROMPT_BUCKETS) + num_new
  tokens = np.full((rows, width), pad_id, np.int32)
  prompt_lengths = np.ones((rows,), np.int32)
  gen_lengths = np.zeros((rows,), np.int32)
  for i, (p, g) in enumerate(zip(prompts, generated)):
    g = list(g)[:num_new]
    if not p:
      raise ValueError(f"row {i}: empty prompt")
    tokens[i, :len(p)] = p
    tokens[i, len(p):len(p) + len(g)] = g
    prompt_lengths[i], gen_lengths[i] = len(p), len(g)
  return tokens, prompt_lengths, gen_lengths


def teacher_forced_batch(target_config: ModelConfig, target_params, draft, draft_params,
                         prompts: Sequence[Sequence[int]],
                         generated: Sequence[Sequence[int]], *, temperature: float,
                         num_new: int, chunk_rows: int = 8, pad_id: int = 0) -> dict:
  """`teacher_forced` over all rows in chunks of chunk_rows (bounds the [rows, L, V] draft
  logits); returns the diversed_loss batch dict with [B, N] / [B, N, D] device arrays."""
  b = len(prompts)
  chunk = min(chunk_rows, b)
  rows = -(-b // chunk) * chunk
  tokens, plen, glen = pack(prompts, generated, num_new, pad_id, rows)
  parts = []
  for start in range(0, rows, chunk):
    sl = slice(start, start + chunk)
    parts.append(teacher_forced(
        target_params, draft_params, tokens[sl], plen[sl], glen[sl],
        target_config=target_config, draft=draft,
        temperature=float(temperature), num_new=num_new).as_batch())
  return {k: jnp.concatenate([p[k] for p in parts], 0)[:b] for k in parts[0]}
