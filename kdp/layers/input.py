"""Per-example input clipping: the source of the input bound X₀."""

import keras
from keras import ops

from kdp.layers.base import DPLayer, per_example_norm, serializable


@serializable
class DP_BoundedInput(DPLayer, keras.layers.Layer):
    """Projects each example onto the L2 ball of radius ``upper_bound``.

    ``x ↦ x · min(1, C/‖x‖)`` over all non-batch axes: a projection onto a convex
    set, hence 1-Lipschitz, and ``‖output‖ ≤ C`` (Béthune et al. 2024,
    Requirement 2). Put it first so the bound pass knows the input norm bound;
    it is data independent and costs no privacy.

    Args:
        input_shape: shape of one example (lets it start a `DP_Sequential`).
        upper_bound: the clipping radius ``C > 0``.
        enforce_clipping: lip-dp's; only ``True`` (inputs are always clipped).
    """

    def __init__(self, input_shape=None, upper_bound=1.0, enforce_clipping=True, **kwargs):
        if not enforce_clipping:
            raise ValueError(
                "DP_BoundedInput always clips (enforce_clipping=True): for inputs bounded "
                "beforehand, start with keras.Input(shape) and pass "
                "DatasetMetadata(max_norm=...); fit refuses inputs above max_norm")
        super().__init__(**kwargs)
        self.example_shape = None if input_shape is None else tuple(int(d) for d in input_shape)
        # Lets a `keras.Sequential` start with this layer (without Keras' warning).
        self._input_shape_arg = self.example_shape
        if not upper_bound > 0:
            raise ValueError(f"upper_bound must be > 0, got {upper_bound}")
        self.upper_bound = float(upper_bound)

    def call(self, inputs):
        norms = per_example_norm(inputs)
        scale = ops.minimum(1.0, self.upper_bound / ops.maximum(norms, 1e-12))
        return inputs * ops.reshape(scale, (-1,) + (1,) * (len(inputs.shape) - 1))

    def propagate_inputs(self, input_bound):
        if input_bound is None:
            return self.upper_bound
        return min(self.upper_bound, input_bound)

    def backpropagate_inputs(self, input_bound, gradient_bound):
        return gradient_bound  # a projection onto a convex set is 1-Lipschitz

    def backpropagate_params(self, input_bound, gradient_bound):
        return {}

    def get_config(self):
        return {**super().get_config(), "input_shape": self.example_shape,
                "upper_bound": self.upper_bound}
