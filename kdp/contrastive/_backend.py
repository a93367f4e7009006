"""The backend-specific part of contrastive training: gradients, Jacobians, jit.

Everything else in `kdp.contrastive` is `keras.ops`. The functions here take a
*pure* function of a list of parameter tensors (built on
``model.stateless_call``) and differentiate it:

* `grad`: ``∇ fn(params)`` of a scalar function;
* `per_example_jacobians`: for ``fn(params, x) -> (n, d)`` whose row ``k``
  depends only on ``x_k`` (checked by the caller), the per-example Jacobians
  ``∂ fn(params, x)_k / ∂ params``, a list of ``(n, d, *param.shape)``;
  ``x`` may be a structure (dict, list) of arrays with one row per example;
* `pair_gradients`: brute force, for ``fn(params, a, b) -> scalar`` on single
  examples, ``∇ fn(params, a_i, b_j)`` for every pair, a list of
  ``(n, m, *param.shape)`` (the O(n²)-memory reference);
* `jit`: ``jax.jit`` / ``tf.function``.
"""

import keras

from kdp._tf_vectorize import vectorization


def _backend():
    name = keras.backend.backend()
    if name not in ("jax", "tensorflow"):
        raise NotImplementedError(
            f"kdp.contrastive supports the jax and tensorflow backends, not {name!r}"
        )
    return name


def grad(fn, params):
    """``∇ fn(params)`` (a list like ``params``); ``fn`` returns a scalar."""
    if _backend() == "jax":
        import jax

        return list(jax.grad(fn)(list(params)))
    import tensorflow as tf

    params = [tf.convert_to_tensor(p) for p in params]
    with tf.GradientTape() as tape:
        tape.watch(params)
        value = fn(params)
    grads = tape.gradient(value, params, unconnected_gradients=tf.UnconnectedGradients.ZERO)
    return [tf.convert_to_tensor(g) for g in grads]  # IndexedSlices (embeddings) -> dense


def per_example_jacobians(fn, params, x):
    """Per-example Jacobians of ``fn(params, x) -> (n, d)``: list of ``(n, d, *shape)``."""
    if _backend() == "jax":
        import jax

        def single(p, xi):
            return fn(p, keras.tree.map_structure(lambda t: t[None], xi))[0]

        return list(jax.vmap(jax.jacrev(single), in_axes=(None, 0))(list(params), x))
    import tensorflow as tf

    params = [tf.convert_to_tensor(p) for p in params]
    with tf.GradientTape() as tape:
        tape.watch(params)
        out = fn(params, x)
    # Row k of the output depends on x_k only, so the batch Jacobian restricted
    # to row k is example k's own Jacobian.
    with vectorization():
        return list(tape.jacobian(out, params, unconnected_gradients=tf.UnconnectedGradients.ZERO,
                                  experimental_use_pfor=True))


def pair_gradients(fn, params, a, b):
    """Brute force ``∇ fn(params, a_i, b_j)`` for all ``i, j``: list of ``(n, m, *shape)``."""
    if _backend() == "jax":
        import jax

        inner = jax.vmap(jax.grad(fn), in_axes=(None, None, 0))
        return list(jax.vmap(inner, in_axes=(None, 0, None))(list(params), a, b))
    import tensorflow as tf

    params = [tf.convert_to_tensor(p) for p in params]
    a = keras.tree.map_structure(tf.convert_to_tensor, a)
    b = keras.tree.map_structure(tf.convert_to_tensor, b)
    n, m = keras.tree.flatten(a)[0].shape[0], keras.tree.flatten(b)[0].shape[0]
    ii, jj = tf.meshgrid(tf.range(n), tf.range(m), indexing="ij")

    def one(idx):
        i, j = idx[0], idx[1]
        with tf.GradientTape() as tape:
            tape.watch(params)
            value = fn(params, keras.tree.map_structure(lambda t: tf.gather(t, i), a),
                       keras.tree.map_structure(lambda t: tf.gather(t, j), b))
        grads = tape.gradient(value, params, unconnected_gradients=tf.UnconnectedGradients.ZERO)
        return [tf.convert_to_tensor(g) for g in grads]

    idx = tf.stack([tf.reshape(ii, [-1]), tf.reshape(jj, [-1])], axis=1)
    with vectorization():
        grads = tf.vectorized_map(one, idx)
    return [tf.reshape(g, (n, m) + tuple(p.shape)) for g, p in zip(grads, params)]


def compiled_apply(optimizer, jit_compile=True):
    """``apply(grads, variables)``: one optimizer update (constraints included),
    compiled: ``stateless_apply`` under ``jax.jit`` (an eager JAX update re-runs
    every Björck projection op by op), ``tf.function(optimizer.apply)`` on TF."""
    if not jit_compile:
        return optimizer.apply
    if _backend() == "jax":
        import jax

        step = jax.jit(optimizer.stateless_apply)

        def apply(grads, variables):
            if not optimizer.built:
                optimizer.build(variables)
            new_vars, new_opt = step([v.value for v in optimizer.variables], list(grads),
                                     [v.value for v in variables])
            for v, value in zip(variables, new_vars):
                v.assign(value)
            for v, value in zip(optimizer.variables, new_opt):
                v.assign(value)

        return apply
    import tensorflow as tf

    steps = {}

    def apply(grads, variables):
        if not optimizer.built:
            optimizer.build(variables)
        key = tuple(id(v) for v in variables)
        if key not in steps:  # the variables are captured, only the gradients are inputs
            steps[key] = tf.function(lambda g: optimizer.apply(g, variables),
                                     reduce_retracing=True)
        steps[key](list(grads))

    return apply
