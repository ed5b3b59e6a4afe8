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


def shipped_heads() -> dict[tuple[str, str, str], str]:
  """(target, draft spec, task) -> head folder, for every valid folder under ASSETS."""
  out = {}
  if not os.path.isdir(ASSETS):
    return out
  for name in sorted(os.listdir(ASSETS)):
    path = os.path.join(ASSETS, name, "head.json")
    if not os.path.isfile(path):
      continue
    with open(path) as f:
      meta = json.load(f)
    if meta.get("format") != FORMAT or not meta.get("target"):
      continue
    key = (meta["target"], resolved_draft_spec(meta.get("draft_spec", "")),
           meta.get("task", ""))
    out.setdefault(key, os.path.join(ASSETS, name))
  return out


def register() -> None:
  from diversed_jax.speculative import build
  if load_head_folder not in build.HEAD_LOADER:
    build.HEAD_LOADER[:] = [load_head_folder]
  for key, folder in shipped_heads().items():
    build.DEFAULT_HEADS.setdefault(key, folder)


register()
