"""GGUF (llama.cpp) checkpoints -> ModelConfig and our parameter tree.

Tensors are dequantized to float32 with `gguf.quants.dequantize`, renamed to their
Hugging Face names and handed to `hf_layout.params_from_hf`, which checks every shape.

llama.cpp's converter permutes the rows of Llama's `attn_q` / `attn_k` (weights and
biases) from Hugging Face's "rotate half" rotary layout to interleaved pairs; we undo it
here. Qwen2/Qwen3 are converted without that permutation.
"""

from __future__ import annotations

import os

import numpy as np

from diversed_jax.models import hf_layout
from diversed_jax.models.config import ModelConfig

# GGUF architectures we map, and whether their q/k rows are permuted for rotary.
_ARCHS = {"llama": True, "qwen2": False, "qwen3": False}

# GGUF per-block tensor name -> Hugging Face suffix under model.layers.{i}.
_BLOCK_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def hf_name(gguf_name: str) -> str | None:
  """Hugging Face name of a GGUF tensor, or None for tensors we do not use."""
  if gguf_name in _GLOBAL_NAMES:
    return _GLOBAL_NAMES[gguf_name]
  parts = gguf_name.split(".", 2)
  if len(parts) == 3 and parts[0] == "blk" and parts[2] in _BLOCK_NAMES:
    return f"model.layers.{parts[1]}.{_BLOCK_NAMES[parts[2]]}"
  return None


def unpermute_rotary(w: np.ndarray, n_heads: int) -> np.ndarray:
  """Inverse of llama.cpp's q/k row permutation on an [out, in] weight or [out] bias."""
  out = w.shape[0]
  head_dim = out // n_heads
  rest = w.shape[1:]
  return w.reshape(n_heads, head_dim // 2, 2, *rest).swapaxes(1, 2).reshape(w.shape)


def permute_rotary(w: np.ndarray, n_heads: int) -> np.ndarray:
  """llama.cpp's permutation (for writing test files): inverse of unpermute_rotary."""
  out = w.shape[0]
  head_dim = out // n_heads
  rest = w.shape[1:]
  return w.reshape(n_heads, 2, head_dim // 2, *rest).swapaxes(1, 2).reshape(w.shape)


def _fields(reader) -> dict:
  """All scalar/string/array metadata as Python values (tokenizer arrays skipped)."""
  out = {}
  for key, field in reader.fields.items():
    if key.startswith("tokenizer.ggml.") and key.rsplit(".", 1)[-1] in (
        "tokens", "scores", "token_type", "merges"):
      out[key] = len(field.data)  # only the size is needed (vocabulary fallback)
      continue
    try:
      out[key] = field.contents()
    except Exception:  # older gguf without contents(): first part of the value
      out[key] = field.parts[field.data[0]].tolist() if field.data else None
  return out


def config_from_metadata(meta: dict, tensor_names, path: str = "") -> ModelConfig:
  """ModelConfig from GGUF metadata.

  Raises:
    ValueError: an architecture or rotary scaling this package does not map.
  """
  arch = meta.get("general.architecture")
  if arch not in _ARCHS:
    raise ValueError(
        f"GGUF file {path}: architecture {arch!r} is not supported; supported: "
        f"{sorted(_ARCHS)} (convert the model to a Hugging Face safetensors folder instead)")
  if "rope_freqs.weight" in tensor_names:
    raise ValueError(
        f"GGUF file {path}: precomputed rotary factors (rope_freqs.weight, Llama 3.1 long "
        "context scaling) are not supported; load the Hugging Face folder instead")
  experts = sorted(n for n in tensor_names if "_exps." in n or ".ffn_gate_inp." in n)
  if meta.get(f"{arch}.expert_count") or experts:
    raise ValueError(
        f"GGUF file {path}: mixture-of-experts models ({arch}.expert_count="
        f"{meta.get(f'{arch}.expert_count')}, tensors such as {experts[:2]}) are not "
        "supported")

  def get(key, default=None):
    return meta.get(f"{arch}.{key}", default)

  def get_float(key, default):
    # GGUF stores float32: 1e-5 reads back as 9.9999997e-06. The shortest decimal that
    # rounds to the same float32 is the value the converter was given.
    return float(str(np.float32(get(key, default))))

  scaling_type = get("rope.scaling.type", "none")
  rope_scaling = None
  if scaling_type == "linear":
    rope_scaling = (("factor", get_float("rope.scaling.factor", 1.0)), ("rope_type", "linear"))
  elif scaling_type not in ("none", None):
    raise ValueError(f"GGUF file {path}: rope scaling type {scaling_type!r} is not supported")
  num_heads = int(get("attention.head_count"))
  hidden = int(get("embedding_length"))
  vocab = get("vocab_size") or meta.get("tokenizer.ggml.tokens")
  eos = meta.get("tokenizer.ggml.eos_token_id")
  return ModelConfig(
      family=arch,
      vocab_size=int(vocab),
      hidden_size=hidden,
      num_layers=int(get("block_count")),
      num_heads=num_heads,
      num_kv_heads=int(get("attention.head_count_kv", num_heads)),
      head_dim=int(get("attention.key_length", hidden // num_heads)),
      intermediate_size=int(get("feed_forward_length")),
      norm_eps=get_float("attention.layer_norm_rms_epsilon", 1e-6),
      rope_theta=get_float("rope.freq_base", 10000.0),
      rope_scaling=rope_scaling,
      tie_embeddings="output.weight" not in tensor_names,
      qkv_bias="blk.0.attn_q.bias" in tensor_names,
      qk_norm=arch == "qwen3",
      bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
      eos_token_ids=() if eos is None else (int(eos),),
      pad_token_id=int(meta.get("tokenizer.ggml.padding_token_id") or 0),
  )


def load_gguf(path: str) -> tuple[ModelConfig, dict]:
  """(config, parameter tree of float32 numpy arrays) from a .gguf file.

  Raises:
    FileNotFoundError: no such file.
    ValueError: unsupported architecture (mixture of experts included), a tensor missing
      or not mapped, a shape mismatch (vocab_size against token_embd's rows included).
  """
  import gguf  # deferred: only GGUF users pay for the import

  if not os.path.isfile(path):
    raise FileNotFoundError(f"GGUF file not found: {path}")
  reader = gguf.GGUFReader(path)
  tensors = {t.name: t for t in reader.tensors}
  config = config_from_metadata(_fields(reader), tensors, path)
  unmapped = sorted(n for n in tensors if hf_name(n) is None)
  if unmapped:  # dropping them would silently change the model
    raise ValueError(f"GGUF file {path}: tensors {unmapped[:8]} are not supported")
  if "token_embd.weight" in tensors:
    rows = int(tensors["token_embd.weight"].shape[-1])  # GGUF's shape is [D, V]
    if rows != config.vocab_size:
      raise ValueError(
          f"GGUF file {path}: vocab_size={config.vocab_size} (from the metadata) does not "
          f"match the {rows} rows of token_embd.weight")
  by_hf = {hf_name(n): n for n in tensors if hf_name(n) is not None}
  permuted = _ARCHS[config.family]

  def get_tensor(name):
    t = tensors[by_hf[name]]
    # Dequantized arrays come out in numpy order: the reverse of GGUF's `ne`, which is
    # Hugging Face's [out, in].
    w = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), np.float32)
    w = w.reshape(tuple(int(d) for d in reversed(t.shape)))
    if permuted and ".self_attn.q_proj." in name:
      w = unpermute_rotary(w, config.num_heads)
    elif permuted and ".self_attn.k_proj." in name:
      w = unpermute_rotary(w, config.num_kv_heads)
    return w

  return config, hf_layout.params_from_hf(config, get_tensor, list(by_hf))
