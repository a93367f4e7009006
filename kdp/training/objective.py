"""The noisy training objective of a DP model (Clipless DP-SGD, Béthune et al. 2024).

``Σ_i w_i ℓ_i / b + Σ_v ⟨v − stop_gradient(v), ξ_v⟩``:

* ``Σ_i w_i ℓ_i / b``: per-example losses summed and divided by the **expected**
  batch size ``b`` (never the realised size, which is private under Poisson
  sampling; padding rows have ``w_i = 0``);
* the second term is exactly 0 in value but its gradient with respect to ``v``
  is ``ξ_v``, a fresh Gaussian draw of std ``σ c_v Δ_v / b`` ("per-layer") or
  ``σ √(Σ_v Δ_v²) / b`` ("global"), ``Δ_v`` the per-example gradient bound of
  the bound pass (Béthune et al. 2024, Alg. 1–2). It is built with a custom
  gradient (`_zero_with_gradient`): its value is 0 without computing the
  products, and ξ is drawn once for all the variables of one dtype.

So Keras' own ``train_step`` computes the noisy gradient in one ordinary
backward pass on every backend. The noise term is built only inside the privacy
gate (`PrivacyGate.require_open`): a step that is not recorded cannot be traced.
"""

import math

import keras
from keras import ops

from kdp import accounting, clipping, distribute
from kdp.bounds import bound_sqrt, compute_gradient_bounds


def noise_coefficients(model):
    """``{variable.path: c_v}``: the public per-layer noise coefficients."""
    coefs = {}
    for layer in model._flatten_layers(include_self=False):
        for v in layer.trainable_weights:
            coefs[v.path] = float(getattr(layer, "nm_coef", 1.0))
    return coefs


def noise_stds(model):
    """``{variable.path: std}`` of the Gaussian noise added to the batch gradient."""
    params = model.dp_parameters
    if params.clipping_norm is not None:
        return clipping.noise_stds(model)  # σ·C/b
    bounds = compute_gradient_bounds(model)
    sigma, b = params.noise_multiplier, model.dataset_metadata.batch_size
    if params.noisify_strategy == "global":
        total = bound_sqrt(sum(d * d for d in bounds.values()))  # a tensor after a clip
        return {p: sigma * total / b for p in bounds}
    coefs = noise_coefficients(model)
    return {p: sigma * coefs.get(p, 1.0) * d / b for p, d in bounds.items()}


def effective_noise_multiplier(model):
    """``σ_eff``: the noise multiplier of the one Gaussian a step is equivalent to
    (``(Σ_v (σ c_v)^-2)^(-1/2)`` for per-layer noise)."""
    params = model.dp_parameters
    if params.noisify_strategy == "global" or params.clipping_norm is not None:
        return params.noise_multiplier
    coefs = noise_coefficients(model)
    return accounting.effective_noise_multiplier(
        params.noise_multiplier * coefs.get(v.path, 1.0) for v in model.trainable_variables)


def noise_term(model, seed_generator):
    """A scalar of value 0 whose gradient with respect to each trainable variable
    ``v`` is ``ξ_v``, a fresh Gaussian draw of std ``noise_stds(model)[v.path]``.

    The standard normals of all the variables of one dtype are one draw, sliced
    per variable: a draw per variable puts one copy of the generator (hash
    rounds, inverse error function) per variable in the compiled step; on the
    benchmark MLP (three kernels, JAX) compiling it then took 36 MB more
    resident memory. The value 0 is not computed from ξ (`_zero_with_gradient`)."""
    stds = noise_stds(model)
    by_dtype = {}
    for v in model.trainable_variables:
        by_dtype.setdefault(v.value.dtype, []).append(v)
    values, noises = [], []
    for dtype, variables in by_dtype.items():
        sizes = [math.prod(v.shape) for v in variables]
        draw = keras.random.normal((sum(sizes),), dtype=dtype, seed=seed_generator)
        offset = 0
        for v, size in zip(variables, sizes):
            values.append(v.value)
            noises.append(ops.reshape(draw[offset:offset + size], v.shape) * stds[v.path])
            offset += size
    term = _zero_with_gradient(*values, *noises)
    # Data-parallel: one calibrated draw per global step (kdp/distribute.py).
    return term * ops.cast(distribute.noise_share(), term.dtype)


@ops.custom_gradient
def _zero_with_gradient(*args):
    """``0``, with gradient ``ξ_i`` for ``v_i`` and none for ``ξ_i``; ``args`` are
    ``v_1 … v_n, ξ_1 … ξ_n``.

    The value of ``Σ_i ⟨v_i − stop_gradient(v_i), ξ_i⟩`` is 0 too, but a compiler
    computes its products: XLA evaluated the Gaussian transform of ξ a second time
    for them (2–3 % of a step of the benchmark MLP on 2 CPU cores, JAX)."""
    noises = args[len(args) // 2:]

    def gradient(*upstream_args, upstream=None):
        if upstream is None:
            (upstream,) = upstream_args
        return (tuple(ops.cast(upstream, xi.dtype) * xi for xi in noises)
                + tuple(ops.zeros_like(xi) for xi in noises))

    return ops.zeros(()), gradient


def objective(model, x, y, y_pred, sample_weight, training, seed_generator):
    """The training objective (noisy when ``training``; the gate must be open).

    Outside training (`evaluate`, ``val_loss``, `test_on_batch`) the loss means
    what it means in Keras: the weighted per-example losses averaged over the
    batch's rows (``sum_over_batch_size``), plus the regularization losses."""
    values = model.loss.call(y, y_pred)
    if sample_weight is not None:
        values = values * ops.reshape(ops.cast(sample_weight, values.dtype), ops.shape(values))
    if not training:
        rows = ops.cast(ops.shape(values)[0], values.dtype)
        total = ops.sum(values) / ops.maximum(rows, 1.0)
        return total + ops.sum(model.losses) if model.losses else total
    b = model.dataset_metadata.batch_size
    if model.dp_parameters.clipping_norm is not None:
        total = clipping.clipped_objective(model, x, y, values, sample_weight)  # grad: ḡ/b
    else:
        total = ops.sum(values) / b
    if model.losses:
        total = total + ops.sum(model.losses) * ops.cast(distribute.noise_share(), total.dtype)
    model.privacy_gate.require_open()
    return total + noise_term(model, seed_generator)
