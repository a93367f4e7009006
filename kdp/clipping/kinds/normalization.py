"""`keras.layers.LayerNormalization` and `keras.layers.RMSNormalization`: the
normalised input ``x̂`` is recorded and the output ``y = x̂·γ + β`` probed;
example ``i``'s gradients ``Σ x̂_i ⊙ G_i`` and ``Σ G_i`` (over the axes that
are not normalised) are of the size of ``γ``, so they are materialised."""

import keras
from keras import ops

from kdp.clipping.kinds.base import Kind, add_up, reduce_to, register


def _broadcast(v, x, axis):
    """``v`` (a parameter over the normalised ``axis``) reshaped to broadcast onto
    ``x``, as `keras.ops.layer_normalization` does."""
    shape = [1] * len(x.shape)
    for dim in axis:
        shape[dim] = x.shape[dim]
    return ops.reshape(ops.cast(v, x.dtype), shape)


@register
class LayerNormalizationKind(Kind):
    layer_type = keras.layers.LayerNormalization

    def call(self, layer, record):
        def call(inputs):
            x = ops.layer_normalization(inputs, None, None, layer.axis, layer.epsilon,
                                        rms_scaling=layer.rms_scaling)
            x = ops.cast(x, keras.backend.result_type(x.dtype, "float32"))  # as keras computes it
            z = x
            if layer.gamma is not None:
                z = z * _broadcast(layer.gamma, x, layer.axis)
            if layer.beta is not None:
                z = z + _broadcast(layer.beta, x, layer.axis)
            return ops.cast(record(x, z), layer.compute_dtype)

        return call

    def gradients(self, layer, calls):
        out = {}
        if layer.gamma is not None:
            out[layer.gamma.path] = add_up(calls, lambda x, g: _param_grad(x * g, layer.axis, layer.gamma.shape))
        if layer.beta is not None:
            out[layer.beta.path] = add_up(calls, lambda _, g: _param_grad(g, layer.axis, layer.beta.shape))
        return out


def _param_grad(t, axis, shape):
    """``t (B, *input)`` summed over the axes not in ``axis``, ``(B, *shape)``."""
    rank = len(t.shape) - 1
    kept = {dim % rank for dim in axis}
    full = [t.shape[1 + k] if k in kept else 1 for k in range(rank)]
    return ops.reshape(reduce_to(t, full), (-1, *shape))


@register
class RMSNormalizationKind(Kind):
    layer_type = getattr(keras.layers, "RMSNormalization", None)

    def call(self, layer, record):
        def call(x):
            normed = ops.rms_normalization(x, None, layer.axis, layer.epsilon)
            return record(normed, normed * layer.scale)

        return call

    def gradients(self, layer, calls):
        return {layer.scale.path: add_up(calls, lambda x, g: reduce_to(x * g, layer.scale.shape))}
