"""Loop efficiency from paired timings: each method call between two autoregressive calls.

This host's speed drifts by 10-25% over minutes, so a method's time and autoregressive
decoding's time taken minutes apart can differ by more than the loop's own overhead. A
`Pair` holds one method call, the AR calls just before and just after it, and the step
costs sampled next to the method call; its figures compare the method with the mean of its
two neighbours, in which a drift linear over the three calls cancels. A benchmark reports
each figure's median over pairs (benchmarks/spec_speed.py).

Every call is split into its prompts' prefills and the decoding phase, which is what the
prediction models: `CallTiming.prefill_s` comes from a one-token call of the same prompts
(max_new_tokens=1) minus its rounds' step costs.
"""

from __future__ import annotations

import dataclasses

from diversed_jax.speculative.step_costs import StepCosts


@dataclasses.dataclass(frozen=True)
class CallTiming:
  """One decoding call (all its prompts): seconds and what its rounds did."""
  seconds: float  # the whole call, prefills included
  prefill_s: float  # the prompts' prefills within it
  tokens: int  # committed tokens, all rows
  batch_rounds: int  # loop iterations
  row_rounds: int  # (row, round) pairs in which the row was active
  row_slots: int  # rows the rounds ran, summed over rounds (a shrunk tail runs fewer)

  @property
  def phase_s(self) -> float:
    """Seconds of the decoding phase: the call less its prefills."""
    return self.seconds - self.prefill_s

  @property
  def tokens_per_round(self) -> float:
    """Per row and round in which the row was active."""
    return self.tokens / self.row_rounds

  @property
  def tokens_per_slot(self) -> float:
    """Per row and BATCH round: a static batch runs until its slowest row is done."""
    return self.tokens / self.row_slots

  @property
  def busy(self) -> float:
    """Rows' occupancy: active row-rounds / the rows the rounds ran."""
    return self.row_rounds / self.row_slots


def prefill_seconds(one_token_s: float, one_token_rounds: int, round_s: float) -> float:
  """The prefills of a one-token call: its time less its rounds (one decoding step or one
  speculative round each, `round_s`)."""
  return max(one_token_s - one_token_rounds * round_s, 0.0)


def ar_calls(timing: CallTiming, costs: StepCosts) -> float:
  """Share of an AR call's decoding phase spent in the target's decoding steps."""
  return timing.batch_rounds * costs.decode_s / timing.phase_s


@dataclasses.dataclass(frozen=True)
class Pair:
  """A method call, its AR neighbours and step costs.

  `costs` feed the prediction: only their ratios matter there, which a short sample
  measures noisily (r moved 2.1-2.9 between batch-8 samples), so a benchmark passes the
  median over all its samples. `local_costs`, sampled just before the method call, give
  `calls`, which compares absolute seconds taken at the same moment.
  """
  method: CallTiming
  ar_before: CallTiming
  ar_after: CallTiming
  costs: StepCosts
  local_costs: StepCosts
  draft_steps: int  # draft forward steps per round (K, or K+1 for bonus-needs-draft rules)

  def _ar_rate(self, phase: bool) -> float:
    # Tokens over summed seconds: the neighbours' mean time, drift linear in time cancels.
    seconds = lambda t: t.phase_s if phase else t.seconds
    return ((self.ar_before.tokens + self.ar_after.tokens)
            / (seconds(self.ar_before) + seconds(self.ar_after)))

  @property
  def speedup(self) -> float:
    """End-to-end tokens/s over AR's, prefills included."""
    return self.method.tokens / self.method.seconds / self._ar_rate(phase=False)

  @property
  def phase_speedup(self) -> float:
    """Decoding-phase tokens/s over AR's."""
    return self.method.tokens / self.method.phase_s / self._ar_rate(phase=True)

  @property
  def predicted(self) -> float:
    """Speed-up predicted from tokens per round and the step costs."""
    return self.costs.predicted_speedup(self.method.tokens_per_round, self.draft_steps)

  @property
  def efficiency(self) -> float:
    """Loop efficiency: measured / predicted decoding-phase speed-up."""
    return self.phase_speedup / self.predicted

  @property
  def predicted_batch(self) -> float:
    """The prediction from per-row tokens per BATCH round relative to AR's (a batch's
    raggedness taken out of the prediction)."""
    ar_slots = self.ar_before.row_slots + self.ar_after.row_slots
    ar_per_slot = (self.ar_before.tokens + self.ar_after.tokens) / ar_slots
    return self.costs.predicted_speedup(self.method.tokens_per_slot / ar_per_slot,
                                        self.draft_steps)

  @property
  def efficiency_batch(self) -> float:
    return self.phase_speedup / self.predicted_batch

  @property
  def calls(self) -> float:
    """Share of the method's decoding phase spent in its rounds' model calls; with
    `ar_calls` of the neighbours, efficiency ~= calls / ar_calls."""
    return (self.method.batch_rounds * self.local_costs.round_s(self.draft_steps)
            / self.method.phase_s)
