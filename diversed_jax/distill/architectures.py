"""The two trainable draft kinds, both implementing the draft interface of
`diversed_jax.speculative.drafts` (init_cache / forward).

  'independent'  a small decoder of its own (own width, own stacked layers) reading the
                 target's FROZEN embedding through a learned input projection, with a
                 truncated-vocabulary output head (learned projection to the target width,
                 then the target's frozen embedding rows of the kept tokens).
  'feature'      an EAGLE-style feature draft: x_t = fc([norm(embed(token_t)); norm(f_{t-1})])
                 -> L decoder layers -> final norm = its hidden h_t, which predicts the target's
                 feature f_t and, through the target's frozen (truncated) head, token t+1.
                 When the loop feeds the draft's own proposals (target_hidden_btd is None), the
                 last predicted feature kept in the cache stands in for f_{t-1}.

Parameter tree of both kinds (frozen leaves are rebuilt from the target at load time and
never shipped):
  frozen/embed       [V, Dt]   the target's input embedding
  frozen/head_embed  [Vs, Dt]  the target's output rows of the Vs kept tokens
  frozen/vocab_ids   [Vs]      int32 ids of the kept tokens (sorted)
  train/...                    everything trained (see `init_train_params`)

Truncated head: logits outside the kept tokens are -1e30, so q puts no mass there; exact
rules stay exact (q only has to be a distribution) and acceptance loses at most the target
mass outside the kept set.

Shape legend: B batch, T tokens, S cache slots, D draft width, Dt target width, V full
vocabulary, Vs kept vocabulary, J unrolled draft steps in training.
"""

from __future__ import annotations

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from diversed_jax.models import cpu_kernels, products, transformer
from diversed_jax.models.config import ModelConfig
from diversed_jax.models.init import init_params
from diversed_jax.models.kv_cache import KVCache

KINDS = ("independent", "feature")
NEG_INF = -1e30


def head_logits(params, hidden_btd, draft_hidden: int, target_hidden: int,
                vocab_size: int, full_vocab: bool = True):
  """Truncated-vocabulary logits.

  Returns [B, T, V] float32 (-1e30 outside the kept tokens) when full_vocab, else the kept
  tokens' logits [B, T, Vs] (training works in the kept vocabulary).
  """
  h = hidden_btd
  if draft_hidden != target_hidden:
    h = h @ params["train"]["head_proj"]
  small = products.matmul_oi(h, params["frozen"]["head_embed"],
                             preferred_element_type=jnp.float32)
  if not full_vocab:
    return small
  return to_full_vocab(small, params["frozen"]["vocab_ids"], vocab_size)


def _float16_if_exact(path, leaf):
  """A float32 [out, in] matrix (`*_oi`) as float16 where that keeps every value."""
  name = getattr(path[-1], "key", "")
  if not (isinstance(name, str) and name.endswith("_oi") and leaf.dtype == jnp.float32):
    return leaf
  narrow = leaf.astype(jnp.float16)
  return narrow if bool(jnp.array_equal(narrow.astype(jnp.float32), leaf)) else leaf


def to_full_vocab(kept_logits, vocab_ids, vocab_size: int):
  """[..., V] float32 logits from the kept tokens' [..., Vs] (NEG_INF elsewhere)."""
  out = jnp.full((*kept_logits.shape[:-1], vocab_size), NEG_INF, jnp.float32)
  return out.at[..., vocab_ids].set(kept_logits)


@flax.struct.dataclass
class FeatureCache:
  """KV cache of the feature draft plus its last predicted feature (for proposals)."""
  kv: KVCache
  feature_bd: jax.Array  # [B, Dt]

  @property
  def lengths_b(self):
    return self.kv.lengths_b

  def with_lengths(self, lengths_b) -> "FeatureCache":
    return self.replace(kv=self.kv.with_lengths(lengths_b))

  def set_row(self, row, row_cache: "FeatureCache") -> "FeatureCache":
    return FeatureCache(self.kv.set_row(row, row_cache.kv),
                        self.feature_bd.at[row].set(row_cache.feature_bd[0]))

  def take_rows(self, rows_w) -> "FeatureCache":
    return FeatureCache(self.kv.take_rows(rows_w), jnp.take(self.feature_bd, rows_w, axis=0))


@dataclasses.dataclass(frozen=True)
class DistilledDraft:
  """A trained draft (hashable: a jit static argument).

  kind: 'independent' or 'feature'.
  config: the draft's own decoder (hidden_size D; for 'feature' D == target_hidden).
  target_hidden: Dt.
  vocab_size: V of the target (the width of the logits the loop sees).
  """
  kind: str
  config: ModelConfig
  target_hidden: int
  vocab_size: int

  def __post_init__(self):
    if self.kind not in KINDS:
      raise ValueError(f"draft kind={self.kind!r} is not one of {KINDS}")
    if self.kind == "feature" and self.config.hidden_size != self.target_hidden:
      raise ValueError(f"a feature draft needs hidden_size == target width {self.target_hidden}"
                       f", got {self.config.hidden_size}")

  def init_cache(self, params, batch: int, max_len: int):
    dtype = params["frozen"]["embed"].dtype
    kv = KVCache.create(self.config, batch, max_len, dtype,
                        per_layer=transformer.per_layer_cache(params["train"]["layers"], batch))
    if self.kind == "independent":
      return kv
    return FeatureCache(kv, jnp.zeros((batch, self.target_hidden), dtype))

  def _inputs(self, params, tokens_bt, features_btd):
    """Layer inputs x_btd from tokens (and features for the feature draft)."""
    tp = params["train"]
    emb = params["frozen"]["embed"][tokens_bt]
    eps = self.config.norm_eps
    if self.kind == "independent":
      return emb @ tp["in_proj"] if "in_proj" in tp else emb
    both = jnp.concatenate([transformer.rms_norm(emb, tp["embed_norm"], eps, False),
                            transformer.rms_norm(features_btd, tp["feature_norm"], eps, False)],
                           axis=-1)
    return transformer.dense(both, tp, "fc")

  def _outputs(self, params, x_btd, full_vocab=True, last_only=False):
    hidden = transformer.rms_norm(x_btd, params["train"]["final_norm"], self.config.norm_eps,
                                  False)
    logits = head_logits(params, hidden[:, -1:] if last_only else hidden,
                         self.config.hidden_size, self.target_hidden, self.vocab_size,
                         full_vocab)
    return logits, hidden

  def inference_params(self, params):
    """The decoding layout of `params`: layers unstacked and every matrix [out, in] (see
    `transformer.unstack_layers`). Where the few-row kernel runs, matrices that float16
    holds exactly (a draft loaded from its float16 folder) are stored in float16, and the
    head's rows as `products.Int8Rows` where exact (rows of a GGUF Q8_0 embedding): the
    kernel widens them as it reads them, so the draft's outputs keep their bits, and a
    step of the shipped draft reads 23 MB instead of 59."""
    train = transformer.unstack_layers(params["train"])
    if "fc" in train:
      train["fc_oi"] = jnp.swapaxes(train.pop("fc"), 0, 1)
    frozen = params["frozen"]
    # Idempotent: a decoder built from another decoder's params passes them in this layout.
    if cpu_kernels.runs_here(jnp.float32):
      train = jax.tree_util.tree_map_with_path(_float16_if_exact, train)
      if not isinstance(frozen["head_embed"], products.Int8Rows):
        head = products.Int8Rows.from_exact(frozen["head_embed"])
        if head is not None:
          frozen = {**frozen, "head_embed": head}
    return {**params, "train": train, "frozen": frozen}

  def forward(self, params, tokens_bt, cache, target_hidden_btd=None, last_only=False):
    """(logits_btv float32, hidden_btd, cache); see drafts.py for target_hidden_btd."""
    if self.kind == "independent":
      x = self._inputs(params, tokens_bt, None)
      x, cache = transformer.decoder_layers(params["train"]["layers"], self.config, x, cache)
      logits, hidden = self._outputs(params, x, last_only=last_only)
      return logits, hidden, cache
    if target_hidden_btd is None:
      if tokens_bt.shape[1] != 1:
        raise ValueError("a feature draft fed its own proposals takes one token per call")
      features = cache.feature_bd[:, None]
    else:
      features = target_hidden_btd
    x = self._inputs(params, tokens_bt, features.astype(cache.feature_bd.dtype))
    x, kv = transformer.decoder_layers(params["train"]["layers"], self.config, x, cache.kv)
    logits, hidden = self._outputs(params, x, last_only=last_only)
    return logits, hidden, FeatureCache(kv, hidden[:, -1].astype(cache.feature_bd.dtype))

  def train_forward(self, params, tokens_bt, features_btd, unroll: int = 1):
    """Teacher-forced training pass over whole windows, in the kept vocabulary.

    For the feature draft, `features_btd[:, t]` is the target feature f_{t-1} (zeros at 0).
    With unroll J > 1 ("training-time test"), pass j feeds the previous pass's predicted
    features shifted by one and attends to pass-1 keys at positions <= t-j+1 plus its own
    pass keys at positions t-j+2..t, exactly as drafting step j sees its cache.

    Returns (logits_jbtv over the kept vocabulary float32, hidden_jbtd).
    """
    b, t = tokens_bt.shape
    if self.kind == "independent":
      x = self._inputs(params, tokens_bt, None)
      cache = KVCache.create(self.config, b, t, x.dtype)
      x, _ = transformer.decoder_layers(params["train"]["layers"], self.config, x, cache)
      logits, hidden = self._outputs(params, x, full_vocab=False)
      return logits[None], hidden[None]
    logits_j, hidden_j = [], []
    feats = features_btd
    keys_vals = []
    for j in range(unroll):
      x = self._inputs(params, tokens_bt, feats)
      x, kv = _unrolled_layers(params["train"]["layers"], self.config, x, keys_vals)
      keys_vals.append(kv)
      logits, hidden = self._outputs(params, x, full_vocab=False)
      logits_j.append(logits)
      hidden_j.append(hidden)
      # The next pass reads this pass's predictions as f_{t-1}.
      feats = jnp.pad(hidden[:, :-1], ((0, 0), (1, 0), (0, 0)))
    return jnp.stack(logits_j), jnp.stack(hidden_j)


def _unrolled_layers(layers, config: ModelConfig, x_btd, prev_kv):
  """Layers for pass j = len(prev_kv) + 1 of `train_forward`.

  prev_kv: per earlier pass, (k_lbthd, v_lbthd) post-rotary keys and values of all layers.
  Returns (x_btd before the final norm, this pass's (k_lbthd, v_lbthd)).
  """
  b, t, _ = x_btd.shape
  h_, hkv, dh = config.num_heads, config.num_kv_heads, config.head_dim
  j = len(prev_kv)  # 0-based pass index
  positions_bt = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
  inv_freq_l, _ = transformer.layer_constants(config)
  tpos = jnp.arange(t)
  # Pass 0 keys: causal up to t - j. Pass i >= 1 keys: exactly position t - j + i.
  masks = [tpos[None, :] <= tpos[:, None] - j]
  for i in range(1, j + 1):
    masks.append(tpos[None, :] == tpos[:, None] - j + i)
  mask_ts = jnp.concatenate(masks, axis=1)  # [T, (j+1) T]

  def layer(x, xs):
    lp, inv_freq, prev = xs
    h = transformer.rms_norm(x, lp["attn_norm"], config.norm_eps, False)
    q = (h @ lp["q"]).reshape(b, t, h_, dh)
    k = (h @ lp["k"]).reshape(b, t, hkv, dh)
    v = (h @ lp["v"]).reshape(b, t, hkv, dh)
    q = transformer.apply_rope(q, positions_bt, inv_freq)
    k = transformer.apply_rope(k, positions_bt, inv_freq)
    ks = jnp.concatenate([p[0] for p in prev] + [k], axis=1)
    vs = jnp.concatenate([p[1] for p in prev] + [v], axis=1)
    qg = q.reshape(b, t, hkv, h_ // hkv, dh)
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, ks) * config.scale
    scores = jnp.where(mask_ts, scores, NEG_INF)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, vs).reshape(b, t, h_ * dh)
    x = x + out @ lp["o"]
    h = transformer.rms_norm(x, lp["mlp_norm"], config.norm_eps, False)
    x = x + (jax.nn.silu(h @ lp["gate"]) * (h @ lp["up"])) @ lp["down"]
    return x, (k, v)

  prev_l = [(pk, pv) for pk, pv in prev_kv]
  x, (k_l, v_l) = jax.lax.scan(layer, x_btd, (layers, inv_freq_l, prev_l))
  return x, (k_l, v_l)


def draft_config(kind: str, target: ModelConfig, num_layers: int, hidden_size: int,
                 num_heads: int, num_kv_heads: int, intermediate_size: int) -> ModelConfig:
  """The draft's own decoder config (llama family; tie_embeddings=True only because the
  draft has no output matrix of its own: its head is the target's, see `head_logits`).

  A feature draft's layers start as copies of the target's last layers, so its width, head
  geometry and MLP width are the target's, and the given ones are ignored.
  """
  if kind == "feature":
    hidden_size, num_heads = target.hidden_size, target.num_heads
    num_kv_heads, head_dim = target.num_kv_heads, target.head_dim
    intermediate_size = target.intermediate_size
  else:
    head_dim = hidden_size // num_heads
  return ModelConfig(
      family="llama", vocab_size=target.vocab_size, hidden_size=hidden_size,
      num_layers=num_layers, num_heads=num_heads, num_kv_heads=num_kv_heads,
      head_dim=head_dim, intermediate_size=intermediate_size,
      norm_eps=target.norm_eps, rope_theta=target.rope_theta, tie_embeddings=True,
      bos_token_id=target.bos_token_id, eos_token_ids=target.eos_token_ids,
      pad_token_id=target.pad_token_id)


def init_train_params(draft: DistilledDraft, key, target_params=None, std: float = 0.02):
  """Fresh trainable leaves. With target_params, the feature draft's layers start from the
  target's last layers (a good init for predicting the last hidden state)."""
  cfg, dt = draft.config, draft.target_hidden
  k_layers, k_proj, k_head = jax.random.split(key, 3)
  full = init_params(cfg, k_layers, std=std)
  layers = jax.tree.map(lambda x: x, full["layers"])
  for name in ("attn_norm", "mlp_norm"):
    layers[name] = jnp.ones_like(layers[name])
  train = {"layers": layers, "final_norm": jnp.ones((cfg.hidden_size,), jnp.float32)}
  if draft.kind == "feature":
    if target_params is not None:
      n = cfg.num_layers
      # Copies: the training step donates its params, which must not alias the target.
      layers = jax.tree.map(lambda x: jnp.array(x[-n:], jnp.float32, copy=True),
                            target_params["layers"])
      layers = {k: v for k, v in layers.items() if k in train["layers"]}
      _check_copied_shapes(layers, train["layers"])
      train["layers"] = layers
      train["final_norm"] = jnp.array(target_params["final_norm"], jnp.float32, copy=True)
    eye = jnp.eye(dt, dtype=jnp.float32)
    # fc starts as 0.5 * (embedding + feature), both normed: a neutral mix.
    train["fc"] = 0.5 * jnp.concatenate([eye, eye], axis=0)
    train["embed_norm"] = jnp.ones((dt,), jnp.float32)
    train["feature_norm"] = jnp.ones((dt,), jnp.float32)
  else:
    if cfg.hidden_size != dt:
      train["in_proj"] = jax.random.normal(k_proj, (dt, cfg.hidden_size)) * dt ** -0.5
      train["head_proj"] = (jax.random.normal(k_head, (cfg.hidden_size, dt))
                            * cfg.hidden_size ** -0.5)
  return train


def _check_copied_shapes(copied, expected) -> None:
  """Raises ValueError when the target's layer shapes differ from the draft config's. A
  regrouping that keeps every shape (9 x 64 heads against 8 x 72) passes: `draft_config`
  takes the target's geometry, so only a hand-built config can hit that."""
  bad = {k: (v.shape, expected[k].shape) for k, v in copied.items()
         if v.shape != expected[k].shape}
  if bad:
    raise ValueError("the feature draft's config does not match the target layers it "
                     f"copies (leaf: (target, draft) shapes): {bad}; build it with "
                     "draft_config, which takes their geometry from the target")


def grow_layers(draft: DistilledDraft, train_params, num_new: int):
  """(draft, train_params) with `num_new` decoder layers appended that start as the identity.

  Each new layer copies the draft's last layer with its attention output and MLP down
  projections zeroed, so its residual branches add nothing: the grown draft computes the
  same logits and features as before, and training starts from the trained draft instead
  of from scratch (for a draft whose held-out and training acceptance have met, the limit
  is its capacity, not its data). The zeroed projections get gradients at once (their
  inputs are the copied layer's non-zero activations)."""
  if num_new < 0:
    raise ValueError(f"grow_layers needs num_new >= 0, got {num_new}")
  if num_new == 0:
    return draft, train_params
  layers = train_params["layers"]
  silent = {"o", "down"}
  last = {name: leaf[-1:] for name, leaf in layers.items()}
  new = {name: jnp.zeros_like(leaf) if name in silent else leaf for name, leaf in last.items()}
  grown = {name: jnp.concatenate([layers[name]] + [new[name]] * num_new, axis=0)
           for name in layers}
  config = dataclasses.replace(draft.config, num_layers=draft.config.num_layers + num_new)
  return dataclasses.replace(draft, config=config), {**train_params, "layers": grown}


def frozen_params(target_params, vocab_ids) -> dict:
  """The frozen leaves built from the target: embedding and the kept head rows."""
  embed = jnp.asarray(target_params["embed"], jnp.float32)
  head = embed if "lm_head" not in target_params else jnp.asarray(target_params["lm_head"]).T
  ids = np.sort(np.asarray(vocab_ids, np.int32))
  return {"embed": embed, "head_embed": head[ids], "vocab_ids": jnp.asarray(ids)}
