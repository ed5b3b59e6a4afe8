"""Forward-pass parity with transformers' PyTorch models and KV-cache consistency.

Tiny random configs of every family (float32): logits within 1e-4 of transformers on a
[2, 32] batch (Gemma 2's soft caps set low enough to bind, each moving the logits by over
10x that); cached decoding (one token at a time, and chunks at per-row offsets after a
roll-back) equals the full forward.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from diversed_jax.models import (KVCache, config as config_lib, cpu_kernels, hf_layout, init,
                                 kv_cache, products, transformer)

from tests.q8 import q8_0_weights

VOCAB, BATCH, SEQ = 97, 2, 32
TOL = 1e-4  # logits against transformers'
_COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
               num_attention_heads=4, num_key_value_heads=2, head_dim=16,
               max_position_embeddings=256)
_LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 16}


def hf_config(name: str):
  """Tiny transformers configs exercising each family's switches."""
  if name == "llama":
    return transformers.LlamaConfig(**_COMMON, tie_word_embeddings=False)
  if name == "llama3_rope":
    return transformers.LlamaConfig(**_COMMON, tie_word_embeddings=False,
                                    rope_scaling=_LLAMA3_ROPE, rope_theta=500000.0)
  if name == "llama_tied":
    return transformers.LlamaConfig(**_COMMON, tie_word_embeddings=True)
  if name == "qwen2":
    return transformers.Qwen2Config(**_COMMON, tie_word_embeddings=True)
  if name == "qwen3":
    return transformers.Qwen3Config(**_COMMON, tie_word_embeddings=False)
  if name == "gemma2":
    return transformers.Gemma2Config(**_COMMON, sliding_window=8, query_pre_attn_scalar=24,
                                     # Scores at this init are ~0.01-0.1: a cap of 5 would
                                     # never bind (test_soft_caps_bind checks both do).
                                     attn_logit_softcapping=0.02, final_logit_softcapping=3.0)
  if name == "gemma3":
    return transformers.Gemma3TextConfig(
        **_COMMON, sliding_window=8, query_pre_attn_scalar=24,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_scaling={"rope_type": "linear", "factor": 4.0})
  if name == "mistral_window":  # a window on every layer, shorter than SEQ
    return transformers.MistralConfig(**_COMMON, sliding_window=4, tie_word_embeddings=False)
  if name == "gemma2_layer_types":  # not Gemma 2's default even/odd pattern
    return transformers.Gemma2Config(
        **_COMMON, sliding_window=4, query_pre_attn_scalar=24,
        layer_types=["full_attention", "sliding_attention", "sliding_attention"])
  raise KeyError(name)


NAMES = ("llama", "llama3_rope", "llama_tied", "qwen2", "qwen3", "gemma2", "gemma3",
         "mistral_window")
# Config switches checked by the logits alone.
LOGITS_ONLY = ("gemma2_layer_types",)


def torch_model(hfc, cfg, params):
  hfc._attn_implementation = "eager"
  model = transformers.AutoModelForCausalLM.from_config(hfc).eval()
  state = {k: torch.tensor(np.asarray(v)) for k, v in hf_layout.params_to_hf(cfg, params).items()}
  missing, unexpected = model.load_state_dict(state, strict=False)
  # Tied heads show up as a missing lm_head; Gemma's rotary buffers are not weights.
  assert not [m for m in missing if "lm_head" not in m and "rotary" not in m], missing
  assert not unexpected, unexpected
  return model


@functools.lru_cache(maxsize=None)
def case(name: str):
  """(config, params, tokens_bt, reference logits_btv from transformers)."""
  hfc = hf_config(name)
  cfg = config_lib.from_hf_config(hfc.to_dict())
  params = init.init_params(cfg, jax.random.PRNGKey(0))
  tokens_bt = np.random.RandomState(0).randint(0, VOCAB, (BATCH, SEQ))
  with torch.no_grad():
    ref_btv = torch_model(hfc, cfg, params)(torch.tensor(tokens_bt)).logits.numpy()
  return cfg, params, tokens_bt, ref_btv


@pytest.mark.parametrize("name", NAMES + LOGITS_ONLY)
def test_logits_match_transformers(name):
  cfg, params, tokens_bt, ref_btv = case(name)
  logits_btv, hidden_btd, cache = transformer.forward_jit(params, cfg, jnp.asarray(tokens_bt))
  assert logits_btv.shape == (BATCH, SEQ, VOCAB) and logits_btv.dtype == jnp.float32
  assert hidden_btd.shape == (BATCH, SEQ, cfg.hidden_size)
  np.testing.assert_array_equal(cache.lengths_b, [SEQ] * BATCH)
  assert np.abs(np.asarray(logits_btv) - ref_btv).max() <= TOL


@pytest.mark.parametrize("field", ["attn_logit_softcap", "final_logit_softcap"])
def test_soft_caps_bind(field):
  """The gemma2 case's caps move its logits by over 10x TOL: the parity test above would
  fail if either were dropped or misapplied (a cap of 5 on the attention moved them 1e-6)."""
  cfg, params, tokens_bt, _ = case("gemma2")
  assert getattr(cfg, field) is not None
  capped = np.asarray(transformer.forward_jit(params, cfg, jnp.asarray(tokens_bt))[0])
  uncapped = np.asarray(transformer.forward_jit(
      params, dataclasses.replace(cfg, **{field: None}), jnp.asarray(tokens_bt))[0])
  assert np.abs(capped - uncapped).max() > 10 * TOL


@pytest.mark.parametrize("name", NAMES)
def test_incremental_decoding_matches_full_forward(name):
  cfg, params, tokens_bt, ref_btv = case(name)
  full_btv = np.asarray(transformer.forward_jit(params, cfg, jnp.asarray(tokens_bt))[0])
  cache = KVCache.create(cfg, BATCH, 64)
  prefill = 20
  logits, _, cache = transformer.forward_jit(params, cfg, jnp.asarray(tokens_bt[:, :prefill]),
                                             cache)
  outs = [np.asarray(logits)]
  for i in range(prefill, SEQ):
    logits, _, cache = transformer.forward_jit(params, cfg, jnp.asarray(tokens_bt[:, i:i + 1]),
                                               cache)
    outs.append(np.asarray(logits))
  np.testing.assert_array_equal(cache.lengths_b, [SEQ] * BATCH)
  np.testing.assert_allclose(np.concatenate(outs, 1), full_btv, atol=2e-5, rtol=0)


@pytest.mark.parametrize("name", NAMES)
def test_chunks_at_per_row_offsets_after_rollback(name):
  """Rows at different lengths (a roll-back of rejected drafts) each write and attend
  from their own offset; stale slots beyond a row's length must stay invisible."""
  cfg, params, tokens_bt, _ = case(name)
  full_btv = np.asarray(transformer.forward_jit(params, cfg, jnp.asarray(tokens_bt))[0])
  cache = KVCache.create(cfg, BATCH, 48)
  _, _, cache = transformer.forward_jit(params, cfg, jnp.asarray(tokens_bt[:, :16]), cache)
  starts = np.array([9, 13])
  cache = cache.with_lengths(starts)
  chunk = 3
  for step in range(4):
    pos = starts + step * chunk
    toks = np.stack([tokens_bt[b, p:p + chunk] for b, p in enumerate(pos)])
    logits, _, cache = transformer.forward_jit(params, cfg, jnp.asarray(toks), cache)
    for b, p in enumerate(pos):
      np.testing.assert_allclose(np.asarray(logits[b]), full_btv[b, p:p + chunk], atol=2e-5,
                                 rtol=0)
  np.testing.assert_array_equal(cache.lengths_b, starts + 4 * chunk)


@pytest.mark.parametrize("name", ["llama3_rope", "gemma3"])
def test_bfloat16_forward_is_close(name):
  cfg, params, tokens_bt, ref_btv = case(name)
  params16 = transformer.cast_params(params, jnp.bfloat16)
  logits_btv = transformer.forward_jit(params16, cfg, jnp.asarray(tokens_bt))[0]
  assert logits_btv.dtype == jnp.float32
  logits_btv = np.asarray(logits_btv)
  assert np.isfinite(logits_btv).all()
  assert np.abs(logits_btv - ref_btv).max() < 0.05 * np.abs(ref_btv).max() + 1e-2
  assert (logits_btv.argmax(-1) == ref_btv.argmax(-1)).mean() >= 0.8


def test_exact_gelu_matches_transformers():
  """hidden_act="gelu" is the exact (erf) GELU, which the tanh form misses by far more than
  the tolerance at these weights (at the default std 0.02 the two agree within 1e-4)."""
  hfc = transformers.LlamaConfig(**_COMMON, hidden_act="gelu", tie_word_embeddings=False)
  cfg = config_lib.from_hf_config(hfc.to_dict())
  assert cfg.activation == "gelu"
  params = init.init_params(cfg, jax.random.PRNGKey(0), std=0.3)
  tokens_bt = np.random.RandomState(0).randint(0, VOCAB, (BATCH, 8))
  with torch.no_grad():
    ref_btv = torch_model(hfc, cfg, params)(torch.tensor(tokens_bt)).logits.numpy()
  logits = lambda c: np.asarray(transformer.forward(params, c, jnp.asarray(tokens_bt))[0])
  tol = 5e-5  # logits up to ~10; the exact form is ~1e-5 off, the tanh form ~2e-3
  assert np.abs(logits(cfg) - ref_btv).max() <= tol
  tanh_cfg = dataclasses.replace(cfg, activation="gelu_tanh")
  assert np.abs(logits(tanh_cfg) - ref_btv).max() > 20 * tol


@pytest.mark.parametrize("unstack", [False, True])
def test_more_new_tokens_than_cache_slots_is_an_error(unstack):
  """Writes past the cache's end would be dropped and the attention go wrong, silently."""
  cfg, params, tokens_bt, _ = case("llama")
  params = transformer.unstack_layers(params) if unstack else params
  with pytest.raises(ValueError, match="6 new tokens do not fit a KV cache of 4 slots"):
    transformer.forward(params, cfg, jnp.asarray(tokens_bt[:, :6]), KVCache.create(cfg, BATCH, 4))
  _, _, cache = transformer.forward(params, cfg, jnp.asarray(tokens_bt[:, :4]),
                                    KVCache.create(cfg, BATCH, 4))  # exactly full
  np.testing.assert_array_equal(cache.lengths_b, [4] * BATCH)


def test_truncate_layers_is_the_first_layers():
  cfg, params, tokens_bt, _ = case("llama")
  small_cfg = cfg.truncated(2)
  small = transformer.truncate_layers(params, 2)
  got = transformer.forward_jit(small, small_cfg, jnp.asarray(tokens_bt))[0]
  # The same computation on a freshly built 2-layer parameter tree.
  rebuilt = dict(params, layers={k: v[:2] for k, v in params["layers"].items()})
  want = transformer.forward(rebuilt, small_cfg, jnp.asarray(tokens_bt))[0]
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=0)
  cache = KVCache.create(cfg, BATCH, 8).truncated(2)
  assert cache.k.shape[0] == 2
  assert KVCache.create(cfg, BATCH, 8, per_layer=True).truncated(2).num_layers == 2


def test_cache_layouts_hold_the_same_data():
  """Stacked and per-layer caches convert exactly, and `set_row` (continuous batching)
  writes the same row in both layouts, whatever the layout of the row it is given."""
  cfg = config_lib.from_hf_config(hf_config("llama").to_dict())
  rng = np.random.default_rng(0)
  stacked = KVCache.create(cfg, 3, 8)
  stacked = stacked.replace(k=jnp.asarray(rng.normal(size=stacked.k.shape), jnp.float32),
                            v=jnp.asarray(rng.normal(size=stacked.v.shape), jnp.float32),
                            lengths_b=jnp.asarray([1, 5, 2], jnp.int32))
  per_layer = stacked.as_layout(per_layer=True)
  assert per_layer.per_layer and len(per_layer.k) == cfg.num_layers
  assert (per_layer.capacity, per_layer.batch_size) == (stacked.capacity, stacked.batch_size)
  np.testing.assert_array_equal(np.asarray(per_layer.k[1]), np.asarray(stacked.k[1]))
  np.testing.assert_array_equal(np.asarray(per_layer.as_layout(per_layer=False).v),
                                np.asarray(stacked.v))
  row = KVCache.create(cfg, 1, 8)
  row = row.replace(k=row.k + 7.0, v=row.v - 7.0, lengths_b=jnp.asarray([4], jnp.int32))
  for given in (row, row.as_layout(per_layer=True)):
    want = stacked.set_row(jnp.asarray(1), given)
    got = per_layer.set_row(jnp.asarray(1), given).as_layout(per_layer=False)
    assert not want.per_layer
    for a, b in ((want.k, got.k), (want.v, got.v), (want.lengths_b, got.lengths_b)):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_array_equal(np.asarray(want.k[:, 1]), 7.0)
    np.testing.assert_array_equal(np.asarray(want.k[:, 0]), np.asarray(stacked.k[:, 0]))
    assert np.asarray(want.lengths_b).tolist() == [1, 4, 2]


def test_cache_buckets_waste_at_most_a_quarter_octave():
  """`bucket_length` gives the smallest bucket that fits (a CNN/DM prompt bucket of 512
  plus 64 new tokens: 640 slots, not 1,024) and a multiple of the largest beyond it."""
  buckets = np.asarray(kv_cache.CACHE_BUCKETS)
  assert np.all(np.diff(buckets) > 0) and np.all(buckets % 128 == 0)
  assert np.all(buckets[1:] <= 1.25 * buckets[:-1] + 128)
  for needed in (1, 128, 129, 578, 1024, 1025, 5000, 32768):
    got = kv_cache.bucket_length(needed)
    assert got >= needed and got in buckets, needed
    assert not np.any((buckets >= needed) & (buckets < got)), needed
  assert kv_cache.bucket_length(512 + 64 + 2) == 640
  assert kv_cache.bucket_length(40_000) == 2 * 32768
  assert kv_cache.bucket_length(5, (4, 8)) == 8


@pytest.mark.parametrize("name,fuse", [("llama3_rope", False), ("llama", True), ("qwen2", True),
                                       ("qwen3", True), ("gemma2", True), ("gemma3", False)])
def test_unstacked_layers_match_stacked(name, fuse):
  """The unrolled per-layer layout (with q/k/v and gate/up fused or not) computes the same
  logits and cache as the stacked scan, and converts back exactly."""
  cfg, params, tokens_bt, ref_btv = case(name)
  flat = transformer.unstack_layers(params, fuse=fuse)
  assert isinstance(flat["layers"], tuple) and len(flat["layers"]) == cfg.num_layers
  assert ("qkv_oi" in flat["layers"][0]) == fuse
  # Every matrix is stored [out, in]: o maps H * Dh -> D.
  assert "o" not in flat["layers"][0]
  assert flat["layers"][0]["o_oi"].shape == (cfg.hidden_size, cfg.num_heads * cfg.head_dim)
  cache = KVCache.create(cfg, BATCH, 40)
  want, _, want_cache = transformer.forward_jit(params, cfg, jnp.asarray(tokens_bt), cache)
  # Unrolled layers run on either cache layout and keep it.
  got_stacked, _, got_cache = transformer.forward_jit(flat, cfg, jnp.asarray(tokens_bt), cache)
  got, _, per_layer_cache = transformer.forward_jit(
      flat, cfg, jnp.asarray(tokens_bt), cache.as_layout(per_layer=True))
  assert per_layer_cache.per_layer and not got_cache.per_layer
  np.testing.assert_allclose(np.asarray(got_stacked), np.asarray(got), atol=1e-6, rtol=0)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=0)
  for c in (got_cache, per_layer_cache.as_layout(per_layer=False)):
    np.testing.assert_allclose(np.asarray(c.k), np.asarray(want_cache.k), atol=1e-5, rtol=0)
  # The decoding layout: per-layer buffers with several rows, stacked with one.
  assert transformer.init_cache(flat, cfg, 2, 8).per_layer
  assert not transformer.init_cache(flat, cfg, 1, 8).per_layer
  assert not transformer.init_cache(params, cfg, 2, 8).per_layer
  assert np.abs(np.asarray(got) - ref_btv).max() <= 1e-4
  step = jnp.asarray(tokens_bt[:, :1])
  np.testing.assert_allclose(
      np.asarray(transformer.forward_jit(flat, cfg, step, got_cache)[0]),
      np.asarray(transformer.forward_jit(params, cfg, step, want_cache)[0]), atol=1e-5, rtol=0)
  small = transformer.truncate_layers(flat, 2)
  np.testing.assert_allclose(
      np.asarray(transformer.forward_jit(small, cfg.truncated(2), step)[0]),
      np.asarray(transformer.forward_jit(transformer.truncate_layers(params, 2),
                                         cfg.truncated(2), step)[0]), atol=1e-5, rtol=0)
  restacked = transformer.stack_layers(flat)
  for a, b in zip(jax.tree.leaves(restacked), jax.tree.leaves(params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.skipif(not cpu_kernels.runs_here(jnp.float32), reason="no few-row kernel here")
def test_decoding_layout_reads_a_q8_embedding_as_int8_with_the_same_logits():
  """A tied embedding that int8 with a scale per 32 holds exactly (GGUF's Q8_0) is also
  kept as an int8 head in the decoding layout: the same logits bit for bit, and the
  stacked layout it converts back to has no trace of it."""
  cfg, params, tokens_bt, _ = case("llama_tied")
  rng = np.random.default_rng(0)
  _, _, embed = q8_0_weights(rng, VOCAB, cfg.hidden_size, (0.01, 0.05))
  q8_params = {**params, "embed": jnp.asarray(embed)}
  flat = transformer.unstack_layers(q8_params)
  assert isinstance(flat["tied_head_oi"], products.Int8Rows)
  assert "tied_head_oi" not in transformer.unstack_layers(params)  # not on its grid
  plain = {k: v for k, v in flat.items() if k != "tied_head_oi"}
  step = jnp.asarray(tokens_bt[:, :3])
  np.testing.assert_array_equal(transformer.forward_jit(flat, cfg, step)[0],
                                transformer.forward_jit(plain, cfg, step)[0])
  assert set(transformer.stack_layers(flat)) == set(q8_params)


@pytest.mark.skipif(not cpu_kernels.runs_here(jnp.float32), reason="no few-row kernel here")
def test_decoding_layout_keeps_no_int8_head_for_an_untied_model():
  # Its logits come from lm_head, so an int8 copy of the embedding would go unused.
  cfg, params, _, _ = case("llama")
  _, _, embed = q8_0_weights(np.random.default_rng(0), VOCAB, cfg.hidden_size)
  assert "tied_head_oi" not in transformer.unstack_layers({**params, "embed": jnp.asarray(embed)})
