"""Re-execute the notebooks in notebooks/ and save them with their outputs (``make notebooks``).

    python notebooks/execute.py                 # every notebook
    python notebooks/execute.py nan_hunt        # some, by stem or path
    python notebooks/execute.py --check         # execute in memory, save nothing; exit 1 if a cell fails

Each notebook runs top to bottom in a fresh ``python3`` kernel with ``cwd = notebooks/`` and
``JAXSANE_NB_SMALL=1``, the sizes the test suite runs (tests/e2e/test_notebooks.py), so the committed
outputs are the ones the tests reproduce. Plots are captured as ``image/png`` by the inline backend
(``%matplotlib inline`` in each notebook). Volatile metadata is stripped before saving: per-cell
execution timestamps (``cell.metadata.execution``) and the kernel's exact Python version;
``execution_count`` is kept. Outputs that are wall-clock times (an overfit sweep's seconds, doctor's
stage times) are real and differ run to run; everything else is deterministic (fixed PRNG keys).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent
TIMEOUT_S = int(os.environ.get("JAXSANE_NB_TIMEOUT", "600"))


def kernel_env() -> dict[str, str]:
    """The environment the kernel inherits: the repository on PYTHONPATH, small sizes, one CPU device."""
    env = dict(os.environ)
    env["JAXSANE_NB_SMALL"] = "1"
    env["JAXSANE_CACHE"] = "0"   # no persistent compilation cache: nothing written to ~/.cache, no cache notes
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.pop("XLA_FLAGS", None)   # the notebooks need no fake devices
    env.pop("MPLBACKEND", None)  # the kernel's inline backend, so that figures become image/png outputs
    return env


def strip_volatile(nb) -> None:
    """Drop what changes on every run without being a result: cell timestamps, the exact Python version."""
    for cell in nb.cells:
        cell.metadata.pop("execution", None)
        cell.metadata.pop("ExecuteTime", None)
    info = nb.metadata.get("language_info")
    if info is not None:
        nb.metadata["language_info"] = {k: v for k, v in info.items() if k not in ("version",)}


def execute(path: pathlib.Path, save: bool = True):
    """Execute ``path`` in a fresh kernel (raising CellExecutionError on a failing cell); return the notebook."""
    import nbclient
    import nbformat

    nb = nbformat.read(path, as_version=4)
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(kernel_env())   # the kernel is started with this process's environment
    try:
        client = nbclient.NotebookClient(nb, timeout=TIMEOUT_S, kernel_name="python3",
                                         resources={"metadata": {"path": str(path.parent)}})
        client.execute()
    finally:
        os.environ.clear()
        os.environ.update(saved)
    strip_volatile(nb)
    if save:
        nbformat.write(nb, path)
    return nb


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebooks", nargs="*", help="notebook stems or paths (default: all in notebooks/)")
    parser.add_argument("--check", action="store_true", help="execute without saving")
    args = parser.parse_args(argv)
    paths = sorted(HERE.glob("*.ipynb"))
    if args.notebooks:
        wanted = {pathlib.Path(n).stem for n in args.notebooks}
        paths = [p for p in paths if p.stem in wanted]
        missing = wanted - {p.stem for p in paths}
        if missing:
            parser.error(f"no such notebook in {HERE}: {', '.join(sorted(missing))}")
    failed = 0
    for path in paths:
        start = time.perf_counter()
        try:
            execute(path, save=not args.check)
        except Exception as e:   # CellExecutionError names the cell and carries the traceback
            failed += 1
            print(f"FAILED {path.name}: {e}", file=sys.stderr)
            continue
        size = path.stat().st_size / 1024
        print(f"{'ran' if args.check else 'saved'} {path.name} in {time.perf_counter() - start:.1f} s"
              + ("" if args.check else f" ({size:.0f} KiB)"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
