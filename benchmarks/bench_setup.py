"""Set-up shared by the engine benchmarks: the target, its tokenizer, a decoder with a
draft, and GSM8K-test prompts (chat-formatted token lists)."""

from __future__ import annotations

from diversed_jax import tokenizer as tokenizer_lib
from diversed_jax.models import loading
from diversed_jax.speculative import build
from diversed_jax.tasks.registry import get_task


def load_decoder(target_name: str, draft_spec: str | None):
  """(target, tokenizer, SpeculativeDecoder, info) for a target and a draft spec (None:
  the target's default draft)."""
  target = loading.load_model(target_name)
  tokenizer = tokenizer_lib.load_tokenizer(target_name)
  decoder, info = build.build_decoder(target, draft_spec)
  return target, tokenizer, decoder, info


def gsm8k_test_prompts(tokenizer, limit: int) -> list[list[int]]:
  """The first `limit` GSM8K-test prompts as chat-formatted token lists."""
  task = get_task("gsm8k")
  return [tokenizer_lib.encode_prompt(tokenizer, task.prompt(e), chat=True)
          for e in task.load(split="test", limit=limit)]
