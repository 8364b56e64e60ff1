"""The command line, thin over the library.

  jaxsane doctor [MODULE:ATTR | FILE.py:ATTR ...] [--json FILE] [--stages ...] [--skip ...]
  jaxsane replay DUMP_DIR --step MODULE:ATTR     (exit 1: a NaN origin was found, 0: finite)

Exit codes: 0 no error findings, 1 error findings, 2 usage errors (so it works as a CI gate).
ATTR names an :class:`Experiment` or a zero-argument callable returning one. With no target,
the bundled examples run.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import sys
from typing import Any, Sequence

EXIT_OK, EXIT_ERRORS, EXIT_USAGE = 0, 1, 2


class UsageError(Exception):
    pass


def load_target(target: str, raw: bool = False) -> Any:
    """``pkg.module:attr`` or ``path/to/file.py:attr`` -> an Experiment (calling attr if needed).

    With ``raw=True`` the attribute itself is returned (e.g. a step function)."""
    from ._experiment import Experiment
    module_name, sep, attr = target.rpartition(":")
    if not sep or not module_name or not attr:
        raise UsageError(f"target {target!r} must look like MODULE:ATTR or path/to/file.py:ATTR")
    try:
        if module_name.endswith(".py") or os.sep in module_name:
            if not os.path.isfile(module_name):
                raise UsageError(f"no such file: {module_name}")
            spec = importlib.util.spec_from_file_location(os.path.splitext(os.path.basename(module_name))[0],
                                                          module_name)
            module = importlib.util.module_from_spec(spec)
            sys.path.insert(0, os.path.dirname(os.path.abspath(module_name)))
            spec.loader.exec_module(module)
        else:
            sys.path.insert(0, os.getcwd())
            module = importlib.import_module(module_name)
    except ImportError as e:
        raise UsageError(f"cannot import {module_name!r}: {e}") from e
    if not hasattr(module, attr):
        raise UsageError(f"{module_name!r} has no attribute {attr!r}")
    value = getattr(module, attr)
    if raw:
        return value
    if not isinstance(value, Experiment) and callable(value):
        value = value()
    if not isinstance(value, Experiment):
        raise UsageError(f"{target} is a {type(value).__name__}, not a jaxsane.Experiment (or a callable "
                         "returning one)")
    return value


def _doctor(args: argparse.Namespace) -> int:
    from ._doctor import doctor
    from ._errors import JaxsaneError
    from ._findings import Diagnosis

    if args.targets:
        experiments = [load_target(t) for t in args.targets]
    else:
        from .examples import EXAMPLES, load
        print(f"[jaxsane] no target given: running the bundled examples {', '.join(EXAMPLES)}", file=sys.stderr)
        experiments = [load(name) for name in EXAMPLES]
    stage_options = dict(kv.split("=", 1) for kv in args.option)
    results: list[Diagnosis] = []
    for exp in experiments:
        try:
            diagnosis = doctor(exp, stages=args.stages, skip=args.skip or (), progress=not args.quiet,
                               **{k: _parse_value(v) for k, v in stage_options.items()})
        except JaxsaneError as e:
            raise UsageError(str(e)) from e
        results.append(diagnosis)
        if not args.quiet:
            diagnosis.render()
            print()
    if args.json:
        payload = [d.to_dict() for d in results]
        with open(args.json, "w") as fh:
            json.dump(payload if len(payload) > 1 else payload[0], fh, indent=2)
    if args.html:
        from ._report import write_html
        write_html(args.html, results)
    return EXIT_OK if all(d.ok for d in results) else EXIT_ERRORS


def _replay(args: argparse.Namespace) -> int:
    """``jaxsane replay DUMP_DIR --step MODULE:ATTR``: re-run :func:`jaxsane.locate` on a guard dump."""
    from ._dump import load_dump
    from ._errors import DumpError, DumpShapeError, JaxsaneError
    from ._locate import replay_dump

    if not os.path.isdir(args.dump):
        raise UsageError(f"no such dump directory: {args.dump}")
    target = load_target(args.step, raw=True)
    try:
        report = replay_dump(args.dump, target, load=load_dump)
    except (DumpError, DumpShapeError) as e:  # a damaged or hostile dump, or a class it cannot rebuild
        print(str(e), file=sys.stderr)
        return EXIT_USAGE
    except JaxsaneError as e:
        raise UsageError(str(e)) from e
    if report is None:
        print("[jaxsane] replay: every output of the step is finite on the dumped inputs (the failure did not "
              "reproduce; compare devices, dtypes and XLA flags with the failing run)")
        return EXIT_OK
    print(report)
    return EXIT_ERRORS


def _parse_value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxsane", description="JAX/Flax training sanity checks.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("doctor", help="run the sanity checklist on experiments (default: the bundled examples)")
    p.add_argument("targets", nargs="*", metavar="MODULE:ATTR", help="experiments to check")
    p.add_argument("--json", metavar="FILE", help="also write the findings as JSON")
    p.add_argument("--html", metavar="FILE", help="also write a self-contained HTML report")
    p.add_argument("--stages", nargs="+", metavar="STAGE", help="run only these stages")
    p.add_argument("--skip", nargs="+", metavar="STAGE", help="skip these stages")
    p.add_argument("-o", "--option", action="append", default=[], metavar="NAME=VALUE",
                   help="a stage option, e.g. -o run_steps=50")
    p.add_argument("-q", "--quiet", action="store_true", help="print nothing; use the exit code / --json")
    p.set_defaults(func=_doctor)
    p = sub.add_parser("replay", help="re-run jaxsane.locate on the inputs a guarded step dumped")
    p.add_argument("dump", metavar="DUMP_DIR", help="a dump directory written by guard(..., dump_dir=...)")
    p.add_argument("--step", required=True, metavar="MODULE:ATTR",
                   help="the step function, or an Experiment (or a zero-argument callable returning one)")
    p.set_defaults(func=_replay)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse: 2 on usage errors, 0 on --help
        return int(e.code or 0)
    try:
        return args.func(args)
    except UsageError as e:
        print(f"[jaxsane] usage error: {e}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
