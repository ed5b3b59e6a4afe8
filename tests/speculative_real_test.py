"""The speculative loop on the real embedded SmolLM2-135M-Instruct (slow: loads 540 MB)."""

import pytest

from diversed_jax import tokenizer as tokenizer_lib
from diversed_jax.models import loading
from diversed_jax.speculative import build
from diversed_jax.speculative.types import VerifyParams

pytestmark = pytest.mark.slow

QUESTIONS = ["What is 12 + 7?", "Name three colours of the rainbow.",
             "Write one sentence about the sea.", "What is the capital of Italy?"]


@pytest.fixture(scope="module")
def setup():
  target = loading.load_model("smollm2-135m-instruct")
  tokenizer = tokenizer_lib.load_tokenizer("smollm2-135m-instruct")
  prompts = [tokenizer_lib.encode_prompt(tokenizer, q, chat=True) for q in QUESTIONS]
  decoder, _ = build.build_decoder(target, "self:6")
  return decoder, prompts


def test_greedy_speculative_equals_greedy_autoregressive(setup):
  decoder, prompts = setup
  greedy_ar = VerifyParams(method="ar", temperature=0.0)
  greedy_sd = VerifyParams(method="sd", temperature=0.0)
  expected = decoder.generate(prompts, greedy_ar, max_new_tokens=20).token_ids
  assert decoder.generate(prompts[:1], greedy_ar, max_new_tokens=20).token_ids == expected[:1]
  # One compile per case (~40 s each on CI): flat attention and kernel products at one row
  # (k = 2), the grouped attention and 24-row products of k = 5 over 4 rows.
  for k, batch in ((2, prompts[:1]), (5, prompts)):
    got = decoder.generate(batch, greedy_sd, num_draft=k, max_new_tokens=20)
    assert got.token_ids == expected[:len(batch)], (k, len(batch))
  queued = decoder.generate(prompts, greedy_sd, num_draft=3, max_new_tokens=20, batch_size=2)
  assert queued.token_ids == expected  # continuous batching: 2 rows, 4 prompts
