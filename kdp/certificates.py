"""Certified L2 robustness of Lipschitz classifiers.

If ``f`` is ``ℓ``-Lipschitz in L2 (input -> logits), each logit difference
``f_c − f_j`` is ``ℓ·√2``-Lipschitz (``‖e_c − e_j‖₂ = √2``), so the prediction
``c = argmax f(x)`` cannot change under any perturbation ``‖δ‖₂ < r(x)`` with

    ``r(x) = (f_c(x) − max_{j≠c} f_j(x)) / (ℓ·√2)``

(Tsuzuku et al. 2018; Béthune et al. 2024, §A.3). For a model with a single
output (a binary logit thresholded at 0) the radius is ``|f(x)| / ℓ``.

``ℓ`` comes from the bound pass, `kdp.bounds.lipschitz_constant` (``1`` for a
stack of kdp orthogonal layers and 1-Lipschitz activations). The certificate is
deterministic: it costs no privacy and holds for the released model.
"""

import math

import keras
import numpy as np
from keras import ops

from kdp.bounds import lipschitz_constant


def _radii_from_logits(logits, lipschitz):
    """Certified radius of each row of ``logits`` for an ``ℓ``-Lipschitz model."""
    if not lipschitz > 0:
        raise ValueError(f"lipschitz must be > 0, got {lipschitz}")
    if logits.shape[-1] == 1:
        return ops.abs(logits[:, 0]) / lipschitz
    top2 = ops.top_k(logits, 2, sorted=True)[0]
    return (top2[:, 0] - top2[:, 1]) / (lipschitz * math.sqrt(2.0))


def _predictions(logits):
    if logits.shape[-1] == 1:
        return ops.cast(logits[:, 0] > 0, "int32")
    return ops.cast(ops.argmax(logits, axis=-1), "int32")


def _labels(y_true, logits):
    """Integer class ids from integer labels or one-hot (or soft) label vectors."""
    y_true = ops.convert_to_tensor(y_true)
    classes = logits.shape[-1]
    if classes > 1 and len(y_true.shape) == 2 and y_true.shape[-1] == classes:
        return ops.cast(ops.argmax(y_true, axis=-1), "int32")
    return ops.cast(ops.reshape(y_true, (-1,)), "int32")


def _certified(y_true, logits, radius, lipschitz):
    """1.0 where the prediction is correct and certified beyond ``radius``."""
    correct = ops.equal(_predictions(logits), _labels(y_true, logits))
    if radius > 0:
        correct = ops.logical_and(correct, _radii_from_logits(logits, lipschitz) > radius)
    return ops.cast(correct, logits.dtype)


def _logits(model, x, batch_size):
    outs = []
    for start in range(0, len(x), batch_size):
        out = model(ops.convert_to_tensor(x[start:start + batch_size]), training=False)
        outs.append(ops.cast(out, "float32"))
    return ops.concatenate(outs, axis=0) if len(outs) > 1 else outs[0]


def _resolve_lipschitz(model, lipschitz):
    if lipschitz is None:
        lipschitz = float(lipschitz_constant(model))
    if not lipschitz > 0:
        raise ValueError(f"lipschitz must be > 0, got {lipschitz}")
    return float(lipschitz)


def certified_radius(model, x, lipschitz=None, batch_size=1024):
    """Per-example certified L2 radius ``margin / (ℓ·√2)``.

    Args:
        model: a classifier returning logits; a kdp model when ``lipschitz`` is None.
        x: inputs, an array of shape ``(n, ...)``.
        lipschitz: the L2 Lipschitz constant ``ℓ`` of ``model``; defaults to
            `kdp.bounds.lipschitz_constant(model)` (the bound pass).
        batch_size: examples per forward pass.

    Returns:
        A numpy array of shape ``(n,)``: no perturbation of L2 norm below
        ``radius[i]`` changes the prediction on ``x[i]`` (margin = top logit minus
        runner-up; ``|logit|/ℓ`` for a single-output model).
    """
    lipschitz = _resolve_lipschitz(model, lipschitz)
    logits = _logits(model, np.asarray(x), batch_size)
    return ops.convert_to_numpy(_radii_from_logits(logits, lipschitz))


def certified_accuracy(model, x, y, radius, lipschitz=None, batch_size=1024):
    """Fraction of examples classified correctly with a certified radius > ``radius``.

    At ``radius = 0`` this is the clean accuracy. ``y``: integer labels, or
    one-hot vectors. Other arguments as in `certified_radius`.
    """
    lipschitz = _resolve_lipschitz(model, lipschitz)
    logits = _logits(model, np.asarray(x), batch_size)
    return float(ops.convert_to_numpy(ops.mean(_certified(y, logits, float(radius), lipschitz))))


@keras.saving.register_keras_serializable(package="kdp")
class CertifiedAccuracy(keras.metrics.Mean):
    """Keras metric: certified accuracy at L2 radius ``radius``.

    An example counts when the prediction is correct and its certified radius
    ``margin / (ℓ·√2)`` exceeds ``radius`` (see `certified_radius`).

    Args:
        radius: the L2 radius ``r ≥ 0`` (``0``: plain accuracy).
        lipschitz: the model's L2 Lipschitz constant ``ℓ``; a metric does not see
            the model, so pass ``kdp.lipschitz_constant(model)`` (``1`` for a stack
            of kdp orthogonal layers and 1-Lipschitz activations).
        name: metric name.
    """

    def __init__(self, radius, lipschitz=1.0, name="certified_accuracy", dtype=None):
        super().__init__(name=name, dtype=dtype)
        if not radius >= 0:
            raise ValueError(f"radius must be >= 0, got {radius}")
        if not lipschitz > 0:
            raise ValueError(f"lipschitz must be > 0, got {lipschitz}")
        self.radius = float(radius)
        self.lipschitz = float(lipschitz)

    def update_state(self, y_true, y_pred, sample_weight=None):
        y_pred = ops.cast(ops.convert_to_tensor(y_pred), "float32")
        values = _certified(y_true, y_pred, self.radius, self.lipschitz)
        return super().update_state(values, sample_weight=sample_weight)

    def get_config(self):
        return {**super().get_config(), "radius": self.radius, "lipschitz": self.lipschitz}


__all__ = ["CertifiedAccuracy", "certified_accuracy", "certified_radius"]
