"""`keras.layers.EinsumDense` whose equation is a matmul over rows
(`linear.parse`: keras' and keras_hub's attention projections and feed-forward
layers); another equation is left to per-example gradients."""

import keras
from keras import ops

from kdp.clipping.kinds.base import register
from kdp.clipping.kinds.linear import Linear, parse


@register
class EinsumDenseKind(Linear):
    layer_type = keras.layers.EinsumDense

    def covers(self, layer):
        return super().covers(layer) and parse(layer.equation) is not None

    def equation(self, layer):
        return layer.equation

    def product(self, layer, inputs):
        return ops.einsum(layer.equation, inputs, layer.kernel)
