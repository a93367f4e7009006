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
    bound pass uses ``G_in = min(G, C)`` (fixing lip-dp's unit mix-up), so a
    threshold below the loss's Lipschitz constant really lowers the noise.

    The threshold lives in a non-trainable variable (``clip_variable``), read by
    the traced training step both for the clipping and, through the bound pass,
    for the noise std: assigning it (``layer.clip_value = C``, what
    `kdp.callbacks.AdaptiveQuantileClipping` does) takes effect at the next step,
    without recompiling. A **fixed** threshold is a public constant and costs no
    privacy; a threshold chosen from private data must be accounted for (the
    adaptive callback records its releases in the model's ledger).

    Args:
        clip_value: the initial per-example threshold ``C > 0``. lip-dp's
            ``None`` (a dynamic threshold its callback reset to the loss's
            Lipschitz constant) is refused: pass ``loss.get_L()``.
        mode: lip-dp's ``"fixed"`` or ``"dynamic"``, accepted for both: the
            threshold is always a variable, which only
            `kdp.callbacks.AdaptiveQuantileClipping` moves (lip-dp's
            ``"dynamic"``); without that callback it stays fixed.
    """

    def __init__(self, clip_value, mode="fixed", **kwargs):
        super().__init__(**kwargs)
        if mode not in ("fixed", "dynamic"):
            raise ValueError(f"mode must be 'fixed' or 'dynamic', got {mode!r}")
        if clip_value is None:
            raise ValueError(
                "clip_value=None (lip-dp's dynamic start) is not supported: start at the "
                "loss's Lipschitz constant, DP_ClipGradient(loss.get_L(), mode='dynamic'), as "
                "lip-dp's callback did; kdp.callbacks.AdaptiveQuantileClipping moves it from there")
        clip_value = float(clip_value)
        if not clip_value > 0:
            raise ValueError(f"clip_value must be > 0, got {clip_value}")
        self.clip_variable = self.add_weight(
            shape=(), initializer=keras.initializers.Constant(clip_value), trainable=False,
            name="clip_value", dtype="float32", autocast=False,
        )
        self.cotangent_scale = 1.0

    @property
    def clip_value(self):
        """The current threshold as a Python float (outside a traced step; under
        JAX, inside ``fit``, call ``model.jax_state_sync()`` first)."""
        return float(ops.convert_to_numpy(self.clip_variable))

    @clip_value.setter
    def clip_value(self, value):
        value = float(value)
        if not value > 0:
            raise ValueError(f"clip_value must be > 0, got {value}")
        self.clip_variable.assign(value)

    def call(self, inputs):
        threshold = ops.cast(ops.convert_to_tensor(self.clip_variable), inputs.dtype)
        threshold = ops.stop_gradient(threshold * self.cotangent_scale)

        # The threshold is an explicit argument (not a closed-over tracer or
        # variable) so that the custom gradient is valid on every backend.
        @ops.custom_gradient
        def clip_backward(x, t):
            def grad(*args, upstream=None):
                if upstream is None:
                    (upstream,) = args
                norms = per_example_norm(upstream)
                scale = ops.minimum(1.0, t / ops.maximum(norms, 1e-30))
                shape = (-1,) + (1,) * (len(upstream.shape) - 1)
                return upstream * ops.reshape(scale, shape), ops.zeros_like(t)

            return ops.copy(x), grad

        return clip_backward(inputs, threshold)

    def compute_output_shape(self, input_shape):
        return input_shape

    def propagate_inputs(self, input_bound):
        return input_bound  # the identity forward

    def backpropagate_inputs(self, input_bound, gradient_bound):
        """``min(G, C)`` with ``C`` read from ``clip_variable``: a Python float
        when run eagerly, a tensor inside a traced function (the training step),
        so the noise follows the threshold without recompiling (see
        `kdp.bounds.compute_gradient_bounds`)."""
        return concrete_or_tensor(
            ops.minimum(gradient_bound, ops.convert_to_tensor(self.clip_variable)))

    def backpropagate_params(self, input_bound, gradient_bound):
        return {}  # the threshold is not trainable

    def get_config(self):
        return {**super().get_config(), "clip_value": self.clip_value}


def concrete_or_tensor(value):
    """``float(value)`` for an eager scalar tensor, ``value`` itself when it is
    traced (a JAX tracer, a TensorFlow graph tensor)."""
    backend = keras.backend.backend()
    if backend == "jax":
        import jax

        if isinstance(value, jax.core.Tracer):
            return value
    elif backend == "tensorflow":
        import tensorflow as tf

        if not tf.executing_eagerly():
            return value
    return float(ops.convert_to_numpy(value))


def clip_layers(model):
    """Every `DP_ClipGradient` inside ``model`` (nested models included)."""
    return [l for l in model._flatten_layers(include_self=False) if isinstance(l, DP_ClipGradient)]


@contextlib.contextmanager
def per_example_units(model):
    """Temporarily clip at ``clip_value`` itself (``cotangent_scale = 1``) in every
    `DP_ClipGradient` of ``model``: for per-example gradients of unreduced losses."""
    clips = clip_layers(model)
    saved = [l.cotangent_scale for l in clips]
    for layer in clips:
        layer.cotangent_scale = 1.0
    try:
        yield
    finally:
        for layer, scale in zip(clips, saved):
            layer.cotangent_scale = scale
