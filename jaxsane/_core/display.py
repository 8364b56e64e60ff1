"""How a finding and a diagnosis read: their one-line reprs, their notebook HTML fragments, and the
findings and stages tables that the HTML report and the other results' fragments reuse.

This module reads findings by their attributes and imports no other jaxsane module, so ``Finding`` and
``Diagnosis`` can call it. Not jit-safe: host-side text.
"""

from __future__ import annotations

import html
from collections.abc import Iterable
from typing import Any

TEXT_WIDTH = 160  # characters of a message kept in a one-line repr


MAX_LINES = 6  # findings listed in a Diagnosis repr before "... and N more"


CSS = """
.jaxsane-repr{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;color:#222}
.jaxsane-repr table{border-collapse:collapse;margin:.4em 0}.jaxsane-repr th,.jaxsane-repr td{border:1px solid #ddd;
padding:.3em .5em;text-align:left;vertical-align:top;font-size:.9em}.jaxsane-repr th{background:#f4f4f4}
.jaxsane-repr .error{color:#b00020;font-weight:bold}.jaxsane-repr .warning{color:#a86500;font-weight:bold}
.jaxsane-repr .info{color:#0063a8}.jaxsane-repr .hint{color:#206020}.jaxsane-repr .ok{color:#206020;font-weight:bold}
.jaxsane-repr tr.consequence td{color:#666;font-size:.85em;background:#fafafa}.jaxsane-repr .count{color:#555}
.jaxsane-repr .folded{color:#555;font-size:.85em;margin-top:.3em}.jaxsane-repr img{max-width:100%}
.jaxsane-repr pre{font-size:.85em;background:#f8f8f8;padding:.5em;overflow-x:auto}
"""


def shorten(text: str, width: int = TEXT_WIDTH) -> str:
    """``text`` on one line, cut to ``width`` characters with an ellipsis."""
    text = " ".join(str(text).split())
    return text if len(text) <= width else text[: width - 1] + "…"


def plural(n: int, word: str) -> str:
    return f"{n} {word}{'s' if n != 1 else ''}"


def counts_text(d: Any) -> str:
    return ", ".join(plural(n, s) for s, n in d.counts().items())


def codes_text(codes: Iterable[str], limit: int = 8) -> str:
    unique = list(dict.fromkeys(codes))
    more = f" (+{len(unique) - limit} more)" if len(unique) > limit else ""
    return ", ".join(unique[:limit]) + more if unique else "none"


def finding_repr(f: Any) -> str:
    """``Finding(error nonfinite.backward (step 3, grads['w']) x2: message…)`` on one line."""
    return f"Finding({f.severity} {shorten(f.headline())})"


def diagnosis_repr(d: Any) -> str:
    """The headline, then up to :data:`MAX_LINES` root causes, one line each."""
    name = f" {d.name!r}" if d.name else ""
    roots = d.root_causes
    lines = [
        f"<Diagnosis{name}: {counts_text(d)} ({len(d)} findings, {len(d.consequences)} folded) - "
        + ("ok" if d.ok else "not ok")
    ]
    lines += [f"  [{d.severity_of(r)}] {shorten(r.headline())}" for r in roots[:MAX_LINES]]
    if len(roots) > MAX_LINES:
        lines.append(f"  ... and {len(roots) - MAX_LINES} more root causes (print(diagnosis) lists them all)")
    return "\n".join(lines) + ">"


def finding_cells(f: Any, severity: str, consequence: bool, note: str = "") -> str:
    """The four ``<td>`` of one finding: severity, code (xN), where, message and fix."""
    hint = f'<div class="hint">fix: {html.escape(f.hint)}</div>' if f.hint and not consequence else ""
    times = f' <span class="count">x{f.count}</span>' if f.count > 1 else ""
    code = f"<code>{html.escape(f.code)}</code>"
    if consequence:
        code = f'<span class="arrow">&#8627;</span> {code}'
    return (
        f'<td class="{severity}">{severity}</td><td>{code}{times}</td><td>{html.escape(f.where)}</td>'
        f"<td>{html.escape(f.message)}{hint}{note}</td>"
    )


TABLE_HEAD = (
    '<table class="findings"><thead><tr><th>severity</th><th>code</th><th>where</th>'
    "<th>finding and fix</th></tr></thead><tbody>"
)


def findings_table(d: Any) -> str:
    """Root causes first (by their severity with their consequences), each followed by its consequences."""
    if not len(d):
        return '<p class="ok">no findings</p>'
    rows = []
    for r in d.root_causes:
        cons = d.consequences_of(r)
        note = (
            f'<div class="folded">{len(cons)} consequence{"s" if len(cons) != 1 else ""} below: fixing this '
            "cause fixes them</div>"
            if cons
            else ""
        )
        rows.append(
            f'<tr class="finding root" data-code="{html.escape(r.code)}">'
            f"{finding_cells(r, d.severity_of(r), False, note)}</tr>"
        )
        for c in cons:
            rows.append(
                f'<tr class="finding consequence" data-code="{html.escape(c.code)}" '
                f'data-caused-by="{html.escape(r.code)}">{finding_cells(c, c.severity, True)}</tr>'
            )
    return TABLE_HEAD + "".join(rows) + "</tbody></table>"


def finding_rows_table(findings: Iterable[Any]) -> str:
    """A findings table for a plain list of findings (no root-cause folding)."""
    rows = [
        f'<tr class="finding" data-code="{html.escape(f.code)}">{finding_cells(f, f.severity, False)}</tr>'
        for f in findings
    ]
    return TABLE_HEAD + "".join(rows) + "</tbody></table>" if rows else '<p class="ok">no findings</p>'


def stages_table(d: Any) -> str:
    """doctor's stages (``artifacts["stages"]``): status, seconds, and why a stage did not run."""
    rows = "".join(
        f'<tr class="stage" data-stage="{html.escape(s["name"])}"><td>{html.escape(s["name"])}</td>'
        f'<td class="{"ok" if s["status"] == "ran" else "warning"}">{html.escape(s["status"])}</td>'
        f"<td>{s['seconds']:.1f} s"
        + (f" ({s['compiles']} compiled, {s.get('compile_seconds', 0):.1f} s)" if s.get("compiles") else "")
        + (
            f"; +{s['background_seconds']:.1f} s ahead, in the background"
            if s.get("background_seconds", 0) >= 0.05
            else ""
        )
        + f"</td><td>{html.escape(s.get('reason') or '')}</td></tr>"
        for s in d.artifacts.get("stages") or []
    )
    return (
        (
            '<section class="stages"><h3>Stages</h3><table><thead><tr><th>stage</th><th>status</th><th>time</th>'
            f"<th>why it did not run</th></tr></thead><tbody>{rows}</tbody></table></section>"
        )
        if rows
        else ""
    )


def wrap_html(kind: str, title: str, *parts: str) -> str:
    return (
        f'<div class="jaxsane-repr" data-kind="{kind}"><style>{CSS}</style>'
        f"<div><b>{html.escape(title)}</b></div>" + "".join(p for p in parts if p) + "</div>"
    )


def pre_html(text: str) -> str:
    return f"<pre>{html.escape(text)}</pre>"


def finding_html(f: Any) -> str:
    return wrap_html("finding", f"jaxsane finding: {f.code}", finding_rows_table([f]))


def diagnosis_html(d: Any) -> str:
    status = '<span class="ok">no errors</span>' if d.ok else '<span class="error">not ok</span>'
    title = f"jaxsane diagnosis{' of ' + d.name if d.name else ''}"
    return wrap_html(
        "diagnosis",
        title,
        f'<p class="summary">{html.escape(counts_text(d))} &#8212; {status}</p>',
        findings_table(d),
        stages_table(d),
    )
