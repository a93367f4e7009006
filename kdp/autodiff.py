"""The one backend-specific module: gradients of plain functions.

Everything else in kdp is written in `keras.ops`; Keras' own trainers do the
training-step differentiation. Tests, audits and per-example methods need a
gradient of an arbitrary function, which Keras does not expose: it lives here.
"""

import keras
import numpy as np

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
    """``fn`` compiled by the backend (``jax.jit`` / ``tf.function``), one trace per
    input shape on both (static shapes); returned as is on other backends."""
    backend = keras.backend.backend()
    if backend == "jax":
        import jax

        return jax.jit(fn)
    if backend == "tensorflow":
        import tensorflow as tf

        return tf.function(fn)
    return fn


def host_check(check, after):
    """A float32 scalar ``1`` that calls ``check()`` on the host **each time** the
    compiled computation containing it executes (not once when it is traced),
    after the tensor ``after`` is computed (TensorFlow may otherwise run it
    before the step's input is read; a JAX step's inputs already exist).

    If ``check`` raises, that execution fails (JAX: `JaxRuntimeError`, TensorFlow:
    an `OpError`, each carrying the message) and returns nothing. Multiply a
    result by the scalar so that the engine cannot prune the call. JAX runs it
    with `jax.experimental.io_callback` (not deduplicated, not cached), TensorFlow
    with `tf.numpy_function` (not compilable by XLA: kdp's TensorFlow steps run
    without ``jit_compile``)."""
    def call():
        check()
        return np.ones((), "float32")

    backend = keras.backend.backend()
    if backend == "jax":
        import jax
        from jax.experimental import io_callback

        return io_callback(call, jax.ShapeDtypeStruct((), "float32"), ordered=False)
    if backend == "tensorflow":
        import tensorflow as tf

        value = tf.numpy_function(lambda _: call(), [tf.stop_gradient(after)], tf.float32,
                                  stateful=True)
        value.set_shape(())
        return value
    return keras.ops.convert_to_tensor(call())


def trace_shapes(fn, shape, dtype):
    """Run ``fn`` on an abstract tensor of static ``shape`` (shapes only, no compute).

    ``jax.eval_shape`` / a `tf.function` trace; ``fn``'s side effects (e.g.
    recorded intermediate tensors, whose static shapes can be read) happen
    once, inside the trace. Usable eagerly and inside a traced training step.
    """
    backend = keras.backend.backend()
    if backend == "jax":
        import jax

        jax.eval_shape(fn, jax.ShapeDtypeStruct(tuple(shape), dtype))
        return
    if backend == "tensorflow":
        import tensorflow as tf

        tf.function(fn, autograph=False).get_concrete_function(tf.TensorSpec(tuple(shape), dtype))
        return
    raise NotImplementedError(f"trace_shapes supports jax and tensorflow, not {backend!r}")


def evaluate_shapes(fn, *args):
    """``fn(*args)`` for its shapes and errors: on JAX traced on abstract
    tensors of ``args``' shapes and dtypes (``jax.eval_shape``: no compute,
    nothing compiled, where eager JAX would compile and keep one executable per
    operation); elsewhere run eagerly (TensorFlow's eager ops compile nothing).
    ``args`` may be structures of arrays."""
    if keras.backend.backend() == "jax":
        import jax

        return jax.eval_shape(fn, *args)
    return fn(*args)


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


def probe_cotangents(forward, cotangent):
    """Cotangents at chosen intermediate tensors, with one forward and one backward pass.

    ``forward(probe)`` runs a computation and returns ``(values, aux)``; inside it,
    every tensor ``z`` whose cotangent is wanted is replaced by ``probe(z)``
    (which returns ``z + p`` for a zero tensor ``p`` shaped like ``z``, one per
    call, in call order). ``aux`` holds whatever the caller needs from the
    forward pass (e.g. layer inputs); under JAX it must be returned, not kept
    on the side.

    Returns:
        ``(values, aux, cotangents)``: ``cotangents[k] = ∂⟨cotangent, values⟩/∂p_k``,
        i.e. the cotangent of the ``k``-th probed tensor.
    """
    backend = keras.backend.backend()
    if backend == "jax":
        import jax
        import jax.numpy as jnp

        shapes = []

        def record(z):
            shapes.append(jax.ShapeDtypeStruct(z.shape, z.dtype))
            return z

        jax.eval_shape(lambda: forward(record))  # abstract: shapes only, no compute

        def probed(probes):
            it = iter(probes)
            return forward(lambda z: z + next(it))

        zeros = [jnp.zeros(s.shape, s.dtype) for s in shapes]
        values, vjp_fn, aux = jax.vjp(probed, zeros, has_aux=True)
        (cotangents,) = vjp_fn(jnp.asarray(cotangent, values.dtype).reshape(values.shape))
        return values, aux, list(cotangents)
    if backend == "tensorflow":
        import tensorflow as tf

        probes = []
        with tf.GradientTape() as tape:

            def probe(z):
                p = tf.zeros_like(z)
                tape.watch(p)
                probes.append(p)
                return z + p

            values, aux = forward(probe)
        cotangents = tape.gradient(
            values, probes, output_gradients=tf.reshape(tf.cast(cotangent, values.dtype), tf.shape(values)),
            unconnected_gradients="zero",
        )
        return values, aux, list(cotangents)
    raise NotImplementedError(f"probe_cotangents supports jax and tensorflow, not {backend!r}")


def weighted_per_example_gradients(model, loss_fn, x, y, weights, variables, training=True):
    """``∇_v (w_i · loss_fn(y_i, model(x_i)))`` for every example ``i``, vectorized.

    Like `per_example_gradients`, but only for ``variables`` (a subset of
    ``model.trainable_variables``), with per-example weights, in training mode,
    and usable inside a traced training step (the current values of the
    variables are those of the step).

    Args:
        model: a built Keras model.
        loss_fn: ``(y, y_pred) -> per-example losses`` of shape ``(batch,)``.
        x, y: one batch; ``weights``: shape ``(batch,)``.
        variables: the variables to differentiate.

    Returns:
        A list, one array ``(batch, *variable.shape)`` per variable.
    """
    backend = keras.backend.backend()
    if backend == "jax":
        import jax
        import jax.numpy as jnp

        trainable = list(model.trainable_variables)
        index = {id(v): j for j, v in enumerate(trainable)}
        positions = [index[id(v)] for v in variables]
        base = [v.value for v in trainable]
        others = [v.value for v in model.non_trainable_variables]

        def example_loss(subset, xi, yi, wi):
            values = list(base)
            for j, s in zip(positions, subset):
                values[j] = s
            out, _ = model.stateless_call(values, others, xi[None], training=training)
            return wi * jnp.sum(loss_fn(yi[None], out))

        return list(jax.vmap(jax.grad(example_loss), in_axes=(None, 0, 0, 0))(
            [base[j] for j in positions], jnp.asarray(x), jnp.asarray(y), jnp.asarray(weights)
        ))
    if backend == "tensorflow":
        import tensorflow as tf

        def example_grads(args):
            xi, yi, wi = args
            with tf.GradientTape() as tape:
                value = wi * tf.reduce_sum(loss_fn(yi[None], model(xi[None], training=training)))
            grads = tape.gradient(value, variables, unconnected_gradients="zero")
            return [tf.convert_to_tensor(g) for g in grads]  # IndexedSlices (embeddings) -> dense

        x, y = tf.convert_to_tensor(x), tf.convert_to_tensor(y)
        return list(tf.vectorized_map(example_grads, (x, y, tf.cast(weights, "float32"))))
    raise NotImplementedError(
        f"weighted_per_example_gradients supports jax and tensorflow, not {backend!r}"
    )
