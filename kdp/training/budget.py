"""A DP model's privacy arithmetic: its per-step mechanism, planned releases,
and the ε of more epochs (pure accounting lives in `kdp.accounting`).

Mechanisms that run *alongside* training (adaptive clipping's quantile
releases) register a plan on the model's gate, so that budgets computed before
or during `fit` include their future cost. A plan is an object with
``planned_events(steps) -> [DpEvent]``: the releases it will make during the
next ``steps`` training steps (those already made are in the ledger).
"""

from kdp import accounting
from kdp.training.ledger import mechanism_event, training_mechanism
from kdp.training.objective import effective_noise_multiplier


def privacy_spec(model):
    """The per-step mechanism of ``model.fit``: ``{noise_multiplier, sampling_rate,
    sampling, steps_per_epoch, delta}``."""
    if model.dp_parameters is None or model.dataset_metadata is None:
        raise ValueError(f"{model.name}: pass dp_parameters= and dataset_metadata= to train it")
    md, sampling = model.dataset_metadata, model.dp_parameters.sampling
    # Shuffled batches of at most b records: a pass has at least ⌊N/b⌋ steps.
    steps_per_epoch = (md.steps_per_epoch if sampling == "poisson"
                       else max(1, md.nb_samples_train // md.batch_size))
    return {
        "noise_multiplier": effective_noise_multiplier(model),
        "sampling_rate": md.sampling_rate,
        "sampling": sampling,
        "steps_per_epoch": steps_per_epoch,
        "delta": model.dp_parameters.delta,
    }


def fit_mechanism(spec):
    """The ledger key of one `fit` step (Poisson or shuffled batches)."""
    return training_mechanism(spec["noise_multiplier"], spec["sampling_rate"], spec["sampling"],
                              spec["steps_per_epoch"])


def batch_mechanism(spec):
    """The ledger key of one step on a batch kdp did not sample (`train_on_batch`,
    a custom loop): the Gaussian mechanism without amplification (``q = 1``)."""
    return training_mechanism(spec["noise_multiplier"], 1.0, "poisson", None)


def register_release_plan(model, plan):
    """Make ``plan``'s future releases part of ``model``'s budget computations."""
    model.privacy_gate.plans[id(plan)] = plan


def unregister_release_plan(model, plan):
    model.privacy_gate.plans.pop(id(plan), None)


def planned_events(model, steps):
    """The events of every plan registered on ``model`` for ``steps`` more steps."""
    return model.privacy_gate.planned_events(steps)


def get_eps_delta(model, epochs, accountant="rdp"):
    """``(ε, δ)`` after ``epochs`` more epochs of ``model.fit`` (plus what it already spent)."""
    spec = privacy_spec(model)
    steps = int(epochs) * spec["steps_per_epoch"]
    events = (model.privacy_ledger.events() + planned_events(model, steps)
              + [mechanism_event(fit_mechanism(spec), steps)])
    return accounting.epsilon_of_events(events, spec["delta"], accountant), spec["delta"]


def calibrate_model_noise(model, target_epsilon, epochs, accountant="rdp"):
    """Set ``model.dp_parameters`` to a copy whose σ is the smallest with which
    ``epochs`` more epochs (after the ledger, with the planned releases) cost at
    most ``target_epsilon``; return that σ.

    Unlike `accounting.calibrate_noise_multiplier`, this accounts for the noise
    strategy: with ``"per-layer"`` noise a step is one Gaussian of
    ``σ_eff = r·σ`` (``r = (Σ_v c_v^-2)^(-1/2)``, public), so σ is the
    calibrated ``σ_eff / r``. The model must be built.
    """
    spec = privacy_spec(model)
    ratio = spec["noise_multiplier"] / model.dp_parameters.noise_multiplier
    steps = int(epochs) * spec["steps_per_epoch"]
    extra = model.privacy_ledger.events() + planned_events(model, steps)
    sigma_eff = accounting.calibrate_noise_multiplier(
        target_epsilon, spec["sampling_rate"], steps, spec["delta"], accountant,
        spec["sampling"], spec["steps_per_epoch"], extra)
    model.dp_parameters = model.dp_parameters.replace(noise_multiplier=sigma_eff / ratio)
    return model.dp_parameters.noise_multiplier


def get_max_epochs(epsilon_max, model, accountant="rdp", epochs_max=None):
    """Largest number of further epochs ``e`` with ε(e) ≤ epsilon_max < ε(e + 1)
    (at most ``epochs_max`` if given, lip-dp's argument).

    ε(e) includes the releases planned alongside training by plans registered on
    the model (`register_release_plan`; e.g. `AdaptiveQuantileClipping`, which
    registers itself in ``set_model``: call ``callback.set_model(model)`` first
    if the callback is not attached yet)."""
    spec = privacy_spec(model)
    mechanism = fit_mechanism(spec)
    steps = accounting.max_count(
        epsilon_max, spec["delta"], lambda n: [mechanism_event(mechanism, n)],
        model.privacy_ledger.events(), accountant, unit=spec["steps_per_epoch"],
        planned=(lambda n: planned_events(model, n)) if model.privacy_gate.plans else None)
    epochs = steps // spec["steps_per_epoch"]
    return epochs if epochs_max is None else min(epochs, int(epochs_max))
