"""Residual connections whose bounds add correctly across the two branches."""

import keras

from kdp.layers.base import DPLayer, serializable

_MERGES = {"add": 1.0, "1-lip-add": 0.5}


@serializable
class DP_Residual(DPLayer, keras.layers.Layer):
    """``y = s · (x + f(x))`` with ``f`` a chain of DP layers (the residual branch).

    ``s = 1`` for ``merge="add"`` (2-Lipschitz if ``f`` is 1-Lipschitz) and
    ``s = 1/2`` for ``"1-lip-add"`` (1-Lipschitz). Bounds (Béthune et al. 2024,
    §B.4): ``X_out = s (X + X_f)``; the cotangent ``s·G`` enters both branches and
    the input cotangents add: ``G_in = s G + G_f``; the branch's parameter
    bounds are those of its layers with output cotangent ``s G``.

    Args:
        layers: list of DP layers forming ``f`` (output shape = input shape).
        merge: ``"add"`` or ``"1-lip-add"``.
    """

    def __init__(self, layers, merge="1-lip-add", **kwargs):
        super().__init__(**kwargs)
        if merge not in _MERGES:
            raise ValueError(f"merge must be one of {tuple(_MERGES)}, got {merge!r}")
        self.merge = merge
        self.scale = _MERGES[merge]
        self.branch = [
            keras.layers.deserialize(layer) if isinstance(layer, dict) else layer
            for layer in layers
        ]

    def build(self, input_shape):
        shape = input_shape
        for layer in self.branch:
            if not layer.built:
                layer.build(shape)
            # compute_output_spec: most DP layers keep the shape and only define call
            shape = layer.compute_output_spec(keras.KerasTensor(shape)).shape
        if tuple(shape[1:]) != tuple(input_shape[1:]):
            raise ValueError(
                f"{self.name}: the branch maps {input_shape} to {shape}; a residual "
                "needs the same shape"
            )

    def call(self, inputs):
        out = inputs
        for layer in self.branch:
            out = layer(out)
        return self.scale * (inputs + out)

    def compute_output_shape(self, input_shape):
        return input_shape

    # The branch's bounds come from the bound pass, which calls these methods: it is
    # imported when they run (`import kdp.bounds` first would find it half imported).
    def propagate_inputs(self, input_bound):
        from kdp.bounds import chain_propagate

        return self.scale * (input_bound + chain_propagate(self.branch, input_bound))

    def backpropagate_inputs(self, input_bound, gradient_bound):
        return self._backward(input_bound, gradient_bound)[0]

    def backpropagate_params(self, input_bound, gradient_bound):
        return self._backward(input_bound, gradient_bound)[1]

    def _backward(self, input_bound, gradient_bound):
        from kdp.bounds import chain_backpropagate

        g = self.scale * gradient_bound
        g_branch, params = chain_backpropagate(self.branch, input_bound, g)
        return g + g_branch, params

    def get_config(self):
        return {
            **super().get_config(),
            "layers": [keras.layers.serialize(layer) for layer in self.branch],
            "merge": self.merge,
        }


@serializable
class DP_Add(DPLayer, keras.layers.Layer):
    """Sum of two or more inputs times ``scale`` (``1/n`` keeps it 1-Lipschitz in the
    concatenated input), for residual branches in functional models.

    Bounds: ``X_out = scale · Σ X_k``; each input receives ``scale · G``.
    """

    def __init__(self, scale=1.0, **kwargs):
        super().__init__(**kwargs)
        self.scale = float(scale)

    def call(self, inputs):
        return self.scale * sum(inputs[1:], inputs[0])

    def compute_output_shape(self, input_shape):
        return input_shape[0]

    def propagate_inputs(self, input_bound):
        return self.scale * sum(input_bound)

    def backpropagate_inputs(self, input_bound, gradient_bound):
        return [self.scale * gradient_bound for _ in input_bound]

    def backpropagate_params(self, input_bound, gradient_bound):
        return {}

    def get_config(self):
        return {**super().get_config(), "scale": self.scale}


def make_residuals(merge_policy, wrapped_layers):
    """lip-dp-compatible helper: ``[DP_Residual(wrapped_layers, merge_policy)]``,
    to splice into a layer list with ``*make_residuals(...)``."""
    return [DP_Residual(list(wrapped_layers), merge=merge_policy)]
