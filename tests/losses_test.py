"""Tests of the DIVERSED RL objective: advantages, log nu_t, the acceptance regulariser, PPO
clipping, the optimiser and the train step."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from diversed_jax.rl import head as head_lib
from diversed_jax.rl import losses
from diversed_jax.rl import optim

B, T, DQ, DP = 4, 5, 3, 4


def identity_head(params, h_q, h_p):
  """A 'head' whose parameters are w_bt itself: gradients of the loss wrt w_t, directly."""
  del h_q, h_p
  return params


def make_batch(key, advantages_b=None, b=B, t=T, v=7):
  """A toy rollout batch from random p, q over V tokens; tokens drawn from q."""
  k = jax.random.split(key, 6)
  p = jax.nn.softmax(2 * jax.random.normal(k[0], (b, t, v)))
  q = jax.nn.softmax(2 * jax.random.normal(k[1], (b, t, v)))
  x = jax.random.categorical(k[2], jnp.log(q))
  gather = lambda d: jnp.take_along_axis(d, x[..., None], -1)[..., 0]
  mask = jnp.ones((b, t)).at[0, t - 2:].set(0.0)  # a row that ended early
  if advantages_b is None:
    advantages_b = jax.random.normal(k[3], (b,))
  return {
      "h_q_btd": jax.random.normal(k[4], (b, t, DQ)),
      "h_p_btd": jax.random.normal(k[5], (b, t, DP)),
      "p_tok_bt": gather(p), "q_tok_bt": gather(q),
      "tv_pq_bt": 0.5 * jnp.abs(p - q).sum(-1),
      "mask_bt": mask,
      "advantages_b": jnp.asarray(advantages_b, jnp.float32),
  }


# ---------------------------------------------------------------- masked helpers, advantages


def test_masked_helpers():
  x = jnp.array([[1.0, 2.0, 100.0], [3.0, 4.0, 5.0]])
  m = jnp.array([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
  assert float(losses.masked_sum(x, m)) == 15.0
  np.testing.assert_allclose(losses.masked_mean(x, m, axis=-1), [1.5, 4.0])
  assert float(losses.masked_mean(x, jnp.zeros_like(m))) == 0.0
  white = losses.masked_whiten(x, m)
  vals = np.array([1.0, 2.0, 3.0, 4.0, 5.0])
  expected = (vals - 3.0) / math.sqrt(2.0)  # population std of 1..5 is sqrt(2)
  np.testing.assert_allclose(white[m > 0], expected, rtol=1e-6)
  assert float(white[0, 2]) == 0.0


def test_reinforce_pp_advantages_by_hand():
  # Two prompts (ids 0 and 1) with 3 rollouts each, interleaved.
  rewards = jnp.array([1.0, 3.0, 0.0, 3.0, 6.0, 2.0])
  ids = jnp.array([0, 1, 0, 1, 1, 0])
  # Group means: id 0 -> (1 + 0 + 2)/3 = 1, id 1 -> (3 + 3 + 6)/3 = 4.
  centred = np.array([0.0, -1.0, -1.0, -1.0, 2.0, 1.0])
  # Batch mean of centred = 0, population variance = (0+1+1+1+4+1)/6 = 4/3.
  expected = centred / math.sqrt(4.0 / 3.0)
  got = losses.reinforce_pp_advantages(rewards, ids, 1e-8)
  np.testing.assert_allclose(got, expected, rtol=1e-6)
  np.testing.assert_allclose(
      jax.jit(losses.ADVANTAGES["reinforce_pp"])(rewards, ids, 1e-8), expected, rtol=1e-6)


def test_reinforce_pp_padding_row_and_constant_rewards():
  rewards = jnp.array([1.0, 3.0, 0.0, 3.0, 6.0, 2.0, 99.0])
  ids = jnp.array([0, 1, 0, 1, 1, 0, 0])
  mask = jnp.array([1, 1, 1, 1, 1, 1, 0])
  got = losses.reinforce_pp_advantages(rewards, ids, 1e-8, mask_b=mask)
  expected = np.array([0.0, -1.0, -1.0, -1.0, 2.0, 1.0, 0.0]) / math.sqrt(4.0 / 3.0)
  np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-7)
  # Every group solved equally: no signal, no NaN.
  flat = losses.reinforce_pp_advantages(jnp.ones(4), jnp.array([0, 0, 1, 1]), 1e-8)
  np.testing.assert_array_equal(flat, 0.0)


@pytest.mark.parametrize("advantage", ["reinforce_pp", "grpo"])
@pytest.mark.parametrize("group_size", [3, 5, 6])
def test_constant_groups_give_zero_advantages(advantage, group_size):
  # The float32 mean of G equal rewards is not always the reward (G not a power of two); the
  # leftover ~1e-8, whitened by a std of ~1e-8, used to become O(1) noise advantages.
  rng = np.random.default_rng(0)
  ids = jnp.repeat(jnp.arange(4), group_size)
  fn = losses.get_advantage_fn(advantage)
  for _ in range(50):
    rewards = jnp.repeat(jnp.asarray(rng.uniform(0, 1, 4), jnp.float32), group_size)
    np.testing.assert_array_equal(fn(rewards, ids), 0.0)


def test_other_advantage_estimators_by_hand():
  rewards = jnp.array([1.0, 3.0, 0.0, 3.0, 6.0, 2.0])
  ids = jnp.array([0, 1, 0, 1, 1, 0])
  np.testing.assert_allclose(  # batch mean 15/6 = 2.5
      losses.get_advantage_fn("reinforce")(rewards, ids, 1e-8),
      [-1.5, 0.5, -2.5, 0.5, 3.5, -0.5])
  # Group std: id 0 -> sqrt((0+1+1)/3), id 1 -> sqrt((1+1+4)/3).
  s0, s1 = math.sqrt(2 / 3), math.sqrt(2.0)
  np.testing.assert_allclose(
      losses.get_advantage_fn("grpo")(rewards, ids, 0.0),
      [0.0, -1 / s1, -1 / s0, -1 / s1, 2 / s1, 1 / s0], rtol=1e-6)
  with pytest.raises(ValueError, match="reinforce_pp"):
    losses.get_advantage_fn("ppo_gae")


# ---------------------------------------------------------------- log nu, regulariser


def test_log_nu_matches_full_distributions():
  k = jax.random.split(jax.random.key(0), 4)
  p = jax.nn.softmax(3 * jax.random.normal(k[0], (3, 4, 7)))
  q = jax.nn.softmax(3 * jax.random.normal(k[1], (3, 4, 7)))
  w = jax.random.uniform(k[2], (3, 4))
  nu = w[..., None] * p + (1 - w[..., None]) * q
  x = jax.random.categorical(k[3], jnp.log(nu))
  gather = lambda d: jnp.take_along_axis(d, x[..., None], -1)[..., 0]
  np.testing.assert_allclose(losses.log_nu(w, gather(p), gather(q)), jnp.log(gather(nu)),
                             rtol=1e-5)
  # Extremes: w = 1 is log p, w = 0 is log q; padding (p = q = 0) stays finite, zero gradient.
  np.testing.assert_allclose(losses.log_nu(jnp.ones((3, 4)), gather(p), gather(q)),
                             jnp.log(gather(p)), rtol=1e-6)
  np.testing.assert_allclose(losses.log_nu(jnp.zeros((3, 4)), gather(p), gather(q)),
                             jnp.log(gather(q)), rtol=1e-6)
  g = jax.grad(lambda w: losses.log_nu(w, jnp.zeros(()), jnp.zeros(())))(0.5)
  assert np.isfinite(losses.log_nu(0.5, 0.0, 0.0)) and float(g) == 0.0


def test_regulariser_value_and_gradient_sign():
  batch = make_batch(jax.random.key(1))
  w = jax.random.uniform(jax.random.key(2), (B, T))
  tv, mask = batch["tv_pq_bt"], batch["mask_bt"]
  reg = losses.acceptance_regulariser(w, tv, mask)
  np.testing.assert_allclose(reg, np.sum((1 - w * tv) * mask) / B, rtol=1e-6)
  g = jax.grad(losses.acceptance_regulariser)(w, tv, mask)
  np.testing.assert_allclose(g, -tv * mask / B, rtol=1e-6)
  assert bool(jnp.all(g[mask > 0] < 0))  # TV > 0 almost surely for random p, q
  assert bool(jnp.all(g[mask == 0] == 0))


@pytest.mark.parametrize("adv_scale", [0.0, 1.0, -1.0, 1e3, -1e3])
@pytest.mark.parametrize("lam", [0.01, 1.0])
def test_regulariser_gradient_keeps_its_sign_with_any_reward_term(adv_scale, lam):
  """The loss gradient's regulariser part is +lambda TV mask / B wrt w_t, whatever the policy
  term (the released code scales it by a factor whose sign flips with the reward loss)."""
  batch = make_batch(jax.random.key(3), advantages_b=adv_scale * jnp.array([1.0, -2.0, 0.5, 3.0]))
  w = jax.random.uniform(jax.random.key(4), (B, T), minval=0.05, maxval=0.95)
  grad = lambda lam_: jax.grad(
      lambda w_: losses.diversed_loss(w_, identity_head, batch, lam_)[0])(w)
  reg_part = grad(lam) - grad(0.0)
  expected = lam * batch["tv_pq_bt"] * batch["mask_bt"] / B
  np.testing.assert_allclose(reg_part, expected, rtol=1e-3, atol=1e-5 * max(1.0, abs(adv_scale)))
  live = batch["mask_bt"] > 0
  assert bool(jnp.all(reg_part[live] > 0))  # descent on the loss lowers w, raising 1 - w TV


def test_regulariser_only_step_lowers_w_and_raises_acceptance():
  head = head_lib.EnsembleHead("linear")
  params = head_lib.init_head(head, jax.random.key(0), DQ, DP)
  batch = make_batch(jax.random.key(5), advantages_b=jnp.zeros(B))  # no reward signal
  step = jax.jit(optim.make_train_step(head.apply, optax.sgd(0.5), lam=1.0))
  new_params, _, m0 = step(params, optax.sgd(0.5).init(params), batch)
  _, m1 = losses.diversed_loss(new_params, head.apply, batch, 1.0)
  assert float(m1["w_mean"]) < float(m0["w_mean"]) == 0.5
  assert float(m1["acceptance_proxy"]) > float(m0["acceptance_proxy"])


# ---------------------------------------------------------------- policy term


def test_loss_value_by_hand_without_clipping():
  batch = make_batch(jax.random.key(6))
  w = jax.random.uniform(jax.random.key(7), (B, T))
  loss, m = losses.diversed_loss(w, identity_head, batch, lam=0.3)
  nu = w * batch["p_tok_bt"] + (1 - w) * batch["q_tok_bt"]
  mask, tv, adv = batch["mask_bt"], batch["tv_pq_bt"], batch["advantages_b"]
  policy = -np.sum(np.log(nu) * adv[:, None] * mask) / B
  reg = np.sum((1 - w * tv) * mask) / B
  np.testing.assert_allclose(m["policy_loss"], policy, rtol=1e-5)
  np.testing.assert_allclose(loss, policy - 0.3 * reg, rtol=1e-5)
  np.testing.assert_allclose(m["w_mean"], np.sum(w * mask) / np.sum(mask), rtol=1e-6)
  # clip_eps without old_logp_bt is plain REINFORCE.
  np.testing.assert_allclose(
      losses.diversed_loss(w, identity_head, batch, 0.3, clip_eps=0.2)[0], loss, rtol=1e-6)


def test_ppo_clipping_by_hand():
  # Row 0 has A = +1, row 1 has A = -2; ratios r chosen per token; w = 0.5 everywhere.
  adv = np.array([1.0, -2.0])
  r = np.array([[1.5, 1.1], [0.5, 1.5]])
  p_tok = np.array([[0.6, 0.2], [0.3, 0.1]])
  q_tok = np.array([[0.2, 0.4], [0.5, 0.3]])
  w = jnp.full((2, 2), 0.5)
  nu = 0.5 * p_tok + 0.5 * q_tok
  batch = {
      "h_q_btd": jnp.zeros((2, 2, DQ)), "h_p_btd": jnp.zeros((2, 2, DP)),
      "p_tok_bt": jnp.asarray(p_tok), "q_tok_bt": jnp.asarray(q_tok),
      "tv_pq_bt": jnp.full((2, 2), 0.3), "mask_bt": jnp.ones((2, 2)),
      "advantages_b": jnp.asarray(adv),
      "old_logp_bt": jnp.asarray(np.log(nu) - np.log(r), jnp.float32),
  }
  # min(r A, clip(r, 0.8, 1.2) A) per token:
  #   row 0: min(1.5, 1.2) = 1.2 (clipped), min(1.1, 1.1) = 1.1
  #   row 1: min(-1.0, -1.6) = -1.6 (clipped), min(-3.0, -2.4) = -3.0 (not clipped)
  # policy_loss = -((1.2 + 1.1) + (-1.6 - 3.0)) / 2 = 1.15
  loss_fn = lambda w_: losses.diversed_loss(w_, identity_head, batch, lam=0.0, clip_eps=0.2)
  (loss, m), g = jax.value_and_grad(loss_fn, has_aux=True)(w)
  np.testing.assert_allclose(loss, 1.15, rtol=1e-5)
  np.testing.assert_allclose(m["clip_frac"], 0.5)
  np.testing.assert_allclose(m["ratio_mean"], r.mean(), rtol=1e-5)
  np.testing.assert_allclose(m["ratio_max"], 1.5, rtol=1e-5)
  np.testing.assert_allclose(m["approx_kl"], np.mean(r - 1 - np.log(r)), rtol=1e-4)
  # Gradient: 0 on clipped tokens, else -r A (p - q) / nu / B (d log nu / dw = (p - q) / nu).
  unclipped = np.array([[0.0, 1.0], [0.0, 1.0]])
  expected = -unclipped * r * adv[:, None] * (p_tok - q_tok) / nu / 2
  np.testing.assert_allclose(g, expected, rtol=1e-5, atol=1e-7)
  # clip_eps None with old_logp_bt present means the default eps 0.2.
  np.testing.assert_allclose(
      losses.diversed_loss(w, identity_head, batch, lam=0.0)[0], 1.15, rtol=1e-5)


def test_bandit_reward_on_target_favoured_tokens_raises_w():
  """A > 0 on rows whose tokens p likes more than q, A < 0 where q likes them more: the
  REINFORCE term alone must move w_t towards the target (and the reverse must lower it)."""
  head = head_lib.EnsembleHead("linear")
  params = head_lib.init_head(head, jax.random.key(0), DQ, DP)
  base = make_batch(jax.random.key(8), b=2, t=3)
  p_tok = jnp.array([[0.6, 0.5, 0.7], [0.1, 0.2, 0.05]])
  q_tok = jnp.array([[0.1, 0.2, 0.3], [0.5, 0.6, 0.4]])

  def w_after_one_step(adv):
    batch = dict(base, p_tok_bt=p_tok, q_tok_bt=q_tok, mask_bt=jnp.ones((2, 3)),
                 advantages_b=jnp.asarray(adv))
    opt = optax.sgd(0.1)
    new, _, _ = optim.make_train_step(head.apply, opt, lam=0.0)(params, opt.init(params), batch)
    return losses.diversed_loss(new, head.apply, batch, 0.0)[1]["w_mean"]

  assert float(w_after_one_step([1.0, -1.0])) > 0.5
  assert float(w_after_one_step([-1.0, 1.0])) < 0.5


def test_gradients_reach_only_the_head():
  head = head_lib.EnsembleHead("mlp", hidden_dim=8)
  params = head_lib.init_head(head, jax.random.key(0), DQ, DP)
  batch = make_batch(jax.random.key(9))
  g_batch = jax.grad(lambda b: losses.diversed_loss(params, head.apply, b, 1.0)[0])(batch)
  for leaf in jax.tree_util.tree_leaves(g_batch):
    np.testing.assert_array_equal(leaf, 0.0)


# ---------------------------------------------------------------- optimiser, train step


def test_make_optimizer_schedule_and_validation():
  opt = optim.make_optimizer(1e-2, warmup_steps=2, total_steps=10, weight_decay=0.1)
  head = head_lib.EnsembleHead("linear")
  params = head_lib.init_head(head, jax.random.key(0), DQ, DP)
  state = opt.init(params)
  ones = jax.tree_util.tree_map(jnp.ones_like, params)
  upd, _ = opt.update(ones, state, params)  # step 0 of the warm-up: learning rate 0
  for leaf in jax.tree_util.tree_leaves(upd):
    np.testing.assert_array_equal(leaf, 0.0)
  with pytest.raises(ValueError, match="warmup_steps"):
    optim.make_optimizer(1e-3, warmup_steps=10, total_steps=10)
  # Biases are not decayed (that would drag w towards 0.5, not towards init_weight).
  opt = optim.make_optimizer(1.0, 0, 10, weight_decay=0.5, grad_clip=0.0)
  zeros = jax.tree_util.tree_map(jnp.zeros_like, params)
  params = jax.tree_util.tree_map(lambda x: x + 1.0, params)
  upd, _ = opt.update(zeros, opt.init(params), params)
  np.testing.assert_array_equal(upd["params"]["out"]["bias"], 0.0)
  assert bool(jnp.all(upd["params"]["out"]["kernel"] < 0))


@pytest.mark.parametrize("kind", ["linear", "mlp"])
def test_train_step_decreases_loss(kind):
  head = head_lib.EnsembleHead(kind, hidden_dim=8)
  params = head_lib.init_head(head, jax.random.key(0), DQ, DP)
  batch = make_batch(jax.random.key(10))
  batch["old_logp_bt"] = losses.log_nu(jnp.full((B, T), 0.5), batch["p_tok_bt"],
                                       batch["q_tok_bt"])
  opt = optim.make_optimizer(3e-2, warmup_steps=0, total_steps=100, weight_decay=0.01)
  step = jax.jit(optim.make_train_step(head.apply, opt, lam=0.1, clip_eps=0.2),
                 donate_argnums=(0, 1))
  state = opt.init(params)
  losses_seen = []
  for _ in range(3):
    params, state, m = step(params, state, batch)
    losses_seen.append(float(m["loss"]))
    assert float(m["grad_norm"]) > 0
  final = float(losses.diversed_loss(params, head.apply, batch, 0.1, 0.2)[0])
  assert final < losses_seen[1] < losses_seen[0]
  assert step._cache_size() == 1  # one compilation across steps


def test_ppo_update_logs_the_ratio_of_its_last_epoch():
  """The first epoch's head is the one that computed old_logp_bt (ratio 1 everywhere): the
  ratio diagnostics come from the last epoch, the loss still from the first."""
  from diversed_jax.training.trainer import ppo_update
  head = head_lib.EnsembleHead("linear")
  params = head_lib.init_head(head, jax.random.key(0), DQ, DP)
  batch = make_batch(jax.random.key(10))
  w_bt = head.apply(params, batch["h_q_btd"], batch["h_p_btd"])
  batch["old_logp_bt"] = losses.log_nu(w_bt, batch["p_tok_bt"], batch["q_tok_bt"])
  opt = optim.make_optimizer(0.5, warmup_steps=0, total_steps=100, grad_clip=0.0)
  step = jax.jit(optim.make_train_step(head.apply, opt, lam=0.1, clip_eps=0.05))
  _, _, first = step(params, opt.init(params), batch)
  assert float(first["clip_frac"]) == 0.0 and abs(float(first["approx_kl"])) < 1e-6
  _, _, m = ppo_update(step, params, opt.init(params), batch, epochs=3)
  assert float(m["last_epoch_clip_frac"]) > 0 and float(m["last_epoch_approx_kl"]) > 0
  assert float(m["last_epoch_ratio_max"]) > 1.05
  assert not {"clip_frac", "approx_kl", "ratio_mean"} & set(m)
  np.testing.assert_allclose(m["loss"], first["loss"])
