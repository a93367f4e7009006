"""Per-example clipping of the loss cotangent (the "hybrid" approach, §3.1)."""

import contextlib

import keras
from keras import ops

from kdp.layers.base import DPLayer, per_example_norm, serializable


@serializable
class DP_ClipGradient(DPLayer, keras.layers.Layer):
    """Identity forward; backward, clips each example's cotangent to ``clip_value``.

    ``clip_value`` is in **per-example** units (the norm of ``∂ℓ_i/∂y_i``). The
    cotangent that reaches the layer is that of the training objective
    ``Σ_i w_i ℓ_i / b``, so the rows are clipped at ``clip_value · cotangent_scale``;
    `DP_Model` sets ``cotangent_scale = 1/b`` (b the expected batch size). The
    bound pass uses ``G_in = min(G, clip_value)`` (fixing lip-dp's unit mix-up).

    Args:
        clip_value: the per-example threshold ``C > 0``.
    """

    def __init__(self, clip_value, **kwargs):
        super().__init__(**kwargs)
        if not clip_value > 0:
            raise ValueError(f"clip_value must be > 0, got {clip_value}")
        self.clip_value = float(clip_value)
        self.cotangent_scale = 1.0

    def call(self, inputs):
        threshold = self.clip_value * self.cotangent_scale

        @ops.custom_gradient
        def clip_backward(x):
            def grad(*args, upstream=None):
                if upstream is None:
                    (upstream,) = args
                norms = per_example_norm(upstream)
                scale = ops.minimum(1.0, threshold / ops.maximum(norms, 1e-30))
                return upstream * ops.reshape(scale, (-1,) + (1,) * (len(upstream.shape) - 1))

            return ops.copy(x), grad

        return clip_backward(inputs)

    def backpropagate_inputs(self, input_bound, gradient_bound):
        return min(gradient_bound, self.clip_value)

    def get_config(self):
        return {**super().get_config(), "clip_value": self.clip_value}


@contextlib.contextmanager
def per_example_units(model):
    """Temporarily clip at ``clip_value`` itself (``cotangent_scale = 1``) in every
    `DP_ClipGradient` of ``model``: for per-example gradients of unreduced losses."""
    clips = [l for l in model._flatten_layers(include_self=False) if isinstance(l, DP_ClipGradient)]
    saved = [l.cotangent_scale for l in clips]
    for layer in clips:
        layer.cotangent_scale = 1.0
    try:
        yield
    finally:
        for layer, scale in zip(clips, saved):
            layer.cotangent_scale = scale
