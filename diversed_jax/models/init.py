"""Random parameters for a ModelConfig (tests, fresh drafts)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from diversed_jax.models.config import ModelConfig


def param_shapes(config: ModelConfig) -> dict:
  """The abstract parameter tree: leaf name -> shape (see transformer.py's legend)."""
  l, d, f, v = config.num_layers, config.hidden_size, config.intermediate_size, config.vocab_size
  q = config.num_heads * config.head_dim
  kv = config.num_kv_heads * config.head_dim
  layers = {
      "attn_norm": (l, d), "mlp_norm": (l, d),
      "q": (l, d, q), "k": (l, d, kv), "v": (l, d, kv), "o": (l, q, d),
      "gate": (l, d, f), "up": (l, d, f), "down": (l, f, d),
  }
  if config.qkv_bias:
    layers.update(q_bias=(l, q), k_bias=(l, kv), v_bias=(l, kv))
  if config.qk_norm:
    layers.update(q_norm=(l, config.head_dim), k_norm=(l, config.head_dim))
  if config.sandwich_norm:
    layers.update(post_attn_norm=(l, d), post_mlp_norm=(l, d))
  shapes = {"embed": (v, d), "final_norm": (d,), "layers": layers}
  if not config.tie_embeddings:
    shapes["lm_head"] = (d, v)
  return shapes


def _is_norm(name: str) -> bool:
  return name.endswith("norm")


def init_params(config: ModelConfig, key: jax.Array, dtype=jnp.float32, std: float = 0.02):
  """Normal(0, std) matrices and biases; norms at their identity value (0 with an offset)."""
  shapes = param_shapes(config)
  flat, treedef = jax.tree_util.tree_flatten_with_path(
      shapes, is_leaf=lambda x: isinstance(x, tuple))
  keys = jax.random.split(key, len(flat))
  leaves = []
  for (path, shape), k in zip(flat, keys):
    name = path[-1].key
    if _is_norm(name):
      base = 0.0 if config.norm_offset else 1.0
      leaves.append(base + 0.1 * jax.random.normal(k, shape, dtype))
    else:
      leaves.append(std * jax.random.normal(k, shape, dtype))
  return jax.tree_util.tree_unflatten(treedef, leaves)
