"""Accounting for DPCL steps: several Gaussian releases on one sampled batch.

**The paper's accounting** (Li et al. §4): each mechanism ``m`` of a
step is a Gaussian subsampled *without replacement* (fixed batch of ``B`` out of
``N``, fresh each step, replace-one adjacency), whose RDP is Wang–Balle–
Kasiviswanathan 2019 Thm 9 (the paper's Eq. 11, integer ``α ≥ 2``)::

    ε'(α) = log(1 + γ² C(α,2) min{4(e^{ε(2)}−1), 2e^{ε(2)}}
                  + Σ_{j=3}^{α} γ^j C(α,j) 2 e^{(j−1)ε(j)}) / (α−1),   ε(j) = j/(2σ²)

then ``RDP(α) = T Σ_m ε'_m(α)`` and Balle et al. 2020 Thm 21:
``ε = RDP(α) + log((α−1)/α) − (log δ + log α)/(α−1)``, minimised over ``α``.
`paper_epsilon` / `calibrate_paper_sigma` implement exactly that (numpy), and
reproduce the paper's σ table (§5.2–5.3).

**[flag] Composing the mechanisms of a step *after* subsampling each is not
justified:** they all read the *same* batch, so the step is one subsampled
mechanism whose inner part is the composition of the Gaussians, i.e. one
Gaussian with ``σ_eff = (Σ_m σ_m^-2)^(-1/2)`` (the rule kdp uses for per-layer
noise, `kdp.privacy.effective_noise_multiplier`). Subsampling each separately treats them as if they saw
independent batches and under-counts, by orders of magnitude at the paper's
σ ≈ 0.4. `step_event(..., composition="joint")` (the default) is the sound
event; ``composition="separate"`` is the paper's, kept to reproduce it.

Events are `dp_accounting` events: ``SampledWithoutReplacementDpEvent`` under
``NeighboringRelation.REPLACE_ONE`` (the paper's sampling and adjacency), or
``PoissonSampledDpEvent`` under ``ADD_OR_REMOVE_ONE`` (kdp's default; the
mechanisms' add/remove sensitivities then apply, see `kdp.dpcl.mechanisms`).

`DPCLTrainer`'s gate is a `kdp.training.PrivacyGate` with
``neighboring=REPLACE_ONE``: add/remove-one has no bound for sampling without
replacement, so its ledger is composed under replace-one by dp-accounting's RDP
accountant (Wang, Balle and Kasiviswanathan 2019), at `kdp.privacy.REPLACE_ONE_ORDERS`.
"""

import math

import dp_accounting
import numpy as np
from dp_accounting.rdp import rdp_privacy_accountant as _rdp_lib
from scipy.special import gammaln

from kdp._quiet import quiet_dp_accounting
from kdp.privacy import REPLACE_ONE_ORDERS

SAMPLINGS = ("without-replacement", "poisson")
COMPOSITIONS = ("joint", "separate")
#: the orders of the paper's computation (integer α from 2 to 63: they reproduce its σ table).
PAPER_ORDERS = tuple(range(2, 64))
#: default orders of `epsilon`: those of kdp's replace-one RDP accountant.
ORDERS = REPLACE_ONE_ORDERS

NeighborRel = dp_accounting.NeighboringRelation


def relation_of(sampling):
    """The `dp_accounting.NeighboringRelation` that goes with a sampling scheme."""
    if sampling == "without-replacement":
        return NeighborRel.REPLACE_ONE
    if sampling == "poisson":
        return NeighborRel.ADD_OR_REMOVE_ONE
    raise ValueError(f"sampling must be one of {SAMPLINGS}, got {sampling!r}")


def _inner(noise_multipliers):
    sigmas = [float(s) for s in noise_multipliers]
    if not sigmas or min(sigmas) <= 0:
        raise ValueError("noise multipliers must be a non-empty list of positive numbers")
    gaussians = [dp_accounting.GaussianDpEvent(s) for s in sigmas]
    return gaussians[0] if len(gaussians) == 1 else dp_accounting.ComposedDpEvent(gaussians)


def step_event(noise_multipliers, dataset_size, batch_size, sampling="without-replacement",
               composition="joint"):
    """The `DpEvent` of one step releasing Gaussians with these multipliers on one batch.

    Args:
        noise_multipliers: ``σ_m`` of each release of the step (gradient, S, stats...).
        dataset_size, batch_size: ``N`` and ``B`` (Poisson: ``q = B/N``, B expected).
        sampling: ``"without-replacement"`` (the paper) or ``"poisson"`` (kdp).
        composition: ``"joint"`` (sound: subsample the composition) or ``"separate"``
            (the paper's: compose the subsampled mechanisms; under-counts, see module doc).
    """
    if composition not in COMPOSITIONS:
        raise ValueError(f"composition must be one of {COMPOSITIONS}, got {composition!r}")
    relation_of(sampling)
    if not 1 <= batch_size <= dataset_size:
        raise ValueError(f"need 1 <= batch_size <= dataset_size, got {batch_size}, {dataset_size}")

    def sample(inner):
        if sampling == "poisson":
            return dp_accounting.PoissonSampledDpEvent(batch_size / dataset_size, inner)
        return dp_accounting.SampledWithoutReplacementDpEvent(int(dataset_size), int(batch_size),
                                                              inner)

    if composition == "joint":
        return sample(_inner(noise_multipliers))
    return dp_accounting.ComposedDpEvent([sample(_inner([s])) for s in noise_multipliers])


@quiet_dp_accounting()
def step_rdp(event, sampling="without-replacement", orders=None):
    """RDP curve of one event at ``orders`` (dp-accounting's RDP accountant)."""
    orders = np.asarray(orders if orders is not None else ORDERS, float)
    acc = dp_accounting.rdp.RdpAccountant(orders, neighboring_relation=relation_of(sampling))
    acc.compose(event)
    return orders, np.asarray(acc.rdp, float)


def epsilon(event, steps, delta, sampling="without-replacement", orders=None):
    """``(ε, α*)`` of ``steps`` (may be fractional, like the paper's 39 062.5) repetitions of
    ``event`` at ``δ``, with dp-accounting's RDP accountant and its conversion (which is
    Balle et al. 2020 Thm 21, the paper's Thm 5)."""
    orders, rdp = step_rdp(event, sampling, orders)
    eps, order = _rdp_lib.compute_epsilon(orders, steps * rdp, delta)
    return float(eps), float(order)


def calibrate(target_epsilon, steps, delta, make_event, sampling="without-replacement",
              lower=1e-2, upper=100.0, rtol=1e-3):
    """Smallest ``s`` (geometric bisection to relative ``rtol``) with
    ``epsilon(make_event(s), steps) ≤ target``; ``make_event(s)`` must be less private for
    smaller ``s``. The answer always satisfies the target."""
    def eps(s):
        return epsilon(make_event(s), steps, delta, sampling)[0]

    if eps(upper) > target_epsilon:
        raise ValueError(f"target epsilon {target_epsilon} not reached even at s={upper}")
    lo, hi = lower, upper
    while hi / lo > 1 + rtol:
        mid = math.sqrt(lo * hi)
        lo, hi = (lo, mid) if eps(mid) <= target_epsilon else (mid, hi)
    return hi


# -- the paper's own computation (independent of dp-accounting) -----------------------------
def _log_comb(n, k):
    return gammaln(n + 1) - gammaln(k + 1) - gammaln(n - k + 1)


def paper_rdp(sigma, q, alpha):
    """Eq. 11 of Li et al. (Wang et al. 2019 Thm 9 for the Gaussian), integer ``α ≥ 2``."""
    alpha = int(alpha)
    if alpha < 2:
        raise ValueError("alpha must be an integer >= 2")
    eps2 = 2.0 / (2.0 * sigma**2)
    terms = [0.0,
             2 * math.log(q) + _log_comb(alpha, 2)
             + min(math.log(4) + math.log(math.expm1(eps2)), math.log(2) + eps2)]
    for j in range(3, alpha + 1):
        terms.append(j * math.log(q) + _log_comb(alpha, j) + math.log(2)
                     + (j - 1) * j / (2.0 * sigma**2))
    return float(np.logaddexp.reduce(terms)) / (alpha - 1)


def balle_conversion(rdp, alpha, delta):
    """Balle et al. 2020 Thm 21 (the paper's Thm 5): (α, ρ)-RDP ⇒ (ε, δ)-DP."""
    return rdp + math.log((alpha - 1) / alpha) - (math.log(delta) + math.log(alpha)) / (alpha - 1)


def mironov_conversion(rdp, alpha, delta):
    """Mironov 2017 Prop. 3 (the paper's Lemma 2): ``ε = ρ + log(1/δ)/(α−1)``."""
    return rdp + math.log(1.0 / delta) / (alpha - 1)


def paper_epsilon(sigmas, q, steps, delta, orders=PAPER_ORDERS):
    """``(ε, α*)`` as in the paper: per-step RDP summed over the *separately* subsampled
    mechanisms ``sigmas``, times ``steps``, Balle conversion, minimum over ``orders``."""
    best = (math.inf, None)
    for alpha in orders:
        rdp = steps * sum(paper_rdp(s, q, alpha) for s in sigmas)
        best = min(best, (balle_conversion(rdp, alpha, delta), alpha))
    return best


def calibrate_paper_sigma(target_epsilon, q, steps, delta, n_mechanisms=1, fixed=(),
                          tol=1e-7):
    """The σ, shared by ``n_mechanisms`` mechanisms (plus the ``fixed`` ones), at which
    `paper_epsilon` equals ``target_epsilon`` (bisection; ε decreases with σ)."""
    def eps(s):
        return paper_epsilon([s] * n_mechanisms + list(fixed), q, steps, delta)[0]

    lo, hi = 0.05, 10.0
    while hi - lo > tol:
        mid = 0.5 * (lo + hi)
        lo, hi = (lo, mid) if eps(mid) <= target_epsilon else (mid, hi)
    return hi


#: the paper's σ values (§5.2, §5.3), with N = 50 000, B = 128, δ = 1e-5, ε = 1000.
PAPER_TABLE = {
    "simclr-original": dict(sigma=0.3812, n_mechanisms=1, fixed=(), steps=78125.0),
    "simclr-dp-similarity": dict(sigma=0.4021, n_mechanisms=2, fixed=(), steps=78125.0),
    "barlow-original": dict(sigma=0.3633, n_mechanisms=1, fixed=(), steps=39062.5),
    "barlow-dp-stats": dict(sigma=0.3931, n_mechanisms=1, fixed=(0.416,) * 4, steps=39062.5),
}
PAPER_SETTING = dict(dataset_size=50000, batch_size=128, delta=1e-5, epsilon=1000.0)


__all__ = [
    "COMPOSITIONS", "PAPER_ORDERS", "PAPER_SETTING", "PAPER_TABLE", "SAMPLINGS", "balle_conversion",
    "calibrate", "calibrate_paper_sigma", "epsilon", "mironov_conversion", "paper_epsilon",
    "paper_rdp", "relation_of", "step_event", "step_rdp",
]
