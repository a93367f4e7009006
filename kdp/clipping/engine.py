"""The clipped gradient sum ``ḡ = Σ_i clip(∇(w_i ℓ_i))`` and the clipping-mode objective."""

import keras
from keras import ops

from kdp import autodiff
from kdp.clipping.kinds import Probes, ghost_layers, kind_of
from kdp.clipping.groups import _owners, group_clipping_norms


def clipped_gradient_sum(model, x, y, weights=None, ghost=True, first_row=0, with_losses=False,
                         with_outputs=False):
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
        ghost: take the norms of the layers the registry covers from their kind
            (`kdp.clipping.kinds`, `ghost_layers`); ``False`` differentiates
            every variable.
        first_row: the index of ``x``'s first row in the step's batch (the
            examples' random seeds, `autodiff.ExampleSeeds`).
        with_losses: also return the pass's losses.
        with_outputs: also return the pass's outputs (with ``with_losses``).

    Returns:
        The sums; with ``with_losses``, ``(sums, losses)``, ``losses[i] = w_i ℓ_i``
        (float32, shape ``(batch,)``) of the same pass: its random draws, ``ℓ_i``
        the mean over the example's augmented views; with ``with_outputs`` too,
        ``(sums, losses, outputs)``: the model's outputs for the batch, each
        example's from its own pass (``None`` with several augmented views).
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

    layers = ghost_layers(model) if ghost else []
    covered = {id(layer) for layer in layers}
    others = [v for v in trainable if id(owners.get(id(v))) not in covered]

    # One vectorized pass, each example alone: what the covered layers' kinds
    # record and their probes' cotangents, per-example gradients of every other variable.
    probes = Probes(layers)
    with probes:
        aux, cotangents, grads, losses = autodiff.weighted_per_example_gradients(
            model, probes.example_loss(model.loss), x, y, weights, others,
            views=model.dp_parameters.augmentation_multiplicity, first_row=first_row,
            with_values=True)
        called = probes.called()
    *aux, outputs = aux

    calls = {}  # id(layer) -> (layer, [(aux, cotangent) per call])
    for layer, a, g in zip(called, aux, cotangents):
        calls.setdefault(id(layer), (layer, []))[1].append((a, g))
    states = []  # (layer, kind, what its norms and sums need)
    for layer, pairs in calls.values():
        kind = kind_of(layer)
        states.append((layer, kind, kind.per_example(layer, pairs)))

    sq = {}  # group -> (batch,) squared norms

    def add(g, value):
        value = ops.cast(value, "float32")
        sq[g] = value if g not in sq else sq[g] + value

    for layer, kind, state in states:
        add(group(layer.trainable_variables[0]), kind.sq_norms(layer, state))
    for v, g in zip(others, grads):
        add(group(v), ops.sum(ops.square(ops.reshape(g, (batch, -1))), axis=1))

    factors = {}
    for g, s in sq.items():
        factors[g] = ops.minimum(1.0, norms[g] / ops.maximum(ops.sqrt(s), 1e-12))

    out = {v.path: ops.zeros(v.shape, v.dtype) for v in trainable}  # a covered layer never called: 0
    for layer, kind, state in states:
        out.update(kind.weighted_sums(layer, state, factors[group(layer.trainable_variables[0])]))
    for v, g in zip(others, grads):
        out[v.path] = ops.tensordot(factors[group(v)], g, axes=1)
    sums = {v.path: ops.cast(out[v.path], v.dtype) for v in trainable}  # the variable's dtype
    if not with_losses:
        return sums
    if not with_outputs:
        return sums, ops.cast(losses, "float32")
    views = model.dp_parameters.augmentation_multiplicity
    outputs = None if views > 1 else keras.tree.map_structure(lambda t: t[:, 0], outputs)
    return sums, ops.cast(losses, "float32"), outputs


def _chunked_sum(model, x, y, weights, chunk, like=None):
    """`clipped_gradient_sum` over virtual batches of at most ``chunk`` rows: the
    fewest passes that hold the batch, ``p = ⌈rows/chunk⌉``, of ``⌈rows/p⌉`` rows each
    in a loop, the last padded with zero-weight rows (fewer than ``p``). Passes after
    the last row of positive weight are skipped (a Poisson batch's drawn rows come
    first, its padding last), so a batch padded to a large static size costs its
    drawn rows rounded up to a pass. The number of rows may be known only when the
    step runs (TensorFlow traces one step for every batch size): a batch that fits
    in ``chunk`` rows is then one pass of its own rows. Whether a batch needs virtual batches is
    `kdp.training.objective.virtual_batch_rows`' call.

    Args:
        chunk: the largest number of rows of one pass.
        like: the model's outputs for the batch (Keras' forward pass; only their
            structure, shapes and dtypes are read) to collect each pass's outputs
            in the same form, or ``None``.

    Returns:
        ``(sums, losses, outputs)``: as `clipped_gradient_sum`'s (the losses and
        outputs of skipped rows 0), the outputs ``None`` without ``like`` or with
        several augmented views.
    """
    if model.dp_parameters.augmentation_multiplicity > 1:
        like = None
    n_rows = ops.shape(y)[0]
    steps = (n_rows + chunk - 1) // chunk
    chunk = (n_rows + steps - 1) // steps  # balanced: the padding is below one row per pass
    padded = steps * chunk
    x = keras.tree.map_structure(lambda t: _pad_rows(t, padded - n_rows), x)
    y = _pad_rows(y, padded - n_rows)
    weights = _pad_rows(weights, padded - n_rows)
    paths = [v.path for v in model.trainable_variables]
    init = [[ops.zeros(v.shape, v.dtype) for v in model.trainable_variables],
            ops.zeros((padded,), "float32")]  # the per-example losses
    if like is not None:
        init.append(keras.tree.map_structure(
            lambda t: ops.zeros((padded,) + tuple(t.shape[1:]), t.dtype), like))

    def body(i, acc):
        sums, losses, *outputs = acc
        start = i * chunk
        xs = keras.tree.map_structure(lambda t: _rows(t, start, chunk), x)
        part, values, out = clipped_gradient_sum(
            model, xs, _rows(y, start, chunk), _rows(weights, start, chunk), first_row=start,
            with_losses=True, with_outputs=True)
        rows = ops.expand_dims(start + ops.arange(chunk, dtype="int32"), 1)
        outputs = [keras.tree.map_structure(lambda a, o: ops.scatter_update(a, rows, ops.cast(o, a.dtype)),
                                            collected, out) for collected in outputs]
        return [[a + part[p] for a, p in zip(sums, paths)], ops.scatter_update(losses, rows, values),
                *outputs]

    # Only the passes up to the last row of positive weight run: the rest hold
    # padding (or rows of weight 0), whose clipped gradient, loss and weight are 0.
    weighted = ops.max(ops.where(weights > 0, ops.arange(1, padded + 1, dtype="int32"), 0))
    sums, losses, *outputs = autodiff.sequential_loop(0, (weighted + chunk - 1) // chunk, body, init)
    outputs = keras.tree.map_structure(lambda t: _rows(t, 0, n_rows), outputs[0]) if outputs else None
    return dict(zip(paths, sums)), _rows(losses, 0, n_rows), outputs


def _pad_rows(t, pad):
    widths = [[0, pad]] + [[0, 0]] * (len(t.shape) - 1)
    return ops.pad(t, widths)


def _rows(t, start, size):
    begin = [start] + [0] * (len(t.shape) - 1)
    shape = [size] + list(t.shape[1:])
    return ops.slice(t, begin, shape)


def clipped_objective(model, x, y, sample_weight, chunk=None, y_pred=None):
    """The clipping-mode data term: value ``Σ w_i ℓ_i / b``, gradient ``ḡ / b``, and
    the model's outputs for the batch.

    The losses ``w_i ℓ_i`` and the outputs are those of the per-example pass that
    computes ḡ (its random draws, its mean over augmented views), so the step
    needs no other forward pass: Keras' own is left unused (a compiler drops
    it) when the outputs replace its predictions (`kdp.model.DP_Model`). With
    ``chunk``, virtual batches of at most ``chunk`` rows (`_chunked_sum`, whose
    outputs take the form of ``y_pred``, Keras' predictions); ``None``: one pass.
    The outputs are ``None`` with several augmented views. The noise term is
    added by the model.

    Returns:
        ``(objective, outputs)``.
    """
    b = model.dataset_metadata.batch_size
    x = keras.tree.map_structure(ops.convert_to_tensor, x)
    y = ops.convert_to_tensor(y)
    weights = (ops.ones((ops.shape(y)[0],), "float32") if sample_weight is None
               else ops.reshape(ops.cast(sample_weight, "float32"), (-1,)))
    if chunk:
        gbar, values, outputs = _chunked_sum(model, x, y, weights, chunk, like=y_pred)
    else:
        gbar, values, outputs = clipped_gradient_sum(model, x, y, weights, with_losses=True,
                                                     with_outputs=True)
    total = ops.stop_gradient(ops.sum(values) / b)
    for v in model.trainable_variables:
        value = v.value
        total = total + ops.sum((value - ops.stop_gradient(value)) * ops.stop_gradient(gbar[v.path] / b))
    return total, outputs
