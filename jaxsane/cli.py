"""The command line, thin over the library.

  jaxsane doctor [MODULE:ATTR | FILE.py:ATTR ...] [--json FILE] [--stages ...] [--skip ...] [--no-cache]
  jaxsane replay DUMP_DIR --step MODULE:ATTR [--like MODULE:ATTR] [--pdb]   (exit 1: a NaN origin was found,
                 0: finite; --pdb: then a post-mortem pdb session at the origin)

Exit codes (a CI gate): 0 every requested stage ran and found no error; 1 error findings, or a
requested stage that could not run (skipped, or crashed in the user's code); 2 usage errors (bad
arguments or options, a target that does not import, an output directory that does not exist),
reported in one ``[jaxsane]`` line, the argument checks before jax is imported; 130 Ctrl-C (SIGINT):
within about a second the CLI prints what doctor found so far and the stage it interrupted, and exits
without waiting for background compiles. ATTR names an
:class:`Experiment` or a zero-argument callable returning one. With no target, the bundled
examples run. ``-o NAME=VALUE`` values are read per the option's declared type (numbers,
``true``/``false``, comma lists such as ``overfit_learning_rates=1e-3,1e-2``).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import inspect
import json
import os
import signal
import socket
import sys
import threading
from collections.abc import Sequence
from typing import Any

EXIT_OK, EXIT_ERRORS, EXIT_USAGE = 0, 1, 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a Ctrl-C
INTERRUPT_GRACE_S = 1.0  # how long the main thread gets to stop by itself before the watcher ends the process


class UsageError(Exception):
    pass


def _split_target(target: str) -> tuple[str, str]:
    module_name, sep, attr = target.rpartition(":")
    if not sep or not module_name or not attr:
        raise UsageError(f"target {target!r} must look like MODULE:ATTR or path/to/file.py:ATTR")
    return module_name, attr


def _is_file_target(module_name: str) -> bool:
    return module_name.endswith(".py") or os.sep in module_name


def check_target(target: str) -> None:
    """Check a target's form and that its file or top-level package exists, without importing it."""
    module_name, _ = _split_target(target)
    if _is_file_target(module_name):
        if not os.path.isfile(module_name):
            raise UsageError(f"no such file: {module_name}")
        return
    top = module_name.split(".")[0]
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        found = importlib.util.find_spec(top) is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        raise UsageError(
            f"cannot import {module_name!r}: no module named {top!r} (run from the directory that "
            "holds it, or install it)"
        )


def _user_error(exc: BaseException, what: str) -> UsageError:
    """A one-line usage error naming the user's exception and their file:line."""
    where = ""
    if isinstance(exc, SyntaxError) and exc.filename:
        where = f" at {exc.filename}:{exc.lineno}"
    else:
        from ._doctor.triage import user_crash

        crash = user_crash(exc)
        if crash is not None:
            exc, file, line = crash
            where = f" at {file}:{line}" if file else ""
    text = " ".join(str(exc).split()) if not isinstance(exc, SyntaxError) else (exc.msg or "")
    return UsageError(f"{what}: {type(exc).__name__}: {text}{where}")


def load_target(target: str, raw: bool = False) -> Any:
    """``pkg.module:attr`` or ``path/to/file.py:attr`` -> an Experiment (calling attr if needed).

    With ``raw=True`` the attribute itself is returned (e.g. a step function). A module that does
    not import (syntax error, exception at import) or a factory that needs arguments or raises is a
    :class:`UsageError` naming the user's exception and file:line."""
    from ._experiment.contract import Experiment

    check_target(target)
    module_name, attr = _split_target(target)
    try:
        if _is_file_target(module_name):
            spec = importlib.util.spec_from_file_location(
                os.path.splitext(os.path.basename(module_name))[0], module_name
            )
            assert spec is not None and spec.loader is not None  # a .py path has a spec and a source loader
            module = importlib.util.module_from_spec(spec)
            sys.path.insert(0, os.path.dirname(os.path.abspath(module_name)))
            # registered as Python's own import does: dataclasses (a flax TrainState subclass) look it up
            sys.modules.setdefault(spec.name, module)
            spec.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        raise UsageError(f"cannot import {module_name!r}: {e}") from e
    except Exception as e:  # the user's module: a syntax error, or an exception while importing it
        raise _user_error(e, f"cannot import {module_name!r}") from e
    if not hasattr(module, attr):
        raise UsageError(f"{module_name!r} has no attribute {attr!r}")
    value = getattr(module, attr)
    if raw:
        return value
    if not isinstance(value, Experiment) and callable(value):
        try:
            required = [
                p.name
                for p in inspect.signature(value).parameters.values()
                if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
            ]
        except (TypeError, ValueError):
            required = []
        if required:
            raise UsageError(
                f"{target} needs arguments {required}; point the CLI at an Experiment or a "
                "callable that takes no arguments and returns one"
            )
        try:
            value = value()
        except Exception as e:
            raise _user_error(e, f"{target}() raised") from e
    if not isinstance(value, Experiment):
        raise UsageError(
            f"{target} is a {type(value).__name__}, not a jaxsane.Experiment (or a callable returning one)"
        )
    return value


def _parse_options(pairs: Sequence[str]) -> dict[str, Any]:
    """``-o NAME=VALUE`` pairs, each value read per the option's declared type. No jax import."""
    from ._core.errors import DoctorOptionError
    from ._doctor.options import parse_text

    options: dict[str, Any] = {}
    for pair in pairs:
        name, sep, text = pair.partition("=")
        if not sep or not name.strip():
            raise UsageError(f"option {pair!r} must look like NAME=VALUE (e.g. -o run_steps=50)")
        try:
            options[name.strip()] = parse_text(name.strip(), text)
        except DoctorOptionError as e:
            raise UsageError(str(e).removeprefix("[jaxsane] ")) from e
    return options


def _check_output(path: str | None, flag: str) -> None:
    if path is None:
        return
    parent = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise UsageError(f"{flag} {path} is a directory; give a file name")
    if not os.path.isdir(parent):
        raise UsageError(f"{flag} {path}: the directory {parent} does not exist; create it first")
    if not os.access(parent, os.W_OK):
        raise UsageError(f"{flag} {path}: the directory {parent} is not writable")
    name = os.path.basename(path)
    try:
        name_max = os.pathconf(parent, "PC_NAME_MAX")
    except (OSError, ValueError):  # no such limit here
        name_max = 255
    if len(os.fsencode(name)) > name_max:
        raise UsageError(
            f"{flag}: the file name {name[:40]}... is {len(os.fsencode(name))} bytes, over this file system's "
            f"limit of {name_max}; give a shorter name"
        )


def _write_output(path: str, flag: str, write) -> None:
    """``write(path)``, an OS error (disk full, permission, a path that vanished) becoming a usage error."""
    try:
        write(path)
    except OSError as e:
        raise UsageError(f"{flag} {path}: cannot write it ({e.strerror or e})") from e


def _doctor(args: argparse.Namespace) -> int:
    # everything about the arguments is checked before jax is imported
    from ._core.errors import DoctorOptionError
    from ._doctor.options import select_stages

    options = _parse_options(args.option)
    if not args.html:  # the init-scale sweep is drawn only in the HTML report: without one, nothing would read it
        options.setdefault("init_scales", None)
    try:
        select_stages(args.stages, args.skip or ())
    except DoctorOptionError as e:
        raise UsageError(str(e).removeprefix("[jaxsane] ")) from e
    _check_output(args.json, "--json")
    _check_output(args.html, "--html")
    if args.budget is not None and not args.budget > 0:
        raise UsageError(f"--budget must be a positive number of seconds, got {args.budget:g}")
    for target in args.targets:
        check_target(target)

    from ._core.diagnosis import Diagnosis
    from ._core.errors import JaxsaneError
    from ._doctor.doctor import doctor

    if not args.no_cache:  # before the targets load: their imports and Experiment.init compile too
        from ._jaxpr.compile_cache import enable_compilation_cache

        enable_compilation_cache()
    if args.targets:
        experiments = [load_target(t) for t in args.targets]
    else:
        from .examples import EXAMPLES, load

        print(f"[jaxsane] no target given: running the bundled examples {', '.join(EXAMPLES)}", file=sys.stderr)
        experiments = [load(name) for name in EXAMPLES]
    results: list[Diagnosis] = []
    for exp in experiments:
        try:
            diagnosis = doctor(
                exp,
                stages=args.stages,
                skip=args.skip or (),
                progress=not args.quiet,
                compile_cache=not args.no_cache,
                time_budget=args.budget,
                **options,
            )
        except JaxsaneError as e:
            raise UsageError(str(e).removeprefix("[jaxsane] ")) from e
        results.append(diagnosis)
        if not args.quiet:
            diagnosis.render()
            print()
    if args.json:
        payload = [d.to_dict() for d in results]

        def write_json(path: str) -> None:
            with open(path, "w") as fh:
                json.dump(payload if len(payload) > 1 else payload[0], fh, indent=2)

        _write_output(args.json, "--json", write_json)
    if args.html:
        from ._render.html import write_html

        _write_output(args.html, "--html", lambda path: write_html(path, results))
    return EXIT_OK if all(getattr(d, "passed", d.ok) for d in results) else EXIT_ERRORS


def _replay(args: argparse.Namespace) -> int:
    """``jaxsane replay DUMP_DIR --step MODULE:ATTR [--pdb]``: re-run :func:`jaxsane.locate` on a guard dump and,
    with ``--pdb``, open :func:`jaxsane.post_mortem` at its origin."""
    from ._core.errors import DumpError, DumpShapeError, JaxsaneError
    from ._dump.dump import load_dump
    from ._locate.locate import replay_dump

    if not os.path.isdir(args.dump):
        raise UsageError(f"no such dump directory: {args.dump}")
    target = load_target(args.step, raw=True)
    like = load_target(args.like, raw=True) if args.like else None
    if args.precision:
        return _replay_precision(args.dump, target)
    try:
        report = replay_dump(args.dump, target, load=load_dump, like=like)
    except (DumpError, DumpShapeError) as e:  # a damaged or hostile dump, or a class it cannot rebuild
        print(str(e), file=sys.stderr)
        return EXIT_USAGE
    except JaxsaneError as e:  # (the user's factory raised: named, with its file:line, in one line)
        raise UsageError(str(e).removeprefix("[jaxsane] ")) from e
    if report is None:
        print(
            "[jaxsane] replay: every output of the step is finite on the dumped inputs (the failure did not "
            "reproduce; compare devices, dtypes and XLA flags with the failing run)"
            + ("; no origin, so no debugger opened" if args.pdb else "")
        )
        return EXIT_OK
    print(report, flush=True)
    if args.pdb:
        from ._locate.debugger import post_mortem

        post_mortem(report)
    return EXIT_ERRORS


class _Parser(argparse.ArgumentParser):
    """argparse with jaxsane's one-line ``[jaxsane] usage error: ...`` (after the usage) and exit code 2."""

    def error(self, message: str):  # argparse declares NoReturn; so does this (it raises SystemExit)
        self.print_usage(sys.stderr)
        print("[jaxsane] usage error: " + " ".join(message.split()), file=sys.stderr)
        raise SystemExit(EXIT_USAGE)


def _replay_precision(path: str, target: Any) -> int:
    """``jaxsane replay DUMP --step M:A --precision``: :func:`jaxsane.compare_precision` of the step on the dumped
    inputs (exit 1 when an equation lost precision, 0 when none did)."""
    from ._core.errors import DumpError, DumpShapeError, JaxsaneError
    from ._dump.dump import load_dump
    from ._experiment.contract import Experiment, PureExperiment
    from ._locate.locate import call_users, callable_without_arguments
    from ._precision.compare import compare_precision

    if not isinstance(target, Experiment) and callable_without_arguments(target):
        try:  # a factory, as for replay without --precision: when it raises, name the user's line
            target = call_users(target, "your --step factory")
        except JaxsaneError as e:
            raise UsageError(str(e).removeprefix("[jaxsane] ")) from e
    step = PureExperiment(target).step if isinstance(target, Experiment) else target
    try:
        dump = load_dump(path)
    except (DumpError, DumpShapeError) as e:
        print(str(e), file=sys.stderr)
        return EXIT_USAGE
    findings = compare_precision(lambda *a: step(*a, **dump.kwargs), *dump.args)
    if not findings:
        print("[jaxsane] replay --precision: no equation lost more than rounding against float32 on the dumped inputs")
        return EXIT_OK
    for f in findings:
        print(f"{f.severity} {f.code}: {f.message}\n  fix: {f.hint}")
    return EXIT_ERRORS


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="jaxsane", description="JAX/Flax training sanity checks.")
    sub = parser.add_subparsers(dest="command", required=True)
    from ._doctor.options import OPTIONS, STAGE_NAMES, type_name

    epilog = (
        "stages: "
        + ", ".join(STAGE_NAMES)
        + "\noptions (-o NAME=VALUE):\n"
        + "\n".join(
            f"  {spec.name} ({type_name(spec.type)}, default {spec.default!r}): {spec.doc}" for spec in OPTIONS.values()
        )
    )
    p = sub.add_parser(
        "doctor",
        help="run the sanity checklist on experiments (default: the bundled examples)",
        epilog=epilog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("targets", nargs="*", metavar="MODULE:ATTR", help="experiments to check")
    p.add_argument("--json", metavar="FILE", help="also write the findings as JSON")
    p.add_argument("--html", metavar="FILE", help="also write a self-contained HTML report")
    p.add_argument("--stages", nargs="+", metavar="STAGE", help="run only these stages")
    p.add_argument("--skip", nargs="+", metavar="STAGE", help="skip these stages")
    p.add_argument(
        "-o",
        "--option",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a stage option, read per its type: -o run_steps=50, -o overfit_learning_rates=1e-3,1e-2",
    )
    p.add_argument("-q", "--quiet", action="store_true", help="print nothing; use the exit code / --json")
    p.add_argument(
        "--budget",
        type=float,
        metavar="SECONDS",
        help="fit the stages into about this many seconds per experiment: doctor estimates each stage from the "
        "step's cost and reduces the sweep, the sampled gradient leaves and the run, saying what it reduced",
    )
    p.add_argument(
        "--no-cache",
        action="store_true",
        help="do not keep compiled programs in jaxsane's persistent compilation cache ($JAXSANE_CACHE_DIR, "
        "default ~/.cache/jaxsane/xla; JAXSANE_CACHE=0 also turns it off)",
    )
    p.set_defaults(func=_doctor)
    p = sub.add_parser("replay", help="re-run jaxsane.locate on the inputs a guarded step dumped")
    p.add_argument("dump", metavar="DUMP_DIR", help="a dump directory written by guard(..., dump_dir=...)")
    p.add_argument(
        "--step",
        required=True,
        metavar="MODULE:ATTR",
        help="the step function, or an Experiment (or a zero-argument callable returning one)",
    )
    p.add_argument(
        "--like",
        metavar="MODULE:ATTR",
        help="a function callable without arguments (make_objects(seed=0) too) returning the step's first "
        "positional args as templates (NNX objects: (model, optimizer)); the rest come from the dump",
    )
    p.add_argument(
        "--pdb",
        action="store_true",
        help="after the report, open a post-mortem pdb session in your own line at the origin (jaxsane.post_mortem)",
    )
    p.add_argument(
        "--precision",
        action="store_true",
        help="instead of locating a NaN, compare the step in its low precision (bf16/fp16) with float32, equation "
        "by equation, and name where precision is lost (jaxsane.compare_precision)",
    )
    p.set_defaults(func=_replay)
    return parser


def _print_interrupted(diagnosis: Any) -> None:
    """What an interrupted doctor had found, and the stage it was in, on stderr."""
    if diagnosis is None:
        print("[jaxsane] interrupted (Ctrl-C)", file=sys.stderr, flush=True)
        return
    from ._doctor.doctor import interrupted_where

    where = interrupted_where(diagnosis)
    print(f"\n[jaxsane] interrupted (Ctrl-C) {where}; found so far:", file=sys.stderr, flush=True)
    print(str(diagnosis), file=sys.stderr, flush=True)


class _InterruptWatch:
    """The program's Ctrl-C: the main thread gets :data:`INTERRUPT_GRACE_S` to turn it into a report and exit
    130; when it is stuck where Python cannot raise (inside an XLA compile, joining a thread), a watcher thread
    that hears the signal through ``signal.set_wakeup_fd`` prints the report and ends the process with
    ``os._exit(130)``; a second Ctrl-C ends it at once. Used only when the CLI is the program (not when
    ``main`` is called in-process)."""

    def __init__(self) -> None:
        self.handled = threading.Event()
        self._read, self._write = socket.socketpair()
        self._previous_fd: int | None = None

    def __enter__(self) -> _InterruptWatch:
        if threading.current_thread() is not threading.main_thread():
            return self
        self._write.setblocking(False)
        try:
            self._previous_fd = signal.set_wakeup_fd(self._write.fileno(), warn_on_full_buffer=False)
        except ValueError:
            return self
        threading.Thread(target=self._watch, name="jaxsane-ctrl-c", daemon=True).start()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._previous_fd is not None:
            signal.set_wakeup_fd(self._previous_fd)

    def _watch(self) -> None:
        interrupts = 0
        while True:
            try:
                data = self._read.recv(64)
            except OSError:
                return
            interrupts += data.count(bytes([signal.SIGINT]))
            if interrupts >= 2:
                os._exit(EXIT_INTERRUPTED)
            if interrupts == 1 and not self.handled.wait(INTERRUPT_GRACE_S):
                try:  # the report is read while the main thread may still change it: it may fail, the exit may not
                    from ._doctor.doctor import running

                    _print_interrupted(running())
                finally:
                    os._exit(EXIT_INTERRUPTED)


def main(argv: Sequence[str] | None = None) -> int:
    """The CLI; returns the exit code. Called as the program (``argv`` None), a Ctrl-C ends it within about a
    second with code 130 (see :class:`_InterruptWatch`)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse: 2 on usage errors, 0 on --help
        return int(e.code or 0)
    # doctor only: replay --pdb hands Ctrl-C to the debugger
    watch = _InterruptWatch() if argv is None and args.command == "doctor" else contextlib.nullcontext()
    with watch:
        try:
            return args.func(args)
        except UsageError as e:
            print("[jaxsane] usage error: " + " ".join(str(e).split()), file=sys.stderr)
            return EXIT_USAGE
        except KeyboardInterrupt as e:
            if isinstance(watch, _InterruptWatch):
                watch.handled.set()
            _print_interrupted(getattr(e, "diagnosis", None))
            if isinstance(watch, _InterruptWatch):  # the program: leave now, never joining a compile at exit
                sys.stdout.flush()
                os._exit(EXIT_INTERRUPTED)
            return EXIT_INTERRUPTED


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
