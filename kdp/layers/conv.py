"""1-Lipschitz convolutions with reshaped-kernel orthogonalisation (RKO)."""

import keras
from keras import ops

from kdp.layers.base import DPLayer, serializable
from kdp.layers.dense import _OrthogonalKernelMixin, _refuse_bias
from kdp.lipschitz import conv_lipschitz_factor


@serializable
class DP_SpectralConv2D(_OrthogonalKernelMixin, DPLayer, keras.layers.Layer):
    """2-D convolution (channels last, no bias) with a certified 1-Lipschitz kernel.

    With ``k = ⌈k_h/s_h⌉·⌈k_w/s_w⌉`` the largest number of windows containing
    one input pixel, and ``Φ_r`` the kernel reshaped to ``(k_h·k_w·C_in, F)``:

    * ``‖conv_Φ(x)‖² = Σ_p ‖Φ_rᵀ x^p‖² ≤ ‖Φ_r‖₂² · k ‖x‖²``, so the projection keeps
      ``‖Φ_r‖₂ ≤ 1/√k`` (RKO: orthogonalise ``√k·Φ_r``, divide by ``√k``) and the
      layer is 1-Lipschitz, for 'same' (zero) or 'valid' padding and any stride;
    * ``∂ℓ/∂Φ = Σ_p x^p ⊗ g_p`` has norm ``≤ √k ‖x‖ ‖g‖`` (Béthune et al. 2024,
      Property 3, with the stride-aware patch count instead of deel-lip's
      average-border factor, which is not a worst-case bound).

    Bounds: ``X_out = X``; ``G_in = G``; kernel ``√k · X · G``.

    Args:
        filters: output channels.
        kernel_size: int or pair.
        strides: int or pair.
        padding: ``"same"`` or ``"valid"``.
        nm_coef: per-layer noise coefficient.
    """

    quick = False

    def __init__(self, filters, kernel_size=3, strides=1, padding="same", nm_coef=1.0,
                 kernel_initializer="orthogonal", **kwargs):
        _refuse_bias(kwargs)
        super().__init__(**kwargs)
        self.filters = int(filters)
        self.kernel_size = _pair(kernel_size)
        self.strides = _pair(strides)
        if padding not in ("same", "valid"):
            raise ValueError(f"padding must be 'same' or 'valid', got {padding!r}")
        self.padding = padding
        self.nm_coef = float(nm_coef)
        self.kernel_initializer = keras.initializers.get(kernel_initializer)
        self.factor = conv_lipschitz_factor(self.kernel_size, self.strides)

    def build(self, input_shape):
        if len(input_shape) != 4:
            raise ValueError(f"{self.name} expects (batch, H, W, C) inputs, got {input_shape}")
        self.kernel = self._add_kernel(self.kernel_size + (input_shape[-1], self.filters), self.factor)

    def call(self, inputs):
        return ops.conv(inputs, self.kernel, strides=self.strides, padding=self.padding)

    def compute_output_shape(self, input_shape):
        out = keras.ops.conv(
            keras.KerasTensor(input_shape), keras.KerasTensor(self.kernel_size + (input_shape[-1], self.filters)),
            strides=self.strides, padding=self.padding,
        )
        return out.shape

    def backpropagate_params(self, input_bound, gradient_bound):
        return {self.kernel.path: self.factor * input_bound * gradient_bound}

    def get_config(self):
        config = super().get_config()
        config.update(
            filters=self.filters,
            kernel_size=self.kernel_size,
            strides=self.strides,
            padding=self.padding,
            nm_coef=self.nm_coef,
            kernel_initializer=keras.initializers.serialize(self.kernel_initializer),
        )
        return config


@serializable
class DP_QuickSpectralConv2D(DP_SpectralConv2D):
    """`DP_SpectralConv2D` with one warm-started Björck step per update (certified)."""

    quick = True


def _pair(v):
    return (int(v), int(v)) if isinstance(v, int) else tuple(int(a) for a in v)
