"""`keras.layers.Embedding`: example ``i``'s gradient of the table is the
scatter-add of its output cotangents ``g_s`` at its token ids, so
``‖∇‖² = Σ_{s,t: id_s = id_t} g_s·g_t`` (Li et al. 2022, Appendix; Bu et al.
2023): a ``(T, T)`` Gram form per example when ``T² ≤ V·d``, else the
materialised ``(V, d)`` gradient. The sum ``Σ_i c_i ∇_i`` is one scatter-add.
``ReversibleEmbedding`` (a subclass, whose table may also be the output
projection) is its own kind (`reversible_embedding`)."""

import math

import keras
from keras import ops

from kdp.clipping.kinds.base import Kind, register


@register
class EmbeddingKind(Kind):
    layer_type = keras.layers.Embedding

    def call(self, layer, record):
        def call(inputs):
            if keras.backend.standardize_dtype(inputs.dtype) not in ("int32", "int64"):
                inputs = ops.cast(inputs, "int32")
            z = record(inputs, ops.take(layer.embeddings, inputs, axis=0))
            return ops.cast(z, layer.compute_dtype)

        return call

    def per_example(self, layer, calls):
        vocabulary, d = layer.embeddings.shape
        ids, g = [], []
        for a, cot in calls:
            a = ops.reshape(ops.cast(a, "int32"), (-1, math.prod(a.shape[1:])))  # static: TensorFlow
            ids.append(ops.where(a < 0, a + vocabulary, a))  # ops.take's negative indices
            g.append(ops.reshape(cot, (-1, a.shape[1], d)))
        if len(calls) > 1:
            return ops.concatenate(ids, axis=1), ops.concatenate(g, axis=1)
        return ids[0], g[0]

    def sq_norms(self, layer, state):
        return table_sq_norms(*state, layer.embeddings.shape[0])

    def weighted_sums(self, layer, state, c):
        return {layer.embeddings.path: table_weighted_sum(*state, c, layer.embeddings.shape[0])}


def table_sq_norms(ids, g, rows):
    """Each example's ``‖Σ_t one_hot(id_t) g_tᵀ‖² = Σ_{s,t: id_s = id_t} g_s·g_t``
    for a table of ``rows`` rows read at ``ids (B, T)`` with cotangents
    ``g (B, T, d)``: a Gram form when ``T² ≤ rows·d``, else the materialised
    ``(rows, d)`` gradient."""
    if ids.shape[1] ** 2 <= rows * g.shape[-1]:
        same = ops.equal(ids[:, :, None], ids[:, None, :])
        gram = ops.einsum("bsd,btd->bst", g, g)
        return ops.sum(ops.where(same, gram, ops.zeros_like(gram)), axis=(1, 2))
    table = ops.einsum("btv,btd->bvd", ops.one_hot(ids, rows, dtype=g.dtype), g)
    return ops.sum(ops.square(table), axis=(1, 2))


def table_weighted_sum(ids, g, c, rows):
    """``Σ_i c_i ∇_i`` of that table: one scatter-add of the weighted cotangents."""
    weighted = ops.reshape(g * ops.cast(c, g.dtype)[:, None, None], (-1, g.shape[-1]))
    return ops.segment_sum(weighted, ops.reshape(ids, (-1,)), num_segments=rows)
