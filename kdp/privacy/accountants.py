"""ε of a composition of `DpEvent`s, with dp-accounting's RDP (Mironov 2017) or
privacy-loss-distribution (PLD; Koskela et al. 2020, Doroshenko et al. 2022)
accountant, or the smaller of the two (``"tightest"``, the default: each is an
upper bound on ε, so their minimum is one too), under a neighbouring relation
(`dp_accounting.NeighboringRelation`).

kdp's releases compose under **add/remove-one** adjacency (`ADD_OR_REMOVE_ONE`,
the default); a mechanism sampled without replacement is analysed under
**replace-one** (`REPLACE_ONE`; Wang, Balle and Kasiviswanathan 2019), as the
DPCL trainer's. The σ of a ``GaussianDpEvent`` is relative to the sensitivity
under the relation in use.
"""

import functools
import json

import dp_accounting
import numpy as np
from dp_accounting.rdp import rdp_privacy_accountant as _rdp_lib

from kdp._quiet import quiet_dp_accounting
from kdp.privacy._checks import check_delta
from kdp.privacy.events import training_event
from kdp.privacy.serialization import event_from_config, event_to_config
from kdp.privacy.stored import stored

ACCOUNTANTS = ("tightest", "pld", "rdp")
#: how statements and reports name each accountant
ACCOUNTANT_NAMES = {"tightest": "min of the PLD and RDP accountants", "pld": "PLD accountant",
                    "rdp": "RDP accountant"}
ADD_OR_REMOVE_ONE = dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE
REPLACE_ONE = dp_accounting.NeighboringRelation.REPLACE_ONE

#: the Rényi orders of the RDP accountant: dp-accounting's defaults ...
RDP_ORDERS = np.asarray(_rdp_lib.DEFAULT_RDP_ORDERS, dtype=float)
#: ... but under replace-one, where sampling without replacement costs O(α²) per
#: order (Wang, Balle and Kasiviswanathan 2019, Thm 9): integer orders up to 64, a
#: few fractional and larger ones (beyond 128 none won for DPCL's ε ≤ 100).
REPLACE_ONE_ORDERS = np.asarray(
    (1.25, 1.5, 1.75) + tuple(range(2, 65)) + (80, 96, 128), dtype=float)
RDP_ORDERS.setflags(write=False)
REPLACE_ONE_ORDERS.setflags(write=False)

#: The grid of privacy-loss values of the PLD accountant: 1e-3, ten times
#: dp-accounting's default, makes one ε about 7x faster (≈ 55 ms instead of
#: ≈ 380 ms for 360 DP-SGD steps) and raises it by < 0.02 % at 360 steps, 0.11 %
#: at 6000 (2.8938 instead of 2.8905). dp-accounting's estimate stays pessimistic
#: (every privacy loss rounded up): an upper bound on ε, on any grid.
PLD_DISCRETIZATION = 1e-3
#: ... but the rounding costs up to about one grid step per composed step, which
#: at small ε is most of it (5,000 steps at σ 3.825, q 6.4e-4: 0.078 on the grid
#: of 1e-3, 0.0337 on a fine one): where ε on that grid is below
#: ``PLD_RESOLUTION × 1e-3``, ε is computed again on a grid of 1e-3 / 2^k no
#: coarser than ε / `PLD_RESOLUTION` (powers of 2 keep the PLDs cacheable), not
#: finer than `PLD_FINEST`, and the smaller of the two is kept.
PLD_RESOLUTION = 1000
PLD_FINEST = 1e-6
#: PLD's grid of privacy losses grows as 1/σ² (one Gaussian release of multiplier
#: 0.05: 3 s and 260 MB; 0.01: 53 s and 2.3 GB; 1e-3 would take some 200 GB), so
#: releases with a smaller noise multiplier are accounted in RDP only (`unsupported`
#: lists them for PLD). Below it, one release alone costs ε > 40 at δ = 1e-5.
PLD_MIN_NOISE = 0.1


def accountant_name(accountant):
    """How statements and reports name ``accountant`` (`ACCOUNTANT_NAMES`)."""
    check_accountant(accountant)
    return ACCOUNTANT_NAMES[accountant]


def pld_interval(epsilon):
    """The grid on which PLD recomputes an ``epsilon`` found on `PLD_DISCRETIZATION`
    (`PLD_RESOLUTION`); `PLD_DISCRETIZATION` itself where that is fine enough."""
    interval = PLD_DISCRETIZATION
    while interval > max(epsilon / PLD_RESOLUTION, PLD_FINEST) and interval / 2 >= PLD_FINEST:
        interval /= 2
    return interval


def rdp_orders(neighboring=ADD_OR_REMOVE_ONE):
    """The Rényi orders of the RDP accountant under ``neighboring``."""
    return REPLACE_ONE_ORDERS if neighboring is REPLACE_ONE else RDP_ORDERS


def check_accountant(accountant):
    """Raise `ValueError` unless ``accountant`` is one of `ACCOUNTANTS`."""
    if accountant not in ACCOUNTANTS:
        raise ValueError(f"accountant must be one of {ACCOUNTANTS}, got {accountant!r}")


def make_accountant(accountant="rdp", neighboring=ADD_OR_REMOVE_ONE,
                    discretization=PLD_DISCRETIZATION):
    """A fresh dp-accounting accountant: ``"rdp"`` (at `rdp_orders`) or ``"pld"``
    (pessimistic, on a grid of ``discretization``)."""
    if accountant not in ("rdp", "pld"):
        raise ValueError(f"dp-accounting has an 'rdp' and a 'pld' accountant, got {accountant!r}")
    if accountant == "rdp":
        return dp_accounting.rdp.RdpAccountant(rdp_orders(neighboring),
                                              neighboring_relation=neighboring)
    cls = _CachedPLDAccountant if _CACHEABLE_PLD else dp_accounting.pld.PLDAccountant
    return cls(neighboring_relation=neighboring, value_discretization_interval=discretization)


class _CachedPLDAccountant(dp_accounting.pld.PLDAccountant):
    """dp-accounting's PLD accountant, except that the PLD of ``count`` self-composed
    Poisson-subsampled Gaussians (DP-SGD steps, private quantiles) is built as it
    builds it but cached (`_poisson_gaussian_pld`): the same ε bit for bit, without
    rebuilding every ledger entry for every ε a budget's bisection or a step's logs
    ask for (building one costs ~60 ms at `PLD_DISCRETIZATION`)."""

    def _maybe_compose(self, event, count, do_compose):
        if (do_compose and isinstance(event, dp_accounting.PoissonSampledDpEvent)
                and isinstance(event.event, dp_accounting.GaussianDpEvent)
                and event.sampling_probability > 0 and event.event.noise_multiplier > 0):
            self._pld = self._pld.compose(_poisson_gaussian_pld(
                event.sampling_probability, event.event.noise_multiplier, count,
                self._value_discretization_interval, self.neighboring_relation))
            return None
        return super()._maybe_compose(event, count, do_compose)


#: the private state `_CachedPLDAccountant` relies on (else the plain accountant)
_CACHEABLE_PLD = all(hasattr(dp_accounting.pld.PLDAccountant(), name)
                     for name in ("_pld", "_value_discretization_interval"))


@functools.lru_cache(maxsize=64)
def _poisson_gaussian_pld(sampling_probability, noise_multiplier, count, discretization,
                          neighboring):
    return _unit_poisson_gaussian_pld(sampling_probability, noise_multiplier, discretization,
                                      neighboring).self_compose(count)


@functools.lru_cache(maxsize=64)
def _unit_poisson_gaussian_pld(sampling_probability, noise_multiplier, discretization,
                               neighboring):
    return dp_accounting.pld.privacy_loss_distribution.from_gaussian_mechanism(
        standard_deviation=noise_multiplier, value_discretization_interval=discretization,
        sampling_prob=sampling_probability, neighboring_relation=neighboring)


def _unit_rdp(event, neighboring):
    """The RDP curve (at `rdp_orders`) of one ``event``, cached: the subsampled
    Gaussian costs ~0.2 s per evaluation and training asks for ε of the same
    step at every epoch. Events holding lists (a `RepeatAndSelectDpEvent` of a
    composition) are cached by their JSON form only."""
    try:
        return _unit_rdp_cached(event, neighboring)
    except TypeError:  # unhashable: a list inside
        return _unit_rdp_of_config(_config_json(event), neighboring)


@functools.lru_cache(maxsize=256)
def _unit_rdp_cached(event, neighboring):
    return _unit_rdp_of_config(_config_json(event), neighboring)


@functools.lru_cache(maxsize=256)
def _unit_rdp_of_config(config_json, neighboring):
    rdp = np.array(_unit_rdp_values(config_json, neighboring), dtype=float)
    rdp.setflags(write=False)
    return rdp


@stored
def _unit_rdp_values(config_json, neighboring):
    """The curve as a list (`stored` on disk where asked)."""
    acc = make_accountant("rdp", neighboring)
    acc.compose(event_from_config(json.loads(config_json)))
    return [float(value) for value in acc._rdp]


def _config_json(event):
    return json.dumps(event_to_config(event), sort_keys=True)


@quiet_dp_accounting()
def rdp_curve(events, neighboring=ADD_OR_REMOVE_ONE):
    """The RDP ε(λ) of the composition of ``events`` under ``neighboring``, at the
    orders `rdp_orders(neighboring)`: the sum of each event's curve."""
    total = np.zeros_like(rdp_orders(neighboring))

    def add(event, count):
        nonlocal total
        while isinstance(event, dp_accounting.SelfComposedDpEvent):
            count *= event.count
            event = event.event
        if isinstance(event, dp_accounting.ComposedDpEvent):
            for inner in event.events:
                add(inner, count)
        elif not isinstance(event, dp_accounting.NoOpDpEvent) and count:
            total = total + count * _unit_rdp(event, neighboring)

    for event in events:
        add(event, 1)
    return total


def _rdp_epsilon(events, delta, neighboring):
    # Exactly what RdpAccountant computes (it also adds count × the RDP of one
    # event for a self-composed event), with the one-event curves cached.
    curve = rdp_curve(events, neighboring)
    return float(_rdp_lib.compute_epsilon(rdp_orders(neighboring), curve, delta)[0])


def pld_unsupported(events, neighboring=ADD_OR_REMOVE_ONE):
    """The events inside ``events`` (through compositions) that dp-accounting's PLD
    accountant cannot account under ``neighboring`` (RDP only: e.g. a private
    hyper-parameter selection, ``RepeatAndSelectDpEvent``, Papernot and Steinke
    2022, or sampling without replacement)."""
    return unsupported(events, "pld", neighboring)


def unsupported(events, accountant, neighboring=ADD_OR_REMOVE_ONE):
    """The events inside ``events`` (through compositions) that dp-accounting's
    ``accountant`` (``"rdp"`` or ``"pld"``) cannot account under ``neighboring``
    (e.g. its RDP accountant, Poisson sampling under replace-one)."""
    acc = make_accountant(accountant, neighboring)
    found = []

    def visit(event):
        while isinstance(event, dp_accounting.SelfComposedDpEvent):
            event = event.event
        if isinstance(event, dp_accounting.ComposedDpEvent):
            for inner in event.events:
                visit(inner)
        elif not acc.supports(event) or (accountant == "pld" and _below_pld_noise(event)):
            found.append(event)

    for event in events:
        visit(event)
    return found


def _below_pld_noise(event):
    """Whether ``event`` holds (through samplings and compositions) a Gaussian
    release with a noise multiplier below `PLD_MIN_NOISE`."""
    if isinstance(event, dp_accounting.GaussianDpEvent):
        return event.noise_multiplier < PLD_MIN_NOISE
    inner = list(getattr(event, "events", ())) + [getattr(event, "event", None)]
    return any(_below_pld_noise(e) for e in inner if e is not None)


def _pld_epsilon(events, delta, neighboring):
    found = pld_unsupported(events, neighboring)
    if found:
        raise ValueError(
            f"dp-accounting accounts this {type(found[0]).__name__} under "
            f"{neighboring.name} in RDP only (its PLD accountant does not support it: "
            "e.g. a private hyper-parameter selection, Papernot and Steinke 2022, "
            "sampling without replacement, or a Gaussian release with a noise "
            f"multiplier below PLD_MIN_NOISE = {PLD_MIN_NOISE}): use accountant='rdp'")
    configs = json.dumps([event_to_config(event) for event in events], sort_keys=True)
    return _pld_epsilon_of_config(configs, float(delta), neighboring)


@functools.lru_cache(maxsize=256)
@stored
def _pld_epsilon_of_config(configs, delta, neighboring):
    """On `PLD_DISCRETIZATION`, then on the finer `pld_interval` of that ε if there
    is one. Cached by the events' JSON form: training asks for ε of the same ledger
    several times (the last step's logs, the epoch's, a callback's, the statement);
    `stored` on disk where asked."""
    epsilon = _pld_on_grid(configs, delta, neighboring, PLD_DISCRETIZATION)
    interval = pld_interval(epsilon)
    if interval < PLD_DISCRETIZATION:
        epsilon = min(epsilon, _pld_on_grid(configs, delta, neighboring, interval))
    return epsilon


def _pld_on_grid(configs, delta, neighboring, discretization):
    acc = make_accountant("pld", neighboring, discretization)
    for config in json.loads(configs):
        acc.compose(event_from_config(config))
    return float(acc.get_epsilon(delta))


def _tightest_epsilon(events, delta, neighboring):
    bounds = [epsilon_of_events(events, delta, accountant, neighboring)
              for accountant in ("pld", "rdp") if not unsupported(events, accountant, neighboring)]
    if not bounds:
        raise ValueError(f"neither of dp-accounting's accountants accounts these events under "
                         f"{neighboring.name}")
    return min(bounds)


@quiet_dp_accounting()
def epsilon_of_events(events, delta, accountant="tightest", neighboring=ADD_OR_REMOVE_ONE):
    """ε at ``delta`` of the composition of ``events`` under ``neighboring`` with
    ``accountant`` (`ACCOUNTANTS`; `ValueError` for PLD if one of them is
    `pld_unsupported`, for ``"tightest"`` if neither accountant supports them all)."""
    check_delta(delta)
    check_accountant(accountant)
    events = list(events)
    if accountant == "tightest":
        return _tightest_epsilon(events, delta, neighboring)
    if accountant == "rdp" and hasattr(dp_accounting.rdp.RdpAccountant(), "_rdp"):
        return _rdp_epsilon(events, delta, neighboring)
    if accountant == "pld":
        return _pld_epsilon(events, delta, neighboring)
    acc = make_accountant(accountant, neighboring)
    for event in events:
        acc.compose(event)
    return float(acc.get_epsilon(delta))


@functools.lru_cache(maxsize=4096)
def compute_epsilon(noise_multiplier, sampling_rate, steps, delta, accountant="tightest",
                    sampling="poisson", steps_per_epoch=None, neighboring=ADD_OR_REMOVE_ONE):
    """ε of ``steps`` DP-SGD steps with noise ``noise_multiplier`` and rate ``sampling_rate``
    (`training_event`).

    Returns 0 for 0 steps. Cached (the arguments are plain numbers).
    """
    event = training_event(noise_multiplier, sampling_rate, steps, sampling, steps_per_epoch)
    return epsilon_of_events([event], delta, accountant, neighboring)
