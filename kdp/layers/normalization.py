"""Per-example group normalisation: fixed features of a known norm."""

import math

import keras
from keras import ops

from kdp.layers.base import DPLayer, serializable


@serializable
class DP_GroupNormalization(DPLayer, keras.layers.Layer):
    """Normalises each example's groups of channels to mean 0 and variance 1.

    Channels-last ``(batch, ..., C)``: the ``C`` channels are split into
    ``groups`` consecutive groups; each example's values in a group (all its
    positions and the group's channels, ``m`` values) become
    ``u / sqrt(‖u‖²/m + epsilon)`` with ``u`` their deviation from their own
    mean. No trainable scale or shift, nothing shared across examples (unlike
    BatchNormalization), so it is data independent and costs no privacy.
    Tramèr and Boneh (2021, §3) normalise scattering features this way before a
    private linear model.

    Bounds (per example, ``n`` values in all):

    * ``X_out = √n`` whatever the input: a group's output has squared norm
      ``‖u‖² / (‖u‖²/m + ε) < m``;
    * ``G_in = G / √ε``: the Jacobian of ``u ↦ u / sqrt(‖u‖²/m + ε)`` has
      eigenvalues ``1/s`` and ``ε/s³`` (``s`` the denominator, ``≥ √ε``) and
      centring is a projection. The layer is not Lipschitz in any useful sense,
      so put it before every trainable layer, where only ``X_out`` matters.

    Args:
        groups: the number of channel groups (a divisor of ``C``); ``None``: one
            group per channel.
        epsilon: ``ε > 0`` added to the variance.
    """

    def __init__(self, groups=None, epsilon=1e-5, **kwargs):
        kwargs["trainable"] = False
        super().__init__(**kwargs)
        if groups is not None and int(groups) < 1:
            raise ValueError(f"groups must be None or >= 1, got {groups}")
        if not epsilon > 0:
            raise ValueError(f"epsilon must be > 0, got {epsilon}")
        self.groups = None if groups is None else int(groups)
        self.epsilon = float(epsilon)

    def build(self, input_shape):
        if len(input_shape) < 2 or any(d is None for d in input_shape[1:]):
            raise ValueError(f"{self.name}: needs a known shape (batch, ..., C), got {input_shape}")
        channels = int(input_shape[-1])
        groups = channels if self.groups is None else self.groups
        if channels % groups:
            raise ValueError(f"{self.name}: groups={groups} does not divide the {channels} channels")
        self.nb_groups = groups
        self.nb_values = math.prod(int(d) for d in input_shape[1:])

    def call(self, inputs):
        shape = ops.shape(inputs)
        x = ops.reshape(inputs, (shape[0], -1, self.nb_groups, inputs.shape[-1] // self.nb_groups))
        u = x - ops.mean(x, axis=(1, 3), keepdims=True)
        y = u / ops.sqrt(ops.mean(ops.square(u), axis=(1, 3), keepdims=True) + self.epsilon)
        return ops.reshape(y, shape)

    def compute_output_shape(self, input_shape):
        return input_shape

    def propagate_inputs(self, input_bound):
        return math.sqrt(self.nb_values)

    def backpropagate_inputs(self, input_bound, gradient_bound):
        return gradient_bound / math.sqrt(self.epsilon)

    def backpropagate_params(self, input_bound, gradient_bound):
        return {}

    def get_config(self):
        return {**super().get_config(), "groups": self.groups, "epsilon": self.epsilon}
