"""atomic_files: a write that fails leaves the old file and no temporary beside it."""

import json
import os

import numpy as np
import pytest

from diversed_jax import atomic_files


def test_a_failed_write_keeps_the_old_file_and_removes_its_temporary(tmp_path):
  path = str(tmp_path / "summary.json")
  atomic_files.write_json(path, {"old": 1})
  with pytest.raises(TypeError):  # a set is not JSON: the dump fails mid-write
    atomic_files.write_json(path, {"new": {1, 2}})
  with pytest.raises(RuntimeError):
    with atomic_files.replacing(path) as tmp, open(tmp, "w") as f:
      f.write('{"torn": ')
      raise RuntimeError("killed")
  with open(path) as f:
    assert json.load(f) == {"old": 1}
  assert os.listdir(tmp_path) == ["summary.json"]


def test_writers_replace_whole_files(tmp_path):
  text = str(tmp_path / "in_use.txt")
  atomic_files.write_lines(text, ["a", "b\n"])
  atomic_files.write_lines(text, ["c"])
  assert open(text).read() == "c\n"
  arrays = str(tmp_path / "params.npz")
  for compressed in (False, True):
    atomic_files.save_npz(arrays, {"w": np.arange(3) + compressed}, compressed=compressed)
    with np.load(arrays) as z:
      np.testing.assert_array_equal(z["w"], np.arange(3) + compressed)
  copy = str(tmp_path / "copy.npz")
  atomic_files.copy_file(arrays, copy)
  assert open(copy, "rb").read() == open(arrays, "rb").read()
  assert sorted(os.listdir(tmp_path)) == ["copy.npz", "in_use.txt", "params.npz"]


def test_an_npz_needs_its_extension(tmp_path):
  with pytest.raises(ValueError, match="npz"):
    atomic_files.save_npz(str(tmp_path / "params"), {"w": np.zeros(2)})
