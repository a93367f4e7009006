"""Output perturbation: one Gaussian draw on the trained weights (paper Cor. 3.15, 4.2).

``f_priv = T(D) + N(0, σ² s² I)`` with ``s`` the (replace-one) sensitivity and
``σ = calibrate_sigma(ε, δ, k_comp)``: (ε, δ)-DP by the exact Gaussian profile
(:mod:`kdp.helmet.privacy`).  The sensitivity holds for every sample order
(randomised sensitivity, Thm. J.2), so the seed of the order may be anything.
"""

import numpy as np

from kdp.helmet import privacy
from kdp.helmet.trainer import SingleLayerTrainer


def gaussian_output_perturbation(weights, sensitivity, sigma, seed=None):
    """``weights + N(0, (σ·s)²)`` entry-wise, drawn once (NumPy, float64)."""
    if not (sensitivity > 0 and sigma > 0):
        raise ValueError("sensitivity and sigma must be > 0")
    rng = np.random.default_rng(seed)
    weights = np.asarray(weights, dtype="float64")
    return weights + rng.normal(0.0, sigma * sensitivity, size=weights.shape)


def private_fit(X, y, config, num_classes, eps, delta, seed=None, group_size=1):
    """Centralised DP-Helmet (one user): train, then perturb once.

    Returns ``(weights (p + 1, K), info)`` where ``info`` holds σ, s and k_comp.
    """
    n = len(X)
    if not delta < 1.0 / n:
        raise ValueError(f"delta={delta} must be < 1/n = {1.0 / n}")
    rng = np.random.default_rng(seed)
    order_seed, noise_seed = rng.integers(0, 2**31, size=2)
    k = config.k_comp(num_classes)
    sigma = privacy.calibrate_sigma(eps, delta, k)
    s = config.sensitivity(n, group_size)
    f = SingleLayerTrainer(config).fit(X, y, num_classes, seed=int(order_seed))
    noisy = gaussian_output_perturbation(f, s, sigma, int(noise_seed))
    return noisy, {"sigma": sigma, "sensitivity": s, "k_comp": k, "eps": eps, "delta": delta}
