"""The checks a DP model passes before its step is compiled: a configuration
that would not be DP as claimed is refused with a clear error, before anything
is spent (DP layers with sound bounds, a loss with `get_L()`, ``δ < 1/N``, an
output per class, a training forward pass that writes no variable and adds no
loss term: `kdp.admission`)."""

import numpy as np

from kdp import admission, clipping
from kdp.bounds import BoundError, compute_gradient_bounds, loss_lipschitz
from kdp.training.validation import output_width


def require_dp_config(model):
    """Raise unless ``model`` has ``dp_parameters`` and ``dataset_metadata``."""
    if model.dp_parameters is None or model.dataset_metadata is None:
        raise ValueError(f"{model.name}: pass dp_parameters= and dataset_metadata= to train it")


def check_dp(model):
    """Raise a clear error if training ``model`` would not be DP as claimed; return
    its per-example gradient bounds (Clipless) or the clipping check's result."""
    check_delta(model)
    if model.optimizer is None or model.loss is None:
        raise ValueError(f"{model.name}: compile the model with a kdp loss first")
    check_output_width(model)
    if model.dp_parameters.clipping_norm is not None:
        return clipping.check_model(model)
    loss_lipschitz(model.loss)
    if getattr(model.optimizer, "use_ema", False) and model.optimizer.ema_overwrite_frequency:
        raise BoundError(
            f"{model.name}: ema_overwrite_frequency={model.optimizer.ema_overwrite_frequency} "
            "would train on averages of unprojected weights, outside the sets the gradient bounds "
            "assume. Keep ema_overwrite_frequency=None: fit then ends on the average, projected "
            "again.")
    bounds = compute_gradient_bounds(model)
    bad = {p: b for p, b in bounds.items() if not (b >= 0 and np.isfinite(b))}
    if bad:
        raise BoundError(f"non-finite gradient bounds: {bad}")
    admission.check_forward_pass(model)
    return bounds


def check_delta(model):
    """Refuse ``δ ≥ 1/N`` (unless ``allow_large_delta``): such a δ allows
    releasing a record in the clear."""
    require_dp_config(model)
    n = model.dataset_metadata.nb_samples_train
    if model.dp_parameters.delta >= 1.0 / n and not model.dp_parameters.allow_large_delta:
        raise ValueError(
            f"delta={model.dp_parameters.delta} >= 1/N = {1.0 / n:.3g}: such a δ allows "
            "releasing a record in the clear. Lower it or pass allow_large_delta=True.")


def check_output_width(model):
    """``DatasetMetadata.nb_classes`` must match the model's output width (one
    output per class, or one output for two classes)."""
    width, k = output_width(model), model.dataset_metadata.nb_classes
    if width is not None and width != k and not (width == 1 and k <= 2):
        raise ValueError(
            f"{model.name} has {width} outputs but DatasetMetadata(nb_classes={k}): set "
            f"nb_classes={width}, or end the model with a layer of {k} units.")


def check_dp_once(model):
    """`check_dp` unless it already passed for this plan, metadata, loss, optimizer
    and set of trainable variables (`fit` checks before building the step)."""
    require_dp_config(model)
    key = (model.step_plan(), repr(model.dataset_metadata.get_config()), id(model.loss),
           id(model.optimizer), tuple(v.path for v in model.trainable_variables))
    if key != getattr(model, "_dp_checked", None):
        check_dp(model)
        object.__setattr__(model, "_dp_checked", key)
