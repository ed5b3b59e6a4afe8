"""Scoring on edge inputs: an empty batch, no decoding rounds, a caller's program timeout."""

import types

import pytest

from diversed_jax.speculative import metrics
from diversed_jax.tasks import code, datasets, sandbox
from diversed_jax.tasks.registry import get_task


def test_quality_of_nothing_is_refused():
  # A mean of no rewards is no measurement; 0.0 would read as one.
  for name in ("gsm8k", "mbpp"):
    with pytest.raises(ValueError, match=f"{name}: quality of 0 completions"):
      get_task(name).quality([], [])
  gsm = get_task("gsm8k")
  examples = gsm.load(limit=1)
  assert gsm.quality([f"The answer is {examples[0].reference}."], examples) == 1.0


class _Decoder:
  """Records generate's arguments and returns a fixed Generation-like result."""

  def __init__(self, num_tokens, accepted_per_round):
    self.result = types.SimpleNamespace(num_tokens=num_tokens,
                                        accepted_per_round=accepted_per_round)
    self.calls = []

  def generate(self, prompts, verify, **kwargs):
    self.calls.append((prompts, verify, kwargs))
    return self.result


def test_greedy_tokens_per_round_without_prompts_or_rounds():
  with pytest.raises(ValueError, match="prompts: empty"):
    metrics.greedy_tokens_per_round(_Decoder(0, []), [], 2, max_new_tokens=4)
  # No rounds decoded: 0.0, as summarize's tokens_per_round, not a ZeroDivisionError.
  assert metrics.greedy_tokens_per_round(_Decoder(0, [[]]), [[1, 2]], 2, 4) == 0.0
  decoder = _Decoder(6, [[2, 1], [0]])
  assert metrics.greedy_tokens_per_round(decoder, [[1], [2]], 2, 4) == 2.0
  assert decoder.calls[0][2]["batch_size"] == 1


def test_code_rewards_take_the_callers_timeout(monkeypatch):
  seen = []
  real = sandbox.run_many

  def run_many(programs, workers=None, timeout_s=None):
    seen.append(timeout_s)
    return real(programs, workers=workers, timeout_s=timeout_s)
  monkeypatch.setattr(sandbox, "run_many", run_many)
  mbpp = get_task("mbpp")
  ex = datasets.load_examples("mbpp", limit=1)
  slow = "import time\ntime.sleep(1.5)\n" + ex[0].meta["solution"]
  assert mbpp.rewards([slow], ex, timeout_s=0.5) == [0.0]
  assert mbpp.rewards([slow], ex) == [1.0]
  assert mbpp.quality([slow], ex, workers=1, timeout_s=20.0) == 1.0
  assert seen == [0.5, code.TIMEOUT_S, 20.0]
