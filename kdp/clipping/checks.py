"""What per-example clipping refuses before anything is spent (`check_model`)."""

import warnings

import keras
import numpy as np
from keras import ops

from kdp import admission, autodiff
from kdp.clipping.config import ClippingError
from kdp.clipping.groups import group_clipping_norms

def check_model(model):
    """Raise `ClippingError` (or `kdp.admission.AdmissionError`) if per-example
    clipping of ``model`` would not be DP.

    * the loss must be a `keras.losses.Loss` (its ``call`` gives per-example values);
    * random layers (Dropout, GaussianNoise, augmentation layers: any layer
      drawing from a `keras.random.SeedGenerator`) are admitted: each
      example's pass draws its own values (`autodiff.ExampleSeeds`), and the
      loss reported is that of the same pass. Random values drawn
      independently of the data do not change the sensitivity: each
      example's contribution is still clipped to ``C``;
    * a training forward pass that writes a variable (a trainable
      `BatchNormalization`'s moving statistics) or adds a loss term is refused
      (`kdp.admission.check_forward_pass`); a frozen BatchNormalization runs in
      inference mode (a warning: its statistics must be public);
    * a model whose output for one example depends on other examples of its
      batch is refused (`check_examples_independent`).
    """
    loss = model.loss
    if not isinstance(loss, keras.losses.Loss):
        raise ClippingError(
            f"clipping needs a keras.losses.Loss instance whose call() is per-example "
            f"(e.g. keras.losses.SparseCategoricalCrossentropy(from_logits=True)), got {loss!r}"
        )
    if not model.trainable_variables:
        raise ClippingError(f"{model.name} has no trainable variables")
    warn_fixed_statistics(model, frozen_only=True)
    group_clipping_norms(model)  # validates a per-layer dict
    admission.check_forward_pass(model)
    check_examples_independent(model)
    return {}


def warn_fixed_statistics(model, frozen_only):
    """Warn for each ``BatchNormalization`` of ``model`` that runs in inference mode (the
    frozen ones, or all with ``frozen_only=False``): its fixed statistics must be public."""
    for layer in model._flatten_layers(include_self=False):
        if isinstance(layer, keras.layers.BatchNormalization) and not (frozen_only and layer.trainable):
            warnings.warn(f"{layer.name}: {'frozen ' if frozen_only else ''}BatchNormalization runs in "
                          "inference mode with fixed statistics; fine for DP as long as those "
                          "statistics are public.", stacklevel=4)


def _perturb_row(x, k, rng):
    """``x`` with row ``k`` changed: random floats; integers and booleans (token ids,
    masks) from another row, else 0 or 1, so that they stay valid."""
    x = x.copy()
    if x.dtype.kind in "iub":
        other = x[(k + 1) % len(x)]
        x[k] = other if not np.array_equal(other, x[k]) else np.zeros_like(x[k]) if x[k].any() else 1
    else:
        x[k] = rng.normal(size=x[k].shape).astype(x.dtype)
    return x


def _same(a, b):
    """Equal up to 1e-4 (1e-2 for 16-bit values) of the largest magnitude."""
    rtol = 1e-2 if np.asarray(a).dtype.itemsize <= 2 else 1e-4
    a, b = np.asarray(a, "float64"), np.asarray(b, "float64")
    if a.shape != b.shape:
        return False
    scale = max(float(np.max(np.abs(a), initial=0.0)), float(np.max(np.abs(b), initial=0.0)))
    return bool(np.allclose(a, b, rtol=0.0, atol=rtol * scale, equal_nan=True))


def _compiled_forward(model, training):
    """``(trainable, non_trainable, x) -> outputs``: ``model``'s stateless forward pass
    in mode ``training``; on JAX under ``jax.jit`` (one trace per input shape).

    Run eagerly, JAX compiles and keeps one executable per operation and shape
    (about 160 MB of resident memory for a two-layer BERT encoder, the whole
    check's cost); the probe's few compiled passes are freed with the function.
    Random layers draw from the seeds of the `autodiff.ExampleSeeds` context
    active when a shape is traced. Other backends run it eagerly: TensorFlow's
    eager operations compile nothing."""

    def forward(trainable, non_trainable, x):
        return model.stateless_call(trainable, non_trainable, x, training=training)[0]

    return autodiff.compile_function(forward) if keras.backend.backend() == "jax" else forward


#: why per-example clipping refuses a model that mixes its batch
CLIPPING_NEEDS = ("the clipped per-example gradients would not be those of the computation the "
                  "batch runs. Per-example clipping needs each example's output to depend on that "
                  "example alone.")


def check_examples_independent(model, modes=(True, False), why=CLIPPING_NEEDS, data=None):
    """Refuse a model whose output for one example depends on other examples.

    The clipped sum does not rest on this check: `clipped_gradient_sum` runs
    every example alone, so nothing one example does to the others' rows reaches
    the update. But a model that mixes its batch (statistics or a mean over the
    batch axis) would then be trained on a computation the batch did not run,
    so it is refused. Functional probe, in training and inference mode, on
    random rows plus a repeated row and an all-zero row (a padded Poisson
    batch's padding), every input of a multi-input model alike: perturbing or
    removing row ``k`` must leave every other row of every output unchanged
    (`_same`). Random layers draw the same values in every run of the probe
    (`autodiff.ExampleSeeds` started without an example), so that only the data
    changes; in training mode a model with random layers is only perturbed,
    not shortened, since a draw of another shape gives every row other values.
    A layer that mixes only on inputs the probe does not hold passes it.

    Args:
        model: a built Keras model (``dataset_metadata`` gives unknown input sizes
            when it has one: `kdp.admission.probe_batch`).
        modes: the ``training`` values probed.
        why: what the mixing would break, ending the error's message.
        data: rows of data (a structure of arrays) to probe with instead of random
            ones (`kdp.admission.probe_batch`): a model that declares no inputs
            needs them.

    Raises:
        ClippingError: naming the mixing (e.g. a Lambda centring over the batch axis).
    """
    rng = np.random.default_rng(0)
    x, rows = admission.probe_batch(model, rng, data)
    fixed_batch = model.inputs[0].shape[0] is not None if getattr(model, "inputs", None) else False
    if not fixed_batch:
        x = keras.tree.map_structure(lambda a: np.concatenate([a, a[:1], np.zeros_like(a[:1])]), x)
        rows += 2
    elif rows >= 3:
        for a in keras.tree.flatten(x):
            a[-2], a[-1] = a[0], 0
    trainable = [v.value for v in model.trainable_variables]
    others = [v.value for v in model.non_trainable_variables]
    seeds = autodiff.ExampleSeeds(model)

    forwards = {training: _compiled_forward(model, training) for training in modes}

    def run(batch, training):
        seeds.start(None)
        with seeds:
            out = forwards[training](trainable, others, batch)
        return [ops.convert_to_numpy(o) for o in keras.tree.flatten(out)]

    def refuse(how, training):
        raise ClippingError(
            f"{model.name}: the output for one example changes when another example of the batch "
            f"is {how} (training={training}): a layer mixes the examples of a batch (e.g. statistics "
            f"or a mean over the batch axis), and {why}"
        )

    for training in modes:
        ref = run(x, training)
        if any(len(o.shape) == 0 or o.shape[0] != rows for o in ref):
            raise ClippingError(f"{model.name}: every output must have one row per example (batch axis first)")
        removable = not fixed_batch and rows > 1 and not (training and seeds.generators)
        for k in sorted({0, rows - 1}):
            out = run(keras.tree.map_structure(lambda a: _perturb_row(a, k, rng), x), training)
            if not all(_same(np.delete(a, k, 0), np.delete(b, k, 0)) for a, b in zip(ref, out)):
                refuse("perturbed", training)
            if removable:
                out = run(keras.tree.map_structure(lambda a: np.delete(a, k, 0), x), training)
                if not all(_same(np.delete(a, k, 0), b) for a, b in zip(ref, out)):
                    refuse("removed", training)
