"""What each generated token's law was made of, recorded by the loop for the head's RL.

DIVERSED commits every token under nu_t = w_t p_t + (1 - w_t) q_t, with w_t from the
ensemble head on the draft's and target's last hidden states (h_q,t, h_p,t) at the position
that predicts the token. The head's policy gradient needs, per generated token x_t, those
hidden states and p_t(x_t), q_t(x_t), TV(p_t, q_t) at the rollout's temperature.

A teacher-forced pass over the finished text gives them exactly only for an independent
draft. A feature (EAGLE-style) draft drafts a round's later positions from its own features
and keeps those in its cache, and a copying draft proposes from its history: their laws in
the loop differ from a pass over the text. So with `record_policy` the loop writes the
values it used, per prompt and output position, next to the tokens (`PolicyTrace.record`).

Shape legend: Q prompts, N output positions (max_new_tokens + K + 1), B rows, K drafts,
V vocabulary, D hidden (Dq draft, Dp target).
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from diversed_jax.speculative import distributions


@flax.struct.dataclass
class PolicyTrace:
  """Per prompt and output position; entries past a prompt's generated count are stale."""
  h_q_qnd: jax.Array  # [Q, N, Dq] float32, the draft's last hidden state predicting x_t
  h_p_qnd: jax.Array  # [Q, N, Dp] float32, the target's
  p_tok_qn: jax.Array  # [Q, N] p_t(x_t)
  q_tok_qn: jax.Array  # [Q, N] q_t(x_t)
  tv_pq_qn: jax.Array  # [Q, N] TV(p_t, q_t)

  @classmethod
  def zeros(cls, num_prompts: int, positions: int, draft_dim: int,
            target_dim: int) -> "PolicyTrace":
    qn = (num_prompts, positions)
    return cls(h_q_qnd=jnp.zeros(qn + (draft_dim,), jnp.float32),
               h_p_qnd=jnp.zeros(qn + (target_dim,), jnp.float32),
               p_tok_qn=jnp.zeros(qn, jnp.float32), q_tok_qn=jnp.zeros(qn, jnp.float32),
               tv_pq_qn=jnp.zeros(qn, jnp.float32))

  def record(self, prompt_b, positions_bk, active_b, tokens_bk, draft_logits_bkv,
             target_logits_bkv, draft_hidden_bkd, target_hidden_bkd, temperature: float,
             top_p: float = 1.0) -> "PolicyTrace":
    """Writes a round's K + 1 positions of each active row at its prompt's `positions_bk`.

    tokens_bk: the round's tokens d_1..d_n, then the residual or bonus token, then
    leftovers (written, and overwritten by the next round, as the loop's tokens are);
    the laws and hidden states are those of the round's positions 1..K+1.
    """
    p_bkv = distributions.scaled_probs(target_logits_bkv, temperature, top_p)
    q_bkv = distributions.scaled_probs(draft_logits_bkv, temperature, top_p)
    take = lambda probs: jnp.take_along_axis(probs, tokens_bk[..., None], axis=-1)[..., 0]
    # Finished rows write past the buffer's end, where the writes are dropped.
    cols_bk = jnp.where(active_b[:, None], positions_bk, self.p_tok_qn.shape[1])
    rows_b1 = prompt_b[:, None]

    def write(buffer, values):
      return buffer.at[rows_b1, cols_bk].set(values.astype(buffer.dtype), mode="drop")

    return PolicyTrace(
        h_q_qnd=write(self.h_q_qnd, draft_hidden_bkd),
        h_p_qnd=write(self.h_p_qnd, target_hidden_bkd),
        p_tok_qn=write(self.p_tok_qn, take(p_bkv)), q_tok_qn=write(self.q_tok_qn, take(q_bkv)),
        tv_pq_qn=write(self.tv_pq_qn, distributions.tv_distance(p_bkv, q_bkv)))
