"""Pure-functional decoder forward pass over a parameter pytree.

Parameters (x @ W layout, [in, out]); per-layer leaves are stacked on a leading L axis
so that `lax.scan` runs the layers (0.4 s to compile on a 2-core CPU instead of 4-9 s
unrolled):

  embed            [V, D]
  lm_head          [D, V]            (absent when config.tie_embeddings)
  final_norm       [D]
  layers/attn_norm [L, D]            layers/mlp_norm  [L, D]
  layers/q         [L, D, H*Dh]      layers/k, v      [L, D, Hkv*Dh]
  layers/o         [L, H*Dh, D]
  layers/gate, up  [L, D, F]         layers/down      [L, F, D]
  layers/q_bias    [L, H*Dh]  layers/k_bias, v_bias [L, Hkv*Dh]          (qkv_bias)
  layers/q_norm, k_norm [L, Dh]                                          (qk_norm)
  layers/post_attn_norm, post_mlp_norm [L, D]                            (sandwich_norm)

`layers` may also be a tuple of L per-layer dicts (`unstack_layers`), optionally with
q/k/v fused into `qkv` [D, (H+2Hkv)*Dh] (+ `qkv_bias`) and gate/up into `gate_up` [D, 2F],
and with matrices stored [out, in] under `<name>_oi` (`qkv_oi`, `o_oi`, ...): the same
maths unrolled, reading each weight in place (XLA:CPU copies every layer's weights out of
stacked arrays inside a scan): faster decoding, slower compile.

Shape legend: B batch, T new tokens, S cache slots, D hidden, V vocabulary.
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np

from diversed_jax.models import attention, cpu_kernels, products
from diversed_jax.models.config import ModelConfig, rope_frequencies
from diversed_jax.models.kv_cache import KVCache

Params = dict


def rms_norm(x, weight, eps: float, offset: bool):
  """RMSNorm in float32; Gemma scales by (1 + weight)."""
  x32 = x.astype(jnp.float32)
  y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  w = weight.astype(jnp.float32)
  y = y * (1.0 + w if offset else w)
  return y.astype(x.dtype)


def apply_rope(x_bthd, positions_bt, inv_freq):
  """Rotary embedding, Hugging Face 'rotate half' layout."""
  angles = positions_bt[..., None].astype(jnp.float32) * inv_freq  # [B, T, Dh/2]
  cos = jnp.cos(angles)[:, :, None, :]
  sin = jnp.sin(angles)[:, :, None, :]
  x1, x2 = jnp.split(x_bthd.astype(jnp.float32), 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x_bthd.dtype)


def _activation(config: ModelConfig, x):
  if config.activation == "silu":
    return jax.nn.silu(x)
  return jax.nn.gelu(x, approximate=config.activation == "gelu_tanh")


def layer_constants(config: ModelConfig):
  """Per-layer arrays the scan consumes: rotary frequencies [L, Dh/2], local flag [L]."""
  sliding = np.asarray(config.layer_is_sliding, bool)
  freqs = np.stack([rope_frequencies(config, local=bool(s)) for s in sliding])
  return jnp.asarray(freqs), jnp.asarray(sliding)


def dense(x, lp, name):
  """x @ W for layer matrix `name`, stored [in, out] or, as `<name>_oi`, [out, in] (then
  through `products.matmul_oi`, which runs products over a few rows in a faster form)."""
  if name + "_oi" in lp:
    return products.matmul_oi(x, lp[name + "_oi"])
  return x @ lp[name]


def _project_qkv(config, lp, x_btd, positions_bt, inv_freq):
  """Rotated queries [B, T, H, Dh] and keys, values [B, T, Hkv, Dh] of new tokens."""
  b, t, _ = x_btd.shape
  h, hkv, dh = config.num_heads, config.num_kv_heads, config.head_dim
  if "qkv" in lp or "qkv_oi" in lp:  # fused by unstack_layers: one matmul instead of three
    qkv = dense(x_btd, lp, "qkv")
    if config.qkv_bias:
      qkv = qkv + lp["qkv_bias"]
    q, k, v = jnp.split(qkv, [h * dh, (h + hkv) * dh], axis=-1)
  else:
    q = dense(x_btd, lp, "q")
    k = dense(x_btd, lp, "k")
    v = dense(x_btd, lp, "v")
    if config.qkv_bias:
      q, k, v = q + lp["q_bias"], k + lp["k_bias"], v + lp["v_bias"]
  q = q.reshape(b, t, h, dh)
  k = k.reshape(b, t, hkv, dh)
  v = v.reshape(b, t, hkv, dh)
  if config.qk_norm:
    q = rms_norm(q, lp["q_norm"], config.norm_eps, config.norm_offset)
    k = rms_norm(k, lp["k_norm"], config.norm_eps, config.norm_offset)
  return apply_rope(q, positions_bt, inv_freq), apply_rope(k, positions_bt, inv_freq), v


def _write_layer(cache, index, positions_bt, new_bthd):
  """Writes new keys or values at each row's own offset, in place: into a per-layer
  buffer [B, S, Hkv, Dh] (index None) or into slice `index` of a stacked cache, which is a
  loop carry, so XLA updates it without copying (slicing it out per layer and stacking it
  back, as scan's xs/ys would, copies the whole cache every step)."""
  rows_b1 = jnp.arange(new_bthd.shape[0])[:, None]
  at = (rows_b1, positions_bt) if index is None else (index, rows_b1, positions_bt)
  return cache.at[at].set(new_bthd.astype(cache.dtype))


def _layer(config, lp, carry, positions_bt, inv_freq, sliding, index):
  """One decoder layer on carry (x_btd, k, v); writes its keys and values into the
  layer's own buffers k, v [B, S, Hkv, Dh] (index None) or into slice `index` of stacked
  caches [L, B, S, Hkv, Dh], and returns the new carry."""
  x, k_all, v_all = carry
  h = rms_norm(x, lp["attn_norm"], config.norm_eps, config.norm_offset)
  q, k, v = _project_qkv(config, lp, h, positions_bt, inv_freq)
  k_all = _write_layer(k_all, index, positions_bt, k)
  v_all = _write_layer(v_all, index, positions_bt, v)
  attn = attention.attend(config, q, k_all, v_all, positions_bt, sliding, index)
  attn = dense(attn, lp, "o")
  if config.sandwich_norm:
    attn = rms_norm(attn, lp["post_attn_norm"], config.norm_eps, config.norm_offset)
  x = x + attn
  h = rms_norm(x, lp["mlp_norm"], config.norm_eps, config.norm_offset)
  if "gate_up" in lp or "gate_up_oi" in lp:
    gate, up = jnp.split(dense(h, lp, "gate_up"), 2, axis=-1)
  else:
    gate, up = dense(h, lp, "gate"), dense(h, lp, "up")
  mlp = dense(_activation(config, gate) * up, lp, "down")
  if config.sandwich_norm:
    mlp = rms_norm(mlp, lp["post_mlp_norm"], config.norm_eps, config.norm_offset)
  return x + mlp, k_all, v_all


def per_layer_cache(layers, batch: int) -> bool:
  """The cache layout fastest for `layers`: per-layer buffers for unrolled layers with
  several rows; stacked otherwise. (With one row, XLA:CPU turns the per-layer write into an
  update that it fuses into both the attention and the returned cache, and then copies
  every layer's buffer. A stacked cache costs no copies where the attention kernel reads
  its layers in place; XLA's attention forms slice each layer out, a copy. At batch 8 the
  per-layer buffers still decoded ~7% faster than a stacked cache read in place.)"""
  return isinstance(layers, (tuple, list)) and batch > 1


def init_cache(params: Params, config: ModelConfig, batch: int, max_len: int) -> KVCache:
  """An empty cache in the dtype of `params` and the layout fastest for them."""
  return KVCache.create(config, batch, max_len, params["embed"].dtype,
                        per_layer=per_layer_cache(params["layers"], batch))


def forward_hidden(params: Params, config: ModelConfig, tokens_bt: jax.Array,
                   cache: KVCache | None = None) -> tuple[jax.Array, KVCache]:
  """Runs the decoder over T new tokens per row.

  Row b's tokens take positions cache.lengths_b[b] + [0, T) and are written to the cache
  there. Without a cache, a fresh one of T slots is used (a plain causal forward). The
  caller keeps lengths_b + T within the cache's slots (see `decoder_layers`).

  Returns:
    hidden_btd: last hidden state after the final norm, [B, T, D].
    cache: the updated cache with lengths_b advanced by T.
  """
  b, t = tokens_bt.shape
  if cache is None:
    cache = init_cache(params, config, b, t)
  x = params["embed"][tokens_bt]
  if config.embed_scale:
    x = x * jnp.asarray(config.hidden_size ** 0.5, x.dtype)
  x, cache = decoder_layers(params["layers"], config, x, cache)
  return rms_norm(x, params["final_norm"], config.norm_eps, config.norm_offset), cache


def decoder_layers(layers, config: ModelConfig, x_btd: jax.Array,
                   cache: KVCache) -> tuple[jax.Array, KVCache]:
  """The decoder layers (stacked leaves run by `lax.scan`, or an unstacked tuple run
  unrolled) on input vectors [B, T, D] at positions cache.lengths_b + [0, T).

  Returns (x_btd before the final norm, cache advanced by T). Unrolled layers take a
  cache in either layout (see `KVCache`, `init_cache`); scanned ones a stacked cache (a
  per-layer one is converted, a copy).
  Drafts that build their own inputs (feature drafts) call this directly.

  Raises:
    ValueError: T exceeds the cache's S slots (at trace time). Rows whose lengths leave
      fewer than T free slots (known only at run time) are the caller's to avoid: their
      writes past the end are dropped and their attention goes wrong.
  """
  t = x_btd.shape[1]
  if t > cache.capacity:
    raise ValueError(f"{t} new tokens do not fit a KV cache of {cache.capacity} slots")
  positions_bt = cache.lengths_b[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
  inv_freq_l, sliding_l = layer_constants(config)
  if isinstance(layers, (tuple, list)):  # unstacked: see `unstack_layers`
    if cache.per_layer:
      k_l, v_l = list(cache.k), list(cache.v)
      for i, lp in enumerate(layers):
        x_btd, k_l[i], v_l[i] = _layer(config, lp, (x_btd, k_l[i], v_l[i]), positions_bt,
                                       inv_freq_l[i], sliding_l[i], None)
      return x_btd, KVCache(tuple(k_l), tuple(v_l), cache.lengths_b + t)
    carry = (x_btd, cache.k, cache.v)
    for i, lp in enumerate(layers):
      carry = _layer(config, lp, carry, positions_bt, inv_freq_l[i], sliding_l[i], i)
    x, k_new, v_new = carry
    return x, KVCache(k_new, v_new, cache.lengths_b + t)
  cache = cache.as_layout(per_layer=False)

  def layer(carry, xs):
    lp, inv_freq, sliding, index = xs
    return _layer(config, lp, carry, positions_bt, inv_freq, sliding, index), None

  layer_ids = jnp.arange(config.num_layers, dtype=jnp.int32)
  (x, k_new, v_new), _ = jax.lax.scan(layer, (x_btd, cache.k, cache.v),
                                      (layers, inv_freq_l, sliding_l, layer_ids))
  return x, KVCache(k_new, v_new, cache.lengths_b + t)


def logits_from_hidden(params: Params, config: ModelConfig, hidden: jax.Array) -> jax.Array:
  """Next-token logits [..., V] in float32 from final hidden states [..., D]."""
  if config.tie_embeddings:
    # Contract against the embedding's own [V, D] layout: `embed.T` made XLA copy the whole
    # (largest) matrix every call.
    # The decoding layout may hold the same matrix narrower (see `unstack_layers`).
    head = params.get("tied_head_oi", params["embed"])
    logits = products.matmul_oi(hidden, head, preferred_element_type=jnp.float32)
  else:
    logits = jnp.matmul(hidden, params["lm_head"], preferred_element_type=jnp.float32)
  if config.final_logit_softcap is not None:
    cap = config.final_logit_softcap
    logits = jnp.tanh(logits / cap) * cap
  return logits


def forward(params: Params, config: ModelConfig, tokens_bt: jax.Array,
            cache: KVCache | None = None) -> tuple[jax.Array, jax.Array, KVCache]:
  """Returns (logits_btv float32, hidden_btd, cache); see `forward_hidden`."""
  hidden, cache = forward_hidden(params, config, tokens_bt, cache)
  return logits_from_hidden(params, config, hidden), hidden, cache


forward_jit = jax.jit(forward, static_argnames=("config",))


def truncate_layers(params: Params, num_layers: int) -> Params:
  """The first `num_layers` layers with the model's own final norm and head: the
  layer-skip self-draft `self:L` (a slice of the stacked layer leaves)."""
  out = dict(params)
  if isinstance(params["layers"], (tuple, list)):
    out["layers"] = tuple(params["layers"][:num_layers])
  else:
    out["layers"] = jax.tree.map(lambda x: x[:num_layers], params["layers"])
  return out


_MATRICES = ("q", "k", "v", "qkv", "o", "gate", "up", "gate_up", "down")


def unstack_layers(params: Params, fuse: bool = True) -> Params:
  """The same parameters with `layers` as a tuple of L per-layer dicts (leaves without the
  L axis), which `forward` runs as an unrolled Python loop, every matrix stored [out, in]
  (as `<name>_oi`). With `fuse`, each layer's q/k/v projections become one matrix `qkv`
  (biases `qkv_bias`) and gate/up one matrix `gate_up`: fewer, larger matmuls.

  Why: inside `lax.scan` XLA:CPU copies each layer's weights out of the stacked arrays
  before every matmul, so batch-1 decoding reads the weights about twice. Unstacked
  weights are read in place (see benchmarks/README.md) at the price of a longer compile
  (the layers are unrolled). The [out, in] storage makes XLA:CPU's products over several
  rows faster (verifying 5 tokens for 8 rows: -15%), one-row products no slower, and
  lets `products.matmul_oi` take its fused few-row form (2-32 rows: a further 8-27%). Use
  for inference; keep the stacked form for training and checkpoints (`stack_layers`
  converts back).

  Where the few-row kernel runs, a tied embedding that int8 with a scale per 32 holds
  exactly (GGUF's Q8_0, as SmolLM2's) is also kept as `tied_head_oi`
  (`products.Int8Rows`) for the output head: the same logits from a quarter of the bytes
  (SmolLM2-135M: 113 of the 537 MB a decoding step reads become 30).
  """
  if isinstance(params["layers"], (tuple, list)):
    return params
  stacked = dict(params["layers"])
  if fuse:
    stacked["qkv"] = jnp.concatenate([stacked.pop(n) for n in ("q", "k", "v")], axis=-1)
    if "q_bias" in stacked:
      stacked["qkv_bias"] = jnp.concatenate(
          [stacked.pop(n) for n in ("q_bias", "k_bias", "v_bias")], axis=-1)
    stacked["gate_up"] = jnp.concatenate([stacked.pop("gate"), stacked.pop("up")], axis=-1)
  for name in _MATRICES:
    if name in stacked:
      stacked[name + "_oi"] = jnp.swapaxes(stacked.pop(name), -1, -2)
  num_layers = len(next(iter(stacked.values())))
  out = dict(params)
  out["layers"] = tuple({k: v[i] for k, v in stacked.items()} for i in range(num_layers))
  tied = "embed" in params and "lm_head" not in params  # an untied model's head is lm_head
  if tied and cpu_kernels.runs_here(params["embed"].dtype):
    head = products.Int8Rows.from_exact(params["embed"])
    if head is not None:
      out["tied_head_oi"] = head
  return out


def stack_layers(params: Params) -> Params:
  """Inverse of `unstack_layers` (fused matrices split back)."""
  if not isinstance(params["layers"], (tuple, list)):
    return params
  params = {k: v for k, v in params.items() if k != "tied_head_oi"}  # a copy of "embed"
  stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *params["layers"])
  for name in _MATRICES:
    if name + "_oi" in stacked:
      stacked[name] = jnp.swapaxes(stacked.pop(name + "_oi"), -1, -2)
  if "qkv" in stacked:
    q_width = stacked["o"].shape[1]
    kv_width = (stacked["qkv"].shape[-1] - q_width) // 2
    cuts = [q_width, q_width + kv_width]
    stacked["q"], stacked["k"], stacked["v"] = jnp.split(stacked.pop("qkv"), cuts, axis=-1)
    if "qkv_bias" in stacked:
      stacked["q_bias"], stacked["k_bias"], stacked["v_bias"] = jnp.split(
          stacked.pop("qkv_bias"), cuts, axis=-1)
  if "gate_up" in stacked:
    stacked["gate"], stacked["up"] = jnp.split(stacked.pop("gate_up"), 2, axis=-1)
  out = dict(params)
  out["layers"] = stacked
  return out


def cast_params(params: Params, dtype) -> Params:
  return jax.tree.map(lambda x: x.astype(dtype), params)
