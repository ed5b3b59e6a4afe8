"""Loading and saving checkpoints: registry names, Hugging Face folders, GGUF files.

    model = load_model("smollm2-135m-instruct")            # the embedded default
    model = load_model("/data/Llama-3.2-1B-Instruct")        # config.json + *.safetensors
    model = load_model("/data/model.Q4_K_M.gguf")            # llama.cpp file, dequantized
    model = load_model("Qwen/Qwen3-0.6B")                    # hub id (online, or cached)

Everything is dequantized / converted to float32 on the host, then cast to `dtype`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from diversed_jax.models import hf_layout, registry, transformer
from diversed_jax.models.config import HF_ACTIVATION, ModelConfig, from_hf_config

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
# What a hub download fetches: configs, safetensors weights, tokenizer files. Not the
# duplicate PyTorch / original-format weights many repositories also carry.
_HUB_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"]


@dataclasses.dataclass(frozen=True, eq=False)
class LoadedModel:
  """A loaded checkpoint. `params` follows transformer.py's tree (stacked layers)."""
  config: ModelConfig
  params: Any
  name: str
  source_path: str


def looks_like_local_path(spec: str) -> bool:
  """A spec only a local path can be: a weights file name, or an explicit path start."""
  return (spec.lower().endswith((".gguf", ".safetensors"))
          or spec.startswith(("./", "../", "/", "~")))


def looks_like_hub_id(spec: str) -> bool:
  return (bool(_HUB_ID.fullmatch(spec)) and not looks_like_local_path(spec)
          and not os.path.exists(spec))


def download_from_hub(hub_id: str) -> str:
  """Local snapshot folder of a hub repository: the local cache first, then the network.

  Raises:
    FileNotFoundError: offline (or gated, or unknown) and not cached, saying what to do.
  """
  try:
    import huggingface_hub
  except ImportError as err:
    raise FileNotFoundError(
        f"{hub_id!r} is not a local path and huggingface_hub is not installed; pass a local "
        "folder (config.json + *.safetensors) or a .gguf file") from err
  try:
    return huggingface_hub.snapshot_download(hub_id, allow_patterns=_HUB_PATTERNS,
                                             local_files_only=True)
  except Exception:  # not cached: try the network below
    pass
  try:
    return huggingface_hub.snapshot_download(hub_id, allow_patterns=_HUB_PATTERNS)
  except Exception as err:
    raise FileNotFoundError(
        f"could not download {hub_id!r} from the Hugging Face hub ({type(err).__name__}: "
        f"{err}). Without internet access, pass a local path instead: a folder with "
        "config.json and *.safetensors, or a .gguf file (gated models also need "
        "`huggingface-cli login`)") from err


def resolve_location(spec: str) -> tuple[str, str]:
  """(name, local path) of a registry name, folder, .gguf file or hub id. A spec ending in
  .gguf or .safetensors, or starting with ./ ../ / or ~, is only ever a local path.

  Raises:
    FileNotFoundError: nothing at that path (and not a hub id / registry name).
  """
  spec = os.fspath(spec)
  name = spec
  registered = registry.is_registered(spec)
  if registered:
    spec = registry.resolve(spec)
  spec = os.path.expanduser(spec)
  if os.path.exists(spec):
    if not registered:
      name = os.path.basename(os.path.normpath(spec))
    return name, spec
  if looks_like_local_path(spec):
    raise FileNotFoundError(f"no model at {spec!r}: nothing exists at that local path "
                            f"(relative paths start at {os.getcwd()})")
  if looks_like_hub_id(spec):
    try:
      return name, download_from_hub(spec)
    except FileNotFoundError as err:
      if os.path.isdir(spec.split("/")[0]):  # 'runs/model' may be a mistyped local path
        raise FileNotFoundError(f"{err}. Nothing exists at the local path {spec!r} either "
                                f"(relative paths start at {os.getcwd()})") from err
      raise
  raise FileNotFoundError(
      f"no model at {spec!r}: not an existing file or folder, not a registered name "
      f"({', '.join(sorted(registry.REGISTRY))}) and not a hub id like 'org/name'")


def _safetensors_files(folder: str) -> list[str]:
  index = os.path.join(folder, INDEX_FILE)
  if os.path.isfile(index):
    with open(index) as f:
      weight_map = json.load(f)["weight_map"]
    files = sorted(set(weight_map.values()))
    missing = [f for f in files if not os.path.isfile(os.path.join(folder, f))]
    if missing:
      raise FileNotFoundError(f"{index} lists shards that are not in the folder: {missing}")
    return [os.path.join(folder, f) for f in files]
  single = os.path.join(folder, SINGLE_FILE)
  if os.path.isfile(single):
    return [single]
  others = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
  if others:
    return [os.path.join(folder, f) for f in others]
  raise FileNotFoundError(
      f"no weights in {folder}: expected {SINGLE_FILE} or {INDEX_FILE} with its shards "
      f"(found: {sorted(os.listdir(folder))})")


def load_hf_folder(folder: str) -> tuple[ModelConfig, dict, dict]:
  """(config, float32 numpy parameter tree, config.json dict) of a Hugging Face folder.

  Raises:
    FileNotFoundError: no config.json or no safetensors weights.
    ValueError: unsupported model_type, missing tensor, shape mismatch.
  """
  from safetensors import safe_open

  config_path = os.path.join(folder, "config.json")
  if not os.path.isfile(config_path):
    raise FileNotFoundError(f"no config.json in {folder}")
  with open(config_path) as f:
    hf_config = json.load(f)
  config = from_hf_config(hf_config)
  handles = {}
  for path in _safetensors_files(folder):
    handle = safe_open(path, framework="np")
    for key in handle.keys():
      handles[key] = handle
  params = hf_layout.params_from_hf(config, lambda n: handles[n].get_tensor(n), list(handles))
  return config, params, hf_config


def load_model(spec: str, dtype=jnp.float32) -> LoadedModel:
  """Loads a registry name, Hugging Face folder, .gguf file or hub id.

  Returns:
    LoadedModel with params as jnp arrays of `dtype` (norm weights included).

  Raises:
    FileNotFoundError: missing file/folder, no weights, offline hub id.
    ValueError: unsupported architecture, missing tensor or shape mismatch (named).
  """
  name, path = resolve_location(spec)
  if os.path.isdir(path):
    config, params, _ = load_hf_folder(path)
  elif path.endswith(".gguf"):
    from diversed_jax.models.gguf_loading import load_gguf
    config, params = load_gguf(path)
  elif path.endswith(".safetensors"):
    config, params, _ = load_hf_folder(os.path.dirname(path) or ".")
  else:
    raise ValueError(f"{path}: not a model folder, .gguf or .safetensors file")
  params = jax.tree.map(lambda a: jnp.asarray(a, dtype), params)
  return LoadedModel(config=config, params=params, name=name, source_path=path)


def to_hf_config(config: ModelConfig) -> dict:
  """A transformers `config.json` dict that `from_hf_config` maps back to `config`.

  Raises:
    ValueError: q/k/v biases outside Qwen2 (transformers' models then bias o_proj too).
  """
  if config.qkv_bias and config.family != "qwen2":
    raise ValueError(f"ModelConfig.qkv_bias=True has no transformers {config.family} "
                     "counterpart (its attention_bias also biases o_proj)")
  arch = {"llama": ("llama", "LlamaForCausalLM"), "qwen2": ("qwen2", "Qwen2ForCausalLM"),
          "qwen3": ("qwen3", "Qwen3ForCausalLM"), "gemma2": ("gemma2", "Gemma2ForCausalLM"),
          "gemma3": ("gemma3_text", "Gemma3ForCausalLM")}[config.family]
  mistral = config.family == "llama" and config.sliding_window is not None
  if mistral:
    if not all(config.layer_is_sliding):  # Mistral slides on every layer
      raise ValueError(f"ModelConfig.sliding_layers={config.sliding_layers}: a llama-family "
                       "sliding window must cover every layer (Mistral)")
    arch = ("mistral", "MistralForCausalLM")
  eos = list(config.eos_token_ids)
  out = {
      "model_type": arch[0], "architectures": [arch[1]],
      "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
      "num_hidden_layers": config.num_layers, "num_attention_heads": config.num_heads,
      "num_key_value_heads": config.num_kv_heads, "head_dim": config.head_dim,
      "intermediate_size": config.intermediate_size, "rms_norm_eps": config.norm_eps,
      "rope_theta": config.rope_theta, "tie_word_embeddings": config.tie_embeddings,
      "bos_token_id": config.bos_token_id,
      "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
      "pad_token_id": config.pad_token_id, "torch_dtype": "float32",
  }
  if config.family in ("llama", "qwen3") and not mistral:
    out["attention_bias"] = False
  if mistral:
    out["sliding_window"] = config.sliding_window
  if config.rope_scaling is not None:
    out["rope_scaling"] = dict(config.rope_scaling)
  act = HF_ACTIVATION[config.activation]
  if config.family in ("gemma2", "gemma3"):
    qpas = config.scale ** -2
    out.update(hidden_activation=act, query_pre_attn_scalar=int(round(qpas))
               if abs(qpas - round(qpas)) < 1e-6 else qpas,
               sliding_window=config.sliding_window,
               final_logit_softcapping=config.final_logit_softcap,
               attn_logit_softcapping=config.attn_logit_softcap,
               layer_types=["sliding_attention" if s else "full_attention"
                            for s in config.layer_is_sliding])
    if config.family == "gemma3":
      out["rope_local_base_freq"] = config.rope_local_theta
  else:
    out["hidden_act"] = act
  return out


def _shards(tensors: dict, max_shard_bytes: int | None) -> list[list[str]]:
  """Greedy split of tensor names (in order) into shards of at most max_shard_bytes
  (a single larger tensor gets a shard of its own)."""
  shards, current, size = [], [], 0
  for name, arr in tensors.items():
    if current and max_shard_bytes is not None and size + arr.nbytes > max_shard_bytes:
      shards.append(current)
      current, size = [], 0
    current.append(name)
    size += arr.nbytes
  return shards + [current]


def save_hf_folder(config: ModelConfig | Mapping | LoadedModel, params, folder: str,
                   max_shard_bytes: int | None = None) -> str:
  """Writes config.json and (sharded when over max_shard_bytes) safetensors weights that
  `load_model` and transformers' `from_pretrained` both read. Returns the folder.

  Args:
    config: a ModelConfig, a transformers config.json dict, or a LoadedModel.
    params: our parameter tree, stacked or unstacked (None with a LoadedModel: its own).
  """
  from safetensors.numpy import save_file

  if isinstance(config, LoadedModel):
    params = config.params if params is None else params
    config = config.config
  if isinstance(config, ModelConfig):
    model_config, hf_config = config, to_hf_config(config)
  else:
    hf_config = dict(config)
    model_config = from_hf_config(hf_config)
  os.makedirs(folder, exist_ok=True)
  with open(os.path.join(folder, "config.json"), "w") as f:
    json.dump(hf_config, f, indent=2)
  tensors = hf_layout.params_to_hf(model_config, transformer.stack_layers(params))
  groups = _shards(tensors, max_shard_bytes)
  metadata = {"format": "pt"}  # lets transformers' PyTorch loader read the files too
  if len(groups) == 1:
    save_file(tensors, os.path.join(folder, SINGLE_FILE), metadata=metadata)
    return folder
  weight_map = {}
  for i, names in enumerate(groups):
    filename = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
    save_file({n: tensors[n] for n in names}, os.path.join(folder, filename),
              metadata=metadata)
    weight_map.update({n: filename for n in names})
  total = int(sum(np.asarray(a).nbytes for a in tensors.values()))
  with open(os.path.join(folder, INDEX_FILE), "w") as f:
    json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
  return folder
