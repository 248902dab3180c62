"""Every notebook runs top to bottom in quick mode."""
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs_in_quick_mode(path, tmp_path, monkeypatch):
    monkeypatch.setenv("ART_QUICK", "1")
    monkeypatch.setenv("ART_NOTEBOOK_OUT", str(tmp_path))
    notebook = nbformat.read(path, as_version=4)
    NotebookClient(notebook, timeout=300, kernel_name="python3",
                   resources={"metadata": {"path": str(path.parent.parent)}}).execute()
    errors = [o for c in notebook.cells if c.cell_type == "code" for o in c.get("outputs", [])
              if o.get("output_type") == "error"]
    assert not errors
    assert list(tmp_path.glob("*.png")), "the notebook wrote no figure"
