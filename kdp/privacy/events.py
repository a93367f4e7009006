"""The `dp_accounting.DpEvent`s of kdp's releases.

Under **add/remove-one** adjacency (Dwork and Roth 2014, §2.3):

* Poisson sampling (the default): each step is
  ``PoissonSampledDpEvent(q, GaussianDpEvent(σ_eff))``;
* shuffled fixed-size batches (explicit opt-in, ``sampling="shuffle"``): each
  record is in at most one batch per pass over the data, so a pass is one
  Gaussian mechanism, without amplification, under **replace-one** adjacency
  (sensitivity doubled: ``GaussianDpEvent(σ_eff / 2)`` per started pass). With
  batches of at most ``b`` records a pass lasts at least ``⌊N/b⌋`` steps, so
  ``n`` contiguous steps start at most ``⌈n / ⌊N/b⌋⌉`` passes: that is the
  ``steps_per_epoch`` a model gives the accountant in this mode. It holds only
  where kdp draws the passes (arrays, a `kdp.RecordSource`); a step on a batch
  kdp did not draw (a dataset, a generator, `train_on_batch`) is one Gaussian
  release without amplification (``q = 1``).

Per-layer noise with multipliers ``σ·c_v`` is one Gaussian mechanism with
``σ_eff = (Σ_v (σ c_v)^-2)^(-1/2)``.
"""

import math

import dp_accounting

from kdp.privacy._checks import check_count, check_positive

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
    check_positive(noise_multiplier=noise_multiplier)
    steps = check_count(steps, "steps")
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


def _poisson_gaussian(noise_multiplier, sampling_rate, count, name):
    """``count`` self-composed ``PoissonSampledDpEvent(q, GaussianDpEvent(σ))``."""
    check_positive(noise_multiplier=noise_multiplier)
    if not 0 < sampling_rate <= 1:
        raise ValueError(f"sampling_rate must be in (0, 1], got {sampling_rate}")
    count = check_count(count, name)
    if count == 0:
        return dp_accounting.NoOpDpEvent()
    release = dp_accounting.PoissonSampledDpEvent(
        sampling_rate, dp_accounting.GaussianDpEvent(noise_multiplier))
    return dp_accounting.SelfComposedDpEvent(release, count)
