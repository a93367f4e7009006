"""Base class of kdp losses: per-example values and a per-example Lipschitz constant."""

import keras
from keras import ops

from kdp.layers.base import serializable


class DPLoss(keras.losses.Loss):
    """A Keras loss whose ``call`` returns one value per example and whose
    ``get_L()`` bounds ``‖∂ℓ_i/∂ŷ_i‖₂`` for every example, labels and logits,
    with weights fixed in advance (never computed from the batch).

    The reduction only matters outside kdp's training step: `DP_Model` always
    sums ``sample_weight · call(y, ŷ)`` and divides by the expected batch size.

    Attributes:
        labels: what ``get_L()`` assumes of the labels, checked on the data
            before training (`kdp.training.validation`): ``"any"``,
            ``"distribution"`` (entries in [0, 1] summing to at most 1) or
            ``"one-hot"`` (exactly one true class per example).
    """

    labels = "any"

    def get_L(self):
        raise TypeError(f"{type(self).__name__} must define get_L()")


def one_hot_labels(y_true, y_pred):
    """Labels as float vectors like ``y_pred``: one-hot or integer class ids."""
    classes = y_pred.shape[-1]
    if len(y_true.shape) == len(y_pred.shape) and y_true.shape[-1] == classes and classes > 1:
        return ops.cast(y_true, y_pred.dtype)
    ids = ops.reshape(ops.cast(y_true, "int32"), (-1,))
    return ops.one_hot(ids, classes, dtype=y_pred.dtype)


def class_weights(classes):
    """Fixed one-vs-all weights: ``½`` on the true class, ``½/(K−1)`` on each other,
    times ``c = 2√((K−1)/K)`` so that ``‖(−w_y, w_k…)‖₂ = 1`` exactly.

    Returns ``(w_true, w_other)``.
    """
    if classes < 2:
        raise ValueError("multiclass losses need at least 2 outputs")
    c = 2.0 * ((classes - 1) / classes) ** 0.5
    return 0.5 * c, 0.5 * c / (classes - 1)


__all__ = ["DPLoss", "one_hot_labels", "class_weights", "serializable"]
