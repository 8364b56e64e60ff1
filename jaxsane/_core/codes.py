"""The finding codes: every stable code with its default severity, what it means and its typical causes.

Codes are public API (the docs' finding-code reference is generated from :data:`CODES`): a code never
changes meaning once released. Host-side data, no jax.
"""

from __future__ import annotations

ERROR, WARNING, INFO = "error", "warning", "info"
SEVERITY_RANK = {ERROR: 0, WARNING: 1, INFO: 2}

# code -> (default severity, what it means, typical causes)
CODES: dict[str, tuple[str, str, str]] = {
    "nonfinite.input": (ERROR, "the batch itself holds NaN/Inf", "corrupt data, bad preprocessing"),
    "nonfinite.forward": (
        ERROR,
        "loss/outputs go non-finite in the forward pass",
        "log(0), log(softmax(x)), exp overflow, 0/0 in a masked mean, fp16 overflow",
    ),
    "nonfinite.backward": (
        ERROR,
        "forward is finite, gradients are not",
        "jnp.where over sqrt/log/arccos (double-where trap), norm or std at 0, custom_vjp returning inf",
    ),
    "nonfinite.update": (
        ERROR,
        "gradients finite, optimizer update or new state is not",
        "fp16 Adam eps underflow, learning rate blow-up, division in a hand-written optimizer",
    ),
    "nonfinite.literal": (
        ERROR,
        "a NaN/Inf constant written in the program reaches the outputs without being computed on",
        "a cond/switch branch or a jitted function returning jnp.nan/jnp.inf, a custom_vjp backward rule returning "
        "a NaN constant, a 'no value' sentinel never replaced",
    ),
    "nonfinite.latent": (
        WARNING,
        "the compiled gradient is finite, but evaluated operation by operation (eager mode, jax.debug_nans, "
        "another backend or fusion) it is NaN/Inf",
        "jnp.where over log/sqrt/division whose untaken branch has an infinite derivative (double-where trap)",
    ),
    "grad.mismatch": (
        ERROR,
        "autodiff gradient disagrees with finite differences",
        "wrong custom_vjp/custom_jvp rule, wrong sign, missing cotangent factor (a warning where the gap is a "
        "lax.stop_gradient's: a straight-through estimator, a target network)",
    ),
    "grad.missing": (
        ERROR,
        "a trainable float leaf gets an identically zero gradient",
        "lax.stop_gradient, unused parameter, dead branch, non-float leaf",
    ),
    "grad.kink": (
        INFO,
        "leaves the gradient check could not judge: the point is a kink along the probed direction",
        "ReLU/abs/clip/max exactly at 0 or at a tie: zero padding or zero-feature rows through a zero bias",
    ),
    "grad.sampled": (
        INFO,
        "the gradient check ran on a random sample of the float leaves (a big model)",
        "more float leaves than check_grads(max_leaves=128); pass max_leaves=None to check all",
    ),
    "step.no_update": (
        ERROR,
        "parameters are bitwise unchanged after a step",
        "returning the old state, update not applied, learning rate 0",
    ),
    "step.opt_state_frozen": (
        ERROR,
        "optimizer state is bitwise unchanged across steps",
        "returning the initial optimizer state each step",
    ),
    "step.stats_frozen": (
        ERROR,
        "the step computes new values of a state collection (BatchNorm statistics, an EMA) and returns the old",
        "the mutable collection from model.apply(..., mutable=[...]) not put back into the returned state",
    ),
    "step.rng_reused": (
        WARNING,
        "the step draws the same randomness every call",
        "dropout key never split or advanced",
    ),
    "step.recompiles": (
        WARNING,
        "the step is traced/compiled again on later calls",
        "Python scalars as static args, changing shapes or dtypes",
    ),
    "init.loss": (
        WARNING,
        "initial loss far from chance level (ln C for C classes), or, for a loss that is not a "
        "C-way cross-entropy, far above the best constant prediction's loss on the batch",
        "over-confident logits, wrong init scale, outputs at another scale than the targets, wrong loss",
    ),
    "init.scale": (
        WARNING,
        "activation scale grows or shrinks sharply through depth at init",
        "weights too large/small for the activation",
    ),
    "init.symmetric": (
        ERROR,
        "units in a layer are identical at init, so they can never differ",
        "constant or zero initialisation",
    ),
    "overfit.failed": (ERROR, "no tried configuration fits one small batch", "bug in the model, loss, labels or step"),
    "model.ignores_input": (
        ERROR,
        "real inputs fit no better than constant inputs",
        "input not wired in, stale global used as input",
    ),
    "batch.cross_talk": (
        ERROR,
        "an example's output depends on another example's input (in eval mode)",
        "softmax/mean over the batch axis, wrong reshape/transpose",
    ),
    "data.label_range": (ERROR, "labels outside [0, num_classes)", "off-by-one labels, wrong num_classes"),
    "data.shape": (
        ERROR,
        "shapes/dtypes inconsistent, or a shape that silently broadcasts",
        "(B, 1) predictions against (B,) targets",
    ),
    "data.leakage": (
        ERROR,
        "evaluation examples also appear in the training split",
        "split done after duplication, copied test rows",
    ),
    "data.duplicates": (WARNING, "many duplicate examples inside one split", "repeated shards, oversampling by copy"),
    "data.imbalance": (WARNING, "class frequencies extremely skewed", "sampling bug, wrong labels"),
    "data.all_padding": (ERROR, "examples whose mask is all padding", "empty sequences, tokenizer or packing bug"),
    "data.unnormalized": (WARNING, "input scale far from unit", "raw 0..255 pixels, unscaled features"),
    "data.constant": (
        WARNING,
        "an input feature or the whole input is constant",
        "a preprocessing step that zeroes the input, a broken loader",
    ),
    "data.empty": (
        ERROR,
        "a split (or a batch of it) has zero examples",
        "a filter that drops every row, an empty shard",
    ),
    "data.masked_nonfinite": (INFO, "NaN/Inf in the data that the loss masks (the loss at init is finite on it)", "-"),
    "data.partial": (INFO, "only a prefix of an endless or very long stream was checked", "-"),
    "data.outliers": (
        WARNING,
        "rows whose scale is orders of magnitude beyond the rest",
        "unit or scaling errors, sentinel values such as -9999, corrupt records",
    ),
    "data.unshifted_targets": (
        ERROR,
        "next-token targets equal the inputs, or the inputs shifted the wrong way",
        "labels not shifted (targets = tokens), shift applied in the wrong direction",
    ),
    "data.epoch": (INFO, "a stream starts over after k examples: read as one epoch, not as duplicates", "-"),
    "seq.future_leakage": (
        ERROR,
        "in a causal model (declared, or trained by teacher forcing), the output at position t depends on inputs "
        "after t",
        "missing causal mask, mask on the wrong axis (triu for tril, transposed), bidirectional layer",
    ),
    "seq.padding_in_loss": (
        ERROR,
        "the loss depends on positions (or, with a per-example mask, examples) the mask marks as padding",
        "a plain mean over all positions or slots, the mask not applied to the loss, pads as targets",
    ),
    "train.diverging": (ERROR, "loss rising without bound", "learning rate too high, gradient ascent"),
    "train.exploding_grads": (
        WARNING,
        "gradient norm grows by orders of magnitude",
        "bad init, no clipping, lr too high",
    ),
    "train.vanishing_grads": (
        WARNING,
        "early layers' gradients vanish relative to late ones",
        "saturating activations, depth without normalisation",
    ),
    "train.dead_units": (WARNING, "most ReLU units are never active", "large negative bias, lr too high"),
    "train.plateau": (WARNING, "loss flat from the start", "lr too low, frozen parameters"),
    "train.oscillating": (WARNING, "loss oscillates without trend", "lr too high"),
    "train.overfitting": (
        WARNING,
        "eval loss rises while train loss falls",
        "too little data, leakage, mislabeled eval",
    ),
    "train.update_ratio": (
        WARNING,
        "update/parameter norm ratio outside a sane band",
        "learning rate too high or too low",
    ),
    "train.update_underflow": (
        WARNING,
        "a low-precision parameter does not move although its update is non-zero: the update rounds away",
        "pure bf16/fp16 weights with a small learning rate (bf16 keeps 8 bits: an update below ~2^-8 of the "
        "weight is lost); fix with float32 master weights, stochastic rounding or a larger learning rate",
    ),
    "train.loss_spike": (
        WARNING,
        "the loss jumped far above its recent robust level (recent median + k robust sigmas) for a step",
        "a few corrupt or extreme examples in a batch, Adam's second moment lagging a sudden gradient "
        "(eps/beta2 too small), a learning rate too high for the current curvature",
    ),
    "precision.lost": (
        WARNING,
        "an equation computed in low precision (bf16/fp16) differs from its float32 reference by far more "
        "than the dtype's rounding",
        "a long sum/mean accumulated in bf16, softmax/logsumexp/variance in bf16, 1 - p or log(1 + x) cancellation",
    ),
    "precision.overflow": (
        ERROR,
        "an fp16/bf16 value overflows to inf (or flushes to zero) where its float32 reference is finite",
        "fp16 activations or gradients above 65504 without loss scaling, exp of a large logit in fp16",
    ),
    "dist.replica_divergence": (
        ERROR,
        "values that should be replicated differ across devices or processes",
        "per-host seeds, missing gradient all-reduce",
    ),
    "dist.nonfinite_shard": (
        ERROR,
        "non-finite values confined to some devices/processes",
        "one host's data shard, one device's overflow",
    ),
    "dist.hang": (
        ERROR,
        "a process stopped entering the step; the others wait for it in a collective",
        "a data loader that blocks, a host that died, a branch only some processes take",
    ),
    "doctor.user_code_crashed": (
        ERROR,
        "the user's own code (init, step, loss, apply, data) raised, so doctor could not check it",
        "a bug in the raising function, shown with its file:line",
    ),
    "doctor.step_output": (
        ERROR,
        "the step returns no usable new state (e.g. only metrics), so it cannot train",
        "returning only the loss or metrics, returning a differently structured state",
    ),
    # info codes: context for the user, never a failure.
    "overfit.unsettled": (
        WARNING,
        "no configuration fits the batch yet, but the loss is still falling or settled where it cannot be judged",
        "too few steps, a dominating regulariser, a too-small model",
    ),
    "overfit.floor": (INFO, "the overfit loss converged to a floor above 0", "-"),
    "overfit.best": (INFO, "the best configuration of the overfit sweep", "-"),
    "overfit.no_lr_sweep": (INFO, "learning rates were not swept (optimizer lacks inject_hyperparams)", "-"),
    "overfit.update_scaled": (
        INFO,
        "the step's own rate fit nothing; the sweep scaled its parameter updates as larger rates",
        "-",
    ),
    "overfit.budget": (
        INFO,
        "the sweep ran fewer configurations than usual (the model is too large for them), or stopped at its time "
        "limit before any fit (then it is not judged)",
        "-",
    ),
    "doctor.skipped": (INFO, "a doctor stage was skipped because a handle it needs is missing", "-"),
    "nonfinite.xla_only": (INFO, "a non-finite value appears only in the compiled (XLA) program", "-"),
}


def severity_of(code: str) -> str:
    """The default severity of a finding code."""
    try:
        return CODES[code][0]
    except KeyError:
        raise KeyError(f"[jaxsane] unknown finding code {code!r}; known codes are in jaxsane.CODES") from None
