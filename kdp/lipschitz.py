"""Lipschitz primitives in `keras.ops`: certified Björck projection and conv factors.

The projection used by every kdp kernel is a *certified* orthogonalisation:

* ``G = WᵀW`` (the smaller Gram matrix) is computed once per iteration;
* ``Λ = max_i Σ_j |G_ij|`` is an upper bound on ``λ_max(G) = ‖W‖₂²`` (an induced
  norm bounds the spectral radius); if ``Λ > 3.5`` the kernel is rescaled so that
  ``‖W‖₂² ≤ 3.5``;
* one Björck step ``W ← W (3/2 I − 1/2 G)`` maps a singular value ``s`` to
  ``s (3 − s²)/2``, whose square is ``f(λ) = λ (3/2 − λ/2)²`` with
  ``f(λ) − 1 = (λ − 1)² (λ − 4) / 4 ≤ 0`` for ``λ ≤ 4``.

Hence, in exact arithmetic, **every** Björck step started from ``‖W‖₂² ≤ 4`` returns
a kernel with ``‖W‖₂ ≤ 1``, however early the iteration stops: the claim
``‖W‖₂ ≤ 1`` never relies on power iteration (which under-estimates) or on
convergence. Floating-point rounding is covered by a final shrink factor
``1 − FLOAT_MARGIN`` (tests measure the exact largest singular value with an SVD).

Reference: Björck & Bowie (1971); Anil et al. (2019) for Björck in Lipschitz nets;
the certificate is kdp's own (see DESIGN §3.5).
"""

import math

from keras import ops

#: relative shrink applied after the last Björck step, to cover float32 rounding.
FLOAT_MARGIN = 1e-5
#: the Gram bound above which the kernel is rescaled before Björck (must be < 4).
_PRESCALE_LIMIT = 3.5


def _is_tall(shape):
    return shape[0] >= shape[1]


def gram(w):
    """The smaller Gram matrix of a 2-D kernel: ``WᵀW`` if tall, else ``WWᵀ``."""
    if _is_tall(w.shape):
        return ops.matmul(ops.transpose(w), w)
    return ops.matmul(w, ops.transpose(w))


def gram_norm_bound(g):
    """Upper bound on ``λ_max(g)`` for a symmetric matrix: its max absolute row sum."""
    return ops.max(ops.sum(ops.abs(g), axis=1))


def _bjorck_step(w, g):
    eye = ops.eye(g.shape[0], dtype=w.dtype)
    p = 1.5 * eye - 0.5 * g
    return ops.matmul(w, p) if _is_tall(w.shape) else ops.matmul(p, w)


def orthogonalize(w, iterations=1, tolerance=None):
    """Certified Björck orthogonalisation of a 2-D kernel.

    Args:
        w: tensor of shape ``(m, n)``.
        iterations: maximum number of Björck steps (≥ 1).
        tolerance: if given, stop early once ``max_ij |G − I| < tolerance``
            (the result is certified either way).

    Returns:
        A kernel of the same shape with ``‖W‖₂ ≤ 1`` (exact SVD), close to the
        nearest matrix with orthonormal rows or columns.
    """
    if iterations < 1:
        raise ValueError(f"iterations must be >= 1, got {iterations}")
    g = gram(w)
    bound = ops.maximum(gram_norm_bound(g), 1e-30)
    scale = ops.where(bound > _PRESCALE_LIMIT, _PRESCALE_LIMIT / bound, 1.0)
    w = w * ops.sqrt(scale)
    g = g * scale
    w = _bjorck_step(w, g)
    if iterations > 1:
        eye = ops.eye(g.shape[0], dtype=w.dtype)

        def cond(i, w_):
            if tolerance is None:
                return i < iterations
            err = ops.max(ops.abs(gram(w_) - eye))
            return ops.logical_and(i < iterations, err >= tolerance)

        def body(i, w_):
            return i + 1, _bjorck_step(w_, gram(w_))

        _, w = ops.while_loop(cond, body, (ops.convert_to_tensor(1), w))
    return w * (1.0 - FLOAT_MARGIN)


def patches_per_pixel(kernel_size, strides):
    """Max number of convolution windows that contain one input pixel.

    For a window of ``k`` and stride ``s`` along an axis a pixel lies in at most
    ``ceil(k / s)`` windows, with zero ('same') or no ('valid') padding alike.
    """
    return math.prod(math.ceil(k / s) for k, s in zip(kernel_size, strides))


def conv_lipschitz_factor(kernel_size, strides):
    """``√(patches per pixel)``: ``‖conv_Φ‖ ≤ factor · ‖Φ_r‖₂`` and
    ``‖∂ conv_Φ(x) / ∂Φ‖ ≤ factor · ‖x‖`` (Property 3 of Béthune et al. 2024,
    with the stride-aware patch count), where ``Φ_r`` is the kernel reshaped to
    ``(k_h·k_w·C_in, C_out)``.
    """
    return math.sqrt(patches_per_pixel(kernel_size, strides))
