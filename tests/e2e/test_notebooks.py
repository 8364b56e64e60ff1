"""The notebooks in notebooks/: each runs top to bottom (small sizes via JAXSANE_NB_SMALL=1, one test each),
and each is committed executed, with its outputs (`make notebooks` regenerates them), small and clean."""

import ast
import os
import pathlib
import re

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.subprocess]

NOTEBOOKS = sorted((pathlib.Path(__file__).resolve().parents[2] / "notebooks").glob("*.ipynb"))
TIMEOUT_S = int(os.environ.get("JAXSANE_NB_TIMEOUT", "600"))  # whole-notebook limit; cells get the same
MAX_BYTES, MAX_TOTAL_BYTES = 300_000, 700_000
IDS = [p.stem for p in NOTEBOOKS]


def _code_cells(nb):
    return [cell for cell in nb.cells if cell.cell_type == "code"]


def _shape(cell):
    """What a cell outputs, by kind: stdout, displayed or returned mime types (stderr left out: warnings vary)."""
    kinds = set()
    for o in cell.get("outputs", []):
        if o.output_type == "stream":
            if o.name == "stdout":
                kinds.add("stdout")
        elif o.output_type in ("display_data", "execute_result"):
            kinds.update(m for m in o.get("data", {}) if m != "text/plain")
        else:
            kinds.add(o.output_type)
    return kinds


def _should_output(source: str) -> bool:
    """A cell that prints, plots or ends in an expression (displayed) must have outputs."""
    tree = ast.parse("\n".join(line for line in source.splitlines() if not line.lstrip().startswith("%")))
    calls = {n.func.id if isinstance(n.func, ast.Name) else n.func.attr for n in ast.walk(tree)
             if isinstance(n, ast.Call) and isinstance(n.func, (ast.Name, ast.Attribute))}
    return bool(tree.body) and isinstance(tree.body[-1], ast.Expr) or bool(calls & {"print", "show", "display"})


@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_notebook_runs(path, monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    monkeypatch.setenv("JAXSANE_NB_SMALL", "1")
    monkeypatch.setenv("MPLBACKEND", "Agg")  # the notebooks select the inline backend themselves
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(path.parent.parent),
                                                                   os.environ.get("PYTHONPATH")])))
    monkeypatch.delenv("XLA_FLAGS", raising=False)  # the kernel needs no 8 fake devices
    committed = nbformat.read(path, as_version=4)
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=TIMEOUT_S, kernel_name="python3",
                                     resources={"metadata": {"path": str(path.parent)}})
    client.execute()  # raises CellExecutionError naming the cell and the traceback
    errors = [o for cell in _code_cells(nb) for o in cell.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors
    # the committed outputs are this run's: every cell outputs the same kinds of things (text, HTML, PNG)
    # (the values themselves may differ in the last digits across machines, and wall-clock seconds do)
    stale = [i for i, (a, b) in enumerate(zip(_code_cells(committed), _code_cells(nb))) if _shape(a) != _shape(b)]
    assert not stale, f"{path.name}: code cells {stale} output differently than committed; run `make notebooks`"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_notebook_is_committed_with_outputs(path):
    nbformat = pytest.importorskip("nbformat")
    nb = nbformat.read(path, as_version=4)
    cells = _code_cells(nb)
    counts = [cell.get("execution_count") for cell in cells]
    assert counts == list(range(1, len(cells) + 1)), f"{path.name}: not executed top to bottom in one run: {counts}"
    missing = [i for i, cell in enumerate(cells) if _should_output(cell.source) and not cell.get("outputs")]
    assert not missing, f"{path.name}: code cells {missing} have no outputs; run `make notebooks`"
    outputs = [o for cell in cells for o in cell.get("outputs", [])]
    assert not [o for o in outputs if o.output_type == "error"]
    assert not [o for o in outputs if o.output_type == "stream" and o.name == "stderr"], \
        f"{path.name}: stderr in the outputs (progress lines with timings, warnings): pass progress=False"
    if any(re.search(r"\.plot\(|plt\.", cell.source) for cell in cells):
        assert any("image/png" in o.get("data", {}) for o in outputs), f"{path.name} plots but holds no image/png"
    text = path.read_text()
    assert "ipykernel_" not in text and not re.search(r" at 0x[0-9a-f]{6,}", text), \
        f"{path.name}: outputs name a temporary path or a memory address"
    assert not [i for i, cell in enumerate(nb.cells) if "execution" in cell.metadata], "strip cell timestamps"
    assert path.stat().st_size < MAX_BYTES, f"{path.name} is {path.stat().st_size:,} bytes (limit {MAX_BYTES:,})"


def test_notebooks_total_size():
    total = sum(p.stat().st_size for p in NOTEBOOKS)
    assert NOTEBOOKS and total < MAX_TOTAL_BYTES, f"notebooks/ holds {total:,} bytes (limit {MAX_TOTAL_BYTES:,})"
