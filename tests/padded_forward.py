"""A plain full forward (no KV cache) at a fixed width: the tests' reference for what the
speculative loop's cached, chunked passes must reproduce."""

import jax.numpy as jnp

from diversed_jax.models import transformer


def last_logits(params, config, tokens):
  """Logits [V] after `tokens` from a plain full forward. The tokens are right-padded to a
  fixed width (32, or the next power of two), so one compile serves every length: under the
  causal mask the padding cannot reach earlier positions, and nothing in the forward
  normalises across positions (checked on the tiny models: bitwise the unpadded logits)."""
  width = max(32, 1 << (len(tokens) - 1).bit_length())
  padded = jnp.asarray([list(tokens) + [0] * (width - len(tokens))])
  return transformer.forward_jit(params, config, padded)[0][0, len(tokens) - 1]


def greedy_next(params, config, tokens) -> int:
  return int(jnp.argmax(last_logits(params, config, tokens)))
