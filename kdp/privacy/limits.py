"""How many more releases fit a budget: the largest count whose ε stays below it."""

from kdp.privacy._checks import check_positive
from kdp.privacy.accountants import ADD_OR_REMOVE_ONE, epsilon_of_events
from kdp.privacy.events import training_event


def max_count(epsilon_max, delta, events_of, spent_events=(), accountant="tightest", unit=1,
              planned=None, neighboring=ADD_OR_REMOVE_ONE):
    """Largest ``n`` (a multiple of ``unit``) with ε(spent + events_of(n)) ≤ epsilon_max
    under ``neighboring``.

    ``events_of``: ``n -> [DpEvent]``, the releases of ``n`` more units of work
    (non-decreasing in ``n``); ``planned``: optional ``n -> [DpEvent]``, other
    releases those ``n`` bring along (e.g. adaptive clipping's quantiles).
    Bisection on the non-decreasing ε(n) (`count_fits`); returns 0 if even one unit
    exceeds it.
    """
    check_positive(epsilon_max=epsilon_max)
    spent_events = list(spent_events)
    return largest_count(lambda units: count_fits(
        epsilon_max, delta, events_of, units * unit, spent_events, accountant, planned,
        neighboring)) * unit


def count_fits(epsilon_max, delta, events_of, n, spent_events=(), accountant="tightest",
               planned=None, neighboring=ADD_OR_REMOVE_ONE):
    """Whether ε(spent + events_of(n) + planned(n)) ≤ epsilon_max: one ε where
    `max_count` computes several (arguments as there)."""
    extra = list(planned(n)) if planned is not None else []
    return epsilon_of_events(list(spent_events) + extra + list(events_of(n)), delta, accountant,
                             neighboring) <= epsilon_max


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


def max_steps(epsilon_max, noise_multiplier, sampling_rate, delta, accountant="tightest",
              sampling="poisson", steps_per_epoch=None, spent_events=(), unit=1, planned=None,
              neighboring=ADD_OR_REMOVE_ONE):
    """Largest ``n`` (a multiple of ``unit`` steps) with ε(spent + n steps) ≤ epsilon_max
    (`max_count` for DP-SGD steps)."""
    return max_count(
        epsilon_max, delta,
        lambda n: [training_event(noise_multiplier, sampling_rate, n, sampling, steps_per_epoch)],
        spent_events, accountant, unit, planned, neighboring)
