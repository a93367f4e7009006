"""DP-Helmet (kdp.helmet): sensitivity, constants, calibration, blind averaging, secret sharing.

The checks of the DP-Helmet results (Kirschte et al.), each with a negative control that must fail.
"""

import itertools
import math

import keras
import numpy as np
import pytest
from scipy import stats

from kdp.helmet import (FederatedSimulator, HelmetConfig, SecureSum, SingleLayerTrainer,
                        aggregate_sensitivity, augmented_bound, calibrate_sigma, classical_sigma,
                        client_contribution, epsilon, epsilon_dp_accounting, gaussian_delta,
                        lipschitz_constant, private_fit, sensitivity, smoothness_constant,
                        split_iid, split_one_class_per_user, train_many)
from kdp.helmet import objectives

LEARNERS = ("softmax", "huber_svm")


def _as_np(t):
    return np.asarray(keras.ops.convert_to_numpy(t), dtype="float64")


def _distance(kind, f, g):
    """Joint Frobenius distance (softmax) or the largest per-class distance (SVM)."""
    diff = f - g
    return np.linalg.norm(diff) if kind == "softmax" else np.linalg.norm(diff, axis=0).max()


# ---------------------------------------------------------------- output sensitivity


def _random_neighbours(rng, kind, batch, count, p=4, K=3):
    configs, datasets, seeds = [], [], []
    for _ in range(count):
        n = int(rng.integers(max(batch, 8), 41))
        cfg = HelmetConfig(kind, lam=float(10 ** rng.uniform(-1.5, 1)), R=float(10 ** rng.uniform(-1, 1)),
                           c=float(10 ** rng.uniform(-0.5, 0.7)), h=float(rng.uniform(0.05, 0.5)),
                           epochs=int(rng.integers(1, 7)), batch_size=batch)
        X = rng.normal(size=(n, p)) * rng.uniform(0.2, 3.0)
        y = rng.integers(0, K, size=n)
        X2, y2 = X.copy(), y.copy()
        j = rng.integers(n)
        X2[j] = rng.normal(size=p) * rng.uniform(0.2, 5.0)
        y2[j] = rng.integers(K)
        seed = int(rng.integers(2**31))
        configs += [cfg, cfg]
        datasets += [(X, y), (X2, y2)]
        seeds += [seed, seed]
    return configs, datasets, seeds


@pytest.mark.parametrize("kind", LEARNERS)
def test_output_sensitivity_random_configs(kind):
    rng = np.random.default_rng(11 if kind == "softmax" else 12)
    ratios, trivial = [], []
    for batch in (1, 4):
        configs, datasets, seeds = _random_neighbours(rng, kind, batch, count=40)
        f = train_many(datasets, configs, 3, seeds)
        for u in range(0, len(configs), 2):
            cfg, n = configs[u], len(datasets[u][0])
            d = _distance(kind, f[u], f[u + 1])
            data_bound = 2 * cfg.lipschitz() / (cfg.lam * n)
            ratios.append(d / data_bound)
            trivial.append(d / (2 * cfg.R))
            norms = np.linalg.norm(f[u]) if kind == "softmax" else np.linalg.norm(f[u], axis=0)
            assert np.all(norms <= cfg.R * (1 + 1e-5))  # projected onto the ball
    print(f"\n{kind}: largest ‖T(D)−T(D')‖ / (2L/(Λn)) over {len(ratios)} configs = {max(ratios):.4f}; "
          f"/ 2R = {max(trivial):.4f}")
    assert max(ratios) <= 1 + 1e-4
    assert max(trivial) <= 1 + 1e-4
    assert max(ratios) > 0.01  # the neighbours do move the model


def _adversarial_svm(lam, R):
    """Binary data with Σ ỹx = 0, every margin linear; the neighbour flips one label."""
    rng = np.random.default_rng(0)
    U = rng.normal(size=(10, 2))
    U /= np.linalg.norm(U, axis=1, keepdims=True)
    X = np.concatenate([U, -U, U, -U])
    y = np.array([1] * 20 + [0] * 20)
    y2 = y.copy()
    y2[0] = 0
    cfg = HelmetConfig("huber_svm", lam=lam, R=R, c=1.0, h=0.1, epochs=20, batch_size=1)
    f = train_many([(X, y), (X, y2)], cfg, 2, [3, 3])
    return _distance("huber_svm", f[0], f[1]) / cfg.sensitivity(len(X))


def test_sensitivity_bound_nearly_tight_and_halved_bound_violated():
    ratio = _adversarial_svm(lam=3.0, R=0.05)
    print(f"\nadversarial SVM neighbours: ratio to 2L/(Λn) = {ratio:.4f}")
    assert ratio <= 1 + 1e-4
    assert ratio > 0.5  # negative control: a sensitivity constant halved is violated


def test_blind_average_sensitivity_lemma_5_1():
    """One record of one user moves Σ (n_i/w) f_i by at most Δ = max_i (n_i/w) s_i."""
    rng = np.random.default_rng(5)
    cfg = HelmetConfig("softmax", lam=0.5, R=2.0, c=1.5, epochs=3, batch_size=2)
    sizes = [12, 20, 31]
    data = [(rng.normal(size=(n, 3)), rng.integers(0, 4, n)) for n in sizes]
    worst = 0.0
    for user in range(3):
        X2, y2 = data[user][0].copy(), data[user][1].copy()
        X2[0], y2[0] = -3 * X2[0], (y2[0] + 1) % 4
        f = train_many(data + [(X2, y2)], cfg, 4, [1, 2, 3, [1, 2, 3][user]])
        change = sizes[user] / 3 * np.linalg.norm(f[user] - f[3])
        worst = max(worst, change / aggregate_sensitivity("softmax", 0.5, 2.0, cfg.input_bound, sizes))
    assert 0 < worst <= 1 + 1e-4


# ---------------------------------------------------------------- constants


def _random_points(rng, kind, P, rows=3, K=3):
    lam = 10 ** rng.uniform(-1, 1, P)
    R = 10 ** rng.uniform(-1, 1, P)
    c = 10 ** rng.uniform(-0.5, 0.5, P)
    h = rng.uniform(0.05, 0.5, P)
    f = rng.normal(size=(P, rows, K))
    scale = R * rng.uniform(0, 1, P) ** 0.3 / np.linalg.norm(f, axis=(1, 2))
    f *= scale[:, None, None]
    if kind == "huber_svm":  # per-class balls
        f *= np.minimum(1, R[:, None, None] / np.linalg.norm(f, axis=1, keepdims=True))
    x = rng.normal(size=(P, 1, rows))
    x *= (c * rng.uniform(0.3, 1, P) ** 0.2 / np.linalg.norm(x, axis=2)[:, 0])[:, None, None]
    y = np.eye(K)[rng.integers(0, K, P)][:, None, :]
    # adversarial points: f pushes all probability mass onto a wrong class / margins negative
    A = P // 4
    xh = x[:A, 0] / np.linalg.norm(x[:A, 0], axis=1, keepdims=True)
    wrong = (np.argmax(y[:A, 0], 1) + 1) % K
    f[:A] = 0
    if kind == "softmax":
        f[np.arange(A), :, wrong] = R[:A, None] * xh
    else:
        f[:A] = -R[:A, None, None] * xh[:, :, None] * (2 * y[:A] - 1)
    return f.astype("float32"), x.astype("float32"), y.astype("float32"), lam, R, c, h


@pytest.mark.parametrize("kind", LEARNERS)
def test_lipschitz_constant(kind):
    rng = np.random.default_rng(1)
    f, x, y, lam, R, c, h = _random_points(rng, kind, 4000)
    g = _as_np(objectives.gradient(kind, f, x, y, lam, h))
    norms = np.linalg.norm(g, axis=(1, 2)) if kind == "softmax" else np.linalg.norm(g, axis=1).max(1)
    L = np.array([lipschitz_constant(kind, a, b, d) for a, b, d in zip(lam, R, c)])
    ratio = norms / L
    print(f"\n{kind}: max ‖∇J‖ / L = {ratio.max():.4f}")
    assert ratio.max() <= 1 + 1e-4
    assert ratio.max() > 0.9  # nearly attained, so L/2 would be violated


def test_softmax_simplex_facts():
    rng = np.random.default_rng(2)
    s = rng.dirichlet(np.full(5, 0.3), size=20000)
    y = np.eye(5)[rng.integers(0, 5, 20000)]
    assert np.max(np.sum((s - y) ** 2, 1)) <= 2 + 1e-12
    assert np.sum((np.eye(5)[1] - np.eye(5)[0]) ** 2) == 2  # attained: mass on a wrong class
    # Lemma O.2: Σ s_p(1 − s_p)(C + s_p) ≤ (C + 1)²/4, near-equality at uniform s on k coordinates
    C = 10 ** rng.uniform(-3, 2, 20000)
    lhs = np.sum(s * (1 - s) * (C[:, None] + s), 1)
    ratios = lhs / (0.25 * (C + 1) ** 2)
    for k in range(1, 6):
        u = np.full(k, 1 / k)
        Cs = np.linspace(0, 5, 200)
        ratios = np.append(ratios, np.sum(u * (1 - u) * (Cs[:, None] + u), 1) / (0.25 * (Cs + 1) ** 2))
    print(f"\nLemma O.2 max ratio {ratios.max():.5f}")
    assert ratios.max() <= 1 + 1e-12 and ratios.max() > 0.99


def test_huber_loss_shape():
    h = 0.2
    z = np.linspace(-2, 3, 20001).astype("float32")
    d = _as_np(objectives.huber_derivative(z, h))
    v = _as_np(objectives.huber(z, h))
    assert np.all(np.abs(d) <= 1 + 1e-6) and np.all(d <= 0)
    for kink in (1 - h, 1 + h):  # C¹ at the kinks
        lo = _as_np(objectives.huber_derivative(np.float32(kink - 1e-4), h))
        hi = _as_np(objectives.huber_derivative(np.float32(kink + 1e-4), h))
        assert abs(lo - hi) < 1e-3
    second = np.diff(d) / np.diff(z)
    assert second.max() <= 1 / (2 * h) * (1 + 1e-3) and second.max() > 0.99 / (2 * h)
    assert np.allclose(np.gradient(v, z)[1:-1], d[1:-1], atol=1e-3)


def _fd_hessians(kind, f, x, y, lam, h, step=1e-2):
    """Central finite differences of the package gradient: (P, rK, rK)."""
    P, r, K = f.shape
    D = r * K
    E = np.eye(D, dtype="float32").reshape(D, r, K) * step
    fp = (f[:, None] + E[None]).reshape(-1, r, K)
    fm = (f[:, None] - E[None]).reshape(-1, r, K)
    rep = lambda a: np.repeat(a, D, axis=0)  # noqa: E731
    gp = _as_np(objectives.gradient(kind, fp, rep(x), rep(y), rep(lam), rep(h)))
    gm = _as_np(objectives.gradient(kind, fm, rep(x), rep(y), rep(lam), rep(h)))
    H = ((gp - gm) / (2 * step)).reshape(P, D, D)
    return 0.5 * (H + H.transpose(0, 2, 1))


@pytest.mark.parametrize("kind", LEARNERS)
def test_smoothness_and_strong_convexity(kind):
    rng = np.random.default_rng(3)
    P, rows, K = 600, 3, 2 if kind == "softmax" else 3
    f, x, y, lam, R, c, h = _random_points(rng, kind, P, rows, K)
    if kind == "softmax":
        f[-P // 4:] = 0  # s uniform: the largest data curvature
    if kind == "huber_svm":  # keep finite differences off the two kinks of the Huber loss
        z = (2 * y[:, 0] - 1) * np.einsum("pr,prk->pk", x[:, 0], f)
        gap = np.minimum(np.abs(z - 1 + h[:, None]), np.abs(z - 1 - h[:, None])).min(1)
        keep = gap > 3e-2 * c * np.sqrt(rows * K)
        f, x, y, lam, R, c, h = (a[keep] for a in (f, x, y, lam, R, c, h))
        P = len(f)
    f = f.astype("float32")
    H = _fd_hessians(kind, f, x, y, lam.astype("float32"), h.astype("float32"))
    beta = np.array([smoothness_constant(kind, a, b, rows, K, hh) for a, b, hh in zip(lam, c, h)])
    if kind == "huber_svm":  # the objectives of the K classes are separate: one block per class
        blocks = H.reshape(P, rows, K, rows, K)
        fro = np.sqrt(np.max(np.sum(blocks[:, :, range(K), :, range(K)] ** 2, axis=(2, 3)), axis=0))
    else:
        fro = np.linalg.norm(H, axis=(1, 2))
    ratio = fro / beta
    eig_min = np.linalg.eigvalsh(H)[:, 0] / lam
    # gradient-difference form of smoothness and strong convexity on random pairs
    g = f + rng.normal(size=f.shape).astype("float32") * 0.3 * R[:, None, None].astype("float32")
    ga = _as_np(objectives.gradient(kind, f, x, y, lam, h))
    gb = _as_np(objectives.gradient(kind, g, x, y, lam, h))
    dist = np.linalg.norm((f - g).reshape(P, -1), axis=1)
    lip = np.linalg.norm((ga - gb).reshape(P, -1), axis=1) / dist
    mono = np.sum((ga - gb) * (f - g), axis=(1, 2)) / dist**2 / lam
    print(f"\n{kind}: max ‖H‖_F/β = {ratio.max():.4f}, min λ_min(H)/Λ = {eig_min.min():.4f}, "
          f"max ‖Δ∇J‖/(β‖Δf‖) = {(lip / beta).max():.4f}, min monotonicity/Λ = {mono.min():.4f}")
    assert ratio.max() <= 1 + 1e-2 and (lip / beta).max() <= 1 + 1e-3
    assert ratio.max() > 0.5  # negative control: β/2 is violated
    assert eig_min.min() >= 1 - 2e-2 and mono.min() >= 1 - 1e-3
    assert eig_min.min() < 1.05  # tight: 2Λ-strong convexity would be violated


# ---------------------------------------------------------------- privacy calibration

NOTE_TABLE = {  # ε: σ for K_comp = 1, 10, 62, 100 at δ = 1e-5 (Kirschte et al., Gaussian calibration)
    0.1: (30.750, 97.239, 242.12, 307.50),
    0.2: (16.304, 51.558, 128.38, 163.04),
    0.4: (8.630, 27.289, 67.949, 86.296),
    0.6: (5.950, 18.814, 46.847, 59.496),
    1.0: (3.7306, 11.797, 29.375, 37.306),
    1.2: (3.1608, 9.995, 24.888, 31.608),
    2.0: (1.9938, 6.305, 15.699, 19.938),
}


def test_calibration_table_of_the_note():
    rows = []
    for eps, expected in NOTE_TABLE.items():
        got = [calibrate_sigma(eps, 1e-5, k) for k in (1, 10, 62, 100)]
        rows.append(f"{eps:4}: " + "  ".join(f"{v:9.4f}" for v in got))
        np.testing.assert_allclose(got, expected, rtol=2e-4)
    print("\nσ(ε, δ=1e-5) for K_comp = 1, 10, 62, 100\n" + "\n".join(rows))
    np.testing.assert_allclose([epsilon(s, 1e-5) for s in (1, 2, 5, 10, 20)],
                               [4.377, 1.993, 0.7255, 0.3407, 0.1600], rtol=3e-4)
    np.testing.assert_allclose([calibrate_sigma(e, 1e-10) for e in (0.1, 0.5, 1.0)], [54.21, 11.44, 5.868],
                               rtol=5e-4)  # the note rounds to 4 significant digits
    np.testing.assert_allclose([calibrate_sigma(e, 1e-12) for e in (0.1, 0.5, 1.0)], [61.54, 12.84, 6.558],
                               rtol=5e-4)
    assert gaussian_delta(0.5, 10, 10) == pytest.approx(0.0097749, rel=1e-4)


def test_profile_identities_and_monotonicity():
    rng = np.random.default_rng(4)
    for _ in range(200):
        eps, sigma, K = rng.uniform(0, 5), 10 ** rng.uniform(-0.5, 2), int(rng.integers(1, 100))
        assert gaussian_delta(eps, sigma, K) == pytest.approx(gaussian_delta(eps, sigma / math.sqrt(K), 1),
                                                              rel=1e-9, abs=1e-300)
        assert gaussian_delta(eps + 0.1, sigma, K) <= gaussian_delta(eps, sigma, K)
        assert gaussian_delta(eps, sigma * 1.1, K) <= gaussian_delta(eps, sigma, K)
        group = int(rng.integers(1, 5))  # Lem. K.1: a group of Υ is the profile at σ/Υ
        assert gaussian_delta(eps, sigma, K, group) == pytest.approx(gaussian_delta(eps, sigma / group, K))
    for eps in np.linspace(0.05, 0.99, 20):
        assert classical_sigma(eps, 1e-5) >= calibrate_sigma(eps, 1e-5)
    for eps, k in [(0.3, 1), (1.0, 10), (2.0, 62)]:  # ε ∘ calibrate = identity
        assert epsilon(calibrate_sigma(eps, 1e-6, k), 1e-6, k) == pytest.approx(eps, rel=1e-8)
        assert calibrate_sigma(eps, 1e-6, k, group_size=3) == pytest.approx(3 * calibrate_sigma(eps, 1e-6, k))


def test_epsilon_agrees_with_dp_accounting():
    for sigma, k, delta in [(3.7306, 1, 1e-5), (27.289, 10, 1e-5), (1.0, 1, 1e-6), (50.0, 62, 1e-5),
                            (5.0, 3, 1e-8)]:
        ours, theirs = epsilon(sigma, delta, k), epsilon_dp_accounting(sigma, delta, k)
        assert ours == pytest.approx(theirs, rel=1e-4), (sigma, k)
    # negative control: calibrating an OvR-SVM as if it were one Gaussian (K_comp = 1) under-noises
    sigma_wrong = calibrate_sigma(1.0, 1e-5, 1)
    assert epsilon_dp_accounting(sigma_wrong, 1e-5, 10) > 2.0


def test_sensitivity_function_group_and_user_level():
    assert augmented_bound(3.0) == pytest.approx(math.sqrt(10))
    s1 = sensitivity("softmax", 1.0, 1.0, 34.854, 50)
    assert s1 == 2.0  # the note's example: 2L/(Λn) = 2.0116 > 2R = 2, the trivial bound wins
    assert sensitivity("huber_svm", 2.0, 0.5, 1.0, 100, group_size=3) == pytest.approx(3 * 2 * 2.0 / 200)
    assert sensitivity("softmax", 1.0, 0.3, 1.0, 100, group_size=100) == pytest.approx(0.6)


# ---------------------------------------------------------------- blind averaging


@pytest.mark.parametrize("t", [1.0, 0.5, 0.25])
def test_aggregated_noise_matches_central_calibration(t):
    rng = np.random.default_rng(6)
    w, sigma = 40, 2.5
    sizes = rng.integers(20, 60, w)
    delta_agg = aggregate_sensitivity("softmax", 0.7, 1.0, 2.0, sizes)
    zero = np.zeros((40, 10))
    honest_idx = np.arange(int(round(t * w)))
    honest, everyone = [], []
    for _ in range(100):
        c = np.stack([client_contribution(zero, n, w, sigma, delta_agg, t, rng) for n in sizes])
        honest.append(c[honest_idx].sum(0))
        everyone.append(c.sum(0))
    r_honest = np.std(honest) / (sigma * delta_agg)
    r_all = np.std(everyone) / (sigma * delta_agg)
    print(f"\nt={t}: std(honest sum)/(σΔ) = {r_honest:.4f}, std(all)/(σΔ) = {r_all:.4f} "
          f"(expected 1 and {1 / math.sqrt(t):.4f})")
    assert r_honest == pytest.approx(1.0, rel=0.015)
    assert r_all == pytest.approx(1 / math.sqrt(t), rel=0.015)
    if t < 1:
        assert abs(r_all - 1) > 0.1  # dishonest users' noise is wasted: not the central level


def test_simulator_noise_equals_centralised_noise():
    """Equal sizes, t = 1: the averaged model's noise is that of central DP-Helmet on all N records."""
    rng = np.random.default_rng(7)
    X, y = rng.normal(size=(400, 5)), rng.integers(0, 3, 400)
    cfg = HelmetConfig("huber_svm", lam=0.5, R=1.0, c=2.0, epochs=2, batch_size=5)
    sim = FederatedSimulator(cfg, 3, honest_fraction=1.0).train(X, y, split_iid(400, 10))
    clean = sim.release(1.0, 1e-5, noiseless=True)["model"]
    noise = np.stack([sim.release(1.0, 1e-5, seed=s, reproducible=True)["model"] - clean
                      for s in range(400)])
    central = calibrate_sigma(1.0, 1e-5, 3) * cfg.sensitivity(400)
    assert np.std(noise) / central == pytest.approx(1.0, rel=0.03)
    half = FederatedSimulator(cfg, 3, honest_fraction=0.5)
    half.local, half.sizes = sim.local, sim.sizes
    noise_half = np.stack([half.release(1.0, 1e-5, seed=s, reproducible=True)["model"] - clean
                           for s in range(400)])
    assert np.std(noise_half) / central == pytest.approx(math.sqrt(2), rel=0.03)


def test_splits_and_blind_average_of_linear_svms_equals_global():
    """Note §6.11: in the linear Huber region the local minimisers average to the global one."""
    rng = np.random.default_rng(8)
    X, y = rng.normal(size=(200, 3)), rng.integers(0, 4, 200)
    iid = split_iid(200, 7)
    assert sorted(np.concatenate(iid).tolist()) == list(range(200))
    ncl = split_one_class_per_user(y, 8)
    assert sorted(np.concatenate(ncl).tolist()) == list(range(200))
    assert all(len(np.unique(y[p])) == 1 for p in ncl)
    with pytest.raises(ValueError):
        split_one_class_per_user(y, 3)
    # Λ large and R small: every margin is below 1 − h, the objective is linear + ridge
    cfg = HelmetConfig("huber_svm", lam=20.0, R=1.0, c=1.0, h=0.1, epochs=60, batch_size=5)
    sim = FederatedSimulator(cfg, 4).train(X, y, ncl)
    model = sim.release(1.0, 1e-5, noiseless=True)["model"]
    glob = FederatedSimulator(cfg, 4).train(X, y, [np.arange(200)]).release(1.0, 1e-5, noiseless=True)["model"]
    Z = X * np.minimum(1, 1.0 / np.linalg.norm(X, axis=1, keepdims=True))
    closed = np.c_[np.ones(200), Z].T @ (2 * np.eye(4)[y] - 1) / (20.0 * 200)
    assert np.abs(glob - closed).max() < 0.02 * np.abs(closed).max()
    assert np.abs(model - closed).max() < 0.02 * np.abs(closed).max()


# ---------------------------------------------------------------- secure summation


@pytest.mark.parametrize("J", [2, 3, 5])
def test_secure_sum_reconstructs_exactly(J):
    rng = np.random.default_rng(9)
    ss = SecureSum(J, frac_bits=30)
    vectors = [rng.normal(size=(6, 4)) * 10 for _ in range(25)]
    shares = [ss.share(v, rng) for v in vectors]
    totals = ss.server_totals(shares)
    encoded_sum = np.zeros((6, 4), dtype=np.uint64)
    for v in vectors:
        encoded_sum = encoded_sum + ss.encode(v)  # wraps mod 2^64
    assert np.array_equal(ss.reconstruct(totals), encoded_sum)
    exact = sum(np.round(v * 2.0**30).astype(np.int64) for v in vectors) / 2.0**30
    assert np.array_equal(ss.decode(ss.reconstruct(totals)), exact)
    assert np.abs(ss.sum(vectors, seed=1) - np.sum(vectors, 0)).max() <= 25 * 2.0**-31
    # negative control: without one server's total the sum is garbage
    assert not np.allclose(ss.decode(ss.reconstruct(totals[1:])), exact)


class _LeakySum(SecureSum):
    """A broken sharer: random shares from a quarter of the ring."""

    def random_elements(self, shape, rng):
        return rng.integers(0, 2 ** (self.modulus_bits - 2), size=shape, dtype=np.uint64)


def _joint_share_pvalues(ss, secret, draws, rng):
    """χ² uniformity p-values of every (J−1)-subset of one user's shares, jointly."""
    shares = np.stack(ss.share(np.full(draws, secret), rng))  # (J, draws)
    B = 2**ss.modulus_bits
    pvals = []
    for subset in itertools.combinations(range(ss.num_servers), ss.num_servers - 1):
        cells = np.zeros(draws, dtype=np.int64)
        for j in subset:
            cells = cells * B + shares[j].astype(np.int64)
        counts = np.bincount(cells, minlength=B ** len(subset))
        pvals.append(stats.chisquare(counts).pvalue)
    return pvals, shares


def test_any_j_minus_1_shares_are_uniform():
    rng = np.random.default_rng(10)
    ss = SecureSum(3, frac_bits=2, modulus_bits=6)  # 64 elements, 4096 joint cells
    p_a, shares_a = _joint_share_pvalues(ss, 1.5, 120_000, rng)
    p_b, shares_b = _joint_share_pvalues(ss, -7.25, 120_000, rng)
    print(f"\nχ² p-values of the 2-share subsets: {np.round(p_a + p_b, 3)}")
    assert min(p_a + p_b) > 1e-3
    for j in range(3):  # each single share's law does not depend on the secret (two-sample χ²)
        table = np.stack([np.bincount(shares_a[j].astype(int), minlength=64),
                          np.bincount(shares_b[j].astype(int), minlength=64)])
        assert stats.chi2_contingency(table).pvalue > 1e-3
    # 64-bit ring: top byte of the last share (secret minus a random share) is uniform
    big = SecureSum(2)
    last = np.stack([big.share(np.full(50_000, 3.0), rng)[1]])[0]
    assert stats.chisquare(np.bincount((last >> np.uint64(56)).astype(int), minlength=256)).pvalue > 1e-3
    # negative control: the leaky sharer's shares reveal the secret
    leaky = _LeakySum(3, frac_bits=2, modulus_bits=6)
    p_leak, _ = _joint_share_pvalues(leaky, 1.5, 120_000, rng)
    assert min(p_leak) < 1e-6


# ---------------------------------------------------------------- trainer and Keras head


@pytest.mark.parametrize("kind", LEARNERS)
def test_trainer_seed_head_and_private_fit(kind):
    rng = np.random.default_rng(13)
    X, y = rng.normal(size=(60, 4)) * 2, rng.integers(0, 3, 60)
    cfg = HelmetConfig(kind, lam=0.3, R=2.0, c=1.5, epochs=3, batch_size=4)
    trainer = SingleLayerTrainer(cfg)
    f = trainer.fit(X, y, 3, seed=1)
    assert np.array_equal(f, trainer.fit(X, y, 3, seed=1))
    assert not np.allclose(f, trainer.fit(X, y, 3, seed=2))  # the seed sets the sample order
    assert f.shape == (5, 3)
    head = trainer.to_keras(f)
    Z = X * np.minimum(1, 1.5 / np.linalg.norm(X, axis=1, keepdims=True))
    np.testing.assert_allclose(head.predict(X, verbose=0), np.c_[np.ones(60), Z] @ f, rtol=1e-4, atol=1e-5)
    dense = trainer.to_dense(f)
    np.testing.assert_allclose(dense.get_weights()[1], f[0])
    noisy, info = private_fit(X, y, cfg, 3, eps=1.0, delta=1e-3, seed=0,
                               reproducible=True)
    assert info["k_comp"] == (1 if kind == "softmax" else 3)
    assert info["sensitivity"] == cfg.sensitivity(60)
    with pytest.raises(ValueError):
        private_fit(X, y, cfg, 3, eps=1.0, delta=0.1)  # δ ≥ 1/n
    with pytest.raises(ValueError):
        trainer.fit(X[:3], y[:3], 3)  # fewer records than a batch


# ---------------------------------------------------------------- one noise source, one gate


def _simulator(**kwargs):
    rng = np.random.default_rng(21)
    X, y = rng.normal(size=(400, 5)), rng.integers(0, 3, 400)
    cfg = HelmetConfig("softmax", lam=0.5, R=1.0, c=2.0, epochs=2, batch_size=5)
    return FederatedSimulator(cfg, 3, honest_fraction=1.0, **kwargs).train(
        X, y, split_iid(400, 10), seed=3)


def test_default_releases_draw_fresh_noise_that_cannot_be_replayed():
    """Two default releases used the same seed (0): anyone could replay the noise with the
    public sizes and zero models and subtract it, recovering the noiseless sum to 1e-15."""
    sim = _simulator()
    clean = sim.release(1.0, 1e-5, noiseless=True)["released"]
    first, second = sim.release(1.0, 1e-5), sim.release(1.0, 1e-5)
    std = first["noise_std"]
    assert np.std(first["released"] - second["released"]) > 0.5 * std
    attacker = FederatedSimulator(sim.config, 3, honest_fraction=1.0)
    attacker.local, attacker.sizes = np.zeros_like(sim.local), sim.sizes
    replayed = attacker.release(1.0, 1e-5)["released"]  # pure noise, from public numbers
    error = first["released"] - replayed - clean
    print(f"\nstd of (release − replayed noise − noiseless sum) / noise std = {np.std(error) / std:.3f}")
    assert np.std(error) > 0.5 * std


def test_release_seed_needs_reproducible_and_then_replays():
    sim = _simulator()
    with pytest.raises(ValueError, match="reproducible"):
        sim.release(1.0, 1e-5, seed=4)
    a, b = (sim.release(1.0, 1e-5, seed=4, reproducible=True)["released"] for _ in range(2))
    np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="reproducible"):
        private_fit(np.zeros((50, 2)), np.zeros(50, int), HelmetConfig(), 2, 1.0, 1e-3, seed=1)


def test_simulator_gate_records_every_release_and_matches_dp_accounting(monkeypatch):
    import dp_accounting

    from kdp.helmet import dp_event
    from kdp.helmet import federated
    from kdp.training.gate import BudgetExceededError

    sim = _simulator(delta=1e-5)
    k = sim.config.k_comp(3)
    sigmas = [sim.release(eps)["sigma"] for eps in (1.0, 2.0)]
    ledger = sim.privacy_ledger
    assert ledger is sim.privacy_gate.ledger
    assert sum(e["count"] for e in ledger.entries) == 2
    for accountant, make in (("rdp", dp_accounting.rdp.RdpAccountant),
                             ("pld", dp_accounting.pld.PLDAccountant)):
        acc = make()
        for s in sigmas:
            acc.compose(dp_event(s, k))
        assert sim.privacy_spent(accountant)[0] == pytest.approx(acc.get_epsilon(1e-5), rel=1e-6)
    assert sim.privacy_spent("pld")[0] > 2.0  # two releases compose (ε = 1 and 2 alone)
    sim.release(1.0, noiseless=True)
    assert sim.privacy_spent()[0] == math.inf  # a noiseless release is recorded as such
    # a budget is checked before anything runs: no noise drawn, nothing recorded
    capped = _simulator(epsilon_max=0.5)
    monkeypatch.setattr(federated, "client_contribution", lambda *a: pytest.fail("ran"))
    with pytest.raises(BudgetExceededError):
        capped.release(1.0)
    assert capped.privacy_ledger.entries == []
    # centralised private_fit records its one release in the gate it returns
    rng = np.random.default_rng(22)
    X, y = rng.normal(size=(60, 4)), rng.integers(0, 3, 60)
    _, info = private_fit(X, y, HelmetConfig("huber_svm", epochs=2, batch_size=4), 3, 1.0, 1e-3)
    assert info["privacy_gate"].ledger.events() == [
        dp_accounting.SelfComposedDpEvent(dp_event(info["sigma"], 3), 1)]
