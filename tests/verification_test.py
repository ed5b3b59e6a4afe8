"""Tests of the verification rules: the law each rule emits, acceptance, edge cases.

Statistical tests draw N = 200,000 rounds with fixed seeds over V = 8 tokens. The empirical
law of N draws from a V-category law has E[TV] <= 1/2 sqrt(V/N) ~ 0.003, so laws are compared
with TV_TOL = 0.01 (about 3x that bound); acceptance frequencies (std <= 0.5/sqrt(N) = 0.0011)
with RATE_TOL = 0.005. Each law test also checks that a wrong candidate law (p or q, whenever
it is more than 3 TV_TOL from the right one) is rejected by the same tolerance, so the tests
can fail. Reference laws are re-derived here in numpy, independently of the package.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from diversed_jax.distill import architectures
from diversed_jax.speculative import distributions, verification
from diversed_jax.speculative.types import CASCADE_RULES, Verdict, VerifyParams
from tests import xla_flags

N = 200_000
V = 8
K = 3
TV_TOL = 0.01
RATE_TOL = 0.005
TEMP = 0.8

_RNG = np.random.default_rng(0)
# Per-position scales make the cascade deferral decisions differ across positions.
ZQ = _RNG.normal(size=(K + 1, V)) * np.array([[0.6], [2.5], [1.2], [1.0]])
ZP = _RNG.normal(size=(K + 1, V)) * np.array([[1.5], [1.0], [2.0], [1.3]])
WEIGHTS = np.array([0.3, 0.7, 0.5, 0.2])
# Cascade lenience per rule, chosen so position 1 defers and position 2 keeps the draft
# (chow/diff/opt) and so the acceptance set A is a proper subset at position 1 (v1/v2/v3).
CASCADE_ALPHA = {"chow": 0.6, "diff": 0.1, "opt": 0.3, "v1": 0.35, "v2": 0.35, "v3": 0.7}

PARAMS = {
    "sd": VerifyParams(method="sd", temperature=TEMP),
    "sd_top_p": VerifyParams(method="sd", temperature=TEMP, top_p=0.85),
    "lossy": VerifyParams(method="lossy", temperature=TEMP, lenience=0.5),
    "static": VerifyParams(method="static", temperature=TEMP, weight=0.4),
    "static_top_p": VerifyParams(method="static", temperature=TEMP, weight=0.4, top_p=0.85),
    "static_logit": VerifyParams(method="static_logit", temperature=TEMP, weight=0.4),
    "diversed": VerifyParams(method="diversed", temperature=TEMP),
    "mentored": VerifyParams(method="mentored", temperature=TEMP, epsilon=0.1),
    "mentored_big_eps": VerifyParams(method="mentored", temperature=TEMP, epsilon=0.9),
    "mentored_kl": VerifyParams(method="mentored", temperature=TEMP, epsilon=0.05,
                                divergence="kl"),
    "mentored_chi2": VerifyParams(method="mentored", temperature=TEMP, epsilon=0.1,
                                  divergence="chi2"),
    "mentored_chi2_big_eps": VerifyParams(method="mentored", temperature=TEMP, epsilon=50.0,
                                          divergence="chi2"),
    "typical": VerifyParams(method="typical", temperature=TEMP, typical_delta=0.5),
    **{f"cascade_{r}": VerifyParams(method="cascade", temperature=TEMP, cascade_rule=r,
                                    cascade_alpha=a) for r, a in CASCADE_ALPHA.items()},
    # At temperature 1 the rule reuses the scaled laws for its deferral statistics.
    "cascade_opt_t1": VerifyParams(method="cascade", temperature=1.0, cascade_rule="opt",
                                   cascade_alpha=CASCADE_ALPHA["opt"]),
}


# --------------------------------------------------------------- numpy reference maths


def np_scaled(z, temperature, top_p=1.0):
  z = np.asarray(z, np.float64)
  if temperature == 0:
    return np.eye(z.shape[-1])[np.argmax(z, -1)]
  e = np.exp((z - z.max(-1, keepdims=True)) / temperature)
  probs = e / e.sum(-1, keepdims=True)
  if top_p < 1:
    out = np.zeros_like(probs)
    for idx in np.ndindex(probs.shape[:-1]):
      row = probs[idx]
      order = np.argsort(-row)
      kept = order[:np.searchsorted(np.cumsum(row[order]), top_p) + 1]
      out[idx][kept] = row[kept]
    probs = out / out.sum(-1, keepdims=True)
  return probs


def np_eps_of_c(q, p, c):
  excess = q > p
  return np.sum(np.where(excess, np.minimum(q - p, (c - 1) * p), 0.0))


def np_mentored_c(q, p, eps):
  """c* by plain bisection on eps(c) (inf when eps reaches the finite-ratio excess)."""
  if eps >= np_eps_of_c(q, p, 1e12) - 1e-9:
    return np.inf
  lo, hi = 1.0, 1e12
  for _ in range(200):
    mid = 0.5 * (lo + hi)
    lo, hi = (mid, hi) if np_eps_of_c(q, p, mid) < eps else (lo, mid)
  return 0.5 * (lo + hi)


def np_mentored_law(q, p, c):
  """pi_c = min(q, c p) + (1 - sum min(q, c p)) norm((p - q)+)."""
  accepted = np.minimum(q, c * p)
  deficit = np.maximum(p - q, 0)
  return accepted + (1 - accepted.sum()) * deficit / max(deficit.sum(), 1e-300)


def np_divergence(pi, p, kind):
  on = p > 0
  if kind == "kl":
    keep = on & (pi > 0)
    return float(np.sum(pi[keep] * np.log(pi[keep] / p[keep])))
  return float(np.sum((pi[on] - p[on]) ** 2 / p[on]))  # chi2


def np_mentored_f_c(q, p, eps, kind):
  """The largest c >= 1 with D(pi_c || p) <= eps, by bisection on c itself in float64
  (c_max = max q/p over p > 0 when even it fits)."""
  c_max = max(1.0, float(np.max(np.where(p > 0, q / np.where(p > 0, p, 1), 0))))
  if np_divergence(np_mentored_law(q, p, c_max), p, kind) <= eps:
    return c_max
  lo, hi = 1.0, c_max
  for _ in range(200):
    mid = 0.5 * (lo + hi)
    lo, hi = (mid, hi) if np_divergence(np_mentored_law(q, p, mid), p, kind) <= eps else (lo, mid)
  return lo


def np_cascade(q, p, q1, p1, rule, alpha):
  tv1 = 0.5 * np.abs(q1 - p1).sum()
  keep = {"chow": q1.max() >= 1 - alpha, "diff": q1.max() >= p1.max() - alpha,
          "opt": q1.max() >= p1.max() - alpha * tv1}
  if rule in keep:
    return q if keep[rule] else p
  in_a = {"v1": q1 >= p1.max() - alpha, "v2": p1 >= p1.max() - alpha,
          "v3": p1 >= (1 - alpha) * p1.max()}[rule]
  return np.where(in_a, q, 0) + (1 - q[in_a].sum()) * p


def np_rule(params, i, zq=ZQ, zp=ZP, weights=WEIGHTS):
  """(q_i, acceptance a_i over V, emitted law pi_i) at position i, from first principles."""
  t, top = params.temperature, params.top_p
  q, p = np_scaled(zq[i], t, top), np_scaled(zp[i], t, top)
  resid = np.maximum(p - q, 0)
  resid = resid / resid.sum() if resid.sum() > 0 else p
  ratio = lambda pi: np.where(q > 0, np.minimum(1, pi / np.where(q > 0, q, 1)), 0)
  m = params.method
  if m == "sd":
    pi = p
  elif m == "lossy":
    a = ratio(p / params.lenience)
    return q, a, q * a + (1 - (q * a).sum()) * resid
  elif m in ("static", "diversed"):
    w = params.weight if m == "static" else weights[i]
    pi = w * p + (1 - w) * q
  elif m == "static_logit":
    w = params.weight
    pi = np_scaled(w * zp[i] + (1 - w) * zq[i], t, top)
  elif m == "cascade":
    pi = np_cascade(q, p, np_scaled(zq[i], 1.0), np_scaled(zp[i], 1.0), params.cascade_rule,
                    params.cascade_alpha)
  elif m == "mentored" and params.divergence != "tv":
    a = ratio(np_mentored_f_c(q, p, params.epsilon, params.divergence) * p)
    return q, a, q * a + (1 - (q * a).sum()) * resid
  elif m == "mentored":
    c = np_mentored_c(q, p, params.epsilon)
    if np.isinf(c):  # every x with p > 0 accepted; the budget left goes to q's mass at p = 0
      finite_excess = np.maximum(q - p, 0)[p > 0].sum()
      q_at_zero_p = q[(p <= 0) & (q > 0)].sum()
      rest = np.clip((params.epsilon - finite_excess) / max(q_at_zero_p, 1e-30), 0, 1)
      a = np.where(p > 0, 1.0, rest)
    else:
      a = ratio(c * p)
    return q, a, q * a + (1 - (q * a).sum()) * resid
  elif m == "typical":
    h = -np.sum(np.where(p > 0, p * np.log(np.where(p > 0, p, 1)), 0))
    a = (p > min(params.typical_epsilon, params.typical_delta * np.exp(-h))).astype(float)
    return q, a, q * a + (1 - (q * a).sum()) * p
  return q, ratio(pi), pi


def tv(a, b):
  return 0.5 * np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)).sum()


def empirical(tokens, mask=None):
  tokens = np.asarray(tokens)
  if mask is not None:
    tokens = tokens[np.asarray(mask)]
  return np.bincount(tokens, minlength=V) / max(tokens.size, 1)


# ------------------------------------------------------------------------ the harness


@functools.partial(jax.jit, static_argnames=("params", "k", "with_q_bonus", "n"),
                   compiler_options=xla_flags.OPTIMIZED)
def _simulate(key, zq, zp, weights, params, k, with_q_bonus, n=N):
  """n independent rounds: x_i ~ q_i, the rule, resolve_round. Shapes [n, ...]."""
  j = k + 1 if with_q_bonus else k
  zq, zp, weights = zq[:j], zp[:k + 1], weights[:k + 1]
  key_x, key_r = jax.random.split(key)
  q = distributions.scaled_probs(zq[:k], params.temperature, params.top_p)
  x = distributions.sample_categorical(key_x, jnp.broadcast_to(q, (n, k, zq.shape[-1])))
  bcast = lambda a: jnp.broadcast_to(a, (n,) + a.shape)
  w = bcast(weights) if params.method == "diversed" else None
  verdict = verification.get_rule(params.method)(bcast(zq), bcast(zp), x, params, w)
  return x, verdict, verification.resolve_round(verdict, x, key_r)


def simulate(name, k, seed=0, with_q_bonus=False, zq=ZQ, zp=ZP, n=N):
  x, verdict, out = _simulate(jax.random.PRNGKey(seed), jnp.asarray(zq, jnp.float32),
                              jnp.asarray(zp, jnp.float32), jnp.asarray(WEIGHTS, jnp.float32),
                              PARAMS[name] if isinstance(name, str) else name, k, with_q_bonus,
                              n)
  return jax.tree.map(np.asarray, (x, verdict, out))


def assert_law(emp, law, candidates, what):
  assert tv(emp, law) < TV_TOL, f"{what}: TV(empirical, expected) = {tv(emp, law):.4f}"
  tested = 0
  for name, wrong in candidates.items():
    if tv(law, wrong) > 3 * TV_TOL:
      tested += 1
      assert tv(emp, wrong) > TV_TOL, f"{what}: the wrong law {name} was not rejected"
  return tested


# ----------------------------------------------------------------------- law of output


@pytest.mark.parametrize("k", [1, K])
@pytest.mark.parametrize("name", sorted(PARAMS))
def test_emitted_law(name, k):
  """First emitted token ~ pi_1; for K = 3 the second ~ pi_2 given the first was a draft,
  and the acceptance frequencies match beta (`check_acceptance_equals_beta`)."""
  params = PARAMS[name]
  x, verdict, out = simulate(name, k, seed=k)
  tested = 0
  for i in range(min(k, 2)):
    q, a, pi = np_rule(params, i)
    mask = None if i == 0 else out.num_accepted_b >= i
    emp = empirical(out.tokens_bk1[:, i], mask)
    if params.method == "mentored" and params.divergence != "tv":
      p = np_scaled(ZP[i], params.temperature)
      spent = np_divergence(pi, p, params.divergence)
      assert spent <= params.epsilon + 1e-6
      if params.epsilon < 1:  # the budget is spent; 50 covers every drafted token
        assert spent == pytest.approx(params.epsilon, rel=1e-3)
      else:
        np.testing.assert_allclose(a[p > 0], 1.0, rtol=1e-9)
    elif params.method == "mentored":
      p = np_scaled(ZP[i], params.temperature)
      assert tv(pi, p) <= params.epsilon + 1e-6
      assert tv(emp, p) <= params.epsilon + TV_TOL
      want_rate = min(1.0, 1.0 - tv(p, q) + params.epsilon)
      assert abs((q * a).sum() - want_rate) < 1e-6
      if i == 0:
        assert abs(out.accepted_bk[:, 0].mean() - want_rate) < RATE_TOL
    tested += assert_law(emp, pi, {"p": np_scaled(ZP[i], params.temperature, params.top_p),
                                   "q": q}, f"{name} position {i + 1}")
  assert tested > 0, "no wrong law was far enough to check the test's power"
  if k == K:
    check_acceptance_equals_beta(params, x, verdict, out)


def check_acceptance_equals_beta(params, x, verdict, out):
  """P(accept x_1) = beta_1 = sum_x q a (= sum_x min(q, pi) for the ratio rules)."""
  for i in range(K):
    q, a, pi = np_rule(params, i)
    beta = (q * a).sum()
    if params.method != "typical":  # its residual p can put mass where a = 0
      assert abs(beta - np.minimum(q, pi).sum()) < 1e-6
    np.testing.assert_allclose(verdict.beta_bk[:, i], beta, atol=2e-5)
    np.testing.assert_allclose(verdict.accept_prob_bk[:, i], a[x[:, i]], atol=2e-5)
  assert abs(out.accepted_bk[:, 0].mean() - verdict.beta_bk[0, 0]) < RATE_TOL
  # Leading accepts: P(n >= 2) = beta_1 beta_2 (positions are independent here).
  assert abs(np.mean(out.num_accepted_b >= 2) - np.prod(verdict.beta_bk[0, :2])) < RATE_TOL


# A draft with a truncated output head (distillation's kept vocabulary) has logits NEG_INF
# outside its kept ids, so q = 0 there: ids 1, 4 and 7 are never proposed.
UNPROPOSED = np.array([1, 4, 7])
ZQ_TRUNCATED = np.where(np.isin(np.arange(V), UNPROPOSED), architectures.NEG_INF, ZQ)


@pytest.mark.parametrize("name", ["sd", "lossy", "diversed", "static_logit", "mentored_kl",
                                  "cascade_v1", "typical"])
def test_emitted_law_with_a_truncated_draft_vocabulary(name):
  """The ids the draft cannot propose come out, from the residual, as often as the rule's
  law says (for exact SD: as often as p; never for a law without them), and the verdict
  stays finite."""
  params = PARAMS[name]
  x, verdict, out = simulate(name, 1, seed=11, zq=ZQ_TRUNCATED)
  assert not np.isin(x, UNPROPOSED).any()
  for leaf in jax.tree.leaves(verdict):
    assert np.all(np.isfinite(leaf))
  q, _, pi = np_rule(params, 0, zq=ZQ_TRUNCATED)
  emp = empirical(out.tokens_bk1[:, 0])
  if pi[UNPROPOSED].sum() < 1e-9:  # the logit mixture, and cascade keeping the draft here
    assert emp[UNPROPOSED].sum() == 0
  else:
    assert pi[UNPROPOSED].sum() > 0.1  # enough to see a rule that drops them
  assert_law(emp, pi, {"p": np_scaled(ZP[0], params.temperature, params.top_p), "q": q,
                       "pi on proposable ids": np.where(q > 0, pi, 0) / pi[q > 0].sum()},
             f"{name} with a truncated draft")


# ------------------------------------------------------------------------- bonus token


@pytest.mark.parametrize("name,with_q_bonus,law", [
    ("sd", False, "p"), ("sd", True, "p"), ("static", True, "nu"), ("diversed", True, "nu"),
    ("static_logit", True, "nu"), ("static", False, "p"), ("cascade_v1", False, "p"),
    ("cascade_v1", True, "nu"), ("mentored", False, "p"), ("typical", False, "p"),
])
def test_bonus_law(name, with_q_bonus, law):
  """When all K drafts are accepted the next token ~ nu_{K+1} (ensembles given q_{K+1}) or
  p_{K+1}."""
  params = PARAMS[name]
  k = 1
  x, verdict, out = simulate(name, k, seed=5, with_q_bonus=with_q_bonus)
  all_in = out.num_accepted_b == k
  assert all_in.sum() > N // 4
  np.testing.assert_array_equal(out.next_token_b, out.tokens_bk1[:, 1].clip(0) * all_in +
                                out.tokens_bk1[:, 0] * ~all_in)
  p_bonus = np_scaled(ZP[k], params.temperature, params.top_p)
  want = p_bonus if law == "p" else np_rule(params, k)[2]
  emp = empirical(out.next_token_b, all_in)
  q_bonus = np_scaled(ZQ[k], params.temperature)
  assert_law(emp, want, {"p": p_bonus, "q": q_bonus}, f"{name} bonus")
  if law == "nu":
    assert tv(want, p_bonus) > 3 * TV_TOL  # the ensemble's bonus really is not p


# -------------------------------------------------------------------------- edge cases


@pytest.mark.parametrize("name", ["sd", "lossy", "static", "static_logit", "diversed",
                                  "mentored", "cascade_chow", "cascade_diff", "cascade_opt"])
def test_p_equals_q_accepts_everything(name):
  x, verdict, out = simulate(name, K, seed=3, zq=ZP, zp=ZP, n=4096)
  np.testing.assert_allclose(verdict.accept_prob_bk, 1.0, atol=1e-6)
  if name == "static_logit":  # softmax(w z + (1-w) z) may differ from softmax(z) in the ulp
    assert np.mean(out.num_accepted_b == K) > 1 - 1e-3
  else:
    assert np.all(out.num_accepted_b == K)


@pytest.mark.parametrize("name", sorted(PARAMS))
def test_temperature_zero(name):
  """Greedy: one-hot laws, no NaN anywhere; exact SD emits argmax p at every position."""
  params = dataclasses.replace(PARAMS[name], temperature=0.0)
  x, verdict, out = simulate(params, K, seed=2, with_q_bonus=True, n=20_000)
  for leaf in jax.tree.leaves(verdict):
    assert np.all(np.isfinite(leaf))
  np.testing.assert_array_equal(x, np.broadcast_to(np.argmax(ZQ[:K], -1), x.shape))
  if params.method == "sd":
    want = np.argmax(ZP, -1)
    n = out.num_accepted_b
    assert np.all(out.next_token_b == want[n])
    first_mismatch = np.argmax(np.append(np.argmax(ZQ[:K], -1) != want[:K], True))
    assert np.all(n == first_mismatch)
  if params.method == "mentored" and params.divergence == "tv":
    # argmax q != argmax p at position 1: accept w.p. eps
    assert abs(out.accepted_bk[:, 0].mean() - params.epsilon) < 0.015  # std <= 0.0036
  q, a, pi = np_rule(params, 0)  # the first emitted token's law, as at T > 0
  assert tv(empirical(out.tokens_bk1[:, 0]), pi) < TV_TOL, name


def test_hand_computed_example():
  """V = 3, q = (.5, .3, .2), p = (.2, .3, .5), draft x = 0: a = p/q = 0.4 for SD,
  min(1, w p/q + 1 - w) = 0.7 for the w = 0.5 ensemble, p/(l q) = 0.8 for l = 0.5, and
  c* = 1.5 (eps(c) = min(.3, (c-1) .2) = .1), a = 0.6 for mentored eps = 0.1. The residual
  norm((p-q)+) is the point mass on token 2."""
  q, p = np.array([0.5, 0.3, 0.2]), np.array([0.2, 0.3, 0.5])
  dl = jnp.log(jnp.asarray(np.stack([q, q])))[None]
  tl = jnp.log(jnp.asarray(np.stack([p, p, p])))[None]
  x = jnp.array([[0, 1]])
  want = {"sd": 0.4, "static": 0.7, "lossy": 0.8, "mentored": 0.6}
  for method, a0 in want.items():
    verdict = verification.get_rule(method)(dl, tl, x, VerifyParams(method=method, weight=0.5,
                                                                    lenience=0.5, epsilon=0.1))
    np.testing.assert_allclose(verdict.accept_prob_bk, [[a0, 1.0]], atol=1e-6)
    np.testing.assert_allclose(verdict.residual_bkv[0, 0], [0, 0, 1], atol=1e-6)
    for u0, n in ((a0 - 0.01, 2), (a0 + 0.01, 0)):
      mask, n_b = verification.leading_accepts(verdict.accept_prob_bk, jnp.array([[u0, 0.5]]))
      assert int(n_b[0]) == n and mask.tolist() == [[n == 2, n == 2]]
    out = verification.resolve_round(verdict, x, jax.random.PRNGKey(0))
    if int(out.num_accepted_b[0]) < 2:
      assert int(out.next_token_b[0]) == 2
  # SD beta = sum min(q, p) = .2 + .3 + .2 = .7; ensemble beta = 1 - w TV = 1 - .5 * .3.
  sd = verification.exact(dl, tl, x, VerifyParams())
  np.testing.assert_allclose(sd.beta_bk, [[0.7, 0.7]], atol=1e-6)
  st = verification.static(dl, tl, x, VerifyParams(method="static", weight=0.5))
  np.testing.assert_allclose(st.beta_bk, [[0.85, 0.85]], atol=1e-6)
  # Second draft rejected: n = 1 and the token at index 1 is the residual sample.
  mask, n_b = verification.leading_accepts(jnp.array([[0.4, 0.3]]), jnp.array([[0.1, 0.5]]))
  assert mask.tolist() == [[True, False]] and n_b.tolist() == [1]


def test_mentored_newton_solver_on_a_full_size_vocabulary():
  # Tens of thousands of breakpoints: the Newton iteration must still land on c*.
  rng = np.random.default_rng(7)
  q = np_scaled(rng.normal(size=(3, 32768)) * 3, 1.0)
  p = np_scaled(rng.normal(size=(3, 32768)) * 3, 1.0)
  for eps in (0.02, 0.3):
    c, a = verification.mentored_accept(jnp.asarray(q, jnp.float32),
                                        jnp.asarray(p, jnp.float32), eps)
    for r in range(3):
      np.testing.assert_allclose(float(c[r]), np_mentored_c(q[r], p[r], eps), rtol=1e-4)
      accept = float((q[r] * np.asarray(a[r], np.float64)).sum())
      assert abs(accept - min(1.0, 1.0 - tv(p[r], q[r]) + eps)) < 1e-4


@pytest.mark.parametrize("seed", range(6))
def test_mentored_scale_matches_bisection(seed):
  rng = np.random.default_rng(seed)
  v = [3, 6, 12, 50, 7, 9][seed]
  q = np_scaled(rng.normal(size=(5, v)) * 2, 1.0)
  p = np_scaled(rng.normal(size=(5, v)) * 2, 1.0)
  if seed >= 4:  # zeros in p (top-p / greedy) where q > 0: c* p/q cannot spend the budget
    p = np_scaled(rng.normal(size=(5, v)) * 2, 1.0, top_p=0.6)
  for eps in (0.0, 0.01, 0.1, 0.3, 0.7, 1.0):
    c, a = verification.mentored_accept(jnp.asarray(q, jnp.float32),
                                        jnp.asarray(p, jnp.float32), eps)
    c, a = np.asarray(c, np.float64), np.asarray(a, np.float64)
    for r in range(5):
      want_c = np_mentored_c(q[r], p[r], eps)
      if np.isinf(want_c):
        assert np.isinf(c[r]) or c[r] > 1e5
      else:
        np.testing.assert_allclose(c[r], want_c, rtol=1e-4)
      tv_pq = tv(p[r], q[r])
      assert abs((q[r] * a[r]).sum() - min(1.0, 1.0 - tv_pq + eps)) < 1e-5
      resid = np.maximum(p[r] - q[r], 0)
      resid = resid / resid.sum() if resid.sum() > 0 else p[r]
      pi = q[r] * a[r] + (1 - (q[r] * a[r]).sum()) * resid
      assert tv(pi, p[r]) <= min(eps, tv_pq) + 1e-5


@pytest.mark.parametrize("kind", ["kl", "chi2"])
@pytest.mark.parametrize("eps", [0.05, 1e6])
def test_mentored_search_stays_finite_at_extreme_ratios(kind, eps):
  """p(x) = 1e-35, q/p = 5e34 (a GPU's subnormal p would overflow q/p to inf), beside a
  p = 0 < q token: the search clamps c at 1e30, never accepts the p = 0 token, and keeps
  its budget. c = inf itself must not make the law NaN (c p on p = 0)."""
  q = np.asarray([0.5, 0.2, 0.1, 0.1, 0.1])
  p = np.asarray([1e-35, 0.0, 0.3, 0.3, 0.4])
  pi = verification.mentored_law(jnp.asarray(q, jnp.float32), jnp.asarray(p, jnp.float32),
                                 jnp.asarray(jnp.inf))
  accepted = np.where(p > 0, q, 0.0)  # min(q, inf p), and 0 where p = 0
  deficit = np.maximum(p - q, 0.0)
  np.testing.assert_allclose(pi, accepted + (1 - accepted.sum()) * deficit / deficit.sum(),
                             atol=1e-6)
  c, a = verification.mentored_f_accept(q, p, eps, kind)
  c, a = float(c), np.asarray(a, np.float64)
  assert np.isfinite(c) and 1.0 <= c <= 1e30 * (1 + 1e-6) and np.all(np.isfinite(a))
  assert np.all((0 <= a) & (a <= 1)) and a[1] == 0.0
  assert np_divergence(np_mentored_law(q, p, c), p, kind) <= eps * (1 + 1e-4)
  assert np.sum(q * a) >= 1 - tv(p, q) - 1e-6  # never below exact SD's acceptance


def test_mentored_chi2_budget_holds_for_a_tiny_p():
  """(pi - p)^2 / p with p(x) ~ 1e-38: the square underflows float32 unless divided first."""
  q = np.asarray([0.5, 0.2, 0.1, 0.1, 0.1])
  p = np.asarray([2e-38, 0.0, 0.3, 0.3, 0.4])
  c, _ = verification.mentored_f_accept(q, p, 0.05, "chi2")
  assert np_divergence(np_mentored_law(q, p, float(c)), p, "chi2") <= 0.05 * (1 + 1e-4)


# --------------------------------------------------------------- contract and plumbing


def test_diversed_needs_weights_and_registry_errors():
  zq = jnp.zeros((2, 2, V))
  zp = jnp.zeros((2, 3, V))
  x = jnp.zeros((2, 2), jnp.int32)
  with pytest.raises(ValueError, match="weights_bk1"):
    verification.diversed(zq, zp, x, VerifyParams(method="diversed"))
  with pytest.raises(ValueError, match="nope.*choices"):
    verification.get_rule("nope")
  with pytest.raises(ValueError, match="'ar'"):
    verification.get_rule("ar")
  with pytest.raises(ValueError, match="K\\+1"):
    verification.exact(zq, zq, x, VerifyParams())
  with pytest.raises(ValueError, match="lenience"):
    verification.lossy(zq, zp, x, VerifyParams(method="lossy", lenience=0.0))
  with pytest.raises(ValueError, match="cascade_rule"):
    verification.cascade(zq, zp, x, VerifyParams(method="cascade", cascade_rule="x"))
  assert set(verification.RULES) | {"ar"} == set(
      ["ar", "sd", "lossy", "static", "static_logit", "diversed", "cascade", "mentored",
       "typical"])
  assert set(CASCADE_ALPHA) == set(CASCADE_RULES)


def test_rules_jit_with_static_params_and_match_verdict_shapes():
  b, k = 4, 3
  key = jax.random.PRNGKey(1)
  zq = jax.random.normal(key, (b, k + 1, V))
  zp = jax.random.normal(jax.random.PRNGKey(2), (b, k + 1, V))
  x = jnp.zeros((b, k), jnp.int32)
  w = jnp.full((b, k + 1), 0.5)
  for params in [PARAMS[name] for name in ("sd", "lossy", "static", "static_logit", "diversed",
                                           "cascade_opt", "cascade_v2", "mentored", "typical")]:
    rule = jax.jit(verification.get_rule(params.method), static_argnames="params")
    verdict = rule(zq, zp, x, params=params, weights_bk1=w)
    assert isinstance(verdict, Verdict)
    assert verdict.accept_prob_bk.shape == (b, k) and verdict.beta_bk.shape == (b, k)
    assert verdict.residual_bkv.shape == (b, k, V) and verdict.bonus_bv.shape == (b, V)
    np.testing.assert_allclose(verdict.residual_bkv.sum(-1), 1.0, atol=1e-5)
    np.testing.assert_allclose(verdict.bonus_bv.sum(-1), 1.0, atol=1e-5)
    out = verification.resolve_round(verdict, x, key)
    assert out.tokens_bk1.shape == (b, k + 1) and out.next_token_b.dtype == jnp.int32


# ------------------------------------------------------------------------ distributions


def test_scaled_probs():
  z = jnp.array([[1.0, 2.0, 3.0, 0.0, -jnp.inf]])
  np.testing.assert_allclose(distributions.scaled_probs(z, 0.0), [[0, 0, 1, 0, 0]])
  np.testing.assert_allclose(distributions.scaled_probs(z, jnp.float32(0.0)), [[0, 0, 1, 0, 0]])
  np.testing.assert_allclose(distributions.scaled_probs(z, 0.7),
                             np_scaled(np.array([[1, 2, 3, 0, -np.inf]]), 0.7), atol=1e-6)
  np.testing.assert_allclose(distributions.scaled_probs(z, jnp.float32(0.7)),
                             distributions.scaled_probs(z, 0.7), atol=1e-6)
  # top-p after temperature: (.665, .245, .090, .0) at T = 1, the first two reach 0.8.
  got = distributions.scaled_probs(z, 1.0, top_p=0.8)
  np.testing.assert_allclose(got, np_scaled(np.array([[1, 2, 3, 0, -np.inf]]), 1.0, 0.8),
                             atol=1e-6)
  assert np.count_nonzero(np.asarray(got)) == 2
  assert distributions.scaled_probs(z, 1.0).dtype == jnp.float32
  with pytest.raises(ValueError, match="top_p"):
    distributions.scaled_probs(z, 1.0, top_p=0.0)


def test_sample_categorical_law_and_zeros():
  probs = jnp.array([0.0, 0.5, 0.0, 0.3, 0.2, 0.0, 0.0, 0.0])
  sample = jax.jit(distributions.sample_categorical, compiler_options=xla_flags.OPTIMIZED)
  draws = sample(jax.random.PRNGKey(7), jnp.broadcast_to(probs, (N, V)))
  emp = empirical(draws)
  assert emp[[0, 2, 5, 6, 7]].sum() == 0
  assert tv(emp, probs) < TV_TOL


def test_tv_and_normalize_positive():
  a, b = jnp.array([0.5, 0.3, 0.2]), jnp.array([0.2, 0.3, 0.5])
  np.testing.assert_allclose(distributions.tv_distance(a, b), 0.3, atol=1e-7)
  np.testing.assert_allclose(distributions.overlap(a, b), 0.7, atol=1e-7)
  np.testing.assert_allclose(distributions.normalize_positive(b - a, a), [0, 0, 1], atol=1e-7)
  np.testing.assert_allclose(distributions.normalize_positive(a - a, b), b)


@pytest.mark.parametrize("v", [5, 256, 1000])
def test_blocked_argmax_matches_jnp_argmax(v):
  # Integer-valued logits make ties common; the first maximal index must win, across
  # blocks too (v = 1000 spans four blocks, the last one padded).
  rng = np.random.default_rng(v)
  z = rng.integers(-3, 4, size=(3, 7, v)).astype(np.float32)
  z[0, 0] = -np.inf
  z[0, 1, -1] = np.inf
  z[1, 0, v // 2] = 10.0
  got = distributions.argmax(jnp.asarray(z))
  assert got.dtype == jnp.int32 and got.shape == (3, 7)
  np.testing.assert_array_equal(got, jnp.argmax(jnp.asarray(z), axis=-1))


def test_sample_logits_greedy_and_sampled():
  z = jnp.log(jnp.array([[0.1, 0.6, 0.3, 0.0, 0.0, 0.0, 0.0, 0.0]]))
  key = jax.random.PRNGKey(3)
  assert int(distributions.sample_logits(key, z, 0.0)[0]) == 1
  sample = jax.jit(distributions.sample_logits, static_argnums=2,
                   compiler_options=xla_flags.OPTIMIZED)
  draws = sample(key, jnp.broadcast_to(z, (N, V)), 1.0)
  assert tv(empirical(draws), np.exp(np.asarray(z[0]))) < TV_TOL


_TWO_TOKEN_CASES = ([(m, "opt") for m in verification.POINT_MASS_RULES] +
                    [("cascade", rule) for rule in CASCADE_RULES])


@pytest.mark.parametrize("method,cascade_rule", _TWO_TOKEN_CASES)
@pytest.mark.parametrize("draft_positions", ["K", "K+1"])
def test_greedy_round_on_two_tokens_matches_the_full_rule(method, cascade_rule,
                                                          draft_positions):
  """At temperature 0 the two-token round gives the full rule's acceptance, beta and
  number of accepts for the same key, draws from the same law at n (mapped back to the
  vocabulary), and the same tokens wherever that law is a point mass."""
  rng = np.random.default_rng(3)
  b, vocab = 64, 50
  j = K + (draft_positions == "K+1")
  # Logits of varied sharpness, so the temperature-1 maxima that cascade's deferral reads
  # range from ~1/V to ~1 and both of its branches occur.
  sharp = lambda *shape: rng.normal(size=shape) * rng.uniform(0.5, 6.0, size=shape[:-1] + (1,))
  dl = sharp(b, j, vocab).astype(np.float32)
  tl = sharp(b, K + 1, vocab).astype(np.float32)
  agree = rng.random((b, j)) < 0.6  # argmax p = argmax q at ~60% of positions
  dl[agree] = tl[:, :j][agree]
  weights = jnp.asarray(rng.uniform(0.1, 0.9, size=(b, K + 1)), jnp.float32)
  params = VerifyParams(method=method, temperature=0.0, weight=0.4, lenience=0.5,
                        epsilon=0.3, typical_delta=0.5, cascade_rule=cascade_rule,
                        cascade_alpha=0.3)
  if method == "cascade":  # both deferral outcomes occur where the argmaxes differ
    keeps = np.asarray(verification.cascade_greedy_keeps_draft(dl, tl[:, :j], cascade_rule,
                                                               0.3))
    differ = np.asarray(distributions.argmax(dl) != distributions.argmax(tl[:, :j]))
    assert 0 < int(keeps[differ].sum()) < int(differ.sum())
  dl, tl = jnp.asarray(dl), jnp.asarray(tl)
  w = weights if method == "diversed" else None
  drafts = distributions.argmax(dl[:, :K])
  key = jax.random.PRNGKey(5)
  full = verification.get_rule(method)(dl, tl, drafts, params, w)
  full_out = verification.resolve_round(full, drafts, key)
  small, out = verification.greedy_round(dl, tl, params, w, key)
  np.testing.assert_allclose(small.accept_prob_bk, full.accept_prob_bk, atol=1e-6)
  np.testing.assert_allclose(small.beta_bk, full.beta_bk, atol=1e-6)
  np.testing.assert_array_equal(out.num_accepted_b, full_out.num_accepted_b)
  assert 0 < int(np.sum(out.num_accepted_b)) < b * K  # both accepts and rejections ran
  # The law at n, mapped back to the vocabulary by the slots [argmax p, argmax q].
  n = np.asarray(out.num_accepted_b)
  rows = np.arange(b)
  full_laws = np.concatenate([np.asarray(full.residual_bkv),
                              np.asarray(full.bonus_bv)[:, None]], axis=1)[rows, n]
  small_laws = np.concatenate([np.asarray(small.residual_bkv),
                               np.asarray(small.bonus_bv)[:, None]], axis=1)[rows, n]
  p_star = np.asarray(distributions.argmax(tl))[rows, n]
  q_full = np.concatenate([np.asarray(distributions.argmax(dl)),
                           np.asarray(distributions.argmax(tl))[:, j:]], axis=1)[rows, n]
  mapped = np.zeros((b, vocab))
  np.add.at(mapped, (rows, p_star), small_laws[:, 0])
  np.add.at(mapped, (rows, q_full), small_laws[:, 1])
  np.testing.assert_allclose(mapped, full_laws, atol=1e-6)
  next_tok = np.asarray(out.next_token_b)
  assert np.all(full_laws[rows, next_tok] > 0)
  point = full_laws.max(axis=1) > 1 - 1e-6
  assert point.any()
  np.testing.assert_array_equal(next_tok[point], np.asarray(full_out.next_token_b)[point])
  np.testing.assert_array_equal(np.asarray(out.tokens_bk1)[point],
                                np.asarray(full_out.tokens_bk1)[point])


@pytest.mark.parametrize("eps", [0.0, 0.05, 0.3, 0.9])
def test_mentored_search_on_tv_finds_the_closed_forms_acceptance(eps):
  """`mentored_f_accept`'s bisection with D = TV agrees with the closed form that the TV
  rule uses (`mentored_accept`), up to and past the budget that accepts every draft."""
  q = np.stack([np_scaled(z, TEMP) for z in ZQ])
  p = np.stack([np_scaled(z, TEMP) for z in ZP])
  _, closed = verification.mentored_accept(q, p, eps)
  _, searched = verification.mentored_f_accept(q, p, eps, "tv")
  np.testing.assert_allclose(searched, closed, atol=2e-5)


@pytest.mark.parametrize("kind", ["kl", "chi2"])
def test_mentored_acceptance_rises_with_the_budget(kind):
  """Budget 0 is exact SD (acceptance 1 - TV(p, q)); more budget accepts more, and a
  budget past D(q || p) accepts every draft (all tokens have p > 0 here)."""
  q = np.stack([np_scaled(z, TEMP) for z in ZQ])
  p = np.stack([np_scaled(z, TEMP) for z in ZP])
  rates = np.stack([np.sum(q * np.asarray(verification.mentored_f_accept(q, p, e, kind)[1]),
                           axis=-1) for e in (0.0, 0.01, 0.1, 1.0, 1e6)])
  np.testing.assert_allclose(rates[0], 1 - 0.5 * np.abs(p - q).sum(-1), atol=1e-4)
  assert np.all(np.diff(rates, axis=0) >= -1e-6) and np.all(rates[2] > rates[0] + 0.01)
  np.testing.assert_allclose(rates[-1], 1.0, atol=1e-6)
