"""A bias with a norm constraint, so its effect on the bounds is known."""

import math

import keras

from kdp.layers.base import DPLayer, serializable
from kdp.layers.constraints import BallProjection


@serializable
class DP_AddBias(DPLayer, keras.layers.Layer):
    """``y = x + b`` with ``‖b‖₂ ≤ norm_max``, ``b`` of shape ``(C,)`` on the last axis.

    The bias is projected onto the ball after each update (exact, 1-Lipschitz).
    With ``m`` positions it is broadcast over (``m = H·W`` for images, 1 for
    vectors): ``‖y‖ ≤ X + √m·norm_max``; ``G_in = G``; ``‖∂ℓ/∂b‖ = ‖Σ_pos g‖ ≤ √m·G``.

    Args:
        norm_max: radius of the bias ball.
        nm_coef: per-layer noise coefficient.
    """

    def __init__(self, norm_max=1.0, nm_coef=1.0, **kwargs):
        super().__init__(**kwargs)
        if not norm_max > 0:
            raise ValueError(f"norm_max must be > 0, got {norm_max}")
        self.norm_max = float(norm_max)
        self.nm_coef = float(nm_coef)

    def build(self, input_shape):
        self.positions = math.prod(input_shape[1:-1])
        self.bias = self.add_weight(
            name="bias", shape=(input_shape[-1],), initializer="zeros",
            constraint=BallProjection(self.norm_max),
        )

    def call(self, inputs):
        return inputs + self.bias

    def propagate_inputs(self, input_bound):
        return input_bound + math.sqrt(self.positions) * self.norm_max

    def backpropagate_inputs(self, input_bound, gradient_bound):
        return gradient_bound  # the Jacobian in x is the identity

    def backpropagate_params(self, input_bound, gradient_bound):
        return {self.bias.path: math.sqrt(self.positions) * gradient_bound}

    def get_config(self):
        return {**super().get_config(), "norm_max": self.norm_max, "nm_coef": self.nm_coef}
