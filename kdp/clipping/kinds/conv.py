"""`keras.layers.Conv1D` / `Conv2D` (channels last, ``groups=1``, ``"valid"`` or
``"same"`` padding): a convolution is a matmul of the input's patches
(unfolded, ``(T, k·c_in)`` for ``T`` output positions) with the kernel
reshaped to ``(k·c_in, c_out)``, so the linear layers' rule applies to
(patches, output cotangents): the Gram form or the materialised ``(k·c_in,
c_out)`` gradient per example, whichever is smaller (Bu et al. 2023, "mixed
ghost clipping", which introduced it for convolutions)."""

import itertools
import math
import string

import keras
from keras import ops

from kdp.clipping.kinds.base import plain, register
from kdp.clipping.kinds.linear import Linear


def patches(x, layer):
    """``x (N, *spatial, c_in)`` unfolded: ``(N, *out_spatial, k·c_in)``, the features in
    the kernel's ``(*kernel_size, c_in)`` order, with keras' padding and strides."""
    spatial = x.shape[1:-1]
    if layer.padding == "same":  # as keras (TensorFlow's and XLA's "SAME"): the extra row after
        pads = []
        for n, k, s, d in zip(spatial, layer.kernel_size, layer.strides, layer.dilation_rate):
            total = max((-(-n // s) - 1) * s + (k - 1) * d + 1 - n, 0)
            pads.append((total // 2, total - total // 2))
        x = ops.pad(x, [(0, 0), *pads, (0, 0)])
        spatial = x.shape[1:-1]
    out = [(n - (k - 1) * d - 1) // s + 1
           for n, k, s, d in zip(spatial, layer.kernel_size, layer.strides, layer.dilation_rate)]
    taps = []
    for offsets in itertools.product(*(range(k) for k in layer.kernel_size)):
        window = tuple(slice(o * d, o * d + (m - 1) * s + 1, s)
                       for o, d, m, s in zip(offsets, layer.dilation_rate, out, layer.strides))
        taps.append(x[(slice(None), *window, slice(None))])
    return ops.concatenate(taps, axis=-1)


@register
class ConvKind(Linear):
    def covers(self, layer):
        return (type(layer) in (keras.layers.Conv1D, keras.layers.Conv2D) and plain(layer)
                and layer.groups == 1 and layer.data_format == "channels_last"
                and layer.padding in ("valid", "same"))

    def product(self, layer, inputs):
        return layer.convolution_op(inputs, layer.kernel)

    def _rows(self, layer, a, g):
        rank = len(layer.kernel_size)
        unfolded = patches(ops.reshape(a, (-1, *a.shape[-rank - 1:])), layer)
        a = ops.reshape(unfolded, (-1, math.prod(g.shape[1:-1]), unfolded.shape[-1]))
        g = ops.reshape(g, (-1, a.shape[1], g.shape[-1]))
        spec = string.ascii_lowercase[:len(layer.kernel.shape)]
        return ops.cast(a, g.dtype), g, (spec, list(spec))
