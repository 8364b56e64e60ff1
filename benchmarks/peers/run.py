"""jaxsane.locate and jaxsane.guard against jax_debug_nans/infs and checkify, on the peers' own test suites.

The cases are in ``benchmarks/peers/cases.py`` (ported from JAX's ``tests/debug_nans_test.py`` and
``tests/checkify_test.py``; each names its test and marks its origin line ``# ORIGIN``). For each case and
tool this records what the tool says and scores it:

- ``locate``: ``jaxsane.locate(fn, *args)``; line-exact when ``origins[0]`` names the case's ``# ORIGIN``
  line, phase right when ``origins[0].phase`` is the expected phase; an input case is right when the
  origin's phase is ``input``; on a clean or masked case any report is a false alarm.
- ``guard``: ``jaxsane.guard(fn, sync=True, locate=False)(*args)``; does it raise ``NonFiniteError``? (the
  goal: on every case whose outputs are non-finite, input cases included; none on clean/masked cases).
- ``debug_nans``: ``jax_debug_nans`` and ``jax_debug_infs`` on, ``fn(*args)``; does it raise
  ``FloatingPointError``, and is the ``# ORIGIN`` line among its traceback frames (or named ``file:line`` in
  its message)? An input case is right when the message says the input.
- ``checkify``: ``checkify.checkify(fn, errors=float_checks | nan_checks | div_checks)(*args)``; does
  ``err.get()`` report, and does it (or its traceback info) name the ``# ORIGIN`` line?

    XLA_FLAGS=--xla_force_host_platform_device_count=8 .venv/bin/python -m benchmarks.peers.run \\
        [--only NAME[,NAME]] [--json F] [--markdown F]

Timings are printed for the record, never asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
import traceback
import warnings

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import checkify  # noqa: E402

if __package__ in (None, ""):  # run as a script: python benchmarks/peers/run.py
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jaxsane  # noqa: E402
from benchmarks.peers import cases as cases_mod  # noqa: E402

CASES_FILE = os.path.abspath(cases_mod.__file__)
TOOLS = ("locate", "guard", "debug_nans", "checkify")


def _short(text: str, n: int = 160) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= n else text[: n - 3] + "..."


def _crash(e: BaseException) -> str:
    return _short(f"crash: {type(e).__name__}: {e}")


def _nonfinite(tree) -> bool:
    for leaf in jax.tree_util.tree_leaves(tree):
        try:
            a = np.asarray(leaf)
        except Exception:  # noqa: BLE001 - keys and the like
            continue
        if np.issubdtype(a.dtype, np.inexact) and not np.all(np.isfinite(a)):
            return True
    return False


# ----------------------------------------------------------------------------- the tools


def run_locate(c):
    fn, args = c.build()
    t = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = jaxsane.locate(fn, *args)
    dt = time.perf_counter() - t
    if report is None:
        return {"alarm": False, "said": "None (outputs finite)", "time": dt}
    if not report.origins:
        return {"alarm": True, "said": report.summary(), "time": dt, "xla_only": report.xla_only}
    o = report.origins[0]
    here = o.file is not None and os.path.abspath(o.file) == CASES_FILE
    return {
        "alarm": True,
        "said": o.summary(),
        "code": o.code,
        "phase": o.phase,
        "primitive": o.primitive,
        "line": o.line if here else None,
        "where": f"{os.path.basename(o.file) if o.file else None}:{o.line}",
        "time": dt,
    }


def run_guard(c):
    fn, args = c.build()
    g = jaxsane.guard(fn, sync=True, locate=False, warn_recompiles=False)
    t = time.perf_counter()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = g(*args)
            g.flush()
    except jaxsane.NonFiniteError as e:
        f = getattr(e, "finding", None)
        code = getattr(f, "code", "") or ""
        return {
            "alarm": True,
            "said": _short(f"NonFiniteError {code}: {f.message if f else e}"),
            "code": code,
            "time": time.perf_counter() - t,
        }
    dt = time.perf_counter() - t
    out_bad = _nonfinite(out)
    said = "returned" + (" a non-finite output" if out_bad else "")
    kinds = sorted({type(x).__name__ for x in jax.tree_util.tree_leaves(out)})
    return {"alarm": False, "said": f"{said} ({', '.join(kinds)})", "out_bad": out_bad, "time": dt}


def _chain(e: BaseException):
    seen = []
    while e is not None and e not in seen:
        seen.append(e)
        e = e.__cause__ or e.__context__
    return seen


def _lines_in_exception(e: BaseException) -> set[int]:
    lines = set()
    for x in _chain(e):
        for fr in traceback.extract_tb(x.__traceback__):
            if os.path.abspath(fr.filename) == CASES_FILE:
                lines.add(fr.lineno)
        lines |= _lines_in_text(str(x))
    return lines


def _lines_in_text(text: str) -> set[int]:
    name = re.escape(os.path.basename(CASES_FILE))
    return {int(m) for m in re.findall(rf"{name}:(\d+)", text)}


def run_debug_nans(c):
    fn, args = c.build()
    t = time.perf_counter()
    try:  # the context managers, as the upstream tests use them (they are part of jit's cache key)
        with jax.debug_nans(True), jax.debug_infs(True), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = fn(*args)
            jax.block_until_ready(out)
    except FloatingPointError as e:
        msg = str(e)
        return {
            "alarm": True,
            "said": _short(msg),
            "lines": sorted(_lines_in_exception(e)),
            "input": "input" in msg.lower(),
            "time": time.perf_counter() - t,
        }
    return {"alarm": False, "said": "no FloatingPointError", "time": time.perf_counter() - t}


def run_checkify(c):
    fn, args = c.build()
    errors = checkify.float_checks | checkify.nan_checks | checkify.div_checks
    t = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        err, out = checkify.checkify(fn, errors=errors)(*args)
        jax.block_until_ready(out)
    msg = err.get()
    dt = time.perf_counter() - t
    if msg is None:
        return {"alarm": False, "said": "err.get() is None", "time": dt}
    lines = _lines_in_text(msg)
    exc = err.get_exception()
    tb = getattr(exc, "traceback_info", None)
    try:
        frames = tb.frames if tb is not None else []
        lines |= {fr.line_num for fr in frames if os.path.abspath(fr.file_name) == CASES_FILE}
    except Exception:  # noqa: BLE001 - a traceback object of another shape
        pass
    return {"alarm": True, "said": _short(msg), "lines": sorted(lines), "input": "input" in msg.lower(), "time": dt}


RUNNERS = {"locate": run_locate, "guard": run_guard, "debug_nans": run_debug_nans, "checkify": run_checkify}


# ----------------------------------------------------------------------------- scoring


def score(c, tool: str, r: dict) -> dict:
    """``ok``: the tool did what the goal asks on this case; ``exact``: reached the origin line; ``phase``."""
    origin = c.origin_line
    if "crash" in r:
        r.update(ok=False, exact=False)
        return r
    if c.kind in ("clean", "masked"):
        r.update(ok=not r["alarm"], exact=None, false_alarm=bool(r["alarm"]))
        return r
    if tool == "guard":  # every case left here has non-finite outputs: guard must raise
        r.update(ok=bool(r["alarm"]), exact=None)
        if c.kind == "input":
            r["input"] = r["alarm"] and "input" in r.get("code", "")
        return r
    if tool == "locate":
        if c.kind == "input":
            r.update(ok=r.get("phase") == "input", exact=None, input=r.get("phase") == "input")
            return r
        exact = r.get("line") == origin
        phase = r.get("phase") == c.phase or (c.phase == "literal" and "literal" in r.get("code", ""))
        r.update(exact=exact, phase_ok=phase, ok=exact and phase)
        return r
    if c.kind == "input":
        r.update(ok=bool(r.get("input")), exact=None)
        return r
    exact = bool(r["alarm"]) and origin in r.get("lines", [])
    r.update(exact=exact, ok=exact)
    return r


def run_case(c, tools=TOOLS) -> dict:
    row = {
        "name": c.name,
        "source": c.source,
        "kind": c.kind,
        "phase": c.phase,
        "origin_line": c.origin_line,
        "devices": c.devices,
        "tools": {},
    }
    if jax.device_count() < c.devices:
        row["skipped"] = f"needs {c.devices} devices, {jax.device_count()} present"
        return row
    for tool in tools:
        t = time.perf_counter()
        try:
            r = RUNNERS[tool](c)
        except Exception as e:  # noqa: BLE001 - a tool that crashes on a case did not answer it
            r = {"alarm": False, "said": _crash(e), "crash": True, "time": time.perf_counter() - t}
        row["tools"][tool] = score(c, tool, r)
    return row


def totals(rows: list[dict]) -> dict:
    out = {}
    live = [r for r in rows if "skipped" not in r]
    for tool in TOOLS:
        nf = [r["tools"][tool] for r in live if r["kind"] == "nonfinite" and tool in r["tools"]]
        cm = [r["tools"][tool] for r in live if r["kind"] in ("clean", "masked") and tool in r["tools"]]
        inp = [r["tools"][tool] for r in live if r["kind"] == "input" and tool in r["tools"]]
        t = {
            "nonfinite": len(nf),
            "alarm_on_nonfinite": sum(bool(x.get("alarm")) for x in nf),
            "line_exact": sum(bool(x.get("exact")) for x in nf),
            "clean_masked": len(cm),
            "false_alarms": sum(bool(x.get("alarm")) for x in cm),
            "input": len(inp),
            "input_attributed": sum(bool(x.get("input")) for x in inp),
            "crashes": sum(bool(x.get("crash")) for x in nf + cm + inp),
            "time_s": round(sum(x.get("time", 0.0) for x in nf + cm + inp), 2),
        }
        if tool == "locate":
            t["line_exact_and_phase"] = sum(bool(x.get("ok")) for x in nf)
        if tool == "guard":
            t["raised_on_nonfinite_outputs"] = sum(bool(x.get("alarm")) for x in nf + inp)
            t["nonfinite_outputs"] = len(nf) + len(inp)
        out[tool] = t
    return out


# ----------------------------------------------------------------------------- output


def _cell(tool: str, r: dict | None) -> str:
    if r is None:
        return "-"
    if r.get("crash"):
        return "CRASH"
    mark = "ok" if r.get("ok") else "MISS"
    if r.get("false_alarm"):
        mark = "FALSE ALARM"
    if tool == "locate" and r.get("alarm"):
        return f"{mark}: {r.get('phase', '-')} @ {r.get('where', r['said'][:40])}"
    if tool in ("debug_nans", "checkify") and r.get("alarm"):
        return f"{mark}: raised, lines {r.get('lines') or '-'}"
    return f"{mark}: {'raised' if r.get('alarm') else 'silent'}"


def print_table(rows: list[dict]) -> None:
    print(f"{'case':38s} {'kind':9s} {'phase':8s} {'line':>4s} | " + " | ".join(f"{t:30s}" for t in TOOLS))
    for row in rows:
        if "skipped" in row:
            print(f"{row['name']:38s} skipped: {row['skipped']}")
            continue
        cells = " | ".join(f"{_cell(t, row['tools'].get(t))[:30]:30s}" for t in TOOLS)
        line = row["origin_line"] or "-"
        print(f"{row['name']:38s} {row['kind']:9s} {row['phase']:8s} {line!s:>4s} | {cells}")


def print_totals(tot: dict) -> None:
    for tool, t in tot.items():
        print(f"{tool:11s} " + ", ".join(f"{k}={v}" for k, v in t.items()))


def markdown(rows: list[dict], tot: dict, command: str, load: str) -> str:
    out = [
        "# Peer suites: jaxsane.locate / guard vs jax_debug_nans / checkify",
        "",
        "The cases of JAX's `tests/debug_nans_test.py` (`DebugNaNsTest`, `DebugInfsTest`) and the NaN/Inf/division "
        "cases of `tests/checkify_test.py`, ported one by one in `benchmarks/peers/cases.py` (each cites its "
        "test; `# ORIGIN` marks the line where the non-finite value is born). Issue 29, section 1.",
        "",
        f"Command: `{command}`",
        "",
        f"Machine load before the run (`uptime`): `{load}`; jax {jax.__version__}, "
        f"{jax.device_count()} {jax.default_backend()} devices.",
        "",
        "Scoring: a non-finite case counts for a tool when it reaches the `# ORIGIN` line (locate: `origins[0]` "
        "there; debug_nans: a traceback frame or `file:line` in the message; checkify: `err.get()` or its "
        "traceback info); for locate also the phase. Clean/masked cases: any report is a false alarm. Input cases: "
        "locate's phase `input`; debug_nans/checkify a message that says input; guard must raise on every case "
        "whose outputs are non-finite (non-finite and input cases).",
        "",
        "## Totals",
        "",
        "| tool | non-finite: reached origin line | locate: line + phase | alarms on non-finite | "
        "false alarms (clean+masked) | input cases attributed | guard raised on non-finite outputs | crashes | "
        "time (s) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for tool, t in tot.items():
        lp = f"{t['line_exact_and_phase']}/{t['nonfinite']}" if "line_exact_and_phase" in t else "-"
        gr = "-"
        if "raised_on_nonfinite_outputs" in t:
            gr = f"{t['raised_on_nonfinite_outputs']}/{t['nonfinite_outputs']}"
        exact = f"{t['line_exact']}/{t['nonfinite']}" if tool != "guard" else "-"
        out.append(
            f"| {tool} | {exact} | {lp} | {t['alarm_on_nonfinite']}/{t['nonfinite']} | "
            f"{t['false_alarms']}/{t['clean_masked']} | {t['input_attributed']}/{t['input']} | {gr} | "
            f"{t['crashes']} | {t['time_s']} |"
        )
    out += [
        "",
        "## Cases",
        "",
        "| case | source | kind | expected | " + " | ".join(TOOLS) + " |",
        "|---|---|---|---|" + "---|" * len(TOOLS),
    ]
    for row in rows:
        if "skipped" in row:
            out.append(f"| {row['name']} | {row['source']} | {row['kind']} | skipped: {row['skipped']} |" + " |" * 4)
            continue
        exp = row["phase"] + (f" @ {row['origin_line']}" if row["origin_line"] else "")
        cells = " | ".join(_cell(t, row["tools"].get(t)).replace("|", "/") for t in TOOLS)
        out.append(f"| {row['name']} | {row['source'].split(' ', 1)[1]} | {row['kind']} | {exp} | {cells} |")
    out += ["", "## What each tool said, where it missed", ""]
    for row in rows:
        for tool in TOOLS:
            r = row.get("tools", {}).get(tool)
            if r is not None and not r.get("ok"):
                out.append(
                    f"- `{row['name']}` ({row['kind']}, {row['phase']}"
                    f"{' @ ' + str(row['origin_line']) if row['origin_line'] else ''}) {tool}: "
                    f"{r['said'].replace('|', '/')}"
                )
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", help="comma-separated case names (or substrings)")
    ap.add_argument("--tools", default=",".join(TOOLS))
    ap.add_argument("--json")
    ap.add_argument("--markdown")
    ap.add_argument("--load", default="", help="the machine load to note in the markdown (uptime)")
    ap.add_argument("--notes", help="a markdown file appended to --markdown (the hand-written analysis)")
    a = ap.parse_args(argv)
    tools = tuple(a.tools.split(","))
    chosen = cases_mod.CASES
    if a.only:
        keys = a.only.split(",")
        chosen = [c for c in chosen if any(k == c.name or k in c.name for k in keys)]
    rows = []
    for c in chosen:
        t = time.perf_counter()
        row = run_case(c, tools)
        rows.append(row)
        took = time.perf_counter() - t
        cells = " | ".join(f"{_cell(tl, row.get('tools', {}).get(tl))[:34]:34s}" for tl in tools)
        print(f"{c.name:38s} {c.kind:9s} {c.phase:8s} {took:5.1f}s | {cells}", flush=True)
    tot = totals(rows)
    print()
    print_totals(tot)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"rows": rows, "totals": tot}, f, indent=1, default=str)
    if a.markdown:
        command = f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')} .venv/bin/python -m benchmarks.peers.run " + " ".join(
            argv if argv is not None else sys.argv[1:]
        )
        with open(a.markdown, "w") as f:
            f.write(markdown(rows, tot, command, a.load))
            if a.notes:
                with open(a.notes) as n:
                    f.write("\n" + n.read())
    return 0


if __name__ == "__main__":
    sys.exit(main())
