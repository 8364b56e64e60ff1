"""The findings of :func:`jaxsane.check_grads`: one builder per outcome (missing gradient, non-finite loss,
gradient or neighbourhood, leaves sampled, a wrong derivative). Host-side only, not jit-safe.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .._core.finding import Finding


def leaf_list(items: list[tuple[str, float]], limit: int = 4) -> str:
    names = ", ".join(f"{p} ({v})" for p, v in items[:limit])
    return names + (f" and {len(items) - limit} more" if len(items) > limit else "")


def nonfinite_loss_finding(v0: np.ndarray, n: int) -> Finding:
    value = float(v0.ravel()[~np.isfinite(v0.ravel())][0])
    return Finding(
        "nonfinite.forward",
        f"the function is already {value} at the gradient check point, so none of the {n} leaves' gradients "
        "could be compared with finite differences (the gradient check was skipped)",
        "a NaN/Inf is born in the forward pass: run jaxsane.locate on the loss (or a guarded step) to get the "
        "line; check the labels and the data first (out-of-range labels, NaN inputs, an all-padding mask), "
        "then log(0), exp overflow and divisions by zero; the gradient check runs once the loss is finite",
        extra={"loss": value, "leaves": n, "stage": "grads"},
    )


def nonfinite_gradient_finding(items: list[tuple[str, float]], loss: float) -> Finding:
    return Finding(
        "nonfinite.backward",
        f"the autodiff gradient is non-finite for {len(items)} leaf(s) while the function is finite at the point "
        f"({loss:.6g}): {leaf_list(items)} (directional derivatives); a NaN gradient is not a wrong "
        "derivative rule, so these leaves were not compared with finite differences",
        "a NaN/Inf is born in the backward pass: run jaxsane.locate on the step (or a guarded run) to get the "
        "line; the usual cause is jnp.where over sqrt/log/arccos (use the double-where fix), or norm/std at 0",
        path=items[0][0],
        extra={"autodiff": items[0][1], "leaves": [p for p, _ in items], "loss": loss},
    )


def nonfinite_nearby_finding(items: list[tuple[str, float]], loss: float, eps: float) -> Finding:
    return Finding(
        "nonfinite.forward",
        f"the function is finite at the point ({loss:.6g}) but goes non-finite within a finite-difference step "
        f"(eps={eps:g}) along {len(items)} leaf(s): {leaf_list(items)}; the parameters sit at the edge of a "
        "domain (sqrt/log of ~0, a division by ~0), so these leaves were not compared",
        "run jaxsane.locate on the loss to get the line; keep the argument of sqrt/log/division away from 0 "
        "(add an epsilon, clip, or use the double-where fix)",
        path=items[0][0],
        extra={"finite_diff": items[0][1], "leaves": [p for p, _ in items], "loss": loss},
    )


def missing_finding(path: str, fd: float, depends: bool, leaf: Any, kink: bool = False) -> Finding:
    if kink:
        message = (
            f"{path} ({leaf.dtype}{list(leaf.shape)}) gets an identically zero gradient: the output changes "
            f"with it only across a kink at this point (finite-difference directional derivative {fd:.4g}, "
            "unequal one-sided slopes), where autodiff's one-sided derivative is 0"
        )
        hint = (
            "its units sit exactly on a ReLU/abs/max kink (zero weights or zero inputs through a zero bias), so "
            "training cannot move this leaf until something else moves them off it; initialise the layer's "
            "weights randomly (a zero-initialised ReLU layer stays dead)"
        )
    elif depends:
        message = (
            f"{path} ({leaf.dtype}{list(leaf.shape)}) gets an identically zero gradient, yet the output "
            f"changes with it (finite-difference directional derivative {fd:.4g})"
        )
        hint = (
            "something on its path blocks the gradient: a jax.lax.stop_gradient on this layer, a custom_vjp "
            "returning zeros for it, or an integer cast; remove the stop_gradient (or freeze the leaf on "
            "purpose with optax.set_to_zero / multi_transform)"
        )
    else:
        message = (
            f"{path} ({leaf.dtype}{list(leaf.shape)}) gets an identically zero gradient and the output "
            "does not depend on it on this batch"
        )
        hint = (
            "the parameter is unused (a layer built but never called, a dead branch, a typo in the forward "
            "pass) or all its units are dead on this batch; wire it in or delete it"
        )
    return Finding(
        "grad.missing",
        message,
        hint,
        path=path,
        extra={"finite_diff": fd, "depends": depends, **({"kink": True} if kink else {})},
    )


def zeroed_here_finding(leaves: list[tuple[str, Any]]) -> Finding:
    """The info that ``leaves`` (path, value) get an identically zero gradient at this point though the output
    reads them: a layer after them starts at zero (a zero-initialised head, LoRA's B, a residual branch's last
    layer), so they move once that layer does. Not ``grad.missing``'s error: the parameters are used, and nothing
    is wrong with their rules."""
    path, leaf = leaves[0]
    more = f" and {len(leaves) - 1} more leaves" if len(leaves) > 1 else ""
    return Finding(
        "grad.missing",
        f"{path} ({leaf.dtype}{list(leaf.shape)}){more} get an identically zero gradient at this point, though the "
        "output reads them: what they compute is multiplied by zero further on (a layer after them initialised to "
        "zero, such as a zero-initialised classifier head or LoRA's B matrix), so they start moving once that "
        "layer does",
        "nothing to do when a later layer starts at zero on purpose; otherwise look for units that are all off "
        "on this batch or a mask that zeroes their path",
        severity="info",
        path=path,
        extra={"finite_diff": 0.0, "depends": False, "zeroed_downstream": [p for p, _ in leaves]},
    )


def sampled_finding(checked: int, total: int, seed: int) -> Finding:
    return Finding(
        "grad.sampled",
        f"gradients checked on {checked} of {total} float leaves, drawn at random (seed {seed}): finite "
        "differences cost two evaluations of the function per leaf, so big models are sampled",
        "pass check_grads(max_leaves=None) (doctor: -o grads_max_leaves=0) to check every leaf, or another seed to "
        "check other leaves",
        severity="info",
        extra={"checked": checked, "leaves": total, "seed": seed},
    )


def mismatch_finding(
    path: str,
    ad: float,
    fd: float,
    *,
    forward: float | None,
    where: str,
    atol: float,
    rtol: float,
    eps: float,
    compute: str,
    order: int,
    modes: tuple[str, ...],
    failure: str,
    kink: dict,
) -> Finding:
    """``grad.mismatch``: autodiff ``ad`` against finite differences ``fd`` along the leaf's direction (or a
    sub-direction of it, ``where``); ``forward`` is the forward-mode value when it is shown; ``compute`` is the
    name of the dtype the function computes in."""
    rel = abs(ad - fd) / max(abs(ad), abs(fd), 1e-30)
    fwd_note = f", forward mode {forward:.6g}" if forward is not None else ""
    return Finding(
        "grad.mismatch",
        f"{path}: autodiff directional derivative {ad:.6g}{fwd_note} vs finite differences {fd:.6g}{where} "
        f"(relative error {rel:.2e}; tolerance atol={atol:g}, rtol={rtol:g}, eps={eps:g}, computed in "
        f"{compute}, order {order}, modes {'/'.join(modes)})",
        "a hand-written derivative on the path from this leaf to the loss is wrong: check every "
        "jax.custom_vjp/custom_jvp rule it flows through (sign, a missing factor of the cotangent g, the "
        "residuals saved in fwd); leaves that check clean sit downstream of the bug",
        path=path,
        extra={
            "autodiff": ad,
            "finite_diff": fd,
            "relative_error": rel,
            "atol": atol,
            "rtol": rtol,
            "eps": eps,
            "compute_dtype": compute,
            "modes": list(modes),
            "jax_message": failure[:2000],
            **({"kink": kink} if kink else {}),
        },
    )


def stopped_gradient_finding(leaves: list[tuple[str, float, float, tuple[str, ...]]]) -> Finding:
    """The one ``grad.mismatch`` warning of the leaves (path, autodiff, finite differences, stop_gradient lines)
    whose value flows into a ``lax.stop_gradient``: autodiff takes it as a constant there while finite differences
    see it move, so the two differ by design (a straight-through estimator, a commitment loss, a target network),
    unless the stop is the bug (a router, an encoder cut off from its loss)."""
    path, ad, fd, stops = leaves[0]
    where = sorted({w for *_, s in leaves for w in s})
    more = f" and {len(leaves) - 1} more leaves" if len(leaves) > 1 else ""
    return Finding(
        "grad.mismatch",
        f"{path}{more}: autodiff and finite differences differ (autodiff {ad:.6g} vs {fd:.6g} on the first) where "
        f"their values flow into lax.stop_gradient ({', '.join(where)}): there autodiff takes the value as a "
        "constant and finite differences see it move, so the gradient is not the function's derivative by design "
        "(a straight-through estimator, a commitment loss, a target network)",
        "nothing to do where the stop_gradient is meant; if the gradient should flow through it (a router, an "
        "encoder or a layer cut off from its loss), remove it",
        severity="warning",
        path=path,
        extra={"stop_gradient": where, "leaves": [p for p, *_ in leaves], "autodiff": ad, "finite_diff": fd},
    )
