#!/usr/bin/env python
"""The fault benchmark: jaxsane.doctor on a zoo of real training bugs, next to jax_debug_nans and checkify.

Every program in this folder is a small module: ``f*.py`` are faulty, ``c*.py`` are correct. Each
exposes ``experiment()`` (a ``jaxsane.Experiment``) or, for checks that need several devices,
``check()`` (a list of findings); ``EXPECTED`` (the finding codes it must produce; empty for a correct
program); ``STYLE`` ("optax", "linen", "nnx", "equinox"); ``STAGES`` (the doctor stages it needs) and optionally
``OPTIONS`` (doctor options). The faulty line carries a ``# FAULT`` comment, so line-exactness of
``nonfinite.forward/backward/update/literal`` findings is measured against the marked line, never hard-coded.

For each program this prints: the expected code(s), the codes doctor found (errors and warnings),
whether the file:line of a nonfinite finding is the marked line, doctor's time, and whether
``jax_debug_nans`` and ``checkify(float_checks)`` raised on a few steps of the same program. Totals:
detection rate (every expected code found), line-exact rate, false-positive rate (error findings on
correct programs), mean time per program.

    python benchmarks/faults/run.py [--full] [--no-baselines] [--only f01,c02] [--json F] [--markdown F]

``--full`` runs every doctor stage on every program (as a user who does not know the bug would);
by default each program runs only the stages it declares. Timings are wall clock on whatever
machine runs this; they assert nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import re
import sys
import time
import traceback
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")  # before jax initialises
HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
from jax.experimental import checkify  # noqa: E402

import jaxsane  # noqa: E402
from jaxsane._experiment.contract import PureExperiment  # noqa: E402
from jaxsane._experiment.batches import iter_batches  # noqa: E402

LOCATED_CODES = ("nonfinite.forward", "nonfinite.backward", "nonfinite.update", "nonfinite.literal",
                 "precision.lost", "precision.overflow")
BASELINE_STEPS = 10


def discover() -> list[str]:
    """Names of the program modules, faulty (f*) first, then correct (c*), in file order."""
    names = sorted(p.stem for p in HERE.glob("[fc][0-9][0-9]_*.py"))
    return [n for n in names if n.startswith("f")] + [n for n in names if n.startswith("c")]


def load(name: str):
    return importlib.import_module(f"benchmarks.faults.{name}")


def fault_line(module) -> tuple[str, int] | None:
    """(file, line) of the ``# FAULT`` comment in the program's source, or None (correct programs)."""
    path = Path(module.__file__).resolve()
    for i, text in enumerate(path.read_text().splitlines(), start=1):
        if re.search(r"#\s*FAULT\b", text):
            return str(path), i
    return None


def _same_file(a: str | None, b: str) -> bool:
    if not a:
        return False
    try:
        return os.path.samefile(a, b)
    except OSError:
        return Path(a).name == Path(b).name and Path(a).parent.name == Path(b).parent.name


@dataclasses.dataclass
class Row:
    name: str
    style: str
    correct: bool
    expected: list[str]
    found: list[str]
    errors: list[str]
    detected: bool
    line_exact: bool | None   # None: no located code expected
    where: str                # file:line of the first located finding, for the report
    seconds: float
    missing_stages: list[str]
    debug_nans: str           # "caught", "-", or "n/a"
    checkify: str
    note: str = ""
    roots: list[str] = dataclasses.field(default_factory=list)  # codes (errors, warnings) that are no other's consequence
    unlinked: int = 0         # root errors beside the expected ones (on a correct program: every root error)


def _stages_for(module, full: bool) -> tuple[list[str] | None, list[str]]:
    from jaxsane._doctor.pipeline import STAGES
    known = [stage.name for stage in STAGES]
    wanted = known if full else list(getattr(module, "STAGES", known))
    return [s for s in wanted if s in known], [s for s in wanted if s not in known]


def run_doctor(module, full: bool = False) -> tuple[list, float, list[str]]:
    """The findings of doctor (or of the program's ``check()``), the seconds it took, missing stages."""
    if hasattr(module, "check"):
        start = time.perf_counter()
        findings = list(module.check())
        return findings, time.perf_counter() - start, []
    stages, missing = _stages_for(module, full)
    experiment = module.experiment()
    start = time.perf_counter()
    diagnosis = jaxsane.doctor(experiment, stages=stages, progress=False, **getattr(module, "OPTIONS", {}))
    return list(diagnosis), time.perf_counter() - start, missing


def _user_steps(module, steps: int):
    """Run the program's own step ``steps`` times on its own state (NNX: in place)."""
    experiment = module.experiment()
    state = experiment.init(jax.random.key(0))
    adapted = PureExperiment(experiment)
    out = None
    pure = adapted.to_pure(state)
    for batch in iter_batches(experiment.train, steps):
        if adapted.nnx:
            out = experiment.step(*state, batch) if isinstance(state, tuple) else experiment.step(state, batch)
        else:  # the user's step on the user's state (an Equinox model whole, a spread (model, opt_state, batch))
            pure, out = adapted.step(pure, batch)
            state = pure
    jax.block_until_ready((state, out))


def debug_nans_catches(module, steps: int = BASELINE_STEPS) -> str:
    """"caught" when the program's step raises under ``jax_debug_nans`` within ``steps`` steps."""
    if not hasattr(module, "experiment"):
        return "n/a"
    jax.config.update("jax_debug_nans", True)
    try:
        _user_steps(module, steps)
        return "-"
    except FloatingPointError:
        return "caught"
    except Exception as e:  # a crash of the program under debug_nans is not a catch
        return f"crash:{type(e).__name__}"
    finally:
        jax.config.update("jax_debug_nans", False)


def checkify_catches(module, steps: int = BASELINE_STEPS) -> str:
    """"caught" when ``checkify(float_checks)`` of the pure step reports an error within ``steps`` steps."""
    if not hasattr(module, "experiment"):
        return "n/a"
    try:
        experiment = module.experiment()
        adapted = PureExperiment(experiment)
        state = adapted.init(jax.random.key(0))
        checked = jax.jit(checkify.checkify(adapted.step, errors=checkify.float_checks))
        for batch in iter_batches(experiment.train, steps):
            err, (state, _) = checked(state, batch)
            err.throw()
        return "-"
    except checkify.JaxRuntimeError:
        return "caught"
    except Exception as e:
        return f"crash:{type(e).__name__}"


def run_program(name: str, *, full: bool = False, baselines: bool = True, doctor: bool = True) -> Row:
    module = load(name)
    expected = list(module.EXPECTED)
    correct = name.startswith("c")
    note = ""
    try:
        findings, seconds, missing = run_doctor(module, full) if doctor else ([], float("nan"), [])
    except Exception as e:
        findings, seconds, missing = [], float("nan"), []
        note = f"doctor raised {type(e).__name__}: {e}"[:300]
        traceback.print_exc()
    found = sorted({f.code for f in findings if f.severity in ("error", "warning")})
    linked = jaxsane.Diagnosis(findings) if findings else []   # root causes first, consequences folded
    roots = [f.code for f in getattr(linked, "root_causes", []) if linked.severity_of(f) in ("error", "warning")]
    errors = sorted({f.code for f in findings if f.severity == "error"})
    skipped = [f.message for f in findings if f.code == "doctor.skipped" and f.severity != "info"]
    if skipped:
        note = (note + " " + " | ".join(skipped))[:400].strip()
    codes = {f.code for f in findings}
    detected = all(code in codes for code in expected)
    line_exact, where = None, ""
    marked = fault_line(module)
    located_expected = [c for c in expected if c in LOCATED_CODES]
    if located_expected and marked is not None:
        hits = [f for f in findings if f.code in located_expected]
        line_exact = any(_same_file(f.file, marked[0]) and f.line == marked[1] for f in hits)
        located = [f for f in hits if f.file]
        where = f"{Path(located[0].file).name}:{located[0].line}" if located else "(no file:line)"
    if baselines:
        dn, ck = debug_nans_catches(module), checkify_catches(module)
    else:
        dn = ck = "skipped"
    unlinked = sum(code not in expected and code in errors for code in roots)
    return Row(name, getattr(module, "STYLE", "?"), correct, expected, found, errors, detected, line_exact, where,
               seconds, missing, dn, ck, note, sorted(set(roots)), unlinked)


def _fmt_bool(b: bool | None) -> str:
    return "-" if b is None else ("yes" if b else "NO")


def print_table(rows: list[Row]) -> None:
    header = f"{'program':34} {'style':5} {'expected':36} {'found (errors+warnings)':58} {'det':3} {'line':4} " \
             f"{'time':>6} {'debug_nans':10} {'checkify':10}"
    print(header)
    print("-" * len(header))
    for r in rows:
        exp = ",".join(r.expected) if r.expected else "(correct)"
        det = ("FP" if r.errors else "ok") if r.correct else _fmt_bool(r.detected)
        print(f"{r.name:34} {r.style:5} {exp:36} {','.join(r.found) or '-':58} {det:3} "
              f"{_fmt_bool(r.line_exact):4} {r.seconds:6.1f} {r.debug_nans:10} {r.checkify:10}")
        if r.roots:
            print(f"{'':34}   root causes (errors, warnings): {', '.join(r.roots)}; other unlinked errors: {r.unlinked}")
        if r.missing_stages or r.note or (r.line_exact is False):
            extra = []
            if r.missing_stages:
                extra.append(f"stages not available yet: {r.missing_stages}")
            if r.line_exact is False:
                extra.append(f"nonfinite finding at {r.where}")
            if r.note:
                extra.append(r.note)
            print(f"{'':34}   ^ " + "; ".join(extra))


def totals(rows: list[Row]) -> dict:
    faulty = [r for r in rows if not r.correct]
    correct = [r for r in rows if r.correct]
    located = [r for r in faulty if r.line_exact is not None]
    with_baseline = [r for r in faulty if r.debug_nans not in ("n/a", "skipped")]
    correct_baseline = [r for r in correct if r.debug_nans not in ("n/a", "skipped")]
    times = [r.seconds for r in rows if r.seconds == r.seconds]

    def rate(k, n):
        return {"n": k, "of": n, "rate": (k / n if n else float("nan"))}

    return {
        "detection": rate(sum(r.detected for r in faulty), len(faulty)),
        "line_exact": rate(sum(bool(r.line_exact) for r in located), len(located)),
        "false_positive": rate(sum(bool(r.errors) for r in correct), len(correct)),
        "mean_seconds": sum(times) / len(times) if times else float("nan"),
        "debug_nans_detection": rate(sum(r.debug_nans == "caught" for r in with_baseline), len(with_baseline)),
        "checkify_detection": rate(sum(r.checkify == "caught" for r in with_baseline), len(with_baseline)),
        "debug_nans_false_positive": rate(sum(r.debug_nans == "caught" for r in correct_baseline),
                                          len(correct_baseline)),
        "checkify_false_positive": rate(sum(r.checkify == "caught" for r in correct_baseline),
                                        len(correct_baseline)),
        "undetected": [r.name for r in faulty if not r.detected],
        "root_first": rate(sum(any(c in r.roots for c in r.expected) for r in faulty), len(faulty)),
        "max_unlinked": max((r.unlinked for r in faulty), default=0),
        "false_positives": {r.name: r.errors for r in correct if r.errors},
    }


def print_totals(t: dict) -> None:
    def pct(d):
        return f"{d['n']}/{d['of']} = {100 * d['rate']:.0f}%" if d["of"] else "n/a"

    print()
    print(f"jaxsane detection rate      : {pct(t['detection'])} of faulty programs (every expected code found)")
    print(f"jaxsane line-exact rate     : {pct(t['line_exact'])} of programs expecting a located nonfinite code")
    print(f"jaxsane false-positive rate : {pct(t['false_positive'])} of correct programs with an error finding")
    print(f"root cause first            : {pct(t['root_first'])} of faulty programs have an expected code among the "
          f"root causes; at most {t['max_unlinked']} other unlinked error(s) beside it")
    print(f"mean doctor time / program  : {t['mean_seconds']:.2f} s")
    print(f"jax_debug_nans              : caught {pct(t['debug_nans_detection'])} faulty, "
          f"raised on {pct(t['debug_nans_false_positive'])} correct")
    print(f"checkify(float_checks)      : caught {pct(t['checkify_detection'])} faulty, "
          f"raised on {pct(t['checkify_false_positive'])} correct")
    if t["undetected"]:
        print(f"not detected: {', '.join(t['undetected'])}")
    if t["false_positives"]:
        print(f"false positives: {t['false_positives']}")


def markdown(rows: list[Row], t: dict) -> str:
    """The results as a markdown table with the totals underneath (for benchmarks/README.md)."""
    def pct(d):
        return f"{d['n']}/{d['of']} ({100 * d['rate']:.0f}%)" if d["of"] else "n/a"

    lines = ["| program | expected | found (errors, warnings) | detected | line-exact | time (s) | debug_nans | "
             "checkify |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        det = ("false positive" if r.errors else "quiet") if r.correct else ("yes" if r.detected else "**no**")
        lines.append(f"| {r.name} | {', '.join(r.expected) or '(correct)'} | {', '.join(r.found) or '-'} | {det} | "
                     f"{_fmt_bool(r.line_exact)} | {r.seconds:.1f} | {r.debug_nans} | {r.checkify} |")
    lines += ["", f"- detection: {pct(t['detection'])} of faulty programs; line-exact: {pct(t['line_exact'])}; "
              f"false positives: {pct(t['false_positive'])} of correct programs; mean doctor time "
              f"{t['mean_seconds']:.1f} s per program",
              f"- jax_debug_nans: caught {pct(t['debug_nans_detection'])} faulty programs, raised on "
              f"{pct(t['debug_nans_false_positive'])} correct ones; checkify(float_checks): caught "
              f"{pct(t['checkify_detection'])}, raised on {pct(t['checkify_false_positive'])}"]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--full", action="store_true", help="run every doctor stage on every program")
    parser.add_argument("--no-baselines", action="store_true", help="skip jax_debug_nans and checkify")
    parser.add_argument("--no-doctor", action="store_true", help="only the baselines (jax_debug_nans, checkify)")
    parser.add_argument("--only", default="", help="comma-separated program name prefixes (e.g. f01,c02)")
    parser.add_argument("--json", default="", help="write the rows and totals to this JSON file")
    parser.add_argument("--markdown", default="", help="write the results as a markdown table to this file")
    args = parser.parse_args(argv)
    names = discover()
    if args.only:
        prefixes = [p.strip() for p in args.only.split(",") if p.strip()]
        names = [n for n in names if any(n.startswith(p) for p in prefixes)]
    rows = []
    for name in names:
        rows.append(run_program(name, full=args.full, baselines=not args.no_baselines, doctor=not args.no_doctor))
        print(f"[{len(rows)}/{len(names)}] {name}: {rows[-1].seconds:.1f}s", file=sys.stderr, flush=True)
    print_table(rows)
    t = totals(rows)
    print_totals(t)
    if args.markdown:
        Path(args.markdown).write_text(markdown(rows, t))
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": [dataclasses.asdict(r) for r in rows], "totals": t},
                                              indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
