"""Test accuracy of `kdp.recipes` on scikit-learn's bundled data at ε = 1, 3, 8.

Each recipe is chosen from public facts only (input shape, classes, N, ε, δ,
method); nothing here is tuned on the data. Protocol: the loaders' 80/20
stratified split (seed 0), δ = 1e-5, test accuracy, mean ± std over seeds
(initialisation seeds; the DP noise always uses the OS entropy). digits is the
data the rules were set on; the tables (breast_cancer, wine, iris: columns
mapped by declared domain ranges) are a check on data they were not.

    KERAS_BACKEND=jax python benchmarks/recipes_digits.py [--methods clipping clipless]
        [--datasets digits breast_cancer wine iris] [--seeds 3] [--epsilons 1 3 8]
"""

import argparse
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402

from kdp import recipes  # noqa: E402
from kdp.cli import DATASETS, TABLES  # noqa: E402
from kdp.datasets import load_dataset  # noqa: E402

DELTA = 1e-5


def run(dataset, method, epsilon, seed):
    (x, y), (x_test, y_test), md = load_dataset(dataset, batch_size=32)
    r = recipes.recipe(md.input_shape, md.nb_classes, md.nb_samples_train, epsilon, DELTA,
                       method=method, max_norm=md.max_norm,
                       kind="table" if dataset in TABLES else "image", features=None)
    model = r.build(seed=seed)
    model.fit(x, y, epochs=r.epochs, verbose=0)
    eps = model.privacy_spent()[0]
    assert eps <= epsilon * (1 + 1e-9), (eps, epsilon)
    acc = float(model.evaluate(x_test, y_test, verbose=0, batch_size=512)[1])
    return acc, r, model.dp_parameters.noise_multiplier


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--methods", nargs="+", default=["clipping", "clipless", "auto"],
                        choices=recipes.METHODS)
    parser.add_argument("--datasets", nargs="+", default=["digits", "breast_cancer"],
                        choices=DATASETS)
    parser.add_argument("--epsilons", nargs="+", type=float, default=[1.0, 3.0, 8.0])
    parser.add_argument("--seeds", type=int, default=3)
    args = parser.parse_args()
    print(f"backend={keras.backend.backend()} delta={DELTA} seeds={args.seeds}")
    print(f"{'dataset':>13} {'method':>8} {'eps':>4} {'b':>5} {'ep':>3} {'sigma':>7} "
          f"{'acc mean':>8} {'std':>6} {'s/run':>6}")
    for dataset in args.datasets:
        for method in args.methods:
            for epsilon in args.epsilons:
                start = time.time()
                results = [run(dataset, method, epsilon, s) for s in range(args.seeds)]
                accs = [a for a, _, _ in results]
                r, sigma = results[0][1], results[0][2]
                print(f"{dataset:>13} {r.method:>8} {epsilon:4g} {r.batch_size:5d} {r.epochs:3d} "
                      f"{sigma:7.3f} {np.mean(accs):8.4f} {np.std(accs):6.4f} "
                      f"{(time.time() - start) / args.seeds:6.1f}", flush=True)


if __name__ == "__main__":
    main()
