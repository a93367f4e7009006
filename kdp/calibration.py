"""Private calibration of a binary model's probabilities.

A DP model's own probabilities (``sigmoid(τ·z)`` for τ-binary cross-entropy)
rank well but need not be calibrated: with loss-gradient clipping every
example pushes with the same force whatever its loss, so the trained logits
are sharper than the data's conditional probabilities (a synthetic clinical
table: predicted 0.01 where 13 % had the event, 0.97 where 78 % had it).

`PrivateCalibration` fixes this with **Platt scaling** (Platt 1999) fitted on
private counts: the model's score ``s`` (the logit of its probability) is
binned on fixed, public edges; the numbers of positive and negative training
examples in each bin are released once with Gaussian noise; everything after
is post-processing: the noisy counts are clamped at 0 and a logistic
regression ``sigmoid(a·c + b)`` of the bins' centres ``c`` is fitted to them
(``a ≥ 0``). A new score is mapped to ``sigmoid(a·clip(s) + b)``, ``clip`` to
the outer bins' centres, plus ``10⁻⁶·(1/2 + arctan(s)/π)``, which keeps the
map strictly increasing: the ranking, hence the AUROC, is the model's own.
Two parameters pool every bin (a rate per bin, histogram binning after
Zadrozny and Elkan 2001, was tried first and was noisier). Counts of a few
hundred rows at a small ε are mostly noise: `reserve` warns then.

Privacy: adding or removing one example changes one of the ``2·B`` counts by 1
(L2 sensitivity 1; √2 under replace-one, where one count goes down and another
up), so the release is one ``GaussianDpEvent(σ)`` with noise std ``σ`` times the
sensitivity. It goes through the model's privacy gate (checked against its
budget, recorded in its ledger, listed in its privacy statement).
``reserve`` registers the release as a plan before `make_private`, so that the
training σ is calibrated for training **plus** the calibration and the total
stays within the target ε. Opt-in: it spends part of ε, so it is worth it on
tables of thousands of rows (measured in ``benchmarks/calibration_tables.py``).
"""

import math
import warnings

import dp_accounting
import numpy as np

from kdp.losses.probabilities import link, sigmoid
from kdp.training import budget
from kdp.training.ledger import event_mechanism
from kdp.training.seeds import numpy_generator

#: the bins' inner edges, on the score (the logit of the model's probability):
#: 16 bins of width 1 in [-8, 8]; the first and last are open to ±∞.
DEFAULT_EDGES = tuple(float(e) for e in np.arange(-7.0, 8.0))
#: the weight of the strictly increasing tie-breaker added to the Platt map
TIE_BREAK = 1e-6
#: the share of a target ε that `reserve` gives to the calibration's release alone. In
#: Gaussian-DP terms (μ² adds up) a share s raises the training σ by about
#: 1/√(1 − s²), 3 % for 1/4 (measured with PLD: 3.2–4.5 % at ε = 1, 3, 8), for
#: counts 2.5× less noisy than with a share of 1/10 (chosen by this argument after
#: a first run at 1/10, one seed on two tables, found a 426-row table's counts
#: mostly noise).
CALIBRATION_SHARE = 0.25
#: `reserve` warns when the noise of all the counts together, √(2·bins)·σ·Δ, is above
#: this fraction of the training rows (the fit is then mostly noise)
NOISE_WARNING_FRACTION = 0.1


def scores(model, x, batch_size=None):
    """The logit of the model's probability of label 1, ``(rows,)``: ``τ·z`` for
    τ-binary cross-entropy, ``z`` for Keras' binary cross-entropy from logits.

    Raises:
        ValueError: the model has more than one output, or another link.
    """
    name, scale = link(model.loss)
    if name != "sigmoid":
        raise ValueError("calibration takes a binary model with one output whose probability "
                         "is sigmoid(τ·z) or sigmoid(z) (DP_TauBCE, or BinaryCrossentropy("
                         f"from_logits=True)); its loss's link is {name}")
    outputs = np.asarray(model.predict(x, batch_size=batch_size, verbose=0), "float64")
    if outputs.ndim != 2 or outputs.shape[1] != 1:
        raise ValueError("calibration takes a binary model with one output, got outputs of "
                         f"shape {outputs.shape[1:]}")
    return scale * outputs[:, 0]  # not the logit of p: sigmoid(τ·z) is 1.0 in float64 from τ·z ≈ 37


def _sensitivity(neighboring):
    """The counts' L2 sensitivity: 1 under add/remove-one, √2 under replace-one."""
    return math.sqrt(2.0) if neighboring == dp_accounting.NeighboringRelation.REPLACE_ONE else 1.0


def _platt(centres, positives, negatives, iterations=100):
    """``(a, b)`` maximising ``Σ_c pos_c log σ(a·c + b) + neg_c log σ(−a·c − b)``
    with ``a ≥ 0`` (Newton's method, a 10⁻⁶ ridge for counts that separate)."""
    weights = positives + negatives
    if weights.sum() <= 0:
        return 0.0, 0.0  # nothing survived the noise: probability 1/2
    design = np.stack([centres, np.ones_like(centres)], axis=1)
    ridge = 1e-6 * weights.sum() * np.eye(2)
    theta = np.zeros(2)
    for _ in range(iterations):
        p = sigmoid(design @ theta)
        grad = design.T @ (positives - weights * p) - ridge @ theta
        hess = design.T @ (design * (weights * p * (1 - p))[:, None]) + ridge
        step = np.linalg.solve(hess, grad)
        theta = theta + step
        if theta[0] < 0:  # a decreasing map would reverse the model's ranking: a = 0
            rate = positives.sum() / weights.sum()
            return 0.0, float(np.log(max(rate, 1e-12) / max(1 - rate, 1e-12)))
        if np.max(np.abs(step)) < 1e-10:
            break
    return float(theta[0]), float(theta[1])


class PrivateCalibration:
    """Platt scaling of a binary model on privately released counts (module docstring).

    Args:
        noise_multiplier: σ of the one release (noise std / sensitivity).
        edges: the bins' inner edges on the score, increasing (public).

    Attributes:
        coefficients: ``(a, b)`` once fitted, else None.
        centres: the bins' centres on the score (the outer bins: half a width out).
    """

    #: a reserved calibration is saved with the model's weights (`kdp.training.saving`)
    saved_with_model = True

    def __init__(self, noise_multiplier, edges=DEFAULT_EDGES):
        if not (noise_multiplier > 0 and math.isfinite(noise_multiplier)):
            raise ValueError(f"noise_multiplier must be a finite number > 0, got {noise_multiplier}")
        edges = np.asarray(edges, "float64")
        if edges.ndim != 1 or len(edges) < 2 or not np.all(np.diff(edges) > 0):
            raise ValueError("edges must be at least two increasing numbers")
        self.noise_multiplier = float(noise_multiplier)
        self.edges = tuple(float(e) for e in edges)
        width = np.diff(edges)
        self.centres = np.concatenate([[edges[0] - width[0] / 2], (edges[:-1] + edges[1:]) / 2,
                                       [edges[-1] + width[-1] / 2]])
        self.coefficients = None

    @property
    def event(self):
        """The `DpEvent` of the release."""
        return dp_accounting.GaussianDpEvent(self.noise_multiplier)

    def planned_events(self, steps):
        """The release still to come (the plan protocol of `kdp.training.budget`)."""
        return [] if self.coefficients is not None else [self.event]

    def fit(self, model, x, y, batch_size=None):
        """Release the noisy counts of ``(x, y)`` (the private training rows) through
        ``model``'s privacy gate and fit the map; returns ``self``. ε is checked
        against the model's budget before anything is computed.

        Raises:
            kdp.training.gate.BudgetExceededError: the release does not fit the budget.
            ValueError: labels other than 0/1, or a model with more than one output.
        """
        y = np.asarray(y).reshape(-1)
        if not np.all((y == 0) | (y == 1)):
            raise ValueError("calibration takes labels 0 and 1")
        gate = model.privacy_gate
        mechanism = event_mechanism(self.event)
        sensitivity = _sensitivity(gate.neighboring)
        params = model.dp_parameters
        generator = numpy_generator(params.reproducible, params.seed, offset=11)
        gate.begin_run(mechanism)  # refuses now if the budget has no room (nothing computed)
        bins = np.searchsorted(self.edges, scores(model, x, batch_size), side="right")
        if len(bins) != len(y):
            raise ValueError(f"{len(bins)} inputs but {len(y)} labels")
        counts = np.stack([np.bincount(bins[y == label], minlength=len(self.centres))
                           for label in (0, 1)]).astype("float64")
        with gate.spend(mechanism):  # recorded before the noisy counts exist
            noisy = counts + generator.normal(0.0, self.noise_multiplier * sensitivity, counts.shape)
        budget.unregister_release_plan(model, self)
        negatives, positives = np.maximum(noisy, 0.0)
        self.coefficients = _platt(self.centres, positives, negatives)
        return self

    def probabilities(self, s):
        """Calibrated probabilities of scores ``s`` (see `scores`)."""
        if self.coefficients is None:
            raise ValueError("fit the calibration first")
        a, b = self.coefficients
        s = np.asarray(s, "float64")
        platt = sigmoid(a * np.clip(s, self.centres[0], self.centres[-1]) + b)
        return (1.0 - TIE_BREAK) * platt + TIE_BREAK * (0.5 + np.arctan(s) / np.pi)

    def predict_proba(self, model, x, batch_size=None):
        """Calibrated probabilities of label 1 for ``x``, ``(rows,)``; costs no privacy."""
        return self.probabilities(scores(model, x, batch_size))

    def get_config(self):
        """JSON-serializable: σ, the edges and the fitted coefficients (for saving)."""
        return {"noise_multiplier": self.noise_multiplier, "edges": list(self.edges),
                "coefficients": (None if self.coefficients is None
                                 else [float(c) for c in self.coefficients])}

    @classmethod
    def from_config(cls, config):
        calibration = cls(config["noise_multiplier"], config["edges"])
        if config.get("coefficients") is not None:
            calibration.coefficients = tuple(float(c) for c in config["coefficients"])
        return calibration

    def __repr__(self):
        state = "planned" if self.coefficients is None else "a={:.4g}, b={:.4g}".format(
            *self.coefficients)
        return f"PrivateCalibration(noise_multiplier={self.noise_multiplier:.4g}, {state})"


def calibrate(model, x, y, batch_size=None):
    """Fit the calibration reserved on ``model`` (`reserve`, or
    ``Recipe.build(calibrate=True)``) on its private training rows ``(x, y)``;
    returns the fitted `PrivateCalibration`."""
    reserved = [p for p in model.privacy_gate.plans.values() if isinstance(p, PrivateCalibration)]
    if not reserved:
        raise ValueError(f"{model.name} has no reserved calibration: call kdp.calibration.reserve("
                         "model, target_epsilon) before make_private (Recipe.build(calibrate=True) "
                         "does), or fit a PrivateCalibration(noise_multiplier) within the budget")
    return reserved[0].fit(model, x, y, batch_size)


def reserve(model, target_epsilon, share=CALIBRATION_SHARE, edges=DEFAULT_EDGES):
    """A `PrivateCalibration` whose release alone costs ``share · target_epsilon`` at
    the model's δ (PLD), registered on ``model`` as a planned release: call it
    **before** ``model.make_private(target_epsilon, epochs)``, which then calibrates
    the training σ for training plus this release (the total stays ≤ the target;
    composed, the calibration costs the training a few % of σ, not ``share``)."""
    from kdp import privacy

    if not 0 < share < 1:
        raise ValueError(f"share must be in (0, 1), got {share}")
    plan = model.step_plan()
    sigma = privacy.calibrate_noise_multiplier(
        share * target_epsilon, 1.0, 1, plan.delta, "pld", neighboring=plan.neighboring)
    calibration = PrivateCalibration(float(sigma), edges)
    noise = (calibration.noise_multiplier * math.sqrt(2 * len(calibration.centres))
             * _sensitivity(plan.neighboring))
    rows = model.dataset_metadata.nb_samples_train
    if noise > NOISE_WARNING_FRACTION * rows:
        warnings.warn(
            f"PrivateCalibration: the counts' noise (about {noise:.0f} in all) is "
            f"{noise / rows:.0%} of the {rows} training rows at ε = {target_epsilon:g}: the "
            "calibration would be mostly noise (measured: it made a 426-row table worse at "
            "ε = 1 and 3). Keep the model's own predict_proba, or calibrate at a larger ε.",
            stacklevel=2)
    budget.register_release_plan(model, calibration)
    return calibration
