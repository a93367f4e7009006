"""DP-Helmet: DP single-layer learners by output perturbation, with blind averaging.

Kirschte, Meiser, Ardalan, Mohammadi, "Distributed DP-Helmet: Scalable
Differentially Private Non-interactive Averaging of Single Layers" (arXiv
2211.02003).

* :mod:`~kdp.helmet.constants` — L, β, Λ, output sensitivity (single, group, 2R)
* :mod:`~kdp.helmet.preprocessing` — feature clipping, bias augmentation
* :mod:`~kdp.helmet.objectives` — softmax / one-vs-rest Huber objectives in ``keras.ops``
* :mod:`~kdp.helmet.trainer` — projected SGD, Keras ``Dense`` export
* :mod:`~kdp.helmet.privacy` — exact Gaussian profile, ``calibrate_sigma``, ``epsilon``
* :mod:`~kdp.helmet.perturbation` — output perturbation, centralised ``private_fit``
* :mod:`~kdp.helmet.secure_sum` — additive secret sharing emulation
* :mod:`~kdp.helmet.federated` — clients, server, splits, ``FederatedSimulator``
"""

from kdp.helmet.constants import (aggregate_sensitivity, augmented_bound, k_comp,
                                  lipschitz_constant, sensitivity, smoothness_constant,
                                  strong_convexity_constant)
from kdp.helmet.federated import (FederatedSimulator, client_contribution, server_sum,
                                  split_iid, split_one_class_per_user)
from kdp.helmet.perturbation import gaussian_output_perturbation, private_fit
from kdp.helmet.preprocessing import FeatureClip, clip_by_l2_norm
from kdp.helmet.privacy import (calibrate_sigma, classical_sigma, dp_event, epsilon,
                                epsilon_dp_accounting, gaussian_delta, privacy_report)
from kdp.helmet.secure_sum import SecureSum
from kdp.helmet.trainer import HelmetConfig, SingleLayerTrainer, train_many

__all__ = [
    "aggregate_sensitivity", "augmented_bound", "k_comp", "lipschitz_constant", "sensitivity",
    "smoothness_constant", "strong_convexity_constant", "FederatedSimulator",
    "client_contribution", "server_sum", "split_iid", "split_one_class_per_user",
    "gaussian_output_perturbation", "private_fit", "FeatureClip", "clip_by_l2_norm",
    "calibrate_sigma", "classical_sigma", "dp_event", "epsilon", "epsilon_dp_accounting",
    "gaussian_delta", "privacy_report", "SecureSum", "HelmetConfig", "SingleLayerTrainer",
    "train_many",
]
