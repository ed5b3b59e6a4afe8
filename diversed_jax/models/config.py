"""Architecture description shared by every supported decoder family.

One frozen, hashable dataclass covers Llama 3.x / SmolLM2 / Mistral, Qwen2 / Qwen2.5,
Qwen3, Gemma 2 and Gemma 3: the families differ only in the switches below, so a single
pure-functional forward pass (`transformer.py`) serves all of them. Being hashable,
a `ModelConfig` can be a static argument of `jax.jit`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

FAMILIES = ("llama", "qwen2", "qwen3", "gemma2", "gemma3")
# ModelConfig.activation -> the transformers name `to_hf_config` writes for it.
HF_ACTIVATION = {"silu": "silu", "gelu_tanh": "gelu_pytorch_tanh", "gelu": "gelu"}
ACTIVATIONS = tuple(HF_ACTIVATION)
# Keys `rope_frequencies` reads for each scaling type.
_ROPE_SCALING_KEYS = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor",
               "original_max_position_embeddings"),
}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Static description of a decoder-only transformer.

  Attributes:
    family: one of FAMILIES.
    vocab_size: V.
    hidden_size: D.
    num_layers: L.
    num_heads: query heads H.
    num_kv_heads: key/value heads (grouped-query attention).
    head_dim: Dh.
    intermediate_size: F, width of the gated MLP.
    norm_eps: RMSNorm epsilon.
    rope_theta: rotary base of global-attention layers.
    rope_local_theta: rotary base of sliding-window layers (Gemma 3), else None.
    rope_scaling: hashable tuple of (key, value) pairs of a Llama-3 style scaling, or None.
    tie_embeddings: the output head is the transposed input embedding.
    qkv_bias: q/k/v projections carry biases (Qwen2).
    qk_norm: per-head RMSNorm on queries and keys (Qwen3, Gemma 3).
    norm_offset: RMSNorm multiplies by (1 + weight) (Gemma).
    embed_scale: multiply embeddings by sqrt(D) (Gemma).
    sandwich_norm: extra norms after attention and MLP (Gemma 2/3).
    activation: 'silu', 'gelu_tanh' (tanh approximation) or 'gelu' (exact, erf).
    query_scale: multiplier of q.k, usually head_dim ** -0.5.
    attn_logit_softcap: tanh soft-cap of attention scores (Gemma 2), or None.
    final_logit_softcap: tanh soft-cap of output logits (Gemma 2), or None.
    sliding_window: window size of local layers, or None.
    sliding_layers: tuple of bools, one per layer: True where the layer is local. Without
      it no layer slides, whatever sliding_window says (the window then only keeps
      attention off the CPU kernel; `from_hf_config` sets neither when no layer slides).
    bos_token_id / eos_token_ids / pad_token_id: special ids (eos may be several).
  """

  family: str = "llama"
  vocab_size: int = 256
  hidden_size: int = 64
  num_layers: int = 2
  num_heads: int = 4
  num_kv_heads: int = 2
  head_dim: int = 16
  intermediate_size: int = 128
  norm_eps: float = 1e-5
  rope_theta: float = 10000.0
  rope_local_theta: float | None = None
  rope_scaling: tuple[tuple[str, Any], ...] | None = None
  tie_embeddings: bool = True
  qkv_bias: bool = False
  qk_norm: bool = False
  norm_offset: bool = False
  embed_scale: bool = False
  sandwich_norm: bool = False
  activation: str = "silu"
  query_scale: float | None = None
  attn_logit_softcap: float | None = None
  final_logit_softcap: float | None = None
  sliding_window: int | None = None
  sliding_layers: tuple[bool, ...] | None = None
  bos_token_id: int | None = None
  eos_token_ids: tuple[int, ...] = ()
  pad_token_id: int = 0

  def __post_init__(self):
    if self.family not in FAMILIES:
      raise ValueError(f"ModelConfig.family={self.family!r} is not one of {FAMILIES}")
    for name in ("num_heads", "num_kv_heads", "head_dim"):
      if getattr(self, name) < 1:
        raise ValueError(f"ModelConfig.{name}={getattr(self, name)} must be >= 1")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(
          f"ModelConfig.num_heads={self.num_heads} is not a multiple of "
          f"num_kv_heads={self.num_kv_heads}")
    if self.head_dim % 2:  # rotary embeddings rotate pairs of dimensions
      raise ValueError(f"ModelConfig.head_dim={self.head_dim} must be even (RoPE)")
    if self.activation not in ACTIVATIONS:
      raise ValueError(f"ModelConfig.activation={self.activation!r} is not one of {ACTIVATIONS}")
    if self.sliding_window is not None and self.sliding_window < 1:
      raise ValueError(f"ModelConfig.sliding_window={self.sliding_window} must be >= 1 or None")
    if self.sliding_layers is not None and len(self.sliding_layers) != self.num_layers:
      raise ValueError(
          f"ModelConfig.sliding_layers has {len(self.sliding_layers)} entries for "
          f"num_layers={self.num_layers}")
    if self.rope_scaling is not None:
      scaling = dict(self.rope_scaling)
      kind = scaling.get("rope_type")
      if kind not in _ROPE_SCALING_KEYS:
        raise ValueError(f"ModelConfig.rope_scaling rope_type={kind!r} is not one of "
                         f"{tuple(_ROPE_SCALING_KEYS)}")
      missing = [k for k in _ROPE_SCALING_KEYS[kind] if k not in scaling]
      if missing:
        raise ValueError(f"ModelConfig.rope_scaling of rope_type={kind!r} lacks {missing}")

  @property
  def scale(self) -> float:
    return self.query_scale if self.query_scale is not None else self.head_dim ** -0.5

  @property
  def layer_is_sliding(self) -> tuple[bool, ...]:
    if self.sliding_window is None or self.sliding_layers is None:
      return (False,) * self.num_layers
    return self.sliding_layers

  def truncated(self, num_layers: int) -> "ModelConfig":
    """The config of the first `num_layers` layers (layer-skip self-drafts)."""
    if not 1 <= num_layers <= self.num_layers:
      raise ValueError(f"num_layers={num_layers} outside [1, {self.num_layers}]")
    sliding = None if self.sliding_layers is None else self.sliding_layers[:num_layers]
    return dataclasses.replace(self, num_layers=num_layers, sliding_layers=sliding)


def _eos_tuple(value) -> tuple[int, ...]:
  if value is None:
    return ()
  if isinstance(value, (list, tuple)):
    return tuple(int(v) for v in value)
  return (int(value),)


def _rope_parameters(hf: Mapping[str, Any], family: str):
  """(global theta, local theta or None, hashable scaling or None) from either the
  transformers<5 keys (rope_theta, rope_scaling, rope_local_base_freq) or the
  transformers>=5 `rope_parameters` dict (per layer type for Gemma 3)."""
  params = hf.get("rope_parameters")
  if params and "full_attention" in params:
    glob, local = params["full_attention"], params.get("sliding_attention", {})
  elif params:
    glob, local = params, {}
  else:
    glob = dict(hf.get("rope_scaling") or {})
    glob["rope_theta"] = hf.get("rope_theta", 10000.0)
    local = {"rope_theta": hf.get("rope_local_base_freq", 10000.0)}
  theta = float(glob.get("rope_theta", 10000.0))
  local_theta = float(local.get("rope_theta", 10000.0)) if family == "gemma3" else None
  kind = glob.get("rope_type", glob.get("type"))
  if kind in (None, "default"):
    return theta, local_theta, None
  if kind not in ("llama3", "linear"):
    raise ValueError(
        f"config.json rope scaling type {kind!r} is not supported (llama3, linear)")
  scaling = {k: v for k, v in glob.items()
             if k not in ("type", "rope_theta") and not isinstance(v, (list, dict))}
  scaling["rope_type"] = kind
  return theta, local_theta, tuple(sorted(scaling.items()))


_FAMILY_OF_MODEL_TYPE = {
    "llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
    "gemma2": "gemma2", "gemma3": "gemma3", "gemma3_text": "gemma3",
}
# config.json keys read below whose absence our fallbacks would get wrong (transformers'
# defaults differ), by model type; a tuple lists keys any one of which will do. Sparse
# configs (the text_config of google/gemma-3-4b-it lists only non-defaults) are completed
# from transformers' config class first.
_CORE_KEYS = (("vocab_size",), ("hidden_size",), ("num_hidden_layers",),
              ("num_attention_heads",), ("num_key_value_heads",), ("intermediate_size",))
_GEMMA_KEYS = (("head_dim",), ("query_pre_attn_scalar",), ("sliding_window",),
               ("hidden_activation",))
_REQUIRED_KEYS = {
    "llama": (), "qwen2": (), "qwen3": (("head_dim",),), "mistral": (("sliding_window",),),
    "gemma2": _GEMMA_KEYS + (("final_logit_softcapping",), ("attn_logit_softcapping",)),
    "gemma3": _GEMMA_KEYS + (("rope_parameters", "rope_theta"),
                             ("rope_parameters", "rope_local_base_freq")),
}
_REQUIRED_KEYS["gemma3_text"] = _REQUIRED_KEYS["gemma3"]
# Model types of multimodal configs -> that of their text_config.
_TEXT_MODEL_TYPE = {"gemma3": "gemma3_text"}
# hidden_act / hidden_activation -> ModelConfig.activation (transformers' ACT2FN names):
# HF_ACTIVATION's names, and their aliases.
_ACTIVATION_OF_HF = {**{hf: ours for ours, hf in HF_ACTIVATION.items()},
                     "swish": "silu", "gelu_tanh": "gelu_tanh", "gelu_new": "gelu_tanh"}


def _with_defaults(hf: dict, model_type: str) -> dict:
  """`hf` itself when it holds every key of _REQUIRED_KEYS, else completed by transformers'
  config class for `model_type` (what transformers would load the checkpoint as)."""
  missing = [keys[0] for keys in _CORE_KEYS + _REQUIRED_KEYS[model_type]
             if not any(k in hf for k in keys)]
  if not missing:
    return hf
  try:
    import transformers
  except ImportError as err:
    raise ValueError(f"config.json ({model_type}) lacks {missing}, and transformers, whose "
                     "defaults they would take, is not installed") from err
  kwargs = {k: v for k, v in hf.items() if k != "model_type"}
  # A flat "gemma3" dict holds the text config's fields (the gemma3 class is multimodal).
  text_type = _TEXT_MODEL_TYPE.get(model_type, model_type)
  return transformers.AutoConfig.for_model(text_type, **kwargs).to_dict()


def from_hf_config(hf: Mapping[str, Any]) -> ModelConfig:
  """Builds a ModelConfig from a Hugging Face `config.json` dictionary.

  Keys the dictionary leaves out take transformers' defaults for its model type.

  Raises:
    ValueError: for an architecture (or a feature of one) this package does not implement.
  """
  hf = dict(hf)
  if "text_config" in hf:  # Gemma 3 multimodal checkpoints nest the LM config.
    outer = hf
    hf = dict(outer["text_config"] or {})
    if "eos_token_id" in outer:
      hf["eos_token_id"] = outer["eos_token_id"]
    outer_type = outer.get("model_type", "")
    hf.setdefault("model_type", _TEXT_MODEL_TYPE.get(outer_type, outer_type))
  model_type = hf.get("model_type", "")
  family = _FAMILY_OF_MODEL_TYPE.get(model_type)
  if family is None:
    raise ValueError(
        f"config.json model_type={model_type!r} is not supported; supported model types: "
        f"{', '.join(_FAMILY_OF_MODEL_TYPE)}")
  hf = _with_defaults(hf, model_type)
  # Qwen2's q/k/v biases are built in; elsewhere attention_bias also biases o_proj.
  for key in ("attention_bias", "mlp_bias", "use_bidirectional_attention"):
    if hf.get(key) and not (key == "attention_bias" and family == "qwen2"):
      raise ValueError(f"config.json {key}=True is not supported for {model_type}")
  if family == "gemma3" and hf.get("attn_logit_softcapping") is not None:
    # transformers 5's Gemma 3 attention ignores it; real checkpoints leave it null.
    raise ValueError(f"config.json attn_logit_softcapping={hf['attn_logit_softcapping']} is "
                     f"not supported for {model_type}")
  num_heads = hf["num_attention_heads"]
  hidden = hf["hidden_size"]
  head_dim = hf.get("head_dim") or hidden // num_heads
  num_layers = hf["num_hidden_layers"]
  gemma = family in ("gemma2", "gemma3")
  rope_theta, rope_local_theta, scaling = _rope_parameters(hf, family)
  sliding_window = hf.get("sliding_window")
  layer_types = hf.get("layer_types")
  sliding_layers = None
  if gemma and layer_types:
    sliding_layers = tuple(t == "sliding_attention" for t in layer_types)
  elif family == "gemma2":
    sliding_layers = tuple(i % 2 == 0 for i in range(num_layers))
  elif family == "gemma3":
    pattern = hf.get("sliding_window_pattern", 6)
    sliding_layers = tuple((i + 1) % pattern != 0 for i in range(num_layers))
  elif model_type == "mistral":  # transformers' Mistral slides on every layer
    sliding_layers = (True,) * num_layers
  elif hf.get("use_sliding_window") and sliding_window:
    raise ValueError("config.json use_sliding_window=True is not supported for " + model_type)
  if sliding_window is None or not any(sliding_layers or ()):
    sliding_window, sliding_layers = None, None  # no layer slides

  query_scale = None
  if gemma:
    query_scale = hf.get("query_pre_attn_scalar", head_dim) ** -0.5
  # Gemma's modules read hidden_activation; the others hidden_act.
  act = hf.get("hidden_activation") if gemma else hf.get("hidden_act", "silu")
  if act not in _ACTIVATION_OF_HF:
    key = "hidden_activation" if gemma else "hidden_act"
    raise ValueError(f"config.json {key}={act!r} is not supported; supported: "
                     f"{sorted(_ACTIVATION_OF_HF)}")
  return ModelConfig(
      family=family,
      vocab_size=hf["vocab_size"],
      hidden_size=hidden,
      num_layers=num_layers,
      num_heads=num_heads,
      num_kv_heads=hf.get("num_key_value_heads") or num_heads,
      head_dim=head_dim,
      intermediate_size=hf["intermediate_size"],
      norm_eps=hf.get("rms_norm_eps", 1e-6),
      rope_theta=rope_theta,
      rope_local_theta=rope_local_theta,
      rope_scaling=scaling,
      tie_embeddings=bool(hf.get("tie_word_embeddings", gemma)),
      qkv_bias=family == "qwen2",
      qk_norm=family in ("qwen3", "gemma3"),
      norm_offset=gemma,
      embed_scale=gemma,
      sandwich_norm=gemma,
      activation=_ACTIVATION_OF_HF[act],
      query_scale=query_scale,
      attn_logit_softcap=hf.get("attn_logit_softcapping") if family == "gemma2" else None,
      final_logit_softcap=hf.get("final_logit_softcapping") if gemma else None,
      sliding_window=sliding_window,
      sliding_layers=sliding_layers,
      bos_token_id=hf.get("bos_token_id"),
      eos_token_ids=_eos_tuple(hf.get("eos_token_id")),
      pad_token_id=hf.get("pad_token_id") or 0,
  )


def rope_frequencies(config: ModelConfig, local: bool = False):
  """Inverse rotary frequencies [Dh/2] of a global (or local sliding-window) layer.

  Global layers apply the optional scaling ('linear', or Llama 3's long-context rule);
  Gemma 3's local layers use their own base and no scaling.
  """
  import numpy as np
  theta = config.rope_local_theta if (local and config.rope_local_theta) else config.rope_theta
  inv = 1.0 / (theta ** (np.arange(0, config.head_dim, 2, dtype=np.float64) / config.head_dim))
  if config.rope_scaling is None or (local and config.rope_local_theta):
    return inv.astype(np.float32)
  s = dict(config.rope_scaling)
  if s["rope_type"] == "linear":
    return (inv / s["factor"]).astype(np.float32)
  factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
  old_len = s["original_max_position_embeddings"]
  low_wavelen, high_wavelen = old_len / low, old_len / high
  wavelen = 2 * math.pi / inv
  smooth = (old_len / wavelen - low) / (high - low)
  scaled = np.where(wavelen > low_wavelen, inv / factor, inv)
  mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
  scaled = np.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled)
  return scaled.astype(np.float32)
