"""Privacy audit tools: check the bounds, check the noise, lower-bound ε empirically.

* `gradient_norm_check`: true per-example gradient norms (vectorized autodiff)
  against the bounds of the bound pass; `GradientNormCheck` runs it as a callback.
* `noise_check`: isolates the noise of the training objective and compares its
  empirical std with the calibrated one.
* `membership_audit`: a white-box canary audit of one noisy step whose
  true/false positive rates give a Clopper–Pearson lower bound on ε.

None of these tools touches private data unless you give it some: run them on
public or synthetic batches.
"""

import math

import keras
import numpy as np
from scipy import stats

from kdp import privacy
from kdp.autodiff import compile_function, gradient, per_example_gradients
from kdp.bounds import compute_gradient_bounds

# --- bounds ----------------------------------------------------------------------


def gradient_norm_check(model, x, y, loss=None, tolerance=1e-4):
    """Compare true per-example gradient norms on ``(x, y)`` with the certified bounds.

    Args:
        model: a built DP model (or any model of DP layers).
        x, y: a batch (public or synthetic data).
        loss: the loss (defaults to ``model.loss``).
        tolerance: relative slack allowed for float rounding.

    Returns:
        A dict ``{"ok": bool, "max_ratio": float, "variables": {path: {"bound",
        "max_norm", "max_ratio"}}, "violations": [paths]}``.
    """
    loss = model.loss if loss is None else loss
    bounds = compute_gradient_bounds(model, loss)
    grads = per_example_gradients(model, loss, x, y)
    report = {}
    for path, g in grads.items():
        g = np.asarray(g, dtype="float64")
        norms = np.sqrt(np.sum(g.reshape(len(g), -1) ** 2, axis=1))
        bound = float(bounds[path])
        report[path] = {
            "bound": bound,
            "max_norm": float(norms.max()),
            "max_ratio": float(norms.max() / bound) if bound > 0 else math.inf,
        }
    violations = [p for p, r in report.items() if r["max_ratio"] > 1 + tolerance]
    return {
        "ok": not violations,
        "max_ratio": max(r["max_ratio"] for r in report.values()),
        "variables": report,
        "violations": violations,
    }


class GradientNormCheck(keras.callbacks.Callback):
    """Runs `gradient_norm_check` on a held-out public batch every ``every`` epochs.

    Writes ``grad_bound_ratio`` (the largest norm/bound ratio) into the epoch logs
    and raises ``RuntimeError`` on a violation (set ``raise_on_violation=False``
    to only log it).
    """

    def __init__(self, x, y, every=1, raise_on_violation=True):
        super().__init__()
        self.x, self.y = x, y
        self.every = int(every)
        self.raise_on_violation = raise_on_violation

    def on_epoch_end(self, epoch, logs=None):
        if (epoch + 1) % self.every:
            return
        report = gradient_norm_check(self.model, self.x, self.y)
        if logs is not None:
            logs["grad_bound_ratio"] = report["max_ratio"]
        if not report["ok"] and self.raise_on_violation:
            raise RuntimeError(f"per-example gradient bound violated: {report['violations']}")


# --- noise -------------------------------------------------------------------------


def noise_draws(model, x, y, trials):
    """``{variable.path: array (trials, *shape)}`` of the noise a training step adds.

    Differentiates ``model.stateless_compute_loss`` (the objective of a real
    step) with all sample weights 0 and fixed predictions, so the gradient is the
    noise alone; the model's seed generator advances before every draw. The draws
    go through the model's privacy gate and are recorded in its ledger as
    ``trials`` steps without amplification (the gate does not trust that the
    weights are 0): audit a throwaway copy of the model.
    """
    zeros = np.zeros(len(x), "float32")
    y_pred = model(x)
    metrics = [v.value for v in model.metrics_variables]
    draws = {v.path: [] for v in model.trainable_variables}
    with model.privacy_gate.spend(model.step_plan().batch_mechanism, trials):
        _draw(model, x, y, y_pred, zeros, metrics, trials, draws)
    return {path: np.stack(d) for path, d in draws.items()}


def _draw(model, x, y, y_pred, zeros, metrics, trials, draws):
    def noise(values, others):  # compiled once: each trial passes the advanced seed state
        def objective(*values):
            loss, _ = model.stateless_compute_loss(
                list(values), others, metrics, x=x, y=y, y_pred=y_pred,
                sample_weight=zeros, training=True,
            )
            return loss

        return gradient(objective, *values)

    noise = compile_function(noise)
    for _ in range(trials):
        model._noise_seed.next()
        grads = noise([v.value for v in model.trainable_variables],
                      [v.value for v in model.non_trainable_variables])
        for v, g in zip(model.trainable_variables, grads):
            draws[v.path].append(np.asarray(g))


def noise_check(model, x, y, trials=50, rtol=0.03, expected=None):
    """Measure the std of the noise the training objective injects, per variable.

    Compares it with ``expected`` (``{path: std}``; default ``model.noise_stds()``,
    the calibration ``σ c_v Δ_v / b`` or ``σ ‖Δ‖ / b``).

    The sample weights are set to 0, so the data gradient is exactly 0 and the
    gradient of ``model.compute_loss`` is the Gaussian draw alone (the draw of a
    real training step: same code path, same seed generator).

    Returns:
        ``{"ok": bool, "variables": {path: {"expected", "measured", "ratio"}}}``
        with ``ok`` when every ratio is within ``rtol`` (the statistical error of
        the measured std is about ``1/√(2·trials·size)``).
    """
    expected = model.noise_stds() if expected is None else expected
    draws = noise_draws(model, x, y, trials)
    report = {}
    for path, samples in draws.items():
        measured = float(np.std(np.asarray(samples, dtype="float64")))
        report[path] = {
            "expected": expected[path],
            "measured": measured,
            "ratio": measured / expected[path] if expected[path] > 0 else math.inf,
        }
    ok = all(abs(r["ratio"] - 1) <= rtol for r in report.values())
    return {"ok": ok, "variables": report}


# --- empirical ε -------------------------------------------------------------------


def clopper_pearson(successes, trials, confidence):
    """Two one-sided Clopper–Pearson bounds ``(lower, upper)`` of a binomial rate,
    each holding with probability ``confidence``."""
    alpha = 1 - confidence
    lower = 0.0 if successes == 0 else stats.beta.ppf(alpha, successes, trials - successes + 1)
    upper = 1.0 if successes == trials else stats.beta.ppf(1 - alpha, successes + 1, trials - successes)
    return float(lower), float(upper)


def epsilon_lower_bound(true_positives, positives, false_positives, negatives, delta,
                        confidence=0.95):
    """A lower bound on ε, valid with probability ≥ ``confidence``, from a membership test.

    (ε, δ)-DP forces ``TPR ≤ e^ε FPR + δ`` and ``1 − FPR ≤ e^ε (1 − TPR) + δ``; with
    Clopper–Pearson bounds (confidence split between the two rates, union bound)
    ``ε ≥ log((TPR_lo − δ) / FPR_hi)`` and ``ε ≥ log((TNR_lo − δ) / FNR_hi)``.
    """
    conf = 1 - (1 - confidence) / 2
    tpr_lo, tpr_hi = clopper_pearson(true_positives, positives, conf)
    fpr_lo, fpr_hi = clopper_pearson(false_positives, negatives, conf)
    candidates = [0.0]
    if tpr_lo - delta > 0 and fpr_hi > 0:
        candidates.append(math.log((tpr_lo - delta) / fpr_hi))
    if (1 - fpr_hi) - delta > 0 and (1 - tpr_lo) > 0:
        candidates.append(math.log((1 - fpr_hi - delta) / (1 - tpr_lo)))
    return max(candidates)


def _snapshot(model):
    return [v.numpy() for v in model.variables], [v.numpy() for v in model.optimizer.variables]


def _restore(model, snapshot, seed_paths):
    weights, opt = snapshot
    for v, w in zip(model.variables, weights):
        if v.path not in seed_paths:  # keep the noise seed moving forward
            v.assign(w)
    for v, w in zip(model.optimizer.variables, opt):
        v.assign(w)


def membership_audit(model, canary_x, canary_y, trials=400, confidence=0.95, seed=0):
    """White-box audit of one noisy step with a gradient canary (Nasr et al. 2021).

    Each trial restores the same weights and optimizer state and runs one real
    training step (``train_on_batch``) on a batch that holds only the canary,
    with sample weight 1 ("in", dataset ``{canary}``) or 0 ("out", the empty
    dataset): exactly two add/remove neighbours. The attacker's score is the
    update projected on the canary's gradient direction. Half of the trials
    choose the threshold, the other half measure TPR/FPR, turned into an ε
    lower bound by `epsilon_lower_bound`.

    The claimed ε is that of one step without subsampling (``q = 1``) at the
    model's ``σ_eff`` and δ: the audited release is a single step. Cost: ``trials``
    training steps of the model (a few seconds for small models).

    Returns:
        ``{"epsilon_lower_bound", "epsilon_claimed", "delta", "tpr", "fpr", "trials"}``.
    """
    rng = np.random.default_rng(seed)
    canary_x = np.asarray(canary_x)[:1]
    canary_y = np.asarray(canary_y)[:1]
    model.train_on_batch(canary_x, canary_y, sample_weight=np.zeros(1, "float32"))  # build
    snapshot = _snapshot(model)
    seed_paths = {v.path for v in model.non_trainable_variables if "seed" in v.path}
    direction = _canary_direction(model, canary_x, canary_y)
    before = np.concatenate([v.numpy().ravel() for v in model.trainable_variables])
    membership = rng.permutation(np.arange(trials) % 2)
    scores = np.empty(trials)
    for t, member in enumerate(membership):
        _restore(model, snapshot, seed_paths)
        model.train_on_batch(canary_x, canary_y, sample_weight=np.full(1, float(member), "float32"))
        after = np.concatenate([v.numpy().ravel() for v in model.trainable_variables])
        scores[t] = -np.dot(after - before, direction)
    _restore(model, snapshot, seed_paths)
    half = trials // 2
    threshold = _best_threshold(scores[:half], membership[:half], model.dp_parameters.delta, confidence)
    s, m = scores[half:], membership[half:]
    guess = s > threshold
    tp, fp = int(np.sum(guess & (m == 1))), int(np.sum(guess & (m == 0)))
    pos, neg = int(np.sum(m == 1)), int(np.sum(m == 0))
    delta = model.dp_parameters.delta
    return {
        "epsilon_lower_bound": epsilon_lower_bound(tp, pos, fp, neg, delta, confidence),
        "epsilon_claimed": privacy.compute_epsilon(model.effective_noise_multiplier(), 1.0, 1, delta),
        "delta": delta,
        "tpr": tp / pos,
        "fpr": fp / neg,
        "trials": trials,
    }


def _canary_direction(model, x, y):
    trainable = [v.value for v in model.trainable_variables]
    others = [v.value for v in model.non_trainable_variables]

    def canary_loss(*values):
        y_pred, _ = model.stateless_call(list(values), others, x)
        return keras.ops.sum(model.loss.call(y, y_pred))

    grads = gradient(canary_loss, *trainable)
    flat = np.concatenate([np.asarray(g).ravel() for g in grads])
    return flat / max(np.linalg.norm(flat), 1e-30)


def _best_threshold(scores, membership, delta, confidence):
    """The threshold whose ε lower bound (same confidence) is largest on these trials."""
    best, best_eps = np.inf, -np.inf
    pos, neg = int(np.sum(membership == 1)), int(np.sum(membership == 0))
    for threshold in np.unique(scores):
        guess = scores > threshold
        tp = int(np.sum(guess & (membership == 1)))
        fp = int(np.sum(guess & (membership == 0)))
        eps = epsilon_lower_bound(tp, pos, fp, neg, delta, confidence)
        if eps > best_eps:
            best, best_eps = threshold, eps
    return best
