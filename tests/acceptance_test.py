"""Tests of the acceptance statistics against closed forms and Monte Carlo.

Monte Carlo: N = 200,000 rounds, fixed seeds. The accepted count n lies in [0, K] with
std <= K/2, so its mean has std <= 1.5/sqrt(N) ~ 0.0034 for K = 3: tolerance MEAN_TOL = 0.015.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from diversed_jax.speculative import acceptance, distributions, verification
from diversed_jax.speculative.types import VerifyParams
from tests.xla_flags import OPTIMIZED

N = 200_000
V = 4
K = 3
MEAN_TOL = 0.015


def test_rates_are_masked():
  n_rb = jnp.array([[3, 0, 2], [1, 5, 0]])
  active = jnp.array([[True, True, False], [True, False, False]])
  # Active rounds: n = 3, 0, 1 with K = 3: 4 accepted of 9 proposed; tokens (4 + 1 + 2) / 3.
  np.testing.assert_allclose(acceptance.acceptance_rate(n_rb, active, 3), 4 / 9, rtol=1e-6)
  np.testing.assert_allclose(acceptance.tokens_per_round(n_rb, active), 7 / 3, rtol=1e-6)
  emitted = jnp.array([[4, 1, 9], [1, 9, 9]])  # e.g. EOS cut the last active round short
  np.testing.assert_allclose(acceptance.tokens_per_round(n_rb, active, emitted), 2.0)
  nothing = jnp.zeros_like(active)
  assert float(acceptance.acceptance_rate(n_rb, nothing, 3)) == 0.0
  assert float(acceptance.masked_mean(jnp.ones((2, 3)), jnp.array([1.0, 0.0, 1.0]))) == 1.0


@pytest.mark.parametrize("alpha", [0.0, 0.2, 0.5, 0.9, 0.999])
@pytest.mark.parametrize("k", [1, 4, 8])
def test_iid_closed_forms(alpha, k):
  want = alpha * (1 - alpha**k) / (1 - alpha)
  np.testing.assert_allclose(acceptance.iid_accepted_drafts(alpha, k), want, rtol=1e-4)
  np.testing.assert_allclose(acceptance.iid_tokens_per_round(alpha, k),
                             (1 - alpha**(k + 1)) / (1 - alpha), rtol=1e-4)


def test_iid_alpha_one_and_vectorised():
  assert float(acceptance.iid_accepted_drafts(1.0, 5)) == 5.0
  assert float(acceptance.iid_tokens_per_round(1.0, 5)) == 6.0
  got = acceptance.iid_accepted_drafts(jnp.array([[0.0, 1.0]]), 2)
  np.testing.assert_allclose(got, [[0.0, 2.0]])


def test_path_estimators_by_hand():
  a = jnp.array([[0.5, 0.4, 1.0], [0.0, 1.0, 1.0]])
  beta = jnp.array([[0.6, 0.7, 0.8], [0.3, 0.9, 0.9]])
  # .5 + .5*.4 + .5*.4*1 = .9; 0.
  np.testing.assert_allclose(acceptance.path_accepted_length(a), [0.9, 0.0], rtol=1e-6)
  # .6 + .5*.7 + .5*.4*.8 = 1.11; .3 + 0 + 0.
  np.testing.assert_allclose(acceptance.path_accepted_length_beta(a, beta), [1.11, 0.3],
                             rtol=1e-6)
  # .6 + .42 + .336.
  np.testing.assert_allclose(acceptance.independent_accepted_length(beta[:1]), [1.356],
                             rtol=1e-6)


def _sd_rounds(zq_kv, zp_kv1, seed, params=VerifyParams(method="sd")):
  """N rounds of exact SD with position laws independent of the prefix."""
  key_x, key_r = jax.random.split(jax.random.PRNGKey(seed))
  q = distributions.scaled_probs(zq_kv, params.temperature)
  x = distributions.sample_categorical(key_x, jnp.broadcast_to(q, (N,) + q.shape))
  bcast = lambda z: jnp.broadcast_to(z, (N,) + z.shape)
  verdict = verification.verify(bcast(zq_kv), bcast(zp_kv1), x, params)
  return verdict, verification.resolve_round(verdict, x, key_r)


def test_iid_case_matches_monte_carlo():
  """Same q, p at every position: n ~ truncated geometric, E[n] = alpha (1-alpha^K)/(1-alpha)
  with alpha = beta = sum min(q, p); both path estimators are unbiased for it, and the beta
  one has lower variance."""
  rng = np.random.default_rng(1)
  zq, zp = rng.normal(size=V), rng.normal(size=V)
  zq_kv = jnp.asarray(np.tile(zq, (K, 1)), jnp.float32)
  zp_kv1 = jnp.asarray(np.tile(zp, (K + 1, 1)), jnp.float32)
  verdict, out = jax.jit(_sd_rounds, static_argnums=2, compiler_options=OPTIMIZED)(
      zq_kv, zp_kv1, 0)
  alpha = float(verdict.beta_bk[0, 0])
  assert 0.5 < alpha < 0.95
  theory = float(acceptance.iid_accepted_drafts(alpha, K))
  n = np.asarray(out.num_accepted_b)
  assert abs(n.mean() - theory) < MEAN_TOL
  assert abs(n.mean() - theory) < abs(n.mean() - float(acceptance.iid_accepted_drafts(
      alpha - 0.05, K)))  # a wrong alpha is further away
  tokens = acceptance.tokens_per_round(out.num_accepted_b, jnp.ones((N,), bool))
  assert abs(float(tokens) - float(acceptance.iid_tokens_per_round(alpha, K))) < MEAN_TOL
  assert abs(float(acceptance.acceptance_rate(out.num_accepted_b, jnp.ones((N,), bool), K))
             - theory / K) < MEAN_TOL / K
  plain = np.asarray(acceptance.path_accepted_length(verdict.accept_prob_bk))
  low_var = np.asarray(acceptance.path_accepted_length_beta(verdict.accept_prob_bk,
                                                            verdict.beta_bk))
  assert abs(plain.mean() - theory) < MEAN_TOL
  assert abs(low_var.mean() - theory) < MEAN_TOL
  assert low_var.var() < plain.var() < n.var()


def test_independent_positions_match_monte_carlo():
  """Different laws per position (not i.i.d.): E[n] = sum_n prod_{i<=n} beta_i."""
  rng = np.random.default_rng(2)
  zq_kv = jnp.asarray(rng.normal(size=(K, V)) * 1.5, jnp.float32)
  zp_kv1 = jnp.asarray(rng.normal(size=(K + 1, V)) * 1.5, jnp.float32)
  params = VerifyParams(method="sd", temperature=0.7)
  verdict, out = jax.jit(_sd_rounds, static_argnums=(2, 3),
                         compiler_options=OPTIMIZED)(zq_kv, zp_kv1, 3, params)
  theory = float(acceptance.independent_accepted_length(verdict.beta_bk[0]))
  n = np.asarray(out.num_accepted_b)
  assert abs(n.mean() - theory) < MEAN_TOL
  low_var = acceptance.path_accepted_length_beta(verdict.accept_prob_bk, verdict.beta_bk)
  assert abs(float(low_var.mean()) - theory) < MEAN_TOL


def test_prefix_dependent_chain_matches_min_kernel():
  """A Markov toy: q_i and p_i depend on the previous token. E[n] is the min-kernel sum
  sum_n sum_{x_1..x_n} prod_{i<=n} m_i(x_i | x_<i), m = min(q, p), enumerated exactly; the
  speculative loop's mean n and both path estimators must match it."""
  rng = np.random.default_rng(4)
  zq_table = rng.normal(size=(V, V)) * 1.5  # [previous token, V]
  # p close to q after tokens 0 and 2, far after 1 and 3: the rate depends on the prefix.
  zp_table = zq_table + rng.normal(size=(V, V)) * np.array([[0.5], [3.0], [0.3], [3.0]])
  q_table = np.asarray(distributions.scaled_probs(jnp.asarray(zq_table), 1.0), np.float64)
  p_table = np.asarray(distributions.scaled_probs(jnp.asarray(zp_table), 1.0), np.float64)
  m_table = np.minimum(q_table, p_table)
  start = 0
  exact = 0.0
  for n in range(1, K + 1):
    for path in itertools.product(range(V), repeat=n):
      prev, weight = start, 1.0
      for x in path:
        weight *= m_table[prev, x]
        prev = x
      exact += weight

  def rounds(key):
    keys = jax.random.split(key, K + 1)
    prev = jnp.full((N,), start, jnp.int32)
    tokens, zq_rows, zp_rows = [], [], []
    for i in range(K):  # drafting is sequential by nature; K = 3 steps
      zq_rows.append(zq_table[prev])
      zp_rows.append(zp_table[prev])
      prev = distributions.sample_categorical(keys[i], jnp.asarray(q_table)[prev])
      tokens.append(prev)
    zp_rows.append(zp_table[prev])
    x = jnp.stack(tokens, 1)
    verdict = verification.exact(jnp.stack(zq_rows, 1), jnp.stack(zp_rows, 1), x,
                                 VerifyParams(method="sd"))
    return verdict, verification.resolve_round(verdict, x, keys[K])

  zq_table, zp_table = jnp.asarray(zq_table, jnp.float32), jnp.asarray(zp_table, jnp.float32)
  verdict, out = jax.jit(rounds, compiler_options=OPTIMIZED)(jax.random.PRNGKey(5))
  n = np.asarray(out.num_accepted_b)
  plain = np.asarray(acceptance.path_accepted_length(verdict.accept_prob_bk))
  low_var = np.asarray(acceptance.path_accepted_length_beta(verdict.accept_prob_bk,
                                                            verdict.beta_bk))
  assert abs(n.mean() - exact) < MEAN_TOL
  assert abs(plain.mean() - exact) < MEAN_TOL
  assert abs(low_var.mean() - exact) < MEAN_TOL
  # The i.i.d. formula with the first position's rate is not the answer here.
  iid = float(acceptance.iid_accepted_drafts(m_table[start].sum(), K))
  assert abs(iid - exact) > 3 * MEAN_TOL
