"""`keras.layers.Dense` (any number of rows per example: ``a (…, d) @ W (d, u)``)."""

import keras
from keras import ops

from kdp.clipping.kinds.base import register
from kdp.clipping.kinds.linear import Linear


@register
class DenseKind(Linear):
    layer_type = keras.layers.Dense

    def equation(self, layer):
        return "...i,io->...o"

    def product(self, layer, inputs):
        return ops.matmul(inputs, layer.kernel)
