"""Constants of the two strongly convex single-layer learners (DP-Helmet §2–3).

Notation: a model ``f`` has ``rows = p + 1`` rows (bias row first when an
intercept is fitted) and ``K`` columns; every augmented input ``x = [1, x̃]``
satisfies ``‖x‖ ≤ c_aug`` (see :func:`augmented_bound`); ``‖f‖_F ≤ R``;
the objective is ``(Λ/2)‖f‖²_F + (1/n) Σ ℓ``, so it is Λ-strongly convex.

* Softmax-SLP (Kirschte et al. 2022, Thm. N.1, O.1, 4.1):
  ``L = ΛR + √2·c``, ``β = √(rows·K·Λ² + ½(Λ + c²)²)``.
* One-vs-rest Huber SVM (Ex. 3.16; Chaudhuri et al. 2011 eq. 7), per class:
  ``L = ΛR + c``, ``β = √((c²/(2h) + Λ)² + (rows − 1)·Λ²)``.
* Output sensitivity of projected SGD with ``α_m = min(1/β, 1/(Λm))``
  (Wu et al. 2017 Lemma 8, paper Thm. 3.12), replace-one neighbours:
  ``s = 2L/(Λn)``; for the SVM this bounds every class column, which then
  compose ``K`` times.  Both outputs lie in the R-ball, so ``s ≤ 2R`` always
  (Cor. 5.5); a group of Υ records moves the output by at most ``min(Υ·s, 2R)``.
"""

import math

LEARNERS = ("softmax", "huber_svm")


def check_learner(kind):
    if kind not in LEARNERS:
        raise ValueError(f"learner must be one of {LEARNERS}, got {kind!r}")
    return kind


def augmented_bound(c, fit_intercept=True):
    """Norm bound of ``[1, x̃]`` when ``‖x̃‖ ≤ c``: ``√(c² + 1)`` (``c`` without intercept).

    The paper's theory assumes the augmented vector is bounded by ``c`` while its
    code clips only ``x̃``; kdp uses the exact bound.
    """
    _positive(c=c)
    return math.sqrt(c * c + 1.0) if fit_intercept else float(c)


def lipschitz_constant(kind, lam, R, c):
    """Bound on the per-example gradient norm ``‖Λf + ∇ℓ‖`` over the R-ball.

    ``c`` is the bound of the (augmented) input.  Per class for the SVM.
    """
    check_learner(kind)
    _positive(lam=lam, R=R, c=c)
    return lam * R + (math.sqrt(2.0) if kind == "softmax" else 1.0) * c


def smoothness_constant(kind, lam, c, rows, num_classes, h=0.1):
    """β: bound on the Frobenius norm of the per-example Hessian (paper Thm. O.1, Ex. 3.16).

    ``rows`` counts every input coordinate including the bias (p + 1).  The
    Frobenius norm over-estimates the operator norm, which only makes the step
    cap ``1/β`` more conservative.
    """
    check_learner(kind)
    _positive(lam=lam, c=c, rows=rows, num_classes=num_classes)
    if kind == "softmax":
        return math.sqrt(rows * num_classes * lam**2 + 0.5 * (lam + c * c) ** 2)
    _positive(h=h)
    return math.sqrt((c * c / (2.0 * h) + lam) ** 2 + (rows - 1) * lam**2)


def strong_convexity_constant(lam):
    """The objective ``(Λ/2)‖f‖² + mean loss`` is Λ-strongly convex (Thm. M.1)."""
    _positive(lam=lam)
    return float(lam)


def k_comp(kind, num_classes):
    """Number of Gaussian compositions: 1 for softmax, ``K`` for one-vs-rest."""
    check_learner(kind)
    return 1 if kind == "softmax" else int(num_classes)


def sensitivity(kind, lam, R, c, n, group_size=1):
    """Replace-one L2 sensitivity of the trained weights: ``min(Υ·2L/(Λn), 2R)``.

    Joint Frobenius norm for softmax, per class column for the SVM.
    ``group_size=Υ`` protects Υ records at once (triangle inequality);
    ``group_size=n`` is user-level privacy and gives the trivial ``2R``.
    """
    _positive(n=n, group_size=group_size)
    data_bound = group_size * 2.0 * lipschitz_constant(kind, lam, R, c) / (lam * n)
    return min(data_bound, 2.0 * R)


def aggregate_sensitivity(kind, lam, R, c, sizes, num_users=None, group_size=1):
    """Sensitivity of the blind average ``Σ_i (n_i/w)·f_i`` (paper Lem. 5.1).

    One record (or group) of user i moves ``(n_i/w)·f_i`` by at most
    ``(n_i/w)·min(Υ·2L/(Λ n_i), 2R) = min(Υ·2L/Λ, 2R·n_i)/w``; the maximum
    over users is a public constant as long as the sizes are public.
    """
    sizes = [int(n) for n in sizes]
    w = len(sizes) if num_users is None else int(num_users)
    return max(n * sensitivity(kind, lam, R, c, n, group_size) for n in sizes) / w


def _positive(**values):
    for name, value in values.items():
        if not value > 0:
            raise ValueError(f"{name} must be > 0, got {value}")
