"""Model layer: configs, pure-functional forward passes, KV caches, checkpoint loading."""

from diversed_jax.models.config import ModelConfig, from_hf_config
from diversed_jax.models.init import init_params, param_shapes
from diversed_jax.models.kv_cache import KVCache, bucket_length
from diversed_jax.models.transformer import (forward, forward_hidden, forward_jit,
                                             logits_from_hidden, truncate_layers)
