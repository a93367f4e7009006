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

# Contrastive losses have a batch-level sensitivity, not a per-example get_L():
# train them with kdp.contrastive.
from kdp.losses.contrastive import DP_InfoNCE, DP_Spreadout

__all__ = [
    "DPLoss", "DP_KCosineSimilarity", "DP_MeanAbsoluteError", "DP_MulticlassHinge",
    "DP_MulticlassHKR", "DP_MulticlassKR", "DP_TauBCE", "DP_TauCategoricalCrossentropy",
    "DP_InfoNCE", "DP_Spreadout",
]
