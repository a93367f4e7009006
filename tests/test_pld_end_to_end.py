"""PLD end to end: `make_private(..., accountant="pld")`, the persistent budget,
ε in the logs and the privacy statement all use the model's accountant.

Every expected ε is recomputed independently with dp-accounting's own
`PLDAccountant` (at kdp's documented `PLD_DISCRETIZATION`) or `RdpAccountant`
on the steps written out by hand (global noise: σ_eff = σ), never taken from
kdp's calibration.
"""

import functools
import warnings

import dp_accounting
import h5py
import keras
import numpy as np
import pytest

from kdp import accounting, callbacks, layers, losses, privacy, tuning
from kdp.model import DP_Sequential, DPParameters
from kdp.pipeline import DatasetMetadata
from kdp.training import BudgetExceededError, saving
from kdp.training.ledger import event_mechanism, new_run_id

D, K, N, B, DELTA = 8, 4, 256, 32, 1e-3  # q = 1/8, 8 steps per epoch
EPOCHS, TARGET = 2, 2.0
STEPS = EPOCHS * N // B


def _model(sigma=1.0):
    model = DP_Sequential(
        [layers.DP_BoundedInput((D,), 2.0), layers.DP_QuickSpectralDense(8), layers.DP_GroupSort(2),
         layers.DP_QuickSpectralDense(K)],
        dataset_metadata=DatasetMetadata((D,), K, N, B),
        dp_parameters=DPParameters("global", sigma, DELTA))
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss=losses.DP_TauCategoricalCrossentropy(4.0))
    return model


def _data():
    rng = np.random.default_rng(0)
    return rng.normal(size=(N, D)).astype("float32"), rng.integers(0, K, N)


@functools.cache  # a subsampled Gaussian's RDP takes dp-accounting ~0.3 s
def _by_hand(sigma, steps, accountant="pld", delta=DELTA, interval=privacy.PLD_DISCRETIZATION):
    """ε of ``steps`` Poisson-subsampled Gaussians of multiplier σ, dp-accounting alone;
    PLD on kdp's documented grids (`PLD_DISCRETIZATION`, and below ε = 1 the
    smaller of that and ε on the finer `privacy.pld_interval` of it)."""
    acc = (dp_accounting.pld.PLDAccountant(value_discretization_interval=interval)
           if accountant == "pld" else dp_accounting.rdp.RdpAccountant())
    acc.compose(dp_accounting.PoissonSampledDpEvent(B / N, dp_accounting.GaussianDpEvent(sigma)), steps)
    eps = acc.get_epsilon(delta)
    finer = privacy.pld_interval(eps)
    if accountant == "pld" and finer < interval:
        return min(eps, _by_hand(sigma, steps, accountant, delta, finer))
    return eps


def _ledger_pld(model, delta=DELTA):
    """ε of the ledger's events, with a fresh dp-accounting `PLDAccountant`."""
    acc = dp_accounting.pld.PLDAccountant(value_discretization_interval=privacy.PLD_DISCRETIZATION)
    for event in model.privacy_ledger.events():
        acc.compose(event)
    return acc.get_epsilon(delta)


def _search_ledger(model):
    """Record in ``model``'s ledger a private hyper-parameter search (PLD cannot account it)."""
    event = tuning.selection_event(dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(B / N, dp_accounting.GaussianDpEvent(4.0)), 8), 2.0)
    model.privacy_ledger.record(event_mechanism(event), 1, new_run_id())


def test_pld_buys_less_noise_than_rdp_for_the_same_target():
    pld, rdp = _model(), _model()
    sigma_pld = pld.make_private(TARGET, EPOCHS, accountant="pld")
    sigma_rdp = rdp.make_private(TARGET, EPOCHS, accountant="rdp")
    assert pld.privacy_gate.accountant == "pld" and rdp.privacy_gate.accountant == "rdp"
    assert sigma_pld < 0.95 * sigma_rdp  # measured: 1.101 vs 1.245 (−12 %)
    # Each σ is the smallest for its own accountant, by dp-accounting alone ...
    assert _by_hand(sigma_pld, STEPS) <= TARGET < _by_hand(sigma_pld * 0.999, STEPS)
    assert _by_hand(sigma_rdp, STEPS, "rdp") <= TARGET < _by_hand(sigma_rdp * 0.999, STEPS, "rdp")
    # ... and RDP would charge the PLD σ more than the target.
    assert _by_hand(sigma_pld, STEPS, "rdp") > TARGET
    assert accounting.get_max_epochs(TARGET, pld) == EPOCHS == accounting.get_max_epochs(TARGET, rdp)
    assert accounting.get_max_epochs(TARGET, pld, "rdp") < EPOCHS


def test_a_pld_calibrated_fit_runs_exactly_its_epochs_and_reports_pld():
    model = _model()
    sigma = model.make_private(TARGET, EPOCHS, accountant="pld")
    x, y = _data()
    with pytest.warns(UserWarning, match="stopped by the privacy budget"):
        history = model.fit(x, y, epochs=EPOCHS + 1, verbose=0, callbacks=[callbacks.DP_Accountant()])
    assert model.privacy_ledger.training_steps() == STEPS  # all E epochs, not one step more
    assert len(history.history["epsilon"]) == EPOCHS  # stopped before epoch E + 1
    eps = _ledger_pld(model)
    assert eps == pytest.approx(_by_hand(sigma, STEPS), rel=1e-12) and eps <= TARGET
    # The logs, privacy_spent, get_eps_delta and the statement give that same PLD ε.
    assert history.history["epsilon"][-1] == pytest.approx(eps, rel=1e-12)
    assert model.privacy_spent()[0] == pytest.approx(eps, rel=1e-12)
    assert accounting.get_eps_delta(model, 0)[0] == pytest.approx(eps, rel=1e-12)
    text = model.privacy_statement()
    assert "PLD accountant" in text and f"ε = {eps:.4g} at δ = {DELTA:.3g}" in text
    assert model.privacy_spent("rdp")[0] > TARGET  # an explicit accountant still works
    with pytest.raises(BudgetExceededError, match="exhausted"):
        model.fit(x, y, epochs=1, verbose=0)
    assert model.privacy_ledger.training_steps() == STEPS


class _StepLogs(keras.callbacks.Callback):
    """Each step's logged ε with the number of steps then in the ledger."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def on_train_batch_end(self, batch, logs=None):
        self.seen.append((logs["epsilon"], self.model.privacy_ledger.training_steps()))


def test_a_steps_pld_epsilon_is_an_upper_bound_computed_four_times_an_epoch():
    """With PLD a step's logs show ε at the next of 4 points of the epoch: never
    below dp-accounting's ε of the steps done, exact at the points (steps 2, 4, 6,
    8 of each 8-step epoch), at most 4 distinct values an epoch. Negative control:
    the steps between the points log more than their exact ε, so a check of
    equality would fail there."""
    model = _model()
    sigma = model.make_private(TARGET, EPOCHS, accountant="pld")
    spy = _StepLogs()
    model.fit(*_data(), epochs=EPOCHS, verbose=0, callbacks=[spy])
    assert [steps for _, steps in spy.seen] == list(range(1, STEPS + 1))
    for logged, steps in spy.seen:
        exact = _by_hand(sigma, steps)
        assert logged >= exact * (1 - 1e-12)
        assert logged == pytest.approx(_by_hand(sigma, 2 * -(-steps // 2)), rel=1e-12)
    assert len({eps for eps, _ in spy.seen}) == STEPS // 2
    odd = [(eps, steps) for eps, steps in spy.seen if steps % 2]
    assert all(eps > _by_hand(sigma, steps) * (1 + 1e-6) for eps, steps in odd)


def test_a_steps_rdp_epsilon_is_exact():
    model = _model()
    sigma = model.make_private(TARGET, EPOCHS, accountant="rdp")
    spy = _StepLogs()
    model.fit(*_data(), epochs=1, verbose=0, callbacks=[spy])
    for logged, steps in spy.seen:
        assert logged == pytest.approx(_by_hand(sigma, steps, "rdp"), rel=1e-9)


def test_negative_control_budgeting_a_pld_calibration_with_rdp_stops_early():
    model = _model()
    model.make_private(TARGET, EPOCHS, accountant="pld")
    model.privacy_gate.accountant = "rdp"  # the mismatch the design prevents
    with pytest.warns(UserWarning, match="stopped by the privacy budget"):
        model.fit(*_data(), epochs=EPOCHS, verbose=0)
    assert model.privacy_ledger.training_steps() < STEPS  # the last epoch was refused


def test_the_accountant_is_saved_with_the_model(tmp_path):
    model = _model()
    model.make_private(TARGET, EPOCHS, accountant="pld")
    model.fit(*_data(), epochs=1, verbose=0)
    path = str(tmp_path / "m.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    assert loaded.privacy_gate.accountant == "pld" and loaded.dp_parameters.epsilon_max == TARGET
    assert loaded.privacy_spent() == model.privacy_spent()
    assert accounting.get_max_epochs(TARGET, loaded) == EPOCHS - 1

    # A weights file written before kdp saved the accountant: the loading model's is kept.
    weights = str(tmp_path / "old.weights.h5")
    model.save_weights(weights)
    with h5py.File(weights, "a") as f:
        found = []
        f.visit(lambda name: found.append(name) if name.endswith(saving.ACCOUNTANT_KEY) else None)
        assert found
        for name in found:
            del f[name]
    old = _model()
    old.load_weights(weights)
    assert old.privacy_gate.accountant == "tightest" and old.privacy_ledger == model.privacy_ledger


def test_make_private_falls_back_to_rdp_for_a_ledger_pld_cannot_account():
    model, twin = _model(), _model()
    for m in (model, twin):
        _search_ledger(m)
    with pytest.warns(UserWarning, match="RDP accountant, not PLD.*RepeatAndSelectDpEvent"):
        sigma = model.make_private(TARGET + 2.0, EPOCHS, accountant="pld")
    assert model.privacy_gate.accountant == "rdp"
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        assert twin.make_private(TARGET + 2.0, EPOCHS, accountant="rdp") == sigma
        # the default keeps RDP's bound, the only one, without a warning
        assert twin.make_private(TARGET + 2.0, EPOCHS) == pytest.approx(sigma, rel=1e-3)
    assert accounting.get_max_epochs(TARGET + 2.0, model) == EPOCHS


def test_a_pld_model_whose_ledger_gains_a_search_reports_rdp():
    model = _model()
    model.make_private(TARGET, EPOCHS, accountant="pld")
    model.fit(*_data(), epochs=1, verbose=0)
    _search_ledger(model)
    assert model.privacy_gate.accountant_for(model.privacy_ledger.events()) == "rdp"
    assert model.privacy_spent() == model.privacy_spent("rdp")  # a valid bound, never an error
    assert "RDP accountant" in model.privacy_statement()
    assert model.privacy_gate.budgets() == [(TARGET, "rdp")]
    with pytest.raises(ValueError, match="RDP only"):
        model.privacy_spent("pld")


def test_a_refused_make_private_keeps_the_accountant():
    model = _model(sigma=0.8)
    model.fit(*_data(), epochs=2, verbose=0)
    with pytest.raises(ValueError, match="unreachable"):
        model.make_private(model.privacy_spent("pld")[0] * 0.9, 1)
    assert model.privacy_gate.accountant == "tightest" and model.dp_parameters.epsilon_max is None
    with pytest.raises(ValueError, match="accountant must be one of"):
        model.make_private(TARGET, 1, accountant="prv")


def test_a_lowered_budget_is_enforced_at_once():
    # The gate caches how many steps a budget allows: changing the budget (or its
    # accountant) must invalidate it, even when σ and the ledger did not change.
    model = _model()
    mechanism = model.step_plan().fit_mechanism
    model.dp_parameters = model.dp_parameters.replace(epsilon_max=10.0)
    generous = model.privacy_gate.remaining(mechanism)
    model.dp_parameters = model.dp_parameters.replace(epsilon_max=3.0)
    assert 0 < model.privacy_gate.remaining(mechanism) < generous
    tightest = model.privacy_gate.remaining(mechanism)
    model.privacy_gate.accountant = "rdp"
    assert model.privacy_gate.remaining(mechanism) < tightest
