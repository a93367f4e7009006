"""Feature clipping and bias augmentation (Kirschte et al. 2022, §3.3).

``clip(x) = x · min(1, c/‖x‖)`` bounds every feature vector by ``c``; the
learners then see ``[1, clip(x)]``, whose norm is at most ``√(c² + 1)``
(:func:`kdp.helmet.constants.augmented_bound`), the constant used in L, β, s.
"""

import keras
from keras import ops


def clip_by_l2_norm(x, c):
    """Rows of ``x`` (``(..., p)``) rescaled to L2 norm at most ``c``."""
    x = ops.convert_to_tensor(x)
    norms = ops.sqrt(ops.sum(ops.square(x), axis=-1, keepdims=True))
    return x * ops.minimum(1.0, c / ops.maximum(norms, 1e-30))


def augment(x, fit_intercept=True):
    """``[1, x]`` along the last axis (the bias coordinate first), or ``x``."""
    x = ops.convert_to_tensor(x)
    if not fit_intercept:
        return x
    return ops.concatenate([ops.ones_like(x[..., :1]), x], axis=-1)


@keras.saving.register_keras_serializable(package="kdp")
class FeatureClip(keras.layers.Layer):
    """Clips each input vector to L2 norm ``c`` (the preprocessing a DP-Helmet head assumes).

    Args:
        c: the clipping bound.
    Input/output shape: ``(batch, p)``.
    """

    def __init__(self, c, **kwargs):
        super().__init__(**kwargs)
        if not c > 0:
            raise ValueError(f"c must be > 0, got {c}")
        self.c = float(c)

    def call(self, inputs):
        return clip_by_l2_norm(inputs, self.c)

    def compute_output_shape(self, input_shape):
        return input_shape

    def get_config(self):
        return {**super().get_config(), "c": self.c}
