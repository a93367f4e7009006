"""Private hyper-parameter search: the best of a random number of trials, with
its cost in the privacy ledger (Papernot and Steinke 2022, *Hyperparameter
Tuning with Renyi Differential Privacy*, ICLR).

Picking the best of several trainings by a score computed on private data
leaks through the choice; running a fixed number ``k`` of trials and composing
them costs ``k`` times one trial. Papernot and Steinke show that if the number
of trials ``K`` is itself random (truncated negative binomial, Theorem 2;
Poisson, Theorem 6) and only the best trial's output (model and score) is
released, the whole search costs about a constant factor more than one trial
in RDP, whatever the ``K`` drawn. dp-accounting implements both theorems as
``RepeatAndSelectDpEvent(event, mean, shape)``; `private_search` runs the
search, checks that every trial stayed within the declared per-trial
mechanism, and writes one such event into the winner's ledger, where it
composes with everything else the ledger holds (RDP accountant only).

What a trial may vary: anything whose privacy cost stays within the declared
``trial_event`` (learning rate, τ, width, depth, loss, loss-gradient clipping,
architecture at a fixed σ, q and number of steps). Candidates with different
mechanisms are covered by declaring their composition
(``dp_accounting.ComposedDpEvent``), which is valid but loose.
"""

import math

import dp_accounting
import numpy as np

from kdp import privacy
from kdp._quiet import quiet_dp_accounting
from kdp.training.ledger import PrivacyLedger, event_mechanism, new_run_id
from kdp.training.seeds import numpy_generator

#: number-of-trials distribution -> dp-accounting's ``shape`` (``None``: the user's η)
DISTRIBUTIONS = {"truncated_negative_binomial": None, "geometric": 1.0, "logarithmic": 0.0,
                 "poisson": math.inf}

#: relative slack of the per-trial domination check (float rounding of RDP curves)
_RDP_SLACK = 1e-9


class TrialBudgetError(RuntimeError):
    """A trial spent more than the declared per-trial mechanism.

    The search's theorem does not apply then; ``ledger`` holds the honest
    account of what ran: the prior ledger composed with every trial run so far
    (sequential composition, valid whatever the trials did).
    """

    def __init__(self, message, ledger):
        super().__init__(message)
        self.ledger = ledger


class SearchResult:
    """The output of `private_search`: only what the theorem lets one release.

    Attributes:
        model: the best trial's model (``None`` if ``K = 0``, possible with the
            Poisson distribution), whose ``privacy_ledger`` now holds the prior
            ledger and the search's event (its own trial entries are inside it).
        score: the best trial's score (the noisy accuracy for a private score).
        candidate: the best trial's candidate.
        ledger: the ledger of the whole search (the same as ``model.privacy_ledger``).
        event: the search's ``RepeatAndSelectDpEvent``.
        trials: the number of trials run (``K``). Releasing it is covered: it
            is data-independent.
    """

    def __init__(self, model, score, candidate, ledger, event, trials):
        self.model, self.score, self.candidate = model, score, candidate
        self.ledger, self.event, self.trials = ledger, event, trials

    def epsilon(self, delta):
        """ε at ``delta`` of the ledger (prior releases and the search), RDP."""
        return privacy.epsilon_of_events(self.ledger.events(), delta)

    def __repr__(self):
        return (f"SearchResult(trials={self.trials}, score={self.score!r}, "
                f"candidate={self.candidate!r})")


def selection_event(trial_event, mean_trials, distribution="geometric", eta=None):
    """The `DpEvent` of releasing the best of ``K`` trials, each bounded by ``trial_event``.

    Args:
        trial_event: a `dp_accounting.DpEvent` bounding one trial (its training
            and the release of its score).
        mean_trials: ``E[K] >= 1``.
        distribution: ``"truncated_negative_binomial"`` (with ``eta``, Theorem 2),
            ``"geometric"`` (η = 1), ``"logarithmic"`` (η = 0) or ``"poisson"``
            (Theorem 6).
        eta: the shape η ≥ 0 of the truncated negative binomial.

    Returns:
        ``dp_accounting.RepeatAndSelectDpEvent(trial_event, mean_trials, shape)``.
    """
    return dp_accounting.dp_event.RepeatAndSelectDpEvent(
        trial_event, float(_check_mean(mean_trials)), _shape(distribution, eta))


def sample_number_of_trials(mean_trials, distribution="geometric", eta=None,
                            rng=None):
    """Draw ``K``: Poisson(mean), or the truncated negative binomial
    ``P(K = k) ∝ (1 - γ)^k C(k + η - 1, k)``, ``k ≥ 1`` (logarithmic ``∝ (1 - γ)^k / k``
    for η = 0), with γ set so that ``E[K] = mean_trials`` (Papernot and Steinke 2022, §2).

    ``rng``: a NumPy ``Generator`` (default: seeded from the OS entropy).
    """
    mean = _check_mean(mean_trials)
    shape = _shape(distribution, eta)
    rng = numpy_generator() if rng is None else rng
    if shape == math.inf:
        return int(rng.poisson(mean))
    if mean == 1.0:
        return 1
    gamma = tnb_gamma(shape, mean)
    if shape == 0.0:
        return int(rng.logseries(1.0 - gamma))
    while True:  # the negative binomial conditioned on K >= 1
        k = int(rng.negative_binomial(shape, gamma))
        if k >= 1:
            return k


def tnb_mean(eta, gamma):
    """``E[K]`` of the truncated negative binomial (η, γ): ``η(1-γ) / (γ(1-γ^η))``,
    and ``(1-γ) / (γ log(1/γ))`` for η = 0 (Papernot and Steinke 2022, §2)."""
    if not 0 < gamma < 1:
        raise ValueError(f"gamma must be in (0, 1), got {gamma}")
    if eta == 0:
        return (1 - gamma) / (gamma * math.log(1 / gamma))
    return eta * (1 - gamma) / (gamma * (1 - gamma**eta))


def tnb_gamma(eta, mean):
    """The γ whose truncated negative binomial of shape ``eta`` has mean ``mean > 1``
    (bisection on the decreasing `tnb_mean`)."""
    if not mean > 1:
        raise ValueError(f"mean must be > 1 to solve for gamma, got {mean}")
    lo, hi = 1e-12, 1.0 - 1e-12
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if tnb_mean(eta, mid) > mean else (lo, mid)
    return 0.5 * (lo + hi)


@quiet_dp_accounting()
def calibrate_trial_noise(target_epsilon, delta, sampling_rate, steps, mean_trials,
                          distribution="geometric", eta=None, score_noise_multiplier=None):
    """The smallest training σ (to 1e-4) with which the whole search (a random number
    of trials, each ``steps`` Poisson-sampled Gaussian steps of rate
    ``sampling_rate`` and, if given, a score released with
    ``score_noise_multiplier``) costs at most ``target_epsilon`` at ``delta`` (RDP).

    Use it when every candidate shares (q, steps): the trials then share one
    mechanism, and ``accounting.training_event(σ, q, steps)`` is their ``trial_event``.
    """
    def search_event(sigma):
        trial = privacy.training_event(sigma, sampling_rate, steps)
        return selection_event(_with_score(trial, score_noise_multiplier), mean_trials,
                               distribution, eta)

    if score_noise_multiplier is not None:
        scores = selection_event(dp_accounting.GaussianDpEvent(float(score_noise_multiplier)),
                                 mean_trials, distribution, eta)
        floor = privacy.epsilon_of_events([scores], delta)
        if floor >= target_epsilon:
            raise ValueError(f"target_epsilon={target_epsilon:g} is unreachable: the scores "
                             f"alone cost ε={floor:.3g}; raise score_noise_multiplier or "
                             "the target")
    return dp_accounting.calibrate_dp_mechanism(
        dp_accounting.rdp.RdpAccountant, search_event, target_epsilon, delta,
        dp_accounting.LowerEndpointAndGuess(1e-2, 1.0), tol=1e-4)


def noisy_accuracy(model, x, y, noise_multiplier, rng=None, batch_size=512):
    """``(correct + N(0, σ²)) / len(x)``: the accuracy of ``model`` on a private
    validation split, released with Gaussian noise on the count of correct
    predictions (sensitivity 1 under add/remove-one). Its cost is
    ``GaussianDpEvent(noise_multiplier)``; `private_search` composes it into
    every trial. ``len(x)`` is treated as public, as kdp treats N."""
    logits = np.asarray(model.predict(x, batch_size=batch_size, verbose=0))
    labels = np.asarray(y).reshape(len(x), -1)
    labels = labels.argmax(-1) if labels.shape[1] > 1 else labels[:, 0]
    correct = float(np.sum(logits.argmax(-1) == labels))
    rng = numpy_generator() if rng is None else rng
    return (correct + float(rng.normal(0.0, noise_multiplier))) / len(x)


def private_search(train_trial, candidates, trial_event, *, mean_trials,
                   distribution="geometric", eta=None,
                   validation_data=None, score_noise_multiplier=None, public_score=None,
                   prior_ledger=None, rng=None):
    """Run a random number of trials and release only the best (Papernot and Steinke 2022).

    Each trial draws a candidate uniformly from ``candidates``, calls
    ``train_trial(candidate)``, which builds and trains a fresh DP model and
    returns it, and scores it. The best-scoring model is returned; its ledger
    is replaced by ``prior_ledger`` plus one `selection_event`, so ``ε`` of the
    model includes the search and composes with every other release made on
    the same data.

    Args:
        train_trial: ``candidate -> model``, a kdp DP model trained from scratch
            on the private data (its ``privacy_ledger`` holds that training only).
        candidates: a non-empty sequence of candidates (any objects).
        trial_event: a `dp_accounting.DpEvent` bounding the *training* of every
            candidate, declared before the search (e.g.
            ``kdp.training.budget.fit_event(model, epochs)`` of one candidate when
            they share σ, q and steps). Each trial's ledger is checked against it
            at every RDP order; a trial above it stops the search with
            `TrialBudgetError`.
        mean_trials: ``E[K] >= 1``.
        distribution, eta: the law of ``K`` (see `selection_event`).
        validation_data: ``(x_val, y_val)``, a private split disjoint from the
            training data: the score is `noisy_accuracy` with
            ``score_noise_multiplier``, whose Gaussian release is composed into
            every trial's event.
        score_noise_multiplier: σ of the score's noise (with ``validation_data``).
        public_score: ``model -> float`` computed on **public** data only (it is
            not accounted); instead of ``validation_data``.
        prior_ledger: the ledger of releases already made on the same data.
        rng: a NumPy ``Generator`` for ``K``, the candidates and the score noise
            (default: seeded from the OS entropy; pass one in tests only).

    Returns:
        A `SearchResult`.

    Raises:
        ValueError: bad arguments (before any trial runs).
        TrialBudgetError: a trial's ledger exceeded ``trial_event``.
    """
    candidates = list(candidates)
    if not candidates:
        raise ValueError("candidates must hold at least one candidate")
    if not isinstance(trial_event, dp_accounting.DpEvent):
        raise TypeError(f"trial_event must be a dp_accounting.DpEvent, got {trial_event!r}")
    if (validation_data is None) == (public_score is None):
        raise ValueError("pass exactly one score: validation_data= with score_noise_multiplier= "
                         "(a private split, accounted), or public_score= (public data only)")
    if validation_data is not None and not (score_noise_multiplier or 0) > 0:
        raise ValueError("a private validation split needs score_noise_multiplier > 0 (the "
                         "score is a release: without noise it is not differentially private)")
    if public_score is not None and score_noise_multiplier is not None:
        raise ValueError("score_noise_multiplier applies to validation_data only")
    prior = prior_ledger if prior_ledger is not None else PrivacyLedger()
    per_trial = _with_score(trial_event,
                            score_noise_multiplier if validation_data is not None else None)
    event = selection_event(per_trial, mean_trials, distribution, eta)
    bound = privacy.rdp_curve([trial_event])
    rng = numpy_generator() if rng is None else rng
    trials = sample_number_of_trials(mean_trials, distribution, eta, rng)

    best, ran = None, PrivacyLedger()
    for _ in range(trials):
        candidate = candidates[int(rng.integers(len(candidates)))]
        model = train_trial(candidate)
        ledger = getattr(model, "privacy_ledger", None)
        if not isinstance(ledger, PrivacyLedger):
            raise TypeError(f"train_trial must return a kdp DP model, got {model!r}")
        ran = ran.merge(ledger)
        curve = privacy.rdp_curve(ledger.events())
        if np.any(curve > bound * (1 + _RDP_SLACK) + 1e-12):
            worst = int(np.argmax(curve - bound))
            raise TrialBudgetError(
                f"a trial (candidate {candidate!r}) spent more than the declared trial_event "
                f"(RDP at order {privacy.RDP_ORDERS[worst]:g}: {curve[worst]:.4g} > "
                f"{bound[worst]:.4g}), so the search's theorem does not "
                "apply. error.ledger composes every trial run so far with the prior ledger "
                "(the honest account). Declare a trial_event that bounds every candidate.",
                prior.merge(ran))
        if validation_data is not None:
            score = noisy_accuracy(model, *validation_data, score_noise_multiplier, rng)
        else:
            score = float(public_score(model))
        if best is None or score > best[0]:
            best = (score, candidate, model)

    ledger = PrivacyLedger(prior.entries)
    ledger.record(event_mechanism(event), 1, new_run_id())
    if best is None:
        return SearchResult(None, None, None, ledger, event, trials)
    score, candidate, model = best
    model.privacy_ledger = ledger
    return SearchResult(model, score, candidate, ledger, event, trials)


def _with_score(trial_event, score_noise_multiplier):
    """One trial's event: its training, composed with the Gaussian release of its
    score when the score is private (``score_noise_multiplier`` not None)."""
    if score_noise_multiplier is None:
        return trial_event
    return dp_accounting.ComposedDpEvent(
        [trial_event, dp_accounting.GaussianDpEvent(float(score_noise_multiplier))])


def _check_mean(mean_trials):
    mean = float(mean_trials)
    if not (mean >= 1 and math.isfinite(mean)):
        raise ValueError(f"mean_trials must be a finite number >= 1, got {mean_trials}")
    return mean


def _shape(distribution, eta):
    if distribution not in DISTRIBUTIONS:
        raise ValueError(f"distribution must be one of {sorted(DISTRIBUTIONS)}, "
                         f"got {distribution!r}")
    shape = DISTRIBUTIONS[distribution]
    if shape is None:
        if eta is None or not (eta >= 0 and math.isfinite(eta)):
            raise ValueError("the truncated negative binomial needs eta >= 0 (finite); "
                             f"got {eta!r}")
        return float(eta)
    if eta is not None:
        raise ValueError(f"eta applies to the truncated negative binomial only, not {distribution!r}")
    return shape
