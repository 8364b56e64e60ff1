"""NaN localization: jaxsane.locate vs jax_debug_nans vs checkify(float_checks), side by side.

(jax_debug_nans runs together with jax_debug_infs, so that it also gets to see the Inf bugs.)

A public set of NaN bugs (forward, backward and optimizer-update; plain, jitted, inside scan,
custom_vjp, NNX, linen, vmap) and clean programs that create NaN/Inf on purpose and mask them.
Each bug marks its faulty line with ``# BUG``; line-exactness is computed from those markers.

For every program and tool it prints: found?, line-exact?, phase right?, wall time; then totals
and false positives on the clean programs. Finally it times locate on a failing step of a ~2M
parameter MLP (784-1024-1024-10, Adam, batch 256) next to the bare compiled step.

    .venv/bin/python benchmarks/nan_localization.py [--skip-mlp]

Nothing here asserts on time; the numbers are for the report.
"""

from __future__ import annotations

import argparse
import inspect
import os
import sys
import time
import traceback
from typing import Callable

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.experimental import checkify  # noqa: E402

import jaxsane  # noqa: E402
from jaxsane._locate.locate import _prepare  # noqa: E402

HERE = os.path.abspath(__file__)
PROGRAMS: list[tuple[str, str, Callable]] = []   # (name, expected phase or "clean", builder)


def program(phase: str):
    def register(builder):
        PROGRAMS.append((builder.__name__, phase, builder))
        return builder
    return register


# ----------------------------------------------------------------------------- bugs

@program("forward")
def log_of_zero_plain():
    def nll(p, y):
        return -jnp.mean(jnp.log(p[jnp.arange(3), y]))  # BUG
    return nll, (jnp.array([[0.5, 0.5], [1.0, 0.0], [0.2, 0.8]]), jnp.array([0, 1, 1]))


@program("backward")
def where_sqrt_trap_jit():
    @jax.jit
    def grad_fn(x):
        def f(x):
            r2 = jnp.sum(x * x, -1)
            return jnp.sum(jnp.where(r2 > 0, jnp.sqrt(r2), 0.0))  # BUG
        return jax.grad(f)(x)
    return grad_fn, (jnp.array([[1.0, 2.0], [0.0, 0.0]]),)


@program("forward")
def masked_mean_all_padding_jit():
    @jax.jit
    def pooled(h, mask):
        return (h * mask[..., None]).sum(1) / mask.sum(1)[:, None]  # BUG
    return pooled, (jnp.ones((2, 3, 4)), jnp.array([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]]))


@program("forward")
def softmax_neg_inf_mask():
    @jax.jit
    def attend(scores, mask):
        masked = jnp.where(mask, scores, -jnp.inf)
        return jax.nn.softmax(masked, axis=-1)  # BUG
    return attend, (jnp.ones((2, 3)), jnp.array([[True, True, False], [False, False, False]]))


@program("forward")
def softplus_overflow():
    def act(x):
        return jnp.sum(jnp.log(1.0 + jnp.exp(x)))  # BUG
    return act, (jnp.array([1.0, 50.0, 120.0]),)


@program("forward")
def float16_overflow_jit():
    @jax.jit
    def layer(x, w):
        h = x @ w  # BUG
        return jax.nn.relu(h)
    return layer, (jnp.full((2, 64), 40.0, jnp.float16), jnp.full((64, 8), 40.0, jnp.float16))


@program("forward")
def log_inside_scan():
    @jax.jit
    def loglik(xs):
        def body(total, x):
            total = total + jnp.log(x)  # BUG
            return total, total
        return jax.lax.scan(body, 0.0, xs)[0]
    return loglik, (jnp.array([0.5, 0.25, 0.0, 0.5]),)


@program("backward")
def arccos_trap_inside_scan():
    def angles(x):
        def body(c, xi):
            a = jnp.where(xi < 1.0, jnp.arccos(xi), 0.0)  # BUG
            return c + a, a
        return jax.lax.scan(body, 0.0, x)[0]
    return jax.jit(jax.grad(angles)), (jnp.array([0.0, 0.5, 1.0]),)


@program("backward")
def custom_vjp_bad_backward():
    @jax.custom_vjp
    def safe_norm(x):
        return jnp.sqrt(jnp.sum(x * x) + 1e-12)

    def fwd(x):
        n = safe_norm(x)
        return n, (x, jnp.sum(x * x))

    def bwd(res, g):
        x, sq = res
        return (g * x / sq,)  # BUG

    safe_norm.defvjp(fwd, bwd)
    return jax.grad(lambda x: safe_norm(x)), (jnp.zeros(3),)


@program("backward")
def norm_of_zero_difference():
    def pair_loss(a, b):
        return jnp.linalg.norm(a - b)  # BUG
    return jax.jit(jax.grad(pair_loss)), (jnp.ones(4), jnp.ones(4))


@program("forward")
def layernorm_without_eps():
    @jax.jit
    def layernorm(x):
        mu = x.mean(-1, keepdims=True)
        return (x - mu) / x.std(-1, keepdims=True)  # BUG
    return layernorm, (jnp.array([[1.0, 2.0, 3.0], [5.0, 5.0, 5.0]]),)


@program("update")
def adam_eps_underflow_float16():
    tx = optax.adam(1e-3)

    @jax.jit
    def step(state, x):
        params, opt_state = state
        grads = jax.grad(lambda p: jnp.sum(p["w"] * x))(params)
        updates, opt_state = tx.update(grads, opt_state, params)  # BUG
        return optax.apply_updates(params, updates), opt_state
    params = {"w": jnp.ones((4,), jnp.float16)}
    return step, ((params, tx.init(params)), jnp.array([1.0, 0.0, 2.0, 0.0], jnp.float16))


@program("update")
def handwritten_rmsprop_division():
    @jax.jit
    def step(params, v, x):
        g = jax.grad(lambda p: jnp.sum((p * x) ** 2))(params)
        v = 0.9 * v + 0.1 * g * g
        return params - 0.01 * g / jnp.sqrt(v), v  # BUG
    return step, (jnp.ones(3), jnp.zeros(3), jnp.array([1.0, 0.0, 1.0]))


@program("backward")
def nnx_step_distance_feature():
    class Net(nnx.Module):
        def __init__(self, rngs):
            self.l = nnx.Linear(3, 2, rngs=rngs)
            self.center = nnx.Param(jnp.zeros(3))

        def __call__(self, x):
            d = jnp.sqrt(jnp.sum((x - self.center) ** 2, -1, keepdims=True))  # BUG
            return self.l(x) * d

    model = Net(nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)

    @nnx.jit
    def step(model, opt, x):
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean(m(x) ** 2))(model)
        opt.update(model, grads)
        return loss
    x = jnp.array([[1.0, 2.0, 3.0], [0.0, 0.0, 0.0]])
    return step, (model, opt, x)


@program("forward")
def linen_naive_cross_entropy():
    class Classifier(nn.Module):
        @nn.compact
        def __call__(self, x):
            return jax.nn.softmax(nn.Dense(3)(x))

    model = Classifier()
    params = model.init(jax.random.key(0), jnp.ones((1, 4)))
    tx = optax.sgd(0.1)

    @jax.jit
    def step(state, x, y):
        params, opt_state = state

        def loss_fn(p):
            probs = model.apply(p, x)
            return -jnp.mean(jnp.log(probs[jnp.arange(x.shape[0]), y]))  # BUG
        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), {"loss": loss}
    x = jnp.array([[1.0, 0.0, 0.0, 0.0], [300.0, -300.0, 300.0, -300.0]])
    return step, ((params, tx.init(params)), x, jnp.array([0, 0]))


@program("forward")
def vmap_per_example_log():
    def per_example(x):
        return jnp.sum(jnp.log(x))  # BUG
    return jax.vmap(per_example), (jnp.array([[1.0, 2.0], [3.0, 4.0], [0.0, 1.0], [2.0, 2.0]]),)


# ----------------------------------------------------------------------------- clean programs (NaNs masked on purpose)

@program("clean")
def clean_where_division():
    def ratio(x, d):
        return jnp.where(d != 0, x / d, 0.0)
    return ratio, (jnp.ones(3), jnp.array([1.0, 0.0, 2.0]))


@program("clean")
def clean_double_where_grad():
    def f(x):
        r2 = jnp.sum(x * x, -1)
        safe = jnp.where(r2 > 0, r2, 1.0)
        return jnp.sum(jnp.where(r2 > 0, jnp.sqrt(safe), 0.0))
    return jax.jit(jax.grad(f)), (jnp.array([[1.0, 2.0], [0.0, 0.0]]),)


@program("clean")
def clean_attention_with_neg_inf_mask():
    def attend(scores, mask, v):
        p = jax.nn.softmax(jnp.where(mask, scores, -jnp.inf), axis=-1)
        return p @ v
    mask = jnp.array([[True, False, False], [True, True, False]])
    return attend, (jnp.ones((2, 3)), mask, jnp.ones((3, 2)))


@program("clean")
def clean_nan_to_num_under_grad():
    def f(x):
        y = jnp.log(x)
        return jnp.sum(jnp.where(jnp.isnan(y), 0.0, y))
    return jax.value_and_grad(f), (jnp.array([1.0, -1.0, 2.0]),)


@program("clean")
def clean_logsumexp_with_neg_inf():
    def f(x):
        return jax.nn.logsumexp(x, axis=-1)
    return jax.jit(f), (jnp.array([[0.0, -jnp.inf, 1.0], [2.0, -jnp.inf, -jnp.inf]]),)


# ----------------------------------------------------------------------------- the tools

def bug_lines(builder) -> set[int]:
    lines, start = inspect.getsourcelines(builder)
    return {start + i for i, text in enumerate(lines) if "# BUG" in text}


def _frame_line(tb) -> int | None:
    """Innermost frame of this file in an exception's traceback."""
    line = None
    for fr in traceback.extract_tb(tb):
        if os.path.abspath(fr.filename) == HERE:
            line = fr.lineno
    return line


def run_locate(builder):
    fn, args = builder()
    t = time.perf_counter()
    report = jaxsane.locate(fn, *args)
    dt = time.perf_counter() - t
    if report is None or not report.origins:
        return False, None, None, dt
    o = report.origins[0]
    line = o.line if o.file and os.path.abspath(o.file) == HERE else None
    return True, line, o.phase, dt


def run_debug_nans(builder):
    fn, args = builder()
    t = time.perf_counter()
    found, line = False, None
    jax.config.update("jax_debug_nans", True)
    jax.config.update("jax_debug_infs", True)
    try:
        out = fn(*args)
        jax.block_until_ready(out)
    except FloatingPointError as e:
        found, line = True, _frame_line(e.__traceback__)
    except Exception as e:  # noqa: BLE001 - other errors raised by the de-optimized re-run
        found, line = "FloatingPoint" in repr(e) or "nan" in str(e).lower(), _frame_line(e.__traceback__)
    finally:
        jax.config.update("jax_debug_nans", False)
        jax.config.update("jax_debug_infs", False)
    return found, line, None, time.perf_counter() - t


def run_checkify(builder):
    fn, args = builder()
    pure, arrays, _, _ = _prepare(fn, args, {})   # NNX objects -> pure state, same as the user would do
    t = time.perf_counter()
    checked = jax.jit(checkify.checkify(pure, errors=checkify.float_checks))
    err, out = checked(*arrays)
    jax.block_until_ready(out)
    exc = err.get_exception()
    dt = time.perf_counter() - t
    if exc is None:
        return False, None, None, dt
    tb = getattr(exc, "traceback_info", None)   # where checkify's check was inserted
    frames = tb.frames if tb is not None else []
    lines = [fr.line_num for fr in frames if os.path.abspath(fr.file_name) == HERE]
    return True, (lines[0] if lines else None), None, dt


TOOLS = [("jaxsane.locate", run_locate), ("jax_debug_nans+infs", run_debug_nans), ("checkify", run_checkify)]


def _mark(x) -> str:
    return "-" if x is None else ("yes" if x else "no")


def compare() -> None:
    rows = []
    totals = {name: {"found": 0, "exact": 0, "phase": 0, "fp": 0, "time": []} for name, _ in TOOLS}
    n_bugs = sum(1 for _, phase, _ in PROGRAMS if phase != "clean")
    n_clean = len(PROGRAMS) - n_bugs
    header = f"{'program':38s} {'phase':9s} " + " ".join(f"| {name:31s}" for name, _ in TOOLS)
    print(header)
    print(f"{'':38s} {'':9s} " + " ".join(f"| {'found exact phase   time':31s}" for _ in TOOLS))
    print("-" * len(header))
    for name, phase, builder in PROGRAMS:
        lines = bug_lines(builder)
        cells = []
        for tool, run in TOOLS:
            try:
                found, line, got_phase, dt = run(builder)
            except Exception as e:  # noqa: BLE001 - a tool that crashes on a program did not find it
                found, line, got_phase, dt = False, None, None, float("nan")
                print(f"   [{tool} crashed on {name}: {type(e).__name__}: {str(e)[:120]}]")
            tt = totals[tool]
            tt["time"].append(dt)
            if phase == "clean":
                tt["fp"] += bool(found)
                cells.append(f"| {'FP' if found else 'ok':5s} {'':5s} {'':5s} {dt:6.2f}s{'':6s}")
                continue
            exact = bool(found) and line in lines
            phase_ok = None if tool != "jaxsane.locate" else (bool(found) and got_phase == phase)
            tt["found"] += bool(found)
            tt["exact"] += exact
            tt["phase"] += bool(phase_ok)
            cells.append(f"| {_mark(bool(found)):5s} {_mark(exact):5s} {_mark(phase_ok):5s} {dt:6.2f}s{'':6s}")
        rows.append(f"{name:38s} {phase:9s} " + " ".join(cells))
        print(rows[-1], flush=True)
    print("-" * len(header))
    for tool, _ in TOOLS:
        tt = totals[tool]
        phase_text = f"{tt['phase']}/{n_bugs}" if tool == "jaxsane.locate" else "n/a (not reported)"
        print(f"{tool:16s} found {tt['found']:2d}/{n_bugs}  line-exact {tt['exact']:2d}/{n_bugs}  phase right "
              f"{phase_text:18s} false positives {tt['fp']}/{n_clean}  median wall {np.nanmedian(tt['time']):.2f}s")


# ----------------------------------------------------------------------------- the 2M-parameter MLP

def mlp_timing(repeats: int = 3) -> None:
    sizes = [784, 1024, 1024, 10]
    key = jax.random.key(0)
    params = []
    for a, b in zip(sizes[:-1], sizes[1:]):
        key, k = jax.random.split(key)
        params.append({"w": jax.random.normal(k, (a, b)) / np.sqrt(a), "b": jnp.zeros(b)})
    tx = optax.adam(1e-3)
    n_params = sum(p["w"].size + p["b"].size for p in params)

    def loss_fn(params, x, y):
        h = x
        for layer in params[:-1]:
            h = jax.nn.relu(h @ layer["w"] + layer["b"])
        probs = jax.nn.softmax(h @ params[-1]["w"] + params[-1]["b"])
        return -jnp.mean(jnp.sum(y * jnp.log(probs), -1))  # naive cross-entropy: log(0) on saturated rows

    @jax.jit
    def step(state, x, y):
        params, opt_state = state
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), {"loss": loss}

    x = jax.random.normal(jax.random.key(1), (256, 784))
    y = jax.nn.one_hot(jnp.arange(256) % 10, 10)
    bad_x = x.at[3].multiply(1e4)            # one exploding example saturates its softmax
    state = (params, tx.init(params))
    t = time.perf_counter()
    jax.block_until_ready(step(state, x, y))
    compile_s = time.perf_counter() - t
    bare, loc = [], []
    report = None
    for _ in range(repeats):                 # interleaved: bare step, locate, bare step, locate, ...
        t = time.perf_counter()
        jax.block_until_ready(step(state, bad_x, y))
        bare.append(time.perf_counter() - t)
        t = time.perf_counter()
        report = jaxsane.locate(step, state, bad_x, y)
        loc.append(time.perf_counter() - t)
    print(f"\n2M MLP ({n_params / 1e6:.2f}M params, batch 256, Adam): first compile+step {compile_s:.2f}s, "
          f"bare step median {np.median(bare) * 1e3:.1f} ms, locate median {np.median(loc):.2f}s "
          f"(min {min(loc):.2f}s, max {max(loc):.2f}s, {report.equations if report else 0} equations replayed)")
    if report is not None:
        print("  " + report.summary())


def main(argv=None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--skip-mlp", action="store_true")
    parser.add_argument("--only", nargs="*", help="program names to run")
    args = parser.parse_args(argv)
    if args.only:
        PROGRAMS[:] = [p for p in PROGRAMS if p[0] in args.only]
    print(f"jax {jax.__version__}, {jax.device_count()} CPU devices, {len(PROGRAMS)} programs\n")
    compare()
    if not args.skip_mlp:
        mlp_timing()


if __name__ == "__main__":
    sys.exit(main())
