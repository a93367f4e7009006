"""`keras.layers.Conv1D` / `Conv2D` (channels last, ``groups=1``, ``"valid"`` or
``"same"`` padding): a convolution is a matmul of the input's patches
(unfolded, ``(T, k·c_in)`` for ``T`` output positions) with the kernel
reshaped to ``(k·c_in, c_out)``, so the linear layers' rule applies to
(patches, output cotangents): the materialised ``(k·c_in, c_out)`` gradient
per example or, where it takes much more memory, the Gram form
(`linear.materialise`; Bu et al. 2023, "mixed ghost clipping", which
introduced the choice for convolutions). The patches are never
concatenated: they enter as ``k`` blocks of ``c_in`` features, one per kernel
tap (the input shifted by the tap's offset), whose products are formed tap by
tap; the unfolded ``(T, k·c_in)`` copy cost more than the products on
TensorFlow. A depthwise convolution of the inputs by the cotangents (the
examples as channels) gives every example's kernel in one operation, but took
1.2–2.1× the products tap by tap on the CPU, on both backends (8 and 32 rows,
the convnet of ``benchmarks/bench_clipping_step.py``, 2026-12-07)."""

import itertools
import math
import string

import keras
from keras import ops

from kdp.clipping.kinds.base import plain, register
from kdp.clipping.kinds.linear import Linear


def taps(x, layer):
    """``x (N, *spatial, c_in)`` unfolded as one ``(N, *out_spatial, c_in)`` tensor per
    kernel tap, in the kernel's ``(*kernel_size)`` order, with keras' padding and
    strides: their concatenation on the last axis is the patches."""
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
    shifted = []
    for offsets in itertools.product(*(range(k) for k in layer.kernel_size)):
        window = tuple(slice(o * d, o * d + (m - 1) * s + 1, s)
                       for o, d, m, s in zip(offsets, layer.dilation_rate, out, layer.strides))
        shifted.append(x[(slice(None), *window, slice(None))])
    return shifted


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
        rows = math.prod(g.shape[1:-1])
        blocks = [ops.cast(ops.reshape(t, (-1, rows, t.shape[-1])), g.dtype)
                  for t in taps(ops.reshape(a, (-1, *a.shape[-rank - 1:])), layer)]
        g = ops.reshape(g, (-1, rows, g.shape[-1]))
        spec = string.ascii_lowercase[:len(layer.kernel.shape)]
        return blocks, g, (spec, list(spec))
