"""Reports: one self-contained HTML page (findings, hints, plots as embedded PNGs) and its JSON form.

``write_html(path, diagnoses)`` draws, for each :class:`Diagnosis`, whichever artifacts exist:

* ``artifacts["run"]`` — a :class:`~jaxsane.History` (or its ``to_dict()``): train/eval loss
  curves, gradient norms per layer, update/parameter ratios, dead-ReLU fractions;
* ``artifacts["overfit"]`` and ``artifacts["init_scales"]`` — any object with ``.plot()`` returning a
  matplotlib ``Figure`` (the overfit sweep and the init-scale plot).

Plots are rendered with matplotlib's Agg backend into PNGs embedded as base64 ``data:`` URIs, so the
file needs nothing else. The findings are also embedded as JSON (``<script type="application/json"
id="jaxsane-findings">``), identical to :func:`to_json`. Not jit-safe.
"""

from __future__ import annotations

import datetime
import html
import json
from collections.abc import Iterable, Sequence
from typing import Any

from .._core.diagnosis import Diagnosis
from .._core.display import findings_table as _findings_table, stages_table as _stages_table
from .._core.history import History
from .._core.run_meta import run_metadata
from .._core.validate import fail, require_str, require_writable_file
from .plots import plot_dead, plot_grad_norms, plot_losses, plot_update_ratio
from .reprs import figure_img as _img, figure_png as figure_png

_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:2em auto;max-width:1100px;color:#222}
h1{font-size:1.6em}h2{border-bottom:1px solid #ccc;padding-bottom:.2em;margin-top:1.6em}
table{border-collapse:collapse;width:100%;margin:.5em 0}th,td{border:1px solid #ddd;padding:.35em .5em;
text-align:left;vertical-align:top;font-size:.92em}th{background:#f4f4f4}
.error{color:#b00020;font-weight:bold}.warning{color:#a86500;font-weight:bold}.info{color:#0063a8}
.hint{color:#206020}.ok{color:#206020;font-weight:bold}figure{margin:1em 0}img{max-width:100%;
border:1px solid #eee}figcaption{color:#555;font-size:.9em}code{background:#f6f6f6;padding:0 .2em}
tr.consequence td{color:#666;font-size:.85em;background:#fafafa}tr.consequence td:nth-child(2){padding-left:1.5em}
.folded{color:#555;font-size:.85em;margin-top:.3em}.count{color:#555}
"""


# ----------------------------------------------------------------------------- plotting helpers


def as_history(run: Any) -> History | None:
    """Accept a History, its ``to_dict()``, or a minimal ``{"loss": [...]}``; None if unusable."""
    if isinstance(run, History):
        return run
    if isinstance(run, dict):
        if "steps" in run:
            return History.from_dict(run)
        if "loss" in run:
            loss = [float("nan") if v is None else float(v) for v in run["loss"]]
            return History(steps=list(range(len(loss))), loss=loss)
    return None


# ----------------------------------------------------------------------------- page


def _artifact_plot(obj: Any):
    plot = getattr(obj, "plot", None)
    if not callable(plot):
        return None
    fig = plot()
    return fig if hasattr(fig, "savefig") else None


_META_ROWS = (
    ("steps", "steps"),
    ("steps_requested", "steps asked for"),
    ("wall_seconds", "wall time (s)"),
    ("timings", "seconds per stage"),
    ("resumed_from", "resumed from step"),
    ("checkpoint_dir", "checkpoint directory"),
    ("metrics_path", "metrics file"),
    ("best_step", "best step"),
    ("best_eval_loss", "best eval loss"),
    ("stopped_early", "stopped early"),
    ("rollbacks", "rollbacks"),
    ("skipped_batches", "skipped batches"),
    ("error", "ended with"),
    ("versions", "versions"),
    ("backend", "backend"),
    ("devices", "devices"),
    ("process_count", "processes"),
)


def _meta_value(value: Any) -> str:
    if isinstance(value, dict):
        return ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return ", ".join(map(str, value)) or "none"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _meta_table(d: Diagnosis) -> str:
    """The run's metadata (``run_metadata`` in ``_core/run_meta.py``): steps, wall time, stage seconds,
    checkpoint directory, best step, versions, backend and devices."""
    meta = run_metadata(d.artifacts)
    known = {k for k, _ in _META_ROWS} | {"device_count"}
    rows = [(label, meta[k]) for k, label in _META_ROWS if k in meta and meta[k] is not None]
    rows += [(k, v) for k, v in meta.items() if k not in known and v is not None]
    body = "".join(f"<tr><th>{html.escape(label)}</th><td>{html.escape(_meta_value(v))}</td></tr>" for label, v in rows)
    return f'<section class="metadata"><h3>Run metadata</h3><table><tbody>{body}</tbody></table></section>'


def _section(d: Diagnosis, index: int) -> str:
    name = d.name or f"diagnosis {index + 1}"
    counts = d.counts()
    summary = ", ".join(f"{n} {s}{'s' if n != 1 else ''}" for s, n in counts.items())
    folded = len(d.consequences)
    if folded:
        summary += f" (root causes; {folded} consequence{'s' if folded != 1 else ''} folded beneath them)"
    parts = [
        f'<section class="diagnosis" id="diagnosis-{index}"><h2>{html.escape(name)}</h2>',
        f'<p class="summary">{html.escape(summary)}'
        + (' — <span class="ok">no errors</span>' if d.ok else "")
        + "</p>",
        '<section class="findings"><h3>Findings</h3>',
        _findings_table(d),
        "</section>",
        _stages_table(d),
        _meta_table(d),
    ]
    plots = []
    h = as_history(d.artifacts.get("run"))
    if h is not None:
        skipped = d.artifacts.get("skipped_batches") or ()
        for fn, slug, caption in (
            (lambda h: plot_losses(h, skipped), "loss-curves", "train and eval loss"),
            (plot_grad_norms, "grad-norms", "gradient norm per layer"),
            (plot_update_ratio, "update-ratio", "update/parameter norm ratio"),
            (plot_dead, "dead-relu", "dead ReLU fraction"),
        ):
            fig = fn(h)
            if fig is not None:
                plots.append((slug, caption, fig))
    for key, slug, caption in (
        ("overfit", "overfit-sweep", "overfit sweep on one small batch"),
        ("init_scales", "init-scales", "activation scale through depth at init"),
    ):
        if key in d.artifacts:
            try:
                fig = _artifact_plot(d.artifacts[key])
            except Exception as e:  # a broken artifact must not lose the rest of the report
                parts.append(f'<p class="warning">could not draw {html.escape(key)}: {html.escape(repr(e))}</p>')
                fig = None
            if fig is not None:
                plots.append((slug, caption, fig))
    for slug, caption, fig in plots:
        parts.append(
            f'<section class="plot {slug}"><h3>{html.escape(caption.capitalize())}</h3>'
            + _img(fig, caption, f"{name}: {caption}")
            + "</section>"
        )
    parts.append("</section>")
    return "\n".join(parts)


def _as_list(diagnoses: Diagnosis | Iterable[Diagnosis]) -> list[Diagnosis]:
    return [diagnoses] if isinstance(diagnoses, Diagnosis) else list(diagnoses)


def _with_meta(d: Diagnosis) -> dict:
    out = d.to_dict()
    if "meta" not in out:
        out["meta"] = json.loads(json.dumps(run_metadata(d.artifacts), default=str))
    return out


def to_json(diagnoses: Diagnosis | Iterable[Diagnosis], path: str | None = None) -> str:
    """The JSON form of the report: ``[diagnosis.to_dict(), ...]``, each with its run ``meta`` (also written
    to ``path``)."""
    text = json.dumps([_with_meta(d) for d in _as_list(diagnoses)], indent=2)
    if path is not None:
        with open(path, "w") as fh:
            fh.write(text + "\n")
    return text


def render_html(diagnoses: Diagnosis | Sequence[Diagnosis], title: str = "jaxsane report") -> str:
    """The report page as a string (see :func:`write_html`). Not jit-safe."""
    items = _as_list(diagnoses)
    stamp = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    total = {s: sum(d.counts()[s] for d in items) for s in ("error", "warning", "info")}
    overview = "".join(
        f'<tr><td><a href="#diagnosis-{i}">{html.escape(d.name or f"diagnosis {i + 1}")}</a></td>'
        f'<td class="{"ok" if d.ok else "error"}">{"ok" if d.ok else "errors"}</td>'
        + "".join(f"<td>{d.counts()[s]}</td>" for s in ("error", "warning", "info"))
        + "</tr>"
        for i, d in enumerate(items)
    )
    payload = to_json(items).replace("</", "<\\/")
    body = "\n".join(_section(d, i) for i, d in enumerate(items))
    return (
        f'<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        f"<title>{html.escape(title)}</title>\n<style>{_CSS}</style>\n</head>\n<body>\n"
        f"<h1>{html.escape(title)}</h1>\n<p>generated {stamp}: {total['error']} errors, {total['warning']} "
        f"warnings, {total['info']} info</p>\n"
        f'<section class="overview"><h2>Overview</h2><table><thead><tr><th>experiment</th><th>status</th>'
        f"<th>errors</th><th>warnings</th><th>info</th></tr></thead><tbody>{overview}</tbody></table></section>\n"
        f"{body}\n"
        f'<script type="application/json" id="jaxsane-findings">{payload}</script>\n</body>\n</html>\n'
    )


def write_html(path: str, diagnoses: Diagnosis | Sequence[Diagnosis], title: str = "jaxsane report") -> str:
    """Write one self-contained HTML report for ``diagnoses`` (a Diagnosis or a list) and return ``path``.

    The page holds each diagnosis's findings with their hints, its train/eval loss curves and
    gradient norms per layer (from ``artifacts["run"]``), and the overfit sweep / init-scale plots
    (``artifacts["overfit"]`` / ``artifacts["init_scales"]``, objects with ``.plot()``), as PNGs
    embedded in the file. Not jit-safe.

    Example:
      >>> import jaxsane, tempfile, os
      >>> d = jaxsane.Diagnosis([jaxsane.Finding("train.plateau", "flat loss", "raise the lr")], name="demo")
      >>> path = write_html(os.path.join(tempfile.mkdtemp(), "r.html"), [d])
    """
    path = require_writable_file("write_html", "path", path)
    require_str("write_html", "title", title)
    if not isinstance(diagnoses, Diagnosis) and (
        isinstance(diagnoses, (str, bytes))
        or not isinstance(diagnoses, Sequence)
        or not all(isinstance(d, Diagnosis) for d in diagnoses)
    ):
        raise fail(
            "write_html",
            "diagnoses",
            "a jaxsane.Diagnosis or a list of them",
            diagnoses,
            fix="pass the Diagnosis returned by jaxsane.doctor/check_data (or a list of them)",
        )
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(render_html(diagnoses, title))
    return path
