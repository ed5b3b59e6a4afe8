"""Draft asset folders, and the registration of the distilled draft kinds with
`diversed_jax.speculative.build` (importing this module registers them).

A draft folder holds
  draft_kind.txt   'distill_feature' or 'distill_independent' (the DRAFT_LOADERS key)
  draft.json       the DistilledDraft fields and the target it was distilled from
  params.npz       trainable leaves ('/'-joined paths, float16 storage) + 'vocab_ids'
  copy_gate.json   optional: the context-copy gate blended into the draft's law
                   (`copy_gate.py`, `diversed_jax.speculative.context_copy`)
The frozen leaves (embedding, kept head rows) are rebuilt from the target when loading, so
the folder stays small.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util

from diversed_jax import atomic_files
from diversed_jax.distill import copy_gate
from diversed_jax.distill.architectures import DistilledDraft, frozen_params
from diversed_jax.models.config import ModelConfig
from diversed_jax.speculative.context_copy import ContextCopyDraft

ASSETS = os.path.join(os.path.dirname(os.path.dirname(__file__)), "assets", "drafts")
KIND_PREFIX = "distill_"
# The files a draft folder may hold (see the module doc), and those `save_draft` writes.
DRAFT_FILES = ("draft_kind.txt", "draft.json", "params.npz", copy_gate.GATE_FILE)
SAVED_FILES = DRAFT_FILES[:3]
# The shipped default draft per target name (a folder under ASSETS).
SHIPPED_DEFAULTS = {"smollm2-135m-instruct": "smollm2-135m-feature"}


def _flatten(tree):
  return traverse_util.flatten_dict(tree, sep="/")


def _unflatten(flat):
  return traverse_util.unflatten_dict(dict(flat), sep="/")


def save_draft(folder: str, draft: DistilledDraft, train_params, vocab_ids, target_name: str,
               extra: dict | None = None, dtype=np.float16) -> None:
  """Writes a draft folder (see the module doc); float leaves stored as `dtype`."""
  os.makedirs(folder, exist_ok=True)
  flat = {k: np.asarray(v, np.float32).astype(dtype)
          for k, v in _flatten(jax.device_get(train_params)).items()}
  flat["vocab_ids"] = np.asarray(vocab_ids, np.int32)
  atomic_files.save_npz(os.path.join(folder, "params.npz"), flat)
  meta = {"kind": draft.kind, "config": dataclasses.asdict(draft.config),
          "target_hidden": draft.target_hidden, "vocab_size": draft.vocab_size,
          "target": target_name, **(extra or {})}
  atomic_files.write_json(os.path.join(folder, "draft.json"), meta, indent=1)
  # Last: the file that makes a folder a draft folder (check_export_dir, shipped_draft).
  atomic_files.write_text(os.path.join(folder, "draft_kind.txt"),
                          KIND_PREFIX + draft.kind + "\n")


def save_draft_swapped(folder: str, *args, **kwargs) -> None:
  """`save_draft` into a sibling folder, then swapped in for `folder` by two renames: a kill
  at any point leaves `folder` whole, the old draft or the new one, never a mix (after
  `recover_swapped`, which a kill between the renames needs). Other files in `folder` go."""
  new, old = folder + ".new", folder + ".old"
  shutil.rmtree(new, ignore_errors=True)
  save_draft(new, *args, **kwargs)
  if os.path.isdir(folder):
    shutil.rmtree(old, ignore_errors=True)
    os.rename(folder, old)
  os.rename(new, folder)
  shutil.rmtree(old, ignore_errors=True)


def recover_swapped(folder: str) -> None:
  """Undoes what a kill inside `save_draft_swapped` left: the old folder is put back where a
  kill came between the two renames, and the half-done sibling folders go. Only the process
  that writes `folder` may call this."""
  old = folder + ".old"
  if not os.path.isdir(folder) and os.path.isdir(old):
    os.rename(old, folder)
  for leftover in (folder + ".new", old):
    shutil.rmtree(leftover, ignore_errors=True)


def swapped_folder(folder: str) -> str:
  """`folder`, or the old draft that `save_draft_swapped` had moved aside when a kill came
  between its two renames (for readers, which must not move folders under a writer)."""
  old = folder + ".old"
  if not os.path.isdir(folder) and os.path.isfile(os.path.join(old, "draft_kind.txt")):
    return old
  return folder


def check_export_dir(dest: str) -> None:
  """Raises ValueError when `dest` holds files and is no draft folder (a mistyped path,
  whose files an export must not mix with a draft's)."""
  if (os.path.isdir(dest) and os.listdir(dest)
      and not os.path.isfile(os.path.join(dest, "draft_kind.txt"))):
    raise ValueError(f"{dest} holds files and is not a draft folder: export to a new or "
                     "empty folder, or to a draft folder to replace")


def remove_stale_files(dest: str, written, log=print) -> None:
  """Removes the draft files of `dest` that a new draft there did not write (a copy gate
  fitted for the old params must not wrap the new ones)."""
  for name in DRAFT_FILES:
    path = os.path.join(dest, name)
    if name not in written and os.path.exists(path):
      os.remove(path)
      log(f"removed {path}: it belonged to the draft this one replaces")


def replace_draft_folder(src: str, dest: str, log=print) -> None:
  """Copies the draft folder `src` to `dest`, a new or empty folder or a draft folder,
  whose draft files all come from `src` afterwards (other files are kept).

  Raises:
    ValueError: `src` is no draft folder, or `dest` holds files and is no draft folder.
  """
  if not os.path.isfile(os.path.join(src, "draft_kind.txt")):
    raise ValueError(f"{src} is not a draft folder (no draft_kind.txt): nothing to export")
  check_export_dir(dest)
  os.makedirs(dest, exist_ok=True)
  written = [name for name in DRAFT_FILES if os.path.exists(os.path.join(src, name))]
  for name in written:
    atomic_files.copy_file(os.path.join(src, name), os.path.join(dest, name))
  remove_stale_files(dest, written, log)


def read_draft(folder: str):
  """(DistilledDraft, trainable params float32, vocab_ids, metadata) of a draft folder."""
  with open(os.path.join(folder, "draft.json")) as f:
    meta = json.load(f)
  cfg = dict(meta["config"])
  for key in ("eos_token_ids",):
    cfg[key] = tuple(cfg[key])
  for key in ("rope_scaling", "sliding_layers"):
    if cfg.get(key) is not None:
      cfg[key] = tuple(tuple(x) if isinstance(x, list) else x for x in cfg[key])
  draft = DistilledDraft(kind=meta["kind"], config=ModelConfig(**cfg),
                         target_hidden=meta["target_hidden"], vocab_size=meta["vocab_size"])
  with np.load(os.path.join(folder, "params.npz")) as z:
    flat = {k: z[k] for k in z.files}
  vocab_ids = flat.pop("vocab_ids")
  train = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), _unflatten(flat))
  return draft, train, vocab_ids, meta


def load_draft_folder(folder: str, target, copy: bool = True):
  """DRAFT_LOADERS entry: (draft object, params) for a target LoadedModel. A folder with a
  context-copy gate (`copy_gate.py`) gives the draft wrapped with it, unless `copy` is
  False."""
  draft, train, vocab_ids, meta = read_draft(folder)
  if draft.vocab_size != target.config.vocab_size or \
      draft.target_hidden != target.config.hidden_size:
    raise ValueError(f"draft folder {folder!r} was distilled for {meta.get('target')!r} "
                     f"(vocabulary {draft.vocab_size}, width {draft.target_hidden}), not for "
                     f"{target.name!r}")
  params = {"train": train, "frozen": frozen_params(target.params, vocab_ids)}
  gate = copy_gate.read_gate(folder) if copy else None
  return (draft if gate is None else ContextCopyDraft(draft, gate)), params


def shipped_draft(target_name: str) -> str | None:
  """The shipped draft folder of a target, when it exists in this checkout."""
  name = SHIPPED_DEFAULTS.get(target_name)
  if name is None:
    return None
  folder = os.path.join(ASSETS, name)
  return folder if os.path.isfile(os.path.join(folder, "draft_kind.txt")) else None


def register() -> None:
  from diversed_jax.speculative import build
  for kind in ("feature", "independent"):
    build.DRAFT_LOADERS[KIND_PREFIX + kind] = load_draft_folder
  for target_name in SHIPPED_DEFAULTS:
    folder = shipped_draft(target_name)
    if folder is not None:
      build.DEFAULT_DRAFTS.setdefault(target_name, folder)


register()
