"""Outside the private objective, numbers mean what they mean in Keras.

`evaluate`, ``val_loss`` and `test_on_batch` report the mean per-example loss
over the evaluated rows, whatever the evaluation batch size; the training step
alone divides by the expected batch size ``b`` (the private objective).
"""

import re
import time
import warnings

import keras
import numpy as np
import pytest

from kdp import autodiff, layers, losses
from kdp.callbacks import DP_Accountant
from kdp.model import DP_Sequential, DPParameters
from kdp.pipeline import DatasetMetadata

D, K, N, B = 8, 4, 256, 64


def _model():
    model = DP_Sequential(
        [layers.DP_BoundedInput((D,), 2.0), layers.DP_QuickSpectralDense(16), layers.DP_GroupSort(2),
         layers.DP_QuickSpectralDense(K)],
        dp_parameters=DPParameters("global", 2.0, 1e-3), dataset_metadata=DatasetMetadata((D,), K, N, B))
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss=losses.DP_TauCategoricalCrossentropy(4.0))
    return model


def _data(n, seed):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, D)).astype("float32"), rng.integers(0, K, n)


@pytest.mark.parametrize("batch_size", [1, 32, 256])
def test_evaluate_reports_the_mean_loss_at_any_batch_size(batch_size):
    x, y = _data(N, 0)
    x_test, y_test = _data(200, 1)
    model = _model()
    model.fit(x, y, epochs=1, verbose=0)
    truth = float(np.mean(keras.ops.convert_to_numpy(model.loss.call(y_test, model.predict(x_test, verbose=0)))))
    got = model.evaluate(x_test, y_test, batch_size=batch_size, verbose=0)
    assert got == pytest.approx(truth, rel=1e-4)  # was 1.6 % (batch 1) to 312 % (256) of it


def test_val_loss_is_the_mean_validation_loss():
    x, y = _data(N, 0)
    x_val, y_val = _data(100, 2)
    model = _model()
    history = model.fit(x, y, epochs=2, verbose=0, validation_data=(x_val, y_val))
    truth = float(np.mean(keras.ops.convert_to_numpy(model.loss.call(y_val, model.predict(x_val, verbose=0)))))
    assert history.history["val_loss"][-1] == pytest.approx(truth, rel=1e-4)


class _SeesLogs(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.seen = []

    def on_epoch_end(self, epoch, logs=None):
        self.seen.append(dict(logs or {}))


def test_epsilon_is_in_the_epoch_logs_without_a_callback_and_before_any():
    x, y = _data(N, 0)
    model = _model()
    first = _SeesLogs()  # e.g. TensorBoard or ModelCheckpoint("m_eps{epsilon:.2f}.keras") placed first
    history = model.fit(x, y, epochs=3, verbose=0, callbacks=[first])
    spent = [model.privacy_spent()[0]]
    assert history.history["epsilon"][-1] == pytest.approx(spent[0], rel=1e-9)
    assert history.history["epsilon"] == sorted(history.history["epsilon"])  # one value per epoch
    assert [logs["epsilon"] for logs in first.seen] == history.history["epsilon"]
    assert history.history["delta"] == [1e-3] * 3


class _SeesBatches(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.epsilons = []

    def on_train_batch_end(self, batch, logs=None):
        self.epsilons.append((logs or {}).get("epsilon"))


def test_progress_bar_shows_epsilon_per_step_and_counts_the_steps_a_budget_stop_ran(capsys):
    from kdp import accounting

    x, y = _data(N, 0)
    model = _model()  # global σ = 2, q = 1/4: 4 steps per epoch
    eps = [accounting.compute_epsilon(2.0, B / N, n, 1e-3) for n in (1, 2, 3)]
    model.dp_parameters = model.dp_parameters.replace(epsilon_max=(eps[1] + eps[2]) / 2)  # 2 steps
    seen = _SeesBatches()
    with pytest.warns(UserWarning, match=r"stopped by the privacy budget.*after 2 steps.*ε=") as record:
        model.fit(x, y, epochs=5, verbose=1, callbacks=[seen])
    assert f"{eps[1]:.4g}" in str(record[0].message)
    assert seen.epsilons == pytest.approx(eps[:2], rel=1e-9)  # ε after every step, in the batch logs
    shown = re.sub(r"\x1b\[[0-9;]*m", "", capsys.readouterr().out)  # without colours
    assert re.findall(r"(\d+)/(\d+)\b", shown)[-1] == ("2", "2")  # Keras alone ends the bar at 4/4
    assert f"epsilon: {eps[1]:.4f}" in shown


@pytest.mark.parametrize("bar", ["kdp", "keras"])
def test_the_progress_bar_never_goes_back_when_batch_ends_come_out_of_order(bar, capsys):
    """Keras runs asynchronous batch ends on a pool of threads: they may arrive out of
    order. kdp's bar skips a batch end older than the one shown. Control: Keras' own
    bar, given the same order, shows step 3 and then step 1."""
    from kdp.training.fit_callbacks import ProgbarLogger

    logger = ProgbarLogger() if bar == "kdp" else keras.callbacks.ProgbarLogger()
    logger.set_params({"verbose": 1, "epochs": 1, "steps": 6})
    logger.on_train_begin()
    logger.on_epoch_begin(0)
    for batch in (2, 0, 4, 1, 5):
        time.sleep(0.06)  # Keras' bar redraws at most every 0.05 s
        logger.on_train_batch_end(batch, {"loss": float(batch)})
    shown = [int(k) for k in re.findall(r"(\d+)/6\b", re.sub(r"\x1b\[[0-9;]*m", "", capsys.readouterr().out))]
    assert shown[0] == 3 and shown[-1] == 6
    assert (shown == sorted(shown)) == (bar == "kdp"), shown


def test_epsilon_per_step_is_computed_only_when_the_step_logs_are_read(monkeypatch):
    """ε after every step reaches any reader (here a callback at verbose=0); with
    no reader (verbose=0, `DP_Accountant` and Keras' own callbacks only) the
    ~0.3 ms accountant call per step is skipped, the epoch logs keep ε."""
    from kdp.training.gate import PrivacyGate

    x, y = _data(N, 0)
    calls = []
    spent = PrivacyGate.privacy_spent
    monkeypatch.setattr(PrivacyGate, "privacy_spent",
                        lambda self, *a, **k: calls.append(1) or spent(self, *a, **k))
    model = _model()  # 4 steps per epoch
    seen = _SeesBatches()
    model.fit(x, y, epochs=2, verbose=0, callbacks=[seen])
    assert len(seen.epsilons) == 8 and None not in seen.epsilons
    assert seen.epsilons == sorted(seen.epsilons)
    calls.clear()
    history = model.fit(x, y, epochs=2, verbose=0, callbacks=[DP_Accountant()])
    assert len(calls) <= 2 * 2  # the epochs' ends only (the gate's and the accountant's)
    assert history.history["epsilon"][-1] == pytest.approx(model.privacy_spent()[0], rel=1e-9)


def test_a_fit_that_ends_within_its_budget_does_not_warn():
    x, y = _data(N, 0)
    model = _model()
    model.make_private(target_epsilon=1.0, epochs=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        model.fit(x, y, epochs=2, verbose=0)
    with pytest.raises(RuntimeError, match="exhausted"):  # the target is the budget
        model.fit(x, y, epochs=1, verbose=0)


@pytest.mark.parametrize("nb_classes", [2, 5, 10])
def test_nb_classes_must_match_the_output_width(nb_classes):
    model = DP_Sequential(
        [layers.DP_BoundedInput((D,), 2.0), layers.DP_QuickSpectralDense(K)],
        dp_parameters=DPParameters("global", 2.0, 1e-3),
        dataset_metadata=DatasetMetadata((D,), nb_classes, N, B))
    model.compile(optimizer="sgd", loss=losses.DP_TauCategoricalCrossentropy(4.0))
    x, y = _data(N, 0)
    with pytest.raises(ValueError, match=rf"{K} outputs but DatasetMetadata\(nb_classes={nb_classes}\)"):
        model.fit(x, y % 2, epochs=1, verbose=0)
    assert model.privacy_ledger.training_steps() == 0


def test_one_output_for_two_classes_is_accepted():
    model = DP_Sequential(
        [layers.DP_BoundedInput((D,), 2.0), layers.DP_QuickSpectralDense(1)],
        dp_parameters=DPParameters("global", 2.0, 1e-3), dataset_metadata=DatasetMetadata((D,), 2, N, B))
    model.compile(optimizer="sgd", loss=losses.DP_TauBCE(4.0))
    x, y = _data(N, 0)
    model.fit(x, (y % 2).astype("float32")[:, None], epochs=1, verbose=0)
    assert model.privacy_ledger.training_steps() > 0


def test_errors_for_non_dp_parts_name_per_example_clipping_as_the_other_way():
    from kdp.bounds import BoundError

    x, y = _data(N, 0)
    for stack, loss in (
            ([layers.DP_BoundedInput((D,), 2.0), keras.layers.Dense(K)], losses.DP_TauCategoricalCrossentropy(4.0)),
            ([layers.DP_BoundedInput((D,), 2.0), layers.DP_QuickSpectralDense(K)],
             keras.losses.SparseCategoricalCrossentropy(from_logits=True))):
        model = DP_Sequential(stack, dp_parameters=DPParameters("global", 2.0, 1e-3),
                              dataset_metadata=DatasetMetadata((D,), K, N, B))
        model.compile(optimizer="sgd", loss=loss)
        with pytest.raises(BoundError, match=r"clipping_norm="):
            model.fit(x, y, epochs=1, verbose=0)
        assert model.privacy_ledger.training_steps() == 0


def _clipping_model():
    model = DP_Sequential([keras.Input((D,)), keras.layers.Dense(K)],
                          dp_parameters=DPParameters(delta=1e-3, clipping_norm=1.0),
                          dataset_metadata=DatasetMetadata((D,), K, N, B))
    return model


@pytest.mark.parametrize("labels,loss", [
    ("one-hot", keras.losses.SparseCategoricalCrossentropy(from_logits=True)),
    ("ids", keras.losses.CategoricalCrossentropy(from_logits=True)),
    ("ids+2", keras.losses.SparseCategoricalCrossentropy(from_logits=True)),
])
def test_labels_a_keras_loss_cannot_take_are_refused_before_any_step(labels, loss):
    x, y = _data(N, 0)
    y = {"one-hot": keras.utils.to_categorical(y, K), "ids": y, "ids+2": y + 2}[labels]
    model = _clipping_model()
    model.compile(optimizer="sgd", loss=loss)
    with pytest.raises(ValueError) as error:
        model.fit(x, y, epochs=1, verbose=0)
    message = str(error.value)
    assert ("class ids must lie in [0, 4)" in message if labels == "ids+2"
            else f"labels of shape {y.shape}" in message)  # the user's shapes, not the padded batch
    assert model.privacy_ledger.training_steps() == 0


def test_the_loss_is_probed_once_per_example_shape_and_refused_labels_still_are(monkeypatch):
    """`probe_loss` runs at the first fit, not again for arrays of the same shapes
    and dtypes; labels of another shape are probed, and refused, after a fit."""
    from kdp.training import validation

    x, y = _data(N, 0)
    model = _clipping_model()
    model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    probes = []
    evaluate_shapes = autodiff.evaluate_shapes
    monkeypatch.setattr(autodiff, "evaluate_shapes", lambda fn, *a: probes.append(
        fn.__qualname__.startswith("probe_loss")) or evaluate_shapes(fn, *a))
    model.fit(x, y, epochs=1, verbose=0)
    model.fit(x, y, epochs=1, verbose=0)
    assert sum(probes) == 1
    steps = model.privacy_ledger.training_steps()
    with pytest.raises(validation.DataValidationError, match="labels of shape"):
        model.fit(x, keras.utils.to_categorical(y, K), epochs=1, verbose=0)
    assert sum(probes) == 2 and model.privacy_ledger.training_steps() == steps


def test_keras_compile_loss_is_built_so_a_fit_does_not_trace_the_model_again():
    """kdp computes the loss itself; Keras' ``CompileLoss`` left unbuilt would make
    every ``fit`` and ``evaluate`` trace the model symbolically again."""
    x, y = _data(N, 0)
    model = _clipping_model()
    model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x, y, epochs=1, verbose=0)
    assert model._compile_loss.built


def test_model_checkpoint_placed_first_can_name_files_by_epsilon(tmp_path):
    x, y = _data(N, 0)
    model = _model()
    pattern = str(tmp_path / "m_eps{epsilon:.2f}.weights.h5")
    history = model.fit(x, y, epochs=2, verbose=0, callbacks=[
        keras.callbacks.ModelCheckpoint(pattern, save_weights_only=True)])  # was KeyError: 'epsilon'
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == sorted(f"m_eps{e:.2f}.weights.h5" for e in history.history["epsilon"])


@pytest.mark.parametrize("mistake", ["label K+8", "label -1", "features D+3"])
def test_classic_mistakes_are_refused_before_the_first_step(mistake):
    x, y = _data(N, 0)
    if mistake == "label K+8":
        y, expected = np.where(np.arange(N) == 5, K + 8, y), r"class ids must lie in \[0, 4\)"
    elif mistake == "label -1":
        y, expected = np.where(np.arange(N) == 5, -1, y), r"class ids must lie in \[0, 4\)"
    else:
        x, expected = np.concatenate([x, x[:, :3]], axis=1), r"examples of shape \(11,\).*input_shape=\(8,\)"
    model = _model()
    with pytest.raises(ValueError, match=expected):
        model.fit(x, y, epochs=1, verbose=0)
    assert model.privacy_ledger.training_steps() == 0


def test_an_accountant_typo_is_refused_at_construction():
    import kdp

    with pytest.raises(ValueError, match="accountant must be one of"):
        kdp.DP_Accountant(accountant="rpd")
