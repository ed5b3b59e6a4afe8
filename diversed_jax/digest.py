"""Content digests of artifact folders (drafts, heads), so that anything derived from a
folder (evaluation results, a head trained against a draft) notices when the folder is
rewritten in place."""

from __future__ import annotations

import hashlib
import os


def folder_digest(spec) -> str | None:
  """First 12 hex digits of the SHA-1 of `spec`/params.npz; None when `spec` is not such a
  folder (a registry name, 'self:L', a GGUF file)."""
  path = os.path.join(str(spec), "params.npz")
  if not os.path.isfile(path):
    return None
  digest = hashlib.sha1()
  with open(path, "rb") as f:
    for block in iter(lambda: f.read(1 << 20), b""):
      digest.update(block)
  return digest.hexdigest()[:12]
