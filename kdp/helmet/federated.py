"""Blind averaging across users (paper Alg. 3, Lem. 5.1–5.2, App. G) and a simulator.

Every user i trains ``f_i = T(D_i, ξ)`` alone and sends, once,

    c_i = (n_i/w)·f_i + N(0, (σ·Δ / √(t·w))² I),   Δ = max_i (n_i/w)·s_i

(:func:`kdp.helmet.constants.aggregate_sensitivity`; with record-level
sensitivity ``s_i = 2L/(Λ n_i)`` this is Alg. 3's ``(n_i/w)(f_i + N(0, σ̃² s_i²))``,
``σ̃ = σ/√(t w)``).  The server releases ``Σ_i c_i``.  Changing one record moves
the sum by at most Δ, and the noise of the ``t·w`` honest users alone has std
``σ·Δ``: the central calibration, whatever the other users do.  If all users
are honest the sum carries ``1/√t`` times that noise.  ``w = 1`` is centralised
DP-Helmet (``t = 1``).

Every release goes through the simulator's `kdp.training.PrivacyGate`
(recorded before it runs, as ``privacy.dp_event``), and its noise and secret
shares come from `kdp.training.seeds` (64 bits of OS entropy unless
``reproducible=True``).
"""

import math

import dp_accounting
import numpy as np

from kdp.helmet import constants, privacy
from kdp.helmet.trainer import train_many
from kdp.training import seeds
from kdp.training.gate import PrivacyGate
from kdp.training.ledger import event_mechanism


def split_iid(n, num_users, seed=0):
    """Indices of ``n`` records shuffled and dealt into ``num_users`` near-equal parts
    (an experiment helper: the split itself is not a private release)."""
    if not 1 <= num_users <= n:
        raise ValueError(f"need 1 <= num_users <= n, got {num_users} users for {n} records")
    return [np.sort(p) for p in np.array_split(np.random.default_rng(seed).permutation(n), num_users)]


def split_one_class_per_user(y, num_users, seed=0):
    """Strongly non-IID: user u holds only class ``u mod K``, that class split evenly.

    Needs ``num_users ≥ K`` so that every class has a user.
    """
    y = np.asarray(y)
    classes = np.unique(y)
    if num_users < len(classes):
        raise ValueError(f"one class per user needs at least {len(classes)} users")
    rng = np.random.default_rng(seed)
    parts = [None] * num_users
    for k, cls in enumerate(classes):
        owners = list(range(k, num_users, len(classes)))
        members = rng.permutation(np.flatnonzero(y == cls))
        for owner, chunk in zip(owners, np.array_split(members, len(owners))):
            parts[owner] = np.sort(chunk)
    return parts


def client_contribution(weights, n_i, num_users, sigma, aggregate_sens, honest_fraction, rng):
    """``(n_i/w)·f_i + N(0, (σΔ/√(t w))²)``: what one client feeds into the secure sum
    (``rng``: a generator from `kdp.training.seeds.numpy_generator`)."""
    _check_honest(honest_fraction, num_users)
    scale = sigma * aggregate_sens / math.sqrt(honest_fraction * num_users)
    weights = np.asarray(weights, dtype="float64")
    return (n_i / num_users) * weights + rng.normal(0.0, scale, size=weights.shape)


def _check_honest(honest_fraction, num_users):
    if not 0 < honest_fraction <= 1 or honest_fraction * num_users < 1:
        raise ValueError("need 0 < t <= 1 and at least one honest user (t·w >= 1)")


def server_sum(contributions, secure_sum=None, seed=None):
    """``Σ_i c_i``, in the clear or through a :class:`kdp.helmet.secure_sum.SecureSum`
    (``seed``: of the secret shares, tests only)."""
    if secure_sum is None:
        return np.sum(np.stack(contributions), axis=0)
    return secure_sum.sum(contributions, seed=seed)


class FederatedSimulator:
    """Runs DP-Helmet with ``w`` users: local training once, then releases at any ε.

    Args:
        config: :class:`kdp.helmet.trainer.HelmetConfig` shared by all users.
        num_classes: K.
        honest_fraction: t (forced to 1 when there is a single user).
        group_size: Υ records protected together (``None``: the user level, 2R).
        secure_sum: optional ``SecureSum``; ``None`` adds in the clear.
        delta: the δ at which `privacy_spent` composes every release (and the
            default δ of `release`).
        epsilon_max: a budget (RDP) over every release of this simulator: a
            release that would exceed it raises before it runs.

    Example:
        >>> sim = FederatedSimulator(cfg, 10).train(X, y, split_iid(len(X), 100))
        >>> model = sim.release(eps=1.0, delta=1e-5)["model"]
        >>> sim.privacy_spent(accountant="pld")
    """

    def __init__(self, config, num_classes, honest_fraction=0.5, group_size=1, secure_sum=None,
                 delta=1e-5, epsilon_max=None):
        self.config, self.num_classes = config, num_classes
        self.honest_fraction, self.group_size, self.secure_sum = honest_fraction, group_size, secure_sum
        self.privacy_gate = PrivacyGate(delta, epsilon_max=epsilon_max, name="FederatedSimulator")
        self.local = None

    @property
    def privacy_ledger(self):
        """The `PrivacyLedger` of every release of this simulator."""
        return self.privacy_gate.ledger

    def privacy_spent(self, accountant="rdp"):
        """``(ε, δ)`` of every release so far, composed by dp-accounting (``"pld"``
        is nearly tight for these Gaussians; ``"rdp"`` is an upper bound)."""
        return self.privacy_gate.privacy_spent(accountant)

    def train(self, X, y, parts, seed=None):
        """Trains every user's model on ``X[parts[i]]`` (one compiled call).

        ``seed`` fixes the local sample orders (default: OS entropy). The output
        sensitivity holds for every order (Kirschte et al. 2022, Thm. J.2), so
        the order need not be secret.
        """
        X, y = np.asarray(X), np.asarray(y)
        self.sizes = [len(p) for p in parts]
        entropy = seeds.draw_seed(seed is not None, seed)
        order_seeds = np.random.SeedSequence(entropy).generate_state(len(parts))
        self.local = train_many([(X[p], y[p]) for p in parts], self.config, self.num_classes,
                                [int(s) for s in order_seeds])
        return self

    @property
    def num_users(self):
        return len(self.sizes)

    def aggregate_sensitivity(self):
        cfg = self.config
        group = max(self.sizes) if self.group_size is None else self.group_size
        return constants.aggregate_sensitivity(cfg.learner, cfg.lam, cfg.R, cfg.input_bound,
                                               self.sizes, group_size=group)

    def release(self, eps, delta=None, seed=None, noiseless=False, reproducible=False):
        """The released sum, the averaged model ``Σ n_i f_i / N`` and the privacy numbers.

        The release is recorded in `privacy_ledger` before it runs (a
        ``noiseless=True`` one, for tests, as non-private: ε = ∞). The noise and
        the secret shares come from 64 bits of OS entropy unless
        ``reproducible=True`` with an explicit ``seed`` (tests only).
        """
        if self.local is None:
            raise RuntimeError("call train() first")
        seeds.check_seed(reproducible, seed)
        delta = self.privacy_gate.delta if delta is None else delta
        n = sum(self.sizes)
        if not (delta < 1.0 / n and self.privacy_gate.delta < 1.0 / n):
            raise ValueError(f"delta (of the release and of the simulator) must be below 1/N = "
                             f"{1.0 / n:.3g}")
        w = self.num_users
        t = 1.0 if w == 1 else self.honest_fraction
        _check_honest(t, w)
        k = self.config.k_comp(self.num_classes)
        sigma = privacy.calibrate_sigma(eps, delta, k)
        agg = self.aggregate_sensitivity()
        event = dp_accounting.NonPrivateDpEvent() if noiseless else privacy.dp_event(sigma, k)
        self.privacy_gate.begin_run(event_mechanism(event))
        with self.privacy_gate.spend(event_mechanism(event)):
            rng = seeds.numpy_generator(reproducible, seed)
            contributions = [
                (n_i / w) * f if noiseless else client_contribution(f, n_i, w, sigma, agg, t, rng)
                for f, n_i in zip(self.local, self.sizes)]
            share_seed = seeds.draw_seed(True, seed, 1) if reproducible else None
            released = server_sum(contributions, self.secure_sum, seed=share_seed)
        return {"released": released, "model": released * w / n, "sigma": sigma,
                "aggregate_sensitivity": agg, "noise_std": sigma * agg / math.sqrt(t),
                "honest_fraction": t, "users": w}
