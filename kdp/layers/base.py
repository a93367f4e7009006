"""The per-example bound protocol shared by every kdp layer.

Notation (all quantities are **per example**, never divided by the batch size):

* ``X`` bounds the L2 norm of one example's input to the layer (over all
  non-batch axes);
* ``G`` bounds the L2 norm of one example's loss cotangent at the layer output
  (``‖∂ℓ_i/∂y_i‖``).

A layer answers three questions (lip-dp's protocol, Béthune et al. 2024, Alg. 1):

* ``propagate_inputs(X) -> X_out``: a bound on the output norm;
* ``backpropagate_inputs(X, G) -> G_in``: a bound on the input cotangent;
* ``backpropagate_params(X, G) -> {variable.path: bound}``: a bound on the
  norm of one example's loss gradient for each trainable variable.

The defaults below are those of a parameterless layer that is 1-Lipschitz and
norm non-increasing with ``f(0) = 0`` (ReLU, GroupSort, pooling, reshapes):
such layers inherit them and write nothing else.
"""

import keras


class DPLayer:
    """Mixin that marks a Keras layer as a kdp DP layer and gives it the protocol.

    Attributes:
        nm_coef: public per-layer noise coefficient ``c_v`` (DESIGN §3.3) used by
            the ``"per-layer"`` noise strategy for this layer's variables.
    """

    nm_coef = 1.0

    def propagate_inputs(self, input_bound):
        return input_bound

    def backpropagate_inputs(self, input_bound, gradient_bound):
        return gradient_bound

    def backpropagate_params(self, input_bound, gradient_bound):
        return {}


def serializable(cls):
    """Register a kdp layer (or loss, constraint) for `.keras` serialization."""
    return keras.saving.register_keras_serializable(package="kdp")(cls)


def per_example_norm(x):
    """L2 norm of each example over all non-batch axes, shape ``(batch,)``."""
    axes = tuple(range(1, len(x.shape)))
    return keras.ops.sqrt(keras.ops.sum(keras.ops.square(x), axis=axes))
