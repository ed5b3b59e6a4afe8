"""Context copying: the suffix lookup against a plain-Python reference, the blended law,
the gate's checks and the history following the cache's rows (the copying draft inside the
speculative loop, and the gate's fitting, are in distill_test.py)."""

import numpy as np
import jax
import jax.numpy as jnp
import pytest

from diversed_jax.speculative import context_copy


def _reference_lookup(seq, t, max_ngram):
  """Token after the latest j < t where seq[j-n+1..j] == seq[t-n+1..t], longest n first."""
  for n in range(max_ngram, 0, -1):
    if t + 1 < n:
      continue
    suffix = seq[t + 1 - n:t + 1]
    for j in range(t - 1, n - 2, -1):
      if seq[j + 1 - n:j + 1] == suffix:
        return seq[j + 1], n
  return 0, 0


@pytest.mark.parametrize("vocab,max_ngram", [(3, 4), (6, 2), (20, 3)])
def test_suffix_lookup_matches_reference(vocab, max_ngram):
  rng = np.random.default_rng(vocab)
  history = rng.integers(0, vocab, size=(3, 40)).astype(np.int32)
  history[1, 20:30] = history[1, 5:15]  # a copied span
  positions = np.stack([rng.permutation(40)[:7] for _ in range(3)]).astype(np.int32)
  token, length = jax.jit(context_copy.suffix_lookup, static_argnums=2)(
      jnp.asarray(history), jnp.asarray(positions), max_ngram)
  for b in range(3):
    for i, t in enumerate(positions[b]):
      want = _reference_lookup(list(history[b]), int(t), max_ngram)
      assert (int(token[b, i]), int(length[b, i])) == want, (b, t)
  assert int(length.max()) == max_ngram  # the cases include full-length matches


def test_lookup_ignores_slots_from_the_query_on():
  """Slots after the query position are stale (rolled back): changing them changes nothing."""
  history = jnp.asarray([[1, 2, 3, 1, 2, 9, 9, 9]], jnp.int32)
  stale = history.at[0, 5:].set(jnp.asarray([3, 1, 2]))
  for h in (history, stale):
    token, length = context_copy.suffix_lookup(h, jnp.asarray([[4]]), 3)
    assert (int(token[0, 0]), int(length[0, 0])) == (3, 2)  # "1 2" -> 3


def test_blend_is_the_mixture_law():
  logits = jnp.asarray([[[1.0, 0.0, -1.0, -1e30]]])
  q = np.array(jax.nn.softmax(logits)[0, 0])
  for token, lam in ((2, 0.3), (3, 0.6), (0, 0.0)):
    mixed = context_copy.blend(logits, jnp.asarray([[token]]), jnp.asarray([[lam]]))
    want = (1 - lam) * q
    want[token] += lam
    np.testing.assert_allclose(np.asarray(jax.nn.softmax(mixed)[0, 0]), want, atol=1e-6)


def test_gate_weights_and_checks():
  gate = context_copy.CopyGate((0.1, 0.5), ((0.0, 0.0, 0.0), (0.2, 0.1, 0.0), (0.8, 0.6, 0.3)))
  lam = gate.weight(jnp.asarray([0, 1, 2, 2, 2]), jnp.asarray([0.9, 0.05, 0.05, 0.1, 0.7]))
  np.testing.assert_allclose(np.asarray(lam), [0.0, 0.2, 0.8, 0.6, 0.3])
  assert context_copy.CopyGate.from_json(gate.to_json()) == gate
  with pytest.raises(ValueError, match="n=0"):
    context_copy.CopyGate((0.5,), ((0.1, 0.0), (0.5, 0.5)))
  with pytest.raises(ValueError, match=r"\[0, 1\)"):
    context_copy.CopyGate((0.5,), ((0.0, 0.0), (1.0, 0.5)))
  with pytest.raises(ValueError, match="entries"):
    context_copy.CopyGate((0.5,), ((0.0, 0.0), (0.5,)))


def test_copy_cache_rows_follow_the_inner_cache():
  """Refill (set_row), the shrunk tail (take_rows) and roll-back move the history with the
  wrapped cache's rows."""
  from diversed_jax.models import ModelConfig, init_params
  from diversed_jax.speculative.drafts import LMDraft
  config = ModelConfig(family="llama", vocab_size=16, hidden_size=8, num_layers=1,
                       num_heads=2, num_kv_heads=1, head_dim=4, intermediate_size=8,
                       eos_token_ids=())
  params = init_params(config, jax.random.PRNGKey(0))
  draft = context_copy.ContextCopyDraft(LMDraft(config), context_copy.CopyGate(
      (), ((0.0,), (0.5,))))
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
