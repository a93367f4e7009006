"""DP contrastive learning on positive pairs (Logit-DP, naive, clipless).

See `kdp.contrastive.trainer` for the mechanism and its calibration,
`kdp.contrastive.gradients` for the per-pair gradients and the clipless bound,
and `kdp.losses.contrastive` for the losses and their batch sensitivities.
"""

from kdp.contrastive.evaluation import embed, finetune_head, knn_accuracy, same_class_pairs
from kdp.contrastive.gradients import PairGradients, check_encoder, clipless_pair_bound
from kdp.contrastive.trainer import SENSITIVITY_SIZES, STRATEGIES, ContrastiveTrainer

__all__ = [
    "ContrastiveTrainer", "PairGradients", "SENSITIVITY_SIZES", "STRATEGIES", "check_encoder",
    "clipless_pair_bound", "embed", "finetune_head", "knn_accuracy", "same_class_pairs",
]
