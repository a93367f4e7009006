"""DPCL (Li et al. 2022): DP contrastive learning with noisy connection points.

DP-SimCLR privatises the similarity matrix, DP-Barlow-Twins the batch mean and
variance, then per-view gradients are clipped to C and summed with noise. The
paper's gradient sensitivity 4C is **unproven** (`kdp.dpcl.objectives`): mode
``"as-published"`` reproduces it with a warning; ``"rigorous"`` (noisy copy of
Z / of the cross-correlation, with stop-gradient) has a proven 4C; ``"full"``
is the paper's original 4|B|C. Its accounting composes separately subsampled
mechanisms, which under-counts; `kdp.dpcl.accounting` reproduces it and
offers the sound joint event (the default).

* `kdp.dpcl.mechanisms`: the Gaussian releases and their sensitivities;
* `kdp.dpcl.accounting`: events, the paper's Eq. 11 RDP, σ calibration;
* `kdp.dpcl.objectives`: NT-Xent / Barlow Twins in the three modes;
* `kdp.dpcl.trainer`: `DPCLTrainer`.
"""

from kdp.dpcl import accounting, mechanisms, objectives
from kdp.dpcl.mechanisms import (Release, dp_batch_mean, dp_batch_sse, dp_batch_variance,
                                 dp_embeddings, dp_similarity_matrix, embedding_sensitivity,
                                 mean_sensitivity, similarity_sensitivity, sse_sensitivity)
from kdp.dpcl.objectives import MODES, OBJECTIVES, Spec, gradient_sensitivity
from kdp.dpcl.trainer import AS_PUBLISHED_WARNING, DPCLTrainer

__all__ = [
    "AS_PUBLISHED_WARNING", "DPCLTrainer", "MODES", "OBJECTIVES", "Release", "Spec", "accounting",
    "dp_batch_mean", "dp_batch_sse", "dp_batch_variance", "dp_embeddings", "dp_similarity_matrix",
    "embedding_sensitivity", "gradient_sensitivity", "mean_sensitivity", "mechanisms",
    "objectives", "similarity_sensitivity", "sse_sensitivity",
]
