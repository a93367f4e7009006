"""Reshaping layers: norm preserving (`DPNormNonIncreasingLayer`)."""

import keras

from kdp.layers.base import DPNormNonIncreasingLayer, serializable


@serializable
class DP_Flatten(DPNormNonIncreasingLayer, keras.layers.Flatten):
    """`keras.layers.Flatten` with the DP bound protocol (norm preserving)."""


@serializable
class DP_Reshape(DPNormNonIncreasingLayer, keras.layers.Reshape):
    """`keras.layers.Reshape` with the DP bound protocol (norm preserving)."""
