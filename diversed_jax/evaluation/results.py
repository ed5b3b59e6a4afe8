"""Per-example results as JSON Lines, appended as batches finish and resumed on restart.

One line per (setting, example): a batch's lines are written with a single `write` and an
fsync, so a kill leaves at most one torn last line, which `ResultStore` cuts off when it
opens the file; a bad line before it is skipped with a warning and kept. A record counts
only for the run it belongs to (its `fingerprint`, a hash of everything that changes the
result), so changing the config never reuses stale lines.

In a multi-host job only process 0 reads and writes the file; the others hold the same
records in memory (process 0's file, broadcast when the store opens, then every batch's
records, which all processes compute alike), so all skip the same examples on a resume.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Iterable

from absl import logging
import jax

from diversed_jax.parallel import hosts


def fingerprint(*parts) -> str:
  """A short stable hash of JSON-serialisable parts."""
  blob = json.dumps(parts, sort_keys=True, default=str)
  return hashlib.sha1(blob.encode()).hexdigest()[:12]


class ResultStore:
  """The JSONL file of one workdir: `done(fp)` ids, `records(fp)`, `append(records)`."""

  def __init__(self, path: str):
    self.path = path
    self._records: list[dict] = []
    self._writer = hosts.is_writer()
    if jax.process_count() > 1:  # a collective: every process opens its store here
      self._load(hosts.broadcast_bytes(self._read() if self._writer else None))
    elif os.path.exists(path):
      self._load(self._read())

  def _read(self) -> bytes:
    if not os.path.exists(self.path):
      return b""
    with open(self.path, "rb") as f:
      return f.read()

  def _load(self, data: bytes) -> None:
    *lines, tail = data.split(b"\n")
    for number, line in enumerate(lines, start=1):
      if not line.strip():
        continue
      try:
        record = json.loads(line)
      except ValueError:  # JSON or UTF-8 errors
        record = None
      if isinstance(record, dict):
        self._records.append(record)
      else:
        # A whole line that is no record (a hand edit, a disk fault) is skipped but left on
        # disk: cutting the file there would delete every valid record after it.
        logging.warning("%s line %d is not a JSON record; skipped: %.80r", self.path,
                        number, line)
    # Only the last line can lack its newline: the torn tail of a killed run. Process 0 cuts
    # it off (else the next append would join it), and its example is recomputed.
    if tail and self._writer:
      with open(self.path, "r+b") as f:
        f.truncate(len(data) - len(tail))

  def records(self, fp: str) -> list[dict]:
    """Records of one setting fingerprint, one per example id (the first written)."""
    seen, out = set(), []
    for r in self._records:
      if r.get("fingerprint") == fp and r["example_id"] not in seen:
        seen.add(r["example_id"])
        out.append(r)
    return out

  def done(self, fp: str) -> set[str]:
    return {r["example_id"] for r in self._records if r.get("fingerprint") == fp}

  def append(self, records: Iterable[dict]) -> None:
    records = list(records)
    if not records:
      return
    if self._writer:
      blob = "".join(json.dumps(r, sort_keys=True) + "\n" for r in records)
      os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
      with open(self.path, "a", encoding="utf-8") as f:
        f.write(blob)
        f.flush()
        os.fsync(f.fileno())
    self._records.extend(records)
