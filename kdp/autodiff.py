"""The one backend-specific module: gradients of plain functions.

Everything else in kdp is written in `keras.ops`; Keras' own trainers do the
training-step differentiation. Tests, audits and per-example methods need a
gradient of an arbitrary function, which Keras does not expose: it lives here.
"""

import keras

from kdp.layers.clip import per_example_units


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


def compile_function(fn):
    """``fn`` compiled by the backend (``jax.jit`` / ``tf.function``); as is elsewhere."""
    backend = keras.backend.backend()
    if backend == "jax":
        import jax

        return jax.jit(fn)
    if backend == "tensorflow":
        import tensorflow as tf

        return tf.function(fn, reduce_retracing=True)
    return fn


def per_example_gradients(model, loss, x, y):
    """Gradient of every example's own loss, vectorized over the batch.

    For each ``i``, ``∇_v loss.call(y_i, model(x_i))`` (unreduced: not divided by
    the batch size nor weighted), each example run through the model alone as a
    batch of one, so nothing couples the examples.

    Args:
        model: a built Keras model.
        loss: a loss whose ``call(y_true, y_pred)`` returns per-example values.
        x, y: one batch of inputs and labels (arrays or tensors).

    Returns:
        ``{variable.path: array of shape (batch, *variable.shape)}`` for every
        trainable variable of ``model``.
    """
    with per_example_units(model):
        return _per_example_gradients(model, loss, x, y)


def _per_example_gradients(model, loss, x, y):
    backend = keras.backend.backend()
    variables = model.trainable_variables
    if backend == "jax":
        import jax
        import jax.numpy as jnp

        others = [v.value for v in model.non_trainable_variables]

        def example_loss(trainable, xi, yi):
            out, _ = model.stateless_call(trainable, others, xi[None], training=False)
            return jnp.sum(loss.call(yi[None], out))

        grads = jax.vmap(jax.grad(example_loss), in_axes=(None, 0, 0))(
            [v.value for v in variables], jnp.asarray(x), jnp.asarray(y)
        )
    elif backend == "tensorflow":
        import tensorflow as tf

        def example_grads(args):
            xi, yi = args
            with tf.GradientTape() as tape:
                value = tf.reduce_sum(loss.call(yi[None], model(xi[None], training=False)))
            return tape.gradient(value, variables, unconnected_gradients="zero")

        grads = tf.vectorized_map(example_grads, (tf.convert_to_tensor(x), tf.convert_to_tensor(y)))
    else:
        raise NotImplementedError(
            f"per_example_gradients supports the jax and tensorflow backends, not {backend!r}"
        )
    return {v.path: g for v, g in zip(variables, grads)}
