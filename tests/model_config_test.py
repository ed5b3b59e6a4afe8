"""`ModelConfig` validation and the config.json mapping of `from_hf_config`: refusals of
what the forward pass does not implement, sparse configs completed from transformers'
defaults, activations, sliding windows."""

import dataclasses

import pytest
import transformers

from diversed_jax.models import config as config_lib
from diversed_jax.models.config import ModelConfig, from_hf_config

_COMMON = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
               num_attention_heads=4, num_key_value_heads=2, head_dim=16)


# --- ModelConfig.__post_init__ -----------------------------------------------------------


@pytest.mark.parametrize("changes,match", [
    (dict(num_kv_heads=0), "num_kv_heads=0"),
    (dict(num_heads=0), "num_heads=0"),
    (dict(head_dim=15), "head_dim=15 must be even"),
    (dict(sliding_window=0, sliding_layers=(True, True)), "sliding_window=0"),
    (dict(activation="relu"), "activation='relu'"),
    (dict(rope_scaling=(("factor", 8.0), ("rope_type", "llama3"))),
     r"rope_type='llama3' lacks \['low_freq_factor', 'high_freq_factor', "
     r"'original_max_position_embeddings'\]"),
    (dict(rope_scaling=(("rope_type", "linear"),)), r"rope_type='linear' lacks \['factor'\]"),
    (dict(rope_scaling=(("factor", 2.0), ("rope_type", "yarn"))), "rope_type='yarn'"),
    (dict(rope_scaling=(("factor", 2.0),)), "rope_type=None"),
])
def test_model_config_refuses_bad_fields(changes, match):
  with pytest.raises(ValueError, match=match):
    ModelConfig(**changes)


def test_a_window_without_sliding_layers_slides_nowhere():
  # Documented rather than refused: tests of the attention forms build such configs.
  assert ModelConfig(sliding_window=4).layer_is_sliding == (False, False)


# --- from_hf_config: refusals -------------------------------------------------------------


@pytest.mark.parametrize("hfc,match", [
    (transformers.LlamaConfig(**_COMMON, attention_bias=True),
     "attention_bias=True is not supported for llama"),
    (transformers.Qwen3Config(**_COMMON, attention_bias=True),
     "attention_bias=True is not supported for qwen3"),
    (transformers.Gemma3TextConfig(**_COMMON, attention_bias=True),
     "attention_bias=True is not supported for gemma3_text"),
    (transformers.LlamaConfig(**_COMMON, mlp_bias=True),
     "mlp_bias=True is not supported for llama"),
    (transformers.Gemma3TextConfig(**_COMMON, use_bidirectional_attention=True),
     "use_bidirectional_attention=True is not supported for gemma3_text"),
    (transformers.LlamaConfig(**_COMMON, hidden_act="relu"),
     "hidden_act='relu' is not supported"),
    (transformers.Gemma2Config(**_COMMON, hidden_activation="gelu_fast"),
     "hidden_activation='gelu_fast' is not supported"),
])
def test_unsupported_features_are_refused(hfc, match):
  """Biases on o_proj / the MLP (attention_bias, mlp_bias), bidirectional attention and
  unknown activations would otherwise load as a different model."""
  with pytest.raises(ValueError, match=match):
    from_hf_config(hfc.to_dict())


def test_qwen2_qkv_biases_still_map():
  cfg = from_hf_config(transformers.Qwen2Config(**_COMMON).to_dict())
  assert cfg.family == "qwen2" and cfg.qkv_bias


@pytest.mark.parametrize("act,want", [("silu", "silu"), ("swish", "silu"),
                                      ("gelu_pytorch_tanh", "gelu_tanh"),
                                      ("gelu_new", "gelu_tanh"), ("gelu", "gelu")])
def test_activation_table(act, want):
  assert from_hf_config(transformers.LlamaConfig(**_COMMON, hidden_act=act).to_dict()
                        ).activation == want
  gemma = transformers.Gemma3TextConfig(**_COMMON, hidden_activation=act).to_dict()
  assert from_hf_config(gemma).activation == want


# --- from_hf_config: sliding windows -------------------------------------------------------


def test_mistral_slides_on_every_layer():
  cfg = from_hf_config(transformers.MistralConfig(**_COMMON, sliding_window=4).to_dict())
  assert cfg.family == "llama" and cfg.sliding_window == 4
  assert cfg.layer_is_sliding == (True, True, True)
  assert cfg.rope_local_theta is None  # local layers keep the global rotary
  full = from_hf_config(transformers.MistralConfig(**_COMMON, sliding_window=None).to_dict())
  assert full.sliding_window is None and full.sliding_layers is None


def test_gemma2_follows_layer_types():
  hfc = transformers.Gemma2Config(
      **_COMMON, sliding_window=4,
      layer_types=["full_attention", "sliding_attention", "sliding_attention"])
  assert from_hf_config(hfc.to_dict()).layer_is_sliding == (False, True, True)
  no_types = {k: v for k, v in hfc.to_dict().items() if k != "layer_types"}
  assert from_hf_config(no_types).layer_is_sliding == (True, False, True)  # even layers
  # No sliding layer: no window either (so the attention kernel may run).
  full = transformers.Gemma2Config(**_COMMON, sliding_window=4, layer_types=["full_attention"] * 3)
  cfg = from_hf_config(full.to_dict())
  assert cfg.sliding_window is None and cfg.layer_is_sliding == (False,) * 3


def test_gemma3_attention_softcapping_is_refused():
  # transformers 5's Gemma 3 attention ignores the field; we would apply it.
  hfc = transformers.Gemma3TextConfig(**_COMMON, attn_logit_softcapping=0.5)
  with pytest.raises(ValueError, match="attn_logit_softcapping=0.5 is not supported"):
    from_hf_config(hfc.to_dict())


# --- from_hf_config: sparse configs --------------------------------------------------------

# google/gemma-3-4b-it's config.json: its text_config lists only non-default fields.
_GEMMA3_4B_SPARSE = {
    "architectures": ["Gemma3ForConditionalGeneration"], "eos_token_id": [1, 106],
    "model_type": "gemma3",
    "text_config": {"hidden_size": 2560, "intermediate_size": 10240,
                    "model_type": "gemma3_text", "num_hidden_layers": 34,
                    "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                    "sliding_window": 1024},
    "vision_config": {"hidden_size": 1152, "model_type": "siglip_vision_model"},
}
# The same text config with every field written out (transformers<5 keys).
_GEMMA3_4B_FULL = {
    "model_type": "gemma3_text", "vocab_size": 262208, "hidden_size": 2560,
    "intermediate_size": 10240, "num_hidden_layers": 34, "num_attention_heads": 8,
    "num_key_value_heads": 4, "head_dim": 256, "query_pre_attn_scalar": 256,
    "rms_norm_eps": 1e-6, "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0,
    "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "sliding_window": 1024,
    "sliding_window_pattern": 6, "hidden_activation": "gelu_pytorch_tanh",
    "final_logit_softcapping": None, "attn_logit_softcapping": None,
    "tie_word_embeddings": True, "bos_token_id": 2, "eos_token_id": [1, 106],
    "pad_token_id": 0,
}


def test_sparse_gemma3_config_takes_transformers_defaults():
  sparse, full = from_hf_config(_GEMMA3_4B_SPARSE), from_hf_config(_GEMMA3_4B_FULL)
  assert sparse == full
  assert (sparse.num_heads, sparse.num_kv_heads, sparse.head_dim) == (8, 4, 256)
  assert (sparse.rope_theta, sparse.rope_local_theta) == (1e6, 1e4)  # not 1e4 for both
  assert sparse.rope_scaling == (("factor", 8.0), ("rope_type", "linear"))
  assert sparse.layer_is_sliding[:6] == (True,) * 5 + (False,)


def test_a_text_config_without_model_type_is_gemma3_text():
  text = {k: v for k, v in _GEMMA3_4B_SPARSE["text_config"].items() if k != "model_type"}
  assert from_hf_config({**_GEMMA3_4B_SPARSE, "text_config": text}) == from_hf_config(
      _GEMMA3_4B_FULL)


@pytest.mark.parametrize("model_type", sorted(config_lib._REQUIRED_KEYS))
def test_fallbacks_agree_with_transformers_defaults(model_type):
  """A config with only the keys `from_hf_config` requires maps as transformers reads it:
  every other key's fallback is transformers' default (token ids aside)."""
  text_type = "gemma3_text" if model_type == "gemma3" else model_type  # flat text fields
  defaults = transformers.AutoConfig.for_model(text_type, **_COMMON).to_dict()
  groups = config_lib._CORE_KEYS + config_lib._REQUIRED_KEYS[model_type]
  keys = [next(k for k in ks if k in defaults) for ks in groups]
  minimal = {"model_type": model_type, **{k: defaults[k] for k in keys}}
  no_ids = lambda c: dataclasses.replace(c, bos_token_id=None, eos_token_ids=(),
                                         pad_token_id=0)
  assert no_ids(from_hf_config(minimal)) == no_ids(from_hf_config(defaults))


def test_missing_fields_without_transformers_are_named(monkeypatch):
  import builtins
  real_import = builtins.__import__

  def no_transformers(name, *args, **kwargs):
    if name == "transformers":
      raise ImportError(name)
    return real_import(name, *args, **kwargs)

  monkeypatch.setattr(builtins, "__import__", no_transformers)
  with pytest.raises(ValueError, match=r"lacks \['vocab_size', 'num_attention_heads'"):
    from_hf_config(_GEMMA3_4B_SPARSE)
