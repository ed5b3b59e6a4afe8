"""Drafts as the speculative loop sees them.

A draft is a frozen (hashable, jit-static) object with

  init_cache(params, batch, max_len) -> cache pytree (in the layout and dtype `params`
      decode with: see `KVCache`)
  forward(params, tokens_bt, cache, target_hidden_btd, last_only=False)
      -> (logits_btv, hidden_btd, cache); with last_only the logits are the last token's
      alone, [B, 1, V] (the loop feeds a round's first call two tokens and reads one law)
  inference_params(params) -> params in the layout fastest for decoding (optional)

`target_hidden_btd[:, t]` is the target's last hidden state at the position just before
`tokens_bt[:, t]` (the state that predicted that token; zeros where unknown), or None when
the tokens are the draft's own proposals that the target has not seen yet. An independent
draft ignores it; a feature draft (EAGLE-style) reads it, and may keep its own features in
its cache for the None case. The cache must support `.lengths_b` and
`.with_lengths(lengths_b)` for roll-back (slots past the length are stale, never erased),
`.set_row(row, one_row_cache)` for continuous batching (a finished row takes a new
prompt) and `.take_rows(rows_w)` for the batch's tail (the loop drops finished rows).
"""

from __future__ import annotations

import dataclasses
import re

from diversed_jax.models import transformer
from diversed_jax.models.config import ModelConfig
from diversed_jax.models.kv_cache import KVCache


@dataclasses.dataclass(frozen=True)
class LMDraft:
  """An ordinary decoder LM sharing the target's vocabulary (also the `self:L` drafts)."""
  config: ModelConfig

  def init_cache(self, params, batch: int, max_len: int) -> KVCache:
    return transformer.init_cache(params, self.config, batch, max_len)

  def inference_params(self, params):
    return transformer.unstack_layers(params)

  def forward(self, params, tokens_bt, cache, target_hidden_btd=None, last_only=False):
    del target_hidden_btd  # An independent draft does not read target features.
    hidden, cache = transformer.forward_hidden(params, self.config, tokens_bt, cache)
    logits = transformer.logits_from_hidden(params, self.config,
                                            hidden[:, -1:] if last_only else hidden)
    return logits, hidden, cache


_SELF_DRAFT = re.compile(r"^self:(\d+)$")


def self_draft(target_config: ModelConfig, target_params, num_layers: int):
  """Layer-skip self-speculation: the target's first L layers + its final norm and head."""
  if not 1 <= num_layers < target_config.num_layers:
    raise ValueError(f"draft 'self:{num_layers}' needs 1 <= L < {target_config.num_layers} "
                     "(the target's layer count)")
  return (LMDraft(target_config.truncated(num_layers)),
          transformer.truncate_layers(target_params, num_layers))


def parse_self_draft(spec: str) -> int | None:
  """'self:4' -> 4; anything else -> None."""
  match = _SELF_DRAFT.match(spec.strip())
  return int(match.group(1)) if match else None
