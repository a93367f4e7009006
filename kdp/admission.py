"""A model is admitted for what its training forward pass does, not for its type.

Noise calibrated to a per-example sensitivity covers only what flows through the
per-example objective. Two things a Keras model's forward pass may do escape it,
whatever the layer's type:

* **writing a variable** (`Variable.assign`: BatchNormalization's moving
  statistics, a running mean, a cache): a state computed from the batch, saved
  with the weights without noise;
* **adding a loss term** (`add_loss`, an ``activity_regularizer``: a VAE's KL
  term, a mixture-of-experts balancing loss): a gradient computed from the batch
  outside the per-example objective, so one example can move the update without
  bound.

`check_forward_pass` refuses both, for Clipless and per-example clipping alike,
before anything is spent. It runs the pass once on a probe batch inside a
`keras.StatelessScope` (nothing is changed; shapes only on JAX), where every
``assign`` and ``add_loss`` is recorded whatever its value, so the check does
not depend on the probe's data. Allowed: the state of a
`keras.random.SeedGenerator` (it advances by a fixed increment, independently
of the data) and weight regularizers (``kernel_regularizer=``...: functions of
the weights alone, added by Keras outside the forward pass). Not seen: a layer
that writes a backend variable behind Keras' back (``v.value.assign`` on
TensorFlow), assigns a seed generator's state by hand, or writes or adds a
term only on inputs or batch sizes other than the probe's. A loss term that
escapes the check still never enters the noisy gradient (the objective adds
weight penalties only, `kdp.training.objective`); a variable write that
escapes it is not undone.
"""

import keras
import numpy as np

from kdp import autodiff

_PROBE_ROWS = 4


class AdmissionError(ValueError):
    """The model's training forward pass does something the noise does not cover."""


def probe_batch(model, rng, rows_like=None):
    """A small batch for probing the model: ``(x, rows)``.

    Given ``rows_like`` (a structure of arrays, e.g. training rows), ``x`` is a
    copy of its first rows (at most 4). Otherwise ``x`` is random, with the
    structure of the model's inputs (an array, or the dict or list of a
    multi-input model, e.g. a keras_hub backbone's ``token_ids``,
    ``segment_ids`` and ``padding_mask``): float inputs standard normal,
    integer and boolean inputs 0 or 1 (valid token ids and mask values whatever
    the vocabulary); unknown sizes other than the batch's are taken from
    ``dataset_metadata.input_shape`` for a single input, else 3.
    """
    if rows_like is not None:
        x = keras.tree.map_structure(lambda a: np.array(a[:_PROBE_ROWS]), rows_like)
        return x, len(keras.tree.flatten(x)[0])
    meta = getattr(model, "dataset_metadata", None)
    struct = getattr(model, "_inputs_struct", None)  # a functional model's, as given
    if struct is None:
        struct = getattr(model, "inputs", None)
    if struct is None:
        if meta is None:
            raise ValueError(f"{model.name}: declares no inputs; probe it with rows like its inputs")
        struct = keras.KerasTensor((None,) + tuple(meta.input_shape))
    if isinstance(struct, (list, tuple)) and len(struct) == 1:
        struct = struct[0]
    specs = keras.tree.flatten(struct)
    rows = specs[0].shape[0] or _PROBE_ROWS

    def make(spec):
        fill = (meta.input_shape if meta is not None and len(specs) == 1
                and len(meta.input_shape) == len(spec.shape) - 1 else None)
        shape = [rows] + [d if d is not None else (fill[i] if fill else 3)
                          for i, d in enumerate(spec.shape[1:])]
        dtype = keras.backend.standardize_dtype(spec.dtype)
        if "int" in dtype or dtype == "bool":
            return rng.integers(0, 2, shape).astype(dtype)
        return rng.normal(size=shape).astype(dtype)

    return keras.tree.map_structure(make, struct), rows


def check_forward_pass(model):
    """Raise `AdmissionError`, naming the layer and the fix, if ``model(x, training=True)``
    writes a variable (other than a seed generator's state) or adds a loss term."""
    layers = list(model._flatten_layers(include_self=True))
    seed_states = {id(g.state) for layer in layers for g in layer._seed_generators}
    found = {}

    def forward(x):
        with keras.StatelessScope(collect_losses=True) as scope:
            model(x, training=True)
            found["losses"] = bool(scope.losses)
            found["adders"] = [layer for layer in layers if layer._get_own_losses()]
        found["written"] = set(scope.state_mapping) - seed_states

    x, _ = probe_batch(model, np.random.default_rng(0))
    autodiff.evaluate_shapes(forward, x)
    if found["losses"]:
        adder = (found["adders"] or [model])[0]
        raise AdmissionError(
            f"{adder.name}: its training forward pass adds a loss term (add_loss or an "
            "activity_regularizer). Computed from the batch outside the per-example objective, "
            "it lets one example move the update by more than the noise covers. Remove it; a "
            "penalty on the weights alone belongs in a weight regularizer (e.g. "
            "kernel_regularizer=keras.regularizers.L2(...)), which is allowed.")
    if found["written"]:
        for layer in layers:
            own = [v for v in layer._trainable_variables + layer._non_trainable_variables
                   if id(v) in found["written"]]
            if own:
                break
        else:
            layer, own = model, []
        names = ", ".join(v.path for v in own) or (
            "a variable outside the model (Keras' global random seed, if a layer calls keras.random "
            "without seed=: give it a keras.random.SeedGenerator, whose draws are admitted)")
        raise AdmissionError(
            f"{layer.name} ({type(layer).__name__}): its training forward pass writes {names}. "
            "A state computed from the batch is kept and saved with the weights without noise. "
            "Use a layer without state (LayerNormalization or GroupNormalization instead of "
            "BatchNormalization), freeze the layer (layer.trainable = False) if it then stops "
            "writing, or compute the state from public data before training.")
