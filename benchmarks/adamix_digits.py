"""AdaMix against its baselines on scikit-learn's bundled digits (no download).

A few labelled examples per class are public, the rest of the training split is
private; test error (%) at ε ∈ {1, 3}, δ = 1e-5, σ = 20 (T from `calibrate_steps`),
mean ± std over seeds (each seed: its own split and noise). As in the paper, the
learning rate of each private method is the best of a small grid per ε (by mean test
error); that selection is NOT privacy-accounted.

    KERAS_BACKEND=jax python benchmarks/adamix_digits.py [--seeds 3] [--shots 2]
"""

import argparse
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402

from kdp import adamix as am  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--shots", type=int, default=2, help="public examples per class")
    parser.add_argument("--epsilons", type=float, nargs="+", default=[1.0, 3.0])
    parser.add_argument("--sigma", type=float, default=20.0)
    args = parser.parse_args()
    delta, seeds = 1e-5, range(args.seeds)
    splits = {s: am.digits_mixed_split(args.shots, seed=s) for s in seeds}

    def run(make, seed):
        d = splits[seed]
        t0 = time.perf_counter()
        model = make(seed).fit(d["x_private"], d["y_private"], public_data=(d["x_public"], d["y_public"]))
        return 100 * model.error(d["x_test"], d["y_test"]), time.perf_counter() - t0

    def best_of(grid, make_for_lr):
        best = None
        for lr in grid:
            res = [run(lambda s: make_for_lr(lr, s), s) for s in seeds]
            errs = np.array([r[0] for r in res])
            if best is None or errs.mean() < best[0].mean():
                best = (errs, lr, np.mean([r[1] for r in res]))
        return best

    d0 = splits[0]
    print(f"digits: {len(d0['y_private'])} private, {len(d0['y_public'])} public "
          f"({args.shots}/class), {len(d0['y_test'])} test; δ={delta}, σ={args.sigma}; "
          f"backend={__import__('keras').backend.backend()}")
    rows = []
    res = [run(lambda s: am.NonPrivate(10, seed=s), s) for s in seeds]
    rows.append(("Non-private (paragon)", "-", "-", np.array([r[0] for r in res]), "-", np.mean([r[1] for r in res])))
    res = [run(lambda s: am.PublicOnly(10, seed=s), s) for s in seeds]
    rows.append(("Public-only", "0", "-", np.array([r[0] for r in res]), "-", np.mean([r[1] for r in res])))
    methods = [
        ("Fully-private NoisyGD (τ=1)", [2.5e-3, 5e-3, 1e-2, 2e-2],
         lambda eps: lambda lr, s: am.NoisyGD(10, epsilon=eps, delta=delta, noise_multiplier=args.sigma,
                                              learning_rate=lr, clip_norm=1.0, reproducible=True, seed=s)),
        ("AdaMix, P = D (no projection)", [1e-2, 2e-2, 4e-2, 8e-2],
         lambda eps: lambda lr, s: am.AdaMix(10, epsilon=eps, delta=delta, noise_multiplier=args.sigma,
                                             learning_rate=lr, projection=False, reproducible=True, seed=s)),
        ("AdaMix, P = rank(G_pub) <= C-1", [1e-2, 2e-2, 4e-2, 8e-2],
         lambda eps: lambda lr, s: am.AdaMix(10, epsilon=eps, delta=delta, noise_multiplier=args.sigma,
                                             learning_rate=lr, reproducible=True, seed=s)),
    ]
    for eps in args.epsilons:
        steps = am.calibrate_steps(eps, delta, args.sigma)
        spent = am.noisy_gd_epsilon(args.sigma, steps, delta)
        for name, grid, factory in methods:
            errs, lr, secs = best_of(grid, factory(eps))
            rows.append((name, f"{eps:g} ({spent:.3f})", str(steps), errs, f"{lr:g}", secs))

    print(f"\n| method | ε (spent) | T | test error % (mean ± std, {args.seeds} seeds) | lr | s/fit |")
    print("|---|---|---|---|---|---|")
    for name, eps, steps, errs, lr, secs in rows:
        print(f"| {name} | {eps} | {steps} | {errs.mean():.2f} ± {errs.std():.2f} | {lr} | {secs:.2f} |")


if __name__ == "__main__":
    main()
