"""A DP model's privacy arithmetic: its per-step mechanism, planned releases,
and the ε of more epochs (pure accounting lives in `kdp.privacy`).

Mechanisms that run *alongside* training (adaptive clipping's quantile
releases) register a plan on the model's gate, so that budgets computed before
or during `fit` include their future cost. A plan is an object with
``planned_events(steps) -> [DpEvent]``: the releases it will make during the
next ``steps`` training steps (those already made are in the ledger).

A model's accountant (``accountant=None`` below) is that of its persistent
budget, `PrivacyGate.accountant`: RDP, or what `make_private` chose (PLD by
default), so ε in the logs, the budget and the privacy statement agree.
"""

import math
import warnings

from kdp import privacy
from kdp.training.ledger import mechanism_event

#: Relative steps by which `make_private` raises σ when float rounding of
#: ``σ = σ_eff / r`` would let the last planned step exceed the budget.
_NUDGES = (0.0, 1e-12, 1e-9, 1e-6)


def privacy_spec(model):
    """The per-step mechanism of ``model.fit`` as a dict, from its `StepPlan`:
    ``{noise_multiplier (σ_eff), sampling_rate, sampling, steps_per_epoch, delta}``."""
    plan = model.step_plan()
    return {"noise_multiplier": plan.effective_noise_multiplier,
            "sampling_rate": plan.sampling_rate, "sampling": plan.sampling,
            "steps_per_epoch": plan.steps_per_epoch, "delta": plan.delta}


def register_release_plan(model, plan):
    """Make ``plan``'s future releases part of ``model``'s budget computations."""
    model.privacy_gate.plans[id(plan)] = plan


def unregister_release_plan(model, plan):
    model.privacy_gate.plans.pop(id(plan), None)


def planned_events(model, steps):
    """The events of every plan registered on ``model`` for ``steps`` more steps."""
    return model.privacy_gate.planned_events(steps)


def fit_events(model, epochs):
    """The releases of ``epochs`` more epochs of ``model.fit``: the noisy steps
    and what the registered plans release alongside them (not the ledger)."""
    plan = model.step_plan()
    steps = int(epochs) * plan.steps_per_epoch
    return planned_events(model, steps) + [mechanism_event(plan.fit_mechanism, steps)]


def fit_event(model, epochs):
    """`fit_events` as one `DpEvent`: e.g. the ``trial_event`` of a private
    hyper-parameter search (`kdp.tuning.private_search`)."""
    import dp_accounting

    return dp_accounting.ComposedDpEvent(fit_events(model, epochs))


def get_eps_delta(model, epochs, accountant=None):
    """``(ε, δ)`` after ``epochs`` more epochs of ``model.fit`` (plus what it already
    spent), with ``accountant`` (``None``: the model's)."""
    events = model.privacy_ledger.events() + fit_events(model, epochs)
    plan = model.step_plan()
    accountant = model.privacy_gate.accountant_for(events, accountant)
    return privacy.epsilon_of_events(events, plan.delta, accountant, plan.neighboring), plan.delta


def calibrate_model_noise(model, target_epsilon, epochs, accountant=None):
    """Set ``model.dp_parameters`` to a copy whose σ is the smallest with which
    ``epochs`` more epochs (after the ledger, with the planned releases) cost at
    most ``target_epsilon`` with ``accountant`` (``None``: the model's); return that σ.

    Unlike `kdp.privacy.calibrate_noise_multiplier`, this accounts for the noise
    strategy: with ``"per-layer"`` noise a step is one Gaussian of
    ``σ_eff = r·σ`` (``r = (Σ_v c_v^-2)^(-1/2)``, public), so σ is the
    calibrated ``σ_eff / r``. The model must be built.
    """
    plan = model.step_plan()
    ratio = plan.effective_noise_multiplier / plan.noise_multiplier
    steps = int(epochs) * plan.steps_per_epoch
    extra = model.privacy_ledger.events() + planned_events(model, steps)
    accountant = model.privacy_gate.accountant_for(
        extra + [mechanism_event(plan.fit_mechanism, steps)], accountant)
    sigma_eff = privacy.calibrate_noise_multiplier(
        target_epsilon, plan.sampling_rate, steps, plan.delta, accountant,
        plan.sampling, plan.steps_per_epoch, extra, plan.neighboring)
    model.dp_parameters = model.dp_parameters.replace(noise_multiplier=sigma_eff / ratio)
    return model.dp_parameters.noise_multiplier


def get_max_epochs(epsilon_max, model, accountant=None, epochs_max=None, *, safe=True,
                   atol=None):
    """Largest number of further epochs ``e`` with ε(e) ≤ epsilon_max < ε(e + 1)
    (at most ``epochs_max`` if given, lip-dp's argument: pass it by keyword), ε by
    ``accountant`` (``None``: the model's).

    ε(e) includes the releases planned alongside training by plans registered on
    the model (`register_release_plan`; e.g. `AdaptiveQuantileClipping`, which
    registers itself in ``set_model``: call ``callback.set_model(model)`` first
    if the callback is not attached yet).

    lip-dp's ``safe=True`` is what kdp does; ``safe=False`` and ``atol`` are refused."""
    if accountant is not None and not isinstance(accountant, str):
        raise TypeError(
            f"get_max_epochs' third positional argument is the accountant, got {accountant!r}: "
            f"pass lip-dp's epochs_max by keyword, get_max_epochs(epsilon_max, model, "
            f"epochs_max={accountant!r})")
    if not safe:
        raise ValueError("safe=False (lip-dp's smallest e with ε(e) >= epsilon_max, which can "
                         "exceed the budget) is not provided: kdp always returns lip-dp's "
                         "safe=True epochs")
    if atol is not None:
        raise TypeError("get_max_epochs takes no atol: kdp's search is exact (the largest e "
                        "with ε(e) <= epsilon_max, by bisection on whole epochs); drop atol")
    plan = model.step_plan()
    mechanism = plan.fit_mechanism
    spent = model.privacy_ledger.events()
    accountant = model.privacy_gate.accountant_for(spent + fit_events(model, 1), accountant)
    steps = privacy.max_count(
        epsilon_max, plan.delta, lambda n: [mechanism_event(mechanism, n)], spent, accountant,
        unit=plan.steps_per_epoch,
        planned=(lambda n: planned_events(model, n)) if model.privacy_gate.plans else None,
        neighboring=plan.neighboring)
    epochs = steps // plan.steps_per_epoch
    return epochs if epochs_max is None else min(epochs, int(epochs_max))


def make_private(model, target_epsilon, epochs, delta=None, accountant="tightest"):
    """Privacy in one call: calibrate ``model`` so that ``epochs`` more epochs of
    `fit` reach at most ``target_epsilon`` at ``delta`` with ``accountant``, and make
    that target the model's budget, enforced with the same accountant.

    σ is calibrated for the model's own mechanism (`calibrate_model_noise`):
    per-layer noise as its equivalent ``σ_eff``, per-example clipping, Poisson or
    shuffled batches, the releases planned alongside training (adaptive
    clipping: attach it first with ``callback.set_model(model)``) and what the
    ledger already holds. ``epsilon_max`` is set to ``target_epsilon`` and the
    model's accountant (`PrivacyGate.accountant`, saved with the model) to
    ``accountant``, so ε in the logs, the budget and the privacy statement agree,
    and `fit` runs exactly ``epochs`` epochs before the budget stops it.

    The default, the smaller of PLD and RDP (both dp-accounting's upper bounds
    on ε; PLD on a grid refined at small ε), gives the smallest σ; where PLD
    cannot account a release (`kdp.privacy.pld_unsupported`: a private
    hyper-parameter search, sampling without replacement) it is RDP's. Asked for
    PLD alone on such a ledger or planned releases, RDP is used instead, with a
    warning rather than an error (RDP bounds ε as well).

    Args:
        model: a DP model with `dp_parameters` and `dataset_metadata` (built, or
            buildable from ``dataset_metadata.input_shape``).
        target_epsilon: ε > 0 to reach after ``epochs`` epochs.
        epochs: the number of epochs the user will pass to `fit`.
        delta: the δ (default: ``dp_parameters.delta``), below ``1/N``.
        accountant: ``"tightest"`` (default), ``"pld"`` or ``"rdp"``.

    Returns:
        The calibrated σ (``model.dp_parameters.noise_multiplier``).

    Warns:
        UserWarning: PLD was asked for but cannot account the ledger (RDP used).

    Raises:
        ValueError: a non-positive target or number of epochs, an unknown
            accountant, or a target that no σ can reach (the ledger or the planned
            releases already cost it).
    """
    if not (target_epsilon > 0 and math.isfinite(target_epsilon)):
        raise ValueError(f"target_epsilon must be a finite number > 0, got {target_epsilon}")
    if int(epochs) != epochs or epochs < 1:
        raise ValueError(f"epochs must be a whole number >= 1, got {epochs}")
    privacy.check_accountant(accountant)
    if model.dp_parameters is None or model.dataset_metadata is None:
        raise ValueError(f"{model.name}: pass dp_parameters= and dataset_metadata= first")
    gate = model.privacy_gate
    before = model.dp_parameters, gate.accountant
    try:
        return _make_private(model, target_epsilon, epochs, delta, accountant)
    except BaseException:
        model.dp_parameters, gate.accountant = before  # a refusal changes nothing
        raise


def _make_private(model, target_epsilon, epochs, delta, accountant):
    if delta is not None:
        model.dp_parameters = model.dp_parameters.replace(delta=delta)
    model.check_delta()
    plan = model.step_plan()
    steps = int(epochs) * plan.steps_per_epoch
    fixed = model.privacy_ledger.events() + planned_events(model, steps)
    accountant = _usable_accountant(
        model, accountant, fixed + [mechanism_event(plan.fit_mechanism, steps)], plan.neighboring)
    floor = privacy.epsilon_of_events(fixed, plan.delta, accountant, plan.neighboring) if fixed else 0.0
    if floor >= target_epsilon:
        raise ValueError(
            f"target_epsilon={target_epsilon:g} is unreachable at δ={plan.delta:g}: "
            f"{_describe_fixed(model)} already cost ε={floor:.4g} whatever the training noise. "
            "Raise the target, or use fewer (or noisier) planned releases, or a fresh ledger "
            "if this is a new dataset.")
    model.privacy_gate.accountant = accountant
    sigma = calibrate_model_noise(model, target_epsilon, epochs, accountant)
    for nudge in _NUDGES:
        model.dp_parameters = model.dp_parameters.replace(
            noise_multiplier=sigma * (1 + nudge), epsilon_max=target_epsilon)
        if model.privacy_gate.remaining(model.step_plan().fit_mechanism) >= steps:
            return model.dp_parameters.noise_multiplier
    raise RuntimeError(f"{model.name}: calibrated σ={sigma:.6g} does not fit the budget it was "
                       "calibrated for (please report this)")


def _usable_accountant(model, accountant, events, neighboring):
    """``accountant``, or RDP (with a warning) where it is PLD and ``events`` hold
    one that PLD cannot account."""
    unsupported = privacy.pld_unsupported(events, neighboring) if accountant == "pld" else []
    if not unsupported:
        return accountant
    names = ", ".join(sorted({type(event).__name__ for event in unsupported}))
    warnings.warn(
        f"{model.name}: make_private calibrates σ and enforces the budget with the RDP "
        f"accountant, not PLD: dp-accounting's PLD accountant cannot account the {names} in "
        "the ledger or the planned releases (e.g. a private hyper-parameter search of "
        "kdp.tuning.private_search). Pass accountant='rdp' to choose RDP explicitly.",
        stacklevel=5)  # the caller of model.make_private
    return "rdp"


def _describe_fixed(model):
    spent = model.privacy_ledger.training_steps()
    plans = ", ".join(type(p).__name__ for p in model.privacy_gate.plans.values())
    parts = ([f"the {spent} steps already in the ledger"] if spent else []) + (
        [f"the releases planned by {plans}"] if plans else [])
    return " and ".join(parts) or "the ledger's releases"


def default_noise_warning(model, mechanism, epochs, steps, budgeted):
    """A warning text for the first `fit` of a model whose σ nobody chose (the
    `DPParameters` default, no `make_private`) and that no budget limits: the ε
    its ``steps`` planned steps of ``mechanism`` (``epochs`` epochs) will cost,
    and how to choose σ; else ``None``."""
    params = model.dp_parameters
    if not params.noise_multiplier_is_default or budgeted or getattr(model, "_default_noise_warned",
                                                                     False):
        return None
    model._default_noise_warned = True
    plan = model.step_plan()
    events = (model.privacy_ledger.events() + planned_events(model, steps)
              + [mechanism_event(mechanism, steps)])
    eps = privacy.epsilon_of_events(events, plan.delta, model.privacy_gate.accountant_for(events),
                                    plan.neighboring)
    sigma, sigma_eff = params.noise_multiplier, plan.effective_noise_multiplier
    per_layer = (f" (one Gaussian of σ_eff={sigma_eff:.3g} per step, by its per-layer noise)"
                 if abs(sigma_eff - sigma) > 1e-9 * sigma else "")
    return (
        f"{model.name}: no noise multiplier was chosen, so fit trains with the default "
        f"σ={sigma:g}{per_layer} and no privacy budget: {epochs} epoch{'s' * (epochs != 1)} "
        f"({steps} steps) will cost ε={eps:.3g} (δ={plan.delta:g}). Choose the privacy level with "
        "model.make_private(target_epsilon=..., epochs=...), or σ with "
        "DPParameters(noise_multiplier=...) (and a budget with epsilon_max=...).")


def plain_calibration_warning(model):
    """A warning text if σ came from `kdp.privacy.calibrate_noise_multiplier` (one
    Gaussian of multiplier σ per step) but the model adds less noise than that
    (per-layer noise: one Gaussian of ``σ_eff < σ``), else ``None``."""
    sigma = model.dp_parameters.noise_multiplier  # the object: it may carry its calibration
    calibration = getattr(sigma, "calibration", None)
    if calibration is None:
        return None
    sigma_eff = model.step_plan().effective_noise_multiplier
    if sigma_eff >= sigma * (1 - 1e-9):
        return None
    c = calibration
    args = (c["sampling_rate"], c["steps"], c["delta"], c["accountant"], c["sampling"],
            c["steps_per_epoch"], c["neighboring"])
    planned = privacy.compute_epsilon(float(sigma), *args)
    actual = privacy.compute_epsilon(sigma_eff, *args)
    return (
        f"{model.name}: noise_multiplier={sigma:.4g} was calibrated for ε={c['target_epsilon']:g} "
        f"as one Gaussian of multiplier σ per step, but this model's per-layer noise makes each "
        f"step one Gaussian of σ_eff={sigma_eff:.4g}: those {c['steps']} steps cost "
        f"ε={actual:.3g}, not {planned:.3g}. Calibrate for the model's own noise with "
        "model.make_private(target_epsilon=..., epochs=...) (or use noisify_strategy='global').")
