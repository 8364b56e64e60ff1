"""``jaxsane replay DUMP --step M:A --precision`` on a dump of a bf16 step: names the line, exit 1; a correct
step: exit 0. And the Monitor's gradient proxy where the step cannot run upcast."""

import os
import textwrap

import jax
import jax.numpy as jnp
import numpy as np

import jaxsane
from jaxsane import cli
from jaxsane._experiment.contract import PureExperiment
from jaxsane._monitor.monitor import Monitor

PROGRAM = '''
import jax.numpy as jnp

def bad_step(x):
    return jnp.log(1 + x)  # MARK

def good_step(x):
    return jnp.log1p(x)

def broken_factory(seed=0):
    raise RuntimeError("no such checkpoint")  # RAISES
'''


def test_replay_precision_names_the_line(tmp_path, capsys):
    file = tmp_path / "user_bf16_step.py"
    file.write_text(textwrap.dedent(PROGRAM))
    dump = jaxsane.save_dump(str(tmp_path / "dump"), (jnp.linspace(1e-4, 1e-3, 64).astype(jnp.bfloat16),))
    assert cli.main(["replay", dump, "--step", f"{file}:bad_step", "--precision"]) == 1
    out = capsys.readouterr().out
    line = 1 + PROGRAM.splitlines().index("    return jnp.log(1 + x)  # MARK")
    assert "precision.lost" in out and f"user_bf16_step.py:{line}" in out and "log1p" in out, out
    assert cli.main(["replay", dump, "--step", f"{file}:good_step", "--precision"]) == 0
    assert os.path.isdir(dump)
    capsys.readouterr()
    # a factory that raises: the user's exception and line in one [jaxsane] line, exit 2, no traceback
    assert cli.main(["replay", dump, "--step", f"{file}:broken_factory", "--precision"]) == 2
    err = capsys.readouterr().err
    line = 1 + PROGRAM.splitlines().index('    raise RuntimeError("no such checkpoint")  # RAISES')
    assert "[jaxsane]" in err and "RuntimeError: no such checkpoint" in err and f"user_bf16_step.py:{line}" in err
    assert "Traceback" not in err, err


def test_monitor_falls_back_to_the_gradient_proxy():
    """A step that casts its new weights to a fixed bf16 would round its float32 shadow the same way: the
    shadow is refused and the gradient proxy measures instead (a leaf where some elements moved)."""
    def loss(params, batch):
        return jnp.mean((batch["x"].astype(jnp.bfloat16) @ params["w"]).astype(jnp.float32) ** 2)

    def step(state, batch):
        g = jax.grad(loss)(state["params"], batch)
        w = state["params"]["w"]
        new = (w - jnp.asarray(1e-3, w.dtype) * g["w"].astype(w.dtype)).astype(jnp.bfloat16)  # a fixed dtype
        return {"params": {"w": new}}, {"loss": loss(state["params"], batch)}

    rng = np.random.default_rng(0)
    data = [{"x": rng.normal(size=(16, 8)).astype(np.float32)} for _ in range(4)]
    scales = jnp.asarray(np.geomspace(0.01, 64.0, 8)[:, None], jnp.float32)  # small weights move, large ones not

    def init(key):
        return {"params": {"w": (scales * (1 + 0.1 * jax.random.normal(key, (8, 1)))).astype(jnp.bfloat16)}}

    pure = PureExperiment(jaxsane.Experiment(init=init, step=step, train=data, loss=loss))
    mon = Monitor(pure, every=1, dead_every=0)
    state = pure.init(jax.random.key(0))
    for i, b in enumerate(data):
        state, metrics = mon.step(state, b, 1)
        mon.record(i, metrics)
    h = mon.pull()
    assert mon._shadow_ok is False
    assert len(h.update_lost) == 4 and all(0.0 < r[0] < 1.0 for r in h.update_lost)
