"""Per-example input clipping: the source of the input bound X₀."""

import keras
import numpy as np
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


@serializable
class DP_BoxInput(DPLayer, keras.layers.Layer):
    """Clamps each input to a declared box and moves it by the box's centre.

    ``x ↦ clip(x, low, high) − (low + high)/2``, coordinate by coordinate, for
    inputs whose every value has a public range (a table's columns mapped to
    [0, 1]). The box is public, so the offset costs no privacy; a clamp onto a
    box is a projection onto a convex set and a shift is an isometry, so the
    map is 1-Lipschitz, and ``‖output‖ ≤ ‖(high − low)/2‖`` (the box's half
    diagonal) for every input, inside the box or not. Centring matters for
    utility, not for privacy: rows of uncentred columns share the box's corner
    direction, which dominates every example's gradient, and the norm bound
    of the centred box is up to half the uncentred one.

    Args:
        low, high: the box's bounds, scalars or one value per input coordinate
            (broadcast to the example's shape), ``low < high`` everywhere.
        refuse_outside: ``False`` (default): a value outside the box is clamped
            (a declared range, like a clip). ``True``: the box is an assumption
            to check, and training data with a value outside it is refused by
            `kdp.training.validation` before anything is spent (`kdp.recipes`
            sets it when it reads ``max_norm = √d`` as columns in [0, 1]); the
            layer still clamps at prediction time.
        input_shape: the shape of one example (lets it start a `DP_Sequential`).
    """

    def __init__(self, low=0.0, high=1.0, refuse_outside=False, input_shape=None, **kwargs):
        super().__init__(**kwargs)
        self.refuse_outside = bool(refuse_outside)
        self.example_shape = None if input_shape is None else tuple(int(d) for d in input_shape)
        self._input_shape_arg = self.example_shape
        low_array, high_array = (np.asarray(v, dtype="float64") for v in (low, high))
        if not (np.all(np.isfinite(low_array)) and np.all(np.isfinite(high_array))):
            raise ValueError("DP_BoxInput: low and high must be finite")
        try:
            low_array, high_array = np.broadcast_arrays(low_array, high_array)
        except ValueError as error:
            raise ValueError(f"DP_BoxInput: low and high do not broadcast: {error}") from None
        if not np.all(low_array < high_array):
            raise ValueError("DP_BoxInput: low < high is required for every coordinate")
        self.low, self.high = low_array.tolist(), high_array.tolist()
        self._low, self._high = low_array, high_array

    def build(self, input_shape):
        example = tuple(input_shape[1:])
        try:
            np.broadcast_to(self._low, example)
        except ValueError:
            raise ValueError(f"DP_BoxInput: a box of shape {self._low.shape} does not fit "
                             f"examples of shape {example}") from None
        self.half_diagonal = float(np.linalg.norm(
            np.broadcast_to((self._high - self._low) / 2.0, example)))
        self.centre_norm = float(np.linalg.norm(
            np.broadcast_to((self._high + self._low) / 2.0, example)))
        #: the largest norm of an input inside the box (before the shift)
        self.box_norm = float(np.linalg.norm(
            np.broadcast_to(np.maximum(np.abs(self._low), np.abs(self._high)), example)))

    def call(self, inputs):
        low = ops.cast(self._low, inputs.dtype)
        high = ops.cast(self._high, inputs.dtype)
        return ops.clip(inputs, low, high) - (low + high) / 2.0

    def propagate_inputs(self, input_bound):
        if input_bound is None:
            return self.half_diagonal
        return min(self.half_diagonal, input_bound + self.centre_norm)

    def backpropagate_inputs(self, input_bound, gradient_bound):
        return gradient_bound  # a clamp onto a box then a shift: 1-Lipschitz

    def backpropagate_params(self, input_bound, gradient_bound):
        return {}

    def get_config(self):
        return {**super().get_config(), "low": self.low, "high": self.high,
                "refuse_outside": self.refuse_outside, "input_shape": self.example_shape}
