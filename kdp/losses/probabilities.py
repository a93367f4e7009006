"""Probabilities from a classifier's outputs, by the link of the loss it was trained with.

A loss that is a negative log-likelihood defines the model's probabilities:
τ-cross-entropy ``softmax(τ·z)``, τ-binary cross-entropy ``sigmoid(τ·z)`` (the
probability of label 1 of each output), Keras' cross-entropies with
``from_logits=True`` ``softmax(z)`` / ``sigmoid(z)`` (and ``z`` itself without
logits). Margin losses (hinge, KR, HKR, cosine) define no probability: refused.
"""

import keras
import numpy as np


def _softmax(z):
    z = z - z.max(axis=-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=-1, keepdims=True)


def sigmoid(z):
    """The logistic function of a NumPy array, without overflow."""
    return np.exp(-np.logaddexp(0.0, -z))


def link(loss):
    """``(name, scale)`` of ``loss``'s link: ``("softmax", τ)``, ``("sigmoid", τ)``
    (the scale is 1 for Keras' cross-entropies from logits) or ``("identity", 1)``
    (Keras' cross-entropies on probabilities).

    Raises:
        TypeError: the loss is not a likelihood (no probability is defined).
    """
    from kdp.losses.supervised import DP_TauBCE, DP_TauCategoricalCrossentropy

    if isinstance(loss, DP_TauCategoricalCrossentropy):
        return "softmax", float(loss.tau)
    if isinstance(loss, DP_TauBCE):
        return "sigmoid", float(loss.tau)
    categorical = (keras.losses.CategoricalCrossentropy, keras.losses.SparseCategoricalCrossentropy)
    if isinstance(loss, categorical + (keras.losses.BinaryCrossentropy,)):
        if not loss.get_config().get("from_logits", False):
            return "identity", 1.0
        return ("softmax" if isinstance(loss, categorical) else "sigmoid"), 1.0
    raise TypeError(
        f"{type(loss).__name__} is not a negative log-likelihood, so it defines no "
        "probability: train with a τ-cross-entropy (DP_TauCategoricalCrossentropy, "
        "DP_TauBCE) or a Keras cross-entropy to use predict_proba")


def output_probabilities(loss, outputs):
    """``outputs`` (NumPy, the model's predictions) mapped to probabilities by ``loss``'s link.

    Args:
        loss: the model's loss object.
        outputs: array ``(rows, outputs)``.

    Returns:
        float64 array of the same shape: class probabilities (rows sum to 1) for
        categorical losses, the probability of label 1 per output for binary ones.

    Raises:
        TypeError: the loss is not a likelihood (no probability is defined).
    """
    name, scale = link(loss)
    z = scale * np.asarray(outputs, "float64")
    return {"softmax": _softmax, "sigmoid": sigmoid, "identity": lambda v: v}[name](z)
