"""Gaussian differential privacy (GDP) for full-batch NoisyGD.

Without subsampling, each NoisyGD step releases ``Σ_i clip_τ(g_i) + N(0, σ²τ²I)``:
a Gaussian mechanism with sensitivity τ under add/remove-one, i.e. ``1/σ``-GDP.
``T`` steps compose to ``μ = √T / σ``-GDP (Dong, Roth & Su 2019; AdaMix Lemma 8 and
Prop. 5, whose zCDP parameter is ρ = T/(2σ²); the paper prints T²/(2σ²)). A μ-GDP mechanism is
(ε, δ(ε))-DP for every ε ≥ 0 with (Balle & Wang 2018, AdaMix Lemma 6)

    δ(ε; μ) = Φ(μ/2 − ε/μ) − e^ε Φ(−μ/2 − ε/μ).

This is exact for Gaussian mechanisms, so it agrees with dp-accounting's analytic
Gaussian (`dp_accounting.get_epsilon_gaussian(σ/√T, δ)`) and, up to discretisation,
with its PLD accountant on ``SelfComposedDpEvent(GaussianDpEvent(σ), T)``
(see `noisy_gd_event`, `epsilon_dp_accounting`).
"""

import math

import dp_accounting
from scipy.optimize import brentq
from scipy.special import log_ndtr, ndtr


def gdp_delta(eps, mu):
    """δ(ε; μ) of a μ-GDP mechanism (AdaMix Lemma 6). ``mu = 0`` gives 0."""
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    if mu < 0:
        raise ValueError(f"mu must be >= 0, got {mu}")
    if mu == 0:
        return 0.0
    first = ndtr(mu / 2 - eps / mu)
    second = math.exp(eps + log_ndtr(-mu / 2 - eps / mu))
    return float(max(first - second, 0.0))


def gdp_eps(mu, delta):
    """Smallest ε ≥ 0 with δ(ε; μ) ≤ δ (δ(·; μ) is decreasing in ε)."""
    _check_delta(delta)
    if gdp_delta(0.0, mu) <= delta:
        return 0.0
    hi = 1.0
    while gdp_delta(hi, mu) > delta:
        hi *= 2.0
    return float(brentq(lambda e: gdp_delta(e, mu) - delta, 0.0, hi, xtol=1e-12, rtol=1e-12))


def gdp_mu(eps, delta):
    """Largest μ with δ(ε; μ) ≤ δ (δ(ε; ·) is increasing in μ)."""
    _check_delta(delta)
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    hi = 1.0
    while gdp_delta(eps, hi) < delta:
        hi *= 2.0
    return float(brentq(lambda m: gdp_delta(eps, m) - delta, 1e-12, hi, xtol=1e-14, rtol=1e-14))


def compose_gdp(mechanisms):
    """μ of the composition of Gaussian mechanisms ``[(Δ_i, σ_i)]``: ``√Σ(Δ_i/σ_i)²`` (Lemma 8).

    ``σ_i`` is the noise std (not a multiplier); ``Δ_i`` the L2 sensitivity.
    """
    total = 0.0
    for sensitivity, std in mechanisms:
        if std <= 0 or sensitivity < 0:
            raise ValueError(f"need sensitivity >= 0 and std > 0, got ({sensitivity}, {std})")
        total += (sensitivity / std) ** 2
    return math.sqrt(total)


def noisy_gd_mu(noise_multiplier, steps):
    """``μ = √T / σ`` of ``T`` full-batch NoisyGD steps with noise multiplier σ."""
    if noise_multiplier <= 0:
        raise ValueError(f"noise_multiplier must be > 0, got {noise_multiplier}")
    if steps < 0:
        raise ValueError(f"steps must be >= 0, got {steps}")
    return math.sqrt(steps) / noise_multiplier


def noisy_gd_epsilon(noise_multiplier, steps, delta):
    """ε at δ of ``steps`` full-batch NoisyGD steps (GDP, exact for Gaussians)."""
    return gdp_eps(noisy_gd_mu(noise_multiplier, steps), delta)


def calibrate_steps(eps, delta, sigma):
    """AdaMix's "Calibrate": the largest T with ``δ(ε; √T/σ) ≤ δ`` (0 if none).

    E.g. ``calibrate_steps(1, 1e-5, 20) == 28`` and ``calibrate_steps(3, 1e-5, 20) == 206``.
    """
    if eps <= 0 or sigma <= 0:
        raise ValueError(f"need eps > 0 and sigma > 0, got eps={eps}, sigma={sigma}")
    _check_delta(delta)
    steps = int(math.floor((sigma * gdp_mu(eps, delta)) ** 2))

    def ok(t):
        return gdp_delta(eps, noisy_gd_mu(sigma, t)) <= delta

    while ok(steps + 1):  # guard against the root finder's rounding, both ways
        steps += 1
    while steps > 0 and not ok(steps):
        steps -= 1
    return steps


def noisy_gd_event(noise_multiplier, steps):
    """The `dp_accounting.DpEvent` of ``steps`` NoisyGD steps (add/remove, no sampling)."""
    if steps == 0:
        return dp_accounting.NoOpDpEvent()
    return dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(noise_multiplier), int(steps))


def epsilon_dp_accounting(noise_multiplier, steps, delta, accountant="pld"):
    """ε of ``noisy_gd_event`` from dp-accounting's ``"pld"`` or ``"rdp"`` accountant.

    An independent cross-check of `noisy_gd_epsilon`: PLD is tight up to its
    (pessimistic) discretisation, RDP is an upper bound.
    """
    if accountant == "pld":
        acc = dp_accounting.pld.PLDAccountant()
    elif accountant == "rdp":
        acc = dp_accounting.rdp.RdpAccountant()
    else:
        raise ValueError(f"accountant must be 'pld' or 'rdp', got {accountant!r}")
    acc.compose(noisy_gd_event(noise_multiplier, steps))
    return float(acc.get_epsilon(delta))


def _check_delta(delta):
    if not 0 < delta < 1:
        raise ValueError(f"delta must be in (0, 1), got {delta}")
