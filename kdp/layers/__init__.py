"""kdp's DP layers: Keras layers with the per-example bound protocol."""

from kdp.layers.activations import DP_GroupSort, DP_ReLU
from kdp.layers.base import DPLayer, DPNormNonIncreasingLayer
from kdp.layers.bias import DP_AddBias
from kdp.layers.centering import DP_LayerCentering
from kdp.layers.clip import DP_ClipGradient
from kdp.layers.constraints import BallProjection, OrthogonalProjection
from kdp.layers.conv import DP_QuickSpectralConv2D, DP_SpectralConv2D
from kdp.layers.dense import DP_QuickSpectralDense, DP_SpectralDense
from kdp.layers.features import DP_ConcatFeatures
from kdp.layers.input import DP_BoundedInput, DP_BoxInput
from kdp.layers.normalization import DP_GroupNormalization
from kdp.layers.pooling import DP_ScaledGlobalL2NormPooling2D, DP_ScaledL2NormPooling2D
from kdp.layers.residual import DP_Add, DP_Residual, make_residuals
from kdp.layers.scattering import DP_Scattering2D
from kdp.layers.shape import DP_Flatten, DP_Reshape

__all__ = [
    "DPLayer", "DPNormNonIncreasingLayer", "DP_AddBias", "DP_Add", "DP_BoundedInput",
    "DP_BoxInput", "DP_ClipGradient", "DP_ConcatFeatures", "DP_Flatten", "DP_GroupNormalization",
    "DP_GroupSort", "DP_LayerCentering", "DP_QuickSpectralConv2D", "DP_QuickSpectralDense",
    "DP_ReLU", "DP_Reshape", "DP_Residual", "DP_ScaledGlobalL2NormPooling2D", "DP_Scattering2D",
    "DP_ScaledL2NormPooling2D", "DP_SpectralConv2D", "DP_SpectralDense", "BallProjection",
    "OrthogonalProjection", "make_residuals",
]

# lip-dp's layer names: each raises an error that names the kdp layer to use instead.
from kdp.compat import (  # noqa: E402
    DP_GNP_Factory, DP_InputLayer, DP_Lambda, DP_MaxPool2D, DP_MergeResidual, DP_Permute,
    DP_QuickFrobeniusDense, DP_ScaledL2NormPooling1D, DP_SplitResidual, DP_WrappedResidual,
)
