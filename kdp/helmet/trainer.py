"""Projected SGD for the strongly convex single-layer learners (paper Alg. 1 and 2).

For every model (user) independently:

    f_0 = 0;   for m = 1..M:   f_m = Π_R( f_{m−1} − α_m ∇J_B(f_{m−1}) ),
    α_m = min(1/β, 1/(Λ m))                       (Wu et al. 2017; paper Thm. 3.12)

with ``B`` the m-th mini-batch of a seeded random order (a fresh permutation
every epoch, fixed batch size ``b``, the ``n mod b`` left-over records of an
epoch skipped), ``Π_R`` the projection onto the R-ball (bias row included,
per class for the SVM), no momentum.  Inputs are clipped to ``c`` and
augmented with a leading 1.  Under these conditions two runs with the same
seed on neighbouring datasets end within ``2L/(Λn)`` of each other
(:func:`kdp.helmet.constants.sensitivity`).

Many models train at once (a leading "user" axis), each with its own data,
hyper-parameters and number of steps; the loop is ``keras.ops.fori_loop``
compiled once per shape (``jax.jit`` / ``tf.function``).
"""

import dataclasses
import functools

import keras
import numpy as np
from keras import ops

from kdp.autodiff import compile_function
from kdp.helmet import constants, objectives
from kdp.helmet.preprocessing import FeatureClip, augment, clip_by_l2_norm
from kdp.training.seeds import draw_seed, numpy_generator


@dataclasses.dataclass(frozen=True)
class HelmetConfig:
    """Public hyper-parameters ξ of one learner.

    Args:
        learner: ``"softmax"`` (Softmax-SLP) or ``"huber_svm"`` (one-vs-rest).
        lam: regularisation Λ > 0 (objective term ``(Λ/2)‖f‖²``).
        R: radius of the weight ball.
        c: feature clipping bound (before the bias coordinate is added).
        h: Huber relaxation (SVM only).
        epochs: passes over the local data.
        batch_size: records per SGD step.
        fit_intercept: add the constant coordinate (the bias row).
    """

    learner: str = "softmax"
    lam: float = 1.0
    R: float = 1.0
    c: float = 1.0
    h: float = 0.1
    epochs: int = 10
    batch_size: int = 10
    fit_intercept: bool = True

    def __post_init__(self):
        constants.check_learner(self.learner)
        for name in ("lam", "R", "c", "h", "epochs", "batch_size"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")

    @property
    def input_bound(self):
        """Norm bound of the augmented input, ``√(c² + 1)`` with an intercept."""
        return constants.augmented_bound(self.c, self.fit_intercept)

    def rows(self, num_features):
        return num_features + int(self.fit_intercept)

    def lipschitz(self):
        return constants.lipschitz_constant(self.learner, self.lam, self.R, self.input_bound)

    def smoothness(self, num_features, num_classes):
        return constants.smoothness_constant(
            self.learner, self.lam, self.input_bound, self.rows(num_features), num_classes, self.h)

    def sensitivity(self, n, group_size=1):
        """``min(Υ·2L/(Λn), 2R)``: joint (softmax) or per class (SVM)."""
        return constants.sensitivity(self.learner, self.lam, self.R, self.input_bound, n, group_size)

    def k_comp(self, num_classes):
        return constants.k_comp(self.learner, num_classes)


def sample_order(n, batch_size, epochs, seed):
    """Mini-batch indices ``(epochs·⌊n/b⌋, b)``: one seeded permutation per epoch
    (``seed=None``: 64 bits of OS entropy)."""
    if n < batch_size:
        raise ValueError(f"a dataset of {n} records is smaller than batch_size={batch_size}")
    rng = numpy_generator(seed is not None, seed)
    per_epoch = (n // batch_size) * batch_size
    return np.concatenate(
        [rng.permutation(n)[:per_epoch].reshape(-1, batch_size) for _ in range(epochs)])


def _psgd(kind, fit_intercept, c, X, Y, idx, active, lam, R, inv_beta, h):
    """The compiled loop; every argument after ``fit_intercept`` is a tensor."""
    X = augment(clip_by_l2_norm(X, ops.reshape(c, (-1, 1, 1))), fit_intercept)
    num_steps = ops.shape(idx)[1]
    f0 = ops.zeros((ops.shape(X)[0], ops.shape(X)[2], ops.shape(Y)[2]), dtype=X.dtype)

    def body(m, f):
        ids = ops.expand_dims(ops.take(idx, m, axis=1), -1)  # (U, b, 1)
        xb = ops.take_along_axis(X, ids, axis=1)
        yb = ops.take_along_axis(Y, ids, axis=1)
        step = ops.minimum(inv_beta, 1.0 / (lam * ops.cast(m + 1, X.dtype)))
        g = objectives.gradient(kind, f, xb, yb, lam, h)
        new = objectives.project(kind, f - ops.reshape(step, (-1, 1, 1)) * g, R)
        on = ops.reshape(ops.take(active, m, axis=1), (-1, 1, 1))
        return ops.where(on > 0, new, f)

    return ops.fori_loop(0, num_steps, body, f0)


@functools.lru_cache(maxsize=None)
def _compiled(backend, kind, fit_intercept):
    return compile_function(functools.partial(_psgd, kind, fit_intercept))


def one_hot(y, num_classes):
    y = np.asarray(y).astype(int)
    if y.min() < 0 or y.max() >= num_classes:
        raise ValueError(f"labels must lie in [0, {num_classes})")
    return np.eye(num_classes, dtype="float32")[y]


def train_many(datasets, configs, num_classes, seeds):
    """Train one model per ``(X_i, y_i)`` in a single compiled loop.

    Args:
        datasets: list of ``(X_i (n_i, p), y_i (n_i,) int labels)``; same ``p``.
        configs: one :class:`HelmetConfig` or one per dataset (same learner,
            batch size and intercept; Λ, R, c, h, epochs may differ).
        num_classes: ``K``.
        seeds: one int per dataset, the seed of its sample order.
    Returns:
        float64 array ``(U, p + 1, K)`` (bias row first).
    """
    if isinstance(configs, HelmetConfig):
        configs = [configs] * len(datasets)
    if not (len(configs) == len(datasets) == len(seeds)) or not datasets:
        raise ValueError("datasets, configs and seeds must be non-empty and of equal length")
    first = configs[0]
    for cfg in configs:
        if (cfg.learner, cfg.batch_size, cfg.fit_intercept) != (
                first.learner, first.batch_size, first.fit_intercept):
            raise ValueError("learner, batch_size and fit_intercept must be shared by one call")
    p = np.asarray(datasets[0][0]).shape[1]
    n_max = max(len(X) for X, _ in datasets)
    orders = [sample_order(len(X), cfg.batch_size, cfg.epochs, s)
              for (X, _), cfg, s in zip(datasets, configs, seeds)]
    steps = max(len(o) for o in orders)
    U, b = len(datasets), first.batch_size
    Xp = np.zeros((U, n_max, p), "float32")
    Yp = np.zeros((U, n_max, num_classes), "float32")
    idx = np.zeros((U, steps, b), "int32")
    active = np.zeros((U, steps), "float32")
    for u, ((X, y), order) in enumerate(zip(datasets, orders)):
        X = np.asarray(X, "float32")
        if X.ndim != 2 or X.shape[1] != p or not np.all(np.isfinite(X)):
            raise ValueError("every X must be a finite (n, p) array with the same p")
        Xp[u, : len(X)] = X
        Yp[u, : len(X)] = one_hot(y, num_classes)
        idx[u, : len(order)] = order
        active[u, : len(order)] = 1.0
    vec = lambda values: np.asarray(values, "float32")  # noqa: E731
    inv_beta = [1.0 / cfg.smoothness(p, num_classes) for cfg in configs]
    fn = _compiled(keras.backend.backend(), first.learner, first.fit_intercept)
    f = fn(vec([cfg.c for cfg in configs]), Xp, Yp, idx, active, vec([cfg.lam for cfg in configs]),
           vec([cfg.R for cfg in configs]), vec(inv_beta), vec([cfg.h for cfg in configs]))
    return np.asarray(ops.convert_to_numpy(f), dtype="float64")


class SingleLayerTrainer:
    """Non-private learner ``T(D, ξ)`` of DP-Helmet: projected SGD, then a Keras head.

    It releases nothing private by itself: `kdp.helmet.private_fit` and
    `kdp.helmet.FederatedSimulator` perturb its output through a privacy gate.

    Example:
        >>> trainer = SingleLayerTrainer(HelmetConfig("softmax", lam=1.0, R=1.0, c=1.0))
        >>> f = trainer.fit(X, y, num_classes=10)            # (p + 1, K)
        >>> head = trainer.to_keras(f)                       # FeatureClip → Dense
    """

    def __init__(self, config):
        self.config = config

    def fit(self, X, y, num_classes, seed=None):
        """The trained weights ``(p + 1, K)`` (bias row first). ``seed`` fixes the
        sample order (default: 64 bits of OS entropy; the order need not be secret)."""
        return train_many([(X, y)], self.config, num_classes,
                          [draw_seed(seed is not None, seed)])[0]

    def to_dense(self, weights, **kwargs):
        """A built ``keras.layers.Dense(K)`` holding ``weights`` (kernel ``f[1:]``, bias ``f[0]``).

        It expects clipped features; :meth:`to_keras` adds the clipping.
        """
        weights = np.asarray(weights, "float32")
        start = int(self.config.fit_intercept)
        dense = keras.layers.Dense(weights.shape[1], use_bias=self.config.fit_intercept, **kwargs)
        dense.build((None, weights.shape[0] - start))
        dense.set_weights([weights[start:], weights[0]] if start else [weights])
        return dense

    def to_keras(self, weights, name="dp_helmet_head"):
        """``keras.Sequential([Input(p), FeatureClip(c), Dense(K)])`` returning logits."""
        p = np.asarray(weights).shape[0] - int(self.config.fit_intercept)
        return keras.Sequential(
            [keras.Input((p,)), FeatureClip(self.config.c), self.to_dense(weights)], name=name)
