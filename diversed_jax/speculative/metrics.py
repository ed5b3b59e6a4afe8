"""Summary figures of a decoded batch: acceptance rate, tokens per round, theory.

All computed on the host from `Generation.stats` ([R, B, ...] numpy arrays), once per batch;
`greedy_tokens_per_round` decodes its prompts itself, for drafts compared by that figure.
"""

from __future__ import annotations

import numpy as np

from diversed_jax.speculative import acceptance
from diversed_jax.speculative.types import VerifyParams


def served_mask(stats, prompt: int) -> np.ndarray:
  """[R, B] bool: the (round, row) pairs in which a row decoded `prompt` (rows take new
  prompts under continuous batching, so a prompt's rounds are not one column)."""
  return np.asarray(stats.active_rb, bool) & (np.asarray(stats.prompt_rb) == prompt)


def summarize(stats, num_tokens: int, speculative: bool) -> dict:
  """Acceptance figures over all (row, round) pairs in which a row was active.

  Returns a dict with rounds (row-rounds), accepted (drafts the rule accepted, also those
  a row's EOS or length limit then cut), acceptance_rate (accepted / proposed drafts),
  tokens_per_round, mean_accepted (drafts per round) and
  expected_accepted_theory (the min-kernel estimator sum_n (prod_{i<n} a_i) beta_n of
  methods.md, averaged over rounds: E[accepted drafts per round] predicted from a and beta).
  Method 'smc' commits every draft (acceptance 1) and adds `ess`, the mean effective
  sample size over the particles before resampling. Method 'ssd' adds `hits`, the
  rounds whose drafts were pre-drafted, and `hit_rate`, their share of the rounds that
  could be (all but each prompt's first).
  """
  active = np.asarray(stats.active_rb, bool)
  row_rounds = int(active.sum())
  n = np.asarray(stats.num_accepted_rb)[active]
  k = np.asarray(stats.accept_prob_rbk).shape[-1]
  out = {"rounds": row_rounds,
         "tokens_per_round": num_tokens / max(row_rounds, 1)}
  if stats.ess_rb is not None:
    ess = np.asarray(stats.ess_rb)[active]
    out["ess"] = float(ess.mean()) if ess.size else 0.0
  if stats.hit_rb is not None:
    first_rounds = np.unique(np.asarray(stats.prompt_rb)[active]).size
    out["hits"] = int(np.asarray(stats.hit_rb)[active].sum())
    out["hit_rate"] = out["hits"] / max(row_rounds - first_rounds, 1)
  if not speculative or k == 0:
    out.update(accepted=0, acceptance_rate=0.0, mean_accepted=0.0,
               expected_accepted_theory=0.0)
    return out
  theory = np.asarray(acceptance.path_accepted_length_beta(
      np.asarray(stats.accept_prob_rbk)[active], np.asarray(stats.beta_rbk)[active]))
  out.update(accepted=int(n.sum()), acceptance_rate=float(n.sum() / max(row_rounds * k, 1)),
             mean_accepted=float(n.mean()) if n.size else 0.0,
             expected_accepted_theory=float(theory.mean()) if theory.size else 0.0)
  return out


def summarize_generation(generation, speculative: bool) -> dict:
  """`summarize` plus the per-row accepted counts of the first row (for the CLI)."""
  out = summarize(generation.stats, generation.num_tokens, speculative)
  out["accepted_per_round"] = generation.accepted_per_round[0] if speculative else []
  return out


def greedy_tokens_per_round(decoder, prompts, num_draft: int, max_new_tokens: int) -> float:
  """Tokens a greedy exact SD round commits, over `prompts` decoded alone (a one-row queue).

  Deterministic, so it ranks drafts of one architecture by batch-1 speed without timing
  noise: their rounds cost the same, and a greedy round's output is plain decoding's.
  No rounds (nothing decoded) give 0.0, as `summarize`'s tokens_per_round.
  """
  if not len(prompts):
    raise ValueError("prompts: empty; greedy_tokens_per_round needs at least one prompt")
  generation = decoder.generate(prompts, VerifyParams(method="sd", temperature=0.0),
                                num_draft=num_draft, max_new_tokens=max_new_tokens,
                                batch_size=1)
  rounds = sum(len(accepted) for accepted in generation.accepted_per_round)
  return generation.num_tokens / max(rounds, 1)
