"""Summary figures of a decoded batch: acceptance rate, tokens per round, theory.

All computed on the host from `Generation.stats` ([R, B, ...] numpy arrays), once per batch.
"""

from __future__ import annotations

import numpy as np


def expected_accepted(accept_prob_nk: np.ndarray, beta_nk: np.ndarray) -> np.ndarray:
  """Low-variance min-kernel estimator of E[accepted drafts] per round (methods.md):
  sum_n (prod_{i<n} a_i(x_i)) * beta_n, along the drafted path. [N, K] -> [N]."""
  prefix = np.cumprod(np.concatenate([np.ones_like(accept_prob_nk[:, :1]),
                                      accept_prob_nk[:, :-1]], axis=1), axis=1)
  return np.sum(prefix * beta_nk, axis=1)


def summarize(stats, num_tokens: int, speculative: bool) -> dict:
  """Acceptance figures over all (row, round) pairs in which a row was active.

  Returns a dict with rounds (row-rounds), accepted drafts, acceptance_rate (accepted /
  proposed drafts), tokens_per_round, mean_accepted (drafts per round) and
  expected_accepted_theory (the estimator above, averaged).
  """
  active = np.asarray(stats.active_rb, bool)
  row_rounds = int(active.sum())
  n = np.asarray(stats.num_accepted_rb)[active]
  k = np.asarray(stats.accept_prob_rbk).shape[-1]
  out = {"rounds": row_rounds,
         "tokens_per_round": num_tokens / max(row_rounds, 1)}
  if not speculative or k == 0:
    out.update(acceptance_rate=0.0, mean_accepted=0.0, expected_accepted_theory=0.0)
    return out
  theory = expected_accepted(np.asarray(stats.accept_prob_rbk)[active],
                             np.asarray(stats.beta_rbk)[active])
  out.update(acceptance_rate=float(n.sum() / max(row_rounds * k, 1)),
             mean_accepted=float(n.mean()) if n.size else 0.0,
             expected_accepted_theory=float(theory.mean()) if theory.size else 0.0)
  return out


def summarize_generation(generation, speculative: bool) -> dict:
  """`summarize` plus the per-row accepted counts of the first row (for the CLI)."""
  out = summarize(generation.stats, generation.num_tokens, speculative)
  out["accepted_per_round"] = generation.accepted_per_round[0] if speculative else []
  return out
