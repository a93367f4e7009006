"""Output perturbation: one Gaussian draw on the trained weights (paper Cor. 3.15, 4.2).

``f_priv = T(D) + N(0, σ² s² I)`` with ``s`` the (replace-one) sensitivity and
``σ = calibrate_sigma(ε, δ, k_comp)``: (ε, δ)-DP by the exact Gaussian profile
(:mod:`kdp.helmet.privacy`).  The sensitivity holds for every sample order
(randomised sensitivity, Thm. J.2), so the order need not be secret; the noise
must be: it comes from `kdp.training.seeds` (64 bits of OS entropy) unless
``reproducible=True`` with an explicit seed (tests only).
"""

import numpy as np

from kdp.helmet import privacy
from kdp.helmet.trainer import SingleLayerTrainer
from kdp.training import seeds
from kdp.training.gate import PrivacyGate
from kdp.training.ledger import event_mechanism


def gaussian_output_perturbation(weights, sensitivity, sigma, seed=None, reproducible=False):
    """``weights + N(0, (σ·s)²)`` entry-wise, drawn once (NumPy, float64).

    A primitive: nothing is recorded (`private_fit` and `FederatedSimulator.release`
    run it through a privacy gate).
    """
    if not (sensitivity > 0 and sigma > 0):
        raise ValueError("sensitivity and sigma must be > 0")
    seeds.check_seed(reproducible, seed)
    rng = seeds.numpy_generator(reproducible, seed)
    weights = np.asarray(weights, dtype="float64")
    return weights + rng.normal(0.0, sigma * sensitivity, size=weights.shape)


def private_fit(X, y, config, num_classes, eps, delta, seed=None, group_size=1,
                reproducible=False, privacy_gate=None):
    """Centralised DP-Helmet (one user): train, then perturb once.

    The release is recorded (``privacy.dp_event``) in ``privacy_gate`` (a new
    `kdp.training.PrivacyGate` at ``delta`` by default) before the noise is drawn.

    Returns ``(weights (p + 1, K), info)`` where ``info`` holds σ, s, k_comp and
    the ``privacy_gate``.
    """
    n = len(X)
    if not delta < 1.0 / n:
        raise ValueError(f"delta={delta} must be < 1/n = {1.0 / n}")
    seeds.check_seed(reproducible, seed)
    gate = privacy_gate if privacy_gate is not None else PrivacyGate(delta, name="private_fit")
    k = config.k_comp(num_classes)
    sigma = privacy.calibrate_sigma(eps, delta, k)
    s = config.sensitivity(n, group_size)
    f = SingleLayerTrainer(config).fit(X, y, num_classes, seed=seeds.draw_seed(reproducible, seed))
    mechanism = event_mechanism(privacy.dp_event(sigma, k))
    gate.begin_run(mechanism)
    with gate.spend(mechanism):
        noisy = gaussian_output_perturbation(
            f, s, sigma, seeds.draw_seed(True, seed, 1) if reproducible else None, reproducible)
    return noisy, {"sigma": sigma, "sensitivity": s, "k_comp": k, "eps": eps, "delta": delta,
                   "privacy_gate": gate}
