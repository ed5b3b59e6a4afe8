"""Content digests of artifact folders (drafts, heads), so that anything derived from a
folder (evaluation results, a head trained against a draft) notices when the folder is
rewritten in place."""

from __future__ import annotations

import hashlib
import os


# Files besides params.npz that change what a folder computes, hashed when present (a
# folder without them keeps the digest it had before they existed).
BEHAVIOUR_FILES = ("copy_gate.json",)


def folder_digest(spec) -> str | None:
  """First 12 hex digits of the SHA-1 of `spec`/params.npz (and of the BEHAVIOUR_FILES it
  has); None when `spec` is not such a folder (a registry name, 'self:L', a GGUF file)."""
  path = os.path.join(str(spec), "params.npz")
  if not os.path.isfile(path):
    return None
  digest = hashlib.sha1()
  extras = [os.path.join(str(spec), name) for name in BEHAVIOUR_FILES]
  for file in [path] + [e for e in extras if os.path.isfile(e)]:
    with open(file, "rb") as f:
      for block in iter(lambda: f.read(1 << 20), b""):
        digest.update(block)
  return digest.hexdigest()[:12]
