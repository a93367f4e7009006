"""The noisy training objective of a DP model (Clipless DP-SGD, Béthune et al. 2024).

``Σ_i w_i ℓ_i / b + Σ_v ⟨v − stop_gradient(v), ξ_v⟩``:

* ``Σ_i w_i ℓ_i / b``: per-example losses summed and divided by the **expected**
  batch size ``b`` (never the realised size, which is private under Poisson
  sampling; padding rows have ``w_i = 0``);
* the second term is exactly 0 in value but its gradient with respect to ``v``
  is ``ξ_v``, a fresh Gaussian draw of std ``σ c_v Δ_v / b`` ("per-layer") or
  ``σ √(Σ_v Δ_v²) / b`` ("global"), ``Δ_v`` the per-example gradient bound of
  the bound pass (Béthune et al. 2024, Alg. 1–2). It is built with a custom
  gradient (`_zero_with_gradient`): its value is 0 without computing the
  products, and ξ is drawn once for all the variables of one dtype;
* plus the weight regularizers' penalties (functions of the weights alone). A
  loss term a layer adds from the batch (``add_loss``) never enters: such a
  model is refused before training (`kdp.admission`), and were one to slip
  through, its term would still be left out of the gradient.

So Keras' own ``train_step`` computes the noisy gradient in one ordinary
backward pass on every backend. Every constant comes from the model's
`StepPlan` (`kdp.training.plan`). The objective is traced only inside the
privacy gate (`PrivacyGate.require_open`) and, each time the compiled step
executes, multiplied by a host check that spends one of the gate's credits for
the plan (`PrivacyGate.consume`): a step that was not recorded cannot run.
"""

import contextlib
import math
import threading

import keras
from keras import ops

from kdp import autodiff, clipping, distribute
from kdp.bounds import bound_sqrt, compute_gradient_bounds
from kdp.training.sampling import poisson_batch_shapes


def noise_stds(model, plan=None):
    """``{variable.path: std}`` of the Gaussian noise added to the batch gradient
    (`StepPlan.noise_std` of ``plan``, default the model's current plan)."""
    plan = plan or model.step_plan()
    if plan.clipping_norm is not None:
        return {v.path: plan.noise_std(v.path, None) for v in model.trainable_variables}
    bounds = compute_gradient_bounds(model)
    if plan.noisify_strategy == "global":
        total = bound_sqrt(sum(d * d for d in bounds.values()))  # a tensor after a clip
        return {p: plan.noise_std(p, total) for p in bounds}
    return {p: plan.noise_std(p, d) for p, d in bounds.items()}


def noise_term(model, plan, seed_generator):
    """A scalar of value 0 whose gradient with respect to each trainable variable
    ``v`` is ``ξ_v``, a fresh Gaussian draw of std ``noise_stds(model, plan)[v.path]``.

    The standard normals of all the variables of one dtype are one draw, sliced
    per variable: a draw per variable puts one copy of the generator (hash
    rounds, inverse error function) per variable in the compiled step; on the
    benchmark MLP (three kernels, JAX) compiling it then took 36 MB more
    resident memory. The value 0 is not computed from ξ (`_zero_with_gradient`)."""
    stds = noise_stds(model, plan)
    by_dtype = {}
    for v in model.trainable_variables:
        by_dtype.setdefault(v.value.dtype, []).append(v)
    values, noises = [], []
    for dtype, variables in by_dtype.items():
        sizes = [math.prod(v.shape) for v in variables]
        draw = keras.random.normal((sum(sizes),), dtype=dtype, seed=seed_generator)
        offset = 0
        for v, size in zip(variables, sizes):
            values.append(v.value)
            noises.append(ops.reshape(draw[offset:offset + size], v.shape) * stds[v.path])
            offset += size
    term = _zero_with_gradient(*values, *noises)
    # Data-parallel: one calibrated draw per global step (kdp/distribute.py).
    return term * ops.cast(distribute.noise_share(), term.dtype)


@ops.custom_gradient
def _zero_with_gradient(*args):
    """``0``, with gradient ``ξ_i`` for ``v_i`` and none for ``ξ_i``; ``args`` are
    ``v_1 … v_n, ξ_1 … ξ_n``.

    The value of ``Σ_i ⟨v_i − stop_gradient(v_i), ξ_i⟩`` is 0 too, but a compiler
    computes its products: XLA evaluated the Gaussian transform of ξ a second time
    for them (2–3 % of a step of the benchmark MLP on 2 CPU cores, JAX)."""
    noises = args[len(args) // 2:]

    def gradient(*upstream_args, upstream=None):
        if upstream is None:
            (upstream,) = upstream_args
        return (tuple(ops.cast(upstream, xi.dtype) * xi for xi in noises)
                + tuple(ops.zeros_like(xi) for xi in noises))

    return ops.zeros(()), gradient


@contextlib.contextmanager
def pass_outputs(model):
    """While active (around Keras' ``train_step``), the clipping objective offers the
    outputs of its per-example pass in place of Keras' predictions, and
    `step_predictions` takes them once, in the same traced step (for the metrics
    and the step's ``y_pred``): Keras' forward pass, left unused, is dropped by the
    compiler. One slot per thread (TensorFlow traces replicas in threads)."""
    slots = model.__dict__.setdefault("_kdp_pass_outputs", {})
    slots[threading.get_ident()] = []
    try:
        yield
    finally:
        slots.pop(threading.get_ident(), None)


def _slot(model):
    return model.__dict__.get("_kdp_pass_outputs", {}).get(threading.get_ident())


def _offer_pass_outputs(model, outputs):
    slot = _slot(model)
    if slot is not None and outputs is not None:
        slot[:] = [outputs]


def step_predictions(model, y_pred):
    """The predictions of the current training step: the outputs the clipping
    objective offered within `pass_outputs` (taken once), else ``y_pred`` (outside a
    training step, Clipless models, several augmented views)."""
    slot = _slot(model)
    return slot.pop() if slot else y_pred


def with_step_predictions(model, aux):
    """JAX's ``compute_loss_and_updates`` auxiliary values with its predictions (third
    from the end in Keras 3's layouts: ``(..., y_pred, non_trainable_variables,
    metrics_variables)``) replaced by `step_predictions`."""
    aux = list(aux)
    aux[-3] = step_predictions(model, aux[-3])
    return tuple(aux)


def virtual_batch_rows(model, batch):
    """The most rows one per-example pass of a step of ``batch`` rows (``None``:
    unknown when traced) computes ḡ over (virtual batches), or ``None`` for one pass
    of the whole batch.

    ``physical_batch_size=k`` given: ``k``, unless the batch is known to fit in
    it. Otherwise the largest size of the padding ladder below its capacity
    (`kdp.training.sampling.poisson_batch_shapes`, ``b + 2s`` with three sizes)
    for a batch known to exceed it or of unknown size (TensorFlow traces one step
    for every size; a batch that fits runs one pass of its own rows). That caps
    the step's memory: the capacity ``b + 6√b + 8`` (74 rows at ``b = 32``) pads
    about 2 % of the Poisson batches, and its pass took 2.8 times the buffers of
    a plain step of ``b`` rows on a BERT encoder (1.45 times at ``b + 2s``). The
    sum is the same: each example is run alone with its own seeds either way.
    Not with data-parallel replicas (their ladder is rounded to shard evenly)."""
    explicit = model.dp_parameters.physical_batch_size
    if explicit:
        return None if batch is not None and batch <= explicit else explicit
    meta = model.dataset_metadata
    if meta is None or distribute.num_replicas(model) > 1:
        return None
    shapes = poisson_batch_shapes(meta.batch_size, meta.nb_samples_train, model.dp_parameters.batch_shapes)
    if len(shapes) == 1 or (batch is not None and batch <= shapes[-2]):
        return None
    return shapes[-2]


def objective(model, x, y, y_pred, sample_weight, training, seed_generator):
    """The training objective (noisy when ``training``; the gate must be open).

    Outside training (`evaluate`, ``val_loss``, `test_on_batch`) the loss means
    what it means in Keras: the weighted per-example losses averaged over the
    batch's rows (``sum_over_batch_size``), plus the regularization losses."""
    def weighted_losses():
        values = model.loss.call(y, y_pred)
        if sample_weight is None:
            return values
        return values * ops.reshape(ops.cast(sample_weight, values.dtype), ops.shape(values))

    if not training:
        values = weighted_losses()
        rows = ops.cast(ops.shape(values)[0], values.dtype)
        total = ops.sum(values) / ops.maximum(rows, 1.0)
        return total + sum(model.losses) if model.losses else total
    plan = model.step_plan()
    gate = model.privacy_gate
    gate.require_open(plan=plan)
    if plan.clipping_norm is not None:
        # The loss reported and the outputs are those of the per-example pass whose
        # gradients are clipped (its random draws, its views): Keras' forward pass is
        # then left unused.
        chunk = virtual_batch_rows(model, ops.convert_to_tensor(y).shape[0])
        total, outputs = clipping.clipped_objective(model, x, y, sample_weight, chunk, y_pred)  # grad: ḡ/b
        _offer_pass_outputs(model, outputs)
    else:
        total = ops.sum(weighted_losses()) / plan.batch_size
    # Weight penalties only (functions of the weights): a term added from the batch
    # (add_loss) is refused (`kdp.admission`) and never enters the noisy gradient.
    penalties = model._get_regularization_losses()
    if penalties:
        total = total + sum(penalties) * ops.cast(distribute.noise_share(), total.dtype)
    # Checked each time the compiled step runs: a release recorded for this plan. Only
    # the noise term waits for the check (the rest of the step can run meanwhile);
    # a failed check fails the whole execution.
    admitted = ops.cast(autodiff.host_check(lambda: gate.consume(plan), after=total), total.dtype)
    return total + noise_term(model, plan, seed_generator) * admitted
