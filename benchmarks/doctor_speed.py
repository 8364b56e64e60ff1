"""How long `jaxsane doctor` takes, per stage, on a first run and on a second run that finds the
compiled programs in jaxsane's persistent compilation cache; and the overfit sweep against sequential
jitted scans at a short and a long step budget.

Each doctor run is a fresh process (`python -m jaxsane.cli doctor TARGET --json ...`), as in CI: the
second run of a target gains only from the on-disk cache, never from a warm process. The cache lives in
a temporary directory made for this benchmark. Asserts nothing about time.

  .venv/bin/python benchmarks/doctor_speed.py [--targets digits_optax,lm] [--no-sweep] [--reps 1]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGETS = {
    "digits_nnx": "jaxsane.examples.digits_nnx:experiment",
    "digits_linen": "jaxsane.examples.digits_linen:experiment",
    "digits_optax": "jaxsane.examples.digits_optax:experiment",
    "where_nan": "jaxsane.examples.where_nan:experiment",
    "lm": "benchmarks/programs/causal_lm_nnx.py:experiment",
}


def child_env(**extra: str) -> dict[str, str]:
    """The environment of a measured process: this one's, with Python writing and reading its bytecode caches
    as on a user's machine (a sandbox's PYTHONDONTWRITEBYTECODE=1 would recompile every jaxsane module in
    every run, ~0.1 s), and this checkout first on the path."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), **extra)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    return env


def import_floor(target: str, reps: int = 3) -> float:
    """Median wall seconds of a process that imports ``target``'s module (the user's program, hence jax and its
    model libraries) and makes a PRNG key, without calling anything in it: what every doctor process on the
    target pays before any check, which no cache removes."""
    code = f"import jax; from jaxsane.cli import load_target; load_target({target!r}, raw=True); jax.random.key(0)"
    walls = []
    for _ in range(reps):
        start = time.perf_counter()
        subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=child_env(), check=True)
        walls.append(time.perf_counter() - start)
    return sorted(walls)[len(walls) // 2]


def run_doctor(target: str, cache_dir: str) -> tuple[float, dict, int, list[str], dict]:
    """(wall seconds, per-stage seconds, exit code, error codes, per-stage compile counts) of one doctor process."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "d.json")
        env = child_env(JAXSANE_CACHE_DIR=cache_dir)
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "jaxsane.cli", "doctor", target, "-q", "--json", out],
                              cwd=ROOT, env=env, capture_output=True, text=True)
        wall = time.perf_counter() - start
        if not os.path.exists(out):
            sys.stderr.write(proc.stdout + proc.stderr)
            return wall, {}, proc.returncode, [], {}
        with open(out) as fh:
            data = json.load(fh)
    timings = data.get("timings") or data.get("artifacts", {}).get("timings") or {}
    errors = [f["code"] for f in data.get("findings", []) if f.get("severity") == "error"]
    compiles = {s["name"]: s["compiles"] for s in data.get("stages", []) if "compiles" in s}
    compiles.update({k: v for k, v in data.get("compiles", {}).items() if k in ("setup", "background")})
    return wall, timings, proc.returncode, errors, compiles


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--targets", default=",".join(TARGETS), help="comma list of " + ", ".join(TARGETS))
    parser.add_argument("--no-sweep", action="store_true", help="skip the overfit sweep comparison")
    parser.add_argument("--reps", type=int, default=3, help="repetitions of the overfit sweep comparison")
    args = parser.parse_args()
    load = os.getloadavg()[0]
    from importlib.metadata import version
    print(f"# doctor speed, first run (empty cache) vs second run (cache filled by the first); load {load:.1f}; "
          f"jax {version('jax')}, ml_dtypes {version('ml_dtypes')}, numpy {version('numpy')}")
    print("# 'floor': a process that only imports the target's module and makes a key (no check, no cache can"
          "\n# remove it); 'own' is the doctor's wall time above that floor")
    stages = ["data", "init", "grads", "step", "batch", "overfit", "run"]
    print("# 'outside' is the process's time outside the stages (imports, loading the target, init); the row"
          "\n# under each run counts its compilations per stage (setup: before the first stage; bg: in doctor's"
          "\n# background threads: the gradient check, both sweeps, the run stage's telemetry, while earlier stages"
          "\n# ran; a stage's seconds are then mostly its wait), programs loaded from the cache included")
    print(f"{'target':14s} {'run':6s} {'total':>7s} {'outside':>7s}  " + " ".join(f"{s:>7s}" for s in stages)
          + "  exit  errors")
    for name in args.targets.split(","):
        floor = import_floor(TARGETS[name])
        with tempfile.TemporaryDirectory() as cache:
            walls = []
            for run in ("first", "second"):
                wall, timings, code, errors, compiles = run_doctor(TARGETS[name], cache)
                walls.append(wall)
                cells = " ".join(f"{timings[s]:7.1f}" if s in timings else f"{'-':>7s}" for s in stages)
                outside = wall - sum(timings.values())
                print(f"{name:14s} {run:6s} {wall:7.1f} {outside:7.1f}  {cells}  {code:4d}  "
                      f"{errors and ','.join(errors) or '-'}")
                if compiles:
                    counts = " ".join(f"{compiles[s]:7d}" if s in compiles else f"{'-':>7s}" for s in stages)
                    print(f"{'':14s} {'compiles':>14s} setup {compiles.get('setup', 0)}  {counts}  "
                          f"bg {compiles.get('background', 0)}")
            own = [max(w - floor, 1e-3) for w in walls]
            print(f"{name:14s} second run {walls[0] / walls[1]:.2f}x faster; floor {floor:.1f} s, own {own[0]:.1f} s / "
                  f"{own[1]:.1f} s: {own[0] / own[1]:.2f}x (load now {os.getloadavg()[0]:.1f})")
    if not args.no_sweep:
        for steps in (200, 2000):
            print(f"\n# overfit sweep, 16 configurations x {steps} steps (benchmarks/overfit_sweep.py)")
            proc = subprocess.run([sys.executable, "-W", "ignore", os.path.join(ROOT, "benchmarks", "overfit_sweep.py"),
                                   "--steps", str(steps), "--reps", str(args.reps)], cwd=ROOT, capture_output=True,
                                  text=True, env=child_env())
            print(proc.stdout.strip() or proc.stderr[-2000:])


if __name__ == "__main__":
    main()
