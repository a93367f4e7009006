"""Orthogonal (1-Lipschitz, gradient-norm-preserving) dense layers."""

import keras
from keras import ops

from kdp.layers.base import DPLayer, serializable
from kdp.layers.constraints import OrthogonalProjection, full_projection, projected_initializer

#: Björck steps of `DP_SpectralDense` / `DP_SpectralConv2D` per projection.
FULL_ITERATIONS = 15
#: early stop of the full projection, on ``max |WᵀW − I|``.
FULL_TOLERANCE = 1e-5


class _OrthogonalKernelMixin:
    """Shared pieces of the orthogonal dense and conv layers.

    Both are linear maps of operator norm ≤ 1 (see their docstrings), so
    ``X_out = X`` and ``G_in = G``.
    """

    def propagate_inputs(self, input_bound):
        return input_bound

    def backpropagate_inputs(self, input_bound, gradient_bound):
        return gradient_bound

    def _kernel_constraint(self, scale):
        if self.quick:
            return OrthogonalProjection(iterations=1, scale=scale)
        return OrthogonalProjection(FULL_ITERATIONS, FULL_TOLERANCE, scale)

    def _add_kernel(self, shape, scale):
        """The kernel variable: drawn by ``kernel_initializer`` and certified by one
        full projection (`kdp.layers.constraints.projected_initializer`), then kept
        certified by the constraint of ``scale`` after every update."""
        full = full_projection(FULL_ITERATIONS, FULL_TOLERANCE, scale)
        return self.add_weight(
            name="kernel", shape=shape, initializer=projected_initializer(self.kernel_initializer, full),
            constraint=self._kernel_constraint(scale))


@serializable
class DP_SpectralDense(_OrthogonalKernelMixin, DPLayer, keras.layers.Layer):
    """Dense layer ``y = x W`` with ``‖W‖₂ ≤ 1``, projected after every update.

    The kernel starts orthogonal and is projected by certified Björck iterations
    (:mod:`kdp.lipschitz`) after every optimizer step, iterated to convergence
    (up to 15 steps, tolerance 1e-5): the layer is gradient-norm preserving up to
    that tolerance and 1-Lipschitz exactly. No bias: use `DP_AddBias`.

    Bounds: ``X_out = X``; ``G_in = G``; ``‖∂ℓ/∂W‖ = ‖x‖·‖g‖ ≤ X·G``
    (Béthune et al. 2024, Property 2).

    Args:
        units: output dimension.
        nm_coef: per-layer noise coefficient (``"per-layer"`` strategy).
    """

    quick = False

    def __init__(self, units, nm_coef=1.0, kernel_initializer="orthogonal", **kwargs):
        _refuse_bias(kwargs)
        super().__init__(**kwargs)
        self.units = int(units)
        self.nm_coef = float(nm_coef)
        self.kernel_initializer = keras.initializers.get(kernel_initializer)

    def build(self, input_shape):
        self.kernel = self._add_kernel((input_shape[-1], self.units), 1.0)

    def call(self, inputs):
        return ops.matmul(inputs, self.kernel)

    def compute_output_shape(self, input_shape):
        return tuple(input_shape[:-1]) + (self.units,)

    def backpropagate_params(self, input_bound, gradient_bound):
        return {self.kernel.path: input_bound * gradient_bound}

    def get_config(self):
        config = super().get_config()
        config.update(
            units=self.units,
            nm_coef=self.nm_coef,
            kernel_initializer=keras.initializers.serialize(self.kernel_initializer),
        )
        return config


@serializable
class DP_QuickSpectralDense(DP_SpectralDense):
    """`DP_SpectralDense` whose projection does a single warm-started Björck step.

    The previous kernel is already orthogonal and one update moves it little, so
    one step per update keeps it close to orthogonal at a third of the cost; the
    claim ``‖W‖₂ ≤ 1`` is certified after every step whatever the convergence
    (see :mod:`kdp.lipschitz`). Same bounds as `DP_SpectralDense`.
    """

    quick = True


def _refuse_bias(kwargs):
    if kwargs.pop("use_bias", False):
        raise ValueError(
            "kdp dense and conv layers have no bias (its bound would need a norm "
            "constraint): add a `DP_AddBias(norm_max)` layer after them."
        )
