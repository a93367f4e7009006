"""Privacy accounting with `dp-accounting` (RDP or PLD).

kdp describes every private release as a `dp_accounting.DpEvent` and composes
them in one accountant under **add/remove-one** adjacency (DESIGN §3.1):

* Poisson sampling (the default): each step is
  ``PoissonSampledDpEvent(q, GaussianDpEvent(σ_eff))``;
* shuffled fixed-size batches (explicit opt-in, ``sampling="shuffle"``): each
  record is in at most one batch per pass over the data, so a pass is one
  Gaussian mechanism, without amplification, under **replace-one** adjacency
  (sensitivity doubled: ``GaussianDpEvent(σ_eff / 2)`` per started pass). With
  batches of at most ``b`` records a pass lasts at least ``⌊N/b⌋`` steps, so
  ``n`` contiguous steps start at most ``⌈n / ⌊N/b⌋⌉`` passes: that is the
  ``steps_per_epoch`` a model gives the accountant in this mode.

Per-layer noise with multipliers ``σ·c_v`` is one Gaussian mechanism with
``σ_eff = (Σ_v (σ c_v)^-2)^(-1/2)`` (DESIGN §3.3).
"""

import functools
import math

import dp_accounting
import numpy as np
from dp_accounting.rdp import rdp_privacy_accountant as _rdp_lib

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
        steps_per_epoch: needed for ``"shuffle"``: the least number of steps of
            one pass over the data (``⌊N/b⌋``); the ``steps`` must be contiguous
            (one run of ``fit``), and a started pass counts whole.
    """
    if sampling == "poisson":
        return _poisson_gaussian(noise_multiplier, sampling_rate, steps, "steps")
    _check_positive(noise_multiplier=noise_multiplier)
    steps = _check_count(steps, "steps")
    if steps == 0:
        return dp_accounting.NoOpDpEvent()
    if sampling == "shuffle":
        if not steps_per_epoch:
            raise ValueError("sampling='shuffle' needs steps_per_epoch")
        epochs = math.ceil(steps / steps_per_epoch)
        return dp_accounting.SelfComposedDpEvent(
            dp_accounting.GaussianDpEvent(noise_multiplier / 2.0), epochs
        )
    raise ValueError(f"sampling must be one of {SAMPLINGS}, got {sampling!r}")


def quantile_event(noise_multiplier, sampling_rate, count=1):
    """The `DpEvent` of ``count`` private quantile releases (Andrew et al. 2021).

    Each release counts, on a Poisson sample of rate ``sampling_rate``, the
    examples whose norm is at most the threshold (sensitivity 1 under
    add/remove-one) and adds ``N(0, noise_multiplier²)``:
    ``PoissonSampledDpEvent(q, GaussianDpEvent(σ_q))``, self-composed ``count`` times.
    """
    return _poisson_gaussian(noise_multiplier, sampling_rate, count, "count")


def _check_count(count, name):
    count = int(count)
    if count < 0:
        raise ValueError(f"{name} must be >= 0, got {count}")
    return count


def _poisson_gaussian(noise_multiplier, sampling_rate, count, name):
    """``count`` self-composed ``PoissonSampledDpEvent(q, GaussianDpEvent(σ))``."""
    _check_positive(noise_multiplier=noise_multiplier)
    if not 0 < sampling_rate <= 1:
        raise ValueError(f"sampling_rate must be in (0, 1], got {sampling_rate}")
    count = _check_count(count, name)
    if count == 0:
        return dp_accounting.NoOpDpEvent()
    release = dp_accounting.PoissonSampledDpEvent(
        sampling_rate, dp_accounting.GaussianDpEvent(noise_multiplier))
    return dp_accounting.SelfComposedDpEvent(release, count)


# --- planned releases -------------------------------------------------------------
# Mechanisms that run *alongside* training (adaptive clipping's quantile releases)
# register a plan on the model, so that budgets computed before or at the start
# of `fit` (`get_max_epochs`, `max_steps`, `DP_Accountant(epsilon_max=...)`)
# include their future cost. A plan is an object with
# ``planned_events(steps, steps_per_epoch) -> [DpEvent]``: the releases it will
# make during the next ``steps`` training steps (those already made are in the
# ledger).

def register_release_plan(model, plan):
    """Make ``plan``'s future releases part of ``model``'s budget computations."""
    plans = model.__dict__.setdefault("_kdp_release_plans", {})
    plans[id(plan)] = plan


def unregister_release_plan(model, plan):
    model.__dict__.get("_kdp_release_plans", {}).pop(id(plan), None)


def planned_events(model, steps, steps_per_epoch=None):
    """The events of every plan registered on ``model`` for ``steps`` more steps."""
    if steps_per_epoch is None:
        steps_per_epoch = model.privacy_spec()["steps_per_epoch"]
    events = []
    for plan in model.__dict__.get("_kdp_release_plans", {}).values():
        events.extend(plan.planned_events(int(steps), int(steps_per_epoch)))
    return events


def planned_events_fn(model, steps_per_epoch=None):
    """``steps -> planned_events(model, steps)``, or ``None`` without any plan
    (the ``planned`` argument of `max_steps`)."""
    if not model.__dict__.get("_kdp_release_plans"):
        return None
    return lambda steps: planned_events(model, steps, steps_per_epoch)


def _accountant(accountant):
    if accountant == "rdp":
        return dp_accounting.rdp.RdpAccountant()
    if accountant == "pld":
        return dp_accounting.pld.PLDAccountant()
    raise ValueError(f"accountant must be one of {ACCOUNTANTS}, got {accountant!r}")


@functools.lru_cache(maxsize=256)
def _unit_rdp(event):
    """The RDP curve (at dp-accounting's default orders) of one ``event``, cached:
    the Poisson-subsampled Gaussian costs ~0.2 s per evaluation and training
    asks for ε of the same step at every epoch."""
    acc = dp_accounting.rdp.RdpAccountant()
    acc.compose(event)
    rdp = np.array(acc._rdp, dtype=float)
    rdp.setflags(write=False)
    return rdp


def _rdp_epsilon(events, delta):
    # Exactly what RdpAccountant computes (it also adds count × the RDP of one
    # event for a self-composed event), with the one-event curves cached.
    orders = np.asarray(_rdp_lib.DEFAULT_RDP_ORDERS, dtype=float)
    total = np.zeros_like(orders)
    for event in events:
        count = 1
        while isinstance(event, dp_accounting.SelfComposedDpEvent):
            count *= event.count
            event = event.event
        if isinstance(event, dp_accounting.NoOpDpEvent) or count == 0:
            continue
        total = total + count * _unit_rdp(event)
    return float(_rdp_lib.compute_epsilon(orders, total, delta)[0])


def epsilon_of_events(events, delta, accountant="rdp"):
    """ε at ``delta`` of the composition of ``events``."""
    _check_delta(delta)
    if accountant == "rdp" and hasattr(dp_accounting.rdp.RdpAccountant(), "_rdp"):
        return _rdp_epsilon(events, delta)
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
                               sampling="poisson", steps_per_epoch=None, extra_events=()):
    """Smallest σ (to 1e-4) whose ``steps`` steps cost at most ``target_epsilon`` at ``delta``.

    ``extra_events``: other releases composed with the training (e.g. the
    `quantile_event` of adaptive clipping, or ``model.privacy_ledger.events()``).

    With ``accountant="pld"`` the search is bracketed by the RDP answer (RDP is
    never tighter than PLD), which keeps PLD away from tiny σ, where it is slow.
    """
    _check_positive(target_epsilon=target_epsilon)

    extra_events = list(extra_events)

    def event(s):
        train = training_event(s, sampling_rate, steps, sampling, steps_per_epoch)
        return dp_accounting.ComposedDpEvent(extra_events + [train]) if extra_events else train

    bracket = dp_accounting.LowerEndpointAndGuess(1e-2, 1.0)
    if accountant == "pld":
        hi = calibrate_noise_multiplier(target_epsilon, sampling_rate, steps, delta, "rdp",
                                        sampling, steps_per_epoch, extra_events)
        lo = hi / 2
        while lo > 1e-3 and epsilon_of_events([event(lo)], delta, "pld") <= target_epsilon:
            lo /= 2
        bracket = dp_accounting.ExplicitBracketInterval(lo, hi)
    return float(dp_accounting.calibrate_dp_mechanism(
        lambda: _accountant(accountant), event, target_epsilon, delta, bracket, tol=1e-4,
    ))


def max_steps(epsilon_max, noise_multiplier, sampling_rate, delta, accountant="rdp",
              sampling="poisson", steps_per_epoch=None, spent_events=(), unit=1, planned=None):
    """Largest ``n`` (a multiple of ``unit`` steps) with ε(spent + n steps) ≤ epsilon_max.

    ``planned``: optional ``n -> [DpEvent]``, the other releases that ``n`` more
    steps bring along (non-decreasing in ``n``; `planned_events_fn`), composed in.
    Bisection on the non-decreasing ε(n); returns 0 if even one unit exceeds it.
    """
    _check_positive(epsilon_max=epsilon_max)
    def eps(units):
        event = training_event(noise_multiplier, sampling_rate, units * unit, sampling, steps_per_epoch)
        extra = list(planned(units * unit)) if planned is not None else []
        return epsilon_of_events(list(spent_events) + extra + [event], delta, accountant)

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
    planned = planned_events(model, steps, spec["steps_per_epoch"])  # e.g. adaptive clipping
    eps = epsilon_of_events(model.privacy_ledger.events() + planned + [event], spec["delta"],
                            accountant)
    return eps, spec["delta"]


def calibrate_model_noise(model, target_epsilon, epochs, accountant="rdp"):
    """Set ``model.dp_parameters.noise_multiplier`` to the smallest σ with which
    ``epochs`` more epochs (after the ledger, with the planned releases) cost at
    most ``target_epsilon``; return it.

    Unlike `calibrate_noise_multiplier`, this accounts for the noise strategy:
    with ``"per-layer"`` noise a step is one Gaussian of ``σ_eff = r·σ``
    (``r = (Σ_v c_v^-2)^(-1/2)``, public), so σ is the calibrated ``σ_eff / r``.
    The model must be built.
    """
    spec = model.privacy_spec()
    ratio = spec["noise_multiplier"] / model.dp_parameters.noise_multiplier
    steps = int(epochs) * spec["steps_per_epoch"]
    extra = model.privacy_ledger.events() + planned_events(model, steps, spec["steps_per_epoch"])
    sigma_eff = calibrate_noise_multiplier(
        target_epsilon, spec["sampling_rate"], steps, spec["delta"], accountant,
        spec["sampling"], spec["steps_per_epoch"], extra,
    )
    model.dp_parameters.noise_multiplier = sigma_eff / ratio
    return model.dp_parameters.noise_multiplier


def get_max_epochs(epsilon_max, model, accountant="rdp"):
    """Largest number of further epochs ``e`` with ε(e) ≤ epsilon_max < ε(e + 1).

    ε(e) includes the releases planned alongside training by callbacks registered
    on the model (`register_release_plan`; e.g. `AdaptiveQuantileClipping`, which
    registers itself in ``set_model``: call ``callback.set_model(model)`` before
    this if the callback is not attached yet)."""
    spec = model.privacy_spec()
    steps = max_steps(
        epsilon_max, spec["noise_multiplier"], spec["sampling_rate"], spec["delta"], accountant,
        spec["sampling"], spec["steps_per_epoch"], model.privacy_ledger.events(),
        unit=spec["steps_per_epoch"], planned=planned_events_fn(model, spec["steps_per_epoch"]),
    )
    return steps // spec["steps_per_epoch"]


def _check_positive(**values):
    for name, value in values.items():
        if not value > 0:
            raise ValueError(f"{name} must be > 0, got {value}")


def _check_delta(delta):
    if not 0 < delta < 1:
        raise ValueError(f"delta must be in (0, 1), got {delta}")
