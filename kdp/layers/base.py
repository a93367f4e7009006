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

`DPLayer` gives no answer by default: a layer states its three bounds, or opts
into those of a parameterless 1-Lipschitz map with ``f(0) = 0`` by inheriting
`DPNormNonIncreasingLayer`. The bound pass (`kdp.bounds`) refuses a layer that
does neither, or whose class redefines ``call`` below the class that stated
the bounds.
"""

import keras

#: the three methods of the protocol.
BOUND_METHODS = ("propagate_inputs", "backpropagate_inputs", "backpropagate_params")


def _not_stated(layer, method):
    return NotImplementedError(
        f"{type(layer).__name__} ({getattr(layer, 'name', layer)!r}) does not state "
        f"{method}: implement the three bound methods, or inherit "
        "DPNormNonIncreasingLayer for a parameterless 1-Lipschitz layer with f(0) = 0."
    )


class DPLayer:
    """Mixin that marks a Keras layer as a kdp DP layer.

    A subclass must implement `propagate_inputs`, `backpropagate_inputs` and
    `backpropagate_params` (the versions here raise), or inherit
    `DPNormNonIncreasingLayer`.

    Attributes:
        nm_coef: public per-layer noise coefficient ``c_v`` used by the
            ``"per-layer"`` noise strategy for this layer's variables.
    """

    nm_coef = 1.0

    def propagate_inputs(self, input_bound):
        raise _not_stated(self, "propagate_inputs")

    def backpropagate_inputs(self, input_bound, gradient_bound):
        raise _not_stated(self, "backpropagate_inputs")

    def backpropagate_params(self, input_bound, gradient_bound):
        raise _not_stated(self, "backpropagate_params")


class DPNormNonIncreasingLayer(DPLayer):
    """Opt-in bounds of a parameterless, 1-Lipschitz layer ``f`` with ``f(0) = 0``.

    Then ``‖f(x)‖ = ‖f(x) − f(0)‖ ≤ ‖x‖`` and ``‖Jᵀg‖ ≤ ‖g‖``: ``X_out = X``,
    ``G_in = G``, no parameter bound (ReLU, GroupSort, L2-norm pooling, reshapes,
    centering). Inheriting it is a claim about the inheriting class's ``call``;
    a subclass that redefines ``call`` must state its bounds again.
    """

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
