"""Per-example objectives of the two learners and their gradients, batched in ``keras.ops``.

Shapes: ``f`` is ``(U, r, K)`` (U independent models, ``r = p + 1`` rows with
the bias row first), ``x`` is ``(U, b, r)`` (augmented, clipped inputs), ``y``
is one-hot ``(U, b, K)``; ``lam`` and ``h`` are ``(U,)``.

Softmax-SLP (paper eq. in §4):
    ``J(f) = (Λ/2)‖f‖² + mean_j CE(softmax(fᵀx_j), y_j)``,
    ``∇J = Λf + mean_j x_j (softmax(fᵀx_j) − y_j)ᵀ``.
One-vs-rest Huber SVM (Ex. 3.16), class k with ``ỹ_k = 2y_k − 1``:
    ``J_k(f_k) = (Λ/2)‖f_k‖² + mean_j ℓ_h(ỹ_jk f_kᵀx_j)``,
    ``ℓ_h(z) = 0 (z > 1+h); (1+h−z)²/(4h) (|1−z| ≤ h); 1 − z (z < 1−h)``.
The K class objectives are independent; the gradient is not divided by K
(as in the paper's Ex. 3.16, one objective per class).
"""

from keras import ops


def huber(z, h):
    """Huber hinge ``ℓ_h(z)`` (Chaudhuri et al. 2011, eq. 7)."""
    quad = ops.square(1.0 + h - z) / (4.0 * h)
    return ops.where(z > 1.0 + h, ops.zeros_like(z), ops.where(z < 1.0 - h, 1.0 - z, quad))


def huber_derivative(z, h):
    """``ℓ_h'(z) ∈ [−1, 0]``, continuous, ``|ℓ_h''| ≤ 1/(2h)``."""
    quad = -(1.0 + h - z) / (2.0 * h)
    return ops.where(z > 1.0 + h, ops.zeros_like(z), ops.where(z < 1.0 - h, -ops.ones_like(z), quad))


def _col(v):
    return ops.reshape(ops.convert_to_tensor(v, dtype="float32"), (-1, 1, 1))


def objective(kind, f, x, y, lam, h=None):
    """``J`` per model, shape ``(U,)`` (for the SVM the sum of the K class objectives)."""
    logits = ops.matmul(x, f)
    reg = 0.5 * ops.reshape(_col(lam), (-1,)) * ops.sum(ops.square(f), axis=(1, 2))
    if kind == "softmax":
        ce = -ops.sum(y * ops.log_softmax(logits, axis=-1), axis=-1)
        return reg + ops.mean(ce, axis=1)
    sign = 2.0 * y - 1.0
    loss = huber(sign * logits, _col(h))
    return reg + ops.mean(ops.sum(loss, axis=-1), axis=1)


def gradient(kind, f, x, y, lam, h=None):
    """``∇_f J`` (mini-batch mean plus regulariser), shape ``(U, r, K)``."""
    logits = ops.matmul(x, f)
    if kind == "softmax":
        residual = ops.softmax(logits, axis=-1) - y
    else:
        sign = 2.0 * y - 1.0
        residual = huber_derivative(sign * logits, _col(h)) * sign
    batch = ops.cast(ops.shape(x)[1], f.dtype)
    return _col(lam) * f + ops.matmul(ops.transpose(x, (0, 2, 1)), residual) / batch


def project(kind, f, R):
    """Euclidean projection onto ``‖f‖_F ≤ R`` (softmax) or ``‖f_k‖ ≤ R`` per class (SVM).

    The ball, not the sphere (Kirschte et al. 2022, Alg. 1); the bias row is part of the norm.
    """
    axes = (1, 2) if kind == "softmax" else (1,)
    norms = ops.sqrt(ops.sum(ops.square(f), axis=axes, keepdims=True))
    return f * ops.minimum(1.0, _col(R) / ops.maximum(norms, 1e-30))
