"""Which layer owns each trainable variable, and the clipping norm of each group."""

import math

from kdp.clipping.config import ClippingError


def _owned_variables(layer):
    return [v for v in getattr(layer, "_trainable_variables", []) if v.trainable]


def _owners(model):
    """``{id(variable): layer}``, the innermost layer that created each trainable variable."""
    owners = {}
    for layer in model._flatten_layers(include_self=False):
        for v in _owned_variables(layer):
            owners[id(v)] = layer
    return owners


def clipping_groups(model):
    """``{layer name: [variable paths]}``: the clipping groups of ``"per-layer"``."""
    owners = _owners(model)
    groups = {}
    for v in model.trainable_variables:
        layer = owners.get(id(v))
        if layer is None:
            raise ClippingError(f"cannot tell which layer owns the trainable variable {v.path!r}")
        groups.setdefault(layer.name, []).append(v.path)
    return groups


def group_clipping_norms(model):
    """``{layer name: C_l}`` (``"per-layer"``) or ``{None: C}`` (``"flat"``)."""
    params = model.dp_parameters
    if params.clipping == "flat":
        return {None: float(params.clipping_norm)}
    groups = clipping_groups(model)
    c = params.clipping_norm
    if isinstance(c, dict):
        missing = sorted(set(groups) - set(c))
        extra = sorted(set(c) - set(groups))
        if missing or extra:
            raise ClippingError(
                f"clipping_norm dict must name every layer with trainable weights: "
                f"missing {missing}, unknown {extra}"
            )
        return {name: c[name] for name in groups}
    share = float(c) / math.sqrt(len(groups))  # equal split: Σ C_l² = C²
    return {name: share for name in groups}
