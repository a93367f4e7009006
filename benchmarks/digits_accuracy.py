"""Test accuracy of Clipless DP-SGD on scikit-learn's bundled digits at ε = 1, 3, 8.

Protocol (issue 4): digits (1797 images 8×8), 80/20 stratified split with seed 0,
δ = 1e-5, an MLP `DP_Sequential`; for each ε the noise multiplier is calibrated
with `kdp.accounting.calibrate_noise_multiplier` for the chosen batch size and
number of epochs (Poisson sampling, RDP), each grid point is trained with 3 seeds
and the table reports, per ε, the grid point with the best mean test accuracy
(the selection is made on the test set, as in the reference numbers, and its
privacy cost is ignored, as in the paper).

Reference (same protocol): lip-dp 0.67 / 0.86 / 0.89, Opacus DP-SGD 0.84 / 0.91 /
0.93 at ε = 1 / 3 / 8; a non-private MLP 0.98.

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

# (batch size, epochs, learning rate, tau, width): a small grid (a first pass with
# learning rate 0.03 was worse everywhere than 0.01, so it moved down), reported as is.
GRID = {
    "batch_size": (256, 512),
    "epochs": (15, 30),
    "learning_rate": (0.003, 0.01),
    "tau": (8.0,),
    "width": (256,),
}
INPUT_BOUND = 1.0  # each image is scaled to unit L2 norm (data independent)
SEEDS = (0, 1, 2)


def load():
    x, y = load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(
        x, y, test_size=0.2, stratify=y, random_state=0)
    normalize, _ = kdp.bound_normalize()
    return normalize(x_train), y_train.astype("int32"), normalize(x_test), y_test.astype("int32")


def build(n, batch_size, sigma, width, tau, learning_rate, seed):
    keras.utils.set_random_seed(seed)
    model = kdp.DP_Sequential(
        [
            layers.DP_BoundedInput((64,), INPUT_BOUND),
            layers.DP_QuickSpectralDense(width),
            layers.DP_AddBias(1.0),
            layers.DP_GroupSort(2),
            layers.DP_QuickSpectralDense(10),
        ],
        dp_parameters=kdp.DPParameters("global", sigma, DELTA),
        dataset_metadata=kdp.DatasetMetadata((64,), 10, n, batch_size),
    )
    model.compile(optimizer=keras.optimizers.Adam(learning_rate),
                  loss=losses.DP_TauCategoricalCrossentropy(tau), metrics=["accuracy"])
    return model


def run(data, epsilon, batch_size, epochs, learning_rate, tau, width, seed):
    x_train, y_train, x_test, y_test = data
    n = len(x_train)
    steps = epochs * -(-n // batch_size)
    sigma = accounting.calibrate_noise_multiplier(epsilon, batch_size / n, steps, DELTA)
    model = build(n, batch_size, sigma, width, tau, learning_rate, seed)
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
    print(f"{'eps':>4} {'b':>4} {'ep':>3} {'lr':>6} {'tau':>5} {'w':>4} {'sigma':>7} {'acc mean':>8} {'std':>6}")
    for epsilon in EPSILONS:
        for point in grid:
            results = [run(data, epsilon, seed=s, **point) for s in seeds]
            accs = [r[0] for r in results]
            mean = float(np.mean(accs))
            print(f"{epsilon:4.0f} {point['batch_size']:4d} {point['epochs']:3d} "
                  f"{point['learning_rate']:6.3f} {point['tau']:5.1f} {point['width']:4d} "
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
