"""AdaMix and its baselines: linear softmax heads trained by full-batch (noisy) GD.

All trainers share one API::

    trainer = AdaMix(num_classes=10, epsilon=1.0, delta=1e-5, noise_multiplier=20)
    trainer.fit(x_private, y_private, public_data=(x_public, y_public))
    trainer.error(x_test, y_test); trainer.privacy_spent(); trainer.head  # a keras Dense

Every trainer owns a `kdp.training.PrivacyGate` (``privacy_gate``): each noisy
step is recorded in ``privacy_ledger`` (one ``GaussianDpEvent(σ)``) before it
runs, and ``privacy_spent()`` composes the ledger with dp-accounting.
`AdaMix.privacy` also reports the paper's GDP accounting of one run (tight for
these Gaussians, so it is below ``privacy_spent(accountant="rdp")``). The noise
comes from `kdp.training.seeds` (64 bits of OS entropy, never Keras' global
seed) unless ``reproducible=True`` with an explicit ``seed`` (tests only).

Features are L2-normalised inside the trainer (``normalize=True``; a per-example,
data-independent map), labels are integers in ``[0, num_classes)``. The weights live
in ``trainer.head``, a bias-free `keras.layers.Dense(num_classes)`;
`keras_model()` wraps it with `keras.layers.UnitNormalization`.

Source: Golatkar, Achille, Wang, Roth, Kearns, Soatto, "Mixed Differential Privacy
in Computer Vision", CVPR 2022 (Algorithms 1–2), with the GDP composition of
Dong, Roth and Su, "Gaussian Differential Privacy" (JRSS-B 2022).
"""

import math

import dp_accounting
import keras
import numpy as np
from keras import ops

from kdp.adamix import core
from kdp.adamix.diagnostics import PerInstanceLedger
from kdp.adamix.gdp import calibrate_steps, gdp_eps, noisy_gd_event, noisy_gd_mu
from kdp.training import seeds
from kdp.training.gate import PrivacyGate
from kdp.training.ledger import event_mechanism

SCOPE = "private data only (add/remove one private example), for any fixed public set"


class LinearHeadTrainer:
    """Base: a bias-free linear softmax head trained by full-batch gradient descent,
    with a `kdp.training.PrivacyGate` (``privacy_gate``) for its releases."""

    def __init__(self, num_classes, *, normalize=True, seed=None, delta=1e-5, epsilon_max=None):
        if int(num_classes) < 2:
            raise ValueError(f"num_classes must be >= 2, got {num_classes}")
        self.num_classes = int(num_classes)
        self.normalize = bool(normalize)
        self.seed = seed
        self.head = None
        self.history = []
        self.privacy_gate = PrivacyGate(delta, epsilon_max=epsilon_max, name=type(self).__name__)

    @property
    def privacy_ledger(self):
        """The `PrivacyLedger` of every release made by this trainer."""
        return self.privacy_gate.ledger

    def privacy_spent(self, accountant="rdp"):
        """``(ε, δ)`` of every release in the ledger (dp-accounting)."""
        return self.privacy_gate.privacy_spent(accountant)

    # -- data ---------------------------------------------------------------
    def _features(self, x):
        x = np.asarray(x, dtype=np.float32)
        if x.ndim != 2:
            raise ValueError(f"features must be a 2-D array (N, D), got shape {x.shape}")
        if not np.all(np.isfinite(x)):
            raise ValueError("features contain NaN or inf")
        x = ops.convert_to_tensor(x)
        if self.normalize:
            x = x / ops.maximum(ops.norm(x, axis=1, keepdims=True), 1e-12)
        return x

    def _labels(self, y, n):
        y = np.asarray(y).reshape(-1)
        if y.shape[0] != n:
            raise ValueError(f"{y.shape[0]} labels for {n} examples")
        if not np.issubdtype(y.dtype, np.integer):
            if not np.all(np.mod(y, 1) == 0):
                raise ValueError("labels must be integers")
            y = y.astype(np.int64)
        if y.size and (y.min() < 0 or y.max() >= self.num_classes):
            raise ValueError(f"labels must lie in [0, {self.num_classes})")
        return ops.one_hot(ops.convert_to_tensor(y.astype("int32")), self.num_classes)

    def _data(self, x, y):
        x = self._features(x)
        return x, self._labels(y, int(x.shape[0]))

    def _build(self, dim):
        self.head = keras.layers.Dense(self.num_classes, use_bias=False, kernel_initializer="zeros")
        self.head.build((None, dim))
        self.history = []

    @property
    def weights_(self):
        """The D×C kernel as a numpy array."""
        return ops.convert_to_numpy(self.head.kernel)

    # -- plain GD (public pre-training, baselines) ---------------------------
    @staticmethod
    def _gd(w, x, y, steps, learning_rate, weight_decay, center=None):
        """``w ← w − η (Σ_j ∇ℓ_j(w) + λ (w − center))``: ``steps`` full-batch steps, no noise."""
        for _ in range(int(steps)):
            grad = core.gradient_sum(x, core.residuals(w, x, y))
            grad = grad + weight_decay * (w if center is None else w - center)
            w = w - learning_rate * grad
        return w

    # -- inference -----------------------------------------------------------
    def predict(self, x):
        """Class probabilities (numpy, N×C)."""
        self._check_fitted()
        return ops.convert_to_numpy(ops.softmax(self.head(self._features(x)), axis=-1))

    def error(self, x, y):
        """Test error: the fraction of misclassified examples."""
        return float(np.mean(np.argmax(self.predict(x), axis=1) != np.asarray(y).reshape(-1)))

    def losses(self, x, y):
        """Per-example cross-entropy (numpy), e.g. for `membership_auc`."""
        p = self.predict(x)
        return -np.log(np.maximum(p[np.arange(len(p)), np.asarray(y).reshape(-1)], 1e-30))

    def keras_model(self):
        """``Sequential([UnitNormalization, head])`` (without normalisation if ``normalize=False``)."""
        self._check_fitted()
        layers = [keras.Input((int(self.head.kernel.shape[0]),))]
        if self.normalize:
            layers.append(keras.layers.UnitNormalization())
        return keras.Sequential(layers + [self.head])

    def _check_fitted(self):
        if self.head is None:
            raise RuntimeError("call fit() first")

    def privacy(self):
        raise NotImplementedError


class AdaMix(LinearHeadTrainer):
    """AdaMix (Golatkar et al. 2022, Algorithm 2): NoisyGD on private data, helped by public data.

    1. ``W ← Pretrain(D_pub)``: ``pretrain_steps`` full-batch GD steps on the public loss
       from ``W = 0`` (``w_pub``).
    2. For ``t = 1..T`` (full batch, no sampling), at the current ``W`` and from public
       data only: ``τ_t = quantile_q{‖g̃_j^pub‖}``, ``G^pub = Σ_j g_j^pub``, ``U_t`` = top-P
       left singular vectors of ``G^pub`` (D×P, see `core.public_subspace` for P > rank);

           Ĝ = Σ_i U_tᵀ clip_τt(g_i^pri) + n_t,   n_t ~ N(0, σ² τ_t² I_{P×C}),
           W ← W − η (G^pub + U_t Ĝ + λ (W − W_ref)),   W_ref ∈ {0, w_pub, array}.

    **Privacy.** The guarantee covers **the private data only**, under add/remove of
    one private example, and holds **for any fixed public set** (mixed DP, §3.1).
    τ_t and U_t are functions of the public data and of W_t (post-processing of
    earlier releases), and ‖U_tᵀ g̃_i‖ ≤ τ_t, so each step is a Gaussian mechanism
    with multiplier σ: ``μ = √T/σ`` GDP overall (Prop. 5 with ρ = T/(2σ²)), and
    ``T = calibrate_steps(ε, δ, σ)`` when ``epsilon`` is given. Hyper-parameter
    search on private data is not accounted for.

    Args:
        num_classes: C.
        epsilon, steps: give exactly one; ``steps = calibrate_steps(epsilon, delta, σ)``.
        delta: target δ (must be < 1/N_private).
        noise_multiplier: σ (noise std / τ_t). The paper uses 20 and advises a large σ
            (privacy depends on σ/√T only).
        learning_rate: η for the summed loss.
        weight_decay: λ. ``weight_decay_center``: ``"zero"`` (the paper's practice),
            ``"public"`` (the public solution, as in Theorem 3) or an array (D×C).
        clip_quantile: q of the public norms (paper: 0.9). ``clip_norm``: a fixed τ
            instead, or ``"analytic"`` for ``√2`` (‖x‖ = 1 bounds ‖g‖ by √2: no clipping).
        subspace_dim: P (None: the rank of ``G^pub``); ``projection=False`` skips it.
        rank_policy, rank_rtol: see `core.public_subspace`.
        pretrain_steps, pretrain_learning_rate: public pre-training (paper: 200 steps);
            the default rate is ``2 / N_pub`` (i.e. 2 for the mean loss).
        add_public_gradient: add the (unnoised) public gradient to each update.
        averaging: None or ``"linear"`` (``w̄ = Σ_t 2t/(T(T+1)) w_t``, Algorithm 3).
        track_per_instance: keep the Prop. 14 ledger (`per_instance`, NOT for release).
        keep_trajectory: keep every ``W_t`` in ``history`` (tests, audits).
        epsilon_max: a budget (RDP) over every `fit` of this trainer: a fit whose
            steps would exceed it raises before it starts.
        reproducible, seed: fix the noise (tests only; both are needed). By
            default the noise is seeded from 64 bits of OS entropy.

    Choosing P: ``rank(G^pub) ≤ C − 1``, so the default (P = rank, ``"truncate"``)
    keeps at most C − 1 feature directions. The paper's P = 2000 of 2048 ResNet-50
    features is close to no projection. On digits (D = 65, C = 10, 2 public shots)
    P = rank cost 7–8 points of error against ``projection=False``
    (`benchmarks/adamix_digits.py`); projection pays only when D·C ≫ N_private.
    Quantile clipping makes τ_t small (≈ 0.2–0.3 after pre-training), so η must be
    larger than the paper's grid (2e-2 to 8e-2 on digits).
    """

    uses_public_data = True

    def __init__(self, num_classes, *, epsilon=None, steps=None, delta=1e-5, noise_multiplier=20.0,
                 learning_rate=2.5e-3, weight_decay=1e-2, weight_decay_center="zero",
                 clip_quantile=0.9, clip_norm=None, subspace_dim=None, projection=True,
                 rank_policy="truncate", rank_rtol=1e-5, pretrain_steps=200,
                 pretrain_learning_rate=None, add_public_gradient=True, averaging=None,
                 track_per_instance=False, keep_trajectory=False, normalize=True, seed=None,
                 reproducible=False, epsilon_max=None):
        if not 0 < delta < 1:
            raise ValueError(f"delta must be in (0, 1), got {delta}")
        super().__init__(num_classes, normalize=normalize, seed=seed, delta=delta,
                         epsilon_max=epsilon_max)
        seeds.check_seed(reproducible, seed)
        self.reproducible = bool(reproducible)
        if (epsilon is None) == (steps is None):
            raise ValueError("give exactly one of epsilon and steps")
        if noise_multiplier <= 0:
            raise ValueError(f"noise_multiplier must be > 0, got {noise_multiplier}")
        self.target_epsilon = epsilon
        self.delta = float(delta)
        self.noise_multiplier = float(noise_multiplier)
        self.steps = calibrate_steps(epsilon, delta, noise_multiplier) if steps is None else int(steps)
        if self.steps < 0:
            raise ValueError(f"steps must be >= 0, got {steps}")
        self.learning_rate = float(learning_rate)
        self.weight_decay = float(weight_decay)
        if isinstance(weight_decay_center, str) and weight_decay_center not in ("zero", "public"):
            raise ValueError("weight_decay_center must be 'zero', 'public' or an array")
        self.weight_decay_center = weight_decay_center
        if clip_norm is None:
            if not 0 < clip_quantile <= 1:
                raise ValueError(f"clip_quantile must be in (0, 1], got {clip_quantile}")
        elif clip_norm == "analytic":
            if not normalize:
                raise ValueError("clip_norm='analytic' needs normalize=True (it relies on ‖x‖ = 1)")
        elif not float(clip_norm) > 0:
            raise ValueError(f"clip_norm must be > 0, 'analytic' or None, got {clip_norm}")
        self.clip_quantile = float(clip_quantile)
        self.clip_norm = clip_norm
        self.subspace_dim = subspace_dim
        self.projection = bool(projection)
        if rank_policy not in core.RANK_POLICIES:
            raise ValueError(f"rank_policy must be one of {core.RANK_POLICIES}, got {rank_policy!r}")
        self.rank_policy = rank_policy
        self.rank_rtol = float(rank_rtol)
        self.pretrain_steps = int(pretrain_steps)
        self.pretrain_learning_rate = pretrain_learning_rate
        self.add_public_gradient = bool(add_public_gradient)
        if averaging not in (None, "linear"):
            raise ValueError(f"averaging must be None or 'linear', got {averaging!r}")
        self.averaging = averaging
        self.track_per_instance = bool(track_per_instance)
        self.keep_trajectory = bool(keep_trajectory)
        self.per_instance = None
        self.public_solution = None

    # -- the private part ----------------------------------------------------
    def _clip_threshold(self, norms_pub):
        if self.clip_norm == "analytic":
            return ops.convert_to_tensor(math.sqrt(2.0), "float32")
        if self.clip_norm is not None:
            return ops.convert_to_tensor(float(self.clip_norm), "float32")
        if norms_pub is None:
            raise ValueError("quantile clipping needs public data; give clip_norm instead")
        return core.public_clip_threshold(norms_pub, self.clip_quantile)

    def public_statistics(self, w, x_pub, y_pub):
        """``(τ, U, G^pub, rank)`` at ``w``: functions of the public data and ``w`` only."""
        g_pub, norms, u, rank = None, None, None, None
        if x_pub is not None:
            r_pub = core.residuals(w, x_pub, y_pub)
            g_pub = core.gradient_sum(x_pub, r_pub)
            norms = core.per_example_norms(x_pub, r_pub)
        tau = self._clip_threshold(norms)
        if self.projection:
            u, rank = core.public_subspace(g_pub, self.subspace_dim, self.rank_policy,
                                           self.rank_rtol, x_pub)
        return tau, u, g_pub, rank

    def _split(self, x_pri, y_pri, public_data):
        """``(x_pri, y_pri, x_pub, y_pub)``: the private set and the public set."""
        if public_data is None:
            raise ValueError("AdaMix needs public_data=(x_public, y_public)")
        x_pub, y_pub = self._data(*public_data)
        return x_pri, y_pri, x_pub, y_pub

    def fit(self, x_private, y_private, public_data=None):
        """Train on the private set ``(x_private, y_private)`` helped by ``public_data``."""
        x_pri, y_pri = self._data(x_private, y_private)
        x_pri, y_pri, x_pub, y_pub = self._split(x_pri, y_pri, public_data)
        n_pri, dim = int(x_pri.shape[0]), int(x_pri.shape[1])
        if x_pub is not None and int(x_pub.shape[1]) != dim:
            raise ValueError("public and private features differ in dimension")
        if self.delta >= 1.0 / max(n_pri, 1):
            raise ValueError(f"delta={self.delta} must be < 1/N_private = {1.0 / n_pri:.3g}")
        mechanism = self.step_mechanism()
        self.privacy_gate.begin_run(mechanism, self.steps)  # the whole run, before anything runs
        self._build(dim)
        w = ops.zeros((dim, self.num_classes))
        if self.pretrain_steps and x_pub is not None:
            lr = self.pretrain_learning_rate or 2.0 / int(x_pub.shape[0])
            w = self._gd(w, x_pub, y_pub, self.pretrain_steps, lr, self.weight_decay)
        self.public_solution = ops.convert_to_numpy(w)
        center = self._center(dim)
        seed_gen = seeds.seed_generator(self.reproducible, self.seed)
        self.per_instance = PerInstanceLedger(n_pri) if self.track_per_instance else None
        w_avg = w
        for t in range(1, self.steps + 1):
            tau, u, g_pub, rank = self.public_statistics(w, x_pub, y_pub)
            record = {"step": t, "tau": float(ops.convert_to_numpy(tau)), "rank": rank,
                      "dim": None if u is None else int(u.shape[1])}
            if self.keep_trajectory:
                record["weights"] = ops.convert_to_numpy(w)
            with self.privacy_gate.spend(mechanism):  # recorded before the release
                if u is not None and int(u.shape[1]) == 0:
                    update = ops.zeros_like(w)  # nothing private is released (still counted)
                    contrib = np.zeros(n_pri)
                else:
                    noisy, _, contrib = core.private_release(w, x_pri, y_pri, tau,
                                                             self.noise_multiplier, seed_gen, u)
                    update = noisy if u is None else ops.matmul(u, noisy)
            if self.per_instance is not None:
                self.per_instance.record(ops.convert_to_numpy(contrib), record["tau"],
                                         self.noise_multiplier)
            if self.add_public_gradient and g_pub is not None:
                update = update + g_pub
            update = update + self.weight_decay * (w if center is None else w - center)
            w = w - self.learning_rate * update
            if self.averaging == "linear":
                w_avg = w_avg + (2.0 / (t + 1)) * (w - w_avg)
            self.history.append(record)
        self.head.kernel.assign(w_avg if self.averaging == "linear" and self.steps else w)
        return self

    def _center(self, dim):
        c = self.weight_decay_center
        if isinstance(c, str):
            return None if c == "zero" else ops.convert_to_tensor(self.public_solution)
        c = np.asarray(c, dtype=np.float32)
        if c.shape != (dim, self.num_classes):
            raise ValueError(f"weight_decay_center must have shape {(dim, self.num_classes)}")
        return ops.convert_to_tensor(c)

    # -- accounting ------------------------------------------------------------
    def step_mechanism(self):
        """The ledger key of one step: ``GaussianDpEvent(σ)`` (full batch, add/remove)."""
        return event_mechanism(dp_accounting.GaussianDpEvent(self.noise_multiplier))

    def privacy(self):
        """``{epsilon, delta, mu, steps, noise_multiplier, scope}`` of one run of
        `fit`: μ = √T/σ GDP (the paper's accounting; `privacy_spent` composes
        every run in the ledger)."""
        mu = noisy_gd_mu(self.noise_multiplier, self.steps)
        return {"epsilon": gdp_eps(mu, self.delta), "delta": self.delta, "mu": mu,
                "steps": self.steps, "noise_multiplier": self.noise_multiplier, "scope": SCOPE}

    def dp_event(self):
        """The run as a `dp_accounting.DpEvent` (add/remove, full batch)."""
        return noisy_gd_event(self.noise_multiplier, self.steps)


class NoisyGD(AdaMix):
    """Fully private baseline (Algorithm 1): NoisyGD from ``W = 0`` with a fixed clip τ.

    ``W ← W − η (Σ_i clip_τ(g_i) + N(0, σ²τ² I_{D×C}) + λ W)``; no pre-training, no
    projection, no public gradient. Public data, if given, is **treated as private**
    (merged into the private set, as the paper's Fully-Private baseline). The
    guarantee (μ = √T/σ GDP) then covers all the data. ``clip_norm``: a float or
    ``"analytic"`` (√2, exact for unit features: nothing is clipped).
    """

    uses_public_data = False

    def __init__(self, num_classes, *, epsilon=None, steps=None, delta=1e-5, noise_multiplier=20.0,
                 learning_rate=2.5e-3, weight_decay=1e-2, clip_norm="analytic", averaging=None,
                 track_per_instance=False, keep_trajectory=False, normalize=True, seed=None,
                 reproducible=False, epsilon_max=None):
        super().__init__(num_classes, epsilon=epsilon, steps=steps, delta=delta,
                         noise_multiplier=noise_multiplier, learning_rate=learning_rate,
                         weight_decay=weight_decay, clip_norm=clip_norm, projection=False,
                         pretrain_steps=0, add_public_gradient=False, averaging=averaging,
                         track_per_instance=track_per_instance, keep_trajectory=keep_trajectory,
                         normalize=normalize, seed=seed, reproducible=reproducible,
                         epsilon_max=epsilon_max)

    def _split(self, x_pri, y_pri, public_data):
        if public_data is not None:
            x_pub, y_pub = self._data(*public_data)
            x_pri, y_pri = ops.concatenate([x_pri, x_pub], 0), ops.concatenate([y_pri, y_pub], 0)
        return x_pri, y_pri, None, None

    def privacy(self):
        out = super().privacy()
        out["scope"] = "all training data (public data, if given, is treated as private)"
        return out


class PublicOnly(LinearHeadTrainer):
    """Baseline: non-private GD on the public data only (ε = 0 for the private data)."""

    uses_public_data = True

    def __init__(self, num_classes, *, steps=200, learning_rate=None, weight_decay=1e-2,
                 normalize=True, seed=None):
        super().__init__(num_classes, normalize=normalize, seed=seed)
        self.steps, self.learning_rate, self.weight_decay = int(steps), learning_rate, float(weight_decay)

    def fit(self, x_private, y_private, public_data=None):
        """Ignores the private data (its shape is still checked)."""
        if public_data is None:
            raise ValueError("PublicOnly needs public_data=(x_public, y_public)")
        x_pub, y_pub = self._data(*public_data)
        self._build(int(x_pub.shape[1]))
        lr = self.learning_rate or 2.0 / int(x_pub.shape[0])
        w = self._gd(ops.zeros((int(x_pub.shape[1]), self.num_classes)), x_pub, y_pub,
                     self.steps, lr, self.weight_decay)
        self.head.kernel.assign(w)
        return self

    def privacy(self):
        return {"epsilon": 0.0, "delta": 0.0, "mu": 0.0, "steps": 0, "scope": SCOPE}


class NonPrivate(LinearHeadTrainer):
    """Paragon: non-private full-batch GD on public ∪ private data (no privacy: its
    ledger records a ``NonPrivateDpEvent``, ``privacy_spent()`` is ε = ∞)."""

    uses_public_data = True

    def __init__(self, num_classes, *, steps=300, learning_rate=None, weight_decay=1e-2,
                 normalize=True, seed=None):
        super().__init__(num_classes, normalize=normalize, seed=seed)
        self.steps, self.learning_rate, self.weight_decay = int(steps), learning_rate, float(weight_decay)

    def fit(self, x_private, y_private, public_data=None):
        x, y = self._data(x_private, y_private)
        if public_data is not None:
            x_pub, y_pub = self._data(*public_data)
            x, y = ops.concatenate([x, x_pub], 0), ops.concatenate([y, y_pub], 0)
        self._build(int(x.shape[1]))
        lr = self.learning_rate or 2.0 / int(x.shape[0])
        mechanism = event_mechanism(dp_accounting.NonPrivateDpEvent())
        self.privacy_gate.begin_run(mechanism)
        with self.privacy_gate.spend(mechanism):
            w = self._gd(ops.zeros((int(x.shape[1]), self.num_classes)), x, y, self.steps, lr,
                         self.weight_decay)
        self.head.kernel.assign(w)
        return self

    def privacy(self):
        return {"epsilon": math.inf, "delta": 1.0, "mu": math.inf, "steps": self.steps,
                "scope": "none (non-private)"}
