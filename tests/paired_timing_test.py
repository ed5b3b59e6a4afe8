"""Paired timings: a method call compared with its two AR neighbours."""

import dataclasses

import pytest

from diversed_jax.speculative.paired_timing import (CallTiming, Pair, ar_calls,
                                                    prefill_seconds)
from diversed_jax.speculative.step_costs import StepCosts

# A target step of 10 ms, verification r = 1.5, draft c = 0.1, catch-up c2 = 0.15.
COSTS = StepCosts(decode_s=0.010, verify_s=0.015, draft_s=0.001, catchup_s=0.0015)
K = 3
PREFILL_S = 0.2  # per call, at the host's base speed


def _call(rounds_s: float, batch_rounds: int, tokens: int, speed: float,
          overhead: float = 1.0) -> CallTiming:
  """A call at host slowness `speed` (1: base) whose decoding phase is its rounds' model
  calls times `overhead` (1: no loop cost); one row, so every round is active."""
  phase_s = rounds_s * overhead * speed
  prefill_s = PREFILL_S * speed
  return CallTiming(seconds=phase_s + prefill_s, prefill_s=prefill_s, tokens=tokens,
                    batch_rounds=batch_rounds, row_rounds=batch_rounds,
                    row_slots=batch_rounds)


def _ar(tokens: int, speed: float) -> CallTiming:
  return _call(tokens * COSTS.decode_s, tokens, tokens, speed)


def _method(tokens: int, rounds: int, speed: float, overhead: float = 1.0) -> CallTiming:
  return _call(rounds * COSTS.round_s(K), rounds, tokens, speed, overhead)


@pytest.mark.parametrize("overhead", [1.0, 1.25])
def test_linear_drift_cancels_and_the_loop_overhead_remains(overhead):
  # The host slows by 10% per call: AR at 1.0, the method at 1.1, AR again at 1.2.
  # The step costs sampled beside the method call, in the host's phase at 1.1.
  local_costs = StepCosts(*(1.1 * x for x in dataclasses.astuple(COSTS)))
  pair = Pair(method=_method(120, 50, 1.1, overhead), ar_before=_ar(120, 1.0),
              ar_after=_ar(120, 1.2), costs=COSTS, local_costs=local_costs, draft_steps=K)
  # 2.4 tokens per round over a round of (0.15 + 2 * 0.1 + 1.5) target steps.
  assert pair.predicted == pytest.approx(2.4 / 1.85)
  assert pair.efficiency == pytest.approx(1 / overhead)
  assert pair.efficiency_batch == pytest.approx(1 / overhead)
  assert pair.calls == pytest.approx(1 / overhead)
  assert ar_calls(pair.ar_before, COSTS) == pytest.approx(1.0)
  # Compared with the first neighbour alone, the drift would read as loop cost.
  unpaired = dataclasses.replace(pair, ar_after=pair.ar_before)
  assert unpaired.efficiency == pytest.approx(1 / (overhead * 1.1))


def test_end_to_end_speedup_includes_the_prefills():
  pair = Pair(method=_method(120, 50, 1.0), ar_before=_ar(120, 1.0),
              ar_after=_ar(120, 1.0), costs=COSTS, local_costs=COSTS, draft_steps=K)
  ar_s, method_s = 120 * 0.010 + PREFILL_S, 50 * COSTS.round_s(K) + PREFILL_S
  assert pair.speedup == pytest.approx(ar_s / method_s)
  assert pair.phase_speedup == pytest.approx(pair.predicted)
  assert pair.speedup < pair.phase_speedup


def test_a_ragged_batch_is_taken_out_of_the_batch_prediction():
  # Two rows; the method's rows idle half the rounds' slots, AR's never.
  method = CallTiming(seconds=1.0, prefill_s=0.0, tokens=100, batch_rounds=50,
                      row_rounds=50, row_slots=100)
  ar = CallTiming(seconds=2.0, prefill_s=0.0, tokens=100, batch_rounds=50, row_rounds=100,
                  row_slots=100)
  pair = Pair(method=method, ar_before=ar, ar_after=ar, costs=COSTS, local_costs=COSTS,
              draft_steps=K)
  assert method.busy == 0.5 and ar.busy == 1.0
  assert pair.predicted_batch == pytest.approx(pair.predicted / 2)


def test_prefill_is_the_one_token_call_less_its_rounds():
  assert prefill_seconds(0.5, 8, 0.025) == pytest.approx(0.3)
  assert prefill_seconds(0.1, 8, 0.025) == 0.0  # noise never makes it negative


def test_median_step_costs_take_each_call_separately():
  slow = StepCosts(*(2 * x for x in dataclasses.astuple(COSTS)))
  odd = dataclasses.replace(COSTS, verify_s=0.5)
  assert StepCosts.median([COSTS, slow, odd]) == dataclasses.replace(COSTS, verify_s=0.03)
