"""`kdp.calibration`: Platt scaling on privately released counts.

Checked by measurement: the noise of the released counts (its standard
deviation over repeated releases, against σ), ε of training plus the release
recomputed with dp-accounting alone, the recovered Platt map on data whose
miscalibration is known, and the ranking kept (AUROC unchanged). Negative
controls: a model calibrated for training alone refuses the release, and a
noise of half the σ is told apart by the same measurement.
"""

import dp_accounting
import keras
import numpy as np
import pytest

from kdp import calibration as C
from kdp import layers, losses, privacy
from kdp.model import DP_Sequential, DPParameters
from kdp.pipeline import DatasetMetadata
from kdp.training import BudgetExceededError

D, N, B, DELTA, TAU = 4, 4096, 256, 1e-5, 8.0


def _model(sigma=1.0, n=N, **params):
    model = DP_Sequential(
        [layers.DP_BoundedInput((D,), 1.0), layers.DP_QuickSpectralDense(1)],
        dataset_metadata=DatasetMetadata((D,), 2, n, B),
        dp_parameters=DPParameters("global", sigma, DELTA, **params))
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss=losses.DP_TauBCE(TAU))
    model.build((None, D))
    return model


def _miscalibrated(model, n=N, a=0.4, b=-0.3, seed=0):
    """Rows whose true P(y = 1) is sigmoid(a·s + b), s the model's own score."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, D)).astype("float32")
    s = C.scores(model, x)
    y = (rng.random(n) < 1 / (1 + np.exp(-(a * s + b)))).astype("int32")
    return x, y, s


def _ece(p, y, bins=10):
    index = np.minimum((p * bins).astype(int), bins - 1)
    return sum(np.mean(index == k) * abs(p[index == k].mean() - y[index == k].mean())
               for k in range(bins) if np.any(index == k))


def test_the_scores_are_the_links_argument():
    model = _model()
    x = np.random.default_rng(1).normal(size=(16, D)).astype("float32")
    z = model.predict(x, verbose=0)[:, 0]
    np.testing.assert_allclose(C.scores(model, x), TAU * z, rtol=1e-6)
    np.testing.assert_allclose(1 / (1 + np.exp(-C.scores(model, x))), model.predict_proba(x)[:, 0],
                               rtol=1e-6)


def test_platt_recovers_a_known_miscalibration_and_keeps_the_ranking():
    from sklearn.metrics import roc_auc_score

    model = _model()
    x, y, s = _miscalibrated(model, n=20000)
    own = model.predict_proba(x)[:, 0]
    calibration = C.PrivateCalibration(noise_multiplier=1.0).fit(model, x, y)
    a, b = calibration.coefficients
    assert a == pytest.approx(0.4, abs=0.05) and b == pytest.approx(-0.3, abs=0.08)
    p = calibration.predict_proba(model, x)
    assert _ece(own, y) > 0.1 and _ece(p, y) < 0.02
    order = np.argsort(s)
    distinct = np.diff(s[order]) > 1e-3
    assert np.all(np.diff(p[order])[distinct] > 0)  # strictly increasing: the same ranking
    assert roc_auc_score(y, p) == pytest.approx(roc_auc_score(y, s), abs=1e-12)


@pytest.mark.parametrize("scale,expected", [(1.0, True), (0.5, False)])
def test_the_released_counts_carry_noise_of_std_sigma(monkeypatch, scale, expected):
    """Repeated releases on the same rows: the counts' deviations from the true
    counts have standard deviation σ (add/remove: sensitivity 1). Negative
    control: a release with half the noise fails the same check."""
    model = _model()
    x, y, s = _miscalibrated(model, n=512)
    sigma = 4.0
    released = []

    class Recording:
        """The release's generator, recording the noise it draws (scaled by ``scale``)."""

        def __init__(self, generator):
            self.generator = generator

        def normal(self, loc, std, size):
            released.append(self.generator.normal(loc, std * scale, size))
            return released[-1]

    real = C.numpy_generator
    monkeypatch.setattr(C, "numpy_generator", lambda *a, **k: Recording(real(*a, **k)))
    for _ in range(100):
        C.PrivateCalibration(sigma).fit(model, x, y)
    deviations = np.concatenate([r.ravel() for r in released])
    assert len(deviations) == 100 * 2 * 16
    measured = deviations.std()
    assert (abs(measured / sigma - 1) < 0.05) == expected, measured
    entries = [e for e in model.privacy_ledger.entries if e["kind"] == "event"]
    assert sum(e["count"] for e in entries) == 100
    assert entries[0]["event"]["noise_multiplier"] == sigma


def test_training_plus_the_reserved_release_stay_within_the_target_and_match_dp_accounting():
    target, epochs = 2.0, 3
    model = _model()
    calibration = C.reserve(model, target)
    model.make_private(target, epochs)
    x, y, _ = _miscalibrated(model)
    model.fit(x, y, epochs=epochs, verbose=0)
    calibration.fit(model, x, y)
    eps = model.privacy_spent()[0]
    sigma = model.dp_parameters.noise_multiplier
    steps = epochs * N // B
    acc = dp_accounting.pld.PLDAccountant(value_discretization_interval=privacy.PLD_DISCRETIZATION)
    acc.compose(dp_accounting.PoissonSampledDpEvent(B / N, dp_accounting.GaussianDpEvent(sigma)), steps)
    acc.compose(dp_accounting.GaussianDpEvent(calibration.noise_multiplier))
    by_hand = acc.get_epsilon(DELTA)
    assert eps <= target * (1 + 1e-9) and eps == pytest.approx(by_hand, rel=1e-6)
    assert eps > 0.98 * target  # the reservation is used, not wasted
    # the release alone costs the share of the target it was sized for
    alone = dp_accounting.pld.PLDAccountant(value_discretization_interval=privacy.PLD_DISCRETIZATION)
    alone.compose(dp_accounting.GaussianDpEvent(calibration.noise_multiplier))
    assert alone.get_epsilon(DELTA) == pytest.approx(C.CALIBRATION_SHARE * target, rel=0.01)
    assert calibration.planned_events(10) == []  # spent: no longer planned
    assert f"1 Gaussian release(s) without sampling (σ = {calibration.noise_multiplier:.4g}" in (
        model.privacy_statement())


def test_negative_control_a_model_calibrated_for_training_alone_refuses_the_release():
    target, epochs = 2.0, 1
    model = _model()
    model.make_private(target, epochs)
    x, y, _ = _miscalibrated(model)
    model.fit(x, y, epochs=epochs, verbose=0)
    entries = len(model.privacy_ledger.entries)
    with pytest.raises(BudgetExceededError):
        C.PrivateCalibration(5.0).fit(model, x, y)
    assert len(model.privacy_ledger.entries) == entries  # nothing recorded


def test_a_release_that_would_be_mostly_noise_warns():
    with pytest.warns(UserWarning, match="mostly noise"):
        C.reserve(_model(n=400), 1.0)


def test_bad_inputs_are_refused_and_the_config_round_trips():
    model = _model()
    x, y, _ = _miscalibrated(model, n=256)
    with pytest.raises(ValueError, match="labels 0 and 1"):
        C.PrivateCalibration(1.0).fit(model, x, y + 1)
    with pytest.raises(ValueError, match="fit the calibration first"):
        C.PrivateCalibration(1.0).probabilities([0.0])
    with pytest.raises(ValueError, match="increasing"):
        C.PrivateCalibration(1.0, edges=[1.0, 0.0])
    with pytest.raises(ValueError, match="noise_multiplier"):
        C.PrivateCalibration(0.0)
    wide = DP_Sequential([layers.DP_BoundedInput((D,), 1.0), layers.DP_QuickSpectralDense(3)],
                         dataset_metadata=DatasetMetadata((D,), 3, N, B),
                         dp_parameters=DPParameters("global", 1.0, DELTA))
    wide.compile(optimizer="sgd", loss=losses.DP_TauCategoricalCrossentropy(2.0))
    with pytest.raises(ValueError, match="one output"):
        C.PrivateCalibration(1.0).fit(wide, x, y)
    fitted = C.PrivateCalibration(1.0).fit(model, x, y)
    clone = C.PrivateCalibration.from_config(fitted.get_config())
    np.testing.assert_array_equal(clone.probabilities([-9.0, 0.0, 2.5]),
                                  fitted.probabilities([-9.0, 0.0, 2.5]))


def test_a_recipe_reserves_the_calibration_within_its_target():
    from kdp import recipes

    rng = np.random.default_rng(0)
    x = rng.uniform(size=(2000, 6)).astype("float32")
    y = (x[:, 0] + 0.5 * x[:, 1] + 0.3 * rng.normal(size=2000) > 0.8).astype("int32")
    r = recipes.recipe((6,), 2, len(x), 3.0, feature_range=(0, 1))
    r.epochs = 2
    plain = r.build(seed=0)
    with pytest.raises(ValueError, match="no reserved calibration"):
        C.calibrate(plain, x, y)
    model = r.build(seed=0, calibrate=True)
    assert model.dp_parameters.noise_multiplier > plain.dp_parameters.noise_multiplier
    model.fit(x, y, epochs=r.epochs, verbose=0)
    fitted = C.calibrate(model, x, y)
    assert fitted.coefficients is not None and 0 < model.privacy_spent()[0] <= 3.0 * (1 + 1e-9)
    p = fitted.predict_proba(model, x[:10])
    assert p.shape == (10,) and np.all((p > 0) & (p < 1))
    with pytest.raises(ValueError, match="two-class"):
        recipes.recipe((6,), 3, len(x), 3.0, feature_range=(0, 1)).build(calibrate=True)


@pytest.mark.parametrize("saved", [True, False])
def test_a_reserved_calibration_survives_saving_and_loading(tmp_path, monkeypatch, saved):
    """A model saved between `fit` and `calibrate` keeps its reservation: the
    reloaded model calibrates within its target, as the original would have.
    Negative control (``saved=False``: plans not saved with the weights): the
    reloaded model has no reservation."""
    import keras

    from kdp import recipes
    from kdp.training import budget

    if not saved:
        monkeypatch.setattr(C.PrivateCalibration, "saved_with_model", False)
    rng = np.random.default_rng(0)
    x = rng.uniform(size=(1000, 6)).astype("float32")
    y = (x[:, 0] + 0.5 * x[:, 1] > 0.8).astype("int32")
    r = recipes.recipe((6,), 2, len(x), 3.0, feature_range=(0, 1))
    r.epochs = 1
    model = r.build(seed=0, calibrate=True)
    model.fit(x, y, epochs=r.epochs, verbose=0)
    path = str(tmp_path / "reserved.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    if not saved:
        with pytest.raises(ValueError, match="no reserved calibration"):
            C.calibrate(loaded, x, y)
        return
    (reloaded,) = loaded.privacy_gate.plans.values()
    (original,) = model.privacy_gate.plans.values()
    assert reloaded is not original and reloaded.get_config() == original.get_config()
    fitted = C.calibrate(loaded, x, y)
    assert fitted.coefficients is not None and not loaded.privacy_gate.plans
    assert loaded.privacy_spent()[0] <= 3.0 * (1 + 1e-9)
    assert loaded.privacy_spent()[0] == pytest.approx(
        budget.get_eps_delta(model, 0)[0], rel=1e-9)  # the original's spent + planned
