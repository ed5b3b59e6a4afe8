"""The quick-start notebook runs top to bottom on tiny random models (what CI executes)."""

import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOK = os.path.join(ROOT, "notebooks", "quickstart.ipynb")


def test_quickstart_notebook_runs_on_tiny_models(tmp_path, monkeypatch):
  nbformat = pytest.importorskip("nbformat")
  nbclient = pytest.importorskip("nbclient")
  monkeypatch.setenv("DIVERSED_NOTEBOOK_TINY", "1")
  monkeypatch.setenv("DIVERSED_TINY_DIR", str(tmp_path / "tiny"))
  monkeypatch.setenv("JAX_PLATFORMS", "cpu")
  # The notebook's workdir is a fresh temporary folder (kept for the user to read); here it
  # goes under tmp_path, which pytest removes.
  monkeypatch.setenv("TMPDIR", str(tmp_path))
  notebook = nbformat.read(NOTEBOOK, as_version=4)
  client = nbclient.NotebookClient(notebook, timeout=1200, kernel_name="python3",
                                   resources={"metadata": {"path": os.path.dirname(NOTEBOOK)}})
  client.execute()
  outputs = "".join(o.get("text", "") for cell in notebook.cells if cell.cell_type == "code"
                    for o in cell.get("outputs", []))
  assert "tiny: True" in outputs
  assert "diversed" in outputs and "| setting |" in outputs
  images = [o for cell in notebook.cells for o in cell.get("outputs", [])
            if "image/png" in o.get("data", {})]
  assert images, "the frontier plot is displayed"
  assert list(tmp_path.glob("diversed_quickstart_*/results.jsonl")), "the workdir is in TMPDIR"
