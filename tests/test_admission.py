"""A model is admitted for what its training forward pass does (`kdp.admission`, `kdp.clipping`).

Runs on whichever ``KERAS_BACKEND`` is set (CI runs it on TensorFlow and JAX).
A loss term added from the data, a variable written from the batch and examples
that influence each other are refused before anything is spent, on the
Clipless and the per-example clipping paths; the clipped sum moves by at most C
when one record is removed, even for a model that mixes its padded batches.
Negative controls: weight regularizers, read-only state and per-example models train.
"""

import math

import keras
import numpy as np
import pytest
from keras import ops

from kdp import clipping, layers, losses
from kdp.admission import AdmissionError
from kdp.layers.base import DPNormNonIncreasingLayer
from kdp.model import DP_Sequential, DPParameters
from kdp.pipeline import DatasetMetadata

N, B, D, C = 200, 8, 6, 1.0
SCCE = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


class _AddLoss(DPNormNonIncreasingLayer, keras.layers.Layer):
    """Adds a term computed from the batch (a VAE's KL term, a balancing loss)."""

    def call(self, x):
        self.add_loss(10.0 * ops.sum(x))
        return x


class _RunningMean(DPNormNonIncreasingLayer, keras.layers.Layer):
    """Keeps the mean of the last training batch (``reads_only``: never writes it)."""

    def __init__(self, reads_only=False, **kwargs):
        super().__init__(**kwargs)
        self.reads_only = reads_only

    def build(self, shape):
        self.m = self.add_weight(shape=(shape[-1],), initializer="zeros", trainable=False, name="m")

    def call(self, x, training=None):
        if training and not self.reads_only:
            self.m.assign(ops.mean(x, axis=0))
        return x + 0.0 * self.m


class _MixOnZeroRow(keras.layers.Layer):
    """Mixes the rows only when the batch holds an all-zero row (Poisson padding)."""

    def call(self, x):
        padded = ops.any(ops.all(ops.equal(x, 0.0), axis=1))
        return ops.where(padded, x + 10.0 * ops.mean(x, axis=0, keepdims=True), x)


class _MixOnRepeat(keras.layers.Layer):
    """Mixes the rows only when two rows of the batch are equal."""

    def call(self, x):
        same = ops.all(ops.equal(x[:, None, :], x[None, :, :]), axis=2)
        repeated = ops.sum(ops.cast(same, "int32")) > ops.shape(x)[0]
        return ops.where(repeated, x + 10.0 * ops.mean(x, axis=0, keepdims=True), x)


def _clipping_model(*extra, first=(), regularizer=None):
    keras.utils.set_random_seed(0)
    model = DP_Sequential(
        [keras.Input((D,)), *first,
         keras.layers.Dense(8, activation="tanh", kernel_regularizer=regularizer), *extra,
         keras.layers.Dense(3)],
        dp_parameters=DPParameters(noise_multiplier=2.0, delta=1e-3, clipping_norm=C,
                                   reproducible=True, seed=1),
        dataset_metadata=DatasetMetadata((D,), 3, N, B))
    model.compile(optimizer=keras.optimizers.SGD(1.0), loss=SCCE)
    return model


def _clipless_model(*extra):
    keras.utils.set_random_seed(0)
    model = DP_Sequential(
        [layers.DP_BoundedInput((D,), 1.0), layers.DP_QuickSpectralDense(8), *extra,
         layers.DP_QuickSpectralDense(3)],
        dp_parameters=DPParameters(noise_multiplier=2.0, delta=1e-3, reproducible=True, seed=1),
        dataset_metadata=DatasetMetadata((D,), 3, N, B))
    model.compile(optimizer=keras.optimizers.SGD(1.0), loss=losses.DP_TauCategoricalCrossentropy(2.0))
    return model


def _batches():
    """A padded batch (two zero rows of weight 0) holding an outlier at row 0, and its
    neighbour without record 0 (row 0 padding too)."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(B, D)).astype("float32")
    y = rng.integers(0, 3, B)
    w = np.ones(B, "float32")
    x[-2:], w[-2:] = 0.0, 0.0
    x[0] *= 30.0
    x2, w2 = x.copy(), w.copy()
    x2[0], w2[0] = 0.0, 0.0
    return (x, y, w), (x2, y, w2)


def _refused_before_spending(model, error, match):
    (x, y, w), _ = _batches()
    model.project_weights()  # what train_on_batch does first, from no data (to float rounding)
    before = [np.array(v) for v in model.variables]
    with pytest.raises(error, match=match):
        model.train_on_batch(x, y, sample_weight=w)
    assert model.privacy_ledger.training_steps() == 0
    assert all(np.allclose(a, np.array(v), rtol=0, atol=1e-6) for a, v in zip(before, model.variables))


def _update_movement(make):
    """One train_on_batch on each neighbouring batch, same weights and noise (SGD, lr 1):
    ``‖Δ update‖·b`` in units of C."""
    updates = []
    for x, y, w in _batches():
        model = make()
        before = [np.array(v) for v in model.trainable_variables]
        model.train_on_batch(x, y, sample_weight=w)
        updates.append([np.array(v) - a for v, a in zip(model.trainable_variables, before)])
    return math.sqrt(sum(float(np.sum((a - b) ** 2)) for a, b in zip(*updates))) * B / C


# --- refused: a loss term from the data -----------------------------------------------------

@pytest.mark.parametrize("path", ["clipping", "clipless"])
def test_loss_term_from_the_data_is_refused(path):
    make = _clipping_model if path == "clipping" else _clipless_model
    _refused_before_spending(make(_AddLoss(name="kl")), AdmissionError,
                             "kl: its training forward pass adds a loss term")


def test_activity_regularizer_is_refused():
    dense = keras.layers.Dense(4, activity_regularizer=keras.regularizers.L2(0.1), name="act")
    _refused_before_spending(_clipping_model(dense), AdmissionError, "act: .* adds a loss term")


def test_weight_regularizer_still_trains_within_c():
    """Negative control: a penalty on the weights alone is allowed; it moves both
    neighbouring updates alike, so one record still moves the update by at most C."""
    moved = _update_movement(lambda: _clipping_model(regularizer=keras.regularizers.L2(0.1)))
    assert 0.5 < moved <= 1.0 + 1e-4, moved


# --- refused: a variable written from the batch ------------------------------------------------

@pytest.mark.parametrize("path", ["clipping", "clipless"])
def test_state_written_from_the_batch_is_refused(path):
    make = _clipping_model if path == "clipping" else _clipless_model
    _refused_before_spending(make(_RunningMean(name="stat")), AdmissionError,
                             r"stat \(_RunningMean\): its training forward pass writes \S*stat/m")


def test_trainable_batchnorm_is_refused_by_what_it_writes():
    _refused_before_spending(_clipping_model(keras.layers.BatchNormalization(name="bn")),
                             AdmissionError, r"bn \(BatchNormalization\): .* writes \S*bn/moving_mean")


@pytest.mark.parametrize("path", ["clipping", "clipless"])
def test_state_read_but_not_written_trains(path):
    """Negative control: a non-trainable variable that the forward pass only reads."""
    make = _clipping_model if path == "clipping" else _clipless_model
    model = make(_RunningMean(reads_only=True))
    (x, y, w), _ = _batches()
    model.train_on_batch(x, y, sample_weight=w)
    assert model.privacy_ledger.training_steps() == 1


# --- refused: examples that influence each other on padded or repeated rows -------------------

@pytest.mark.parametrize("mix", [_MixOnZeroRow, _MixOnRepeat])
def test_mixing_on_padded_or_repeated_rows_is_refused(mix):
    _refused_before_spending(_clipping_model(first=[mix()]), clipping.ClippingError,
                             "mixes the examples of a batch")


def test_mixing_layer_cannot_move_the_clipped_sum_by_more_than_c():
    """By construction: every example's clipped gradient is computed on that example
    alone, so a layer that mixes padded batches moves ḡ by at most C (was 1.2·C)."""
    model = _clipping_model(first=[_MixOnZeroRow()])
    (x, y, w), (x2, y2, w2) = _batches()
    full = clipping.clipped_gradient_sum(model, x, y, w)
    rest = clipping.clipped_gradient_sum(model, x2, y2, w2)
    moved = math.sqrt(sum(float(np.sum((np.asarray(full[p], "float64")
                                        - np.asarray(rest[p], "float64")) ** 2)) for p in full))
    assert 0.5 < moved <= C * (1 + 1e-4), moved


def test_per_example_model_trains_within_c():
    """Negative control: the same model without the mixing layer is admitted and one
    record moves its update by at most C."""
    moved = _update_movement(_clipping_model)
    assert 0.5 < moved <= 1.0 + 1e-4, moved


@pytest.mark.parametrize("path", ["clipping", "clipless"])
def test_loss_term_that_escapes_the_check_never_enters_the_gradient(path, monkeypatch):
    """By construction: the noisy objective adds weight penalties only, so a batch term
    that a check did not see does not move the update (it moved it by 1,090·C on TensorFlow)."""
    from kdp import admission

    monkeypatch.setattr(admission, "check_forward_pass", lambda model: None)
    make = _clipping_model if path == "clipping" else _clipless_model
    with_term = _update_movement(lambda: make(_AddLoss()))
    without = _update_movement(make)
    assert with_term == pytest.approx(without, rel=1e-4, abs=1e-6)
