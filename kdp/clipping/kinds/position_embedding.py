"""keras_hub's ``PositionEmbedding``: a table ``P (L, d)`` whose rows
``start_index … start_index + T − 1`` are broadcast onto the input. Example
``i``'s gradient of ``P`` is its output cotangent summed over the broadcast axes,
``g_i (T, d)``, at those rows: one call reads distinct rows, so ``‖∇‖² =
‖g_i‖²``; several calls may read a row twice, so ``‖∇‖² = Σ_{s,t: row_s =
row_t} g_s·g_t`` (a Gram form when ``T² ≤ L·d``, else the materialised ``(L,
d)`` gradient, as `embedding`; Li et al. 2022; Bu et al. 2023). The sum ``Σ_i
c_i ∇_i`` is one scatter-add. A call with explicit ``positions`` is refused.
Matched by type only: keras_hub is never imported here.
"""

import sys

from keras import ops

from kdp.clipping.kinds.base import Kind, plain, register, sum_squares
from kdp.clipping.kinds.embedding import table_sq_norms, table_weighted_sum


def _type():
    """keras_hub's ``PositionEmbedding`` if keras_hub is imported, else ``None``."""
    return getattr(getattr(sys.modules.get("keras_hub"), "layers", None), "PositionEmbedding", None)


@register
class PositionEmbeddingKind(Kind):
    def covers(self, layer):
        return _type() is not None and type(layer) is _type() and plain(layer)

    def call(self, layer, record):
        def call(inputs, start_index=0, positions=None):
            if positions is not None:
                raise ValueError(f"{layer.name}: PositionEmbedding with explicit positions is not "
                                 "supported by per-example clipping")
            shape = ops.shape(inputs)
            length, width = shape[-2], shape[-1]
            rows = ops.slice(ops.convert_to_tensor(layer.position_embeddings), (start_index, 0), (length, width))
            read = ops.arange(length, dtype="int32") + ops.cast(start_index, "int32")
            return record(read, ops.broadcast_to(rows, shape))

        return call

    def per_example(self, layer, calls):
        """The rows read ``(B, R)`` and their cotangents ``(B, R, d)``, summed over the
        broadcast axes, over all calls; whether the rows are distinct (one call)."""
        rows, g = [], []
        for a, cot in calls:
            rows.append(ops.reshape(a, (-1, cot.shape[-2])))
            g.append(ops.sum(cot, axis=tuple(range(1, len(cot.shape) - 2))) if len(cot.shape) > 3 else cot)
        if len(calls) > 1:
            return ops.concatenate(rows, axis=1), ops.concatenate(g, axis=1), False
        return rows[0], g[0], True

    def sq_norms(self, layer, state):
        rows, g, distinct = state
        if distinct:
            return sum_squares(g)
        return table_sq_norms(rows, g, layer.position_embeddings.shape[0])

    def weighted_sums(self, layer, state, c):
        rows, g, _ = state
        return {layer.position_embeddings.path: table_weighted_sum(rows, g, c,
                                                                   layer.position_embeddings.shape[0])}
