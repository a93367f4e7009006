"""A DP model's privacy statement: a text for a model card (in the spirit of
TensorFlow Privacy's ``compute_dp_sgd_privacy_statement``).

It states what the guarantee is about (mechanism, adjacency, sampling), which
facts it treats as public (N and what is derived from it, the architecture,
the hyper-parameters, the declared bounds), what the ledger holds (steps and
other releases), ε at the model's δ and at two smaller δ, ε under replace-one
adjacency (where N must stay private), and what the guarantee does **not**
cover.
"""

from collections import Counter

import dp_accounting

from kdp import privacy

#: The two other δ of the statement, as fractions of the model's δ.
OTHER_DELTAS = (0.1, 0.01)

NOT_COVERED = (
    "hyper-parameter search and model selection on the private data, unless made with "
    "kdp.tuning.private_search (whose cost is then in the ledger, listed above)",
    "preprocessing that uses statistics of the private data (kdp's loaders use none)",
    "the training loss and metrics logged by fit (computed on private batches without "
    "noise) and any evaluation on private data",
    "releases made with another model or ledger not merged into this one",
    "floating-point and timing side channels of the Gaussian sampler (the guarantee is "
    "for idealised real-valued Gaussian noise)",
)


def privacy_statement(model, accountant=None):
    """The privacy statement of ``model`` (see the module docstring).

    Args:
        model: a DP model with `dp_parameters` and `dataset_metadata`.
        accountant: one of `kdp.privacy.ACCOUNTANTS` for the ε values; ``None`` (default):
            the model's, that of its budget (`PrivacyGate.accountant_for`).

    Returns:
        A multi-line string.
    """
    params, md = model.dp_parameters, model.dataset_metadata
    if params is None or md is None:
        raise ValueError(f"{model.name}: pass dp_parameters= and dataset_metadata= first")
    ledger = model.privacy_ledger
    events = ledger.events()
    lines = [f"Differential privacy statement for {model.name} (kdp)", "",
             "Mechanism: " + _mechanism(model), "",
             "Adjacency: " + _adjacency(ledger, params.sampling), "",
             "Sampling: " + _sampling(md, params.sampling), "",
             "Public facts: " + _public_facts(md), "",
             "Releases in the privacy ledger: " + _releases(ledger), ""]
    if events:
        delta = params.delta
        gate = model.privacy_gate
        accountant = gate.accountant_for(events, accountant)
        lines.append(f"Privacy spent ({privacy.accountant_name(accountant)}):")
        for d in (delta,) + tuple(delta * f for f in OTHER_DELTAS):
            eps = privacy.epsilon_of_events(events, d, accountant, gate.neighboring)
            note = " (the model's δ)" if d == delta else ""
            lines.append(f"  ε = {eps:.4g} at δ = {d:.3g}{note}")
        if gate.neighboring == privacy.ADD_OR_REMOVE_ONE:
            lines.append(_replace_one(events, delta))
    else:
        lines.append("Privacy spent: nothing yet (ε = 0): no private release was made.")
    lines += ["", "Not covered by this guarantee:"] + [f"  - {item}" for item in NOT_COVERED]
    return "\n".join(lines)


def _mechanism(model):
    plan = model.step_plan()
    sigma, b = plan.noise_multiplier, plan.batch_size
    if plan.clipping_norm is not None:
        params = model.dp_parameters
        return (f"DP-SGD with per-example gradient clipping ({params.clipping}, C = "
                f"{params.clipping_norm}) and Gaussian noise of std σ·C/b on the clipped sum, "
                f"σ = {sigma:.4g}, b = {b} (Abadi et al. 2016).")
    text = ("Clipless DP-SGD (Béthune et al. 2024): Lipschitz layers bound every example's "
            "gradient norm analytically (no clipping); the gradient of the loss summed over "
            f"the batch and divided by b = {b} gets Gaussian noise of std σ·Δ/b, "
            f"σ = {sigma:.4g}")
    if plan.noisify_strategy == "per-layer" and model.built:
        text += (f", one draw per variable (per-layer noise, equivalent to one Gaussian of "
                 f"multiplier σ_eff = {plan.effective_noise_multiplier:.4g})")
    return text + "."


def _adjacency(ledger, sampling):
    shuffled = sampling == "shuffle" or any(e.get("sampling") == "shuffle"
                                            for e in ledger.entries)
    text = ("add or remove one record (one training example); a person with several "
            "records is protected only as far as the group's ε (group privacy)")
    if shuffled:
        text += ("; shuffled batches are accounted under replace-one adjacency "
                 "(sensitivity doubled), one Gaussian release per pass")
    return text + "."


def _public_facts(md):
    return (f"the number of training records N = {md.nb_samples_train} and what is derived "
            "from it (q = b/N, the expected batch size b, δ, the steps of a pass), the "
            "architecture, the hyper-parameters and the declared input bound (max_norm = "
            f"{md.max_norm}) and feature ranges are treated as public: they are released "
            "without noise (in the saved model's config and in this statement), so none may "
            "be a statistic of the private records (kdp's loaders and recipes use none). "
            "Add/remove-one neighbours differ in N, so the ε below holds for an observer who "
            "already knows N; where N must stay private, use the replace-one ε (neighbours of "
            "the same size), given with it.")


def _replace_one(events, delta):
    """The line giving ε under replace-one adjacency (PLD), or saying why it cannot."""
    unsupported = privacy.pld_unsupported(events, privacy.REPLACE_ONE)
    if unsupported:
        return ("  Under replace-one adjacency (N kept private): not computed; dp-accounting "
                f"accounts a {type(unsupported[0]).__name__} under it in neither PLD nor, with "
                "Poisson sampling, RDP.")
    eps = privacy.epsilon_of_events(events, delta, "pld", privacy.REPLACE_ONE)
    note = ("; a release without sampling is counted at twice its sensitivity, so this "
            "over-states it" if any(_unsampled_gaussian(e) for e in events) else "")
    return (f"  Under replace-one adjacency (N kept private): ε = {eps:.4g} at the model's δ "
            f"(privacy-loss distributions{note}).")


def _unsampled_gaussian(event):
    """Whether ``event`` holds a Gaussian release outside a Poisson sample."""
    while isinstance(event, dp_accounting.SelfComposedDpEvent):
        event = event.event
    if isinstance(event, dp_accounting.ComposedDpEvent):
        return any(_unsampled_gaussian(e) for e in event.events)
    return isinstance(event, dp_accounting.GaussianDpEvent)


def _sampling(md, sampling):
    n, b = md.nb_samples_train, md.batch_size
    if sampling == "poisson":
        return (f"Poisson: each step includes every one of the N = {n} records independently "
                f"with probability q = b/N = {b}/{n} = {b / n:.4g} (amplification by "
                "subsampling).")
    return (f"shuffled fixed-size batches of at most b = {b} of the N = {n} records (no "
            "amplification): drawn by kdp from arrays or a kdp.RecordSource, each record at "
            "most once per pass; from a dataset or generator, one Gaussian release per step "
            "(any record may be in every step, at most once per batch).")


def _releases(ledger):
    if not ledger.entries:
        return "none."
    parts = []
    steps = Counter()
    for e in ledger.entries:
        if e["kind"] == "training":
            steps[(e["noise_multiplier"], e["sampling_rate"], e["sampling"])] += e["count"]
    for (sigma, q, sampling), count in steps.items():
        kind = ("without amplification (a batch kdp did not sample)" if q == 1.0
                else f"{sampling}, q = {q:.4g}")
        parts.append(f"{count} noisy gradient steps (σ_eff = {sigma:.4g}, {kind})")
    if ledger.releases("quantile"):
        parts.append(f"{ledger.releases('quantile')} private quantile releases "
                     "(adaptive clipping, Andrew et al. 2021)")
    selections = [e for e in ledger.entries
                  if e["kind"] == "event" and e["event"]["class_name"] == "RepeatAndSelectDpEvent"]
    for e in selections:
        shape = e["event"]["shape"]
        law = ("Poisson" if shape == float("inf") else
               f"truncated negative binomial, η = {shape:g}")
        parts.append(f"a private hyper-parameter search: the best of a random number of trials "
                     f"(mean {e['event']['mean']:g}, {law}; Papernot and Steinke 2022), "
                     "each trial's training and score inside it")
    gaussians = Counter()
    for e in ledger.entries:
        if e["kind"] == "event" and e["event"]["class_name"] == "GaussianDpEvent":
            gaussians[e["event"]["noise_multiplier"]] += e["count"]
    for sigma, count in gaussians.items():
        parts.append(f"{count} Gaussian release(s) without sampling (σ = {sigma:.4g}, e.g. a "
                     "private calibration's counts)")
    others = (ledger.releases("event") - sum(e["count"] for e in selections)
              - sum(gaussians.values()))
    if others:
        parts.append(f"{others} other releases (dp-accounting events)")
    return "; ".join(parts) + f"; in {len(ledger.runs())} run(s), composed."
