"""The one backend-specific module: gradients of plain functions.

Everything else in kdp is written in `keras.ops`; Keras' own trainers do the
training-step differentiation. Tests, audits and per-example methods need a
gradient of an arbitrary function, which Keras does not expose: it lives here.
"""

import keras


def gradient(fn, *args):
    """``∇ fn(*args)`` with respect to every positional argument (a tuple).

    ``fn`` must return a scalar tensor; ``args`` are tensors or arrays.
    """
    backend = keras.backend.backend()
    if backend == "jax":
        import jax

        return jax.grad(fn, argnums=tuple(range(len(args))))(*args)
    if backend == "tensorflow":
        import tensorflow as tf

        args = [tf.convert_to_tensor(a) for a in args]
        with tf.GradientTape() as tape:
            for a in args:
                tape.watch(a)
            value = fn(*args)
        return tuple(tape.gradient(value, args))
    if backend == "torch":
        import torch

        args = [torch.as_tensor(a).detach().requires_grad_(True) for a in args]
        return tuple(torch.autograd.grad(fn(*args), args))
    raise NotImplementedError(f"kdp.autodiff does not support the {backend!r} backend")
