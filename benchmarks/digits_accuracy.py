"""Test accuracy of Clipless DP-SGD on scikit-learn's bundled digits at ε = 1, 3, 8.

Protocol: digits (1797 images 8×8), 80/20 stratified split with seed 0,
δ = 1e-5, a Lipschitz `DP_Sequential`; for each ε the noise multiplier is calibrated
with `kdp.accounting.calibrate_noise_multiplier` for the chosen batch size and
number of epochs (Poisson sampling; its default accountant, the tighter of PLD and
RDP: the table below, measured on 2026-11-24, has RDP's larger σ), each grid point is trained with 3 seeds
and the table reports, per ε, the grid point with the best mean test accuracy
(the selection is made on the test set, as in the reference numbers, and its
privacy cost is ignored, as in the paper).

Reference (same protocol): lip-dp 0.67 / 0.86 / 0.89, Opacus DP-SGD 0.84 / 0.91 /
0.93 at ε = 1 / 3 / 8; kdp per-example clipping DP-SGD 0.857 / 0.912 / 0.938; a
non-private MLP 0.98.

The model: the input is centred and scaled to unit L2 norm per example
(public, data independent), then either a **linear** Lipschitz model
(``width=0``: one `DP_QuickSpectralDense(10)`) or one hidden layer
(`DP_QuickSpectralDense(width)`, `DP_GroupSort(2)`, **no bias**), τ-CCE with
τ = 32 and a last **`DP_ClipGradient(C)` with a small fixed C** (a public
constant, so free): every example's logit gradient is clipped to C ≪ L = √2,
which normalises the per-example gradients as DP-SGD with a small clipping norm
does, and the bound pass starts from C instead of √2, so the noise shrinks by
√2/C as well. What moved the accuracy (ε = 1, one seed, b = 256,
30 epochs, Adam 0.01, inputs not centred unless said): the former grid's MLP
0.53; without its bias (the hidden norm bound drops from 2 to 1) 0.73, plus
C = 0.03 0.79, plus centring 0.83 (with τ = 32, 3 seeds: 0.863); a linear
model 0.80, plus C = 0.1 / 0.03 0.87 / 0.87; τ 8 → 32 about +0.02 at ε = 3
(0.88 → 0.91 with C = 1.4 → 0.03). Did not help: width 1024 (0.52 without C),
a bias of norm 0.1 (0.78), `DP_ReLU` (0.83) and per-layer noise (0.84) against
GroupSort's 0.86 (hidden 256, centred, τ = 32), HKR (0.84), an input radius
of 4 with τ = 32 (0.86 at ε = 3), SGD with momentum (0.86 at ε = 3),
C = 0.3 / 1.4 (0.90 / 0.875 at ε = 3), τ = 64 (0.82 at ε = 1).

Rules behind the grid (public facts only: N, K classes, input dimension, ε, δ):
the input bound X = 1 (per-example centred, unit-normalised rows); τ = 32 / X;
C = L / 50 (≈ 0.03 for τ-CCE; L/150 … L/15 were within a point at ε = 3);
b ≈ N / 6 (sampling rate q ≈ 0.18; N / 11 was not better); 30 epochs
(≈ 170 steps); Adam with learning rate 0.01; no hidden layer (width 0) for
a small N; σ then follows from (ε, δ, q, steps) and is the same for every
architecture, since C is absorbed by the bound pass.

Measured (JAX backend, CPU, 179 s for the grid below, mean ± std of 3 seeds):

     eps    b    w   sigma   acc mean    std
       1  128    0   6.968   0.8731   0.0065
       1  128  256   6.968   0.8019   0.0400
       1  256    0   9.815   0.8935   0.0151
       1  256  256   9.815   0.8778   0.0060
       3  128    0   2.704   0.9231   0.0094
       3  128  256   2.704   0.9074   0.0094
       3  256    0   3.745   0.9241   0.0013
       3  256  256   3.745   0.9148   0.0069
       8  128    0   1.333   0.9370   0.0125
       8  128  256   1.333   0.9204   0.0114
       8  256    0   1.749   0.9417   0.0039
       8  256  256   1.749   0.9398   0.0047

Best point at every ε: the linear model, b = 256: 0.894 / 0.924 / 0.942 at
ε = 1 / 3 / 8 (the former grid: 0.700 / 0.857 / 0.898).

    KERAS_BACKEND=jax python benchmarks/digits_accuracy.py [--quick]
"""

import argparse
import itertools
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402
from sklearn.model_selection import train_test_split  # noqa: E402

import kdp  # noqa: E402
from kdp import accounting, layers, losses  # noqa: E402

DELTA = 1e-5
EPSILONS = (1.0, 3.0, 8.0)
REFERENCE = {"lip-dp": (0.67, 0.86, 0.89), "Opacus": (0.84, 0.91, 0.93)}

# (batch size, epochs, learning rate, tau, width, clip): width 0 is the linear model.
GRID = {
    "batch_size": (128, 256),
    "epochs": (30,),
    "learning_rate": (0.01,),
    "tau": (32.0,),
    "width": (0, 256),
    "clip": (0.03,),
}
INPUT_BOUND = 1.0  # each image is centred and scaled to unit L2 norm (data independent)
SEEDS = (0, 1, 2)


def load():
    x, y = load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(
        x, y, test_size=0.2, stratify=y, random_state=0)
    normalize, _ = kdp.bound_normalize()

    def prepare(z):  # per example: subtract the image's own mean pixel, then unit norm
        z = z.astype("float32")
        return normalize(z - z.mean(axis=1, keepdims=True)) * INPUT_BOUND

    return prepare(x_train), y_train.astype("int32"), prepare(x_test), y_test.astype("int32")


def build(n, batch_size, sigma, width, tau, learning_rate, clip, seed):
    keras.utils.set_random_seed(seed)
    hidden = [layers.DP_QuickSpectralDense(width), layers.DP_GroupSort(2)] if width else []
    model = kdp.DP_Sequential(
        [
            layers.DP_BoundedInput((64,), INPUT_BOUND),
            *hidden,
            layers.DP_QuickSpectralDense(10),
            layers.DP_ClipGradient(clip),  # last: the bound pass starts from min(√2, C)
        ],
        dp_parameters=kdp.DPParameters("global", sigma, DELTA),
        dataset_metadata=kdp.DatasetMetadata((64,), 10, n, batch_size),
    )
    model.compile(optimizer=keras.optimizers.Adam(learning_rate),
                  loss=losses.DP_TauCategoricalCrossentropy(tau), metrics=["accuracy"])
    return model


def run(data, epsilon, batch_size, epochs, learning_rate, tau, width, clip, seed):
    x_train, y_train, x_test, y_test = data
    n = len(x_train)
    steps = epochs * -(-n // batch_size)
    sigma = accounting.calibrate_noise_multiplier(epsilon, batch_size / n, steps, DELTA)
    model = build(n, batch_size, sigma, width, tau, learning_rate, clip, seed)
    history = model.fit(x_train, y_train, epochs=epochs, verbose=0, callbacks=[kdp.DP_Accountant()])
    eps = history.history["epsilon"][-1]
    assert eps <= epsilon + 1e-9, (eps, epsilon)
    acc = float(np.mean(np.argmax(model.predict(x_test, verbose=0, batch_size=512), -1) == y_test))
    return acc, sigma, eps


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="one grid point, one seed")
    args = parser.parse_args()
    data = load()
    keys = list(GRID)
    grid = [dict(zip(keys, values)) for values in itertools.product(*GRID.values())]
    seeds = SEEDS
    if args.quick:
        grid, seeds = grid[:1], seeds[:1]
    start = time.time()
    best = {}
    print(f"backend={keras.backend.backend()} N_train={len(data[0])} N_test={len(data[2])} delta={DELTA}")
    print(f"{'eps':>4} {'b':>4} {'ep':>3} {'lr':>6} {'tau':>5} {'w':>4} {'C':>5} {'sigma':>7} "
          f"{'acc mean':>8} {'std':>6}")
    for epsilon in EPSILONS:
        for point in grid:
            results = [run(data, epsilon, seed=s, **point) for s in seeds]
            accs = [r[0] for r in results]
            mean = float(np.mean(accs))
            print(f"{epsilon:4.0f} {point['batch_size']:4d} {point['epochs']:3d} "
                  f"{point['learning_rate']:6.3f} {point['tau']:5.1f} {point['width']:4d} "
                  f"{point['clip']:5.2f} "
                  f"{results[0][1]:7.3f} {mean:8.4f} {np.std(accs):6.4f}", flush=True)
            if epsilon not in best or mean > best[epsilon][0]:
                best[epsilon] = (mean, np.std(accs), point, results[0][2])
    print(f"\nbest of the grid, mean of {len(seeds)} seeds ({time.time() - start:.0f} s):")
    print(f"{'eps':>4} {'kdp':>14} {'lip-dp':>7} {'Opacus':>7}  best point (final eps)")
    for i, epsilon in enumerate(EPSILONS):
        mean, std, point, eps = best[epsilon]
        print(f"{epsilon:4.0f} {mean:7.4f}±{std:.4f} {REFERENCE['lip-dp'][i]:7.2f} "
              f"{REFERENCE['Opacus'][i]:7.2f}  {point} ({eps:.3f})")


if __name__ == "__main__":
    main()
