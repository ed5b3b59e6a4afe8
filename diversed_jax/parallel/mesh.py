"""Named device meshes and shardings for the decoding and training programs.

The speculative loop has no per-device logic: placing its inputs with these shardings
(batch axis over 'data', parameters replicated, or split over 'model' later) lets XLA's
SPMD partitioner run the same jitted program on any mesh.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

DATA, MODEL = "data", "model"


def make_mesh(data: int = -1, model: int = 1, devices=None) -> Mesh:
  """A (data, model) mesh; -1 takes all remaining devices."""
  _check_size("mesh data", data)
  if model < 1:
    raise ValueError(f"mesh model={model} must be >= 1")
  devices = list(devices if devices is not None else jax.devices())
  if data == -1:
    if len(devices) % model:
      raise ValueError(f"mesh model={model} does not divide the {len(devices)} devices")
    data = len(devices) // model
  if data * model != len(devices):
    raise ValueError(f"mesh data={data} x model={model} != {len(devices)} devices")
  return Mesh(np.asarray(devices).reshape(data, model), (DATA, MODEL))


def data_mesh(data: int, rows: int, field: str = "decode.mesh_data",
              rows_field: str = "decode.batch_size") -> Mesh | None:
  """The mesh that splits `rows` decoded rows over `data` devices (-1: all of them, over
  every process), or None where that is one device: the caller then runs unsharded,
  exactly as without a mesh. Raises ValueError naming `field` / `rows_field` when the
  rows do not divide, or when a multi-process job's mesh would leave a process out."""
  _check_size(field, data)
  count = jax.device_count()
  size = count if data == -1 else data
  if size > count:
    raise ValueError(f"{field}={data}: only {count} devices are visible")
  if size == 1:
    return None
  if jax.process_count() > 1 and size != count:
    raise ValueError(f"{field}={data}: a job of {jax.process_count()} processes splits "
                     f"rows over all {count} devices (-1) or none (1)")
  if rows % size:
    raise ValueError(f"{rows_field}={rows}: rows are split over the {size} devices "
                     f"of the mesh ({field}={data}), so it must be a "
                     f"multiple of {size}; or set {field}=1 to run on one device")
  return make_mesh(size, devices=jax.devices()[:size])


def _check_size(field: str, data: int) -> None:
  if data != -1 and data < 1:
    raise ValueError(f"{field}={data}: -1 (all devices) or a positive device count")


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def batch_sharded(mesh: Mesh) -> NamedSharding:
  """Leading (batch) axis over 'data', the rest replicated."""
  return NamedSharding(mesh, P(DATA))


def place(tree, sharding):
  return jax.device_put(tree, sharding)


@dataclasses.dataclass(frozen=True)
class Placement:
  """Where a data-parallel program's inputs go: parameters replicated over the mesh, rows
  split over its 'data' axis; jit then runs the program SPMD and all-reduces what sums
  over rows (losses, gradients). mesh None (one device): inputs stay as given."""
  mesh: Mesh | None = None

  @property
  def size(self) -> int:
    """Devices the rows are split over (1 without a mesh)."""
    return 1 if self.mesh is None else self.mesh.shape[DATA]

  def params(self, tree):
    return tree if self.mesh is None else place(tree, replicated(self.mesh))

  def rows(self, tree):
    return tree if self.mesh is None else place(tree, batch_sharded(self.mesh))
