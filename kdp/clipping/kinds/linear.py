"""`Dense` and `EinsumDense`: kernel norms from each call's input and output
cotangent in matmul form, per example the cheaper of the Gram form and the
materialised gradient ("mixed ghost clipping", Bu et al. 2023; Li et al. 2022).

A linear layer's output is ``z = einsum(X,K->O)(a, W) + b``. Written as a
matmul over rows ``R`` (letters of ``X`` and ``O``), contracted letters ``I``
(``X`` and ``K``) and output letters ``U`` (``K`` and ``O``), example ``i``'s
kernel gradient is ``A_iᵀG_i`` with ``A_i (T, d)`` its input rows and ``G_i
(T, u)`` its output cotangents: ``‖A_iᵀG_i‖² = ⟨A_iA_iᵀ, G_iG_iᵀ⟩``.
"""

import math
import string

from keras import ops

from kdp.clipping.kinds.base import Kind, add_up, reduce_to, sum_squares


def per_example_kernels(a, g):
    """Per-example kernel gradients ``a_iᵀ g_i`` for ``a (B, T, d)``, ``g (B, T, u)``
    when they are smaller than the Gram matrices (``T² > d·u``), else ``None``."""
    t, d, u = a.shape[1], a.shape[2], g.shape[2]
    return ops.einsum("btd,btu->bdu", a, g) if t > 1 and t * t > d * u else None


def gram_sq_norms(a, g):
    """Per-example ``‖a_iᵀ g_i‖_F² = Σ_{s,t} (a_s·a_t)(g_s·g_t)``, without ``a_iᵀ g_i``."""
    if a.shape[1] == 1:
        return ops.sum(ops.square(a[:, 0]), axis=1) * ops.sum(ops.square(g[:, 0]), axis=1)
    ga = ops.einsum("bsd,btd->bst", a, a)
    gg = ops.einsum("bsu,btu->bst", g, g)
    return ops.sum(ga * gg, axis=(1, 2))


def parse(equation):
    """``(X, K, O)`` of ``"X,K->O"`` if it is a matmul over rows (see the module),
    else ``None``: one ``...`` at most, in ``X`` and ``O`` alike, no repeated
    letter in an operand, every letter in exactly two operands."""
    if equation.count(",") != 1 or equation.count("->") != 1:
        return None
    inputs, out = equation.replace(" ", "").split("->")
    x, k = inputs.split(",")
    if "..." in k or ("..." in x) != ("..." in out):
        return None
    letters = [s.replace("...", "") for s in (x, k, out)]
    if any(len(set(s)) != len(s) or not all(ch.isalpha() for ch in s) for s in letters):
        return None
    lx, lk, lo = (set(s) for s in letters)
    if (lx & lk & lo) or (lx - lk - lo) or (lk - lx - lo) or (lo - lx - lk):
        return None
    return x, k, out


def _expand(spec, rank, fill):
    """``spec`` with its ``...`` spelled as the letters ``fill`` for a tensor of ``rank``."""
    if "..." not in spec:
        return spec
    n = rank - len(spec.replace("...", ""))
    return spec.replace("...", fill[:n])


class Linear(Kind):
    """Shared by `Dense` and `EinsumDense`; subclasses give `equation` and `product`."""

    def equation(self, layer):
        raise NotImplementedError

    def product(self, layer, inputs):
        raise NotImplementedError

    def call(self, layer, record):
        def call(inputs, training=None):
            z = self.product(layer, inputs)
            if layer.bias is not None:
                z = ops.add(z, layer.bias)
            z = record(inputs, z)
            return layer.activation(z) if layer.activation is not None else z

        return call

    def _rows(self, layer, a, g):
        """``a (B, T, d)``, ``g (B, T, u)`` in matmul form, and the kernel's letters
        ``K`` and ``I + U`` (the kernel's axes in matmul form)."""
        x, k, o = parse(self.equation(layer))
        fill = "".join(c for c in string.ascii_letters if c not in x + k + o)
        x, o = _expand(x, len(a.shape) - 1, fill), _expand(o, len(g.shape) - 1, fill)
        rows = [c for c in x if c in o]
        contracted = [c for c in x if c in k]
        units = [c for c in o if c in k]
        a = ops.transpose(a, [0] + [1 + x.index(c) for c in rows + contracted])
        g = ops.transpose(g, [0] + [1 + o.index(c) for c in rows + units])
        t = math.prod(a.shape[1:1 + len(rows)])
        a = ops.reshape(a, (-1, t, math.prod(a.shape[1 + len(rows):])))
        g = ops.reshape(g, (-1, t, math.prod(g.shape[1 + len(rows):])))
        return ops.cast(a, g.dtype), g, (k, contracted + units)

    def per_example(self, layer, calls):
        rows = [self._rows(layer, a, g) for a, g in calls]
        a = ops.concatenate([r[0] for r in rows], axis=1) if len(rows) > 1 else rows[0][0]
        g = ops.concatenate([r[1] for r in rows], axis=1) if len(rows) > 1 else rows[0][1]
        bias = None if layer.bias is None else add_up(calls, lambda _, g: reduce_to(g, layer.bias.shape))
        return a, g, per_example_kernels(a, g), rows[0][2], bias

    def sq_norms(self, layer, state):
        a, g, kernels, _, bias = state
        sq = gram_sq_norms(a, g) if kernels is None else sum_squares(kernels)
        return sq if bias is None else sq + sum_squares(bias)

    def weighted_sums(self, layer, state, c):
        a, g, kernels, (spec, letters), bias = state
        c = ops.cast(c, g.dtype)
        if kernels is None:
            kernel = ops.einsum("btd,btu->du", a * c[:, None, None], g)
        else:
            kernel = ops.tensordot(c, kernels, axes=1)
        shape = [layer.kernel.shape[spec.index(ch)] for ch in letters]
        kernel = ops.transpose(ops.reshape(kernel, shape), [letters.index(ch) for ch in spec])
        out = {layer.kernel.path: kernel}
        if bias is not None:
            out[layer.bias.path] = ops.tensordot(c, bias, axes=1)
        return out
