"""Static-shape key/value cache with per-row write heads.

Shapes: L layers, B rows, S slots, Hkv key/value heads, Dh head dim.
Row b holds its committed tokens in slots [0, lengths[b]); a forward over T new tokens
writes them at slots [lengths[b], lengths[b] + T). Slots past a row's length hold stale
values that attention masks out by causality, so rolling back rejected drafts is just
moving `lengths` back: nothing is erased.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from diversed_jax.models.config import ModelConfig

# Static cache lengths. Decode cost grows with the static length (48 ms at 256 slots vs
# 109 ms at 4,096 on a 2-core CPU), so callers round up to the smallest bucket that fits.
CACHE_BUCKETS = (128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)


def bucket_length(needed: int, buckets=CACHE_BUCKETS) -> int:
  """Smallest bucket >= needed; beyond the largest, the next multiple of it."""
  for b in buckets:
    if b >= needed:
      return b
  top = buckets[-1]
  return -(-needed // top) * top


@flax.struct.dataclass
class KVCache:
  k_lbshd: jax.Array  # [L, B, S, Hkv, Dh]
  v_lbshd: jax.Array  # [L, B, S, Hkv, Dh]
  lengths_b: jax.Array  # [B] int32, committed tokens per row

  @classmethod
  def create(cls, config: ModelConfig, batch: int, max_len: int, dtype=jnp.float32) -> "KVCache":
    shape = (config.num_layers, batch, max_len, config.num_kv_heads, config.head_dim)
    return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), jnp.zeros((batch,), jnp.int32))

  @property
  def capacity(self) -> int:
    return self.k_lbshd.shape[2]

  @property
  def batch_size(self) -> int:
    return self.k_lbshd.shape[1]

  def with_lengths(self, lengths_b: jax.Array) -> "KVCache":
    """Rolls rows back (or forward) to `lengths_b` committed tokens."""
    return self.replace(lengths_b=jnp.asarray(lengths_b, jnp.int32))

  def set_row(self, row: jax.Array, row_cache: "KVCache") -> "KVCache":
    """Row `row` (a traced index) replaced by the one-row cache `row_cache` (continuous
    batching: a finished row takes a new prompt)."""
    put = jax.lax.dynamic_update_slice_in_dim
    return KVCache(put(self.k_lbshd, row_cache.k_lbshd.astype(self.k_lbshd.dtype), row, 1),
                   put(self.v_lbshd, row_cache.v_lbshd.astype(self.v_lbshd.dtype), row, 1),
                   put(self.lengths_b, row_cache.lengths_b, row, 0))

  def truncated(self, num_layers: int) -> "KVCache":
    return self.replace(k_lbshd=self.k_lbshd[:num_layers], v_lbshd=self.v_lbshd[:num_layers])
