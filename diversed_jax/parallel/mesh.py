"""Named device meshes and shardings for the decoding and training programs.

The speculative loop has no per-device logic: placing its inputs with these shardings
(batch axis over 'data', parameters replicated, or split over 'model' later) lets XLA's
SPMD partitioner run the same jitted program on any mesh.
"""

from __future__ import annotations

import os

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

DATA, MODEL = "data", "model"


def initialize_distributed() -> None:
  """Joins a multi-host job when launched as one (TPU pod, or the JAX_COORDINATOR_ADDRESS /
  JAX_NUM_PROCESSES / JAX_PROCESS_ID variables that launch/ scripts set); no-op otherwise."""
  if os.environ.get("JAX_COORDINATOR_ADDRESS") or os.environ.get("TPU_WORKER_HOSTNAMES"):
    jax.distributed.initialize()


def make_mesh(data: int = -1, model: int = 1, devices=None) -> Mesh:
  """A (data, model) mesh; -1 takes all remaining devices."""
  devices = list(devices if devices is not None else jax.devices())
  if data == -1:
    if len(devices) % model:
      raise ValueError(f"mesh model={model} does not divide the {len(devices)} devices")
    data = len(devices) // model
  if data * model != len(devices):
    raise ValueError(f"mesh data={data} x model={model} != {len(devices)} devices")
  return Mesh(np.asarray(devices).reshape(data, model), (DATA, MODEL))


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def batch_sharded(mesh: Mesh) -> NamedSharding:
  """Leading (batch) axis over 'data', the rest replicated."""
  return NamedSharding(mesh, P(DATA))


def place(tree, sharding):
  return jax.device_put(tree, sharding)
