"""Verification rules of (relaxed) speculative decoding, vectorised over rows and drafts.

Shape legend: B rows, K drafted tokens per round, J = K or K + 1 draft positions, V vocabulary.

Every rule has one signature (see docs/methods.md for the maths):

  rule(draft_logits_bjv, target_logits_bkv1, draft_tokens_bk, params, weights_bk1=None)
      -> Verdict

- draft_logits_bjv [B, J, V]: the draft's logits q_1..q_K at the drafted positions, and
  optionally q_{K+1} (J = K + 1). Only the ensemble and cascade rules use q_{K+1}: their bonus
  token is drawn from their own emitted law at K + 1 (nu_{K+1}, pi_{K+1}), which needs the
  draft's law there. Without it (J = K) every rule draws the bonus from p_{K+1}.
- target_logits_bkv1 [B, K+1, V]: the target's logits at the K drafted positions and the
  bonus position.
- draft_tokens_bk [B, K] int: x_i ~ q_i.
- params: VerifyParams, static (hashable) under jit.
- weights_bk1 [B, K+1]: w_t, the DIVERSED head's weight on the target; 'diversed' only.

A rule returns a(x) for the drafted tokens, the residual law r_i, the bonus law and
beta_i = sum_x q_i(x) a_i(x) (= sum_x min(q_i, pi_i) for the ratio rules). q and p are the
temperature-scaled, top-p-truncated laws (`distributions.scaled_probs`); temperature 0 makes
them one-hot, so exact SD becomes greedy decoding with no special case. Then `resolve_round`
draws the uniforms and samples, and returns each row's n leading accepts and next token.
"""

from __future__ import annotations

import math
from typing import Callable

import flax.struct
import jax
import jax.numpy as jnp

from diversed_jax.speculative import distributions
from diversed_jax.speculative.distributions import (normalize_positive, sample_categorical,
                                                    scaled_probs, tv_distance)
from diversed_jax.speculative.types import (CASCADE_RULES, DIVERGENCES, METHODS, Verdict,
                                           VerifyParams)

Rule = Callable[..., Verdict]

# Stands in for -inf logits in the logit mixture: w * (-inf) would be NaN at w = 0.
_NEG_LOGIT = -1e30


# ----------------------------------------------------------------------------- plumbing


def validate_params(params: VerifyParams, prefix: str = "VerifyParams.") -> None:
  """Raises ValueError naming the first out-of-range field of `params` (as `prefix` + its
  name: a command line names its flags). A value traced inside a program (TRACED_FIELDS
  given to `loop.decode` as arguments) is not checked here: it was as a number."""
  checks = (
      ("temperature", lambda t: 0 <= t < math.inf, "finite and >= 0"),
      ("top_p", lambda v: 0 < v <= 1, "in (0, 1]"),
      ("lenience", lambda v: 0 < v <= 1, "in (0, 1]"),
      ("weight", lambda v: 0 <= v <= 1, "in [0, 1]"),
      ("cascade_rule", lambda v: v in CASCADE_RULES, f"one of {CASCADE_RULES}"),
      ("cascade_alpha", lambda v: 0 <= v <= 1, "in [0, 1]"),
      ("epsilon", lambda v: v >= 0, ">= 0"),
      ("divergence", lambda v: v in DIVERGENCES, f"one of {DIVERGENCES}"),
      ("typical_epsilon", lambda v: v >= 0, ">= 0"),
      ("typical_delta", lambda v: v >= 0, ">= 0"),
      ("particles", lambda v: v >= 1, ">= 1"),
      ("ess_threshold", lambda v: 0 <= v <= 1, "in [0, 1]"),
      ("fanout", lambda v: v >= 1, ">= 1"),
      ("guess_budget", lambda v: v >= 0, ">= 0"),
      ("saguaro_scale", lambda v: 0 < v <= 1, "in (0, 1]"),
      # Importance weights p/q of one-hot laws are 0 or undefined: nothing to weigh.
      ("temperature", lambda t: params.method != "smc" or t > 0, "> 0 with method 'smc'"),
  )
  for name, ok, want in checks:
    value = getattr(params, name)
    if not isinstance(value, jax.core.Tracer) and not ok(value):
      raise ValueError(f"{prefix}{name} must be {want}, got {value!r}")


def _laws(draft_logits_bjv, target_logits_bkv1, draft_tokens_bk, params):
  """Checks shapes; returns K, q [B, J, V] and p [B, K+1, V] (scaled, float32)."""
  validate_params(params)
  k = draft_tokens_bk.shape[-1]
  if target_logits_bkv1.shape[1] != k + 1:
    raise ValueError(f"target_logits must have K+1 = {k + 1} positions, got shape "
                     f"{target_logits_bkv1.shape}")
  if draft_logits_bjv.shape[1] not in (k, k + 1):
    raise ValueError(f"draft_logits must have K = {k} or K+1 positions, got shape "
                     f"{draft_logits_bjv.shape}")
  q = scaled_probs(draft_logits_bjv, params.temperature, params.top_p)
  p = scaled_probs(target_logits_bkv1, params.temperature, params.top_p)
  return k, q, p


def _ratio_accept(pi, q):
  """a = min(1, pi/q) on the support of q; 1[pi > 0] off it (never drafted)."""
  on = q > 0
  return jnp.where(on, jnp.minimum(1.0, pi / jnp.where(on, q, 1.0)), (pi > 0).astype(q.dtype))


def _verdict(q_bjv, a_bjv, residual_bkv, bonus_bv, draft_tokens_bk) -> Verdict:
  """Reads a(x_i) off the full-vocabulary acceptance a_bjv; beta_i = sum_x q_i a_i."""
  k = draft_tokens_bk.shape[-1]
  q, a = q_bjv[:, :k], a_bjv[:, :k]
  tokens = draft_tokens_bk.astype(jnp.int32)[..., None]
  return Verdict(accept_prob_bk=jnp.take_along_axis(a, tokens, axis=-1)[..., 0],
                 residual_bkv=residual_bkv[:, :k],
                 bonus_bv=bonus_bv,
                 beta_bk=jnp.sum(q * a, axis=-1))


def _bonus(law_bjv, p_bkv1, k):
  """The rule's own law at K + 1 when the draft gave q_{K+1}, else p_{K+1}; [B, V]."""
  return law_bjv[:, k] if law_bjv.shape[1] > k else p_bkv1[:, k]


# ------------------------------------------------------------------- lossless and lossy


def exact(draft_logits_bjv, target_logits_bkv1, draft_tokens_bk, params, weights_bk1=None):
  """Exact speculative sampling: a = min(1, p/q), r = norm((p-q)+), bonus p_{K+1}.

  Emits p exactly; at temperature 0 this is greedy decoding (a = 1[x = argmax p]).
  """
  del weights_bk1
  k, q, p = _laws(draft_logits_bjv, target_logits_bkv1, draft_tokens_bk, params)
  q, pk = q[:, :k], p[:, :k]
  residual = normalize_positive(pk - q, pk)
  return _verdict(q, _ratio_accept(pk, q), residual, p[:, k], draft_tokens_bk)


def lossy(draft_logits_bjv, target_logits_bkv1, draft_tokens_bk, params, weights_bk1=None):
  """Lossy SD with lenience l: a = min(1, p/(l q)), r = norm((p-q)+), bonus p_{K+1}.

  Emits pi = min(q, p/l) + (1 - A) norm((p-q)+), A = sum_x min(q, p/l).
  """
  del weights_bk1
  k, q, p = _laws(draft_logits_bjv, target_logits_bkv1, draft_tokens_bk, params)
  q, pk = q[:, :k], p[:, :k]
  residual = normalize_positive(pk - q, pk)
  return _verdict(q, _ratio_accept(pk / params.lenience, q), residual, p[:, k],
                  draft_tokens_bk)


# ----------------------------------------------------------------------------- ensembles


def _mixture_verdict(q, p, w_bj, draft_tokens_bk, k):
  """nu = w p + (1-w) q; a = min(1, w p/q + 1 - w); r = norm((p-q)+) (as nu - q = w (p-q))."""
  pj = p[:, :q.shape[1]]
  w = w_bj[..., None]
  nu = w * pj + (1.0 - w) * q
  on = q > 0
  accept = jnp.where(on, jnp.minimum(1.0, w * pj / jnp.where(on, q, 1.0) + 1.0 - w),
                     (nu > 0).astype(q.dtype))
  residual = normalize_positive(pj[:, :k] - q[:, :k], pj[:, :k])
  return _verdict(q, accept, residual, _bonus(nu, p, k), draft_tokens_bk)


def static(draft_logits_bjv, target_logits_bkv1, draft_tokens_bk, params, weights_bk1=None):
  """Static ensemble: nu = w p + (1-w) q with w = params.weight (DIVERSED with w_t = w).

  Emits nu exactly; bonus nu_{K+1} when q_{K+1} is given, else p_{K+1}.
  """
  del weights_bk1
  k, q, p = _laws(draft_logits_bjv, target_logits_bkv1, draft_tokens_bk, params)
  w = jnp.full(q.shape[:2], params.weight, jnp.float32)
  return _mixture_verdict(q, p, w, draft_tokens_bk, k)


def diversed(draft_logits_bjv, target_logits_bkv1, draft_tokens_bk, params, weights_bk1=None):
  """DIVERSED dynamic ensemble: nu_t = w_t p_t + (1 - w_t) q_t, w_t = weights_bk1[:, t].

  weights_bk1 [B, K+1] is required. Emits nu_t exactly; bonus nu_{K+1} when q_{K+1} is given.
  """
  if weights_bk1 is None:
    raise ValueError("method 'diversed' needs weights_bk1 [B, K+1] (w_t from the ensemble head)")
  k, q, p = _laws(draft_logits_bjv, target_logits_bkv1, draft_tokens_bk, params)
  w = jnp.asarray(weights_bk1, jnp.float32)
  if w.shape[-1] != k + 1:
    raise ValueError(f"weights_bk1 must have K+1 = {k + 1} positions, got shape {w.shape}")
  return _mixture_verdict(q, p, w[:, :q.shape[1]], draft_tokens_bk, k)


def static_logit(draft_logits_bjv, target_logits_bkv1, draft_tokens_bk, params,
                 weights_bk1=None):
  """The authors' released-code logit mixture nu = softmax(w z_p + (1-w) z_q), w = weight.

  A geometric mixture (off the acceptance/bias frontier), verified against as its own nu:
  a = min(1, nu/q), r = norm((nu-q)+); temperature and top-p apply to the mixed logits.
  """
  del weights_bk1
  k, q, p = _laws(draft_logits_bjv, target_logits_bkv1, draft_tokens_bk, params)
  finite = lambda z: jnp.maximum(jnp.asarray(z, jnp.float32), _NEG_LOGIT)
  w = params.weight
  mixed = w * finite(target_logits_bkv1[:, :q.shape[1]]) + (1 - w) * finite(draft_logits_bjv)
  nu = scaled_probs(mixed, params.temperature, params.top_p)
  residual = normalize_positive(nu[:, :k] - q[:, :k], nu[:, :k])
  return _verdict(q, _ratio_accept(nu, q), residual, _bonus(nu, p, k), draft_tokens_bk)


# ------------------------------------------------------------------------------ cascade


def _keeps_draft(rule: str, alpha: float, max_q1, max_p1, tv_q1p1):
  """chow/diff/opt: whether pi stays with the draft (delta = 0), from the temperature-1
  laws' maxima and (opt) their TV distance; broadcasts."""
  if rule == "chow":
    return max_q1 >= 1.0 - alpha
  if rule == "diff":
    return max_q1 >= max_p1 - alpha
  return max_q1 >= max_p1 - alpha * tv_q1p1


def _in_draft_set(rule: str, alpha: float, q1, p1, max_p1):
  """v1/v2/v3: whether tokens with temperature-1 probabilities q1, p1 are in A; elementwise."""
  if rule == "v1":
    return q1 >= max_p1 - alpha
  if rule == "v2":
    return p1 >= max_p1 - alpha
  if rule == "v3":
    return p1 >= (1.0 - alpha) * max_p1
  raise ValueError(f"unknown cascade_rule {rule!r}; choices: {CASCADE_RULES}")


def cascade_target(q_v, p_v, q1_v, p1_v, rule: str, alpha: float):
  """SpecCascade's token-level target pi [..., V].

  q_v, p_v: scaled laws, mixed into pi; q1_v, p1_v: temperature-1 laws, deciding deferral.
  chow/diff/opt: pi = (1 - delta) q + delta p, delta = 0 (keep the draft) when
    chow: max q1 >= 1 - alpha; diff: max q1 >= max p1 - alpha;
    opt: max q1 >= max p1 - alpha TV(q1, p1).
  v1/v2/v3: pi(v) = q(v) 1[v in A] + (1 - q(A)) p(v) with A = {q1 >= max p1 - alpha},
    {p1 >= max p1 - alpha}, {p1 >= (1 - alpha) max p1}.
  """
  max_q1 = jnp.max(q1_v, axis=-1, keepdims=True)
  max_p1 = jnp.max(p1_v, axis=-1, keepdims=True)
  if rule in ("chow", "diff", "opt"):
    tv = tv_distance(q1_v, p1_v)[..., None] if rule == "opt" else None
    return jnp.where(_keeps_draft(rule, alpha, max_q1, max_p1, tv), q_v, p_v)
  q_in_a = jnp.where(_in_draft_set(rule, alpha, q1_v, p1_v, max_p1), q_v, 0.0)
  return q_in_a + (1.0 - jnp.sum(q_in_a, axis=-1, keepdims=True)) * p_v


def cascade_greedy_keeps_draft(draft_logits_bjv, target_logits_bjv, rule: str, alpha: float):
  """Whether SpecCascade's pi at temperature 0 is the draft's point mass; [B, J] bool.

  At T = 0 the scaled laws are one-hot at q* = argmax q and p* = argmax p, so pi is one of
  the two: q when the rule keeps the draft (chow/diff/opt) or when q* is in A (v1/v2/v3,
  where q(A) = 1[q* in A]), else p. The temperature-1 laws enter only through max q1,
  max p1, TV(q1, p1) (opt) and q1(q*), p1(q*) (v rules): per-position scalars, which lets
  the greedy round run on two tokens like the other rules.
  """
  q1 = jax.nn.softmax(jnp.asarray(draft_logits_bjv, jnp.float32), axis=-1)
  p1 = jax.nn.softmax(jnp.asarray(target_logits_bjv, jnp.float32), axis=-1)
  max_q1, max_p1 = jnp.max(q1, axis=-1), jnp.max(p1, axis=-1)
  if rule in ("chow", "diff", "opt"):
    tv = tv_distance(q1, p1) if rule == "opt" else None
    return _keeps_draft(rule, alpha, max_q1, max_p1, tv)
  q_star = distributions.argmax(draft_logits_bjv)[..., None]
  at_q_star = lambda x: jnp.take_along_axis(x, q_star, axis=-1)[..., 0]
  return _in_draft_set(rule, alpha, at_q_star(q1), at_q_star(p1), max_p1)


def cascade(draft_logits_bjv, target_logits_bkv1, draft_tokens_bk, params, weights_bk1=None):
  """SpecCascade: a = min(1, pi/q), r = norm((pi-q)+), pi from `cascade_target`.

  Bonus: pi_{K+1} when q_{K+1} is given; otherwise no draft law exists at K + 1 and the
  bonus comes from p_{K+1} (the law pi defers to).
  """
  del weights_bk1
  k, q, p = _laws(draft_logits_bjv, target_logits_bkv1, draft_tokens_bk, params)
  j = q.shape[1]
  if params.temperature == 1.0 and params.top_p == 1.0:
    q1, p1 = q, p[:, :j]  # the scaled laws are the temperature-1 ones: two softmaxes saved
  else:
    q1 = jax.nn.softmax(jnp.asarray(draft_logits_bjv, jnp.float32), axis=-1)
    p1 = jax.nn.softmax(jnp.asarray(target_logits_bkv1[:, :j], jnp.float32), axis=-1)
  pi = cascade_target(q, p[:, :j], q1, p1, params.cascade_rule, params.cascade_alpha)
  residual = normalize_positive(pi[:, :k] - q[:, :k], p[:, :k])
  return _verdict(q, _ratio_accept(pi, q), residual, _bonus(pi, p, k), draft_tokens_bk)


# ----------------------------------------------------------------------------- mentored


_MENTORED_MAX_STEPS = 200


def _mentored_row(q_v, p_v, epsilon):
  """(c*, a_v) for one position [V]; see `mentored_accept`.

  eps(c) = sum_{q > p > 0} min(q - p, (c - 1) p) is concave and piecewise linear in c, so
  Newton's method from c = 1 climbs monotonically (each tangent lies above eps(c)) and is
  exact once it reaches the root's linear piece: a few O(V) passes instead of a sort of
  the vocabulary (the sort dominated the round's cost on CPU).
  """
  excess = q_v > p_v
  finite = excess & (p_v > 0)
  zero_p = excess & (p_v <= 0)
  gap = jnp.where(finite, q_v - p_v, 0.0)
  p_f = jnp.where(finite, p_v, 0.0)
  d_finite = jnp.sum(gap)  # = TV(p, q) minus the mass of q where p = 0
  spent = epsilon >= d_finite  # the budget covers every finite ratio: c* = inf

  def eps_and_slope(c):
    rising = (c - 1.0) * p_f < gap  # pieces not yet saturated
    return (jnp.sum(jnp.where(rising, (c - 1.0) * p_f, gap)),
            jnp.sum(jnp.where(rising, p_f, 0.0)))

  def not_done(state):
    c, prev_c, value, _, step = state
    return (~spent) & (value < epsilon) & (c > prev_c) & (step < _MENTORED_MAX_STEPS)

  def newton(state):  # one O(V) pass per step: the new point's value and slope
    c, _, value, slope, step = state
    new_c = c + (epsilon - value) / jnp.maximum(slope, 1e-30)
    return (new_c, c, *eps_and_slope(new_c), step + 1)

  one = jnp.float32(1.0)
  c, _, _, _, _ = jax.lax.while_loop(
      not_done, newton, (one, jnp.float32(0.0), *eps_and_slope(one), jnp.int32(0)))
  c = jnp.where(spent, jnp.inf, c)
  # c p/q cannot accept tokens with p = 0 < q; once c* = inf the rest of the budget is spent
  # on them at a common rate, which keeps the acceptance at min(1, 1 - TV(p,q) + eps).
  q_zero_p = jnp.sum(jnp.where(zero_p, q_v, 0.0))
  extra = jnp.clip((epsilon - d_finite) / jnp.where(q_zero_p > 0, q_zero_p, 1.0), 0.0, 1.0)
  on = q_v > 0
  scaled = jnp.minimum(1.0, jnp.where(spent, 1.0, c) * p_v / jnp.where(on, q_v, 1.0))
  a = jnp.where(spent, jnp.where(p_v > 0, 1.0, extra), scaled)
  return c, jnp.where(on, a, (p_v > 0).astype(q_v.dtype))


def mentored_accept(q_v: jax.Array, p_v: jax.Array, epsilon: float):
  """Mentored decoding, TV budget eps: a(x) = min(1, c* p(x)/q(x)), c* >= 1 solving

    eps(c) = sum_{x: q > p} min(q(x) - p(x), (c - 1) p(x)) = eps

  by Newton's method on the concave piecewise-linear eps(c) (exact on its last linear
  piece; the sorted-ratio closed form of methods.md gives the same root), vmapped over the
  leading axes. q_v, p_v [..., V]; returns (c* [...], a [..., V]). c* = inf when eps covers
  the whole excess (accept all of q's support where p > 0). Acceptance is
  min(1, 1 - TV(p, q) + eps) and TV(pi, p) = min(eps, TV(p, q)).
  """
  lead = q_v.shape[:-1]
  flat = lambda x: jnp.asarray(x, jnp.float32).reshape((-1, x.shape[-1]))
  c, a = jax.vmap(_mentored_row, in_axes=(0, 0, None))(flat(q_v), flat(p_v),
                                                       jnp.float32(epsilon))
  return c.reshape(lead), a.reshape(q_v.shape)


# Bisection steps on log c: the bracket [0, log c_max] is at most ~70 wide (ratios are
# clamped at _MENTORED_MAX_RATIO), so 30 halvings leave c within a relative 1e-7.
_MENTORED_BISECTIONS = 30
# q/p overflows float32 where p is subnormal (a GPU keeps those; XLA:CPU flushes them to 0),
# and c = inf would make the bisection NaN. Clamped, a token with p < 1e-30 q is accepted at
# rate 1e30 p/q at most: accepting it whole would cost a KL term of over 69 q(x) anyway.
_MENTORED_MAX_RATIO = 1e30


def mentored_law(q_v: jax.Array, p_v: jax.Array, c: jax.Array) -> jax.Array:
  """pi_c = min(q, c p) + (1 - sum min(q, c p)) norm((p - q)+): the law that acceptance
  a = min(1, c p/q) with residual norm((p-q)+) emits. q_v, p_v [..., V], c [...]; c = 1
  gives p. As c grows each pi_c(x) moves monotonically from p(x) towards q(x)."""
  # Masked, not c * p: c = inf times p = 0 would be NaN.
  accepted = jnp.minimum(q_v, jnp.where(p_v > 0, c[..., None] * p_v, 0.0))
  deficit = jnp.maximum(p_v - q_v, 0.0)
  total = jnp.sum(deficit, axis=-1, keepdims=True)
  rest = 1.0 - jnp.sum(accepted, axis=-1, keepdims=True)
  return accepted + rest * deficit / jnp.where(total > 0, total, 1.0)


def divergence(pi_v: jax.Array, p_v: jax.Array, kind: str) -> jax.Array:
  """D(pi || p) over the last axis for kind in DIVERGENCES; pi must vanish where p does
  (as `mentored_law`'s does) for 'kl' and 'chi2'."""
  if kind == "tv":
    return 0.5 * jnp.sum(jnp.abs(pi_v - p_v), axis=-1)
  on = p_v > 0
  safe_p = jnp.where(on, p_v, 1.0)
  if kind == "kl":
    log_ratio = jnp.log(jnp.where(pi_v > 0, pi_v, 1.0) / safe_p)
    return jnp.sum(jnp.where(on & (pi_v > 0), pi_v * log_ratio, 0.0), axis=-1)
  if kind == "chi2":
    # (d / p) d, not d^2 / p: the square of a tiny difference underflows float32.
    diff = pi_v - p_v
    return jnp.sum(jnp.where(on, diff * (diff / safe_p), 0.0), axis=-1)
  raise ValueError(f"divergence={kind!r} is not one of {DIVERGENCES}")


def mentored_f_accept(q_v: jax.Array, p_v: jax.Array, epsilon: float, kind: str):
  """Mentored decoding with the budget D(pi || p) <= eps for D = `kind`: the TV case's
  family a = min(1, c p/q) and residual norm((p-q)+), with c >= 1 the largest such that
  D(pi_c || p) <= eps (methods.md: "other f-divergences need a search over c").

  pi_c moves away from p coordinate by coordinate as c grows, so D(pi_c || p) rises with
  c: bisection on log c over [0, log c_max], c_max = max q/p over p > 0, past which
  nothing changes (c = c_max when even it fits the budget: every token with p > 0 is
  accepted). Tokens with p = 0 are never accepted: KL and chi^2 would be infinite.
  q_v, p_v [..., V]; returns (c [...], a [..., V]).
  """
  q_v, p_v = jnp.asarray(q_v, jnp.float32), jnp.asarray(p_v, jnp.float32)
  on = p_v > 0
  ratio = jnp.where(on, jnp.minimum(q_v / jnp.where(on, p_v, 1.0), _MENTORED_MAX_RATIO), 0.0)
  log_c_max = jnp.log(jnp.maximum(jnp.max(ratio, axis=-1), 1.0))
  fits = lambda log_c: divergence(mentored_law(q_v, p_v, jnp.exp(log_c)), p_v,
                                  kind) <= epsilon

  def halve(_, bracket):  # lo fits the budget; hi does not (or is the end)
    lo, hi = bracket
    mid = 0.5 * (lo + hi)
    ok = fits(mid)
    return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid)

  lo, _ = jax.lax.fori_loop(0, _MENTORED_BISECTIONS, halve,
                            (jnp.zeros_like(log_c_max), log_c_max))
  c = jnp.exp(jnp.where(fits(log_c_max), log_c_max, lo))
  if epsilon == 0:  # KL and chi^2 are second order in c - 1: float32 noise near c = 1
    c = jnp.ones_like(c)  # would let c drift ~1e-3 above it; budget 0 is exact SD
  return c, _ratio_accept(c[..., None] * p_v, q_v)


def mentored(draft_logits_bjv, target_logits_bkv1, draft_tokens_bk, params, weights_bk1=None):
  """Mentored decoding: a = min(1, c* p/q), r = norm((p-q)+), bonus p_{K+1}; c* spends the
  budget epsilon on TV(pi, p) (closed form, `mentored_accept`) or on KL / chi^2
  (`mentored_f_accept`)."""
  del weights_bk1
  k, q, p = _laws(draft_logits_bjv, target_logits_bkv1, draft_tokens_bk, params)
  q, pk = q[:, :k], p[:, :k]
  if params.divergence == "tv":
    _, accept = mentored_accept(q, pk, params.epsilon)
  else:
    _, accept = mentored_f_accept(q, pk, params.epsilon, params.divergence)
  residual = normalize_positive(pk - q, pk)
  return _verdict(q, accept, residual, p[:, k], draft_tokens_bk)


# ------------------------------------------------------------------------------ typical


def typical(draft_logits_bjv, target_logits_bkv1, draft_tokens_bk, params, weights_bk1=None):
  """Medusa typical acceptance: a = 1[p(x) > min(eps, delta exp(-H(p)))], r = p, bonus p_{K+1}.

  No distributional guarantee: emits q a + (1 - A) p.
  """
  del weights_bk1
  k, q, p = _laws(draft_logits_bjv, target_logits_bkv1, draft_tokens_bk, params)
  q, pk = q[:, :k], p[:, :k]
  entropy = -jnp.sum(jnp.where(pk > 0, pk * jnp.log(jnp.where(pk > 0, pk, 1.0)), 0.0), -1)
  threshold = jnp.minimum(params.typical_epsilon, params.typical_delta * jnp.exp(-entropy))
  accept = (pk > threshold[..., None]).astype(jnp.float32)
  return _verdict(q, accept, pk, p[:, k], draft_tokens_bk)


# ----------------------------------------------------------------------------- registry

RULES: dict[str, Rule] = {
    "sd": exact, "lossy": lossy, "static": static, "static_logit": static_logit,
    "diversed": diversed, "cascade": cascade, "mentored": mentored, "typical": typical,
}
# 'ar' drafts nothing; 'smc' weighs every draft instead of accepting some (smc.py); 'ssd'
# schedules the drafting of 'sd' (ssd.py).
assert set(RULES) == set(METHODS) - {"ar", "smc", "ssd"}


def get_rule(method: str) -> Rule:
  """The rule registered under `method`; ValueError naming it and the choices otherwise."""
  if method not in RULES:
    extra = {"ar": " ('ar' decodes without drafts and has no rule)",
             "smc": " ('smc' weighs particles instead: speculative.smc)",
             "ssd": " ('ssd' verifies with 'sd': speculative.ssd)"}.get(method, "")
    raise ValueError(f"no verification rule for method {method!r}{extra}; "
                     f"choices: {tuple(RULES)}")
  return RULES[method]


def verify(draft_logits_bjv, target_logits_bkv1, draft_tokens_bk, params: VerifyParams,
           weights_bk1=None) -> Verdict:
  """get_rule(params.method)(...): the rule chosen by the (static) params."""
  return get_rule(params.method)(draft_logits_bjv, target_logits_bkv1, draft_tokens_bk, params,
                                 weights_bk1)


# ------------------------------------------------------------------------ resolve a round


@flax.struct.dataclass
class RoundOutcome:
  """One round's result per row.

  num_accepted_b [B] int32: n, the number of leading accepted drafts (0..K).
  next_token_b [B] int32: the residual sample at index n if n < K, else the bonus sample.
  accepted_bk [B, K] bool: the leading-accept mask (True exactly for i < n).
  tokens_bk1 [B, K+1] int32: the round's emitted tokens x_1..x_n, next_token at index n,
    -1 placeholders after it.
  """
  num_accepted_b: jax.Array
  next_token_b: jax.Array
  accepted_bk: jax.Array
  tokens_bk1: jax.Array


def leading_accepts(accept_prob_bk: jax.Array, uniforms_bk: jax.Array):
  """accepted_i = u_i < a_i (P = a_i for u ~ U[0, 1)); returns (leading mask [B, K] bool,
  n = sum(cumprod(accepted)) [B] int32)."""
  accepted = (uniforms_bk < accept_prob_bk).astype(jnp.int32)
  lead = jnp.cumprod(accepted, axis=-1)
  return lead.astype(bool), jnp.sum(lead, axis=-1).astype(jnp.int32)


def resolve_round(verdict: Verdict, draft_tokens_bk: jax.Array, key: jax.Array) -> RoundOutcome:
  """Draws the round: independent uniforms per position give n; then one sample per row from
  the law at index n (the residual r_n if n < K, else the bonus law). Gathering the law
  before sampling samples one law per row instead of K + 1 (sampling every position's law
  dominated the round's cost at batch 8); the emitted law is the same. Returns
  RoundOutcome."""
  key_u, key_next = jax.random.split(key)
  uniforms = jax.random.uniform(key_u, verdict.accept_prob_bk.shape, jnp.float32)
  accepted_bk, n_b = leading_accepts(verdict.accept_prob_bk, uniforms)
  laws_bk1v = jnp.concatenate([verdict.residual_bkv, verdict.bonus_bv[:, None]], axis=1)
  law_bv = jnp.take_along_axis(laws_bk1v, n_b[:, None, None], axis=1)[:, 0]
  next_b = sample_categorical(key_next, law_bv)
  positions = jnp.arange(laws_bk1v.shape[1])
  drafts_bk1 = jnp.concatenate(
      [draft_tokens_bk.astype(jnp.int32), jnp.full_like(n_b[:, None], -1)], axis=1)
  tokens_bk1 = jnp.where(positions < n_b[:, None], drafts_bk1,
                         jnp.where(positions == n_b[:, None], next_b[:, None], -1))
  return RoundOutcome(num_accepted_b=n_b, next_token_b=next_b, accepted_bk=accepted_bk,
                      tokens_bk1=tokens_bk1)


# ------------------------------------------------------------- greedy rounds on two tokens

# Rules whose verdict at temperature 0 depends on p and q only through their argmax tokens.
POINT_MASS_RULES = ("sd", "lossy", "static", "diversed", "mentored", "typical")
# Rules `greedy_round` runs: those, and cascade, whose deferral also reads per-position
# scalars of the temperature-1 laws (`cascade_greedy_keeps_draft`). Not the logit mixture,
# whose argmax can be a third token.
TWO_TOKEN_RULES = POINT_MASS_RULES + ("cascade",)


def greedy_round(draft_logits_bjv, target_logits_bkv1, params: VerifyParams, weights_bk1,
                 key) -> tuple[Verdict, RoundOutcome]:
  """A round at temperature 0 for a rule in TWO_TOKEN_RULES, with drafts x_i = argmax q_i
  (what greedy drafting proposes; the drafts are not an argument).

  At T = 0 every law a rule builds is supported on {argmax p_i, argmax q_i}, so the rule
  runs on that two-token vocabulary per position ([B, K+1, 2] instead of [B, K+1, V]) and
  the drawn token is mapped back: the same verdict statistics and law as the full rule,
  without a vocabulary-wide pass beyond the two argmaxes (and, for cascade, the
  temperature-1 scalars its deferral reads). Cascade's pi is then a point mass on one of
  the two slots, verified as exact SD against that point mass.

  Returns (verdict, outcome); the verdict's laws are over the two slots [argmax p,
  argmax q] of each position, its acceptance and beta those of the full rule.
  """
  if params.method not in TWO_TOKEN_RULES:
    raise ValueError(f"greedy_round runs the rules {TWO_TOKEN_RULES}, not {params.method!r}")
  k = target_logits_bkv1.shape[1] - 1
  p_star = distributions.argmax(target_logits_bkv1)  # [B, K+1]
  q_star = distributions.argmax(draft_logits_bjv)  # [B, J]
  j = q_star.shape[1]
  # Slot 0 holds argmax p, slot 1 argmax q (when q is absent at K+1 or agrees, argmax p).
  q_pad = jnp.concatenate([q_star, p_star[:, j:]], axis=1)
  support_bk12 = jnp.stack([p_star, q_pad], axis=-1)
  draft_slot_bj = (q_star != p_star[:, :j]).astype(jnp.int32)
  point = lambda slot: jnp.where(jnp.arange(2) == slot[..., None], 0.0, -jnp.inf)
  target_slot_bk1 = jnp.zeros_like(p_star)
  rule = get_rule(params.method)
  if params.method == "cascade":
    keeps = cascade_greedy_keeps_draft(draft_logits_bjv, target_logits_bkv1[:, :j],
                                       params.cascade_rule, params.cascade_alpha)
    target_slot_bk1 = target_slot_bk1.at[:, :j].set(jnp.where(keeps, draft_slot_bj, 0))
    rule = exact
  verdict = rule(point(draft_slot_bj), point(target_slot_bk1), draft_slot_bj[:, :k], params,
                 weights_bk1)
  outcome = resolve_round(verdict, draft_slot_bj[:, :k], key)
  slots_bk1 = outcome.tokens_bk1  # slot indices, -1 after n
  tokens_bk1 = jnp.where(slots_bk1 < 0, -1, jnp.take_along_axis(
      support_bk12, jnp.maximum(slots_bk1, 0)[..., None], axis=-1)[..., 0])
  next_b = jnp.take_along_axis(tokens_bk1, outcome.num_accepted_b[:, None], axis=1)[:, 0]
  return verdict, outcome.replace(next_token_b=next_b, tokens_bk1=tokens_bk1)
