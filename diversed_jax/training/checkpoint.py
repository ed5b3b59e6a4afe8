"""Orbax checkpoints of a head-training run: head params, optimizer state and RNG key (arrays),
plus step and data position (JSON). Saves are synchronous and orbax commits a step folder
atomically, so a `kill -9` leaves the last complete checkpoint to resume from.

In a multi-host job only process 0 keeps checkpoints (host values, gathered first) and the
others receive its restored state by broadcast (training.trainer), so orbax is told that
process 0 alone takes part: its barriers must not wait for processes that never call it."""

from __future__ import annotations

import dataclasses
import os

import jax
import orbax.checkpoint as ocp


class Checkpointer:
  """Keeps the last `keep` checkpoints under `directory` (one sub-folder per step)."""

  def __init__(self, directory: str, keep: int = 2):
    self.directory = directory = os.path.abspath(directory)
    options = ocp.CheckpointManagerOptions(
        max_to_keep=keep, create=True, enable_async_checkpointing=False)
    if jax.process_count() > 1:
      os.makedirs(directory, exist_ok=True)  # orbax creates none for a subset of processes
      options = dataclasses.replace(
          options, create=False, multiprocessing_options=ocp.options.MultiprocessingOptions(
              primary_host=0, active_processes={0}))
    self.manager = ocp.CheckpointManager(directory, options=options)

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def save(self, step: int, state: dict, meta: dict) -> None:
    """state: a pytree of arrays (params, opt_state, key), host values or arrays this
    process can read whole; meta: JSON-able (step, data_pos, the run's settings)."""
    self.manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(jax.device_get(state)), meta=ocp.args.JsonSave(meta)),
        force=True)
    self.manager.wait_until_finished()

  def restore(self, step: int, like_state: dict) -> tuple[dict, dict]:
    """(state, meta) of `step`; like_state gives the tree structure, shapes and dtypes
    (host values in, host values out)."""
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like_state)
    out = self.manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()))
    return out.state, out.meta

  def close(self) -> None:
    self.manager.close()
