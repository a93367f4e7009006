"""Privacy accounting with `dp-accounting` (RDP or PLD).

kdp describes every private release as a `dp_accounting.DpEvent` and composes
them in one accountant under **add/remove-one** adjacency (DESIGN §3.1):

* Poisson sampling (the default): each step is
  ``PoissonSampledDpEvent(q, GaussianDpEvent(σ_eff))``;
* shuffled fixed-size batches (explicit opt-in, ``sampling="shuffle"``): each
  record is in exactly one batch per epoch, so an epoch is one Gaussian
  mechanism, without amplification, under **replace-one** adjacency (sensitivity
  doubled: ``GaussianDpEvent(σ_eff / 2)`` per started epoch).

Per-layer noise with multipliers ``σ·c_v`` is one Gaussian mechanism with
``σ_eff = (Σ_v (σ c_v)^-2)^(-1/2)`` (DESIGN §3.3).
"""

import functools
import math

import dp_accounting

ACCOUNTANTS = ("rdp", "pld")
SAMPLINGS = ("poisson", "shuffle")

ASSUMPTIONS = {
    "poisson": "Poisson sampling with rate q, add/remove-one adjacency",
    "shuffle": (
        "shuffled fixed-size batches: one Gaussian release per record and epoch, "
        "no amplification, replace-one adjacency (sensitivity doubled)"
    ),
}


def effective_noise_multiplier(noise_multipliers):
    """``(Σ σ_v^-2)^(-1/2)``: the Gaussian equivalent to independent per-variable noise."""
    noise_multipliers = list(noise_multipliers)
    if not noise_multipliers or min(noise_multipliers) <= 0:
        raise ValueError("noise multipliers must be a non-empty list of positive numbers")
    return sum(s**-2 for s in noise_multipliers) ** -0.5


def training_event(noise_multiplier, sampling_rate, steps, sampling="poisson", steps_per_epoch=None):
    """The `DpEvent` of ``steps`` noisy gradient steps.

    Args:
        noise_multiplier: ``σ_eff`` (noise std / per-example sensitivity).
        sampling_rate: ``q = b/N``.
        steps: number of noisy updates.
        sampling: ``"poisson"`` or ``"shuffle"``.
        steps_per_epoch: needed for ``"shuffle"`` (a started epoch counts whole).
    """
    _check_positive(noise_multiplier=noise_multiplier)
    if not 0 < sampling_rate <= 1:
        raise ValueError(f"sampling_rate must be in (0, 1], got {sampling_rate}")
    steps = int(steps)
    if steps < 0:
        raise ValueError(f"steps must be >= 0, got {steps}")
    if steps == 0:
        return dp_accounting.NoOpDpEvent()
    if sampling == "poisson":
        step = dp_accounting.PoissonSampledDpEvent(
            sampling_rate, dp_accounting.GaussianDpEvent(noise_multiplier)
        )
        return dp_accounting.SelfComposedDpEvent(step, steps)
    if sampling == "shuffle":
        if not steps_per_epoch:
            raise ValueError("sampling='shuffle' needs steps_per_epoch")
        epochs = math.ceil(steps / steps_per_epoch)
        return dp_accounting.SelfComposedDpEvent(
            dp_accounting.GaussianDpEvent(noise_multiplier / 2.0), epochs
        )
    raise ValueError(f"sampling must be one of {SAMPLINGS}, got {sampling!r}")


def _accountant(accountant):
    if accountant == "rdp":
        return dp_accounting.rdp.RdpAccountant()
    if accountant == "pld":
        return dp_accounting.pld.PLDAccountant()
    raise ValueError(f"accountant must be one of {ACCOUNTANTS}, got {accountant!r}")


def epsilon_of_events(events, delta, accountant="rdp"):
    """ε at ``delta`` of the composition of ``events``."""
    _check_delta(delta)
    acc = _accountant(accountant)
    for event in events:
        acc.compose(event)
    return float(acc.get_epsilon(delta))


@functools.lru_cache(maxsize=4096)
def compute_epsilon(noise_multiplier, sampling_rate, steps, delta, accountant="rdp",
                    sampling="poisson", steps_per_epoch=None):
    """ε of ``steps`` DP-SGD steps with noise ``noise_multiplier`` and rate ``sampling_rate``.

    Returns 0 for 0 steps. Cached (the arguments are plain numbers).
    """
    event = training_event(noise_multiplier, sampling_rate, steps, sampling, steps_per_epoch)
    return epsilon_of_events([event], delta, accountant)


def calibrate_noise_multiplier(target_epsilon, sampling_rate, steps, delta, accountant="rdp",
                               sampling="poisson", steps_per_epoch=None):
    """Smallest σ whose ``steps`` steps cost at most ``target_epsilon`` at ``delta``."""
    _check_positive(target_epsilon=target_epsilon)
    return float(dp_accounting.calibrate_dp_mechanism(
        lambda: _accountant(accountant),
        lambda s: training_event(s, sampling_rate, steps, sampling, steps_per_epoch),
        target_epsilon,
        delta,
        dp_accounting.LowerEndpointAndGuess(1e-2, 1.0),
        tol=1e-4,
    ))


def max_steps(epsilon_max, noise_multiplier, sampling_rate, delta, accountant="rdp",
              sampling="poisson", steps_per_epoch=None, spent_events=(), unit=1):
    """Largest ``n`` (a multiple of ``unit`` steps) with ε(spent + n steps) ≤ epsilon_max.

    Bisection on the non-decreasing ε(n); returns 0 if even one unit exceeds it.
    """
    def eps(units):
        event = training_event(noise_multiplier, sampling_rate, units * unit, sampling, steps_per_epoch)
        return epsilon_of_events(list(spent_events) + [event], delta, accountant)

    if eps(0) > epsilon_max:
        return 0
    hi = 1
    while eps(hi) <= epsilon_max:
        hi *= 2
        if hi > 1 << 40:
            raise ValueError("epsilon_max is never reached: is the noise infinite?")
    lo = hi // 2 if hi > 1 else 0
    while hi - lo > 1:  # invariant: eps(lo) <= epsilon_max < eps(hi)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if eps(mid) <= epsilon_max else (lo, mid)
    return lo * unit


def get_eps_delta(model, epochs, accountant="rdp"):
    """``(ε, δ)`` after ``epochs`` more epochs of ``model.fit`` (plus what it already spent)."""
    spec = model.privacy_spec()
    steps = int(epochs) * spec["steps_per_epoch"]
    event = training_event(spec["noise_multiplier"], spec["sampling_rate"], steps,
                           spec["sampling"], spec["steps_per_epoch"])
    eps = epsilon_of_events(model.privacy_ledger.events() + [event], spec["delta"], accountant)
    return eps, spec["delta"]


def get_max_epochs(epsilon_max, model, accountant="rdp"):
    """Largest number of further epochs ``e`` with ε(e) ≤ epsilon_max < ε(e + 1)."""
    spec = model.privacy_spec()
    steps = max_steps(
        epsilon_max, spec["noise_multiplier"], spec["sampling_rate"], spec["delta"], accountant,
        spec["sampling"], spec["steps_per_epoch"], model.privacy_ledger.events(),
        unit=spec["steps_per_epoch"],
    )
    return steps // spec["steps_per_epoch"]


def _check_positive(**values):
    for name, value in values.items():
        if not value > 0:
            raise ValueError(f"{name} must be > 0, got {value}")


def _check_delta(delta):
    if not 0 < delta < 1:
        raise ValueError(f"delta must be in (0, 1), got {delta}")
