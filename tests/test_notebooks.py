"""Every notebook in notebooks/ runs top to bottom (small sizes via JAXSANE_NB_SMALL=1), one test each."""

import os
import pathlib

import pytest

NOTEBOOKS = sorted((pathlib.Path(__file__).resolve().parent.parent / "notebooks").glob("*.ipynb"))
TIMEOUT_S = int(os.environ.get("JAXSANE_NB_TIMEOUT", "600"))  # whole-notebook limit; cells get the same


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path, monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    monkeypatch.setenv("JAXSANE_NB_SMALL", "1")
    monkeypatch.setenv("MPLBACKEND", "Agg")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(path.parent.parent),
                                                                   os.environ.get("PYTHONPATH")])))
    monkeypatch.delenv("XLA_FLAGS", raising=False)  # the kernel needs no 8 fake devices
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=TIMEOUT_S, kernel_name="python3",
                                     resources={"metadata": {"path": str(path.parent)}})
    client.execute()  # raises CellExecutionError naming the cell and the traceback
    errors = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.get("outputs", [])
              if o.get("output_type") == "error"]
    assert not errors


def test_notebooks_are_committed_without_outputs():
    nbformat = pytest.importorskip("nbformat")
    for path in NOTEBOOKS:
        nb = nbformat.read(path, as_version=4)
        dirty = [i for i, cell in enumerate(nb.cells) if cell.cell_type == "code" and cell.get("outputs")]
        assert not dirty, f"{path.name}: clear the outputs of cells {dirty} before committing"
