"""What `fit` tells the user: the cost of a noise multiplier nobody chose, and the
budget that stopped a fit."""

import math
import re
import warnings

import keras
import numpy as np
import pytest

import kdp
from kdp import accounting, layers, losses
from kdp.model import DP_Sequential, DPParameters
from kdp.pipeline import DatasetMetadata

N, B, DELTA = 120, 30, 1e-3
DEFAULT = "no noise multiplier was chosen"


def _model(**params):
    model = DP_Sequential(
        [layers.DP_BoundedInput((6,), 1.0), layers.DP_QuickSpectralDense(8), layers.DP_GroupSort(2),
         layers.DP_QuickSpectralDense(3)],
        dp_parameters=DPParameters(delta=DELTA, **params),
        dataset_metadata=DatasetMetadata((6,), 3, N, B))
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss=losses.DP_TauCategoricalCrossentropy(1.0))
    return model


def _data():
    rng = np.random.default_rng(0)
    return rng.normal(size=(N, 6)).astype("float32") / 3, rng.integers(0, 3, N)


def _fit(model, epochs, **kwargs):
    """The messages of the UserWarnings ``model.fit`` emits."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(*_data(), epochs=epochs, verbose=0, **kwargs)
    return [str(w.message) for w in caught if issubclass(w.category, UserWarning)]


def test_a_default_noise_multiplier_warns_once_with_the_epsilon_of_the_planned_epochs():
    model = _model()
    assert model.dp_parameters.noise_multiplier == 1.0
    assert model.dp_parameters.noise_multiplier_is_default
    (message,) = [m for m in _fit(model, 3) if DEFAULT in m]
    assert "σ=1 (one Gaussian of σ_eff=0.707 per step" in message and "3 epochs (12 steps)" in message
    assert "make_private(target_epsilon=..., epochs=...)" in message
    assert "DPParameters(noise_multiplier=...)" in message
    warned = float(re.search(r"cost ε=([0-9.]+)", message).group(1))
    # per-layer noise: one Gaussian of σ_eff = σ / √(trainable variables) per step
    sigma_eff = 1.0 / math.sqrt(len(model.trainable_variables))
    assert model.effective_noise_multiplier() == pytest.approx(sigma_eff)
    expected = accounting.compute_epsilon(sigma_eff, B / N, 12, DELTA)
    assert warned == pytest.approx(expected, rel=5e-3)  # printed to 3 digits
    assert model.privacy_spent()[0] == pytest.approx(expected, rel=1e-9)  # what the fit spent
    assert not [m for m in _fit(model, 1) if DEFAULT in m]  # once per model
    # replace() keeps "nobody chose σ" unless σ is among the changes
    assert model.dp_parameters.replace(delta=1e-4).noise_multiplier_is_default
    assert not model.dp_parameters.replace(noise_multiplier=1.0).noise_multiplier_is_default
    # and so does a configuration saved and loaded (a reloaded model warns too)
    reloaded = DPParameters.from_config(model.dp_parameters.get_config())
    assert reloaded.noise_multiplier_is_default and reloaded.noise_multiplier == 1.0
    chosen = DPParameters.from_config(DPParameters(noise_multiplier=1.0).get_config())
    assert not chosen.noise_multiplier_is_default


@pytest.mark.parametrize("how", ["explicit", "make_private", "budget", "callback_budget"])
def test_no_warning_when_sigma_or_a_budget_was_chosen(how):
    """Control: the same σ = 1 passed explicitly, or σ set by make_private, or a
    budget that bounds what the default σ can spend."""
    callbacks = []
    if how == "explicit":
        model = _model(noise_multiplier=1.0)
    elif how == "make_private":
        model = _model()
        model.make_private(target_epsilon=20.0, epochs=2)
    elif how == "budget":
        model = _model(epsilon_max=50.0)
    else:
        model = _model()
        callbacks = [kdp.DP_Accountant(epsilon_max=50.0)]
    assert not [m for m in _fit(model, 2, callbacks=callbacks) if DEFAULT in m]
    assert model.privacy_ledger.training_steps() == 8


@pytest.mark.parametrize("where", ["callback", "model"])
def test_a_budget_stop_names_the_budget(where):
    """A DP_Accountant's budget is removed when its fit ends, before the warning is
    written: the message still names it (it printed ``()``)."""
    sigma_eff = 2.0
    eps = [accounting.compute_epsilon(sigma_eff, B / N, n, DELTA) for n in (5, 6)]
    limit = sum(eps) / 2  # allows exactly 5 steps
    if where == "callback":
        model = _model(noisify_strategy="global", noise_multiplier=sigma_eff)
        messages = _fit(model, 5, callbacks=[kdp.DP_Accountant(epsilon_max=limit)])
    else:
        model = _model(noisify_strategy="global", noise_multiplier=sigma_eff, epsilon_max=limit)
        messages = _fit(model, 5)
    (message,) = [m for m in messages if "stopped by the privacy budget" in m]
    assert f"budget epsilon_max={limit:.4g} (" in message and "()" not in message
    assert "after 5 steps" in message
    assert model.privacy_ledger.training_steps() == 5
