"""kdp: differentially private deep learning for Keras 3 (Clipless DP-SGD and more)."""

from kdp import accounting, layers, losses
from kdp.bounds import compute_gradient_bounds, lipschitz_constant
from kdp.callbacks import DP_Accountant
from kdp.model import DP_Model, DP_Sequential, DPParameters
from kdp.pipeline import DatasetMetadata, bound_clip_value, bound_normalize

__version__ = "0.1.0"

__all__ = [
    "accounting", "layers", "losses", "compute_gradient_bounds", "lipschitz_constant",
    "DP_Accountant", "DP_Model", "DP_Sequential", "DPParameters", "DatasetMetadata",
    "bound_clip_value", "bound_normalize",
]
