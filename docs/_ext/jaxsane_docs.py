"""Sphinx extension of the jaxsane manual: references generated from the code at build time.

* ``jaxsane-codes``: the finding-code table, one table per family, from :data:`jaxsane.CODES`
  (code, severity, what it means, typical causes). Each code is an anchor (``#code-nonfinite-backward``).
* ``jaxsane-options``: every doctor option, one table per stage in checklist order, from the frozen
  options dataclasses of ``jaxsane._doctor.options`` (name, declared type, default, bounds, meaning).
* ``jaxsane-cli``: the ``--help`` text of ``jaxsane`` and its subcommands, from ``jaxsane.cli.build_parser``.
* On ``builder-inited`` the notebooks in ``notebooks/`` are copied into ``docs/notebooks/`` (rendered from
  their committed outputs, never executed); on ``env-check-consistency`` every name of
  ``jaxsane.__all__`` and ``jaxsane.testing.__all__`` must have been documented, or the build warns
  (and ``make docs`` fails).

The row builders (:func:`code_rows`, :func:`option_rows`) are plain functions so that tests can call them.
"""

from __future__ import annotations

import filecmp
import pathlib
import re
import shutil
from typing import Any

from docutils import nodes
from sphinx.util import logging
from sphinx.util.docutils import SphinxDirective

LOG = logging.getLogger(__name__)
ROOT = pathlib.Path(__file__).resolve().parents[2]
NOTEBOOKS = ("nan_hunt", "overfit_one_batch", "init_scales", "spike_forensics")


# ----------------------------------------------------------------------------- rows, from the code


def code_rows() -> list[tuple[str, str, str, str]]:
    """``(code, severity, meaning, causes)`` for every code in :data:`jaxsane.CODES`, in its order."""
    from jaxsane import CODES

    return [(code, sev, meaning, causes) for code, (sev, meaning, causes) in CODES.items()]


def code_families() -> dict[str, list[tuple[str, str, str, str]]]:
    """The rows of :func:`code_rows` grouped by family (the part before the first dot), first seen first."""
    out: dict[str, list[tuple[str, str, str, str]]] = {}
    for row in code_rows():
        out.setdefault(row[0].split(".", 1)[0], []).append(row)
    return out


def _bounds(spec: Any) -> str:
    parts = []
    if spec.minimum is not None:
        parts.append(f">= {spec.minimum:g}")
    if spec.choices is not None:
        parts.append("one of " + ", ".join(repr(c) for c in spec.choices))
    return "; ".join(parts)


def option_rows() -> list[tuple[str, str, str, str, str, str]]:
    """``(stage, name, type, default, bounds, meaning)`` for every doctor option, in checklist order."""
    from jaxsane._doctor import options

    return [
        (spec.stage, spec.name, options.type_name(spec.type), repr(spec.default), _bounds(spec), spec.doc)
        for spec in options.OPTIONS.values()
    ]


def stage_descriptions() -> dict[str, str]:
    """``{stage: its one-line description}`` from the options dataclasses, in checklist order."""
    from jaxsane._doctor import options

    return {cls.stage: cls.description for cls in options.OPTION_CLASSES}


# ----------------------------------------------------------------------------- docutils tables


def _cell(content: Any) -> nodes.entry:
    entry = nodes.entry()
    if isinstance(content, nodes.Node):
        entry += content
    else:
        entry += nodes.paragraph(text=str(content))
    return entry


def _literal_par(text: str, ids: list[str] | None = None) -> nodes.paragraph:
    par = nodes.paragraph()
    if ids:
        par["ids"] = ids
    par += nodes.literal(text=text)
    return par


def _table(headers: list[str], rows: list[list[Any]], widths: list[int]) -> nodes.table:
    table = nodes.table(classes=["jaxsane-generated"])
    group = nodes.tgroup(cols=len(headers))
    table += group
    for width in widths:
        group += nodes.colspec(colwidth=width)
    head = nodes.thead()
    row = nodes.row()
    for h in headers:
        row += _cell(h)
    head += row
    group += head
    body = nodes.tbody()
    for cells in rows:
        row = nodes.row()
        for c in cells:
            row += _cell(c)
        body += row
    group += body
    return table


class CodesDirective(SphinxDirective):
    """Every finding code, one table per family, generated from ``jaxsane.CODES``."""

    has_content = False

    def run(self) -> list[nodes.Node]:
        out: list[nodes.Node] = []
        for family, rows in code_families().items():
            section = nodes.section(ids=[f"family-{family}"])
            section += nodes.title(text=f"{family}.*")
            section += _table(
                ["code", "severity", "what it means", "typical causes"],
                [
                    [_literal_par(code, [nodes.make_id(f"code-{code}")]), sev, meaning, causes]
                    for code, sev, meaning, causes in rows
                ],
                [22, 9, 40, 40],
            )
            out.append(section)
        return out


class OptionsDirective(SphinxDirective):
    """Every doctor option, one table per stage, generated from ``jaxsane._doctor.options``."""

    has_content = False

    def run(self) -> list[nodes.Node]:
        rows_by_stage: dict[str, list[list[Any]]] = {}
        for stage, name, tp, default, bounds, doc in option_rows():
            rows_by_stage.setdefault(stage, []).append(
                [
                    _literal_par(name, [nodes.make_id(f"option-{name}")]),
                    _literal_par(tp),
                    _literal_par(default),
                    bounds or "-",
                    doc,
                ]
            )
        out: list[nodes.Node] = []
        for stage, description in stage_descriptions().items():
            section = nodes.section(ids=[f"stage-{stage}"])
            section += nodes.title(text=f"{stage}")
            section += nodes.paragraph(text=description)
            section += _table(
                ["option", "type", "default", "bounds", "meaning"], rows_by_stage.get(stage, []), [20, 16, 14, 10, 40]
            )
            out.append(section)
        return out


class CliDirective(SphinxDirective):
    """``jaxsane --help`` and each subcommand's ``--help``, from ``jaxsane.cli.build_parser``."""

    has_content = False

    def run(self) -> list[nodes.Node]:
        import argparse
        import os

        from jaxsane.cli import build_parser

        old = os.environ.get("COLUMNS")
        os.environ["COLUMNS"] = "80"  # argparse wraps at the terminal's width: fix it for the page
        try:
            parser = build_parser()
            texts = [parser.format_help()]
            for action in parser._actions:
                if isinstance(action, argparse._SubParsersAction):
                    texts += [sub.format_help() for sub in action.choices.values()]
        finally:
            if old is None:
                os.environ.pop("COLUMNS", None)
            else:
                os.environ["COLUMNS"] = old
        return [nodes.literal_block(text, text, language="text") for text in texts]


# ----------------------------------------------------------------------------- build hooks


def copy_notebooks(app: Any) -> None:
    """Copy ``notebooks/*.ipynb`` into ``docs/notebooks/`` (only when changed, so Sphinx rereads only those)."""
    target = pathlib.Path(app.srcdir) / "notebooks"
    target.mkdir(exist_ok=True)
    for name in NOTEBOOKS:
        src, dst = ROOT / "notebooks" / f"{name}.ipynb", target / f"{name}.ipynb"
        if not dst.exists() or not filecmp.cmp(src, dst, shallow=False):
            shutil.copyfile(src, dst)


def clear_generated(app: Any, config: Any) -> None:
    """Remove autosummary's stub pages from an earlier build, so a name no longer listed leaves no stale page."""
    shutil.rmtree(pathlib.Path(app.srcdir) / "reference" / "generated", ignore_errors=True)


def check_api_documented(app: Any, env: Any) -> None:
    """Warn for each public name (``jaxsane.__all__``, ``jaxsane.testing.__all__``) the manual does not document."""
    import jaxsane
    import jaxsane.testing

    documented = set(env.get_domain("py").objects)
    for module, names in (("jaxsane", jaxsane.__all__), ("jaxsane.testing", jaxsane.testing.__all__)):
        for name in names:
            if f"{module}.{name}" not in documented:
                LOG.warning("public name %s.%s is not documented in the API reference (docs/reference/)", module, name)


_STAR_PAIR = re.compile(r"^(\s*)\*(\w+), \*\*(\w+)( \(.*\))?:")


def escape_star_pairs(app: Any, what: str, name: str, obj: Any, options: Any, lines: list[str]) -> None:
    """``*args, **kwargs: ...`` in a Google ``Args:`` section, escaped before napoleon reads it.

    napoleon's Google parser escapes a leading ``*`` of one name only (its NumPy parser splits ``a, b``), so
    the ``**`` of the second name would start reST strong emphasis and warn. Runs before napoleon.
    """
    for i, line in enumerate(lines):
        lines[i] = _STAR_PAIR.sub(lambda m: f"{m[1]}\\*{m[2]}, \\*\\*{m[3]}{m[4] or ''}:", line)


_SECTION = re.compile(r"^(\s*)(\w[\w ]*):\s*$")
_GROUPED = re.compile(r"^(\s+)(\w+(?:, \w+)+):")


def join_grouped_attributes(app: Any, what: str, name: str, obj: Any, options: Any, lines: list[str]) -> None:
    """``a, b: ...`` in a Google ``Attributes:`` section, written ``a,b: ...`` before napoleon reads it.

    napoleon takes one name per entry; given ``best_step, best_eval_loss:`` it renders ``best_step,`` as the
    type of ``best_eval_loss``. Joined without the space, the entry keeps both names under one description.
    Runs before napoleon.
    """
    section = None
    for i, line in enumerate(lines):
        head = _SECTION.match(line)
        if head:
            section = head[2]
            continue
        if section == "Attributes":
            lines[i] = _GROUPED.sub(lambda m: f"{m[1]}{m[2].replace(', ', ',')}:", line)


def setup(app: Any) -> dict[str, Any]:
    app.connect("autodoc-process-docstring", escape_star_pairs, priority=400)
    app.connect("autodoc-process-docstring", join_grouped_attributes, priority=400)
    app.add_directive("jaxsane-codes", CodesDirective)
    app.add_directive("jaxsane-options", OptionsDirective)
    app.add_directive("jaxsane-cli", CliDirective)
    app.connect("config-inited", clear_generated)
    app.connect("builder-inited", copy_notebooks)
    app.connect("env-check-consistency", check_api_documented)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
