"""Continuous batching over a mesh: one queue per device.

`loop.decode` with a queue refills finished rows one prompt at a time from a queue every
row shares, which a batch split over devices cannot do without moving rows between them.
Here the Q prompts are split into D contiguous blocks over the mesh's 'data' axis and each
device runs its own `loop.decode` over its block with B/D rows (`jax.shard_map`): its own
refills, its own tail, its own round count, no communication, so no device waits for
another's slow rows. The results come back in prompt order; a round's statistics hold
every device's rows (columns device by device), `prompt_rb` indexes the whole queue, the
round count is the largest device's, and `width_r` sums the devices' rows.

Each device samples from the call's key folded with its index, so sampled calls draw
other (equally distributed) tokens than one device would; greedy calls give the same,
except for the ensembles with w < 1, whose greedy rounds still accept at random.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from diversed_jax.parallel.mesh import DATA
from diversed_jax.speculative import loop
from diversed_jax.speculative.policy_trace import PolicyTrace


def check_split(mesh: Mesh, num_prompts: int, batch_size: int) -> int:
  """Devices of the mesh's 'data' axis; ValueError unless both the prompts and the rows
  divide over them."""
  devices = mesh.shape[DATA]
  if num_prompts % devices or batch_size % devices:
    raise ValueError(f"{num_prompts} prompts through batch_size={batch_size} rows: a queue "
                     f"is split over the {devices} devices of the mesh, so both must be "
                     f"multiples of {devices}")
  return devices


_ROWS = P(DATA)  # leading axis over 'data'
_STATS = loop.RoundStats(active_rb=P(None, DATA), prompt_rb=P(None, DATA),
                         num_accepted_rb=P(None, DATA), accept_prob_rbk=P(None, DATA),
                         beta_rbk=P(None, DATA), weights_rbk=P(None, DATA), width_r=_ROWS)


def _result_specs(record_policy: bool) -> loop.DecodeResult:
  """out_specs of the devices' results: per-prompt arrays and the round counts over
  'data', the statistics by column."""
  policy = PolicyTrace(*(_ROWS,) * 5) if record_policy else None
  return loop.DecodeResult(tokens_qn=_ROWS, num_generated_q=_ROWS, num_rounds=_ROWS,
                           stats=_STATS, policy=policy)


@functools.partial(jax.jit, static_argnames=("mesh", "spec", "target_config", "draft",
                                             "weight_fn", "cache_len", "batch_size",
                                             "prefill_chunk", "tail_widths"))
def decode(target_params, draft_params, head_params, prompt_qp, prompt_lengths_q, key,
           rule_values=None, *, mesh: Mesh, spec: loop.LoopSpec, target_config, draft=None, weight_fn=None,
           cache_len: int, batch_size: int, prefill_chunk: int = loop.PREFILL_CHUNK,
           tail_widths: tuple[int, ...] = ()) -> loop.DecodeResult:
  """`loop.decode` of Q prompts through `batch_size` rows, each device of the mesh's 'data'
  axis taking Q/D prompts through batch_size/D rows (see the module doc); `tail_widths`
  are per device (below batch_size/D). The other arguments are loop.decode's."""
  devices = check_split(mesh, prompt_qp.shape[0], batch_size)
  block = prompt_qp.shape[0] // devices

  def one_device(target_params, draft_params, head_params, prompt_qp, prompt_lengths_q, key,
                 rule_values):
    index = jax.lax.axis_index(DATA)
    out = loop.decode(target_params, draft_params, head_params, prompt_qp, prompt_lengths_q,
                      jax.random.fold_in(key, index), rule_values, spec=spec,
                      target_config=target_config,
                      draft=draft, weight_fn=weight_fn, cache_len=cache_len,
                      batch_size=batch_size // devices, prefill_chunk=prefill_chunk,
                      tail_widths=tail_widths)
    stats = out.stats.replace(prompt_rb=out.stats.prompt_rb + index * block,
                              width_r=out.stats.width_r[None])
    return out.replace(num_rounds=out.num_rounds[None], stats=stats)

  out = jax.shard_map(one_device, mesh=mesh, in_specs=(P(), P(), P(), _ROWS, _ROWS, P(), P()),
                      out_specs=_result_specs(spec.record_policy), check_vma=False)(
      target_params, draft_params, head_params, prompt_qp, prompt_lengths_q, key, rule_values)
  return out.replace(num_rounds=jnp.max(out.num_rounds),
                     stats=out.stats.replace(width_r=jnp.sum(out.stats.width_r, axis=0)))
