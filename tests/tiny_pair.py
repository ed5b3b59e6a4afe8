"""A tiny random target and draft over an 11-token vocabulary, for the tests of the
samplers that decode with them (SMC, SSD): small enough to enumerate their exact laws."""

import jax
import jax.numpy as jnp
import numpy as np

from diversed_jax.models import ModelConfig, init_params, transformer
from diversed_jax.speculative import drafts

VOCAB = 11
PROMPT = [1, 2, 3, 4]


def tiny(seed: int, layers: int, std: float):
  """(config, params) of a random Llama over VOCAB tokens."""
  config = ModelConfig(family="llama", vocab_size=VOCAB, hidden_size=32, num_layers=layers,
                       num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=48)
  return config, init_params(config, jax.random.PRNGKey(seed), std=std)


def peaked_target_flat_draft():
  """(target_config, target_params, draft, draft_params): a peaked target and a flat draft
  (std 0.1), TV(p, q) = 0.81 over two tokens: far enough that a wrong law shows, and a
  proposal that covers the target's mass."""
  target_config, target_params = tiny(0, layers=2, std=0.5)
  draft_config, draft_params = tiny(1, layers=1, std=0.1)
  return target_config, target_params, drafts.LMDraft(draft_config), draft_params


def next_laws(config, params, prefixes) -> np.ndarray:
  """Each prefix's next-token law (temperature 1), float64 [len(prefixes), VOCAB]."""
  logits = transformer.forward_jit(params, config, jnp.asarray(prefixes))[0][:, -1]
  return np.asarray(jax.nn.softmax(logits), np.float64)
