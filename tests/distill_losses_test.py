"""The distillation divergences (`distill.losses`) against a direct numpy computation, and
the TV loss's gradient raising the acceptance it bounds."""

import jax
import jax.numpy as jnp
import numpy as np

from diversed_jax.distill import losses

VS, K = 12, 4  # kept vocabulary, target top-k


def _example(seed=0, j=2, b=2, t=3):
  rng = np.random.default_rng(seed)
  logits = rng.normal(size=(j, b, t, VS)).astype(np.float32) * 2
  # The target's top-k as kept indices, one of them outside the kept vocabulary (-1).
  kept = np.stack([rng.choice(VS, K, replace=False) for _ in range(b * t)]).reshape(b, t, K)
  kept[0, 1, 2] = -1
  kept[1, 2, 0] = -1  # and one target argmax
  p = rng.dirichlet(np.ones(K + 1), size=(b, t))[..., :K]  # leaves some mass off the top-k
  p = -np.sort(-p, axis=-1)
  return logits, kept.astype(np.int32), np.log(p).astype(np.float32)


def _numpy_terms(logits, kept, logp):
  q = np.exp(logits - logits.max(-1, keepdims=True))
  q /= q.sum(-1, keepdims=True)
  out = {name: np.zeros(logits.shape[:3])
         for name in ("ce", "tv", "accept", "top1", "argmax_ce")}
  for j, b, t in np.ndindex(*logits.shape[:3]):
    for k in range(K):
      if kept[b, t, k] < 0:
        continue
      pk, qk = np.exp(logp[b, t, k]), q[j, b, t, kept[b, t, k]]
      out["ce"][j, b, t] -= pk * np.log(qk)
      out["tv"][j, b, t] += max(pk - qk, 0.0)
      out["accept"][j, b, t] += min(pk, qk)
    out["top1"][j, b, t] = float(np.argmax(logits[j, b, t]) == kept[b, t, 0])
    if kept[b, t, 0] >= 0:
      out["argmax_ce"][j, b, t] = -np.log(q[j, b, t, kept[b, t, 0]])
  return out


def test_terms_match_numpy():
  logits, kept, logp = _example()
  got = losses.distill_terms(jnp.asarray(logits), jnp.asarray(kept), jnp.asarray(logp))
  want = _numpy_terms(logits, kept, logp)
  for name in want:
    np.testing.assert_allclose(np.asarray(got[name]), want[name], rtol=1e-5, atol=1e-6,
                               err_msg=name)
  # tv + accept is the target's kept top-k mass, whatever the draft does.
  mass = np.sum(np.exp(logp) * (kept >= 0), axis=-1)
  np.testing.assert_allclose(np.asarray(got["tv"] + got["accept"]),
                             np.broadcast_to(mass, got["tv"].shape), rtol=1e-5)


def test_equal_distributions_accept_everything_kept():
  rng = np.random.default_rng(1)
  kept = np.stack([rng.choice(VS, K, replace=False) for _ in range(6)]).reshape(2, 3, K)
  logits = np.full((1,) + kept.shape[:2] + (VS,), -30.0, np.float32)
  for b, t in np.ndindex(*kept.shape[:2]):
    logits[0, b, t, kept[b, t]] = [3.0, 2.0, 1.0, 0.0]
  logp = jax.nn.log_softmax(jnp.asarray([3.0, 2.0, 1.0, 0.0]))
  logp = jnp.broadcast_to(logp, kept.shape)
  got = losses.distill_terms(jnp.asarray(logits), jnp.asarray(kept), logp)
  np.testing.assert_allclose(np.asarray(got["accept"]), 1.0, atol=1e-5)
  np.testing.assert_allclose(np.asarray(got["tv"]), 0.0, atol=1e-5)
  assert np.all(np.asarray(got["top1"]) == 1.0)


def test_tv_descent_raises_acceptance():
  # TV's gradient in a logit is ~q(1 - q): slow from a poor start (why tvd is the
  # fine-tuning loss and kl the from-scratch one), hence many plain steps.
  logits, kept, logp = (jnp.asarray(a) for a in _example(seed=2))

  def tv(lg):
    return jnp.sum(losses.distill_terms(lg, kept, logp)["tv"])

  start = float(jnp.mean(losses.distill_terms(logits, kept, logp)["accept"]))
  step = jax.jit(jax.grad(tv))
  for _ in range(300):
    logits = logits - 3.0 * step(logits)
  end = float(jnp.mean(losses.distill_terms(logits, kept, logp)["accept"]))
  mass = float(jnp.mean(jnp.sum(jnp.exp(logp) * (kept >= 0), axis=-1)))
  assert start < 0.5 * mass and end > 0.9 * mass, (start, end, mass)


def test_argmax_descent_raises_greedy_agreement():
  # The greedy term alone moves every kept target argmax to the draft's argmax.
  logits, kept, logp = (jnp.asarray(a) for a in _example(seed=3))
  has_argmax = np.asarray(kept[..., 0] >= 0)

  def argmax_ce(lg):
    return jnp.sum(losses.distill_terms(lg, kept, logp)["argmax_ce"])

  start = np.asarray(losses.distill_terms(logits, kept, logp)["top1"])
  step = jax.jit(jax.grad(argmax_ce))
  for _ in range(50):
    logits = logits - 1.0 * step(logits)
  end = np.asarray(losses.distill_terms(logits, kept, logp)["top1"])
  assert start[:, has_argmax].mean() < 0.5, start
  assert np.all(end[:, has_argmax] == 1.0), end
  assert np.all(end[:, ~has_argmax] == start[:, ~has_argmax])
