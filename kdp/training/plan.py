"""`StepPlan`: the one frozen description of a DP model's noisy step.

Everything a compiled step bakes in about privacy, and everything the ledger
records for it, comes from one `StepPlan`, built in one place (`step_plan`)
from the model's `DPParameters` and `DatasetMetadata`:

* the noise the step adds (`noise_std`: ``σ c_v Δ_v / b`` per variable,
  ``σ √(Σ Δ_v²) / b`` with global noise, ``σ C / b`` with clipping;
  Béthune et al. 2024, Alg. 1–2; Abadi et al. 2016);
* the ledger key of one step (`fit_mechanism` with kdp's sampling,
  `batch_mechanism` for a batch kdp did not sample), whose ``noise_multiplier``
  is the plan's ``σ_eff``.

This module is the only reader of ``σ`` and ``q`` for a step. Two plans are
equal when every field is: a DP model retraces its step whenever its plan
changes, and a compiled step asks the gate, **each time it executes**, for a
release recorded for one of its plan's mechanisms (`PrivacyGate.consume`).
"""

import dataclasses
import json
import math
from dp_accounting import NeighboringRelation

from kdp.clipping import total_clipping_norm
from kdp.privacy import ADD_OR_REMOVE_ONE, effective_noise_multiplier
from kdp.training.ledger import training_mechanism

@dataclasses.dataclass(frozen=True)
class StepPlan:
    """The frozen privacy plan of one noisy step (hashable; equality decides retracing).

    Attributes:
        noise_multiplier: ``σ`` of `DPParameters`.
        effective_noise_multiplier: ``σ_eff``, the multiplier of the one Gaussian a
            step is equivalent to (``(Σ_v (σ c_v)^-2)^(-1/2)`` for per-layer noise).
        noisify_strategy: ``"per-layer"`` or ``"global"``.
        coefficients: ``((variable.path, c_v), ...)``, the public per-layer coefficients.
        clipping_norm: ``C`` (the total over layers with per-layer clipping), or
            ``None`` for Clipless training.
        batch_size: the expected batch size ``b`` (the divisor of the summed loss).
        nb_samples: ``N``.
        sampling_rate: ``q = b / N``.
        sampling: ``"poisson"`` or ``"shuffle"``.
        steps_per_epoch: the steps of one epoch of `fit` (for shuffled batches, the
            ``⌊N/b⌋`` steps a pass lasts at least).
        delta: the δ of the reported guarantee.
        block: steps run by one call of the compiled train function
            (``steps_per_execution``).
        neighboring: the neighbouring relation the step is accounted under
            (`kdp.privacy.ADD_OR_REMOVE_ONE`, or `REPLACE_ONE`).
    """

    noise_multiplier: float
    effective_noise_multiplier: float
    noisify_strategy: str
    coefficients: tuple
    clipping_norm: float | None
    batch_size: int
    nb_samples: int
    sampling_rate: float
    sampling: str
    steps_per_epoch: int
    delta: float
    block: int = 1
    neighboring: NeighboringRelation = ADD_OR_REMOVE_ONE

    @property
    def fit_mechanism(self):
        """The ledger key of one step of `fit` (kdp's Poisson or shuffled batches)."""
        return training_mechanism(self.effective_noise_multiplier, self.sampling_rate,
                                  self.sampling, self.steps_per_epoch)

    @property
    def batch_mechanism(self):
        """The ledger key of one step on a batch kdp did not sample (`train_on_batch`,
        a custom loop): the Gaussian mechanism without amplification (``q = 1``)."""
        return training_mechanism(self.effective_noise_multiplier, 1.0, "poisson", None)

    @property
    def mechanism_keys(self):
        """The canonical texts of the mechanisms a step of this plan realizes (what
        the gate's credits are keyed by, `mechanism_key`)."""
        return (mechanism_key(self.fit_mechanism), mechanism_key(self.batch_mechanism))

    def noise_std(self, path, bound):
        """The std of the Gaussian noise on ``path``'s gradient: ``bound`` is its
        per-example gradient bound ``Δ_v`` (per-layer noise), the total
        ``√(Σ_v Δ_v²)`` (global noise), unused with clipping."""
        if self.clipping_norm is not None:
            return self.noise_multiplier * self.clipping_norm / self.batch_size
        if self.noisify_strategy == "global":
            return self.noise_multiplier * bound / self.batch_size  # bound: √(Σ_v Δ_v²)
        coefficient = dict(self.coefficients).get(path, 1.0)
        return self.noise_multiplier * coefficient * bound / self.batch_size

    def describe(self):
        """A one-line text naming the plan (for errors)."""
        return (f"σ={self.noise_multiplier:.6g} (σ_eff={self.effective_noise_multiplier:.6g}, "
                f"{self.noisify_strategy}), b={self.batch_size}, q={self.sampling_rate:.6g}, "
                f"{self.sampling} sampling, {self.neighboring.name.lower()}")


def mechanism_key(mechanism):
    """The canonical text of a ledger mechanism (a dict)."""
    return json.dumps(mechanism, sort_keys=True)


def noise_coefficients(model):
    """``{variable.path: c_v}``: the public per-layer noise coefficients (``nm_coef``)."""
    coefs = {}
    for layer in model._flatten_layers(include_self=False):
        for v in layer.trainable_weights:
            coefs[v.path] = float(getattr(layer, "nm_coef", 1.0))
    return coefs


def step_plan(model, neighboring=ADD_OR_REMOVE_ONE):
    """The `StepPlan` of ``model``'s noisy step, from its `DPParameters` and
    `DatasetMetadata` (the only place that reads ``σ`` and ``q`` for a step).
    Builds the model (from ``dataset_metadata.input_shape``) if it is not built.

    Raises:
        ValueError: the model has no ``dp_parameters`` or ``dataset_metadata``.
    """
    params, md = model.dp_parameters, model.dataset_metadata
    if params is None or md is None:
        raise ValueError(f"{model.name}: pass dp_parameters= and dataset_metadata= to train it")
    if not model.built:  # the per-layer σ_eff needs the variables
        model.build((None,) + tuple(md.input_shape))
    sigma = float(params.noise_multiplier)
    coefficients = tuple(sorted(noise_coefficients(model).items()))
    clip = None if params.clipping_norm is None else total_clipping_norm(params)
    if clip is not None or params.noisify_strategy == "global":
        sigma_eff = sigma
    else:
        sigma_eff = effective_noise_multiplier(
            sigma * dict(coefficients).get(v.path, 1.0) for v in model.trainable_variables)
    n, b = md.nb_samples_train, md.batch_size
    # Shuffled batches of at most b records: a pass lasts at least ⌊N/b⌋ steps.
    steps_per_epoch = math.ceil(n / b) if params.sampling == "poisson" else max(1, n // b)
    return StepPlan(
        noise_multiplier=sigma, effective_noise_multiplier=float(sigma_eff),
        noisify_strategy=params.noisify_strategy, coefficients=coefficients, clipping_norm=clip,
        batch_size=b, nb_samples=n, sampling_rate=b / n, sampling=params.sampling,
        steps_per_epoch=steps_per_epoch, delta=params.delta,
        block=max(1, int(getattr(model, "steps_per_execution", 1) or 1)), neighboring=neighboring)
