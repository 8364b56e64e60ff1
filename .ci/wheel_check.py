"""Keep the wheel working: build the sdist and the wheel, ``twine check`` them, install the wheel (not
editable) into a fresh venv and run the doctor on a bundled example from outside the checkout.

Run by ``make wheel-check`` and CI. Exits non-zero, with the failing step named, on any failure.
"""

from __future__ import annotations

import glob
import os
import subprocess
import sys
import tempfile
import venv

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGET = "jaxsane.examples.digits_optax:experiment"


def run(step: str, cmd: list[str], **kw) -> subprocess.CompletedProcess:
    print(f"[wheel-check] {step}: {' '.join(cmd)}", flush=True)
    done = subprocess.run(cmd, text=True, capture_output=True, **kw)
    if done.returncode != 0:
        sys.stdout.write(done.stdout[-4000:])
        sys.stderr.write(done.stderr[-4000:])
        sys.exit(f"[wheel-check] {step} failed (exit {done.returncode})")
    return done


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="jaxsane-wheel-") as tmp:
        dist = os.path.join(tmp, "dist")
        run("build", [sys.executable, "-m", "build", "--sdist", "--wheel", "--outdir", dist, ROOT])
        files = sorted(glob.glob(os.path.join(dist, "*")))
        run("twine check", [sys.executable, "-m", "twine", "check", "--strict", *files])
        wheel = next(f for f in files if f.endswith(".whl"))
        env_dir = os.path.join(tmp, "venv")
        venv.EnvBuilder(with_pip=True).create(env_dir)
        py = os.path.join(env_dir, "bin", "python")
        run("install", [py, "-m", "pip", "install", "--quiet", f"{wheel}[examples]"])
        outside = os.path.join(tmp, "elsewhere")
        os.makedirs(outside)
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        env["JAXSANE_CACHE"] = "0"
        where = run("import", [py, "-c", "import jaxsane; print(jaxsane.__file__, jaxsane.__version__)"],
                    cwd=outside, env=env).stdout.split()
        if where[0].startswith(ROOT + os.sep):
            sys.exit(f"[wheel-check] the venv imported the checkout ({where[0]}), not the installed wheel")
        doctor = os.path.join(env_dir, "bin", "jaxsane")
        done = run("doctor", [doctor, "doctor", TARGET], cwd=outside, env=env)
        print(done.stdout[-1500:])
        print(f"[wheel-check] ok: {os.path.basename(wheel)} (version {where[1]}) installed from the wheel; "
              f"`jaxsane doctor {TARGET}` exit 0 outside the checkout")


if __name__ == "__main__":
    main()
