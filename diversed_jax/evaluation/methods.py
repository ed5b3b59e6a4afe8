"""The method list of a config, expanded into named settings, one VerifyParams each.

  ar             autoregressive decoding with the target (the speed baseline)
  sd             exact speculative decoding with the draft
  sd_finetuned   exact SD with the fine-tuned draft (model.finetuned_draft)
  lossy          lossy SD, one setting per lenience l in methods.lenience
  cascade        SpecCascade, one setting per rule in methods.cascade_rules
  static         static ensemble nu = w p + (1 - w) q, one per w in methods.static_weights
  diversed       the dynamic ensemble w_t = head(h_q,t, h_p,t) (a trained head)
  mentored       mentored decoding, one per budget epsilon in methods.mentored_epsilon on
                 the divergence methods.mentored_divergence (tv, kl or chi2)
  typical        Medusa typical acceptance
  smc            SMC speculative decoding, one per particle count in methods.smc_particles
                 (sampling only: decode.temperature > 0)
  ssd            speculative speculative decoding (exact: the draft pre-drafts the next
                 round while the target verifies), one per Saguaro scale in
                 methods.ssd_saguaro_scales, methods.ssd_fanout guesses per accepted length
                 (methods.ssd_guess_budget > 0: that many of them in all, the likeliest)
"""

from __future__ import annotations

import dataclasses
from typing import Any

from diversed_jax.speculative.types import VerifyParams

FAMILIES = ("ar", "sd", "sd_finetuned", "lossy", "cascade", "static", "diversed", "mentored",
            "typical", "smc", "ssd")
# Families drawn as curves on the frontier plot (one line per family, over its grid).
CURVES = ("lossy", "static", "mentored")


@dataclasses.dataclass(frozen=True)
class MethodSetting:
  """One point of the evaluation: a named verification rule and the draft it uses.

  name: unique, e.g. 'lossy(l=0.3)'; family: one of FAMILIES; params: the grid values
  that distinguish it (JSON-ready); draft: 'default' or 'finetuned'.
  """
  name: str
  family: str
  params: tuple[tuple[str, Any], ...]
  verify: VerifyParams
  draft: str = "default"

  @property
  def params_dict(self) -> dict:
    return dict(self.params)


def method_names(run: str) -> list[str]:
  """'ar, sd,lossy' -> ['ar', 'sd', 'lossy'] (order kept, duplicates dropped)."""
  names = [n.strip() for n in run.split(",") if n.strip()]
  return list(dict.fromkeys(names))


def _fmt(x: float) -> str:
  return f"{x:g}"


def ssd_name(fanout: int, budget: int, scale: float) -> str:
  """An 'ssd' setting's name: ssd(f=F,c=C), with b=B between them when budgeted."""
  return f"ssd(f={fanout}" + (f",b={budget}" if budget else "") + f",c={_fmt(scale)})"


def expand(config) -> list[MethodSetting]:
  """Settings for config.methods.run, with config.decode's temperature and top_p."""
  m, d = config.methods, config.decode
  # A rule's own fields go only into its settings (VerifyParams' defaults elsewhere), so
  # that a setting's fingerprint moves only with what changes its results.
  base = VerifyParams(method="sd", temperature=float(d.temperature), top_p=float(d.top_p))

  def make(name, family, verify_fields, params=(), draft="default"):
    verify = dataclasses.replace(base, **verify_fields)
    return MethodSetting(name, family, tuple(params), verify, draft)

  out = []
  for family in method_names(m.run):
    if family == "ar":
      out.append(make("ar", family, dict(method="ar")))
    elif family == "sd":
      out.append(make("sd", family, dict(method="sd")))
    elif family == "sd_finetuned":
      out.append(make("sd_finetuned", family, dict(method="sd"), draft="finetuned"))
    elif family == "lossy":
      out += [make(f"lossy(l={_fmt(l)})", family, dict(method="lossy", lenience=float(l)),
                   [("lenience", float(l))]) for l in m.lenience]
    elif family == "cascade":
      alpha = float(m.cascade_alpha)
      out += [make(f"cascade({r},a={_fmt(alpha)})", family,
                   dict(method="cascade", cascade_rule=r, cascade_alpha=alpha),
                   [("rule", r), ("alpha", alpha)]) for r in m.cascade_rules]
    elif family == "static":
      out += [make(f"{m.static_rule}(w={_fmt(w)})", family,
                   dict(method=m.static_rule, weight=float(w)), [("weight", float(w))])
              for w in m.static_weights]
    elif family == "diversed":
      out.append(make("diversed", family, dict(method="diversed")))
    elif family == "mentored":
      kind = m.mentored_divergence
      # TV settings keep their names from before the other divergences existed.
      prefix = "" if kind == "tv" else f"{kind},"
      out += [make(f"mentored({prefix}eps={_fmt(e)})", family,
                   dict(method="mentored", epsilon=float(e), divergence=kind),
                   [("epsilon", float(e)), ("divergence", kind)])
              for e in m.mentored_epsilon]
    elif family == "typical":
      out.append(make("typical", family,
                      dict(method="typical", typical_epsilon=float(m.typical_epsilon),
                           typical_delta=float(m.typical_delta)),
                      [("epsilon", float(m.typical_epsilon)),
                       ("delta", float(m.typical_delta))]))
    elif family == "smc":
      threshold = float(m.smc_ess_threshold)
      out += [make(f"smc(n={int(n)})", family,
                   dict(method="smc", particles=int(n), ess_threshold=threshold),
                   [("particles", int(n)), ("ess_threshold", threshold)])
              for n in m.smc_particles]
    elif family == "ssd":
      fanout, budget = int(m.ssd_fanout), int(m.ssd_guess_budget)
      out += [make(ssd_name(fanout, budget, float(c)), family,
                   dict(method="ssd", fanout=fanout, guess_budget=budget,
                        saguaro_scale=float(c)),
                   [("fanout", fanout)] + ([("guess_budget", budget)] if budget else [])
                   + [("saguaro_scale", float(c))])
              for c in m.ssd_saguaro_scales]
    else:
      raise ValueError(f"methods.run: unknown method {family!r}; choose from {list(FAMILIES)}")
  return out
