"""The audit tools catch what they are meant to catch, and pass correct models."""

import keras
import numpy as np
import pytest

import kdp
from kdp import accounting, audit
from kdp import layers as L
from kdp import losses

N = 64


class _BrokenDense(L.DP_QuickSpectralDense):
    """A layer that claims ‖W‖₂ ≤ 1 but scales its kernel ×3 and never projects."""

    def build(self, input_shape):
        super().build(input_shape)
        self.kernel.constraint = None
        self.kernel.assign(3.0 * self.kernel.value)


def _model(sigma=1.0, broken=False, seed=None):
    md = kdp.DatasetMetadata((16,), 4, N, 8)
    noise = {} if seed is None else dict(reproducible=True, seed=seed)  # a fixed draw: not flaky
    dense = _BrokenDense if broken else L.DP_QuickSpectralDense
    model = kdp.DP_Sequential(
        [L.DP_BoundedInput((16,), upper_bound=1.0), dense(16), L.DP_GroupSort(2),
         L.DP_QuickSpectralDense(4)],
        dp_parameters=kdp.DPParameters("global", sigma, 1e-5, **noise), dataset_metadata=md,
    )
    model.compile(optimizer=keras.optimizers.SGD(1.0), loss=losses.DP_TauCategoricalCrossentropy(1.0))
    return model


@pytest.fixture
def batch(rng):
    x = rng.normal(size=(32, 16)).astype("float32")
    x /= np.linalg.norm(x, axis=1, keepdims=True)  # at the input bound
    return x, rng.integers(0, 4, 32)


def test_gradient_norm_check_passes_a_correct_model_and_flags_a_broken_layer(batch):
    good = audit.gradient_norm_check(_model(), *batch)
    assert good["ok"] and 0.2 < good["max_ratio"] <= 1 + 1e-4
    bad = audit.gradient_norm_check(_model(broken=True), *batch)
    assert not bad["ok"] and bad["violations"]


def test_gradient_norm_check_callback_logs_and_raises(batch):
    x, y = batch
    model = _model(broken=True)
    callback = audit.GradientNormCheck(x, y)
    callback.set_model(model)
    with pytest.raises(RuntimeError, match="violated"):
        callback.on_epoch_end(0, {})
    logs = {}
    ok = audit.GradientNormCheck(x, y)
    ok.set_model(_model())
    ok.on_epoch_end(0, logs)
    assert 0 < logs["grad_bound_ratio"] <= 1 + 1e-4


def test_noise_check_matches_calibration_and_detects_a_10_percent_error(batch):
    x, y = batch
    # a fixed draw (the measured std's error is ≈ 1.1 %: rtol = 3 % failed ≈ 2 % of runs)
    model = _model(sigma=1.0, seed=0)
    report = audit.noise_check(model, x[:8], y[:8], trials=60)
    assert report["ok"], report
    # A model whose noise is 10 % lower than what its claim (σ = 1) needs.
    under = _model(sigma=0.9, seed=0)
    claim = {path: std / 0.9 for path, std in under.noise_stds().items()}
    assert not audit.noise_check(under, x[:8], y[:8], trials=60, expected=claim)["ok"]


def test_clopper_pearson_and_epsilon_lower_bound():
    lo, hi = audit.clopper_pearson(50, 100, 0.95)
    assert lo < 0.5 < hi and hi - lo < 0.2
    assert audit.clopper_pearson(0, 100, 0.95)[0] == 0.0
    # a perfect test on n trials each side gives about log(n / 3)
    eps = audit.epsilon_lower_bound(100, 100, 0, 100, 1e-5)
    assert 2.5 < eps < np.log(100)
    assert audit.epsilon_lower_bound(50, 100, 50, 100, 1e-5) == 0.0


def test_membership_audit_stays_below_the_claim_and_catches_under_noise(batch):
    x, y = batch
    keras.utils.set_random_seed(0)  # weights and noise fixed: a statistical test, run once
    honest = audit.membership_audit(_model(sigma=1.0, seed=1), x[:1], y[:1], trials=200)
    assert honest["epsilon_lower_bound"] <= honest["epsilon_claimed"]
    non_private = audit.membership_audit(_model(sigma=1e-3, seed=2), x[:1], y[:1], trials=200)
    assert non_private["epsilon_lower_bound"] > 1.5
    # noise ×20 smaller than what the claim (σ = 4) is computed for
    claimed = accounting.compute_epsilon(4.0, 1.0, 1, 1e-5)
    under = audit.membership_audit(_model(sigma=0.2, seed=3), x[:1], y[:1], trials=400)
    assert under["epsilon_lower_bound"] > claimed
