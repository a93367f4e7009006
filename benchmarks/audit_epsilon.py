"""Empirical ε lower bounds of `kdp.audit.membership_audit` against the accountant.

One noisy step of a small DP MLP on a gradient canary (the digits example with
the largest gradient-norm / bound ratio), at σ calibrated for a claimed
ε ∈ {1, 4, 8} (one step, q = 1, δ = 1e-5); then a non-private run (σ = 1e-3)
and an under-noised run (σ twenty times below the ε = 1 calibration).

    KERAS_BACKEND=jax python benchmarks/audit_epsilon.py [--trials 1000]
"""

import argparse

import keras
import numpy as np

import kdp
from kdp import accounting, audit, datasets
from kdp import layers as L
from kdp import losses

DELTA = 1e-5


def model(sigma, n):
    md = kdp.DatasetMetadata((64,), 10, n, 64)
    m = kdp.DP_Sequential(
        [L.DP_BoundedInput((64,), upper_bound=1.0), L.DP_QuickSpectralDense(32), L.DP_GroupSort(2),
         L.DP_QuickSpectralDense(10)],
        dp_parameters=kdp.DPParameters("global", sigma, DELTA), dataset_metadata=md,
    )
    m.compile(optimizer=keras.optimizers.SGD(1.0), loss=losses.DP_TauCategoricalCrossentropy(1.0))
    return m


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--trials", type=int, default=1000)
    args = parser.parse_args()
    (x, y), _, md = datasets.load_digits()
    x = x / np.linalg.norm(x, axis=1, keepdims=True)
    probe = model(1.0, len(x))
    report = audit.gradient_norm_check(probe, x[:256], y[:256])
    ratios = np.zeros(256)
    for path, g in audit.per_example_gradients(probe, probe.loss, x[:256], y[:256]).items():
        g = np.asarray(g).reshape(256, -1)
        ratios = np.maximum(ratios, np.linalg.norm(g, axis=1) / report["variables"][path]["bound"])
    canary = int(np.argmax(ratios))
    print(f"canary: example {canary}, gradient/bound ratio {ratios[canary]:.3f}")
    rows = []
    for eps in (1.0, 4.0, 8.0):
        sigma = accounting.calibrate_noise_multiplier(eps, 1.0, 1, DELTA)
        rows.append((f"honest, claim ε={eps:g}", sigma, eps))
    rows.append(("non-private (σ=1e-3)", 1e-3, accounting.compute_epsilon(1e-3, 1.0, 1, DELTA)))
    sigma1 = rows[0][1]
    rows.append(("under-noised: σ/20 of the ε=1 claim", sigma1 / 20, 1.0))
    print(f"{'run':40s} {'σ':>8s} {'claimed ε':>10s} {'ε lower bound':>14s} {'TPR':>6s} {'FPR':>6s}")
    for name, sigma, claimed in rows:
        r = audit.membership_audit(model(sigma, len(x)), x[canary:canary + 1], y[canary:canary + 1],
                                   trials=args.trials)
        print(f"{name:40s} {sigma:8.3f} {claimed:10.3g} {r['epsilon_lower_bound']:14.3f} "
              f"{r['tpr']:6.2f} {r['fpr']:6.2f}")


if __name__ == "__main__":
    main()
