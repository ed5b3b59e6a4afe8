"""Registers the head loader and the shipped default heads with `speculative.build`
(importing this module does it; build imports it lazily).

Shipped heads live in diversed_jax/assets/heads/<name>/ (head folders, see head_io); each
is the default for the (target, draft spec, task) recorded in its head.json. Draft specs
inside the package's assets (the shipped distilled drafts) are recorded relative to the
package ('assets/drafts/<name>') and mapped back to the absolute folder build resolves.
"""

from __future__ import annotations

import json
import os

from absl import logging

from diversed_jax.digest import folder_digest
from diversed_jax.training.head_io import FORMAT, load_head_folder

PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ASSETS = os.path.join(PACKAGE_DIR, "assets", "heads")


def portable_draft_spec(spec: str) -> str:
  """A draft spec to record: package-relative for folders inside the package."""
  if spec and os.path.isdir(spec):
    path = os.path.abspath(spec)
    if path.startswith(PACKAGE_DIR + os.sep):
      return os.path.relpath(path, PACKAGE_DIR)
  return spec


def resolved_draft_spec(spec: str) -> str:
  """The inverse of portable_draft_spec: the spec as build.load_draft resolves it."""
  if spec.startswith("assets" + os.sep) or spec.startswith("assets/"):
    return os.path.join(PACKAGE_DIR, spec)
  return spec


def shipped_heads(assets: str | None = None) -> dict[tuple[str, str, str], str]:
  """(target, draft spec, task) -> head folder, for every valid folder under `assets`
  (default: the package's ASSETS).

  A head records the digest of the draft folder it was trained with; one whose draft has
  since been rewritten in place (a re-exported draft) is skipped with a warning: its
  weights were learned for the old draft's hidden states.
  """
  assets = ASSETS if assets is None else assets
  out = {}
  digests = {}  # draft folder -> digest, each hashed once
  if not os.path.isdir(assets):
    return out
  for name in sorted(os.listdir(assets)):
    path = os.path.join(assets, name, "head.json")
    if not os.path.isfile(path):
      continue
    with open(path) as f:
      meta = json.load(f)
    if meta.get("format") != FORMAT or not meta.get("target"):
      continue
    draft = resolved_draft_spec(meta.get("draft_spec", ""))
    recorded = meta.get("draft_digest")
    if recorded is not None:
      if draft not in digests:
        digests[draft] = folder_digest(draft)
      if recorded != digests[draft]:
        logging.warning("head %s was trained for another version of draft %s (digest %s, "
                        "now %s): not used as a default; retrain it", name, draft, recorded,
                        digests[draft])
        continue
    out.setdefault((meta["target"], draft, meta.get("task", "")), os.path.join(assets, name))
  return out


def check_ship_as(name: str, target_name: str, draft_spec: str, task: str) -> None:
  """Raises ValueError when a head shipped as `name` would not be the default for
  (target, draft spec as build.load_draft resolved it, task): another shipped folder is,
  and the first in name order wins (`shipped_heads`)."""
  from diversed_jax.speculative import build
  taken = build.shipped_head(target_name, draft_spec, task)
  if taken and os.path.basename(taken) != name:
    raise ValueError(f"--ship_as={name}: {taken} is the shipped default head for "
                     f"({target_name}, {draft_spec}, {task}); ship as "
                     f"--ship_as={os.path.basename(taken)} to replace it, or remove that "
                     "folder")


def register() -> None:
  from diversed_jax.speculative import build
  if load_head_folder not in build.HEAD_LOADER:
    build.HEAD_LOADER[:] = [load_head_folder]
  for key, folder in shipped_heads().items():
    build.DEFAULT_HEADS.setdefault(key, folder)


register()
