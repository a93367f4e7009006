"""Private hyper-parameter search (`kdp.tuning`): its ε against Papernot and
Steinke 2022's theorems computed here from their formulas, its sampler, and the
rule that no trial is left out of ε."""

import math

import dp_accounting
import numpy as np
import pytest
from scipy.stats import norm

import kdp
from kdp import accounting, tuning
from kdp.training.ledger import PrivacyLedger, event_mechanism

ORDERS = np.asarray(dp_accounting.rdp.rdp_privacy_accountant.DEFAULT_RDP_ORDERS, dtype=float)


# --- the theorems, written from the paper (not from kdp or dp-accounting) ----------------

def gaussian_rdp(sigma):
    """Mironov 2017, Prop. 7: the Gaussian mechanism (sensitivity 1) is (λ, λ/2σ²)-RDP."""
    return ORDERS / (2.0 * sigma**2)


def epsilon_from_rdp(rdp, delta):
    """Canonne, Kamath and Steinke 2020, Prop. 12: ε = rdp + log(1 - 1/λ) - log(δλ)/(λ-1)."""
    a = ORDERS[ORDERS > 1.01]
    r = rdp[ORDERS > 1.01]
    return max(0.0, float(np.min(r + np.log1p(-1 / a) - np.log(delta * a) / (a - 1))))


def delta_from_rdp(rdp, eps):
    """The same proposition, solved for δ."""
    a = ORDERS[ORDERS > 1.01]
    r = rdp[ORDERS > 1.01]
    log_delta = (a - 1) * (r - eps + np.log1p(-1 / a)) - np.log(a)
    return min(1.0, float(np.exp(np.min(log_delta))))


def tnb_search_rdp(rdp, eta, gamma):
    """Theorem 2: ε'(λ) = ε(λ) + (1+η)(1-1/λ̂)ε(λ̂) + (1+η)log(1/γ)/λ̂ + log E[K]/(λ-1),
    minimised over λ̂, then made monotone in λ (RDP is non-decreasing in λ)."""
    mean = (eta * (1 - gamma) / (gamma * (1 - gamma**eta)) if eta > 0
            else (1 - gamma) / (gamma * math.log(1 / gamma)))
    constant = (1 + eta) * np.min((1 - 1 / ORDERS) * rdp + math.log(1 / gamma) / ORDERS)
    out = np.where(ORDERS > 1, rdp + math.log(mean) / np.maximum(ORDERS - 1, 1e-300) + constant,
                   np.inf)
    return np.minimum.accumulate(out[::-1])[::-1], mean


def poisson_search_rdp(rdp, mu):
    """Theorem 6: ε'(λ) = ε(λ) + μ δ̂ + log μ/(λ-1), with Q (ε̂, δ̂)-DP at
    ε̂ = log(1 + 1/(λ-1)) (here δ̂ from Q's RDP, Canonne et al. Prop. 12)."""
    out = np.full_like(ORDERS, np.inf)
    for i, lam in enumerate(ORDERS):
        if lam > 1:
            out[i] = rdp[i] + mu * delta_from_rdp(rdp, math.log1p(1 / (lam - 1))) \
                + math.log(mu) / (lam - 1)
    return out


class FakeTrial:
    """What `private_search` reads of a trained model: its ledger."""

    def __init__(self, sigma, releases=1):
        self.privacy_ledger = PrivacyLedger()
        self.privacy_ledger.record(event_mechanism(dp_accounting.GaussianDpEvent(sigma)),
                                   releases, kdp.training.ledger.new_run_id())


def search(sigma, mean, distribution, eta=None, seed=0, releases=lambda c: 1, **kwargs):
    counter = {"trials": 0}

    def train_trial(candidate):
        counter["trials"] += 1
        return FakeTrial(sigma, releases(counter["trials"]))

    result = tuning.private_search(
        train_trial, [0.1, 0.2, 0.3], dp_accounting.GaussianDpEvent(sigma), mean_trials=mean,
        distribution=distribution, eta=eta, public_score=lambda m: 0.0,
        rng=np.random.default_rng(seed), **kwargs)
    return result, counter["trials"]


# --- the reported ε equals the theorems' -------------------------------------------------

@pytest.mark.parametrize("sigma", [1.0, 3.0, 10.0])
@pytest.mark.parametrize("eta,gamma", [(0.0, 0.1), (0.5, 0.05), (1.0, 0.1), (2.0, 0.2)])
def test_truncated_negative_binomial_search_matches_theorem_2(sigma, eta, gamma):
    rdp, mean = tnb_search_rdp(gaussian_rdp(sigma), eta, gamma)
    expected = epsilon_from_rdp(rdp, 1e-5)
    result, _ = search(sigma, mean, "truncated_negative_binomial", eta)
    assert result.epsilon(1e-5) == pytest.approx(expected, rel=1e-6)
    single = epsilon_from_rdp(gaussian_rdp(sigma), 1e-5)
    assert result.epsilon(1e-5) > single  # the search costs more than one trial


@pytest.mark.parametrize("sigma", [2.0, 5.0])
@pytest.mark.parametrize("mu", [2.0, 10.0])
def test_poisson_search_matches_theorem_6(sigma, mu):
    rdp = gaussian_rdp(sigma)
    expected = epsilon_from_rdp(poisson_search_rdp(rdp, mu), 1e-5)
    result, _ = search(sigma, mu, "poisson")
    assert result.epsilon(1e-5) == pytest.approx(expected, rel=1e-6)
    # sound against the exact (ε̂, δ̂) of the Gaussian (Balle and Wang 2018), a smaller δ̂
    exact = np.array([rdp[i] + mu * (norm.cdf(-math.log1p(1 / (lam - 1)) * sigma + 0.5 / sigma)
                                     - (1 + 1 / (lam - 1)) * norm.cdf(
                                         -math.log1p(1 / (lam - 1)) * sigma - 0.5 / sigma))
                      + math.log(mu) / (lam - 1) if lam > 1 else np.inf
                      for i, lam in enumerate(ORDERS)])
    assert result.epsilon(1e-5) >= epsilon_from_rdp(exact, 1e-5) - 1e-9


def test_geometric_and_logarithmic_are_the_binomial_at_eta_1_and_0():
    for name, eta in (("geometric", 1.0), ("logarithmic", 0.0)):
        named, _ = search(2.0, 5.0, name)
        tnb, _ = search(2.0, 5.0, "truncated_negative_binomial", eta)
        assert named.epsilon(1e-5) == pytest.approx(tnb.epsilon(1e-5), rel=1e-12)


def test_the_search_composes_with_the_prior_ledger():
    prior = PrivacyLedger()
    prior.record_training_steps(100, 1.5, 0.05)
    result, _ = search(3.0, 4.0, "geometric", prior_ledger=prior)
    search_only, _ = search(3.0, 4.0, "geometric")
    composed = accounting.epsilon_of_events(prior.events() + [result.event], 1e-5)
    assert result.epsilon(1e-5) == pytest.approx(composed, rel=1e-9)
    assert result.epsilon(1e-5) > max(search_only.epsilon(1e-5),
                                      accounting.epsilon_of_events(prior.events(), 1e-5))
    with pytest.raises(ValueError, match="RDP only"):
        accounting.epsilon_of_events(result.ledger.events(), 1e-5, "pld")


# --- no trial is left out -------------------------------------------------------------------

def test_every_trial_is_inside_the_reported_epsilon():
    """The search's ε is the theorem's for E[K], whatever K was drawn: a search
    that only kept the winner's ledger (ε of one trial) or composed the K it drew
    would report another number. Negative control: the winner's own ledger."""
    for seed in range(4):
        result, trials = search(3.0, 6.0, "geometric", seed=seed)
        assert trials == result.trials >= 1
        rdp, _ = tnb_search_rdp(gaussian_rdp(3.0), 1.0, tuning.tnb_gamma(1.0, 6.0))
        assert result.epsilon(1e-5) == pytest.approx(epsilon_from_rdp(rdp, 1e-5), rel=1e-6)
        winner_only = epsilon_from_rdp(gaussian_rdp(3.0), 1e-5)
        assert result.epsilon(1e-5) > 1.5 * winner_only
        assert result.model.privacy_ledger is result.ledger
        assert len(result.ledger.entries) == 1  # the trials' own entries are inside the event


def test_a_trial_above_its_declared_event_stops_the_search_with_every_trial_composed():
    with pytest.raises(tuning.TrialBudgetError, match="more than the declared") as info:
        search(3.0, 50.0, "geometric", seed=1, releases=lambda k: 2 if k == 3 else 1)
    ledger = info.value.ledger
    assert ledger.releases("event") == 1 + 1 + 2  # trials 1, 2 and the offending 3
    expected = epsilon_from_rdp(gaussian_rdp(3.0) * 4, 1e-5)
    assert accounting.epsilon_of_events(ledger.events(), 1e-5, "rdp") == pytest.approx(expected, rel=1e-6)


def test_poisson_may_draw_no_trial_and_still_charges_the_search():
    for seed in range(50):
        result, trials = search(3.0, 1.0, "poisson", seed=seed)
        if trials == 0:
            break
    else:
        pytest.fail("Poisson(1) never drew 0 in 50 seeds")
    assert result.model is None and result.ledger.releases("event") == 1
    assert result.epsilon(1e-5) > 0


# --- the number of trials -------------------------------------------------------------------

@pytest.mark.parametrize("distribution,eta", [("geometric", None), ("logarithmic", None),
                                              ("truncated_negative_binomial", 0.5),
                                              ("poisson", None)])
def test_the_number_of_trials_has_the_requested_mean(distribution, eta):
    rng = np.random.default_rng(0)
    draws = np.array([tuning.sample_number_of_trials(5.0, distribution, eta, rng)
                      for _ in range(20000)])
    assert abs(draws.mean() - 5.0) < 4 * draws.std() / math.sqrt(len(draws))
    if distribution != "poisson":
        assert draws.min() >= 1
    if distribution == "logarithmic":  # P(K = k) ∝ (1-γ)^k / k
        gamma = tuning.tnb_gamma(0.0, 5.0)
        p1 = (1 - gamma) / -math.log(gamma)
        assert abs(np.mean(draws == 1) - p1) < 0.01


def test_tnb_gamma_inverts_the_mean():
    for eta in (0.0, 0.5, 1.0, 3.0):
        for mean in (1.5, 10.0, 100.0):
            assert tuning.tnb_mean(eta, tuning.tnb_gamma(eta, mean)) == pytest.approx(mean, rel=1e-9)


# --- refusals before any trial --------------------------------------------------------------

def test_bad_arguments_are_refused_before_any_trial():
    ran = []
    event = dp_accounting.GaussianDpEvent(1.0)

    def train_trial(c):
        ran.append(c)
        return FakeTrial(1.0)

    cases = [
        (dict(mean_trials=0.5, public_score=len), "mean_trials"),
        (dict(mean_trials=3, distribution="uniform", public_score=len), "distribution"),
        (dict(mean_trials=3, distribution="truncated_negative_binomial", public_score=len), "eta"),
        (dict(mean_trials=3), "exactly one score"),
        (dict(mean_trials=3, validation_data=([0], [0])), "score_noise_multiplier > 0"),
    ]
    for kwargs, match in cases:
        with pytest.raises(ValueError, match=match):
            tuning.private_search(train_trial, [1], event, **kwargs)
    with pytest.raises(ValueError, match="at least one"):
        tuning.private_search(train_trial, [], event, mean_trials=2, public_score=len)
    assert ran == []


# --- end to end on digits, with a private validation split ---------------------------------

def test_search_on_digits_returns_a_model_whose_epsilon_includes_the_search(tmp_path):
    import keras

    from kdp import layers as L, losses
    from kdp.pipeline import load_digits
    from kdp.training import budget

    (x, y), _, md = load_digits(batch_size=128, input_bound="normalize")
    x_train, y_train, x_val, y_val = x[:1100], y[:1100], x[1100:], y[1100:]
    md = kdp.DatasetMetadata((64,), 10, len(x_train), 128)

    def build(learning_rate):
        model = kdp.DP_Sequential(
            [L.DP_BoundedInput((64,), 1.0), L.DP_QuickSpectralDense(32), L.DP_GroupSort(2),
             L.DP_QuickSpectralDense(10)],
            dp_parameters=kdp.DPParameters("global", 2.0, 1e-5), dataset_metadata=md)
        model.compile(optimizer=keras.optimizers.Adam(learning_rate),
                      loss=losses.DP_TauCategoricalCrossentropy(8.0), metrics=["accuracy"])
        model.build((None, 64))
        return model

    trial_event = budget.fit_event(build(0.01), epochs=1)

    def train_trial(learning_rate):
        model = build(learning_rate)
        model.fit(x_train, y_train, epochs=1, verbose=0)
        return model

    result = tuning.private_search(
        train_trial, [0.003, 0.03], trial_event, mean_trials=2.0,
        validation_data=(x_val, y_val), score_noise_multiplier=5.0,
        rng=np.random.default_rng(3))
    per_trial = dp_accounting.ComposedDpEvent([trial_event, dp_accounting.GaussianDpEvent(5.0)])
    expected = accounting.epsilon_of_events(
        [dp_accounting.dp_event.RepeatAndSelectDpEvent(per_trial, 2.0, 1.0)], 1e-5)
    eps, _ = result.model.privacy_spent()
    assert eps == pytest.approx(expected, rel=1e-9) and eps == pytest.approx(result.epsilon(1e-5))
    assert eps > accounting.epsilon_of_events([per_trial], 1e-5)
    assert "private hyper-parameter search" in result.model.privacy_statement()
    path = tmp_path / "winner.keras"
    result.model.save(path)
    restored = keras.models.load_model(path)
    assert restored.privacy_spent()[0] == pytest.approx(eps, rel=1e-12)


def test_calibrated_trial_noise_makes_the_whole_search_cost_the_target():
    sigma = tuning.calibrate_trial_noise(3.0, 1e-5, 0.2, 100, mean_trials=4.0,
                                         score_noise_multiplier=5.0)
    def eps(s):
        trial = dp_accounting.ComposedDpEvent(
            [accounting.training_event(s, 0.2, 100), dp_accounting.GaussianDpEvent(5.0)])
        return accounting.epsilon_of_events([tuning.selection_event(trial, 4.0)], 1e-5)
    assert eps(sigma) <= 3.0 < eps(sigma * 0.999)
    with pytest.raises(ValueError, match="unreachable"):
        tuning.calibrate_trial_noise(0.1, 1e-5, 0.2, 100, 4.0, score_noise_multiplier=0.5)
