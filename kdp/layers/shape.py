"""Reshaping layers: norm preserving, protocol defaults."""

import keras

from kdp.layers.base import DPLayer, serializable


@serializable
class DP_Flatten(DPLayer, keras.layers.Flatten):
    """`keras.layers.Flatten` with the DP bound protocol (norm preserving)."""


@serializable
class DP_Reshape(DPLayer, keras.layers.Reshape):
    """`keras.layers.Reshape` with the DP bound protocol (norm preserving)."""
