"""Supervised DP losses with honest per-example Lipschitz constants.

Every ``get_L()`` bounds ``‖∂ℓ_i/∂ŷ_i‖₂`` for **one example with fixed weights**,
whatever the rest of the batch (Béthune et al. 2024, §3). Derivations are in each docstring;
the constants are checked numerically in ``tests/test_losses.py``.
"""

import math

from keras import ops

from kdp.losses.base import DPLoss, class_weights, one_hot_labels, serializable


@serializable
class DP_TauCategoricalCrossentropy(DPLoss):
    """``ℓ(ŷ, y) = CE(softmax(τ ŷ), y) / τ = (logsumexp(τ ŷ) − τ ⟨y, ŷ⟩) / τ``.

    τ multiplies the logits and the loss is rescaled by ``1/τ`` (deel-lip's
    parametrization), so ``∇_ŷ ℓ = softmax(τ ŷ) − y`` and for ``y`` any probability
    vector ``‖p − y‖² = ‖p‖² + ‖y‖² − 2⟨p, y⟩ ≤ 2``: **L = √2**, for every τ.
    Approached (tight) when the softmax mass sits on a wrong class.

    Labels: integer ids, one-hot or probability vectors; vector entries are
    clipped to [0, 1] (a ±1 one-vs-all encoding reads as one-hot).

    Args:
        tau: temperature ``τ > 0`` (large τ: closer to a hard max).
    """

    labels = "distribution"

    def __init__(self, tau=1.0, name="tau_categorical_crossentropy", **kwargs):
        super().__init__(name=name, **kwargs)
        if not tau > 0:
            raise ValueError(f"tau must be > 0, got {tau}")
        self.tau = float(tau)

    def call(self, y_true, y_pred):
        y = ops.clip(one_hot_labels(y_true, y_pred), 0.0, 1.0)
        z = self.tau * y_pred
        return (ops.logsumexp(z, axis=-1) - ops.sum(y * z, axis=-1)) / self.tau

    def get_L(self):
        return math.sqrt(2.0)

    def get_config(self):
        return {**super().get_config(), "tau": self.tau}


@serializable
class DP_TauBCE(DPLoss):
    """Binary τ-cross-entropy, mean over the ``m`` outputs, labels in {0, 1}.

    ``ℓ = mean_k [softplus(τ ŷ_k) − τ y_k ŷ_k] / τ``, so
    ``∂ℓ/∂ŷ_k = (sigmoid(τ ŷ_k) − y_k)/m`` with ``|·| < 1/m``: ``‖∇‖ < 1/√m``.
    **L = 1**, tight for one output (a confident wrong prediction).

    Labels are clipped to [0, 1] first: soft labels are kept, ``−1`` (deel-lip's
    {−1, +1} convention) reads as 0, and ``|∂ℓ/∂ŷ_k| < 1/m`` holds for any input
    (a raw ``y = −1`` would give ``sigmoid + 1``, up to 2).

    Args:
        tau: temperature ``τ > 0``.
    """

    def __init__(self, tau=1.0, name="tau_bce", **kwargs):
        super().__init__(name=name, **kwargs)
        if not tau > 0:
            raise ValueError(f"tau must be > 0, got {tau}")
        self.tau = float(tau)

    def call(self, y_true, y_pred):
        y = ops.reshape(ops.cast(y_true, y_pred.dtype), ops.shape(y_pred))
        y = ops.clip(y, 0.0, 1.0)
        z = self.tau * y_pred
        return ops.mean(ops.softplus(z) - y * z, axis=-1) / self.tau

    def get_L(self):
        return 1.0

    def get_config(self):
        return {**super().get_config(), "tau": self.tau}


@serializable
class DP_MulticlassHinge(DPLoss):
    """One-vs-all hinge with fixed class weights, ``K ≥ 2`` outputs.

    With ``s_k = +1`` for the true class and ``−1`` otherwise and the weights of
    `class_weights` (``w_y = c/2``, ``w_k = c/(2(K−1))``, ``c = 2√((K−1)/K)``):
    ``ℓ = Σ_k w_k · max(0, m/2 − s_k ŷ_k)``. The gradient has entries ``−s_k w_k``
    on the active terms, so ``‖∇‖² ≤ w_y² + (K−1) w_k² = 1``: **L = 1**, attained
    whenever every margin is violated (e.g. ŷ = 0).

    Labels: integer ids or one-hot vectors, one true class per example (vector
    entries are clipped to [0, 1], so a ±1 encoding reads as one-hot); the same
    holds for `DP_MulticlassKR` and `DP_MulticlassHKR`.

    Args:
        min_margin: the margin ``m > 0``.
    """

    labels = "one-hot"

    def __init__(self, min_margin=1.0, name="multiclass_hinge", **kwargs):
        super().__init__(name=name, **kwargs)
        if not min_margin > 0:
            raise ValueError(f"min_margin must be > 0, got {min_margin}")
        self.min_margin = float(min_margin)

    def call(self, y_true, y_pred):
        weights, signs = _signed_weights(y_true, y_pred)
        return ops.sum(weights * ops.relu(self.min_margin / 2 - signs * y_pred), axis=-1)

    def get_L(self):
        return 1.0

    def get_config(self):
        return {**super().get_config(), "min_margin": self.min_margin}


@serializable
class DP_MulticlassKR(DPLoss):
    """Per-example multiclass Kantorovich–Rubinstein loss, ``K ≥ 2`` outputs.

    ``ℓ = −Σ_k w_k s_k ŷ_k = −c (ŷ_y/2 − Σ_{k≠y} ŷ_k / (2(K−1)))`` with the fixed
    weights of `DP_MulticlassHinge`. Its gradient is constant with norm exactly
    1: **L = 1**, tight for every input.

    Relation to the literature: deel-lip's MulticlassKR weights each example by
    ``b/n_c`` (``n_c`` the in-batch count of its class, ``b − n_k`` for the other
    classes), which estimates ``E[ŷ_k | y = k] − E[ŷ_k | y ≠ k]`` but gives one
    example the gradient entries ``b/(K n_y)`` and ``−b/(K (b − n_k))``: its norm
    depends on the batch (≈ 14 for one example of a rare class among 100 with
    K = 10; ``√(K/(K−1)) > 1`` even on an exactly balanced batch) and the
    examples are coupled. Here each example's weight is fixed; on an exactly
    balanced batch the two agree per example up to the factor ``c/2``.
    """

    labels = "one-hot"

    def __init__(self, name="multiclass_kr", **kwargs):
        super().__init__(name=name, **kwargs)

    def call(self, y_true, y_pred):
        weights, signs = _signed_weights(y_true, y_pred)
        return -ops.sum(weights * signs * y_pred, axis=-1)

    def get_L(self):
        return 1.0


@serializable
class DP_MulticlassHKR(DPLoss):
    """``ℓ = α · hinge_m + KR`` (both per-example, as above).

    By the triangle inequality **L = 1 + α**; tight: at ŷ = 0 every hinge term
    is active and its gradient points the same way as KR's.

    Args:
        alpha: weight ``α ≥ 0`` of the hinge term.
        min_margin: the margin ``m > 0``.
    """

    labels = "one-hot"

    def __init__(self, alpha=10.0, min_margin=1.0, name="multiclass_hkr", **kwargs):
        super().__init__(name=name, **kwargs)
        if not alpha >= 0:
            raise ValueError(f"alpha must be >= 0, got {alpha}")
        self.alpha = float(alpha)
        self.hinge = DP_MulticlassHinge(min_margin)
        self.kr = DP_MulticlassKR()

    def call(self, y_true, y_pred):
        return self.alpha * self.hinge.call(y_true, y_pred) + self.kr.call(y_true, y_pred)

    def get_L(self):
        return 1.0 + self.alpha

    def get_config(self):
        return {**super().get_config(), "alpha": self.alpha, "min_margin": self.hinge.min_margin}


@serializable
class DP_KCosineSimilarity(DPLoss):
    """``ℓ = −⟨ŷ / max(‖ŷ‖, K), y / ‖y‖⟩``: cosine similarity with a norm floor K.

    For ``‖ŷ‖ ≤ K`` the map is linear with gradient ``−u/K`` (``u = y/‖y‖``); above,
    its Jacobian ``(I − ŷŷᵀ/‖ŷ‖²)/‖ŷ‖`` has norm ``1/‖ŷ‖ < 1/K``: **L = 1/K**, tight
    inside the ball (Béthune et al. 2024, Table 4, with ``K = K·X_min`` there).

    Args:
        K: the norm floor ``K > 0``.
        axis: lip-dp's; only ``-1`` (the classes are the last axis).
    """

    def __init__(self, K=1.0, axis=-1, name="k_cosine_similarity", **kwargs):
        super().__init__(name=name, **kwargs)
        if not K > 0:
            raise ValueError(f"K must be > 0, got {K}")
        if axis != -1:
            raise ValueError(f"axis must be -1 (the classes are the last axis), got {axis!r}")
        self.K = float(K)

    def call(self, y_true, y_pred):
        y = one_hot_labels(y_true, y_pred)
        y = y / ops.maximum(ops.norm(y, axis=-1, keepdims=True), 1e-12)
        # max(‖ŷ‖, K) as √max(‖ŷ‖², K²): same value, but no 0/0 in the gradient
        # of ‖ŷ‖ at ŷ = 0 (jax's norm gives NaN there).
        squared = ops.sum(ops.square(y_pred), axis=-1, keepdims=True)
        scale = ops.sqrt(ops.maximum(squared, self.K ** 2))
        return -ops.sum(y * y_pred / scale, axis=-1)

    def get_L(self):
        return 1.0 / self.K

    def get_config(self):
        return {**super().get_config(), "K": self.K}


@serializable
class DP_MeanAbsoluteError(DPLoss):
    """``ℓ = mean_k |ŷ_k − y_k|`` over ``K`` outputs (integer labels are one-hot encoded).

    ``‖∇‖ = ‖sign(ŷ − y)‖/K ≤ 1/√K``: **L = 1**, tight for one output (regression);
    ``1/√K`` would do for ``K`` outputs but ``K`` is not known in advance.
    """

    def __init__(self, name="mean_absolute_error", **kwargs):
        super().__init__(name=name, **kwargs)

    def call(self, y_true, y_pred):
        if y_pred.shape[-1] == 1:
            y = ops.reshape(ops.cast(y_true, y_pred.dtype), ops.shape(y_pred))
        else:
            y = one_hot_labels(y_true, y_pred)
        return ops.mean(ops.abs(y_pred - y), axis=-1)

    def get_L(self):
        return 1.0


def _signed_weights(y_true, y_pred):
    # clipped to [0, 1]: a ±1 one-vs-all encoding reads as one-hot
    y = ops.clip(one_hot_labels(y_true, y_pred), 0.0, 1.0)
    w_true, w_other = class_weights(y_pred.shape[-1])
    weights = w_other + (w_true - w_other) * y
    return weights, 2.0 * y - 1.0
