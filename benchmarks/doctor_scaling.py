"""doctor at the size people train: a ladder of realistic programs, each timed two ways in one run.

For every rung (benchmarks/programs/scaling.py: an NNX causal LM at about 1M, 10M and 50M parameters,
sequence 128, a linen CNN with BatchNorm at two sizes, and a 7M-parameter linen LSTM LM whose step is bound by
its loop over time) this runs, as fresh processes:

* the user's own cold run: ``python benchmarks/programs/scaling.py RUNG`` (import, init, the first step,
  30 steps);
* ``jaxsane doctor`` on the same program (``python -m jaxsane.cli doctor benchmarks/programs/scaling.py:RUNG``)
  with an empty JAXSANE cache directory;

in the order user, doctor, user (``--reps N``: user, then N times doctor and user), and reports each one's wall
seconds and peak RSS (``ru_maxrss`` of the child from ``os.wait4``: the largest
resident set of the process; jax runs in one process, so that is the process tree's peak), on a GPU or TPU also
each one's peak device memory (``memory_stats()['peak_bytes_in_use']``, read by the child at its end), the ratios
doctor/user, doctor's own per-stage seconds from its JSON summary, and the load average. Each doctor run is
compared with the mean of the user's runs just before and after it: the speed of a shared or virtual machine
drifts (on the 2-core development VM the same user run took 14 to 21 s within five minutes, idle), and a drift
inside the window moves both sides alike. With ``--reps N`` the row gives the median run of each side and the
median of the N ratios, and lists every ratio. Asserts nothing.

Programs not written for the ladder (``benchmarks/programs/more/``: an Equinox WaveNet, a linen CNN with gradient
accumulation and an EMA, a LoRA classifier, a two-tower recommender, a data-parallel MLP-Mixer on 8 host devices)
run the same way when ``--rungs`` names their paths: ``python PATH`` is the user's cold run, ``PATH:experiment``
what doctor checks.

  python benchmarks/doctor_scaling.py [--rungs lm_1m,cnn_small] [--reps 3] [--markdown FILE] [--budget SECONDS]
  python benchmarks/doctor_scaling.py --rungs benchmarks/programs/more/wavenet_eqx.py,...
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROGRAM = os.path.join("benchmarks", "programs", "scaling.py")
RUNGS = ("lm_1m", "lm_10m", "lm_50m", "cnn_small", "cnn_large", "lstm_7m")
STAGES = ("data", "init", "grads", "step", "batch", "overfit", "run")


def child_env(**extra: str) -> dict[str, str]:
    """This environment, with this checkout first on the path and bytecode caches written as on a user's machine."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), **extra)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    return env


def measured(cmd: list[str], env: dict[str, str]) -> tuple[float, float, int, str]:
    """``(wall seconds, peak RSS in MB, exit code, stdout)`` of one fresh process."""
    with tempfile.TemporaryFile("w+") as out:
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.PIPE, text=True)
        assert proc.stderr is not None
        err = proc.stderr.read()  # drained while it runs, so a chatty child cannot block
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - start
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        text = out.read()
    if proc.returncode not in (0, 1):  # doctor exits 1 when it finds an error; anything else is a failure
        sys.stderr.write(err[-3000:])
    return wall, usage.ru_maxrss / 1024, proc.returncode, text


def is_program(rung: str) -> bool:
    """A rung given as a program's path (``benchmarks/programs/more/``): ``python PATH`` is the user's cold run,
    printing one JSON line of timings, and its ``experiment`` is what doctor checks."""
    return rung.endswith(".py")


def user_run(rung: str) -> dict:
    cmd = [sys.executable, rung] if is_program(rung) else [sys.executable, PROGRAM, rung]
    wall, rss, rc, out = measured(cmd, child_env())
    lines = [line for line in out.splitlines() if line.startswith("{")]
    inner = json.loads(lines[-1]) if lines else {}
    return {"wall": wall, "rss": rss, "rc": rc, **inner}


# the CLI's main, then one JSON line with the device's peak memory (jax imported only after doctor has set it up)
RUN_DOCTOR = (
    "import json, sys; from jaxsane.cli import main; rc = main(sys.argv[1:]); import jax; "
    "s = jax.devices()[0].memory_stats() or {}; "
    "print(json.dumps({'device_peak_mb': s['peak_bytes_in_use'] / 2**20 if 'peak_bytes_in_use' in s else None})); "
    "sys.exit(rc)"
)


def doctor_run(rung: str, budget: float | None) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "d.json")
        target = f"{rung}:experiment" if is_program(rung) else f"{PROGRAM}:{rung}"
        cmd = [sys.executable, "-c", RUN_DOCTOR, "doctor", target, "-q", "--json", report]
        if budget is not None:
            cmd += ["--budget", str(budget)]
        wall, rss, rc, out = measured(cmd, child_env(JAXSANE_CACHE_DIR=os.path.join(tmp, "cache")))
        data = json.load(open(report)) if os.path.exists(report) else {}
    findings = data.get("findings", [])
    lines = [line for line in out.splitlines() if line.startswith("{")]
    return {
        "wall": wall,
        "rss": rss,
        "rc": rc,
        "device_peak_mb": json.loads(lines[-1]).get("device_peak_mb") if lines else None,
        "timings": data.get("timings", {}),
        "errors": sorted({f["code"] for f in findings if f.get("severity") == "error"}),
        "plan": [f["message"] for f in findings if f.get("code") in ("overfit.budget", "doctor.budget")],
    }


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def bracketed(rung: str, users: list[dict], doctors: list[dict], load_window: str) -> dict:
    """One rung's row from ``users`` (N + 1 runs) and ``doctors`` (N runs, doctor i between user i and i + 1): each
    doctor run against the mean of the user runs around it; the median run of each side and the median ratios."""
    around = [(users[i]["wall"] + users[i + 1]["wall"]) / 2 for i in range(len(doctors))]
    rss_around = [(users[i]["rss"] + users[i + 1]["rss"]) / 2 for i in range(len(doctors))]
    ratios = [d["wall"] / u for d, u in zip(doctors, around)]
    by_wall = lambda runs: sorted(runs, key=lambda r: r["wall"])[(len(runs) - 1) // 2]  # noqa: E731
    return {
        "rung": rung,
        "user": by_wall(users),
        "doctor": by_wall(doctors),
        "ratio": statistics.median(ratios),
        "ratios": ratios,
        "rss_ratio": statistics.median(d["rss"] / u for d, u in zip(doctors, rss_around)),
        "users": users,
        "doctors": doctors,
        "load": load_window,
    }


def table(rows: list[dict]) -> str:
    head = (
        "| rung | params | user s | doctor s | time ratio | each run | user RSS MB | doctor RSS MB | RSS ratio | "
        + " | ".join(STAGES)
        + " | load (1/5/15 min) | errors |"
    )
    device = any(r["user"].get("device_peak_mb") for r in rows)  # an accelerator: its memory too
    if device:
        head = head.replace(" RSS ratio |", " RSS ratio | user device MB | doctor device MB | device ratio |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        u, d = r["user"], r["doctor"]
        stages = " | ".join(f"{d['timings'][s]:.1f}" if s in d["timings"] else "-" for s in STAGES)
        memory = f"{u['rss']:.0f} | {d['rss']:.0f} | {r['rss_ratio']:.2f}x | "
        if device:
            ud, dd = u.get("device_peak_mb") or 0.0, d.get("device_peak_mb") or 0.0
            memory += f"{ud:.0f} | {dd:.0f} | {dd / ud if ud else float('nan'):.2f}x | "
        lines.append(
            f"| {r['rung']} | {u.get('params', 0) / 1e6:.2f}M | {u['wall']:.1f} | {d['wall']:.1f} | "
            f"{r['ratio']:.2f}x | {' '.join(f'{x:.2f}' for x in r['ratios'])} | {memory}{stages} | {r['load']} | "
            f"{', '.join(d['errors']) or 'none'} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--rungs",
        default=",".join(RUNGS),
        help="comma list of " + ", ".join(RUNGS) + ", or paths of programs (benchmarks/programs/more/*.py)",
    )
    parser.add_argument("--markdown", metavar="FILE", help="also write the table as markdown")
    parser.add_argument("--budget", type=float, help="run doctor with --budget SECONDS")
    parser.add_argument("--json", metavar="FILE", help="also write every measurement as JSON")
    parser.add_argument("--reps", type=int, default=1, help="doctor runs per rung, each between two user runs")
    args = parser.parse_args()
    if args.reps < 1:
        parser.error("--reps must be at least 1")
    rungs = [r.strip() for r in args.rungs.split(",") if r.strip()]
    unknown = [r for r in rungs if r not in RUNGS and not (is_program(r) and os.path.exists(os.path.join(ROOT, r)))]
    if unknown:
        parser.error(f"unknown rung(s) {unknown}; the rungs are {list(RUNGS)}")
    rows = []
    for rung in rungs:
        before = load()
        users, doctors = [user_run(rung)], []
        for _ in range(args.reps):
            doctors.append(doctor_run(rung, args.budget))
            users.append(user_run(rung))
            user, doc = users[-1], doctors[-1]
            print(
                f"{rung}: user {users[-2]['wall']:.1f} s / {user['wall']:.1f} s {user['rss']:.0f} MB; doctor "
                f"{doc['wall']:.1f} s {doc['rss']:.0f} MB ({doc['wall'] * 2 / (users[-2]['wall'] + user['wall']):.2f}x "
                f"time); stages {json.dumps({k: round(v, 1) for k, v in doc['timings'].items()})}; errors "
                f"{doc['errors']}; plan {doc['plan']}; device peak MB user {user.get('device_peak_mb')} doctor "
                f"{doc['device_peak_mb']}; load {load()}",
                flush=True,
            )
        name = os.path.splitext(os.path.basename(rung))[0] if is_program(rung) else rung
        rows.append(bracketed(name, users, doctors, f"{before} -> {load()}"))
    text = table(rows)
    print(text)
    if args.markdown:
        with open(args.markdown, "w") as fh:
            fh.write(text + "\n")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
