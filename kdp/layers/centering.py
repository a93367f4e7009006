"""Layer centering: a 1-Lipschitz stand-in for normalisation, per example."""

import keras
from keras import ops

from kdp.layers.base import DPNormNonIncreasingLayer, serializable

_AXES = ("channels", "spatial", "all")


@serializable
class DP_LayerCentering(DPNormNonIncreasingLayer, keras.layers.Layer):
    """Subtracts the mean over **non-batch** axes of each example.

    ``x ↦ (I − 𝟙𝟙ᵀ/n) x`` on each group of averaged coordinates: an orthogonal
    projection (singular values 0 and 1; Béthune et al. 2024, Property 4), so
    ``‖y‖ ≤ ‖x‖`` and it is 1-Lipschitz. Never averages over the batch axis
    (lip-dp's bug for non-4-D inputs).

    Args:
        axes: ``"channels"`` (last axis, default), ``"spatial"`` (axes 1..n−2,
            per channel) or ``"all"`` (every non-batch axis). lip-dp's
            ``pixelwise=``/``channelwise=`` flags are refused.
    """

    def __init__(self, axes="channels", **kwargs):
        flags = [k for k in ("pixelwise", "channelwise") if k in kwargs]
        if flags:
            raise TypeError(
                f"DP_LayerCentering: lip-dp's {'=, '.join(flags)}= are not kdp's; use axes="
                "'channels' (lip-dp's channelwise=True), 'spatial' (pixelwise=True, "
                "channelwise=False) or 'all' (both False)")
        super().__init__(**kwargs)
        if axes not in _AXES:
            raise ValueError(f"axes must be one of {_AXES}, got {axes!r}")
        self.axes = axes

    def _reduce_axes(self, rank):
        if self.axes == "channels":
            return (rank - 1,)
        if self.axes == "spatial":
            if rank < 3:
                raise ValueError("axes='spatial' needs inputs with spatial axes")
            return tuple(range(1, rank - 1))
        return tuple(range(1, rank))

    def call(self, inputs):
        axes = self._reduce_axes(len(inputs.shape))
        return inputs - ops.mean(inputs, axis=axes, keepdims=True)

    def get_config(self):
        return {**super().get_config(), "axes": self.axes}
