"""Init-scale sweep: per-layer activation and gradient std at init, vmapped over scale multipliers.

The "layers" are the matrix products of the loss (every ``dot_general`` and ``conv_general_dilated``
the loss function executes, in order, including inside nested ``jit`` and ``scan`` bodies), found by
evaluating its jaxpr with a hook on jaxsane's one interpreter (``_jaxpr/interpret.py``),
so the same code serves linen, NNX and hand-written models. For each layer it measures the std of
its output (the pre-activation) and of the loss gradient with respect to that output (the
back-propagated signal). A good init keeps both roughly constant through depth (Glorot & Bengio
2010; He et al. 2015): growth means exploding, decay means vanishing signals.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from .._core.errors import ArgumentError, ExperimentError
from .._core.frames import display_location, is_cell_file, user_location
from .._core.tree import PyTree, leaf_selector, leaves_with_paths, put_like, scale_selected
from .._core.validate import require_bool, require_sequence
from .._experiment.batches import first_batch, get_inputs, get_labels
from .._experiment.contract import Experiment, PureExperiment, require_experiment
from .._jaxpr.compile_level import QuickJit, quick_jit
from .._jaxpr.interpret import Interpreter
from .._render.plots import legend_outside
from .._render.progress import Progress

_RECORDED = {"dot_general", "conv_general_dilated"}
# ops that only move or cast a parameter: its name flows through them to the matrix product that reads it
_LAYOUT = {
    "convert_element_type",
    "transpose",
    "reshape",
    "squeeze",
    "expand_dims",
    "broadcast_in_dim",
    "copy",
    "copy_p",
    "rev",
    "reduce_precision",
}  # not gather: an embedding lookup's output is an activation
_PARAM_KEYS = re.compile(r"\[['\"]?([^'\"\]]+)['\"]?\]|\.(\w+)")
_TRANSFORMS = re.compile(r"^(?:\w+\()+([^()]*)\)+$")  # vmap(BTNH,BSNH->BNTS) -> BTNH,BSNH->BNTS
_LEAF_NAMES = {"kernel", "weight", "w", "embedding", "scale", "bias", "b"}


def module_path(leaf_path: str) -> str:
    """``params['block_0']['attn']['query']['kernel']`` -> ``block_0/attn/query`` (the module's path)."""
    keys = [a or b for a, b in _PARAM_KEYS.findall(leaf_path)]
    if len(keys) > 1 and keys[-1] in ("value", "raw_value"):  # an NNX Variable's own field
        keys.pop()
    if len(keys) > 1 and keys[-1] in _LEAF_NAMES:
        keys.pop()
    keys = [k for k in keys if k != "params"]
    if all(k.isdigit() for k in keys):  # a list of layers: params[0]
        return "params" + "".join(f"[{k}]" for k in keys) if keys else leaf_path
    return "/".join(keys)


@dataclasses.dataclass(frozen=True, repr=False)
class InitScaleSweep:
    """Per-layer statistics at init, one row per scale (host numpy).

    Attributes:
      scales: the multipliers ``[S]`` applied to the initial parameters.
      layers: a label per recorded layer, in execution order: the primitive, its index, output shape, the
        module path of the parameter it multiplies (or the name-stack scope) and ``file:line``
        (``dot_general 3 f32[32,4,32,32] attn/query (model.py:83)``).
      names: a short label per layer for axes: the module path or scope, else ``file:line``; layers that
        share one are told apart by their output shape.
      activation_std: ``[S, L]`` std of each layer's output on the batch.
      gradient_std: ``[S, L]`` std of d loss / d layer output (NaN when there is no loss).
      loss: ``[S]`` the loss at init (NaN when there is no loss).
    """

    scales: np.ndarray
    layers: tuple[str, ...]
    activation_std: np.ndarray
    gradient_std: np.ndarray
    loss: np.ndarray
    names: tuple[str, ...] = ()

    def table(self) -> str:
        """Plain text: loss and per-layer std for each scale. Host-side, not jit-safe."""
        lines = [f"init-scale sweep over {len(self.layers)} layers"]
        for s, scale in enumerate(self.scales):
            acts = " ".join(f"{v:.3g}" for v in self.activation_std[s])
            grads = " ".join(f"{v:.3g}" for v in self.gradient_std[s])
            lines.append(
                f"scale {scale:g}: loss {self.loss[s]:.4g}\n  activation std: {acts}\n  gradient std:   {grads}"
            )
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()

    def __repr__(self) -> str:
        return f"InitScaleSweep(scales={self.scales.tolist()}, layers={len(self.layers)})"

    def _repr_html_(self) -> str:
        from .._render.reprs import sweep_html

        return sweep_html(self)

    def plot(self):
        """Activation std and gradient std against depth, one line per scale; returns the Figure. Not jit-safe."""
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, 2, figsize=(10, 4.4), layout="constrained")
        depth = np.arange(len(self.layers))
        names = self.names or tuple(str(k) for k in depth)
        cmap = plt.get_cmap("coolwarm")
        for s, scale in enumerate(self.scales):
            colour = "black" if scale == 1 else cmap(s / max(1, len(self.scales) - 1))  # the default: boldest
            label = f"x{scale:g}" + ("" if not np.isfinite(self.loss[s]) else f" (loss {self.loss[s]:.3g})")
            axes[0].plot(depth, self.activation_std[s], marker="o", color=colour, label=label)
            axes[1].plot(depth, self.gradient_std[s], marker="o", color=colour, label=f"x{scale:g}")
        for ax, title in zip(axes, ["activation std (layer output)", "gradient std (d loss / d output)"]):
            ax.set_xlabel("layer (execution order)")
            ax.set_xticks(
                depth,
                [n if len(n) <= 28 else "…" + n[-27:] for n in names],
                rotation=60,
                ha="right",
                fontsize=6 if len(names) > 12 else 7,
            )
            ax.set_title(title, fontsize=10)
            values = self.activation_std if ax is axes[0] else self.gradient_std
            if np.any(np.isfinite(values) & (values > 0)):
                ax.set_yscale("log")
        legend_outside(axes[1], handles=axes[0].get_legend_handles_labels()[0], title="init scale (loss)")
        return fig


def _where(eqn, enclosing=()) -> str:
    """``basename:line`` of the user's code that made this equation (``<cell 3>, line 6`` in a notebook), or ''."""
    where = user_location(eqn, enclosing)
    if not where:
        return ""
    file, line = where.rsplit(":", 1)
    return display_location(file, int(line)) if is_cell_file(file) else f"{os.path.basename(file)}:{line}"


class _Layers(Interpreter):
    """Passes every matrix product's output through ``fn(site, out)`` and records it. Jit-safe.

    A product inside a ``scan`` body is one layer recorded over all time steps ``[time, ...]``;
    products inside a traced ``while`` body or ``cond`` branch are not recorded. Custom-derivative
    calls are bound whole, so that their own rules hold when the sweep differentiates.
    """

    def __init__(self, fn: Callable):
        super().__init__()
        self.fn = fn
        self.params_of: dict = {}  # site -> the parameter leaf path the product reads (from the tags)

    def enters(self, eqn, ectx) -> bool:
        return not eqn.primitive.name.startswith("custom_")

    def after(self, eqn, invals, outs, tags, out_tags, ectx):
        name = eqn.primitive.name
        if name in _RECORDED:
            site = self.site_of(eqn)
            out = self.fn(site, outs[0])
            self.emit(eqn, out)
            self.params_of[site] = next((t for t in reversed(tags) if t is not None), None)  # (x, kernel)
            outs = [out, *outs[1:]]
        elif name in _LAYOUT and tags and tags[0] is not None:  # a parameter's name follows its casts
            out_tags = [tags[0]] * len(outs)
        return outs, out_tags


def _objective(adapted: PureExperiment, params: PyTree, batch: PyTree) -> tuple[Callable, bool]:
    """``(params, batch) -> scalar`` and whether it is a real loss (else the mean output, no gradients)."""
    exp = adapted.experiment
    if adapted.loss_fn is not None:
        return (lambda p, b: jnp.asarray(adapted.loss_fn(p, b), jnp.float32)), True
    if adapted.apply_fn is None:
        raise ExperimentError("init_scale_sweep needs Experiment.loss or Experiment.apply to run the model.")
    apply = adapted.apply_fn
    try:
        labels = get_labels(exp, batch)
        out = jax.eval_shape(apply, params, get_inputs(exp, batch))
        classify = jnp.issubdtype(jnp.asarray(labels).dtype, jnp.integer) and out.ndim == np.ndim(labels) + 1
    except Exception:
        classify = False
    if classify:

        def ce(p, b):
            logp = jax.nn.log_softmax(apply(p, get_inputs(exp, b)).astype(jnp.float32), axis=-1)
            lab = get_labels(exp, b).astype(jnp.int32)
            return -jnp.mean(jnp.take_along_axis(logp, lab[..., None], axis=-1))

        return ce, True
    return (lambda p, b: jnp.mean(jnp.asarray(apply(p, get_inputs(exp, b)), jnp.float32))), False


def init_scale_sweep(
    experiment: Experiment | PureExperiment,
    batch: PyTree | None = None,
    *,
    scales: Sequence[float] = (0.25, 0.5, 1.0, 2.0, 4.0),
    key: jax.Array | None = None,
    scale_leaves: str | Callable[[str], bool] | None = None,
    progress: bool = True,
) -> InitScaleSweep:
    """Per-layer activation and gradient std at init for each scale multiplier, vmapped over scales.

    Args:
      experiment: an :class:`Experiment` (or its :class:`PureExperiment` view) with ``loss`` or ``apply``.
      batch: the batch to measure on (default: the first train batch).
      scales: multipliers applied to the initial parameters (default ``(0.25, 0.5, 1, 2, 4)``).
      key: PRNG key of the init (default ``jax.random.key(0)``).
      scale_leaves: which parameter leaves to scale: None (all float leaves), a regex searched in the
        leaf path (``params['dense_0']['kernel']``) or ``callable(path) -> bool``.
      progress: show progress on stderr (a spinner on a terminal, plain lines otherwise).

    Returns:
      An :class:`InitScaleSweep` with ``activation_std``/``gradient_std`` ``[scales, layers]``,
      ``loss`` ``[scales]`` and ``.plot()``.

    Raises:
      ExperimentError: the Experiment has neither ``loss`` nor ``apply``, or the loss has no matrix product.

    Not jit-safe (compiles one vmapped program). A layer inside a ``scan`` body (an RNN cell) is one
    layer: its activation std is taken over all time steps, its gradient std is that of the gradient
    summed over time steps. Layers inside ``while_loop`` bodies and ``cond`` branches are not seen.

    Example:
      >>> from jaxsane.examples import load
      >>> sweep = init_scale_sweep(load("digits_optax"), scales=(0.5, 1, 2))  # doctest: +SKIP
      >>> fig = sweep.plot()  # doctest: +SKIP
    """
    plan = plan_init_scale_sweep(
        experiment, batch, scales=scales, key=key, scale_leaves=scale_leaves, progress=progress
    )
    return plan.run(progress)


@dataclasses.dataclass(frozen=True)
class ScaleSweepPlan:
    """A planned init-scale sweep: ``compile()`` (safe in a background thread) then ``run()``.

    ``run`` calls the same jitted program, so after ``compile`` it finds the compiled executable in jax's
    cache. Not jit-safe.
    """

    program: QuickJit
    scales_arg: jax.Array
    scales: tuple[float, ...]
    layers: tuple[str, ...]
    names: tuple[str, ...]
    has_loss: bool

    def compile(self) -> None:
        """Compile the vmapped program ahead of :meth:`run` (in another thread, while other work runs)."""
        self.program.lower(self.scales_arg).compile()

    def run(self, progress: bool = False) -> InitScaleSweep:
        """Run the sweep (compiling it unless :meth:`compile` already did) and return its result."""
        with Progress(progress, "init_scale_sweep") as show:
            show.say(f"compiling and running {len(self.scales)} scale(s) x {len(self.layers)} layer(s), vmapped")
            act_std, grad_std, loss = self.program(self.scales_arg)
            act_std = jax.block_until_ready(act_std)
            show.say("done")
        grad_std, loss = np.asarray(grad_std), np.asarray(loss)
        if not self.has_loss:
            grad_std = np.full_like(grad_std, np.nan)
            loss = np.full_like(loss, np.nan)
        return InitScaleSweep(np.asarray(self.scales), self.layers, np.asarray(act_std), grad_std, loss, self.names)


def plan_init_scale_sweep(
    experiment: Experiment | PureExperiment,
    batch: PyTree | None = None,
    *,
    scales: Sequence[float] = (0.25, 0.5, 1.0, 2.0, 4.0),
    key: jax.Array | None = None,
    scale_leaves: str | Callable[[str], bool] | None = None,
    progress: bool = True,
) -> ScaleSweepPlan:
    """:func:`init_scale_sweep` up to its compile: the layers found and the vmapped program, not yet run.
    Same arguments and errors. Not jit-safe (traces the loss)."""
    require_experiment("init_scale_sweep", experiment)
    require_sequence("init_scale_sweep", "scales", scales, min=0.0)
    leaf_selector(scale_leaves)  # None, a regex string or a callable; raises a JaxsaneError otherwise
    require_bool("init_scale_sweep", "progress", progress)
    adapted = experiment if isinstance(experiment, PureExperiment) else PureExperiment(experiment)
    exp = adapted.experiment
    if adapted.loss_fn is None and adapted.apply_fn is None:
        raise ExperimentError("init_scale_sweep needs Experiment.loss or Experiment.apply to run the model.")
    scales_list = [float(s) for s in scales]
    if not scales_list:
        raise ArgumentError("[jaxsane] init_scale_sweep(scales=...) is empty. Fix: pass e.g. scales=(0.1, 1, 10).")
    if batch is None:
        batch = first_batch(exp.train, "train")
    batch = jax.tree_util.tree_map(jnp.asarray, batch)
    state = adapted.init(jax.random.key(0) if key is None else key)
    params = adapted.params(state)
    objective, has_loss = _objective(adapted, params, batch)
    closed = jax.make_jaxpr(objective)(params, batch)
    flat_args = jax.tree_util.tree_leaves((params, batch))

    finder = _Layers(lambda site, out: out)
    n_params = len(jax.tree_util.tree_leaves(params))
    param_tags: list[str | None] = [module_path(p) for p, _ in leaves_with_paths(params, "params")]
    param_tags += [None] * (len(flat_args) - len(param_tags))

    sites: list[tuple] = []  # in the order the program runs them (a dict output would be key-sorted)

    def find(args):
        with finder.collecting() as records:
            finder.run(closed.jaxpr, closed.consts, args, tags=param_tags if len(param_tags) == len(args) else None)
        sites[:] = list(records)
        return list(records.values())

    shapes_found = jax.eval_shape(find, flat_args)
    found = dict(zip(sites, shapes_found))
    if not sites:
        raise ExperimentError(
            "init_scale_sweep found no matrix product (dot_general/conv) in the loss; layers "
            "inside while_loop bodies and cond branches are not measured."
        )
    layers, names = [], []
    for k, site in enumerate(sites):
        eqn, enclosing = finder.sites[site]
        aval = eqn.outvars[0].aval
        where = _where(eqn, enclosing)
        scope = finder.params_of.get(site) or _TRANSFORMS.sub(r"\1", str(eqn.source_info.name_stack))
        scan = " in a scan body" if found[site].ndim > aval.ndim else ""
        layers.append(
            f"{eqn.primitive.name} {k} {aval.str_short()}{scan}"
            + (f" {scope}" if scope else "")
            + (f" ({where})" if where else "")
        )
        names.append(scope or where or f"{eqn.primitive.name} {k}")
    shapes = [finder.sites[s][0].outvars[0].aval.str_short(short_dtypes=True) for s in sites]
    names = [f"{n} {sh}" if names.count(n) > 1 else n for n, sh in zip(names, shapes)]
    names = [f"{n} #{k}" if names.count(n) > 1 else n for k, n in enumerate(names)]
    slot = {site: k for k, site in enumerate(sites)}
    shapes = [jax.ShapeDtypeStruct(finder.sites[s][0].outvars[0].aval.shape, found[s].dtype) for s in sites]
    select = leaf_selector(scale_leaves)
    batch_leaves = flat_args[n_params:]

    def stats(scale):
        scaled = scale_selected(params, scale, select)
        args = [*jax.tree_util.tree_leaves(scaled), *batch_leaves]

        def f(eps):
            def perturb(site, out):  # the same eps at every time step of a scan body
                return out + eps[slot[site]].astype(out.dtype) if site in slot else out

            layer = _Layers(perturb)
            with layer.collecting() as records:
                (value,), _ = layer.run(closed.jaxpr, closed.consts, args)
            return jnp.asarray(value, jnp.float32), [records[s] for s in sites]

        eps = [jnp.zeros(s.shape, s.dtype) for s in shapes]
        (value, acts), grads = jax.value_and_grad(f, has_aux=True)(eps)
        act_std = jnp.stack([jnp.std(a.astype(jnp.float32)) for a in acts])
        grad_std = jnp.stack([jnp.std(g.astype(jnp.float32)) for g in grads])
        return act_std, grad_std, value

    return ScaleSweepPlan(
        quick_jit(jax.vmap(stats)),
        put_like(np.asarray(scales_list, np.float32), flat_args),
        tuple(scales_list),
        tuple(layers),
        tuple(names),
        has_loss,
    )
