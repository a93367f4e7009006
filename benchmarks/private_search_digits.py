"""An accounted hyper-parameter search against the recipe's single run, on digits.

At each total ε (δ = 1e-5), two ways to spend it:

* **recipe**: one run of `kdp.recipes` (per-example clipping on digits) on the
  whole training split, ε = the total;
* **search**: `kdp.tuning.private_search` over learning rate × clipping norm
  (6 candidates sharing one mechanism: the recipe's b and epochs, and a σ
  calibrated with `tuning.calibrate_trial_noise` so that the *whole search*
  costs the total ε), a geometric number of trials of mean 3, each scored by
  its noisy accuracy (Gaussian σ_s on the count of correct predictions, the
  smallest of 5, 10, 20, 40 whose selection alone costs ≤ 35 % of ε) on a private validation split of
  20 % of the training data (the trials train on the other 80 %).

Test accuracy on the untouched test split, mean ± std over seeds; the search's
ε is read from the winner's ledger. Papernot and Steinke 2022.

    KERAS_BACKEND=jax python benchmarks/private_search_digits.py [--seeds 3] [--epsilons 1 3 8]
"""

import argparse
import itertools
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import dp_accounting  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402

from kdp import accounting, recipes, tuning  # noqa: E402
from kdp.pipeline import load_digits  # noqa: E402

DELTA = 1e-5
MEAN_TRIALS = 3.0
#: the score's noise: the smallest of these whose selection alone costs at most 35 % of ε
SCORE_SIGMAS = (5.0, 10.0, 20.0, 40.0)
CANDIDATES = [dict(learning_rate=lr, clipping_norm=c)
              for lr, c in itertools.product((0.003, 0.01, 0.03), (0.1, 1.0))]


def recipe_run(data, epsilon, seed):
    (x, y), (x_test, y_test), md = data
    r = recipes.recipe(md.input_shape, md.nb_classes, len(x), epsilon, DELTA, method="clipping",
                       max_norm=md.max_norm, kind="image", features=None)
    model = r.build(seed=seed)
    model.fit(x, y, epochs=r.epochs, verbose=0)
    return float(model.evaluate(x_test, y_test, verbose=0)[1]), model.privacy_spent()[0], 1


def search_run(data, epsilon, seed):
    (x, y), (x_test, y_test), md = data
    order = np.random.default_rng(1000 + seed).permutation(len(x))  # a public split
    n_train = int(0.8 * len(x))
    x_train, y_train = x[order[:n_train]], y[order[:n_train]]
    validation = (x[order[n_train:]], y[order[n_train:]])
    r = recipes.recipe(md.input_shape, md.nb_classes, n_train, epsilon, DELTA,
                       method="clipping", max_norm=md.max_norm, kind="image", features=None)
    q, steps = r.batch_size / n_train, r.epochs * -(-n_train // r.batch_size)
    score_sigma = next(s for s in SCORE_SIGMAS if accounting.epsilon_of_events(
        [tuning.selection_event(dp_accounting.GaussianDpEvent(s), MEAN_TRIALS)], DELTA)
        <= 0.35 * epsilon)
    sigma = tuning.calibrate_trial_noise(epsilon, DELTA, q, steps, MEAN_TRIALS,
                                         score_noise_multiplier=score_sigma)
    print(f"     search: sigma_score={score_sigma:g} trial sigma={sigma:.3f} "
          f"(b={r.batch_size}, {r.epochs} epochs)", flush=True)

    def train_trial(candidate):
        r.learning_rate, r.clipping_norm = candidate["learning_rate"], candidate["clipping_norm"]
        model = r.build(seed=seed)
        model.dp_parameters = model.dp_parameters.replace(noise_multiplier=sigma)
        model.fit(x_train, y_train, epochs=r.epochs, verbose=0)
        return model

    result = tuning.private_search(
        train_trial, CANDIDATES, accounting.training_event(sigma, q, steps),
        mean_trials=MEAN_TRIALS, validation_data=validation, score_noise_multiplier=score_sigma)
    if result.model is None:
        return float("nan"), result.epsilon(DELTA), 0
    acc = float(result.model.evaluate(x_test, y_test, verbose=0)[1])
    return acc, result.model.privacy_spent()[0], result.trials


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--epsilons", nargs="+", type=float, default=[1.0, 3.0, 8.0])
    args = parser.parse_args()
    data = load_digits(batch_size=32)
    print(f"backend={keras.backend.backend()} delta={DELTA} seeds={args.seeds} "
          f"mean trials={MEAN_TRIALS:g} (geometric) candidates={len(CANDIDATES)}")
    print(f"{'eps':>4} {'way':>7} {'acc mean':>8} {'std':>6} {'eps spent':>9} {'trials':>10} "
          f"{'s':>5}")
    for epsilon in args.epsilons:
        for name, fn in (("recipe", recipe_run), ("search", search_run)):
            start = time.time()
            results = [fn(data, epsilon, seed) for seed in range(args.seeds)]
            accs = [a for a, _, _ in results]
            spent = max(e for _, e, _ in results)
            assert spent <= epsilon * (1 + 1e-9), (name, spent, epsilon)
            trials = ",".join(str(k) for _, _, k in results)
            print(f"{epsilon:4g} {name:>7} {np.nanmean(accs):8.4f} {np.nanstd(accs):6.4f} "
                  f"{spent:9.4f} {trials:>10} {time.time() - start:5.0f}", flush=True)


if __name__ == "__main__":
    main()
