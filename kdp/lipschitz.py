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
convergence. Float32 rounding is covered by a final shrink factor
``1 − FLOAT_MARGIN`` (tests measure the exact largest singular value with an SVD).

That margin covers float32 products, not the reduced precision that GPUs and TPUs
use for float32 matmuls by default (TF32: 10 mantissa bits, ‖W‖₂ up to ≈ 1 + 4e-4
after a few quick projections; bfloat16 on TPUs: 7 bits). Every product of the
projection therefore goes through `precise_matmul`.

References: Björck & Bowie (1971); Anil et al. (2019) for Björck in Lipschitz
nets; Henry, Tang & Heinecke (2019) for the split products of `precise_matmul`.
"""

import math

import keras
from keras import ops

#: relative shrink applied after the last Björck step, to cover float32 rounding.
FLOAT_MARGIN = 1e-5
#: the Gram bound above which the kernel is rescaled before Björck (must be < 4).
_PRESCALE_LIMIT = 3.5


# -- full-float32 products -------------------------------------------------------

#: keeps the sign, the exponent and the 7 stored mantissa bits of a float32: a
#: bfloat16, exact in bfloat16 and in TF32 (10 bits).
_BF16_MASK = -65536  # 0xFFFF0000
_BF16_HALF_ULP = 0x8000


def _accelerator_visible():
    """True if the backend may run float32 matmuls at reduced precision (TF32 on
    an Ampere or later GPU, bfloat16 passes on a TPU): a GPU or TPU is visible."""
    backend = keras.backend.backend()
    if backend == "tensorflow":
        import tensorflow as tf

        devices = tf.config.list_physical_devices
        return bool(devices("GPU") or devices("TPU"))
    if backend == "torch":
        import torch

        return torch.cuda.is_available()
    return backend != "numpy"


def _bitcast(x, dtype):
    if hasattr(ops, "view"):
        return ops.view(x, dtype)
    import tensorflow as tf  # Keras < 3.10 on TensorFlow (JAX never gets here)

    return tf.bitcast(x, dtype)


def _bf16_round(x):
    """``x`` rounded to its 8 leading significant bits (exactly a bfloat16)."""
    bits = _bitcast(x, "int32")
    return _bitcast(ops.bitwise_and(bits + _BF16_HALF_ULP, _BF16_MASK), "float32")


def _split3(x):
    """``x = x1 + x2 + x3`` exactly, each piece exact in bfloat16 and in TF32:
    ``x1`` and ``x2`` hold 8 significant bits each, ``x3`` the last ≤ 8."""
    x1 = _bf16_round(x)
    r = x - x1  # exact (Sterbenz): at most 16 significant bits
    x2 = _bf16_round(r)
    return x1, x2, r - x2  # r - x2 exact as well


def split_matmul(a, b):
    """``a @ b`` from six products of bfloat16-exact pieces (Henry et al. 2019).

    Each piece is exact in any float32 matmul mode (bfloat16, TF32, float32) and
    each product of two pieces (16 bits) is exact in the float32 accumulator; the
    three dropped products add up to about ``2⁻²³ |a||b|`` (entrywise). So the
    result is as accurate as a float32 product whatever precision the device uses
    for ``ops.matmul``. Not differentiable (bit casts).
    """
    a1, a2, a3 = _split3(a)
    b1, b2, b3 = _split3(b)
    mm = ops.matmul
    small = mm(a1, b3) + mm(a2, b2) + mm(a3, b1)
    return mm(a1, b1) + ((mm(a1, b2) + mm(a2, b1)) + small)


def precise_matmul(a, b):
    """``a @ b`` at float32 precision on every backend and device.

    GPUs run float32 matmuls in TF32 by default, in JAX and in TensorFlow alike
    (TPUs in bfloat16), which ``FLOAT_MARGIN`` does not cover.

    * JAX: ``precision=HIGHEST`` on this product only (float32 on GPUs, six
      bfloat16 passes on TPUs); no global setting changes.
    * TensorFlow (and torch): the only switch is process-wide
      (``tf.config.experimental.enable_tensor_float_32_execution``, read when a
      graph is compiled or run, and it would slow the whole model), so kdp does
      not touch it: when a GPU or TPU is visible it uses `split_matmul`, whose
      pieces no matmul mode rounds. On a CPU, ``ops.matmul`` is float32.

    Args:
        a, b: matrices of the same float dtype (only float32 is split).

    Returns:
        ``a @ b``.
    """
    a, b = ops.convert_to_tensor(a), ops.convert_to_tensor(b)
    if keras.backend.backend() == "jax":
        import jax

        return jax.numpy.matmul(a, b, precision=jax.lax.Precision.HIGHEST)
    float32 = keras.backend.standardize_dtype(a.dtype) == "float32"
    if float32 and _accelerator_visible():
        return split_matmul(a, b)
    return ops.matmul(a, b)


# -- certified projection ---------------------------------------------------------

def _is_tall(shape):
    return shape[0] >= shape[1]


#: below this many rows, the Gram matrix is one product (its blocks would not pay).
_SYMMETRIC_GRAM_MIN = 128


def gram(w):
    """The smaller Gram matrix of a 2-D kernel: ``WᵀW`` if tall, else ``WWᵀ``.

    From ``n = 128`` rows of the Gram matrix up it is assembled from three of its
    four blocks: with ``W = [A B]`` (column halves; row halves if wide),
    ``G = [[AᵀA, AᵀB], [(AᵀB)ᵀ, BᵀB]]``, 3/4 of the products of ``WᵀW`` and
    exactly symmetric.
    """
    tall = _is_tall(w.shape)
    n = w.shape[1] if tall else w.shape[0]

    def product(a, b):  # aᵀb (columns) if tall, abᵀ (rows) if wide
        return precise_matmul(ops.transpose(a), b) if tall else precise_matmul(a, ops.transpose(b))

    if n < _SYMMETRIC_GRAM_MIN:
        return product(w, w)
    h = n // 2
    a, b = (w[:, :h], w[:, h:]) if tall else (w[:h], w[h:])
    ab = product(a, b)
    top = ops.concatenate([product(a, a), ab], axis=1)
    bottom = ops.concatenate([ops.transpose(ab), product(b, b)], axis=1)
    return ops.concatenate([top, bottom], axis=0)


def gram_norm_bound(g):
    """Upper bound on ``λ_max(g)`` for a symmetric matrix: its max absolute row sum."""
    return ops.max(ops.sum(ops.abs(g), axis=1))


def _bjorck_step(w, g, gram_scale=1.0, factor=1.0):
    """``factor · W (3/2 I − 1/2 gram_scale · G)``, ``G`` the Gram matrix of ``W``:
    with ``gram_scale = c²`` and ``factor = 1``, one Björck step of ``c·W``
    divided by ``c``. The scalars act on the small square factor, not on ``W``."""
    eye = ops.eye(g.shape[0], dtype=w.dtype)
    p = (1.5 * factor) * eye - (0.5 * factor * gram_scale) * g
    return precise_matmul(w, p) if _is_tall(w.shape) else precise_matmul(p, w)


def orthogonalize(w, iterations=1, tolerance=None, scale=1.0):
    """Certified Björck orthogonalisation of the 2-D kernel ``scale · W``.

    The scale, the prescale (``‖scale·W‖₂² ≤ 3.5``) and, for one step, the final
    shrink ``1 − FLOAT_MARGIN`` act on the small square factor of the first step
    (the Gram matrix of ``scale·W`` is ``scale² G``), so one step costs the Gram
    matrix and one product, nothing more over ``W``.

    Args:
        w: tensor of shape ``(m, n)``.
        iterations: maximum number of Björck steps (≥ 1).
        tolerance: if given, stop early once ``max_ij |scale² G − I| < tolerance``
            (the result is certified either way).
        scale: a Python float > 0 (the convolutions' patch factor; 1 for dense).

    Returns:
        A kernel of the same shape with ``‖scale · W‖₂ ≤ 1`` (exact SVD), close to
        ``1/scale`` times the nearest matrix with orthonormal rows or columns.
    """
    if iterations < 1:
        raise ValueError(f"iterations must be >= 1, got {iterations}")
    s2 = float(scale) ** 2
    g = gram(w)
    bound = ops.maximum(gram_norm_bound(g) * s2, 1e-30)
    prescale = ops.where(bound > _PRESCALE_LIMIT, _PRESCALE_LIMIT / bound, 1.0)
    shrink = 1.0 - FLOAT_MARGIN
    if iterations == 1:
        return _bjorck_step(w, g, prescale * s2, ops.sqrt(prescale) * shrink)
    w = _bjorck_step(w, g, prescale * s2, ops.sqrt(prescale))
    eye = ops.eye(g.shape[0], dtype=w.dtype)

    def cond(i, w_):
        if tolerance is None:
            return i < iterations
        err = ops.max(ops.abs(gram(w_) * s2 - eye))
        return ops.logical_and(i < iterations, err >= tolerance)

    def body(i, w_):
        return i + 1, _bjorck_step(w_, gram(w_), s2)

    _, w = ops.while_loop(cond, body, (ops.convert_to_tensor(1), w))
    return w * shrink


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
