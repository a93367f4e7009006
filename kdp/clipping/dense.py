"""Ghost (book-keeping) norms of plain `Dense` layers: per-example kernel norms
from each call's input and output cotangent, without per-example gradients."""

import math

import keras
from keras import ops

from kdp.clipping.loss import per_example_loss


def _is_ghost_dense(layer):
    """A plain `keras.layers.Dense` whose weights are all trainable (the ghost path)."""
    return (
        type(layer) is keras.layers.Dense
        and not getattr(layer, "lora_enabled", False)
        and getattr(layer, "quantization_mode", None) is None
        and layer.built
        and bool(layer.trainable_weights)
        and len(layer.trainable_weights) == len(layer.weights)
    )


def ghost_dense_layers(model):
    """The layers whose per-example norms ghost clipping computes: every plain
    `Dense` of ``model`` (`_is_ghost_dense`), wherever it is called (also from
    inside another layer's ``call``, on any number of rows per example)."""
    return [layer for layer in model._flatten_layers(include_self=False) if _is_ghost_dense(layer)]




_MISSING = object()


class _GhostDense:
    """Swaps the ``call`` of covered Dense layers for one that records its input
    and passes ``z = aW + b`` through ``probe``."""

    def __init__(self, layers):
        self.layers = list(layers)
        self.probe = lambda z: z
        self.records = []  # (layer, input)
        self._saved = []

    def __enter__(self):
        for layer in self.layers:
            self._saved.append((layer, layer.__dict__.get("call", _MISSING)))
            object.__setattr__(layer, "call", self._make_call(layer))
        return self

    def __exit__(self, *exc):
        for layer, old in reversed(self._saved):
            if old is _MISSING:
                object.__delattr__(layer, "call")
            else:
                object.__setattr__(layer, "call", old)
        self._saved = []
        self.records = []

    def _make_call(self, layer):
        def call(inputs, training=None):
            z = ops.matmul(inputs, layer.kernel)
            if layer.bias is not None:
                z = ops.add(z, layer.bias)
            self.records.append((layer, inputs))
            z = self.probe(z)
            return layer.activation(z) if layer.activation is not None else z

        return call

    def example_loss(self, loss):
        """``forward`` of `autodiff.weighted_per_example_gradients`: one example's
        loss, the inputs of the covered Dense calls as ``aux``."""
        def forward(call, probe, x, y):
            self.probe, self.records = probe, []
            value = ops.sum(per_example_loss(loss, y, call(x)))
            return value, [a for _, a in self.records]

        return forward


def _as_rows(t):
    """One example's rows: ``(batch, 1, ..., d) -> (batch, T, d)``."""
    return ops.reshape(t, (-1, int(math.prod(t.shape[1:-1])), t.shape[-1]))


def _kernel_sq_norms(a, g):
    """Per-example ``‖a_iᵀ g_i‖_F²`` for ``a (B, T, d)``, ``g (B, T, u)``."""
    t, d, u = a.shape[1], a.shape[2], g.shape[2]
    if t == 1:
        return ops.sum(ops.square(a[:, 0]), axis=1) * ops.sum(ops.square(g[:, 0]), axis=1)
    if t * t <= d * u:  # Gram form: Σ_{s,t} (a_s·a_t)(g_s·g_t)
        ga = ops.einsum("bsd,btd->bst", a, a)
        gg = ops.einsum("bsu,btu->bst", g, g)
        return ops.sum(ga * gg, axis=(1, 2))
    return ops.sum(ops.square(ops.einsum("btd,btu->bdu", a, g)), axis=(1, 2))
