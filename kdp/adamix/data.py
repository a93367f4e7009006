"""A mixed public/private split of scikit-learn's bundled digits (no download)."""

import numpy as np


def digits_features(images):
    """Data-independent features: pixels/16 − 1/2 plus a constant 1 (normalised later by the trainer)."""
    x = np.asarray(images, dtype=np.float32).reshape(len(images), -1) / 16.0 - 0.5
    return np.concatenate([x, np.ones((len(x), 1), np.float32)], axis=1)


def digits_mixed_split(public_per_class=2, test_fraction=0.3, seed=0):
    """Split digits into public (``public_per_class`` per class), private and test sets.

    Returns a dict with ``x_public, y_public, x_private, y_private, x_test, y_test``
    (features from `digits_features`, 65-d) and ``num_classes``.
    """
    from sklearn.datasets import load_digits

    data = load_digits()
    x, y = digits_features(data.images), data.target.astype(np.int64)
    rng = np.random.default_rng(seed)
    perm = rng.permutation(len(y))
    n_test = int(round(test_fraction * len(y)))
    test, train = perm[:n_test], perm[n_test:]
    public = np.concatenate([train[y[train] == c][:public_per_class] for c in range(10)])
    private = np.setdiff1d(train, public)
    rng.shuffle(private)
    return {"x_public": x[public], "y_public": y[public], "x_private": x[private],
            "y_private": y[private], "x_test": x[test], "y_test": y[test], "num_classes": 10}
