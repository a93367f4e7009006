"""``keras.layers.ReversibleEmbedding`` (and keras_hub's, a subclass with the same
``call``; ``mask_zero=False``): a table ``E (V, d)`` read by lookups
(``reverse=False``, as `embedding`) and by the output projection
(``reverse=True``): ``logits = h Eᵀ`` with ``tie_weights``, else ``h R`` with
its own ``R (d, V)``. The logits are probed before ``logit_soft_cap``.

Example ``i``'s gradient of a tied ``E`` is ``Σ_r u_r v_rᵀ`` over its rows:
lookups (``u = one_hot(id_s)``, ``v = g_s``) and projections (``u = G_t``, the
logits' cotangent, ``v = h_t``), so ``‖∇‖² = Σ_{r,r'} (u_r·u_r')(v_r·v_r')``,
with ``one_hot(id_s)·G_t = G_t[id_s]``: a Gram form over the ``T + T'`` rows
or the materialised ``(V, d)`` gradient, as `linear.materialise` decides (Li et al.
2022; Bu et al. 2023, mixed ghost clipping). Untied, ``E``'s gradient is that
of `embedding` and ``R``'s that of a linear layer (`linear`), in one group.
Matched by type only: keras_hub is never imported here.
"""

import math
import sys

import keras
from keras import ops

from kdp.clipping.kinds.base import plain, register, sum_squares
from kdp.clipping.kinds.embedding import EmbeddingKind
from kdp.clipping.kinds.linear import gram_sq_norms, materialise, per_example_kernels


def _types():
    """keras' ``ReversibleEmbedding`` and keras_hub's if keras_hub is imported and its
    class only renames keras' (same ``call``)."""
    base = getattr(keras.layers, "ReversibleEmbedding", None)
    if base is None:
        return ()
    hub = getattr(getattr(sys.modules.get("keras_hub"), "layers", None), "ReversibleEmbedding", None)
    if hub is not None and issubclass(hub, base) and hub.call is base.call:
        return base, hub
    return (base,)


def _rows(t):
    """``t (B, …, n)`` as ``(B, rows, n)``."""
    return ops.reshape(t, (-1, math.prod(t.shape[1:-1]), t.shape[-1]))  # static: TensorFlow


@register
class ReversibleEmbeddingKind(EmbeddingKind):
    def covers(self, layer):
        return type(layer) in _types() and plain(layer) and not layer.mask_zero

    def call(self, layer, record):
        lookup = super().call(layer, record)

        def call(inputs, reverse=False):
            if not reverse:
                return lookup(inputs)
            kernel = ops.transpose(layer.embeddings) if layer.tie_weights else layer.reverse_embeddings
            if layer.reverse_dtype is not None:
                inputs = ops.cast(inputs, layer.reverse_dtype)
                kernel = ops.cast(kernel, layer.reverse_dtype)
            logits = record(inputs, ops.matmul(inputs, kernel))
            if layer.logit_soft_cap is not None:
                logits = ops.multiply(ops.tanh(ops.divide(logits, layer.logit_soft_cap)), layer.logit_soft_cap)
            return logits

        return call

    def per_example(self, layer, calls):
        """``(ids, g)`` of the lookups (`embedding`), ``(h (B, T', d), G (B, T', V))``
        of the projections, each ``None`` if there were none, and the formed
        per-example gradient where `linear.materialise` says so, else ``None``:
        ``R``'s ``(B, d, V)`` untied, ``E``'s ``(B, V, d)`` (lookups included) tied."""
        lookups = [(a, g) for a, g in calls if "int" in keras.backend.standardize_dtype(a.dtype)]
        projections = [(a, g) for a, g in calls if "int" not in keras.backend.standardize_dtype(a.dtype)]
        ids, g = super().per_example(layer, lookups) if lookups else (None, None)
        if not projections:
            return ids, g, None, None, None
        G = ops.concatenate([_rows(g) for _, g in projections], axis=1)
        h = ops.cast(ops.concatenate([_rows(a) for a, _ in projections], axis=1), G.dtype)
        if not layer.tie_weights:
            return ids, g, h, G, per_example_kernels([h], G)
        vocabulary, d = layer.embeddings.shape
        t = 0 if ids is None else ids.shape[1]
        table = None
        if materialise(t + h.shape[1], vocabulary, d):
            table = ops.einsum("btv,btd->bvd", G, h)
            if ids is not None:
                table = table + ops.einsum("btv,btd->bvd", ops.one_hot(ids, vocabulary, dtype=g.dtype), g)
        return ids, g, h, G, table

    def sq_norms(self, layer, state):
        ids, g, h, G, formed = state
        lookups = 0.0 if ids is None else super().sq_norms(layer, (ids, g))
        if h is None:
            return lookups
        if formed is not None:
            return sum_squares(formed) + (lookups if not layer.tie_weights else 0.0)
        sq = gram_sq_norms([h], G) + lookups
        if not layer.tie_weights or ids is None:
            return sq
        t = ids.shape[1]
        at_ids = ops.take_along_axis(G, ops.broadcast_to(ids[:, None, :], (ops.shape(G)[0], h.shape[1], t)), axis=2)
        cross = ops.sum(at_ids * ops.einsum("btd,bsd->bts", h, g), axis=(1, 2))  # Σ G_t[id_s] (h_t·g_s)
        return sq + 2.0 * cross

    def weighted_sums(self, layer, state, c):
        ids, g, h, G, formed = state
        tied_and_formed = layer.tie_weights and formed is not None
        out = {} if ids is None or tied_and_formed else super().weighted_sums(layer, (ids, g), c)
        if h is None:
            return out
        if formed is not None:
            weighted = ops.tensordot(ops.cast(c, formed.dtype), formed, axes=1)
        elif layer.tie_weights:
            weighted = ops.einsum("btv,btd->vd", G, h * ops.cast(c, h.dtype)[:, None, None])
        else:
            weighted = ops.einsum("btd,btv->dv", h * ops.cast(c, h.dtype)[:, None, None], G)
        path = layer.embeddings.path if layer.tie_weights else layer.reverse_embeddings.path
        out[path] = weighted if path not in out else out[path] + weighted
        return out
