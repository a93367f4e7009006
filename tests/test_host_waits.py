"""A DP model's `fit` never makes the host wait on a step (JAX): Keras dispatches
its batch ends, and the conversion of each step's logs to Python numbers, to a
worker thread, as for a plain Keras model.

The measure: device-to-host conversions of the step logs made **on the main
thread** per training step (Keras' ``convert_to_numpy``, which waits for the
step to finish), counted during `fit`. Controls: a plain Keras model (≈ 0: only
the epoch's end converts on the main thread) and the same model with a user
callback that overrides ``on_train_batch_end`` (≈ 1: Keras dispatches
synchronously). The budget stop, ε in the step logs and the refunds of a
``steps_per_execution`` block are checked in `tests/test_gate.py` and
`tests/test_training.py`; here they are checked again with asynchronous dispatch.
"""

import threading

import keras
import numpy as np
import pytest

import kdp
from kdp import accounting, layers as L, losses
from kdp.callbacks import DP_Accountant

pytestmark = pytest.mark.skipif(keras.backend.backend() != "jax",
                                reason="only JAX dispatches batch ends asynchronously")

N, B, D, K = 1024, 16, 16, 4


class _Sync(keras.callbacks.Callback):
    """A user callback with its own batch-end hook: Keras then dispatches synchronously."""

    def on_train_batch_end(self, batch, logs=None):
        self.last = dict(logs or {})


@pytest.fixture
def main_thread_conversions(monkeypatch):
    """A counter of the main thread's calls of Keras' ``convert_to_numpy``."""
    from keras.src import backend as keras_backend

    counter = {"calls": 0}
    convert = keras_backend.convert_to_numpy

    def counted(x):
        if threading.current_thread() is threading.main_thread():
            counter["calls"] += 1
        return convert(x)

    monkeypatch.setattr(keras_backend, "convert_to_numpy", counted)
    return counter


def _data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(N, D)).astype("float32")
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    return x, keras.utils.to_categorical(rng.integers(0, K, N), K)


def _clipless():
    model = kdp.DP_Sequential(
        [L.DP_BoundedInput((D,), upper_bound=1.0), L.DP_QuickSpectralDense(32), L.DP_GroupSort(2),
         L.DP_QuickSpectralDense(K)],
        dp_parameters=kdp.DPParameters("global", 2.0, 1e-5, batch_shapes=1),
        dataset_metadata=kdp.DatasetMetadata((D,), K, N, B))
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss=losses.DP_TauCategoricalCrossentropy(1.0))
    return model


def _clipping():
    """A plain Keras network trained with per-example clipping."""
    model = kdp.DP_Sequential(
        [keras.Input((D,)), keras.layers.Dense(32, activation="relu"), keras.layers.Dense(K)],
        dp_parameters=kdp.DPParameters(noise_multiplier=2.0, delta=1e-5, clipping_norm=1.0,
                                       batch_shapes=1),
        dataset_metadata=kdp.DatasetMetadata((D,), K, N, B))
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss=keras.losses.CategoricalCrossentropy(from_logits=True))
    return model


def _plain():
    model = keras.Sequential([keras.Input((D,)), keras.layers.Dense(32, activation="relu"),
                              keras.layers.Dense(K)])
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="categorical_crossentropy")
    return model


def _per_step(model, counter, callbacks=(), verbose=0, epochs=1, **kwargs):
    """Main-thread conversions per step of a `fit` (after a first, compiling one)."""
    x, y = _data()
    model.fit(x, y, epochs=1, verbose=0, **kwargs)
    steps_before = _steps(model)
    counter["calls"] = 0
    history = model.fit(x, y, epochs=epochs, verbose=verbose, callbacks=list(callbacks), **kwargs)
    steps = _steps(model) - steps_before if steps_before is not None else epochs * (N // B)
    return counter["calls"] / steps, history


def _steps(model):
    ledger = getattr(model, "privacy_ledger", None)
    return None if ledger is None else ledger.training_steps()


def test_plain_keras_controls(main_thread_conversions):
    asynchronous, _ = _per_step(_plain(), main_thread_conversions, batch_size=B)
    synchronous, _ = _per_step(_plain(), main_thread_conversions, [_Sync()], batch_size=B)
    assert asynchronous <= 0.1
    assert synchronous >= 0.9  # the measure sees a host that waits on every step


@pytest.mark.parametrize("make,verbose", [(_clipless, 0), (_clipless, 1), (_clipping, 0)],
                         ids=["clipless", "clipless-progress-bar", "clipping"])
def test_a_dp_fit_never_waits_on_a_step(main_thread_conversions, make, verbose):
    model = make()
    per_step, history = _per_step(model, main_thread_conversions, verbose=verbose)
    assert per_step <= 0.1
    model_eps = history.history["epsilon"]
    assert len(model_eps) == 1 and model_eps[0] == model.privacy_spent()[0]


def test_a_user_batch_end_hook_still_reads_the_step_logs(main_thread_conversions):
    sync = _Sync()
    per_step, _ = _per_step(_clipless(), main_thread_conversions, [sync])
    assert per_step >= 0.9  # it opted the fit into synchronous dispatch, as in Keras
    assert "loss" in sync.last and "epsilon" in sync.last


def test_a_per_step_accountant_is_synchronous_and_exact(main_thread_conversions):
    model = _clipless()
    eps = []

    class Reader(keras.callbacks.Callback):
        async_safe = True  # reads nothing but the logs it is given

        def on_train_batch_end(self, batch, logs=None):
            eps.append(logs["epsilon"])

    per_step, _ = _per_step(model, main_thread_conversions,
                            [DP_Accountant(accountant="rdp", per_step=True), Reader()], epochs=1)
    assert per_step >= 0.9
    q = B / N
    steps_before = model.privacy_ledger.training_steps() - len(eps)
    expected = [accounting.compute_epsilon(2.0, q, steps_before + k + 1, 1e-5, "rdp")
                for k in range(len(eps))]
    np.testing.assert_allclose(eps, expected, rtol=1e-9)


def test_step_logs_carry_the_epsilon_of_the_step_they_follow(main_thread_conversions):
    """With asynchronous dispatch the batch end of step k may run after step k+1
    was recorded: the ε it writes is still that of the ledger after step k (RDP:
    exact every step)."""
    model = _clipless()
    model.privacy_gate.accountant = "rdp"
    seen = {}

    class Reader(keras.callbacks.Callback):
        async_safe = True

        def on_train_batch_end(self, batch, logs=None):
            seen[batch] = logs["epsilon"]

    per_step, _ = _per_step(model, main_thread_conversions, [Reader()], epochs=1)
    assert per_step <= 0.1
    steps_before = model.privacy_ledger.training_steps() - len(seen)
    for batch, eps in seen.items():
        assert eps == pytest.approx(accounting.compute_epsilon(
            2.0, B / N, steps_before + batch + 1, 1e-5, "rdp"), rel=1e-9)


@pytest.mark.parametrize("block", [1, 3])
def test_the_budget_stops_before_a_step_it_would_not_allow(block, main_thread_conversions):
    model = _clipless()
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss=losses.DP_TauCategoricalCrossentropy(1.0),
                  steps_per_execution=block)
    x, y = _data()
    limit = accounting.compute_epsilon(2.0, B / N, 7, 1e-5, "rdp") * 1.0001  # 7 steps fit, not 8
    with pytest.warns(UserWarning, match="stopped by the privacy budget"):
        model.fit(x, y, epochs=3, verbose=0, callbacks=[DP_Accountant(limit, accountant="rdp")])
    steps = model.privacy_ledger.training_steps()
    assert steps == 7 // block * block  # whole blocks only, never past the limit
    assert model.privacy_spent("rdp")[0] <= limit
    assert main_thread_conversions["calls"] <= 2  # the stop needed no wait on a step
