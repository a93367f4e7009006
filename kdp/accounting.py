"""Privacy accounting with `dp-accounting` (RDP or PLD): pure privacy maths on
`DpEvent`s, which never sees a model (a model's side is `kdp.training.budget`,
whose `get_eps_delta`, `get_max_epochs` and `calibrate_model_noise` are also
importable from here).

kdp describes every private release as a `dp_accounting.DpEvent` and composes
them in one accountant under **add/remove-one** adjacency (Dwork and Roth 2014, §2.3):

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
``σ_eff = (Σ_v (σ c_v)^-2)^(-1/2)``.
"""

import functools
import json
import math

import dp_accounting
import numpy as np
from dp_accounting.rdp import rdp_privacy_accountant as _rdp_lib

from kdp._quiet import quiet_dp_accounting
from kdp.compat import DPGD_Mechanism  # noqa: F401 (lip-dp's name, refused with a pointer)

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


def event_to_config(event):
    """A JSON-serialisable dict describing ``event`` (any `dp_accounting.DpEvent`)."""
    import attr

    def convert(value):
        if isinstance(value, dp_accounting.DpEvent):
            return {"class_name": type(value).__name__,
                    **{k: convert(v) for k, v in attr.asdict(value, recurse=False).items()}}
        if isinstance(value, (list, tuple)):
            return [convert(v) for v in value]
        if isinstance(value, (bool, int, float, str)) or value is None:
            return value
        raise ValueError(f"cannot serialise {value!r} in a DpEvent")

    if not isinstance(event, dp_accounting.DpEvent):
        raise TypeError(f"expected a dp_accounting.DpEvent, got {event!r}")
    return convert(event)


def event_from_config(config):
    """The `dp_accounting.DpEvent` described by `event_to_config`'s dict."""
    def convert(value):
        if isinstance(value, dict):
            value = dict(value)
            name = value.pop("class_name")
            cls = getattr(dp_accounting, name, None) or getattr(dp_accounting.dp_event, name, None)
            if not (isinstance(cls, type) and issubclass(cls, dp_accounting.DpEvent)):
                raise ValueError(f"unknown DpEvent in {config}")
            return cls(**{k: convert(v) for k, v in value.items()})
        if isinstance(value, list):
            return [convert(v) for v in value]
        return value

    return convert(config)


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


def _accountant(accountant):
    if accountant == "rdp":
        return dp_accounting.rdp.RdpAccountant()
    if accountant == "pld":
        return dp_accounting.pld.PLDAccountant()
    raise ValueError(f"accountant must be one of {ACCOUNTANTS}, got {accountant!r}")


def _unit_rdp(event):
    """The RDP curve (at dp-accounting's default orders) of one ``event``, cached:
    the Poisson-subsampled Gaussian costs ~0.2 s per evaluation and training
    asks for ε of the same step at every epoch. Events holding lists (a
    `RepeatAndSelectDpEvent` of a composition) are cached by their JSON form."""
    try:
        return _unit_rdp_cached(event)
    except TypeError:  # unhashable: a list inside
        return _unit_rdp_of_config(json.dumps(event_to_config(event), sort_keys=True))


@functools.lru_cache(maxsize=256)
def _unit_rdp_cached(event):
    return _compute_unit_rdp(event)


@functools.lru_cache(maxsize=64)
def _unit_rdp_of_config(config_json):
    return _compute_unit_rdp(event_from_config(json.loads(config_json)))


def _compute_unit_rdp(event):
    acc = dp_accounting.rdp.RdpAccountant()
    acc.compose(event)
    rdp = np.array(acc._rdp, dtype=float)
    rdp.setflags(write=False)
    return rdp


RDP_ORDERS = np.asarray(_rdp_lib.DEFAULT_RDP_ORDERS, dtype=float)
RDP_ORDERS.setflags(write=False)


@quiet_dp_accounting()
def rdp_curve(events):
    """The RDP ε(λ) of the composition of ``events`` at the orders `RDP_ORDERS`
    (dp-accounting's defaults): the sum of each event's curve."""
    total = np.zeros_like(RDP_ORDERS)

    def add(event, count):
        nonlocal total
        while isinstance(event, dp_accounting.SelfComposedDpEvent):
            count *= event.count
            event = event.event
        if isinstance(event, dp_accounting.ComposedDpEvent):
            for inner in event.events:
                add(inner, count)
        elif not isinstance(event, dp_accounting.NoOpDpEvent) and count:
            total = total + count * _unit_rdp(event)

    for event in events:
        add(event, 1)
    return total


def _rdp_epsilon(events, delta):
    # Exactly what RdpAccountant computes (it also adds count × the RDP of one
    # event for a self-composed event), with the one-event curves cached.
    return float(_rdp_lib.compute_epsilon(RDP_ORDERS, rdp_curve(events), delta)[0])


def _has_selection(event):
    """Whether ``event`` contains a `RepeatAndSelectDpEvent` (RDP only)."""
    if isinstance(event, dp_accounting.dp_event.RepeatAndSelectDpEvent):
        return True
    if isinstance(event, dp_accounting.SelfComposedDpEvent):
        return _has_selection(event.event)
    if isinstance(event, dp_accounting.ComposedDpEvent):
        return any(_has_selection(e) for e in event.events)
    return False


@quiet_dp_accounting()
def epsilon_of_events(events, delta, accountant="rdp"):
    """ε at ``delta`` of the composition of ``events``."""
    _check_delta(delta)
    events = list(events)
    if accountant == "rdp" and hasattr(dp_accounting.rdp.RdpAccountant(), "_rdp"):
        return _rdp_epsilon(events, delta)
    if accountant == "pld" and any(_has_selection(e) for e in events):
        raise ValueError("this ledger holds a private hyper-parameter selection (Papernot and "
                         "Steinke 2022), which dp-accounting accounts in RDP only: use "
                         "accountant='rdp'")
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


@quiet_dp_accounting()
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
    sigma = dp_accounting.calibrate_dp_mechanism(
        lambda: _accountant(accountant), event, target_epsilon, delta, bracket, tol=1e-4)
    return CalibratedNoiseMultiplier(sigma, target_epsilon, sampling_rate, steps, delta,
                                     accountant, sampling, steps_per_epoch)


class CalibratedNoiseMultiplier(float):
    """A σ returned by `calibrate_noise_multiplier`: a float that remembers what it
    was calibrated for (``target_epsilon, sampling_rate, steps, delta,
    accountant, sampling, steps_per_epoch``), so that a model whose steps are
    not one Gaussian of multiplier σ (per-layer noise) can warn
    (`kdp.training.budget.plain_calibration_warning`)."""

    def __new__(cls, sigma, target_epsilon, sampling_rate, steps, delta, accountant="rdp",
                sampling="poisson", steps_per_epoch=None):
        self = super().__new__(cls, sigma)
        self.calibration = dict(target_epsilon=target_epsilon, sampling_rate=sampling_rate,
                                steps=steps, delta=delta, accountant=accountant,
                                sampling=sampling, steps_per_epoch=steps_per_epoch)
        return self


def max_count(epsilon_max, delta, events_of, spent_events=(), accountant="rdp", unit=1,
              planned=None):
    """Largest ``n`` (a multiple of ``unit``) with ε(spent + events_of(n)) ≤ epsilon_max.

    ``events_of``: ``n -> [DpEvent]``, the releases of ``n`` more units of work
    (non-decreasing in ``n``); ``planned``: optional ``n -> [DpEvent]``, other
    releases those ``n`` bring along (e.g. adaptive clipping's quantiles).
    Bisection on the non-decreasing ε(n); returns 0 if even one unit exceeds it.
    """
    _check_positive(epsilon_max=epsilon_max)
    spent_events = list(spent_events)

    def eps(units):
        extra = list(planned(units * unit)) if planned is not None else []
        return epsilon_of_events(spent_events + extra + list(events_of(units * unit)), delta,
                                 accountant)

    return largest_count(lambda units: eps(units) <= epsilon_max) * unit


def largest_count(fits):
    """Largest ``n ≥ 0`` with ``fits(n)``, for a predicate true up to some ``n`` and
    false beyond (0 if ``fits(0)`` is false). Doubling, then bisection."""
    if not fits(0):
        return 0
    hi = 1
    while fits(hi):
        hi *= 2
        if hi > 1 << 40:
            raise ValueError("the budget is never reached: is the noise infinite?")
    lo = hi // 2
    while hi - lo > 1:  # invariant: fits(lo), not fits(hi)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def max_steps(epsilon_max, noise_multiplier, sampling_rate, delta, accountant="rdp",
              sampling="poisson", steps_per_epoch=None, spent_events=(), unit=1, planned=None):
    """Largest ``n`` (a multiple of ``unit`` steps) with ε(spent + n steps) ≤ epsilon_max
    (`max_count` for DP-SGD steps)."""
    return max_count(
        epsilon_max, delta,
        lambda n: [training_event(noise_multiplier, sampling_rate, n, sampling, steps_per_epoch)],
        spent_events, accountant, unit, planned)


def _check_positive(**values):
    for name, value in values.items():
        if not value > 0:
            raise ValueError(f"{name} must be > 0, got {value}")


def _check_delta(delta):
    if not 0 < delta < 1:
        raise ValueError(f"delta must be in (0, 1), got {delta}")


_MODEL_FUNCTIONS = ("get_eps_delta", "get_max_epochs", "calibrate_model_noise",
                    "register_release_plan", "unregister_release_plan", "planned_events",
                    "fit_event")


def __getattr__(name):  # the model-facing names, without an import cycle
    if name in _MODEL_FUNCTIONS:
        from kdp.training import budget

        return getattr(budget, name)
    raise AttributeError(f"module 'kdp.accounting' has no attribute {name!r}")
