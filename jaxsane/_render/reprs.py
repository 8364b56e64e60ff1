"""Notebook-sized renderings of results: short plain-text reprs and HTML fragments.

Each result class (``Finding``, ``Diagnosis``, ``LocateReport``, ``OverfitResult``, ``InitScaleSweep``,
``FitResult``) has a two-line ``__repr__`` / ``_repr_html_`` that calls a function here. The text is a few
lines (headline numbers, counts, codes, never whole arrays or parameters); the HTML is a fragment scoped
under ``<div class="jaxsane-repr">``. The fragments (findings and stages tables, figures as embedded PNGs)
are the HTML report's own: :mod:`jaxsane._render.html` builds its page from them.

This module imports no other jaxsane module (it reads its objects by their attributes), so the shared
classes can call it without an import cycle. Not jit-safe: host-side text.
"""

from __future__ import annotations

import base64
import html
import io
from typing import Any, Callable, Iterable

TEXT_WIDTH = 160       # characters of a message kept in a one-line repr
MAX_LINES = 6          # findings listed in a Diagnosis repr before "... and N more"

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
    return text if len(text) <= width else text[:width - 1] + "…"


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'s' if n != 1 else ''}"


def _counts_text(d: Any) -> str:
    return ", ".join(_plural(n, s) for s, n in d.counts().items())


def _codes_text(codes: Iterable[str], limit: int = 8) -> str:
    unique = list(dict.fromkeys(codes))
    more = f" (+{len(unique) - limit} more)" if len(unique) > limit else ""
    return ", ".join(unique[:limit]) + more if unique else "none"


def _num(x: Any) -> str:
    return "-" if x is None else f"{x:.4g}"


# ----------------------------------------------------------------------------- plain text

def finding_repr(f: Any) -> str:
    """``Finding(error nonfinite.backward (step 3, grads['w']) x2: message…)`` on one line."""
    return f"Finding({f.severity} {shorten(f.headline())})"


def diagnosis_repr(d: Any) -> str:
    """The headline, then up to :data:`MAX_LINES` root causes, one line each."""
    name = f" {d.name!r}" if d.name else ""
    roots = d.root_causes
    lines = [f"<Diagnosis{name}: {_counts_text(d)} ({len(d)} findings, {len(d.consequences)} folded) - "
             + ("ok" if d.ok else "not ok")]
    lines += [f"  [{d.severity_of(r)}] {shorten(r.headline())}" for r in roots[:MAX_LINES]]
    if len(roots) > MAX_LINES:
        lines.append(f"  ... and {len(roots) - MAX_LINES} more root causes (print(diagnosis) lists them all)")
    return "\n".join(lines) + ">"


def state_size(state: Any) -> tuple[int, int]:
    """``(leaves, elements)`` of a pytree, without reading any values."""
    import jax
    leaves = jax.tree_util.tree_leaves(state)
    return len(leaves), sum(int(getattr(x, "size", 1)) for x in leaves)


def fit_repr(r: Any) -> str:
    """Steps, first and last loss, best eval, rollbacks, the state's size and the findings' codes."""
    losses = list(r.history.loss)
    leaves, elements = state_size(r.state)
    loss = f"loss {_num(losses[0])} -> {_num(losses[-1])}" if losses else "no loss recorded"
    best = (f", best eval {_num(r.best_eval_loss)} at step {r.best_step}" if r.best_step is not None else "")
    flags = "".join([", stopped early" if r.stopped_early else "", f", resumed from {r.resumed_from}"
                     if r.resumed_from is not None else "", ", restored best" if r.restored_best else ""])
    lines = [f"<FitResult: {r.step} steps, {loss}{best}, {_plural(r.rollbacks, 'rollback')}{flags}",
             f"  state: {leaves} leaves, {elements:,} elements; diagnosis: {_counts_text(r.diagnosis)}; "
             f"codes: {_codes_text(r.diagnosis.codes)}"]
    where = [f"metrics {r.metrics_path}" if r.metrics_path else "", f"checkpoints {r.checkpoint_dir}"
             if r.checkpoint_dir else ""]
    if any(where):
        lines.append("  " + ", ".join(w for w in where if w))
    return "\n".join(lines) + ">"


# ----------------------------------------------------------------------------- HTML fragments (shared with the report)

def figure_png(fig: Any) -> bytes:
    """A matplotlib Figure as PNG bytes (Agg; works without a display). Not jit-safe."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    if fig.canvas is None or not hasattr(fig.canvas, "print_png"):
        FigureCanvasAgg(fig)
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    try:  # figures made through pyplot stay registered until closed
        import matplotlib.pyplot as plt
        plt.close(fig)
    except Exception:
        pass
    return buf.getvalue()


def figure_img(fig: Any, alt: str, caption: str) -> str:
    """A ``<figure>`` holding ``fig`` as an embedded PNG."""
    data = base64.b64encode(figure_png(fig)).decode("ascii")
    return (f'<figure><img alt="{html.escape(alt)}" src="data:image/png;base64,{data}">'
            f"<figcaption>{html.escape(caption)}</figcaption></figure>")


def finding_cells(f: Any, severity: str, consequence: bool, note: str = "") -> str:
    """The four ``<td>`` of one finding: severity, code (xN), where, message and fix."""
    hint = f'<div class="hint">fix: {html.escape(f.hint)}</div>' if f.hint and not consequence else ""
    times = f' <span class="count">x{f.count}</span>' if f.count > 1 else ""
    code = f"<code>{html.escape(f.code)}</code>"
    if consequence:
        code = f'<span class="arrow">&#8627;</span> {code}'
    return (f'<td class="{severity}">{severity}</td><td>{code}{times}</td><td>{html.escape(f.where)}</td>'
            f"<td>{html.escape(f.message)}{hint}{note}</td>")


_TABLE_HEAD = ("<table class=\"findings\"><thead><tr><th>severity</th><th>code</th><th>where</th>"
               "<th>finding and fix</th></tr></thead><tbody>")


def findings_table(d: Any) -> str:
    """Root causes first (by their severity with their consequences), each followed by its consequences."""
    if not len(d):
        return '<p class="ok">no findings</p>'
    rows = []
    for r in d.root_causes:
        cons = d.consequences_of(r)
        note = (f'<div class="folded">{len(cons)} consequence{"s" if len(cons) != 1 else ""} below: fixing this '
                "cause fixes them</div>" if cons else "")
        rows.append(f'<tr class="finding root" data-code="{html.escape(r.code)}">'
                    f"{finding_cells(r, d.severity_of(r), False, note)}</tr>")
        for c in cons:
            rows.append(f'<tr class="finding consequence" data-code="{html.escape(c.code)}" '
                        f'data-caused-by="{html.escape(r.code)}">{finding_cells(c, c.severity, True)}</tr>')
    return _TABLE_HEAD + "".join(rows) + "</tbody></table>"


def finding_rows_table(findings: Iterable[Any]) -> str:
    """A findings table for a plain list of findings (no root-cause folding)."""
    rows = [f'<tr class="finding" data-code="{html.escape(f.code)}">{finding_cells(f, f.severity, False)}</tr>'
            for f in findings]
    return _TABLE_HEAD + "".join(rows) + "</tbody></table>" if rows else '<p class="ok">no findings</p>'


def stages_table(d: Any) -> str:
    """doctor's stages (``artifacts["stages"]``): status, seconds, and why a stage did not run."""
    rows = "".join(
        f'<tr class="stage" data-stage="{html.escape(s["name"])}"><td>{html.escape(s["name"])}</td>'
        f'<td class="{"ok" if s["status"] == "ran" else "warning"}">{html.escape(s["status"])}</td>'
        f'<td>{s["seconds"]:.1f} s' + (f' ({s["compiles"]} compiled, {s.get("compile_seconds", 0):.1f} s)'
                                        if s.get("compiles") else "")
        + (f'; +{s["background_seconds"]:.1f} s ahead, in the background' if s.get("background_seconds", 0) >= 0.05
           else "")
        + f'</td><td>{html.escape(s.get("reason") or "")}</td></tr>'
        for s in d.artifacts.get("stages") or [])
    return ('<section class="stages"><h3>Stages</h3><table><thead><tr><th>stage</th><th>status</th><th>time</th>'
            f"<th>why it did not run</th></tr></thead><tbody>{rows}</tbody></table></section>") if rows else ""


# ----------------------------------------------------------------------------- notebook HTML

def _wrap(kind: str, title: str, *parts: str) -> str:
    return (f'<div class="jaxsane-repr" data-kind="{kind}"><style>{CSS}</style>'
            f"<div><b>{html.escape(title)}</b></div>" + "".join(p for p in parts if p) + "</div>")


def _pre(text: str) -> str:
    return f"<pre>{html.escape(text)}</pre>"


def _plot_html(plot: Callable[[], Any], alt: str) -> str:
    """The figure ``plot()`` draws, or a note saying why it could not be drawn (a repr never raises)."""
    try:
        fig = plot()
        return figure_img(fig, alt, alt) if fig is not None and hasattr(fig, "savefig") else ""
    except Exception as e:  # no matplotlib, a broken backend: keep the rest of the repr
        return f'<p class="warning">could not draw the plot: {html.escape(repr(e))}</p>'


def finding_html(f: Any) -> str:
    return _wrap("finding", f"jaxsane finding: {f.code}", finding_rows_table([f]))


def diagnosis_html(d: Any) -> str:
    status = '<span class="ok">no errors</span>' if d.ok else '<span class="error">not ok</span>'
    title = f"jaxsane diagnosis{' of ' + d.name if d.name else ''}"
    return _wrap("diagnosis", title, f'<p class="summary">{html.escape(_counts_text(d))} &#8212; {status}</p>',
                 findings_table(d), stages_table(d))


def locate_html(r: Any) -> str:
    return _wrap("locate", f"jaxsane locate: {shorten(r.summary())}", _pre(str(r)),
                 finding_rows_table(r.findings()))


def overfit_html(r: Any) -> str:
    status = '<span class="ok">fits</span>' if r.ok else '<span class="error">does not fit</span>'
    return _wrap("overfit", "jaxsane overfit sweep", f"<p>{status}</p>", _pre(r.table()),
                 _plot_html(r.plot, "overfit sweep: loss against step per configuration"))


def sweep_html(s: Any) -> str:
    head = "".join(f"<th>{html.escape(name)}</th>" for name in s.layers)
    rows = "".join(f"<tr><td>x{scale:g}</td><td>{_num(float(s.loss[i]))}</td>"
                   + "".join(f"<td>{v:.3g}</td>" for v in s.activation_std[i]) + "</tr>"
                   for i, scale in enumerate(s.scales))
    table = (f"<table><thead><tr><th>scale</th><th>loss</th>{head}</tr></thead><tbody>{rows}</tbody></table>"
             "<div class=\"count\">activation std per layer, input side first</div>")
    return _wrap("init_scales", f"jaxsane init-scale sweep over {len(s.layers)} layers", table,
                 _plot_html(s.plot, "activation and gradient std through depth, per init scale"))


def fit_html(r: Any, plot_losses: Callable[[Any], Any] | None = None) -> str:
    """The run's numbers, its findings, and its loss curves when ``plot_losses(history)`` is given."""
    leaves, elements = state_size(r.state)
    losses = list(r.history.loss)
    cells = [("steps", r.step), ("first loss", _num(losses[0]) if losses else "-"),
             ("last loss", _num(losses[-1]) if losses else "-"), ("best eval loss", _num(r.best_eval_loss)),
             ("best step", r.best_step), ("rollbacks", r.rollbacks), ("stopped early", r.stopped_early),
             ("state", f"{leaves} leaves, {elements:,} elements"), ("metrics", r.metrics_path),
             ("checkpoints", r.checkpoint_dir)]
    table = "<table><tbody>" + "".join(f"<tr><th>{k}</th><td>{html.escape(str('-' if v is None else v))}</td></tr>"
                                       for k, v in cells) + "</tbody></table>"
    plot = _plot_html(lambda: plot_losses(r.history), "train and eval loss") if plot_losses else ""
    return _wrap("fit", "jaxsane fit", table, findings_table(r.diagnosis), plot)
