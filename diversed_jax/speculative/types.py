"""The contract between the speculative loop and every verification rule.

Shape legend: B rows, K drafted tokens per round, V vocabulary.
"""

from __future__ import annotations

import dataclasses

import flax.struct
import jax

METHODS = ("ar", "sd", "lossy", "static", "static_logit", "diversed", "cascade", "mentored",
           "typical", "smc", "ssd")
CASCADE_RULES = ("chow", "diff", "opt", "v1", "v2", "v3")
DIVERGENCES = ("tv", "kl", "chi2")  # mentored decoding's budget D(pi || p)
# Rule numbers that a decoding program takes as arguments rather than as constants, so
# that a sweep over them (static weights, lenience, cascade alpha, typical thresholds)
# runs one compiled program. The rules read them with jnp operations only.
TRACED_FIELDS = ("lenience", "weight", "cascade_alpha", "typical_epsilon", "typical_delta")


@dataclasses.dataclass(frozen=True)
class VerifyParams:
  """Static (hashable) parameters of a verification rule; safe as a jit static argument.

  method: one of METHODS ('ar' never calls a rule).
  temperature: 0 means greedy (one-hot distributions, never a division by zero).
  top_p: nucleus truncation applied to both p and q before verification (1.0 = off).
  lenience: l in (0, 1] of lossy SD.
  weight: w on the TARGET for 'static' / 'static_logit' (1 = exact SD, 0 = accept all).
  cascade_rule, cascade_alpha: SpecCascade deferral rule and its lenience alpha.
  epsilon, divergence: mentored decoding's budget, D(pi || p) <= epsilon for D one of
    DIVERGENCES (total variation, KL, chi-squared).
  typical_epsilon, typical_delta: Medusa typical-acceptance thresholds.
  particles, ess_threshold: SMC speculative decoding ('smc', see smc.py): drafts per
    prompt, and the effective sample size, as a fraction of `particles`, below which a
    prompt's particles are resampled (0 never resamples, 1 after every round).
  fanout, guess_budget, saguaro_scale: speculative speculative decoding ('ssd', see
    ssd.py): token guesses per accepted length that the draft pre-drafts the next round
    after; if > 0, how many of those (K + 1) x fanout outcomes it pre-drafts in all (the
    likeliest by its own law); and C in (0, 1] scaling the draft's top-`fanout`
    probabilities (Saguaro sampling; 1 = off).
  """
  method: str = "sd"
  temperature: float = 1.0
  top_p: float = 1.0
  lenience: float = 0.5
  weight: float = 0.5
  cascade_rule: str = "opt"
  cascade_alpha: float = 0.1
  epsilon: float = 0.1
  divergence: str = "tv"
  typical_epsilon: float = 0.3
  typical_delta: float = 0.09
  particles: int = 4
  ess_threshold: float = 0.5
  fanout: int = 2
  guess_budget: int = 0
  saguaro_scale: float = 1.0

  def program_key(self) -> "VerifyParams":
    """These parameters with TRACED_FIELDS at their defaults: what a program that takes
    `traced_values()` as arguments is compiled for."""
    defaults = VerifyParams()
    return dataclasses.replace(self, **{f: getattr(defaults, f) for f in TRACED_FIELDS})

  def traced_values(self) -> dict[str, float]:
    return {f: getattr(self, f) for f in TRACED_FIELDS}


@flax.struct.dataclass
class Verdict:
  """What a rule decides for one round, for all rows and positions at once.

  accept_prob_bk: a_i(x_i), acceptance probability of each drafted token.
  residual_bkv: r_i, the (normalised) law sampled after the first rejection at i.
  bonus_bv: the law of the bonus token drawn when all K drafts are accepted.
  beta_bk: beta_i = sum_x q_i(x) a_i(x), the expected acceptance at position i. It equals
    sum_x min(q_i, pi_i) = 1 - TV(q_i, pi_i) (pi_i the emitted law, nu_i for the
    ensembles) for every rule but 'typical', whose residual p can put mass where a = 0.
  """
  accept_prob_bk: jax.Array
  residual_bkv: jax.Array
  bonus_bv: jax.Array
  beta_bk: jax.Array
