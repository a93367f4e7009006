"""`Dense` and `EinsumDense`: kernel norms from each call's input and output
cotangent in matmul form, per example the materialised gradient or, where it
would take much more memory, the Gram form ("mixed ghost clipping", Bu et al.
2023; Li et al. 2022).

A linear layer's output is ``z = einsum(X,K->O)(a, W) + b``. Written as a
matmul over rows ``R`` (letters of ``X`` and ``O``), contracted letters ``I``
(``X`` and ``K``) and output letters ``U`` (``K`` and ``O``), example ``i``'s
kernel gradient is ``A_iᵀG_i`` with ``A_i (T, d)`` its input rows and ``G_i
(T, u)`` its output cotangents: ``‖A_iᵀG_i‖² = ⟨A_iA_iᵀ, G_iG_iᵀ⟩``.
"""

import functools
import math
import string

from keras import ops

from kdp.clipping.kinds.base import Kind, add_up, reduce_to, sum_squares


def materialise(rows, d, u):
    """Whether one example's ``(d, u)`` kernel gradient is formed rather than its
    Gram form over ``rows > 1`` rows.

    Formed, it takes fewer operations: ``rows·d·u``, and the weighted sum is one
    of formed gradients; the Gram form spends ``rows²·(d + u)`` on the norms and
    ``rows·d·u`` on the weighted sum from the rows. It takes more memory only
    when ``d·u`` is large: the Gram form keeps the example's rows and
    cotangents (``rows·(d + u)`` values) until the clipping factors are known,
    the formed gradient ``d·u``. So the rule is ``d·u ≤ 2·rows·(d + u)``: every
    projection of the BERT encoders of ``benchmarks/bench_transformer.py`` is
    formed (faster, and no more XLA buffer memory, than in the Gram form),
    an output layer over a large vocabulary keeps the Gram form."""
    return rows > 1 and d * u <= 2 * rows * (d + u)


def per_example_kernels(blocks, g):
    """Per-example kernel gradients ``a_iᵀ g_i`` for input rows ``a (B, T, d)``, given
    as ``blocks`` along ``d`` (``a`` = their concatenation on the last axis), and
    ``g (B, T, u)``, when `materialise` says so, else ``None``."""
    t, d, u = g.shape[1], sum(b.shape[2] for b in blocks), g.shape[2]
    if not materialise(t, d, u):
        return None
    kernels = [ops.einsum("btd,btu->bdu", b, g) for b in blocks]
    return ops.concatenate(kernels, axis=1) if len(kernels) > 1 else kernels[0]


def gram_sq_norms(blocks, g):
    """Per-example ``‖a_iᵀ g_i‖_F² = Σ_{s,t} (a_s·a_t)(g_s·g_t)``, without ``a_iᵀ g_i``
    (``a`` given as ``blocks``, `per_example_kernels`)."""
    if g.shape[1] == 1:
        return functools.reduce(ops.add, [sum_squares(b[:, 0]) for b in blocks]) * sum_squares(g[:, 0])
    ga = functools.reduce(ops.add, [ops.einsum("bsd,btd->bst", b, b) for b in blocks])
    gg = ops.einsum("bsu,btu->bst", g, g)
    return ops.sum(ga * gg, axis=(1, 2))


def weighted_kernel_sum(blocks, g, c):
    """``Σ_i c_i a_iᵀ g_i`` ``(d, u)`` from the rows (``a`` given as ``blocks``); ``c``
    scales ``g`` once, not each block."""
    g = g * ops.cast(c, g.dtype)[:, None, None]
    parts = [ops.einsum("btd,btu->du", b, g) for b in blocks]
    return ops.concatenate(parts, axis=0) if len(parts) > 1 else parts[0]


def join_rows(parts):
    """Several calls' rows ``(B, T_k, ·)``, one after the other: ``(B, Σ T_k, ·)``."""
    return ops.concatenate(parts, axis=1) if len(parts) > 1 else parts[0]


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
        """The input rows ``a (B, T, d)`` as a list of blocks along ``d`` (here one),
        ``g (B, T, u)`` in matmul form, and the kernel's letters ``K`` and ``I + U``
        (the kernel's axes in matmul form)."""
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
        return [ops.cast(a, g.dtype)], g, (k, contracted + units)

    def per_example(self, layer, calls):
        rows = [self._rows(layer, a, g) for a, g in calls]
        blocks = [join_rows(parts) for parts in zip(*(r[0] for r in rows))]
        g = join_rows([r[1] for r in rows])
        bias = None if layer.bias is None else add_up(calls, lambda _, g: reduce_to(g, layer.bias.shape))
        return blocks, g, per_example_kernels(blocks, g), rows[0][2], bias

    def sq_norms(self, layer, state):
        blocks, g, kernels, _, bias = state
        sq = gram_sq_norms(blocks, g) if kernels is None else sum_squares(kernels)
        return sq if bias is None else sq + sum_squares(bias)

    def weighted_sums(self, layer, state, c):
        blocks, g, kernels, (spec, letters), bias = state
        c = ops.cast(c, g.dtype)
        if kernels is None:
            kernel = weighted_kernel_sum(blocks, g, c)
        else:
            kernel = ops.tensordot(c, kernels, axes=1)
        shape = [layer.kernel.shape[spec.index(ch)] for ch in letters]
        kernel = ops.transpose(ops.reshape(kernel, shape), [letters.index(ch) for ch in spec])
        out = {layer.kernel.path: kernel}
        if bias is not None:
            out[layer.bias.path] = ops.tensordot(c, bias, axes=1)
        return out
