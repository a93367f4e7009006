"""Exact privacy profile of the (composed) Gaussian output perturbation.

Kirschte et al. 2022, Def. 3.13 (Sommer et al. 2019, Thm. 5): releasing
``q(D) + N(0, σ²s²I)`` for ``k`` queries of L2 sensitivity ``s`` each is
tightly (ε, δ)-DP with

    δ(ε; σ, k) = Φ(−ε/μ + μ/2) − e^ε Φ(−ε/μ − μ/2),   μ = √k / σ,

the analytic Gaussian mechanism of Balle & Wang (2018) at multiplier σ/√k,
so ``δ(ε; σ, k) = δ(ε; σ/√k, 1)``.  ``s`` is the replace-one sensitivity
(:mod:`kdp.helmet.constants`); ``k = 1`` for Softmax-SLP, ``K`` for
one-vs-rest SVMs.  Group privacy for Υ records (Lem. K.1): the profile at
σ/Υ.  All functions are pure NumPy/SciPy; :func:`dp_event` hands the same
mechanism to ``dp-accounting``.
"""

import math

import dp_accounting
import numpy as np
from scipy import optimize, special

EPS_MAX = 400.0


def gaussian_delta(eps, sigma, k_comp=1, group_size=1):
    """``δ(ε)`` of ``k_comp`` Gaussians with noise multiplier ``sigma`` (Def. 3.13)."""
    _check(sigma=sigma, k_comp=k_comp, group_size=group_size)
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    mu = math.sqrt(k_comp) * group_size / sigma
    first = special.ndtr(-eps / mu + mu / 2.0)
    second = math.exp(eps + special.log_ndtr(-eps / mu - mu / 2.0))
    return float(max(first - second, 0.0))


def epsilon(sigma, delta, k_comp=1, group_size=1):
    """Smallest ε with ``δ(ε; σ, k_comp) ≤ delta`` (0 if already ``δ(0) ≤ delta``)."""
    _check_delta(delta)
    f = lambda e: gaussian_delta(e, sigma, k_comp, group_size) - delta  # noqa: E731
    if f(0.0) <= 0:
        return 0.0
    if f(EPS_MAX) > 0:
        raise ValueError(f"epsilon exceeds {EPS_MAX}: sigma={sigma} is too small")
    return float(optimize.brentq(f, 0.0, EPS_MAX, xtol=1e-12, rtol=1e-12))


def calibrate_sigma(eps, delta, k_comp=1, group_size=1):
    """Smallest noise multiplier σ with ``δ(ε; σ, k_comp) ≤ delta``.

    Group privacy: σ for Υ records is Υ times σ for one (Lem. K.1).
    """
    _check_delta(delta)
    if not eps > 0:
        raise ValueError(f"eps must be > 0, got {eps}")
    f = lambda s: gaussian_delta(eps, s, k_comp, group_size) - delta  # noqa: E731
    lo, hi = 1e-3, 1.0
    while f(hi) > 0:
        lo, hi = hi, hi * 2.0
        if hi > 1e12:
            raise ValueError("no finite sigma reaches this (eps, delta)")
    while f(lo) <= 0:
        lo /= 2.0
    return float(optimize.brentq(f, lo, hi, xtol=1e-12, rtol=1e-12))


def classical_sigma(eps, delta):
    """Dwork–Roth ``√(2 ln(1.25/δ))/ε`` (valid for ε < 1; looser than the exact σ)."""
    return math.sqrt(2.0 * math.log(1.25 / delta)) / eps


def dp_event(sigma, k_comp=1, group_size=1):
    """The release as a ``dp_accounting.DpEvent`` (Gaussian, multiplier σ/Υ, ``k_comp`` times).

    The multiplier is relative to the replace-one sensitivity already built into
    ``s``: compose it in an accountant with ``ADD_OR_REMOVE_ONE`` relation (a
    sensitivity-1 Gaussian), never let the accountant double it again.
    """
    _check(sigma=sigma, k_comp=k_comp, group_size=group_size)
    event = dp_accounting.GaussianDpEvent(sigma / group_size)
    return event if k_comp == 1 else dp_accounting.SelfComposedDpEvent(event, int(k_comp))


def epsilon_dp_accounting(sigma, delta, k_comp=1, group_size=1, discretization=1e-4):
    """ε of :func:`dp_event` by dp-accounting's PLD accountant (an independent check)."""
    acc = dp_accounting.pld.PLDAccountant(value_discretization_interval=discretization)
    acc.compose(dp_event(sigma, k_comp, group_size))
    return float(acc.get_epsilon(delta))


def privacy_report(config, num_classes, eps, delta, sizes, honest_fraction=1.0, group_size=1):
    """Everything a release should state (its parameters and assumptions), as a dict."""
    from kdp.helmet import constants

    k = config.k_comp(num_classes)
    sigma = calibrate_sigma(eps, delta, k, 1)
    agg = constants.aggregate_sensitivity(config.learner, config.lam, config.R,
                                          config.input_bound, sizes, group_size=group_size)
    return {
        "eps": eps, "delta": delta, "k_comp": k, "sigma": sigma, "users": len(sizes),
        "honest_fraction": honest_fraction, "group_size": group_size,
        "aggregate_sensitivity": agg, "lipschitz": config.lipschitz(), "lam": config.lam,
        "R": config.R, "c": config.c, "input_bound": config.input_bound,
        "neighbouring": "replace-one", "hyperparameters_tuned_on_private_data": None,
        "caveat": "secure summation is emulated; computational DP adds ν₁ = (1 + e^ε)ν(η) to δ",
    }


def _check(**values):
    for name, value in values.items():
        if not (value > 0 and np.isfinite(value)):
            raise ValueError(f"{name} must be a positive finite number, got {value}")


def _check_delta(delta):
    if not 0 < delta < 1:
        raise ValueError(f"delta must be in (0, 1), got {delta}")
