"""Runnable example experiments: three healthy digits classifiers and one with a planted bug.

``jaxsane doctor`` with no argument runs them all; ``load(name)`` returns one Experiment.
"""

import importlib

EXAMPLES = {
    "digits_nnx": "healthy MLP in Flax NNX (nnx.jit step mutating model and optimizer)",
    "digits_linen": "healthy MLP in Flax linen with a TrainState",
    "digits_optax": "healthy MLP in pure JAX + optax",
    "where_nan": "planted bug: jnp.where over sqrt, NaN gradient in the backward pass",
}


def load(name: str):
    """The Experiment of a bundled example (needs scikit-learn for the digits data)."""
    if name not in EXAMPLES:
        raise KeyError(f"[jaxsane] unknown example {name!r}; the examples are {sorted(EXAMPLES)}")
    return importlib.import_module(f"jaxsane.examples.{name}").experiment()
