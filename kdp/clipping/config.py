"""Per-example clipping's arguments: the modes, their validation, the sensitivity ``C``."""

import math


CLIPPING_MODES = ("flat", "per-layer")


class ClippingError(ValueError):
    """The model cannot be trained with per-example clipping as configured."""


def check_clipping_parameters(clipping_norm, clipping, physical_batch_size):
    """Validate the clipping arguments of `DPParameters` (returns them normalised)."""
    if clipping not in CLIPPING_MODES:
        raise ValueError(f"clipping must be one of {CLIPPING_MODES}, got {clipping!r}")
    if clipping_norm is not None:
        if isinstance(clipping_norm, dict):
            if clipping != "per-layer":
                raise ValueError("a dict of clipping norms {layer name: C_l} needs clipping='per-layer'")
            clipping_norm = {str(k): float(c) for k, c in clipping_norm.items()}
            norms = list(clipping_norm.values())
        else:
            clipping_norm = float(clipping_norm)
            norms = [clipping_norm]
        if not norms or not all(c > 0 and math.isfinite(c) for c in norms):
            raise ValueError(f"clipping_norm must be finite and > 0, got {clipping_norm}")
    if physical_batch_size is not None:
        physical_batch_size = int(physical_batch_size)
        if physical_batch_size < 1:
            raise ValueError(f"physical_batch_size must be >= 1, got {physical_batch_size}")
        if clipping_norm is None:
            raise ValueError("physical_batch_size (virtual batches) needs clipping_norm")
    return clipping_norm, clipping, physical_batch_size


def total_clipping_norm(dp_parameters):
    """``C``: the L2 sensitivity of the clipped sum (``√Σ C_l²`` per layer)."""
    c = dp_parameters.clipping_norm
    return math.sqrt(sum(v * v for v in c.values())) if isinstance(c, dict) else float(c)
