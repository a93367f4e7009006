"""L2-norm pooling: 1-Lipschitz, norm non-increasing (`DPNormNonIncreasingLayer`)."""

import keras
from keras import ops

from kdp.layers.base import DPNormNonIncreasingLayer, serializable

# sqrt(s + EPS) - sqrt(EPS) is smooth at 0, never exceeds sqrt(s), and its
# gradient x / sqrt(|x|² + EPS) has norm < 1: the eps cannot break the bounds.
_EPS = 1e-12


def _safe_norm_from_squares(s):
    return ops.sqrt(s + _EPS) - ops.sqrt(_EPS)


@serializable
class DP_ScaledL2NormPooling2D(DPNormNonIncreasingLayer, keras.layers.Layer):
    """Non-overlapping pooling of ``(batch, H, W, C)`` inputs by the L2 norm of each window.

    ``y[i, j, c] = ‖x[window(i, j), c]‖₂``. Windows are disjoint (stride = pool
    size), so ``‖y‖ ≤ ‖x‖`` and the map is 1-Lipschitz (``|‖a‖−‖b‖| ≤ ‖a−b‖`` per
    window). Incomplete border windows are dropped ('valid').

    Args:
        pool_size: int or pair.
    """

    def __init__(self, pool_size=2, **kwargs):
        strides = kwargs.pop("strides", None)
        if strides is not None and strides != pool_size:
            raise ValueError("DP_ScaledL2NormPooling2D needs strides == pool_size (disjoint windows)")
        super().__init__(**kwargs)
        self.pool_size = (pool_size, pool_size) if isinstance(pool_size, int) else tuple(pool_size)

    def call(self, inputs):
        area = self.pool_size[0] * self.pool_size[1]
        pooled = ops.average_pool(
            ops.square(inputs), self.pool_size, strides=self.pool_size, padding="valid"
        )
        return _safe_norm_from_squares(pooled * area)

    def compute_output_shape(self, input_shape):
        b, h, w, c = input_shape
        ph, pw = self.pool_size
        return (b, None if h is None else h // ph, None if w is None else w // pw, c)

    def get_config(self):
        return {**super().get_config(), "pool_size": self.pool_size}


@serializable
class DP_ScaledGlobalL2NormPooling2D(DPNormNonIncreasingLayer, keras.layers.Layer):
    """``(batch, H, W, C) -> (batch, C)``: the L2 norm of each channel over space.

    ``Σ_c y_c² = ‖x‖²``: norm preserving and 1-Lipschitz.
    """

    def call(self, inputs):
        return _safe_norm_from_squares(ops.sum(ops.square(inputs), axis=(1, 2)))

    def compute_output_shape(self, input_shape):
        return (input_shape[0], input_shape[-1])
