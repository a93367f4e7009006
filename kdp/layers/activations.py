"""1-Lipschitz, zero-preserving activations (`DPNormNonIncreasingLayer`: X and G unchanged)."""

import keras
from keras import ops

from kdp.layers.base import DPNormNonIncreasingLayer, serializable


@serializable
class DP_GroupSort(DPNormNonIncreasingLayer, keras.layers.Layer):
    """Sorts the last axis within consecutive groups of ``group_size`` channels.

    A permutation of each example's coordinates: norm preserving and gradient
    norm preserving (Anil et al. 2019). ``group_size=2`` is "MaxMin" (deel-lip's
    ``n=`` keyword is refused).
    """

    def __init__(self, group_size=2, **kwargs):
        if "n" in kwargs:
            raise TypeError(f"DP_GroupSort: deel-lip's n={kwargs['n']!r} is kdp's "
                            f"group_size={kwargs['n']!r}")
        super().__init__(**kwargs)
        self.group_size = int(group_size)

    def build(self, input_shape):
        if input_shape[-1] % self.group_size:
            raise ValueError(
                f"{self.name}: the last axis ({input_shape[-1]}) must be a multiple "
                f"of group_size={self.group_size}"
            )

    def call(self, inputs):
        shape = ops.shape(inputs)
        if self.group_size == 2:
            # One comparison picks both outputs, so even at ties (a == b) the
            # Jacobian is a permutation; minimum/maximum would each route the
            # whole cotangent to the same input on TensorFlow (norm up to √2).
            a, b = inputs[..., 0::2], inputs[..., 1::2]
            swap = a > b
            pairs = ops.stack([ops.where(swap, b, a), ops.where(swap, a, b)], axis=-1)
            return ops.reshape(pairs, shape)
        grouped = ops.reshape(inputs, tuple(shape[:-1]) + (-1, self.group_size))
        return ops.reshape(ops.sort(grouped, axis=-1), shape)

    def get_config(self):
        return {**super().get_config(), "group_size": self.group_size}


@serializable
class DP_ReLU(DPNormNonIncreasingLayer, keras.layers.Layer):
    """ReLU: 1-Lipschitz and ``‖relu(x)‖ ≤ ‖x‖`` (not gradient-norm preserving)."""

    def call(self, inputs):
        return ops.relu(inputs)
