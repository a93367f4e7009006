"""Several views of one input, side by side: branches whose outputs are concatenated."""

import math

import keras
from keras import ops

from kdp.layers.base import DPLayer, serializable


@serializable
class DP_ConcatFeatures(DPLayer, keras.layers.Layer):
    """``y = [flat(f_1(x)), …, flat(f_k(x))]``: each branch ``f_b`` (a chain of DP
    layers) applied to the same input, the flattened outputs concatenated.

    E.g. the recipes' features for small images: normalised scattering
    coefficients next to the normalised pixels, which the scattering's
    subsampling blurs away (``[[DP_Scattering2D(), DP_GroupNormalization()],
    [DP_GroupNormalization(groups=1)]]``).

    Bounds: the output's squared norm is the sum of the branches',
    ``X_out = √(Σ_b X_b²)``; the output cotangent splits into one slice per
    branch, each of norm at most ``G``, and the input cotangents add:
    ``G_in = Σ_b G_in,b``; a branch's parameter bounds are those of its layers
    with output cotangent ``G``.

    Args:
        branches: a list of at least one list of DP layers (a branch may be
            empty: the input itself).
    """

    def __init__(self, branches, **kwargs):
        super().__init__(**kwargs)
        if not branches:
            raise ValueError("DP_ConcatFeatures needs at least one branch")
        self.branches = [
            [keras.layers.deserialize(layer) if isinstance(layer, dict) else layer
             for layer in branch]
            for branch in branches
        ]

    def build(self, input_shape):
        self.branch_sizes = []
        for branch in self.branches:
            shape = input_shape
            for layer in branch:
                if not layer.built:
                    layer.build(shape)
                shape = layer.compute_output_spec(keras.KerasTensor(shape)).shape
            if any(d is None for d in shape[1:]):
                raise ValueError(f"{self.name}: a branch's output shape {shape} is not known")
            self.branch_sizes.append(math.prod(int(d) for d in shape[1:]))

    def call(self, inputs):
        outputs = []
        for branch in self.branches:
            out = inputs
            for layer in branch:
                out = layer(out)
            outputs.append(ops.reshape(out, (ops.shape(out)[0], -1)))
        return ops.concatenate(outputs, axis=-1)

    def compute_output_shape(self, input_shape):
        if not hasattr(self, "branch_sizes"):
            self.build(input_shape)
        return (input_shape[0], sum(self.branch_sizes))

    # The branches' bounds come from the bound pass (imported when these run, as in
    # `DP_Residual`).
    def propagate_inputs(self, input_bound):
        from kdp.bounds import chain_propagate

        return math.sqrt(sum(chain_propagate(b, input_bound) ** 2 for b in self.branches))

    def backpropagate_inputs(self, input_bound, gradient_bound):
        return self._backward(input_bound, gradient_bound)[0]

    def backpropagate_params(self, input_bound, gradient_bound):
        return self._backward(input_bound, gradient_bound)[1]

    def _backward(self, input_bound, gradient_bound):
        from kdp.bounds import chain_backpropagate

        total, params = 0.0, {}
        for branch in self.branches:
            g_in, new = chain_backpropagate(branch, input_bound, gradient_bound)
            total += g_in
            params.update(new)
        return total, params

    def get_config(self):
        return {
            **super().get_config(),
            "branches": [[keras.layers.serialize(layer) for layer in branch]
                         for branch in self.branches],
        }
