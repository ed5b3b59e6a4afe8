"""A plain full forward (no KV cache) at a fixed width: the tests' reference for what the
speculative loop's cached, chunked passes must reproduce."""

import jax.numpy as jnp
import numpy as np

from diversed_jax.models import transformer


def _padded(rows) -> jnp.ndarray:
  """The rows right-padded to one fixed width (32, or the next power of two), so one
  compile serves every length: under the causal mask the padding cannot reach earlier
  positions, and nothing in the forward normalises across positions (checked on the tiny
  models: bitwise the unpadded logits)."""
  width = max(32, 1 << (max(map(len, rows)) - 1).bit_length())
  tokens = np.zeros((len(rows), width), np.int32)
  for i, row in enumerate(rows):
    tokens[i, :len(row)] = row
  return jnp.asarray(tokens)


def last_logits(params, config, tokens):
  """Logits [V] after `tokens` from a plain full forward."""
  return transformer.forward_jit(params, config, _padded([tokens]))[0][0, len(tokens) - 1]


def greedy_next(params, config, tokens) -> int:
  return int(jnp.argmax(last_logits(params, config, tokens)))


def greedy_continuations(params, config, prompts, steps) -> list[list[int]]:
  """Plain greedy decoding of each prompt, `steps` tokens, the prompts as one batch: each
  row's next token is read at its own last position."""
  rows = [list(p) for p in prompts]
  for _ in range(steps):
    next_bt = np.asarray(jnp.argmax(
        transformer.forward_jit(params, config, _padded(rows))[0], axis=-1))
    for i, row in enumerate(rows):
      row.append(int(next_bt[i, len(row) - 1]))
  return [row[len(p):] for row, p in zip(rows, prompts)]
