"""ε is right: kdp.accounting against dp-accounting, a closed form, and the anchors.

Every expected value here is computed independently of kdp: directly with
`dp_accounting`, with the analytic Gaussian mechanism of Balle & Wang (2018)
written out below with `math.erf`, or read from the experimental settings of Béthune et al. (2024).
"""

import functools
import json
import math

import dp_accounting
import keras
import numpy as np
import pytest

from kdp import accounting, layers, losses
from kdp.model import DP_Sequential, DPParameters
from kdp.pipeline import DatasetMetadata
from kdp.privacy import PLD_DISCRETIZATION, PLD_MIN_NOISE, PLD_RESOLUTION, accountants, calibration, stored

DELTA = 1e-5


# --- independent references ---------------------------------------------------

def _phi(x):
    return 0.5 * (1.0 + math.erf(x / math.sqrt(2.0)))


def analytic_gaussian_delta(epsilon, sigma):
    """δ(ε) of the Gaussian mechanism with sensitivity 1 and noise std σ, exact
    (Balle & Wang 2018, Thm. 8): Φ(1/(2σ) − εσ) − e^ε Φ(−1/(2σ) − εσ)."""
    return _phi(0.5 / sigma - epsilon * sigma) - math.exp(epsilon) * _phi(-0.5 / sigma - epsilon * sigma)


def analytic_gaussian_epsilon(sigma, delta):
    """The ε at which the exact δ(ε) curve of the Gaussian mechanism reaches δ (bisection)."""
    lo, hi = 0.0, 1.0
    while analytic_gaussian_delta(hi, sigma) > delta:
        hi *= 2.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if analytic_gaussian_delta(mid, sigma) > delta else (lo, mid)
    return hi


def direct_epsilon(sigma, q, steps, delta, accountant, interval=PLD_DISCRETIZATION):
    """dp-accounting alone: RDP, or PLD at ``interval`` (kdp's documented
    `PLD_DISCRETIZATION`)."""
    acc = (dp_accounting.rdp.RdpAccountant() if accountant == "rdp" else
           dp_accounting.pld.PLDAccountant(value_discretization_interval=interval))
    acc.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), steps)
    return acc.get_epsilon(delta)


def direct_pld(sigma, q, steps, delta):
    """PLD as kdp documents it: on `PLD_DISCRETIZATION`, and where that ε is below
    1e-3 × `PLD_RESOLUTION`, the smaller of it and ε on the grid 1e-3 / 2^k just
    below ε / `PLD_RESOLUTION`."""
    coarse = direct_epsilon(sigma, q, steps, delta, "pld")
    interval = PLD_DISCRETIZATION
    while interval > coarse / PLD_RESOLUTION:
        interval /= 2
    if interval == PLD_DISCRETIZATION:
        return coarse
    return min(coarse, direct_epsilon(sigma, q, steps, delta, "pld", interval))


def _model(noisify="global", sigma=2.0, n=60_000, b=1000, units=(), sampling="poisson"):
    """A small DP model; ``units`` sets the dense layers (one trainable variable each)."""
    stack = [layers.DP_BoundedInput((8,), 1.0)]
    stack += [layers.DP_QuickSpectralDense(u) for u in units] or [layers.DP_QuickSpectralDense(4)]
    model = DP_Sequential(
        stack,
        dp_parameters=DPParameters(noisify, sigma, DELTA, sampling=sampling),
        dataset_metadata=DatasetMetadata((8,), 4, n, b),
    )
    model.compile(optimizer="sgd", loss=losses.DP_TauCategoricalCrossentropy(1.0))
    return model


# --- agreement with dp-accounting ----------------------------------------------

@pytest.mark.parametrize("accountant", ["rdp", "pld"])
@pytest.mark.parametrize("sigma,q,steps", [(1.0, 0.01, 100), (2.0, 1 / 60, 600), (0.8, 0.1, 37)])
def test_compute_epsilon_equals_direct_dp_accounting(accountant, sigma, q, steps):
    got = accounting.compute_epsilon(sigma, q, steps, DELTA, accountant)
    direct = direct_pld if accountant == "pld" else functools.partial(direct_epsilon, accountant="rdp")
    assert got == pytest.approx(direct(sigma, q, steps, DELTA), rel=1e-9)


# --- closed form at q = 1 ----------------------------------------------------------

@pytest.mark.parametrize("sigma,steps", [(1.0, 1), (2.0, 4), (5.0, 10), (0.7, 1)])
def test_unsampled_gaussian_matches_analytic_gaussian_mechanism(sigma, steps):
    # T unsampled Gaussian steps = one Gaussian of noise σ/√T (exact composition).
    exact = analytic_gaussian_epsilon(sigma / math.sqrt(steps), DELTA)
    pld = accounting.compute_epsilon(sigma, 1.0, steps, DELTA, "pld")
    rdp = accounting.compute_epsilon(sigma, 1.0, steps, DELTA, "rdp")
    assert pld == pytest.approx(exact, rel=2e-3)  # PLD is (near) exact for a Gaussian
    assert exact <= rdp <= 1.25 * exact  # RDP is a valid but looser upper bound


def test_analytic_reference_is_itself_right():
    # Sanity of the independent reference: δ(ε) decreases, and at ε = 0 equals 2Φ(1/(2σ)) − 1.
    assert analytic_gaussian_delta(0.0, 1.0) == pytest.approx(2 * _phi(0.5) - 1)
    eps = analytic_gaussian_epsilon(1.0, DELTA)
    assert analytic_gaussian_delta(eps, 1.0) == pytest.approx(DELTA, rel=1e-6)


# --- monotonicity, max steps / epochs, calibration ----------------------------------

@pytest.mark.parametrize("accountant", ["rdp", "pld"])
def test_epsilon_non_decreasing_in_steps(accountant):
    grid = [0, 1, 2, 5, 10, 50, 100, 300, 1000]
    eps = [accounting.compute_epsilon(1.1, 0.02, s, DELTA, accountant) for s in grid]
    assert eps[0] == 0.0
    assert all(a <= b for a, b in zip(eps, eps[1:])), eps


@pytest.mark.parametrize("eps_max,sigma,q", [(1.0, 1.0, 0.01), (3.0, 0.9, 0.05), (8.0, 2.0, 0.2)])
def test_max_steps_brackets_the_budget(eps_max, sigma, q):
    n = accounting.max_steps(eps_max, sigma, q, DELTA)
    assert n > 0
    assert accounting.compute_epsilon(sigma, q, n, DELTA) <= eps_max
    assert accounting.compute_epsilon(sigma, q, n + 1, DELTA) > eps_max


def test_max_steps_is_zero_when_one_step_is_too_much():
    assert accounting.max_steps(0.01, 0.5, 0.5, DELTA) == 0


@pytest.mark.parametrize("noisify,units,expected", [("global", (), 92), ("per-layer", (8, 8, 8, 4), 11)])
def test_get_max_epochs_anchor_and_bracket(noisify, units, expected):
    # Béthune et al. 2024 settings: MNIST N = 60 000, b = 1000, σ = 2, ε_max = 3 (RDP): 92 global, 11 per-layer D=4.
    model = _model(noisify, units=units)
    epochs = accounting.get_max_epochs(3.0, model, "rdp")
    assert epochs == expected
    spe = model.dataset_metadata.steps_per_epoch
    sigma = model.effective_noise_multiplier()
    assert accounting.compute_epsilon(sigma, 1 / 60, epochs * spe, DELTA, "rdp") <= 3.0
    assert accounting.compute_epsilon(sigma, 1 / 60, (epochs + 1) * spe, DELTA, "rdp") > 3.0
    eps, delta = accounting.get_eps_delta(model, epochs, "rdp")
    assert eps <= 3.0 < accounting.get_eps_delta(model, epochs + 1, "rdp")[0] and delta == DELTA
    # by default the smaller of PLD and RDP: more epochs, each one below its budget
    tightest = accounting.get_max_epochs(3.0, model)
    assert tightest > expected
    assert accounting.get_eps_delta(model, tightest)[0] <= 3.0 < accounting.get_eps_delta(
        model, tightest + 1)[0]


@pytest.mark.parametrize("accountant,target,q,steps", [
    ("rdp", 1.0, 0.05, 500), ("rdp", 3.0, 0.01, 1000), ("rdp", 8.0, 0.2, 200), ("pld", 3.0, 0.05, 100),
])
def test_calibrate_noise_multiplier_inverts_compute_epsilon(accountant, target, q, steps):
    sigma = accounting.calibrate_noise_multiplier(target, q, steps, DELTA, accountant=accountant)
    eps = accounting.compute_epsilon(sigma, q, steps, DELTA, accountant)
    assert eps <= target
    assert eps == pytest.approx(target, abs=1e-3)


def test_a_calibration_is_searched_once_per_set_of_arguments(monkeypatch):
    """The σ of arguments already calibrated is the searched one, without a new
    search; any changed argument (here the extra events, a NumPy rate equal to a
    float's is the same argument) searches again."""
    monkeypatch.delenv(stored.VARIABLE, raising=False)  # counts the searches of this process
    searches = _counted(monkeypatch, dp_accounting, "calibrate_dp_mechanism")
    extra = [dp_accounting.GaussianDpEvent(20.0)]
    args = (2.5, 0.0371, 97, DELTA)
    first = accounting.calibrate_noise_multiplier(*args, extra_events=extra)
    again = accounting.calibrate_noise_multiplier(2.5, np.float64(0.0371), 97, DELTA,
                                                  extra_events=list(extra))
    assert len(searches) == 1 and float(again) == float(first)
    assert again.calibration is not first.calibration
    other = accounting.calibrate_noise_multiplier(*args, extra_events=[dp_accounting.GaussianDpEvent(10.0)])
    plain = accounting.calibrate_noise_multiplier(*args)
    assert len(searches) == 3 and float(plain) < float(first) < float(other)


def _counted(monkeypatch, owner, name):
    """The list to which every later call of ``owner.name`` appends its arguments."""
    calls, function = [], getattr(owner, name)
    monkeypatch.setattr(owner, name, lambda *a, **k: calls.append(a) or function(*a, **k))
    return calls


def _forget_in_memory():
    """Empty the per-process caches of accounting, as a new process starts."""
    for cached in (calibration._smallest_sigma, accountants._pld_epsilon_of_config,
                   accountants._unit_rdp_cached, accountants._unit_rdp_of_config,
                   accountants._poisson_gaussian_pld, accountants._unit_poisson_gaussian_pld):
        cached.cache_clear()


@pytest.mark.parametrize("accountant", ["tightest", "rdp"])
def test_a_stored_calibration_and_epsilon_are_read_back_exactly(accountant, monkeypatch, tmp_path):
    """With `KDP_ACCOUNTING_CACHE_DIR`, a process that finds the σ and ε another
    one computed reads them (no search, no accountant: the PLDs, RDP curves and σ
    come from the folder), bit for bit; any other argument computes afresh; an
    unset variable writes nothing."""
    args = (1.7, 0.0213, 311, DELTA, accountant)
    monkeypatch.delenv(stored.VARIABLE, raising=False)
    _forget_in_memory()
    sigma = accounting.calibrate_noise_multiplier(*args)
    epsilon = accounting.compute_epsilon(float(sigma), *args[1:])
    assert not any(tmp_path.iterdir())

    monkeypatch.setenv(stored.VARIABLE, str(tmp_path))
    for fresh_process in range(2):  # the first one writes, the second reads
        _forget_in_memory()
        accounting.compute_epsilon.cache_clear()
        searches = _counted(monkeypatch, dp_accounting, "calibrate_dp_mechanism")
        computed = (_counted(monkeypatch, accountants, "_pld_on_grid"),
                    _counted(monkeypatch, dp_accounting.rdp.RdpAccountant, "compose"))
        again = accounting.calibrate_noise_multiplier(*args)
        assert float(again) == float(sigma) and again.calibration["accountant"] == accountant
        assert accounting.compute_epsilon(float(sigma), *args[1:]) == epsilon
        assert bool(searches) == any(computed) == (fresh_process == 0)
    entries = len(list(tmp_path.iterdir()))
    other = accounting.calibrate_noise_multiplier(1.7, 0.0213, 311, DELTA / 10, accountant)
    assert searches and float(other) > float(sigma) and len(list(tmp_path.iterdir())) > entries


def test_a_stored_entry_is_used_only_under_its_own_key(monkeypatch, tmp_path):
    """An entry is keyed by the function, its arguments and the code's fingerprint:
    another δ, or the same arguments after a change of kdp's accounting code or
    of dp-accounting's version, is computed afresh, and an entry whose stored key
    differs from its file's (copied over another, corrupted) is not read. Control:
    the value in an entry is what is returned, so a forged one with the right key
    would be (the folder is trusted as the code is)."""
    monkeypatch.setenv(stored.VARIABLE, str(tmp_path))
    _forget_in_memory()
    event = accounting.training_event(1.3, 0.01, 500)
    first = accounting.epsilon_of_events([event], DELTA, "pld")
    (path,) = tmp_path.iterdir()
    entry = json.loads(path.read_text())

    def epsilon(delta=DELTA):
        _forget_in_memory()
        return accounting.epsilon_of_events([event], delta, "pld")

    path.write_text(json.dumps({**entry, "value": 123.0}))  # the control: a forged value ...
    assert epsilon() == 123.0
    path.write_text(json.dumps({**entry, "key": entry["key"].replace("500", "501"), "value": 123.0}))
    assert epsilon() == first  # ... is refused under another key,
    path.write_text("{not json")
    assert epsilon() == first  # a corrupted entry is recomputed
    assert epsilon(DELTA / 10) > first
    monkeypatch.setattr(stored, "fingerprint", lambda: "another version of the code")
    path.write_text(json.dumps({**entry, "value": 123.0}))
    assert epsilon() == first


# --- per-layer composition ------------------------------------------------------------

@pytest.mark.parametrize("depth", [1, 2, 4, 7])
def test_per_layer_sigma_eff_is_global_sigma_over_sqrt_depth(depth):
    sigma = 2.0
    assert accounting.effective_noise_multiplier([sigma] * depth) == pytest.approx(sigma / math.sqrt(depth))
    model = _model("per-layer", sigma, units=(8,) * (depth - 1) + (4,))
    assert len(model.trainable_variables) == depth
    assert model.effective_noise_multiplier() == pytest.approx(sigma / math.sqrt(depth))
    per_layer = accounting.get_eps_delta(model, 3)[0]
    global_ = accounting.compute_epsilon(sigma / math.sqrt(depth), 1 / 60, 3 * 60, DELTA)
    assert per_layer == pytest.approx(global_, rel=1e-9)  # σ_eff computed in another order


def test_per_layer_sigma_eff_uses_the_noise_coefficients():
    model = _model("per-layer", 2.0, units=(8, 4))
    model.layers[1].nm_coef = 3.0  # σ_1 = 6, σ_2 = 2
    assert model.effective_noise_multiplier() == pytest.approx((6.0**-2 + 2.0**-2) ** -0.5)


# --- the anchor table (Béthune et al. 2024) -------------------------------------------

@pytest.mark.parametrize("epochs,rdp_g,pld_g,rdp_l,pld_l", [
    (1, 0.323, 0.259, 1.485, 1.016),
    (10, 0.915, 0.830, 2.824, 2.486),
    (100, 3.140, 2.891, 9.122, 8.416),
])
def test_anchor_table(epochs, rdp_g, pld_g, rdp_l, pld_l):
    # kdp's PLD grid (PLD_DISCRETIZATION = 1e-3, 10x dp-accounting's default) rounds
    # privacy losses up: ε may exceed the paper's by up to ~0.1 % (2.8938 for 2.891).
    steps = 60 * epochs
    for sigma, rdp, pld in ((2.0, rdp_g, pld_g), (1.0, rdp_l, pld_l)):
        assert accounting.compute_epsilon(sigma, 1 / 60, steps, DELTA, "rdp") == pytest.approx(rdp, abs=1.5e-3)
        eps = accounting.compute_epsilon(sigma, 1 / 60, steps, DELTA, "pld")
        assert pld - 1.5e-3 <= eps <= pld * 1.0015 + 1.5e-3


# --- shuffled batches -----------------------------------------------------------------

@pytest.mark.parametrize("steps,passes", [(1, 1), (10, 1), (11, 2), (35, 4)])
def test_shuffle_mode_is_one_unamplified_replace_one_gaussian_per_pass(steps, passes):
    # Documented assumption: each started pass over the data (≥ steps_per_epoch steps of at
    # most b records) is one Gaussian release under replace-one adjacency (σ/2), no amplification.
    sigma = 3.0
    eps = accounting.compute_epsilon(sigma, 0.1, steps, DELTA, "pld", sampling="shuffle", steps_per_epoch=10)
    exact = analytic_gaussian_epsilon(sigma / 2 / math.sqrt(passes), DELTA)
    assert eps == pytest.approx(exact, rel=2e-3)
    assert "replace-one" in accounting.ASSUMPTIONS["shuffle"]
    assert "Poisson" in accounting.ASSUMPTIONS["poisson"]


def test_shuffle_mode_is_never_cheaper_than_poisson():
    poisson = accounting.compute_epsilon(2.0, 0.1, 100, DELTA)
    shuffle = accounting.compute_epsilon(2.0, 0.1, 100, DELTA, sampling="shuffle", steps_per_epoch=10)
    assert shuffle > poisson


def test_shuffle_ledger_counts_started_passes():
    # Within one fit the steps are contiguous passes; a new fit starts a new pass.
    model = _model("global", 2.0, n=100, b=10, sampling="shuffle")
    spec = model.privacy_spec()
    assert spec["sampling"] == "shuffle" and spec["steps_per_epoch"] == 10
    ledger = model.privacy_ledger
    for _ in range(15):  # one fit of 15 steps: 2 passes
        ledger.record_training_steps(1, 2.0, 0.1, "shuffle", 10, run="fit-1")
    ledger.record_training_steps(1, 2.0, 0.1, "shuffle", 10, run="fit-2")  # a new fit: a 3rd pass
    eps, _ = model.privacy_spent("pld")
    assert eps == pytest.approx(analytic_gaussian_epsilon(1.0 / math.sqrt(3), DELTA), rel=2e-3)


# --- validation -----------------------------------------------------------------------

@pytest.mark.parametrize("kwargs,match", [
    (dict(noise_multiplier=0.0), "noise_multiplier"),
    (dict(noise_multiplier=-1.0), "noise_multiplier"),
    (dict(sampling_rate=0.0), "sampling_rate"),
    (dict(sampling_rate=1.5), "sampling_rate"),
    (dict(steps=-1), "steps"),
    (dict(delta=0.0), "delta"),
    (dict(delta=1.0), "delta"),
    (dict(accountant="prv"), "accountant"),
    (dict(sampling="replace"), "sampling"),
    (dict(sampling="shuffle"), "steps_per_epoch"),
])
def test_compute_epsilon_validates(kwargs, match):
    args = dict(noise_multiplier=1.0, sampling_rate=0.1, steps=10, delta=DELTA)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        accounting.compute_epsilon(**args)


def test_calibrate_and_max_steps_validate():
    with pytest.raises(ValueError, match="target_epsilon"):
        accounting.calibrate_noise_multiplier(0.0, 0.1, 10, DELTA)
    with pytest.raises(ValueError, match="epsilon_max"):
        accounting.max_steps(-1.0, 1.0, 0.1, DELTA)
    with pytest.raises(ValueError, match="noise multipliers"):
        accounting.effective_noise_multiplier([])


@pytest.mark.parametrize("kwargs,match", [
    (dict(noisify_strategy="local"), "noisify_strategy"),
    (dict(noise_multiplier=0.0), "noise_multiplier"),
    (dict(noise_multiplier=float("inf")), "noise_multiplier"),
    (dict(delta=0.0), "delta"),
    (dict(delta=1.0), "delta"),
    (dict(sampling="uniform"), "sampling"),
    (dict(seed=3), "reproducible"),
])
def test_dp_parameters_validate(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DPParameters(**kwargs)


@pytest.mark.parametrize("kwargs,match", [
    (dict(nb_samples_train=0), "nb_samples_train"),
    (dict(batch_size=0), "batch_size"),
    (dict(batch_size=101), "batch_size"),
    (dict(max_norm=0.0), "max_norm"),
])
def test_dataset_metadata_validates(kwargs, match):
    args = dict(input_shape=(8,), nb_classes=4, nb_samples_train=100, batch_size=10)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        DatasetMetadata(**args)


def test_get_eps_delta_includes_what_the_ledger_spent():
    model = _model("global", 2.0)
    model.privacy_ledger.record_training_steps(120, 2.0, 1 / 60, "poisson", 60)
    assert model.privacy_spent()[0] == pytest.approx(accounting.compute_epsilon(2.0, 1 / 60, 120, DELTA))
    assert accounting.get_eps_delta(model, 3)[0] == pytest.approx(
        accounting.compute_epsilon(2.0, 1 / 60, 300, DELTA))
    assert accounting.get_max_epochs(3.0, model, "rdp") == 92 - 2
    keras.backend.clear_session()


# --- the tightest ε: the smaller of PLD (refined at small ε) and RDP --------------------

@pytest.mark.parametrize("sigma,q,steps,rdp,coarse,fine_grid", [
    (1.3, 0.1, 40, 3.302, 2.897, 1e-4),  # PLD below RDP (+14 %): PLD is reported
    (3.825, 6.4e-4, 5000, 0.0539, 0.0776, 1e-5),  # at small ε the grid of 1e-3 was above RDP
])
def test_default_epsilon_is_the_smaller_of_pld_and_rdp(sigma, q, steps, rdp, coarse, fine_grid):
    assert direct_epsilon(sigma, q, steps, DELTA, "rdp") == pytest.approx(rdp, abs=1e-3)
    assert direct_epsilon(sigma, q, steps, DELTA, "pld") == pytest.approx(coarse, abs=1e-3)
    fine = direct_epsilon(sigma, q, steps, DELTA, "pld", fine_grid)  # finer than kdp's grid
    got = accounting.compute_epsilon(sigma, q, steps, DELTA)
    # an upper bound (pessimistic grids are above the finer one), within 2 % of the fine one
    assert fine <= got <= fine * 1.02
    assert got < min(rdp, coarse) * 0.9 if steps == 5000 else got < rdp * 0.9
    assert accounting.compute_epsilon(sigma, q, steps, DELTA, "pld") == got


def test_a_model_without_make_private_reports_and_budgets_the_tightest():
    model = _model("global", 1.3, n=10_000, b=1000)
    model.privacy_ledger.record_training_steps(40, 1.3, 0.1, "poisson", 10)
    assert model.privacy_gate.accountant == "tightest"
    eps = model.privacy_spent()[0]
    assert eps == pytest.approx(direct_epsilon(1.3, 0.1, 40, DELTA, "pld", 1e-4), rel=1e-3)
    assert eps < model.privacy_spent("rdp")[0] / 1.1
    assert "Privacy spent (min of the PLD and RDP accountants)" in model.privacy_statement()
    keras.backend.clear_session()


def test_tightest_keeps_only_the_bounds_dp_accounting_supports():
    # negative controls: where one accountant cannot account the events, the other's ε
    poisson = accounting.training_event(2.0, 0.01, 300)
    selection = dp_accounting.dp_event.RepeatAndSelectDpEvent(dp_accounting.GaussianDpEvent(3.0), 2.0, 1.0)
    for events, alone in ([[poisson], "pld"], [[poisson, selection], "rdp"]):
        assert accounting.epsilon_of_events(events, DELTA) == accounting.epsilon_of_events(
            events, DELTA, alone)
    replace_one = accounting.epsilon_of_events([poisson], DELTA, neighboring=accounting.REPLACE_ONE)
    assert replace_one == accounting.epsilon_of_events(
        [poisson], DELTA, "pld", neighboring=accounting.REPLACE_ONE)


def test_noise_below_the_pld_floor_is_accounted_in_rdp_only():
    # PLD's grid grows as 1/σ²: at σ = 1e-3 it would need some 200 GB; below PLD_MIN_NOISE
    # the tightest ε is RDP's and an explicit PLD request is refused
    below, at = 0.5 * PLD_MIN_NOISE, PLD_MIN_NOISE
    rdp = direct_epsilon(below, 1.0, 1, DELTA, "rdp")
    assert direct_epsilon(below, 1.0, 1, DELTA, "pld") < rdp  # control: PLD would be lower
    assert accounting.compute_epsilon(below, 1.0, 1, DELTA) == pytest.approx(rdp, rel=1e-9)
    with pytest.raises(ValueError, match="PLD_MIN_NOISE"):
        accounting.compute_epsilon(below, 1.0, 1, DELTA, "pld")
    assert accounting.compute_epsilon(at, 1.0, 1, DELTA) < direct_epsilon(at, 1.0, 1, DELTA, "rdp")
    assert accounting.compute_epsilon(1e-3, 1.0, 1, DELTA) == pytest.approx(
        direct_epsilon(1e-3, 1.0, 1, DELTA, "rdp"), rel=1e-9)
    sigma = accounting.calibrate_noise_multiplier(5000.0, 1.0, 1, DELTA)  # σ far below the floor
    assert accounting.compute_epsilon(float(sigma), 1.0, 1, DELTA) <= 5000.0


def test_calibration_uses_the_reported_epsilon():
    sigma = accounting.calibrate_noise_multiplier(0.05, 6.4e-4, 5000, DELTA)
    eps = accounting.compute_epsilon(float(sigma), 6.4e-4, 5000, DELTA)
    assert eps <= 0.05 and eps == pytest.approx(0.05, rel=1e-2)
    assert float(sigma) < float(accounting.calibrate_noise_multiplier(
        0.05, 6.4e-4, 5000, DELTA, "rdp"))
