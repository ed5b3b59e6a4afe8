"""Head folders: what `train_head` writes and the HEAD_LOADER of speculative.build reads.

A head folder holds
  head.json    {"format": "diversed_head/1", "head": {kind, hidden_dim, init_weight,
               layer_norm}, "dq", "dp", and provenance: target, draft_spec, task, train
               (the train config), final (last metrics)}
  params.npz   the head's float32 leaves under '/'-joined paths ('params/out/kernel', ...)
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util

from diversed_jax.rl.head import EnsembleHead
from diversed_jax.training.rollouts import head_weight_fn

FORMAT = "diversed_head/1"


def _flatten(tree):
  return {k: np.asarray(v, np.float32)
          for k, v in traverse_util.flatten_dict(tree, sep="/").items()}


def _unflatten(flat):
  return traverse_util.unflatten_dict({k: jnp.asarray(v) for k, v in flat.items()}, sep="/")



def module_fields(module: EnsembleHead) -> dict:
  return {"kind": module.kind, "hidden_dim": int(module.hidden_dim),
          "init_weight": float(module.init_weight), "layer_norm": bool(module.layer_norm)}


def save_head(folder: str, module: EnsembleHead, params, dq: int, dp: int,
              **provenance) -> str:
  """Writes head.json and params.npz into `folder` (atomically per file); returns folder."""
  os.makedirs(folder, exist_ok=True)
  flat = _flatten(jax.device_get(dict(params)))
  tmp = os.path.join(folder, "params.tmp.npz")
  np.savez(tmp, **flat)
  os.replace(tmp, os.path.join(folder, "params.npz"))
  meta = {"format": FORMAT, "head": module_fields(module), "dq": int(dq), "dp": int(dp),
          **provenance}
  tmp = os.path.join(folder, "head.json.tmp")
  with open(tmp, "w") as f:
    json.dump(meta, f, indent=1, sort_keys=True, default=str)
  os.replace(tmp, os.path.join(folder, "head.json"))
  return folder


def read_head(folder: str):
  """(EnsembleHead, params {'params': ...}, meta dict) of a head folder."""
  path = os.path.join(folder, "head.json")
  if not os.path.isfile(path):
    raise FileNotFoundError(f"{folder!r} is not a head folder (no head.json)")
  with open(path) as f:
    meta = json.load(f)
  if meta.get("format") != FORMAT:
    raise ValueError(f"{path}: format {meta.get('format')!r}, expected {FORMAT!r}")
  module = EnsembleHead(**meta["head"])
  with np.load(os.path.join(folder, "params.npz")) as data:
    params = _unflatten({k: data[k] for k in data.files})
  return module, params, meta


def load_head_folder(folder: str):
  """HEAD_LOADER: folder -> (weight_fn, head params) for the speculative loop."""
  module, params, _ = read_head(folder)
  return head_weight_fn(**module_fields(module)), params
