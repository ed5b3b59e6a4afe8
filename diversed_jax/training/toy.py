"""A tiny, CPU-cheap training problem for tests and demos.

Random target (2 layers) and draft (1 layer) over a 16-token vocabulary, with peaked
distributions (init std 0.5) so that p and q differ. The reward of a rollout is the fraction
of its tokens in FAVOURED, the tokens whose probability the target raises most over the
draft on random contexts: a head improves it by moving w_t towards the target, and the
acceptance regulariser pulls the other way, so lambda sets the trade-off.

  python -m diversed_jax.training.toy --workdir /tmp/toy \
    --overrides '{"total_steps": 12, "lam": 0.1}'
"""

from __future__ import annotations

import argparse
import functools
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from diversed_jax.models import ModelConfig, init_params, transformer
from diversed_jax.speculative import drafts
from diversed_jax.speculative.decoder import ModelHandle
from diversed_jax.training.config import default_config
from diversed_jax.training.trainer import TokenTask, train_head

VOCAB = 16
NUM_FAVOURED = 4


def _model(seed: int, layers: int) -> tuple[ModelConfig, dict]:
  config = ModelConfig(family="llama", vocab_size=VOCAB, hidden_size=32, num_layers=layers,
                       num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=48)
  return config, init_params(config, jax.random.PRNGKey(seed), std=0.5)


@functools.lru_cache(maxsize=1)
def toy_pair():
  """(target ModelHandle, LMDraft, draft params)."""
  target_config, target_params = _model(0, 2)
  draft_config, draft_params = _model(1, 1)
  return (ModelHandle(target_config, target_params), drafts.LMDraft(draft_config),
          draft_params)


def toy_examples(n: int = 64, seed: int = 0) -> list[list[int]]:
  """n random prompts of 3..8 tokens (an example is its prompt)."""
  rng = np.random.default_rng(seed)
  return [rng.integers(1, VOCAB, rng.integers(3, 9)).tolist() for _ in range(n)]


@functools.lru_cache(maxsize=1)
def favoured_tokens() -> tuple[int, ...]:
  """The NUM_FAVOURED tokens with the largest mean p(x) - q(x) over random contexts."""
  target, draft, draft_params = toy_pair()
  tokens = jnp.asarray(np.random.default_rng(123).integers(1, VOCAB, (32, 12)), jnp.int32)
  p_logits, _, _ = transformer.forward(target.params, target.config, tokens)
  q_logits, _, _ = draft.forward(draft_params, tokens, None)
  gap_v = jnp.mean(jax.nn.softmax(p_logits) - jax.nn.softmax(q_logits), axis=(0, 1))
  return tuple(int(i) for i in np.argsort(-np.asarray(gap_v))[:NUM_FAVOURED])


def toy_task() -> TokenTask:
  favoured = np.asarray(favoured_tokens())

  def rewards(generated, examples):
    del examples
    return [float(np.isin(np.asarray(g), favoured).mean()) if len(g) else 0.0
            for g in generated]

  return TokenTask("toy", lambda example: list(example), rewards)


def toy_config(**overrides):
  cfg = default_config()
  cfg.update(dict(prompts_per_step=4, rollouts_per_prompt=4, max_new_tokens=8, num_draft=3,
                  total_steps=12, warmup_steps=1, learning_rate=0.05, lam=0.1,
                  checkpoint_every=4, log_every=1))
  cfg.update(overrides)
  return cfg


def run(workdir: str, progress=print, **overrides) -> str:
  target, draft, draft_params = toy_pair()
  return train_head(toy_config(**overrides), target=target, draft=draft,
                    draft_params=draft_params, task=toy_task(), examples=toy_examples(),
                    workdir=workdir, draft_spec="toy", eos_token_ids=(), progress=progress)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--workdir", required=True)
  parser.add_argument("--overrides", default="{}", help="JSON dict of train config fields")
  parser.add_argument("--sleep", type=float, default=0.0, help="seconds to pause per step")
  args = parser.parse_args()

  def progress(line):
    print(line, flush=True)
    time.sleep(args.sleep)

  print(run(args.workdir, progress=progress, **json.loads(args.overrides)), flush=True)


if __name__ == "__main__":
  main()
