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


def weighted_per_example_gradients(model, forward, x, y, weights, variables):
    """Each example run alone, as a batch of one, vectorized over the batch.

    ``forward(call, probe, x_i, y_i) -> (value, aux)`` computes example ``i``'s
    scalar loss, ``x_i, y_i`` its batch of one and ``call(t)`` the model's
    training forward pass on the variables being differentiated; inside it, every
    tensor ``z`` whose cotangent is wanted is replaced by ``probe(z)`` (``z`` plus a
    zero tensor ``p_k``, one per call, in call order), and ``aux`` holds what the
    caller keeps from the pass (e.g. layer inputs; under JAX it must be returned,
    not kept on the side). Nothing couples the examples: example ``i``'s results
    depend on ``x_i, y_i`` and the variables alone, whatever the model does across
    its batch axis. Usable eagerly and inside a traced training step.

    Args:
        model: a built Keras model.
        x, y: one batch; ``weights``: shape ``(batch,)``.
        variables: the trainable variables to differentiate.

    Returns:
        ``(aux, cotangents, grads)``, each a list of arrays with a leading batch axis:
        ``cotangents[k][i] = ∂(w_i value_i)/∂p_k`` and
        ``grads[j][i] = ∂(w_i value_i)/∂variables[j]``.
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
        x, y, weights = jnp.asarray(x), jnp.asarray(y), jnp.asarray(weights)

        def run(subset, probe, xi, yi):
            values = list(base)
            for j, s in zip(positions, subset):
                values[j] = s
            return forward(lambda t: model.stateless_call(values, others, t, training=True)[0],
                           probe, xi, yi)

        shapes = []

        def record(z):
            shapes.append(jax.ShapeDtypeStruct(z.shape, z.dtype))
            return z

        subset = [base[j] for j in positions]
        jax.eval_shape(lambda: run(subset, record, x[:1], y[:1]))  # abstract: shapes only

        def example(subset, xi, yi, wi):
            def value(subset, probes):
                it = iter(probes)
                v, aux = run(subset, lambda z: z + next(it), xi[None], yi[None])
                return wi * v, aux

            zeros = [jnp.zeros(s.shape, s.dtype) for s in shapes]
            (grads, cotangents), aux = jax.grad(value, argnums=(0, 1), has_aux=True)(subset, zeros)
            return aux, cotangents, grads

        aux, cotangents, grads = jax.vmap(example, in_axes=(None, 0, 0, 0))(subset, x, y, weights)
        return list(aux), list(cotangents), list(grads)
    if backend == "tensorflow":
        import tensorflow as tf

        variables = list(variables)

        def example(args):
            xi, yi, wi = args
            probes = []
            with tf.GradientTape() as tape:

                def probe(z):
                    p = tf.zeros_like(z)
                    tape.watch(p)
                    probes.append(p)
                    return z + p

                v, aux = forward(lambda t: model(t, training=True), probe, xi[None], yi[None])
                v = tf.cast(wi, v.dtype) * v
            grads = tape.gradient(v, variables + probes, unconnected_gradients="zero")
            grads = [tf.convert_to_tensor(g) for g in grads]  # IndexedSlices (embeddings) -> dense
            return list(aux), grads[len(variables):], grads[:len(variables)]

        x, y = tf.convert_to_tensor(x), tf.convert_to_tensor(y)
        aux, cotangents, grads = tf.vectorized_map(example, (x, y, tf.cast(weights, "float32")))
        return list(aux), list(cotangents), list(grads)
    raise NotImplementedError(
        f"weighted_per_example_gradients supports jax and tensorflow, not {backend!r}"
    )
