"""Keras constraints that project kernels after every optimizer update.

Keras applies ``variable.constraint`` right after each optimizer step (also in the
stateless JAX path), so the next forward pass uses the projected kernel and the
bounds of the layer hold exactly: projected gradient descent, post-processing
of the private update, no privacy cost (Béthune et al. 2024, Requirement 3).
"""

import functools
import weakref

import keras
from keras import ops

from kdp.layers.base import serializable
from kdp.lipschitz import orthogonalize


@serializable
class OrthogonalProjection(keras.constraints.Constraint):
    """Certified Björck projection of a kernel onto ``{‖W_r‖₂ ≤ 1 / scale}``.

    The kernel is reshaped to ``(-1, units)`` (``W_r``) and ``scale · W_r`` is
    orthogonalised by :func:`kdp.lipschitz.orthogonalize`, which returns ``W_r``
    with ``‖scale · W_r‖₂ ≤ 1``. ``scale`` is ``√(patches per pixel)`` for
    convolutions and 1 for dense kernels.

    Args:
        iterations: Björck steps per projection (1 is enough to warm-start from
            the previous, already orthogonal, kernel).
        tolerance: early stop once ``max |W_rᵀW_r − I| < tolerance``.
        scale: see above.
    """

    def __init__(self, iterations=1, tolerance=None, scale=1.0):
        self.iterations = int(iterations)
        self.tolerance = tolerance
        self.scale = float(scale)

    def __call__(self, w):
        shape = w.shape
        w2 = ops.reshape(w, (-1, shape[-1]))
        return ops.reshape(orthogonalize(w2, self.iterations, self.tolerance, self.scale), shape)

    def get_config(self):
        return {
            "iterations": self.iterations,
            "tolerance": self.tolerance,
            "scale": self.scale,
        }


_COMPILED = weakref.WeakKeyDictionary()


def project(constraint, value):
    """``constraint(value)`` outside a training step (initial kernels, `fit`'s
    and `train_on_batch`'s projection of set weights).

    On JAX it runs as one compiled program, cached per constraint and shape:
    eagerly, JAX compiles and keeps one XLA executable per operation and shape
    (≈ 40 MB of resident memory for the projections of a 784→512→512 MLP).
    """
    if keras.backend.backend() != "jax":
        return constraint(value)
    from kdp.autodiff import compile_function

    compiled = _COMPILED.get(constraint)
    if compiled is None:
        compiled = _COMPILED[constraint] = compile_function(constraint)
    return compiled(value)


@functools.lru_cache(maxsize=None)
def full_projection(iterations, tolerance, scale):
    """The shared `OrthogonalProjection` of these settings (one compiled program
    per kernel shape for every layer that uses it)."""
    return OrthogonalProjection(iterations, tolerance, scale)


@serializable
class BallProjection(keras.constraints.Constraint):
    """Projection onto the L2 ball of radius ``norm_max`` (1-Lipschitz, convex)."""

    def __init__(self, norm_max):
        self.norm_max = float(norm_max)

    def __call__(self, w):
        norm = ops.sqrt(ops.sum(ops.square(w)))
        return w * ops.minimum(1.0, self.norm_max / ops.maximum(norm, 1e-12))

    def get_config(self):
        return {"norm_max": self.norm_max}
