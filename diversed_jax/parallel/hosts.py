"""Multi-host jobs: joining the processes, which one writes, and host reads of global arrays.

Every process of a multi-host job runs the same computations (the same jitted programs in
the same order, which the collectives need); only process 0 writes files and prints
summaries. A single process (one CPU, one GPU, one multi-GPU node) is unaffected: every
helper here reduces to what it would do without them.
"""

from __future__ import annotations

import os

import jax
import numpy as np

# Launch scripts set this to 1 where jax.distributed finds the cluster itself (a TPU pod).
AUTO_ENV = "DIVERSED_DISTRIBUTED"


def initialize_distributed() -> bool:
  """Joins a multi-host job when launched as one; returns whether it did.

  Explicit: JAX_COORDINATOR_ADDRESS=host:port, JAX_NUM_PROCESSES=N, JAX_PROCESS_ID=i (what
  launch/gpu_node.sh documents for several nodes, and the tests use on localhost).
  Detected: DIVERSED_DISTRIBUTED=1 (launch/tpu_pod.sh) or TPU_WORKER_HOSTNAMES, where
  jax.distributed reads the pod's layout from the TPU metadata. Otherwise a no-op. Call it
  before anything touches a device.
  """
  address = os.environ.get("JAX_COORDINATOR_ADDRESS")
  if address:
    count, index = os.environ.get("JAX_NUM_PROCESSES"), os.environ.get("JAX_PROCESS_ID")
    if count is None or index is None:
      raise ValueError(f"JAX_COORDINATOR_ADDRESS={address!r} needs JAX_NUM_PROCESSES and "
                       "JAX_PROCESS_ID too")
    jax.distributed.initialize(coordinator_address=address, num_processes=int(count),
                               process_id=int(index))
    return True
  if os.environ.get(AUTO_ENV) == "1" or os.environ.get("TPU_WORKER_HOSTNAMES"):
    jax.distributed.initialize()
    return True
  return False


def is_writer() -> bool:
  """Whether this process writes the job's files and prints its summaries (process 0)."""
  return jax.process_index() == 0


def fetch(tree):
  """`jax.device_get(tree)`, also for arrays that span other processes' devices (a batch
  split over a multi-host mesh, replicated parameters): those are all-gathered, so every
  process gets the whole value; this process's own arrays are read as they are.
  Single-process trees take jax.device_get unchanged."""
  def spans_processes(x):
    return isinstance(x, jax.Array) and not x.is_fully_addressable

  leaves, treedef = jax.tree.flatten(tree)
  if not any(map(spans_processes, leaves)):
    return jax.device_get(tree)
  from jax.experimental import multihost_utils
  return treedef.unflatten([
      np.asarray(multihost_utils.process_allgather(x, tiled=True)) if spans_processes(x)
      else jax.device_get(x) for x in leaves])


def broadcast_bytes(data: bytes | None) -> bytes:
  """Process 0's `data` on every process (others may pass None); a collective, so every
  process calls it at the same point. One process: `data` itself."""
  if jax.process_count() == 1:
    return data or b""  # as several processes give it
  from jax.experimental import multihost_utils
  mine = np.frombuffer(data or b"", np.uint8)
  size = int(multihost_utils.broadcast_one_to_all(np.asarray(mine.size, np.int64)))
  padded = np.zeros(max(size, 1), np.uint8)
  if jax.process_index() == 0:
    padded[:size] = mine
  out = multihost_utils.broadcast_one_to_all(padded)
  return np.asarray(out, np.uint8)[:size].tobytes()


def broadcast(tree):
  """Process 0's pytree of arrays (host values) on every process; a collective (every
  process passes a tree of the same structure, shapes and dtypes). One process: `tree`."""
  if jax.process_count() == 1:
    return tree
  from jax.experimental import multihost_utils
  # Host values on every process, so that each compiles the same collective.
  tree = jax.tree.map(np.asarray, tree)
  return jax.tree.map(np.asarray, multihost_utils.broadcast_one_to_all(tree))
