"""Diagnostics for mixed-privacy training. **Per-instance values are NOT for release.**

* `PerInstanceLedger`: per-instance GDP (AdaMix App. C, Prop. 14). For example i of
  the private set,

      μ_i = √( Σ_t ‖Uᵀ g̃_i(w_t)‖² / (τ_t² σ²) )        (Algorithm 2; U = I for NoisyGD)

  and ε_i = ε(μ_i, δ) through the GDP conversion. Since ‖Uᵀ g̃_i‖ ≤ τ_t, μ_i ≤ √T/σ,
  the worst-case μ that the accountant reports. μ_i is computed from the private
  data itself and is **data-dependent: releasing it (or anything derived from it)
  is not covered by the (ε, δ) guarantee**. Use it to understand who pays for the
  budget, never to publish.
* `membership_auc`: the loss-threshold membership-inference AUC (members labelled 0).
* `relative_error_increase`, `performance_boost`: the paper's metrics (§4.1).
"""

import warnings

import numpy as np

from kdp.adamix.gdp import gdp_eps

NOT_FOR_RELEASE = (
    "per-instance privacy values are data-dependent and NOT covered by the DP guarantee: "
    "do not release them"
)


class PerInstanceLedger:
    """Accumulates ``Σ_t ‖Uᵀ g̃_i‖² / (τ_t² σ²)`` per private example. NOT FOR RELEASE."""

    not_for_release = True

    def __init__(self, num_examples):
        self.total = np.zeros(int(num_examples), dtype=np.float64)
        self.steps = 0

    def record(self, contributions, tau, noise_multiplier):
        """Add one step: ``contributions[i] = ‖Uᵀ g̃_i‖²`` at clip threshold ``tau``."""
        contributions = np.asarray(contributions, dtype=np.float64)
        if contributions.shape != self.total.shape:
            raise ValueError(f"expected {self.total.shape} contributions, got {contributions.shape}")
        self.steps += 1
        if tau > 0:  # tau = 0 releases nothing about the private data
            self.total += contributions / (float(tau) ** 2 * float(noise_multiplier) ** 2)

    def mu(self):
        """Per-instance GDP μ_i (NOT FOR RELEASE)."""
        warnings.warn(NOT_FOR_RELEASE, stacklevel=2)
        return np.sqrt(self.total)

    def epsilon(self, delta):
        """Per-instance ε_i at δ (NOT FOR RELEASE)."""
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            mus = self.mu()
        warnings.warn(NOT_FOR_RELEASE, stacklevel=2)
        cache = {}
        out = np.empty_like(mus)
        for i, m in enumerate(np.round(mus, 12)):
            if m not in cache:
                cache[m] = gdp_eps(float(m), delta)
            out[i] = cache[m]
        return out


def membership_auc(loss_members, loss_nonmembers):
    """AUC of the loss-threshold attack: score = loss, members are class 0 (higher loss = non-member).

    0.5 means no leakage; computed with the Mann–Whitney statistic (ties count 1/2).
    """
    a = np.asarray(loss_nonmembers, dtype=np.float64)[:, None]
    b = np.asarray(loss_members, dtype=np.float64)[None, :]
    return float(np.mean((a > b) + 0.5 * (a == b)))


def relative_error_increase(error, paragon_error):
    """``(err − err_paragon) / err_paragon`` (the abstract's 311 %, 92 %, ...)."""
    return (error - paragon_error) / paragon_error


def performance_boost(public_error, paragon_error, dp_error):
    """``PB = (err_public − err_paragon) / (err_DP − err_paragon)`` (§4.1); > 1: private data helped."""
    return (public_error - paragon_error) / (dp_error - paragon_error)
