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

# Static cache lengths. Every step attends over all slots (48 ms at 256 slots vs 109 ms at
# 4,096 on a 2-core CPU), so callers round up to the smallest bucket that fits, and the
# buckets are a quarter of an octave apart (multiples of 128 up to 1,024): a CNN/DM prompt
# bucket of 512 plus 64 new tokens takes 640 slots, whose decoding steps ran 18% faster
# than at 1,024. A caller's length is fixed by its prompt bucket and token budget, so finer
# buckets add no compilations.
CACHE_BUCKETS = (
    *range(128, 1024, 128),
    *(octave * quarters // 4 for octave in (1024, 2048, 4096, 8192, 16384)
      for quarters in (4, 5, 6, 7)),
    32768)


def bucket_length(needed: int, buckets=CACHE_BUCKETS) -> int:
  """Smallest bucket >= needed; beyond the largest, the next multiple of it."""
  for b in buckets:
    if b >= needed:
      return b
  top = buckets[-1]
  return -(-needed // top) * top


@flax.struct.dataclass
class KVCache:
  """Keys and values of every layer, in one of two layouts of the same data:

  stacked: `k`, `v` are arrays [L, B, S, Hkv, Dh], what `lax.scan` over stacked layers
    carries (each layer writes its slice in place);
  per-layer: `k`, `v` are tuples of L arrays [B, S, Hkv, Dh], for unrolled layers
    (`transformer.unstack_layers`): each layer reads its own buffer. The attention kernel
    reads a layer of a stacked cache in place; XLA's forms slice it out, a copy (on CPU
    that copy was 15% of a batch-8 decoding step).

  `transformer.init_cache` picks the layout for a parameter layout and batch size;
  unrolled layers run on either layout, scanned ones convert a per-layer cache (a copy).
  """
  k: jax.Array | tuple[jax.Array, ...]
  v: jax.Array | tuple[jax.Array, ...]
  lengths_b: jax.Array  # [B] int32, committed tokens per row

  @classmethod
  def create(cls, config: ModelConfig, batch: int, max_len: int, dtype=jnp.float32,
             per_layer: bool = False) -> "KVCache":
    layer_shape = (batch, max_len, config.num_kv_heads, config.head_dim)
    lengths = jnp.zeros((batch,), jnp.int32)
    if per_layer:
      zeros = lambda: tuple(jnp.zeros(layer_shape, dtype) for _ in range(config.num_layers))
      return cls(zeros(), zeros(), lengths)
    shape = (config.num_layers, *layer_shape)
    return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), lengths)

  @property
  def per_layer(self) -> bool:
    return isinstance(self.k, tuple)

  @property
  def num_layers(self) -> int:
    return len(self.k) if self.per_layer else self.k.shape[0]

  @property
  def capacity(self) -> int:
    return self._layer_shape()[1]  # S

  @property
  def batch_size(self) -> int:
    return self.lengths_b.shape[0]

  def _layer_shape(self) -> tuple[int, ...]:
    return self.k[0].shape if self.per_layer else self.k.shape[1:]

  def as_layout(self, per_layer: bool) -> "KVCache":
    """The same cache in the given layout (unchanged if it has it already; else a copy)."""
    if per_layer == self.per_layer:
      return self
    if per_layer:
      split = lambda x: tuple(x[i] for i in range(x.shape[0]))
      return self.replace(k=split(self.k), v=split(self.v))
    return self.replace(k=jnp.stack(self.k), v=jnp.stack(self.v))

  def with_lengths(self, lengths_b: jax.Array) -> "KVCache":
    """Rolls rows back (or forward) to `lengths_b` committed tokens."""
    return self.replace(lengths_b=jnp.asarray(lengths_b, jnp.int32))

  def set_row(self, row: jax.Array, row_cache: "KVCache") -> "KVCache":
    """Row `row` (a traced index) replaced by the one-row cache `row_cache` (continuous
    batching: a finished row takes a new prompt)."""
    row_cache = row_cache.as_layout(self.per_layer)
    batch_axis = 0 if self.per_layer else 1
    put = lambda old, new: jax.lax.dynamic_update_slice_in_dim(
        old, new.astype(old.dtype), row, batch_axis)
    return KVCache(jax.tree.map(put, self.k, row_cache.k), jax.tree.map(put, self.v, row_cache.v),
                   jax.lax.dynamic_update_slice_in_dim(self.lengths_b, row_cache.lengths_b,
                                                       row, 0))

  def take_rows(self, rows_w: jax.Array) -> "KVCache":
    """The cache of rows `rows_w` [W] only, in that order (a shrinking batch keeps its
    unfinished rows). One row goes back to the stacked layout, as
    `transformer.per_layer_cache` picks for one row (per-layer, XLA:CPU would copy every
    layer's buffer each step)."""
    batch_axis = 0 if self.per_layer else 1
    take = lambda x: jnp.take(x, rows_w, axis=batch_axis)
    taken = KVCache(jax.tree.map(take, self.k), jax.tree.map(take, self.v),
                    jnp.take(self.lengths_b, rows_w, axis=0))
    return taken.as_layout(self.per_layer and rows_w.shape[0] > 1)

  def truncated(self, num_layers: int) -> "KVCache":
    return self.replace(k=self.k[:num_layers], v=self.v[:num_layers])
