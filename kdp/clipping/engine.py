"""The clipped gradient sum ``ḡ = Σ_i clip(∇(w_i ℓ_i))`` and the clipping-mode objective."""

import keras
from keras import ops

from kdp import autodiff
from kdp.clipping.dense import _GhostDense, _as_rows, _kernel_sq_norms, ghost_dense_layers
from kdp.clipping.groups import _owners, group_clipping_norms


def clipped_gradient_sum(model, x, y, weights=None, ghost=True, first_row=0):
    """``{variable.path: Σ_i clip(∇_v (w_i ℓ_i))}`` on one batch, vectorized.

    Flat clipping scales example ``i``'s whole gradient by
    ``min(1, C/‖g_i‖)``; per-layer clipping scales each layer's part by
    ``min(1, C_l/‖g_il‖)``. Example ``i``'s gradient is that of the model run on
    example ``i`` alone (`autodiff.weighted_per_example_gradients`), so it
    depends on no other row of the batch: padding, repeated rows and layers that
    mix the batch axis cannot move the sum by more than ``C`` per example.
    Usable eagerly and inside a traced training step.

    Args:
        model: a DP model in clipping mode (compiled).
        x, y: one batch (``x`` an array or a structure of arrays: a dict, a list);
            weights: per-example weights in ``[0, 1]`` (default 1).
        ghost: use the ghost (book-keeping) norms for the Dense layers
            (`ghost_dense_layers`); ``False`` differentiates every variable.
        first_row: the index of ``x``'s first row in the step's batch (the
            examples' random seeds, `autodiff.ExampleSeeds`).
    """
    x = keras.tree.map_structure(ops.convert_to_tensor, x)
    y = ops.convert_to_tensor(y)
    batch = ops.shape(y)[0]
    weights = ops.ones((batch,), "float32") if weights is None else ops.reshape(
        ops.cast(weights, "float32"), (-1,))
    trainable = list(model.trainable_variables)
    owners = _owners(model)
    flat = model.dp_parameters.clipping == "flat"
    norms = group_clipping_norms(model)

    def group(v):
        return None if flat else owners[id(v)].name

    dense = ghost_dense_layers(model) if ghost else []
    dense_ids = {id(layer) for layer in dense}
    others = [v for v in trainable if id(owners.get(id(v))) not in dense_ids]

    # One vectorized pass, each example alone: Dense inputs and output cotangents
    # (ghost norms), per-example gradients of every other variable.
    ctx = _GhostDense(dense)
    with ctx:
        inputs, cotangents, grads = autodiff.weighted_per_example_gradients(
            model, ctx.example_loss(model.loss), x, y, weights, others,
            views=model.dp_parameters.augmentation_multiplicity, first_row=first_row)
        called = [layer for layer, _ in ctx.records]

    sq = {}  # group -> (batch,) squared norms

    def add(g, value):
        sq[g] = value if g not in sq else sq[g] + value

    calls = {}
    for layer, a, g in zip(called, inputs, cotangents):
        entry = calls.setdefault(id(layer), (layer, [], []))
        entry[1].append(_as_rows(ops.cast(a, g.dtype)))
        entry[2].append(_as_rows(g))
    for key, (layer, a_list, g_list) in calls.items():
        a = ops.concatenate(a_list, axis=1) if len(a_list) > 1 else a_list[0]
        g = ops.concatenate(g_list, axis=1) if len(g_list) > 1 else g_list[0]
        calls[key] = (layer, a, g)
        add(group(layer.kernel), _kernel_sq_norms(a, g))
        if layer.bias is not None:
            add(group(layer.bias), ops.sum(ops.square(ops.sum(g, axis=1)), axis=1))
    for v, g in zip(others, grads):
        add(group(v), ops.sum(ops.square(ops.reshape(g, (batch, -1))), axis=1))

    factors = {}
    for g, s in sq.items():
        factors[g] = ops.minimum(1.0, norms[g] / ops.maximum(ops.sqrt(s), 1e-12))

    out = {v.path: ops.zeros(v.shape, v.dtype) for v in trainable}  # a Dense never called: 0
    for layer, a, g in calls.values():
        f = factors[group(layer.kernel)]
        out[layer.kernel.path] = ops.einsum("btd,btu->du", a * f[:, None, None], g)
        if layer.bias is not None:
            out[layer.bias.path] = ops.einsum("bu,b->u", ops.sum(g, axis=1), factors[group(layer.bias)])
    for v, g in zip(others, grads):
        out[v.path] = ops.tensordot(factors[group(v)], g, axes=1)
    return {v.path: ops.cast(out[v.path], v.dtype) for v in trainable}  # the variable's dtype


def _chunked_sum(model, x, y, weights, chunk):
    """`clipped_gradient_sum` over chunks of ``chunk`` rows (virtual batches)."""
    batch = y.shape[0]  # None when TensorFlow traced an unknown batch size
    if batch is not None and batch <= chunk:
        return clipped_gradient_sum(model, x, y, weights)
    n_rows = ops.shape(y)[0]
    pad = (-n_rows) % chunk
    x = keras.tree.map_structure(lambda t: _pad_rows(t, pad), x)
    y = _pad_rows(y, pad)
    weights = _pad_rows(weights, pad)
    steps = (n_rows + pad) // chunk
    init = [ops.zeros(v.shape, v.dtype) for v in model.trainable_variables]
    paths = [v.path for v in model.trainable_variables]

    def body(i, acc):
        start = i * chunk
        xs = keras.tree.map_structure(lambda t: _rows(t, start, chunk), x)
        ys = _rows(y, start, chunk)
        ws = _rows(weights, start, chunk)
        part = clipped_gradient_sum(model, xs, ys, ws, first_row=start)
        return [a + part[p] for a, p in zip(acc, paths)]

    total = ops.fori_loop(0, steps, body, init)
    return dict(zip(paths, total))


def _pad_rows(t, pad):
    widths = [[0, pad]] + [[0, 0]] * (len(t.shape) - 1)
    return ops.pad(t, widths)


def _rows(t, start, size):
    begin = [start] + [0] * (len(t.shape) - 1)
    shape = [size] + list(t.shape[1:])
    return ops.slice(t, begin, shape)


def clipped_objective(model, x, y, values, sample_weight):
    """The clipping-mode data term: value ``Σ w_i ℓ_i / b``, gradient ``ḡ / b``.

    ``values`` are the weighted per-example losses of Keras' forward pass (used
    for the value only); the noise term is added by the model.
    """
    b = model.dataset_metadata.batch_size
    x = keras.tree.map_structure(ops.convert_to_tensor, x)
    y = ops.convert_to_tensor(y)
    weights = (ops.ones((ops.shape(y)[0],), "float32") if sample_weight is None
               else ops.reshape(ops.cast(sample_weight, "float32"), (-1,)))
    chunk = model.dp_parameters.physical_batch_size
    if chunk:
        gbar = _chunked_sum(model, x, y, weights, chunk)
    else:
        gbar = clipped_gradient_sum(model, x, y, weights)
    total = ops.stop_gradient(ops.sum(values) / b)
    for v in model.trainable_variables:
        value = v.value
        total = total + ops.sum((value - ops.stop_gradient(value)) * ops.stop_gradient(gbar[v.path] / b))
    return total
