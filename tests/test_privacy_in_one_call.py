"""Privacy in one call (`model.make_private`), the warning on a σ calibrated
the plain way, and the privacy statement.

ε is measured with dp-accounting directly from the ledger's step count and
the σ_eff written out by hand (per-layer noise over V variables with unit
coefficients is one Gaussian of σ/√V), never taken from kdp's own calibration:
with the PLD accountant (at kdp's documented discretization) where `make_private`
chose it, with RDP where σ came from `calibrate_noise_multiplier`.
"""

import math
import re
import warnings

import dp_accounting
import keras
import numpy as np
import pytest

from kdp import accounting, layers, losses, privacy
from kdp.adaptive_clipping import AdaptiveQuantileClipping
from kdp.model import DP_Sequential, DPParameters
from kdp.pipeline import DatasetMetadata

D, K, N, B, DELTA = 8, 4, 256, 32, 1e-3  # q = 1/8, 8 steps per epoch
EPOCHS, TARGET = 3, 2.0


def _model(strategy="per-layer", clipping_norm=None, sigma=1.0, clip_layer=False):
    if clipping_norm is None:
        stack = [layers.DP_BoundedInput((D,), 2.0), layers.DP_QuickSpectralDense(16),
                 layers.DP_GroupSort(2), layers.DP_QuickSpectralDense(K)]
        stack += [layers.DP_ClipGradient(1.0)] if clip_layer else []
        loss = losses.DP_TauCategoricalCrossentropy(4.0)
    else:
        stack = [keras.Input((D,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(K)]
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model = DP_Sequential(stack, dataset_metadata=DatasetMetadata((D,), K, N, B),
                          dp_parameters=DPParameters(strategy, sigma, DELTA, clipping_norm=clipping_norm))
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss=loss)
    return model


def _data(seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(N, D)).astype("float32"), rng.integers(0, K, N)


def _epsilon(sigma_eff, steps, delta=DELTA, accountant="pld"):
    """ε of ``steps`` Poisson-subsampled Gaussians, with dp-accounting alone."""
    acc = (dp_accounting.rdp.RdpAccountant() if accountant == "rdp" else
           dp_accounting.pld.PLDAccountant(value_discretization_interval=privacy.PLD_DISCRETIZATION))
    acc.compose(dp_accounting.PoissonSampledDpEvent(B / N, dp_accounting.GaussianDpEvent(sigma_eff)), steps)
    return acc.get_epsilon(delta)


def _by_hand_sigma_eff(model):
    params = model.dp_parameters
    if params.noisify_strategy == "global" or params.clipping_norm is not None:
        return params.noise_multiplier
    return params.noise_multiplier / math.sqrt(len(model.trainable_variables))


@pytest.mark.parametrize("strategy,clipping_norm", [("per-layer", None), ("global", None), ("global", 1.0)])
def test_make_private_reaches_the_target_after_the_stated_epochs(strategy, clipping_norm):
    model = _model(strategy, clipping_norm)
    sigma = model.make_private(target_epsilon=TARGET, epochs=EPOCHS)
    assert model.dp_parameters.noise_multiplier == sigma and model.dp_parameters.epsilon_max == TARGET
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # neither a budget stop nor a calibration warning
        model.fit(*_data(), epochs=EPOCHS, verbose=0)
    steps = model.privacy_ledger.training_steps()
    assert steps == EPOCHS * N // B  # every planned step ran
    eps = _epsilon(_by_hand_sigma_eff(model), steps)
    assert TARGET * 0.995 <= eps <= TARGET  # calibrated tightly, never above


def test_make_private_counts_adaptive_clipping_releases():
    x, y = _data()
    model = _model("global", clip_layer=True)
    clipper = AdaptiveQuantileClipping(x, y, quantile=0.5, noise_multiplier=4.0, patience=1)
    clipper.set_model(model)  # registers its planned releases
    model.make_private(target_epsilon=TARGET, epochs=EPOCHS)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        model.fit(x, y, epochs=EPOCHS, verbose=0, callbacks=[clipper])
    ledger = model.privacy_ledger
    assert ledger.training_steps() == EPOCHS * N // B and ledger.releases("quantile") > 0
    assert model.privacy_spent()[0] <= TARGET
    # Without the releases, the same σ would have spent less: they were counted.
    assert _epsilon(model.dp_parameters.noise_multiplier, ledger.training_steps()) < model.privacy_spent()[0]


def test_make_private_refuses_an_unreachable_target_and_bad_arguments():
    model = _model("global", sigma=0.8)
    model.fit(*_data(), epochs=2, verbose=0)
    spent = model.privacy_spent("pld")[0]  # what the ledger costs with make_private's accountant
    before = model.dp_parameters
    with pytest.raises(ValueError, match="unreachable.*16 steps already in the ledger"):
        model.make_private(target_epsilon=spent * 0.9, epochs=1)
    assert model.dp_parameters is before  # nothing changed
    for bad in (dict(target_epsilon=0, epochs=1), dict(target_epsilon=1, epochs=0),
                dict(target_epsilon=1, epochs=1.5)):
        with pytest.raises(ValueError):
            model.make_private(**bad)
    with pytest.raises(ValueError, match="1/N"):
        model.make_private(target_epsilon=1.0, epochs=1, delta=0.5)
    with pytest.raises(ValueError, match="unreachable"):
        model.make_private(target_epsilon=spent * 0.9, epochs=1, delta=1e-4)
    assert model.dp_parameters is before  # not even the δ it was given


def test_a_plain_calibrated_sigma_on_a_per_layer_model_warns():
    steps = EPOCHS * N // B
    sigma = accounting.calibrate_noise_multiplier(TARGET, B / N, steps, DELTA)
    per_layer = _model("per-layer", sigma=sigma)
    with pytest.warns(UserWarning, match=r"per-layer noise.*make_private") as record:
        per_layer.fit(*_data(), epochs=EPOCHS, verbose=0)
    spent = float(re.search(r"cost ε=([0-9.]+)", str(record[0].message)).group(1))
    sigma_eff = _by_hand_sigma_eff(per_layer)  # ε as calibrated: the smaller of PLD and RDP
    assert spent == pytest.approx(min(_epsilon(sigma_eff, steps), _epsilon(sigma_eff, steps, accountant="rdp")),
                                  rel=1e-2)
    assert spent > 1.5 * TARGET  # the over-spending the warning is about
    with warnings.catch_warnings():  # control: the same σ on a global model is what it claims
        warnings.simplefilter("error", UserWarning)
        _model("global", sigma=sigma).fit(*_data(), epochs=EPOCHS, verbose=0)


def test_privacy_statement_states_the_ledger_and_its_limits():
    model = _model("per-layer")
    assert "nothing yet" in model.privacy_statement()
    model.make_private(target_epsilon=TARGET, epochs=2)
    model.fit(*_data(), epochs=2, verbose=0)
    text = model.privacy_statement()
    steps = model.privacy_ledger.training_steps()
    assert f"{steps} noisy gradient steps" in text and "Poisson" in text and "add or remove one" in text
    reported = {float(d): float(e) for e, d in re.findall(r"ε = ([0-9.e+-]+) at δ = ([0-9.e+-]+)", text)}
    assert sorted(reported) == pytest.approx([DELTA / 100, DELTA / 10, DELTA])
    for delta, eps in reported.items():
        assert eps == pytest.approx(_epsilon(_by_hand_sigma_eff(model), steps, delta), rel=1e-3)
    for limit in ("hyper-parameter search", "preprocessing", "metrics"):
        assert limit in text


def test_the_statement_declares_n_public_and_gives_the_replace_one_epsilon():
    """N is released (the statement, the config, q = b/N), which add/remove-one
    neighbours tell apart: the statement says N and what derives from it are
    public, and gives ε under replace-one adjacency (same-size neighbours) for
    when N must stay private, as dp-accounting's PLD computes it by hand (larger
    than the add/remove ε). A release without sampling is said to be over-counted
    there; an event PLD cannot account under replace-one gets no number."""
    from kdp.training import statement

    model = _model("global", sigma=1.5)
    model.fit(*_data(), epochs=2, verbose=0)
    text = model.privacy_statement()
    assert f"N = {N} and what is derived from it (q = b/N" in text
    assert "treated as public" in text and "already knows N" in text
    replace_one = float(re.search(r"replace-one adjacency \(N kept private\): ε = ([0-9.e+-]+) "
                                  r"at the model's δ \(privacy-loss distributions\)\.", text)[1])
    acc = dp_accounting.pld.PLDAccountant(dp_accounting.NeighboringRelation.REPLACE_ONE,
                                          value_discretization_interval=privacy.PLD_DISCRETIZATION)
    steps = model.privacy_ledger.training_steps()
    acc.compose(dp_accounting.PoissonSampledDpEvent(B / N, dp_accounting.GaussianDpEvent(1.5)), steps)
    assert replace_one == pytest.approx(acc.get_epsilon(DELTA), rel=1e-2)
    assert replace_one > 1.2 * model.privacy_spent()[0]
    unsampled = statement._replace_one([dp_accounting.GaussianDpEvent(2.0)], DELTA)
    assert "counted at twice its sensitivity" in unsampled
    select = dp_accounting.dp_event.RepeatAndSelectDpEvent(
        dp_accounting.GaussianDpEvent(2.0), 3.0, 1.0)
    assert "not computed" in statement._replace_one([select], DELTA)
