"""Calibration of σ: the smallest noise multiplier whose steps fit a target ε."""

import functools
import json

import dp_accounting

from kdp._quiet import quiet_dp_accounting
from kdp.privacy._checks import check_positive
from kdp.privacy.accountants import ADD_OR_REMOVE_ONE, check_accountant, epsilon_of_events
from kdp.privacy.events import training_event
from kdp.privacy.serialization import event_from_config, event_to_config
from kdp.privacy.stored import stored


@quiet_dp_accounting()
def calibrate_noise_multiplier(target_epsilon, sampling_rate, steps, delta, accountant="tightest",
                               sampling="poisson", steps_per_epoch=None, extra_events=(),
                               neighboring=ADD_OR_REMOVE_ONE):
    """Smallest σ (to 1e-4) whose ``steps`` steps cost at most ``target_epsilon`` at ``delta``
    under ``neighboring`` (`dp_accounting.calibrate_dp_mechanism`), ε as
    `epsilon_of_events` reports and budgets it with ``accountant``.

    ``extra_events``: other releases composed with the training (e.g. the
    `quantile_event` of adaptive clipping, or ``model.privacy_ledger.events()``).

    Where PLD is computed (``"pld"``, ``"tightest"``) the search is bracketed first
    (`_pld_bracket`), which keeps PLD away from tiny σ, where it is slow. The
    search (some 15 ε, 1–5 s) runs once per set of arguments in a process: σ is a
    function of them, so it is kept (`_smallest_sigma`), and on disk where
    ``KDP_ACCOUNTING_CACHE_DIR`` names a folder (`kdp.privacy.stored`).
    """
    check_positive(target_epsilon=target_epsilon)
    check_accountant(accountant)
    extra = json.dumps([event_to_config(e) for e in extra_events], sort_keys=True)
    sigma = _smallest_sigma(*map(_hashable, (target_epsilon, sampling_rate, steps, delta)),
                            accountant, sampling, _hashable(steps_per_epoch), extra, neighboring)
    return CalibratedNoiseMultiplier(sigma, target_epsilon, sampling_rate, steps, delta,
                                     accountant, sampling, steps_per_epoch, neighboring)


def _hashable(value):
    """A NumPy scalar or 0-d array as the Python number it holds; else ``value``."""
    return value.item() if hasattr(value, "item") else value


@functools.lru_cache(maxsize=256)
@stored
def _smallest_sigma(target_epsilon, sampling_rate, steps, delta, accountant, sampling,
                    steps_per_epoch, extra_events_json, neighboring):
    """`calibrate_noise_multiplier`'s search, on hashable arguments (the extra
    events as JSON, `event_to_config`)."""
    extra_events = [event_from_config(c) for c in json.loads(extra_events_json)]

    def event(s):
        train = training_event(s, sampling_rate, steps, sampling, steps_per_epoch)
        return dp_accounting.ComposedDpEvent(extra_events + [train]) if extra_events else train

    if accountant == "rdp":
        bracket = dp_accounting.LowerEndpointAndGuess(1e-2, 1.0)
    else:
        bracket = _pld_bracket(
            lambda s: epsilon_of_events([event(s)], delta, accountant, neighboring)
            <= target_epsilon)
    return dp_accounting.calibrate_dp_mechanism(
        lambda: _Composition(accountant, neighboring), event, target_epsilon, delta, bracket,
        tol=1e-4)


class _Composition:
    """What `dp_accounting.calibrate_dp_mechanism` asks of a fresh accountant (a
    ``ledger``, ``compose``, ``get_epsilon``), with ε from `epsilon_of_events`."""

    def __init__(self, accountant, neighboring):
        self.accountant, self.neighboring = accountant, neighboring
        self.ledger = dp_accounting.NoOpDpEvent()

    def compose(self, event):
        self.ledger = event
        return self

    def get_epsilon(self, delta):
        return epsilon_of_events([self.ledger], delta, self.accountant, self.neighboring)


def _pld_bracket(fits):
    """An interval ``[lo, hi]`` holding the smallest σ that ``fits`` the target, with
    ``hi / lo = 2``: ``hi`` is 1 doubled while it does not fit, ``lo`` is ``hi``
    halved while it fits (down to 1e-3)."""
    hi = 1.0
    for _ in range(31):
        if fits(hi):
            break
        hi *= 2
    else:
        raise dp_accounting.mechanism_calibration.NoBracketIntervalFoundError(
            f"no σ up to {hi:g} reaches the target with PLD: the extra events cost it")
    lo = hi / 2
    while lo > 1e-3 and fits(lo):
        hi, lo = lo, lo / 2
    return dp_accounting.ExplicitBracketInterval(lo, hi)


class CalibratedNoiseMultiplier(float):
    """A σ returned by `calibrate_noise_multiplier`: a float that remembers what it
    was calibrated for (``target_epsilon, sampling_rate, steps, delta,
    accountant, sampling, steps_per_epoch, neighboring``), so that a model whose
    steps are not one Gaussian of multiplier σ (per-layer noise) can warn
    (`kdp.training.budget.plain_calibration_warning`)."""

    def __new__(cls, sigma, target_epsilon, sampling_rate, steps, delta, accountant="tightest",
                sampling="poisson", steps_per_epoch=None, neighboring=ADD_OR_REMOVE_ONE):
        self = super().__new__(cls, sigma)
        self.calibration = dict(target_epsilon=target_epsilon, sampling_rate=sampling_rate,
                                steps=steps, delta=delta, accountant=accountant,
                                sampling=sampling, steps_per_epoch=steps_per_epoch,
                                neighboring=neighboring)
        return self
