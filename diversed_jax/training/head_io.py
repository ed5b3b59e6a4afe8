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
from absl import logging
from flax import traverse_util

from diversed_jax import atomic_files
from diversed_jax.digest import folder_digest
from diversed_jax.rl.head import EnsembleHead
from diversed_jax.speculative.build import NO_COPY
from diversed_jax.speculative.drafts import parse_self_draft
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
  atomic_files.save_npz(os.path.join(folder, "params.npz"), flat)
  meta = {"format": FORMAT, "head": module_fields(module), "dq": int(dq), "dp": int(dp),
          **provenance}
  atomic_files.write_json(os.path.join(folder, "head.json"), meta, indent=1,
                          sort_keys=True, default=str)
  return folder


def read_meta(folder: str) -> dict:
  """head.json of a head folder."""
  path = os.path.join(folder, "head.json")
  if not os.path.isfile(path):
    raise FileNotFoundError(f"{folder!r} is not a head folder (no head.json)")
  with open(path) as f:
    meta = json.load(f)
  if meta.get("format") != FORMAT:
    raise ValueError(f"{path}: format {meta.get('format')!r}, expected {FORMAT!r}")
  return meta


def read_head(folder: str):
  """(EnsembleHead, params {'params': ...}, meta dict) of a head folder."""
  meta = read_meta(folder)
  module = EnsembleHead(**meta["head"])
  with np.load(os.path.join(folder, "params.npz")) as data:
    params = _unflatten({k: data[k] for k in data.files})
  return module, params, meta


def load_head_folder(folder: str):
  """HEAD_LOADER: folder -> (weight_fn, head params) for the speculative loop."""
  module, params, _ = read_head(folder)
  return head_weight_fn(**module_fields(module)), params


def check_pair(folder: str, target_name: str, draft_spec: str, task: str | None = None):
  """Raises ValueError when the head in `folder` was trained for another target or draft
  than `target_name` / `draft_spec` (the draft as build.load_draft resolved it); logs a
  warning when it was trained on another task than `task`. A field head.json does not
  record (a toy pair) is not compared."""
  meta = read_meta(folder)
  trained_target = meta.get("target")
  if trained_target and target_name and trained_target != target_name:
    raise ValueError(f"head {folder!r} was trained for target {trained_target!r}, not "
                     f"{target_name!r}: give a head of this target")
  if not _same_draft(meta, draft_spec):
    raise ValueError(
        f"head {folder!r} was trained with draft {meta.get('draft_spec')!r} (digest "
        f"{meta.get('draft_digest')}) but the draft is {draft_spec!r} (digest "
        f"{folder_digest(draft_spec)}): its w_t reads that draft's hidden states. Give the "
        "head of this draft, or the draft the head was trained with")
  trained_task = meta.get("task")
  if trained_task and task and trained_task != task:
    logging.warning("head %s was trained on task %r and is used on %r", folder,
                    trained_task, task)


def _same_draft(meta: dict, draft_spec: str) -> bool:
  """Whether the draft a head recorded is `draft_spec`: the same folder content (its
  digest), else for self-drafts, which have no folder, the same layer count. A folder's
  'nocopy:' form counts as the folder: the gate changes the draft's law, not the hidden
  states the head reads."""
  from diversed_jax.training.artifacts import resolved_draft_spec  # it imports this module
  if not meta.get("draft_spec"):
    return True
  recorded = resolved_draft_spec(meta["draft_spec"].removeprefix(NO_COPY))
  draft_spec = draft_spec.removeprefix(NO_COPY)
  recorded_digest, digest = meta.get("draft_digest"), folder_digest(draft_spec)
  if parse_self_draft(recorded) is not None or parse_self_draft(draft_spec) is not None:
    return parse_self_draft(recorded) == parse_self_draft(draft_spec)
  if recorded_digest is None and digest is not None:
    # A head from before digests were recorded (or of a 'nocopy:' draft): the same folder
    # is all that can be told.
    return os.path.realpath(recorded) == os.path.realpath(draft_spec)
  if recorded_digest is not None:
    return recorded_digest == digest
  return True  # model names or files without a folder digest: their spellings vary
