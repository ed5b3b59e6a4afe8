"""Mapping between Hugging Face tensor names ([out, in] layout) and our parameter tree."""

from __future__ import annotations

import re

import numpy as np

from diversed_jax.models.config import ModelConfig
from diversed_jax.models.init import param_shapes

# Our per-layer leaf -> (Hugging Face suffix under model.layers.{i}., transpose?)
_LAYER_NAMES = {
    "attn_norm": ("input_layernorm.weight", False),
    "q": ("self_attn.q_proj.weight", True),
    "k": ("self_attn.k_proj.weight", True),
    "v": ("self_attn.v_proj.weight", True),
    "o": ("self_attn.o_proj.weight", True),
    "q_bias": ("self_attn.q_proj.bias", False),
    "k_bias": ("self_attn.k_proj.bias", False),
    "v_bias": ("self_attn.v_proj.bias", False),
    "q_norm": ("self_attn.q_norm.weight", False),
    "k_norm": ("self_attn.k_norm.weight", False),
    "gate": ("mlp.gate_proj.weight", True),
    "up": ("mlp.up_proj.weight", True),
    "down": ("mlp.down_proj.weight", True),
}
_GEMMA_NORMS = {
    "attn_norm": "input_layernorm.weight",
    "post_attn_norm": "post_attention_layernorm.weight",
    "mlp_norm": "pre_feedforward_layernorm.weight",
    "post_mlp_norm": "post_feedforward_layernorm.weight",
}


def layer_names(config: ModelConfig) -> dict[str, tuple[str, bool]]:
  names = dict(_LAYER_NAMES)
  if config.sandwich_norm:
    names.update({k: (v, False) for k, v in _GEMMA_NORMS.items()})
  else:
    names["mlp_norm"] = ("post_attention_layernorm.weight", False)
  return names


def _strip_prefix(name: str) -> str:
  # Multimodal wrappers (Gemma 3) put the LM under language_model.
  return re.sub(r"^(language_model\.|model\.language_model\.)", "", name)


# Decoder tensors (after _strip_prefix): a checkpoint's vision tower, projector and the
# like are not ours to read, but a decoder tensor we do not read means a feature we lack.
_DECODER_TENSOR = re.compile(r"(model\.)?(layers\.\d+|embed_tokens|norm)\.|lm_head\.")


def _ignored(name: str, config: ModelConfig) -> bool:
  """Decoder tensors that carry nothing: rotary buffers of old checkpoints, and the copy of
  a tied embedding some checkpoints store as lm_head (transformers ties over it too)."""
  return "rotary_emb." in name or (config.tie_embeddings and name.startswith("lm_head."))


def params_from_hf(config: ModelConfig, get_tensor, names) -> dict:
  """Builds our parameter tree (numpy float32) from HF tensors.

  Args:
    get_tensor: name -> numpy array, for the names in `names`.
    names: the tensor names available in the checkpoint.

  Raises:
    ValueError: on a missing tensor or a shape mismatch, naming the tensor, or on decoder
      tensors the config does not use (say biases of o_proj), naming them.
  """
  available = {_strip_prefix(n): n for n in names}
  shapes = param_shapes(config)
  used = set()

  def fetch(hf_name, shape, transpose):
    for candidate in (hf_name, "model." + hf_name):
      if candidate in available:
        used.add(candidate)
        arr = np.asarray(get_tensor(available[candidate]), np.float32)
        if transpose:
          arr = arr.T
        if arr.shape != tuple(shape):
          raise ValueError(f"tensor {candidate}: checkpoint shape {arr.shape} does not match "
                           f"the config's {tuple(shape)}")
        return arr
    raise ValueError(f"tensor {hf_name!r} is missing from the checkpoint")

  l = config.num_layers
  per_layer = layer_names(config)
  layers = {}
  for leaf, shape in shapes["layers"].items():
    suffix, transpose = per_layer[leaf]
    layers[leaf] = np.stack([fetch(f"layers.{i}.{suffix}", shape[1:], transpose)
                             for i in range(l)])
  params = {
      "embed": fetch("embed_tokens.weight", shapes["embed"], False),
      "final_norm": fetch("norm.weight", shapes["final_norm"], False),
      "layers": layers,
  }
  if "lm_head" in shapes:
    params["lm_head"] = fetch("lm_head.weight", shapes["lm_head"][::-1], False).T
  unused = sorted(available[n] for n in available
                  if n not in used and _DECODER_TENSOR.match(n) and not _ignored(n, config))
  if unused:
    more = f" and {len(unused) - 8} more" if len(unused) > 8 else ""
    raise ValueError(
        f"checkpoint tensors {unused[:8]}{more} have no place in the {config.family} "
        f"config (num_layers={config.num_layers}): the checkpoint has parameters this "
        "package does not implement, or does not match its config.json")
  return params


def params_to_hf(config: ModelConfig, params) -> dict[str, np.ndarray]:
  """Inverse of params_from_hf: HF-named float32 numpy tensors."""
  out = {"model.embed_tokens.weight": np.asarray(params["embed"]),
         "model.norm.weight": np.asarray(params["final_norm"])}
  if "lm_head" in params:
    out["lm_head.weight"] = np.asarray(params["lm_head"]).T
  for leaf, (suffix, transpose) in layer_names(config).items():
    if leaf not in params["layers"]:
      continue
    stacked = np.asarray(params["layers"][leaf])
    for i in range(config.num_layers):
      out[f"model.layers.{i}.{suffix}"] = stacked[i].T if transpose else stacked[i]
  return {k: np.ascontiguousarray(v) for k, v in out.items()}
