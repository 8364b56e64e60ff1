"""Where doctor's first run spends its compiles: every XLA compile of one doctor run, by thread and program.

Runs ``jaxsane doctor TARGET -q`` in this process, with an empty JAXSANE cache directory and jax's compile log
on (``jax_log_compiles``, captured, not printed), and prints each compile: when it started (seconds from the
run's start), the thread (``MainThread``: the stage running; ``jaxsane-precompile_*``: doctor's work ahead in the
background), its seconds, the program's name, the jaxsane line that asked for it and its argument shapes
(shortened), longest first; then the seconds per thread and the run's wall time. Compiling is most of doctor's
cost on a GPU and much of it on a CPU: this says which programs, and whether the background threads were busy
while the stage thread waited.
Asserts nothing.

    python benchmarks/doctor_compiles.py benchmarks/programs/scaling.py:lm_1m [--top 25] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
import tempfile
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_COMPILING = re.compile(r"Compiling (\S+) with global shapes and types (.*?)\. Argument mapping")
_FINISHED = re.compile(r"Finished XLA compilation of (\S+) in ([0-9.eE+-]+) sec")


def _caller() -> str:
    """The innermost jaxsane function outside its jaxpr helpers that asked for this compile (file:line)."""
    for frame in reversed(traceback.extract_stack()):
        path = frame.filename.replace(os.sep, "/")
        if "/jaxsane/" in path and "/_jaxpr/" not in path:
            return f"{path.split('/jaxsane/')[-1]}:{frame.lineno}"
    return ""


class CompileLog(logging.Handler):
    """jax's compile messages, paired per thread: a compile's start is its thread's last "Compiling" message."""

    def __init__(self, t0: float):
        super().__init__(logging.DEBUG)
        self.t0, self.pending, self.rows = t0, {}, []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        started = _COMPILING.search(message)
        if started:
            self.pending[record.threadName] = (record.created - self.t0, started.group(2), _caller())
            return
        finished = _FINISHED.search(message)
        if finished:
            start, shapes, caller = self.pending.pop(record.threadName, (record.created - self.t0, "", ""))
            self.rows.append(
                {
                    "start": round(start, 2),
                    "thread": record.threadName,
                    "seconds": float(finished.group(2)),
                    "program": finished.group(1),
                    "shapes": shapes,
                    "caller": caller,
                }
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("target", help="a doctor target: path/to/file.py:ATTR or module:ATTR")
    parser.add_argument("--top", type=int, default=25, help="compiles listed, longest first (default 25)")
    parser.add_argument("--json", metavar="FILE", help="also write every compile as JSON")
    args = parser.parse_args()
    sys.path.insert(0, ROOT)
    os.environ["JAXSANE_CACHE_DIR"] = tempfile.mkdtemp(prefix="jaxsane-cache-")  # a first run
    t0 = time.time()
    log = CompileLog(t0)
    import jax

    jax.config.update("jax_log_compiles", True)  # the compile messages at WARNING
    jax_logger = logging.getLogger("jax")
    for handler in list(jax_logger.handlers):
        jax_logger.removeHandler(handler)
    jax_logger.addHandler(log)
    jax_logger.propagate = False  # captured here, not printed
    from jaxsane.cli import main as cli

    code = cli(["doctor", args.target, "-q"])
    wall = time.time() - t0
    rows = sorted(log.rows, key=lambda r: -r["seconds"])
    print(f"doctor {args.target}: exit {code}, {wall:.1f} s wall, {len(rows)} compiles on {jax.default_backend()}")
    print(f"{'start s':>8} {'thread':<22} {'seconds':>8}  program (argument shapes)")
    for r in rows[: args.top]:
        where = f"{r['program']:<18} {r['caller'][:40]:<40} {r['shapes'][:50]}"
        print(f"{r['start']:8.1f} {r['thread'][:22]:<22} {r['seconds']:8.2f}  {where}")
    per_thread: dict[str, float] = {}
    for r in rows:
        per_thread[r["thread"]] = per_thread.get(r["thread"], 0.0) + r["seconds"]
    total = sum(per_thread.values())
    print("compile seconds per thread: " + ", ".join(f"{t} {s:.1f}" for t, s in sorted(per_thread.items())))
    print(f"total {total:.1f} s of compile in {wall:.1f} s of wall")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"target": args.target, "exit": code, "wall": wall, "compiles": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
