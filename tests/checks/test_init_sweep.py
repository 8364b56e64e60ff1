"""Init-scale sweep: per-layer activation/gradient std at init, vmapped over scales."""

import jax
import jax.numpy as jnp
import matplotlib
import numpy as np
import optax
import pytest

import jaxsane
from jaxsane import init_scale_sweep
from jaxsane.examples import load
from jaxsane.examples._digits import load_digits_split


def _batch(n=32):
    x, y, _, _ = load_digits_split()
    return {"x": x[:n], "y": y[:n]}


@pytest.mark.slow
def test_relu_mlp_std_scales_as_a_power_of_depth():
    # biases are zero at init and ReLU is positively homogeneous, so layer l's output scales by s**(l+1)
    sweep = init_scale_sweep(load("digits_optax"), _batch(), scales=(0.5, 1.0, 2.0))
    assert sweep.activation_std.shape == (3, 3) and len(sweep.layers) == 3
    assert all(layer.startswith("dot_general") for layer in sweep.layers)
    np.testing.assert_allclose(sweep.activation_std[2] / sweep.activation_std[1], [2.0, 4.0, 8.0], rtol=1e-3)
    np.testing.assert_allclose(sweep.activation_std[0] / sweep.activation_std[1], [0.5, 0.25, 0.125], rtol=1e-3)
    assert np.all(np.isfinite(sweep.gradient_std)) and np.all(sweep.gradient_std > 0)
    assert sweep.loss[2] > sweep.loss[1]  # larger init: over-confident logits, loss above ln 10
    # the gradient at the last layer's output is softmax(logits) - onehot: not scaled like the activations
    assert sweep.gradient_std[0, -1] == pytest.approx(sweep.gradient_std[1, -1], rel=0.5)
    fig = sweep.plot()
    assert isinstance(fig, matplotlib.figure.Figure) and len(fig.axes) == 2
    assert len(fig.axes[0].lines) == 3  # one line per scale
    assert "scale 2" in str(sweep)
    assert fig.axes[1].get_legend() is not None


@pytest.mark.slow
def test_nnx_and_nested_jit_layers_are_found():
    sweep = init_scale_sweep(load("digits_nnx"), _batch(), scales=(1.0, 3.0))
    assert len(sweep.layers) == 3 and sweep.activation_std.shape == (2, 3)
    assert np.all(sweep.activation_std[1] > sweep.activation_std[0])

    @jax.jit
    def dense(w, x):  # a layer behind its own jit: found inside the nested jaxpr
        return jax.nn.relu(x @ w)

    def apply(params, x):
        return dense(params["w2"], dense(params["w1"], x)) @ params["w3"]

    def init(key):
        k1, k2, k3 = jax.random.split(key, 3)
        params = {"w1": jax.random.normal(k1, (64, 16)) / 8, "w2": jax.random.normal(k2, (16, 16)) / 4,
                  "w3": jax.random.normal(k3, (16, 10)) / 4}
        return params, optax.sgd(0.1).init(params)

    exp = jaxsane.Experiment(init=init, step=lambda s, b: s, train=_batch(), apply=apply)
    sweep = init_scale_sweep(exp, scales=(1.0,))
    assert len(sweep.layers) == 3  # apply only: cross-entropy on the integer labels gives the gradients
    assert np.all(np.isfinite(sweep.gradient_std)) and np.isfinite(sweep.loss[0])


def test_scale_leaves_selects_parameters():
    sweep = init_scale_sweep(load("digits_optax"), _batch(), scales=(1.0, 2.0), scale_leaves=r"\[2\]\['w'\]")
    ratio = sweep.activation_std[1] / sweep.activation_std[0]
    np.testing.assert_allclose(ratio, [1.0, 1.0, 2.0], rtol=1e-4)  # only the last kernel was scaled


def test_needs_loss_or_apply():
    exp = jaxsane.Experiment(init=lambda k: {"w": jnp.ones(3)}, step=lambda s, b: s, train={"x": jnp.ones((4, 3))})
    with pytest.raises(jaxsane.ExperimentError, match="loss or Experiment.apply"):
        init_scale_sweep(exp)
