"""AdaMix: differentially private linear heads with private data helped by public data.

Golatkar et al., "Mixed Differential Privacy in Computer Vision" (CVPR 2022). A
linear softmax head on L2-normalised frozen features is trained by full-batch noisy
gradient descent on private data; a small labelled public set supplies the
initialisation, the clipping threshold (a quantile of public per-example gradient
norms) and a subspace (top singular vectors of the public gradient) for the private
gradients. **The (ε, δ) guarantee covers the private data only (add/remove one
private example), for any fixed public set.**

* `AdaMix`, and the baselines `NoisyGD` (fully private), `PublicOnly`, `NonPrivate`;
* `gdp`: μ = √T/σ accounting, `calibrate_steps(eps, delta, sigma)`;
* `core`: closed-form per-example gradients ``x_i (softmax(W x_i) − y_i)ᵀ``, clipping,
  projection, noise (`keras.ops`);
* `diagnostics`: the per-instance GDP ledger (Prop. 14; NOT for release) and metrics.
"""

from kdp.adamix import core, diagnostics, gdp
from kdp.adamix.data import digits_mixed_split
from kdp.adamix.diagnostics import PerInstanceLedger, membership_auc, performance_boost, relative_error_increase
from kdp.adamix.gdp import (
    calibrate_steps, compose_gdp, epsilon_dp_accounting, gdp_delta, gdp_eps, gdp_mu, noisy_gd_epsilon,
    noisy_gd_event, noisy_gd_mu,
)
from kdp.adamix.trainers import AdaMix, LinearHeadTrainer, NoisyGD, NonPrivate, PublicOnly

__all__ = [
    "AdaMix", "NoisyGD", "PublicOnly", "NonPrivate", "LinearHeadTrainer", "PerInstanceLedger",
    "calibrate_steps", "compose_gdp", "epsilon_dp_accounting", "gdp_delta", "gdp_eps", "gdp_mu",
    "noisy_gd_epsilon", "noisy_gd_event", "noisy_gd_mu", "digits_mixed_split", "membership_auc",
    "performance_boost", "relative_error_increase", "core", "diagnostics", "gdp",
]
