"""DP losses; each has ``get_L()``, its per-example Lipschitz constant."""

from kdp.losses.base import DPLoss
from kdp.losses.supervised import (
    DP_KCosineSimilarity,
    DP_MeanAbsoluteError,
    DP_MulticlassHinge,
    DP_MulticlassHKR,
    DP_MulticlassKR,
    DP_TauBCE,
    DP_TauCategoricalCrossentropy,
)

__all__ = [
    "DPLoss", "DP_KCosineSimilarity", "DP_MeanAbsoluteError", "DP_MulticlassHinge",
    "DP_MulticlassHKR", "DP_MulticlassKR", "DP_TauBCE", "DP_TauCategoricalCrossentropy",
]
from kdp.losses.contrastive import DP_InfoNCE, DP_Spreadout  # noqa: E402,F401  (contrastive: batch-level sensitivity, no get_L)
