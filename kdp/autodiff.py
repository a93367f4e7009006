"""The one backend-specific module: gradients of plain functions.

Everything else in kdp is written in `keras.ops`; Keras' own trainers do the
training-step differentiation. Tests, audits and per-example methods need a
gradient of an arbitrary function, which Keras does not expose: it lives here.
"""

import keras
import numpy as np
from keras import ops

from kdp._tf_vectorize import vectorization
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


def sequential_loop(lower, upper, body, init):
    """`keras.ops.fori_loop` whose iterations run one after the other: TensorFlow's
    ``while_loop`` otherwise runs up to 10 iterations at once where one does not read
    the previous one's result (the passes of virtual batches), and with them their
    memory (JAX's loops are sequential)."""
    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        return tf.while_loop(lambda i, _: i < upper, lambda i, value: (i + 1, body(i, value)),
                             (lower, init), parallel_iterations=1)[1]
    return keras.ops.fori_loop(lower, upper, body, init)


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

        with vectorization():
            grads = tf.vectorized_map(example_grads, (tf.convert_to_tensor(x), tf.convert_to_tensor(y)))
    else:
        raise NotImplementedError(
            f"per_example_gradients supports the jax and tensorflow backends, not {backend!r}"
        )
    return {v.path: g for v, g in zip(variables, grads)}


def random_generators(model):
    """The `keras.random.SeedGenerator`s the layers of ``model`` draw from (Dropout,
    GaussianNoise, augmentation layers, keras_hub's dropouts), not a DP model's
    own noise generator."""
    noise = getattr(model, "_noise_seed", None)
    found = {}
    for layer in model._flatten_layers(include_self=True):
        for g in layer._seed_generators:
            if g is not noise:
                found[id(g)] = g
    return list(found.values())


def _fold_in(seed, data):
    """A new seed, a deterministic hash of ``seed`` (a seed generator's state) and
    the integer ``data`` (a tensor under `jax.vmap` / `tf.vectorized_map`)."""
    backend = keras.backend.backend()
    if backend == "jax":
        import jax

        return jax.random.fold_in(seed, data)
    if backend == "tensorflow":
        import tensorflow as tf

        return tf.random.experimental.stateless_fold_in(tf.cast(seed, "int64"), data)
    raise NotImplementedError(f"per-example seeds support jax and tensorflow, not {backend!r}")


_MISSING = object()


class ExampleSeeds:
    """Within it, the ``k``-th draw of a seed generator of ``model`` (in call order)
    uses the seed ``hash(state, k, example)`` and writes no state.

    Example ``i``'s pass (`start(i)`) thus draws its own random values (a Dropout
    mask, an augmentation), independent of the other examples' (a pass on a
    batch of one would otherwise draw one mask shared by all examples), and
    two passes started with the same index and generator states draw the same
    values: the per-example loss and gradient passes run one computation. With
    ``start(None)`` every pass draws the same values (a fixed probe). The
    generators' states advance only where Keras' own forward pass draws.
    """

    def __init__(self, model):
        self.generators = random_generators(model)
        self._index, self._counts, self._saved = None, {}, []

    def start(self, index):
        """Begin one pass: ``index`` (an integer tensor) or ``None`` (no example)."""
        self._index, self._counts = index, {}

    def _next(self, generator):
        def draw(ordered=True):
            k = self._counts[id(generator)] = self._counts.get(id(generator), -1) + 1
            seed = _fold_in(generator.state.value, k)
            return seed if self._index is None else _fold_in(seed, self._index)

        return draw

    def __enter__(self):
        for g in self.generators:
            self._saved.append((g, g.__dict__.get("next", _MISSING)))
            g.next = self._next(g)
        return self

    def __exit__(self, *exc):
        for g, old in reversed(self._saved):
            if old is _MISSING:
                del g.next
            else:
                g.next = old
        self._saved = []


def _views(t, views):
    """One example ``t`` (no batch axis) as a batch of ``views`` copies."""
    return ops.tile(ops.expand_dims(t, 0), [views] + [1] * len(t.shape))  # static shape kept


_TENSORFLOW_LOOP = (
    "TensorFlow cannot differentiate this model's loop (a recurrent layer such as LSTM, GRU or "
    "SimpleRNN, or ops.while_loop / ops.scan) example by example inside Keras' training step, "
    "whose own gradient tape records the per-example pass. Build the recurrent layers with "
    "unroll=True (short sequences), or train with the JAX backend (KERAS_BACKEND=jax), which "
    "differentiates loops per example.")


def per_example_values(model, forward, x, y, views=1):
    """Example ``i``'s value ``forward(call, probe, x_i, y_i)[0] / views`` (e.g. its
    loss averaged over its ``views`` copies), each example run alone in training
    mode with the seeds of `weighted_per_example_gradients`: the values of the
    computation whose gradients that pass clips. Returns shape ``(batch,)``."""
    return _vectorized(model, forward, x, y, None, [], views, 0, differentiate=False)


def weighted_per_example_gradients(model, forward, x, y, weights, variables, views=1, first_row=0,
                                   with_values=False):
    """Each example run alone, as a batch of ``views`` copies, vectorized over the batch.

    ``forward(call, probe, x_i, y_i) -> (value, aux)`` computes example ``i``'s
    scalar loss (summed over its rows), ``x_i, y_i`` its batch and ``call(t)``
    the model's training forward pass on the variables being differentiated;
    inside it, every tensor ``z`` whose cotangent is wanted is replaced by
    ``probe(z)`` (``z`` plus a zero tensor ``p_k``, one per call, in call order),
    and ``aux`` holds what the caller keeps from the pass (e.g. layer inputs;
    under JAX it must be returned, not kept on the side). Example ``i``'s value
    is ``w_i / views`` times ``forward``'s: with ``views = K > 1`` its ``K``
    copies draw ``K`` augmentations and its gradient is their mean
    ("augmentation multiplicity", De et al. 2022), clipped once. Random layers
    draw per-example values (`ExampleSeeds`, index ``first_row + i``).
    Nothing couples the examples: example ``i``'s results depend on ``x_i, y_i``,
    its seeds and the variables alone, whatever the model does across its batch
    axis. Usable eagerly and inside a traced training step. ``x`` may be a
    structure (dict, list) of arrays with the same number of rows.

    Args:
        model: a built Keras model.
        x, y: one batch; ``weights``: shape ``(batch,)``.
        variables: the trainable variables to differentiate.
        views: copies of each example in its pass.
        first_row: the index of the batch's first row in the step's batch
            (its examples' seeds; a virtual batch starts past 0).
        with_values: also return the values differentiated.

    Returns:
        ``(aux, cotangents, grads)``, each a list of arrays with a leading batch axis:
        ``cotangents[k][i] = ∂(w_i value_i)/∂p_k`` and
        ``grads[j][i] = ∂(w_i value_i)/∂variables[j]``; with ``with_values``,
        ``(aux, cotangents, grads, values)``, ``values[i] = w_i value_i`` (shape
        ``(batch,)``, from the same pass).
    """
    out = _vectorized(model, forward, x, y, weights, variables, views, first_row)
    return out if with_values else out[:3]


def _vectorized(model, forward, x, y, weights, variables, views, first_row, differentiate=True):
    """`weighted_per_example_gradients` (with its values), or
    (``differentiate=False``) the values ``forward(...)[0] / views`` alone, with
    ``weights`` ``None``."""
    backend = keras.backend.backend()
    seeds = ExampleSeeds(model)
    if backend == "jax":
        import jax
        import jax.numpy as jnp

        trainable = list(model.trainable_variables)
        index = {id(v): j for j, v in enumerate(trainable)}
        positions = [index[id(v)] for v in variables]
        base = [v.value for v in trainable]
        others = [v.value for v in model.non_trainable_variables]
        x = keras.tree.map_structure(jnp.asarray, x)
        y = jnp.asarray(y)
        rows = jnp.arange(y.shape[0], dtype="int32") + first_row

        def run(subset, probe, i, xi, yi):
            values = list(base)
            for j, s in zip(positions, subset):
                values[j] = s
            seeds.start(i)
            xi = keras.tree.map_structure(lambda t: _views(t, views), xi)
            return forward(lambda t: model.stateless_call(values, others, t, training=True)[0],
                           probe, xi, _views(yi, views))

        subset = [base[j] for j in positions]
        with seeds:
            if not differentiate:
                def value(i, xi, yi):
                    return run(subset, lambda z: z, i, xi, yi)[0] / views

                return jax.vmap(value)(rows, x, y)
            shapes = []

            def record(z):
                shapes.append(jax.ShapeDtypeStruct(z.shape, z.dtype))
                return z

            one = keras.tree.map_structure(lambda t: t[0], x)
            jax.eval_shape(lambda: run(subset, record, rows[0], one, y[0]))  # abstract: shapes only

            def example(subset, i, xi, yi, wi):
                def value(subset, probes):
                    it = iter(probes)
                    v, aux = run(subset, lambda z: z + next(it), i, xi, yi)
                    v = wi / views * v
                    return v, (aux, v)

                zeros = [jnp.zeros(s.shape, s.dtype) for s in shapes]
                (grads, cotangents), (aux, v) = jax.grad(value, argnums=(0, 1), has_aux=True)(
                    subset, zeros)
                return aux, cotangents, grads, v

            aux, cotangents, grads, values = jax.vmap(example, in_axes=(None, 0, 0, 0, 0))(
                subset, rows, x, y, jnp.asarray(weights))
        return list(aux), list(cotangents), list(grads), values
    if backend == "tensorflow":
        import tensorflow as tf

        variables = list(variables)
        x = keras.tree.map_structure(tf.convert_to_tensor, x)
        y = tf.convert_to_tensor(y)
        rows = tf.range(tf.shape(y)[0], dtype="int32") + first_row

        def call(i, xi, yi, probe):
            seeds.start(i)
            xi = keras.tree.map_structure(lambda t: _views(t, views), xi)
            return forward(lambda t: model(t, training=True), probe, xi, _views(yi, views))

        def value(args):
            return call(*args, lambda z: z)[0] / views

        def example(args):
            i, xi, yi, wi = args
            probes = []
            with tf.GradientTape() as tape:

                def probe(z):
                    p = tf.zeros_like(z)
                    tape.watch(p)
                    probes.append(p)
                    return z + p

                v, aux = call(i, xi, yi, probe)
                v = tf.cast(wi / views, v.dtype) * v
            grads = tape.gradient(v, variables + probes, unconnected_gradients="zero")
            grads = [tf.convert_to_tensor(g) for g in grads]  # IndexedSlices (embeddings) -> dense
            return list(aux), grads[len(variables):], grads[:len(variables)], v

        with seeds, vectorization():
            if not differentiate:
                return tf.vectorized_map(value, (rows, x, y))
            try:
                aux, cotangents, grads, values = tf.vectorized_map(
                    example, (rows, x, y, tf.cast(weights, "float32")))
            except TypeError as error:  # raised when the step is traced: nothing has run yet
                if "variant" not in str(error):
                    raise
                from kdp.clipping.config import ClippingError

                raise ClippingError(_TENSORFLOW_LOOP) from error
        return list(aux), list(cotangents), list(grads), values
    raise NotImplementedError(
        f"weighted_per_example_gradients supports jax and tensorflow, not {backend!r}"
    )
