"""Context copying: the suffix lookup against a plain-Python reference, the blended law,
the gate's features and checks, and the history following the cache's rows (the copying
draft inside the speculative loop, and the gate's fitting, are in distill_test.py)."""

import numpy as np
import jax
import jax.numpy as jnp
import pytest

from diversed_jax.speculative import context_copy


def _reference_lookup(seq, t, max_ngram):
  """(c, n, count, agree): the token after the latest j < t where seq[j-n+1..j] ==
  seq[t-n+1..t], longest n first; how many such j; whether all were followed by c."""
  for n in range(max_ngram, 0, -1):
    if t + 1 < n:
      continue
    suffix = seq[t + 1 - n:t + 1]
    found = [j for j in range(t - 1, n - 2, -1) if seq[j + 1 - n:j + 1] == suffix]
    if found:
      token = seq[found[0] + 1]
      return token, n, len(found), all(seq[j + 1] == token for j in found)
  return 0, 0, 0, False


@pytest.mark.parametrize("vocab,max_ngram", [(3, 4), (6, 2), (20, 3)])
def test_suffix_lookup_matches_reference(vocab, max_ngram):
  rng = np.random.default_rng(vocab)
  history = rng.integers(0, vocab, size=(3, 40)).astype(np.int32)
  history[1, 20:30] = history[1, 5:15]  # a copied span
  history[2, 12:18] = history[2, 24:30] = history[2, 0:6]  # copied twice
  positions = np.stack([rng.permutation(40)[:7] for _ in range(3)]).astype(np.int32)
  positions[2, 0] = 28  # inside the second copy: two earlier occurrences, both agreeing
  lookup = jax.jit(context_copy.suffix_lookup, static_argnums=2)(
      jnp.asarray(history), jnp.asarray(positions), max_ngram)
  for b in range(3):
    for i, t in enumerate(positions[b]):
      want = _reference_lookup(list(history[b]), int(t), max_ngram)
      got = tuple(int(x[b, i]) if x.dtype != bool else bool(x[b, i]) for x in lookup)
      assert got == want, (b, t)
  assert int(lookup.length_bt.max()) == max_ngram  # the cases include full-length matches
  assert int(lookup.count_bt[2, 0]) == 2 and bool(lookup.agree_bt[2, 0])


def test_lookup_counts_disagreeing_occurrences():
  # "1 2" occurred twice before t = 7, followed by 3 and then 4: the latest (4) is copied.
  history = jnp.asarray([[1, 2, 3, 1, 2, 4, 1, 2]], jnp.int32)
  lookup = context_copy.suffix_lookup(history, jnp.asarray([[7]]), 3)
  assert [int(x[0, 0]) for x in lookup] == [4, 2, 2, False]


def test_lookup_ignores_slots_from_the_query_on():
  """Slots after the query position are stale (rolled back): changing them changes nothing."""
  history = jnp.asarray([[1, 2, 3, 1, 2, 9, 9, 9]], jnp.int32)
  stale = history.at[0, 5:].set(jnp.asarray([3, 1, 2]))
  for h in (history, stale):
    lookup = context_copy.suffix_lookup(h, jnp.asarray([[4]]), 3)
    assert [int(x[0, 0]) for x in lookup] == [3, 2, 1, True]  # "1 2" -> 3, once


def test_blend_is_the_mixture_law():
  logits = jnp.asarray([[[1.0, 0.0, -1.0, -1e30]]])
  q = np.array(jax.nn.softmax(logits)[0, 0])
  for token, lam in ((2, 0.3), (3, 0.6), (0, 0.0)):
    mixed = context_copy.blend(logits, jnp.asarray([[token]]), jnp.asarray([[lam]]))
    want = (1 - lam) * q
    want[token] += lam
    np.testing.assert_allclose(np.asarray(jax.nn.softmax(mixed)[0, 0]), want, atol=1e-6)


def test_gate_features_and_weight():
  # History "7 8 7 8 7": at t = 4 the suffix "8 7" (n = 2) occurred once, followed by 8;
  # "7 8 7" (n = 3) occurred once too, so n = 3, c = 8, count 1, agree.
  history = jnp.asarray([[7, 8, 7, 8, 7, 0]], jnp.int32)
  lookup = context_copy.suffix_lookup(history, jnp.asarray([[4, 0]]), 3)
  q = np.full((1, 2, 10), 0.05)
  q[0, :, 8], q[0, :, 3] = 0.15, 0.4
  hidden = jnp.asarray([[[3.0, 4.0], [0.0, 0.0]]])
  features = context_copy.gate_features(lookup, jnp.log(jnp.asarray(q)), hidden,
                                        proposing=True, max_ngram=3)
  scalars = [np.log(0.15) / 10, np.log(0.4) / 5, 0.0, 1.0, np.log(2) / 3, 1.0]
  np.testing.assert_allclose(np.asarray(features[0, 0]),
                             [0, 0, 1] + scalars + [0.6 * 4, 0.8 * 4], rtol=1e-5)
  assert np.asarray(features[0, 1, :3]).tolist() == [0, 0, 0]  # t = 0: no match
  weights = tuple(np.linspace(-1, 1, features.shape[-1]))
  gate = context_copy.CopyGate(3, weights, 0.25, 0.8)
  lam = gate.weight(features, lookup.length_bt)
  want = 0.8 / (1 + np.exp(-(np.asarray(features[0, 0]) @ np.asarray(weights) + 0.25)))
  np.testing.assert_allclose(np.asarray(lam), [[want, 0.0]], rtol=1e-5)
  assert gate.hidden_size == 2
  assert context_copy.CopyGate.from_json(gate.to_json()) == gate
  with pytest.raises(ValueError, match="reads 11 features"):
    gate.weight(features[..., :-1], lookup.length_bt)


def test_gate_checks_and_the_hand_set_gate():
  gate = context_copy.CopyGate.by_length((0.3, 0.7), hidden_size=4)
  one_hot = np.zeros((1, 3, 2 + len(context_copy.SCALAR_FEATURES) + 4), np.float32)
  one_hot[0, 0, 0] = one_hot[0, 1, 1] = 1
  lam = gate.weight(jnp.asarray(one_hot), jnp.asarray([[1, 2, 0]]))
  np.testing.assert_allclose(np.asarray(lam), [[0.3, 0.7, 0.0]], rtol=1e-5)
  with pytest.raises(ValueError, match="max_ngram"):
    context_copy.CopyGate(0, (0.0,) * 8, 0.0)
  with pytest.raises(ValueError, match="max_lam"):
    context_copy.CopyGate(1, (0.0,) * 8, 0.0, max_lam=1.0)
  with pytest.raises(ValueError, match="plus one per hidden unit"):
    context_copy.CopyGate(2, (0.0,) * 8, 0.0)
  with pytest.raises(ValueError, match="finite"):
    context_copy.CopyGate(1, (float("nan"),) * 8, 0.0)
  with pytest.raises(ValueError, match="must lie in"):
    context_copy.CopyGate.by_length((0.3, 0.96), hidden_size=4)


def test_copy_cache_rows_follow_the_inner_cache():
  """Refill (set_row), the shrunk tail (take_rows) and roll-back move the history with the
  wrapped cache's rows."""
  from diversed_jax.models import ModelConfig, init_params
  from diversed_jax.speculative.drafts import LMDraft
  config = ModelConfig(family="llama", vocab_size=16, hidden_size=8, num_layers=1,
                       num_heads=2, num_kv_heads=1, head_dim=4, intermediate_size=8,
                       eos_token_ids=())
  params = init_params(config, jax.random.PRNGKey(0))
  draft = context_copy.ContextCopyDraft(LMDraft(config),
                                        context_copy.CopyGate.by_length((0.5,), hidden_size=8))
  cache = draft.init_cache(params, 3, 6)
  _, _, cache = draft.forward(params, jnp.asarray([[1, 2, 3]] * 3) + jnp.arange(3)[:, None],
                              cache)
  _, _, fresh = draft.forward(params, jnp.asarray([[9, 8]]), draft.init_cache(params, 1, 6))
  cache = cache.set_row(1, fresh)
  np.testing.assert_array_equal(np.asarray(cache.history_bs[:, :3]),
                                [[1, 2, 3], [9, 8, 0], [3, 4, 5]])
  assert np.asarray(cache.lengths_b).tolist() == [3, 2, 3]
  tail = cache.take_rows(jnp.asarray([2, 1]))
  np.testing.assert_array_equal(np.asarray(tail.history_bs[:, :2]), [[3, 4], [9, 8]])
  assert np.asarray(tail.with_lengths(jnp.asarray([1, 1])).lengths_b).tolist() == [1, 1]
