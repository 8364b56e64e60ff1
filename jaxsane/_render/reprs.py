"""Notebook-sized renderings of results: short plain-text reprs and HTML fragments.

Each result class (``Finding``, ``Diagnosis``, ``LocateReport``, ``OverfitResult``, ``InitScaleSweep``,
``FitResult``) has a two-line ``__repr__`` / ``_repr_html_`` that calls a function here. The text is a few
lines (headline numbers, counts, codes, never whole arrays or parameters); the HTML is a fragment scoped
under ``<div class="jaxsane-repr">``. The fragments (findings and stages tables, figures as embedded PNGs)
are the HTML report's own: ``_render/html.py`` builds its page from them.

This module imports no other jaxsane module (it reads its objects by their attributes), so the shared
classes can call it without an import cycle. Not jit-safe: host-side text.
"""

from __future__ import annotations

import base64
import html
import io
from collections.abc import Callable
from typing import Any

from .._core.display import (
    codes_text,
    counts_text,
    finding_rows_table,
    findings_table,
    plural,
    pre_html,
    shorten,
    wrap_html,
)


def _num(x: Any) -> str:
    return "-" if x is None else f"{x:.4g}"


# ----------------------------------------------------------------------------- plain text


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
    best = f", best eval {_num(r.best_eval_loss)} at step {r.best_step}" if r.best_step is not None else ""
    flags = "".join(
        [
            ", stopped early" if r.stopped_early else "",
            f", resumed from {r.resumed_from}" if r.resumed_from is not None else "",
            ", restored best" if r.restored_best else "",
        ]
    )
    lines = [
        f"<FitResult: {r.step} steps, {loss}{best}, {plural(r.rollbacks, 'rollback')}{flags}",
        f"  state: {leaves} leaves, {elements:,} elements; diagnosis: {counts_text(r.diagnosis)}; "
        f"codes: {codes_text(r.diagnosis.codes)}",
    ]
    where = [
        f"metrics {r.metrics_path}" if r.metrics_path else "",
        f"checkpoints {r.checkpoint_dir}" if r.checkpoint_dir else "",
    ]
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
    return (
        f'<figure><img alt="{html.escape(alt)}" src="data:image/png;base64,{data}">'
        f"<figcaption>{html.escape(caption)}</figcaption></figure>"
    )


# ----------------------------------------------------------------------------- notebook HTML


def _plot_html(plot: Callable[[], Any], alt: str) -> str:
    """The figure ``plot()`` draws, or a note saying why it could not be drawn (a repr never raises)."""
    try:
        fig = plot()
        return figure_img(fig, alt, alt) if fig is not None and hasattr(fig, "savefig") else ""
    except Exception as e:  # no matplotlib, a broken backend: keep the rest of the repr
        return f'<p class="warning">could not draw the plot: {html.escape(repr(e))}</p>'


def locate_html(r: Any) -> str:
    return wrap_html(
        "locate", f"jaxsane locate: {shorten(r.summary())}", pre_html(str(r)), finding_rows_table(r.findings())
    )


def overfit_html(r: Any) -> str:
    status = '<span class="ok">fits</span>' if r.ok else '<span class="error">does not fit</span>'
    return wrap_html(
        "overfit",
        "jaxsane overfit sweep",
        f"<p>{status}</p>",
        pre_html(r.table()),
        _plot_html(r.plot, "overfit sweep: loss against step per configuration"),
    )


def sweep_html(s: Any) -> str:
    head = "".join(f"<th>{html.escape(name)}</th>" for name in s.layers)
    rows = "".join(
        f"<tr><td>x{scale:g}</td><td>{_num(float(s.loss[i]))}</td>"
        + "".join(f"<td>{v:.3g}</td>" for v in s.activation_std[i])
        + "</tr>"
        for i, scale in enumerate(s.scales)
    )
    table = (
        f"<table><thead><tr><th>scale</th><th>loss</th>{head}</tr></thead><tbody>{rows}</tbody></table>"
        '<div class="count">activation std per layer, input side first</div>'
    )
    return wrap_html(
        "init_scales",
        f"jaxsane init-scale sweep over {len(s.layers)} layers",
        table,
        _plot_html(s.plot, "activation and gradient std through depth, per init scale"),
    )


def fit_html(r: Any, plot_losses: Callable[[Any], Any] | None = None) -> str:
    """The run's numbers, its findings, and its loss curves when ``plot_losses(history)`` is given."""
    leaves, elements = state_size(r.state)
    losses = list(r.history.loss)
    cells = [
        ("steps", r.step),
        ("first loss", _num(losses[0]) if losses else "-"),
        ("last loss", _num(losses[-1]) if losses else "-"),
        ("best eval loss", _num(r.best_eval_loss)),
        ("best step", r.best_step),
        ("rollbacks", r.rollbacks),
        ("stopped early", r.stopped_early),
        ("state", f"{leaves} leaves, {elements:,} elements"),
        ("metrics", r.metrics_path),
        ("checkpoints", r.checkpoint_dir),
    ]
    table = (
        "<table><tbody>"
        + "".join(f"<tr><th>{k}</th><td>{html.escape(str('-' if v is None else v))}</td></tr>" for k, v in cells)
        + "</tbody></table>"
    )
    plot = _plot_html(lambda: plot_losses(r.history), "train and eval loss") if plot_losses else ""
    return wrap_html("fit", "jaxsane fit", table, findings_table(r.diagnosis), plot)
