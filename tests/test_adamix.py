"""AdaMix: GDP accounting, closed-form gradients, clipping, projection, noise, sensitivity."""

import math
import warnings

import dp_accounting
import keras
import numpy as np
import pytest
from keras import ops

from kdp import adamix as am
from kdp.adamix import core
from kdp.autodiff import gradient

SIGMA = 20.0


# ---------------------------------------------------------------- accounting
def test_calibrate_steps_matches_note_table():
    assert am.calibrate_steps(1.0, 1e-5, SIGMA) == 28
    assert am.calibrate_steps(3.0, 1e-5, SIGMA) == 206
    # T is the largest admissible number of steps
    for eps, t in ((1.0, 28), (3.0, 206)):
        assert am.noisy_gd_epsilon(SIGMA, t, 1e-5) <= eps < am.noisy_gd_epsilon(SIGMA, t + 1, 1e-5)
    assert am.noisy_gd_epsilon(SIGMA, 28, 1e-5) == pytest.approx(0.986, abs=1e-3)
    assert am.noisy_gd_epsilon(SIGMA, 206, 1e-5) == pytest.approx(2.993, abs=1e-3)


def test_calibrate_negative_control_printed_rho_typo():
    # the paper's printed ρ = T²/(2σ²), i.e. μ = T/σ, would allow far fewer steps
    mu = am.gdp_mu(1.0, 1e-5)
    typo_steps = int(math.floor(SIGMA * mu))
    assert typo_steps != am.calibrate_steps(1.0, 1e-5, SIGMA)
    assert typo_steps == 5


def test_gdp_primitives():
    assert am.gdp_delta(1.0, 1.0) == pytest.approx(0.12694, abs=1e-5)
    assert am.gdp_eps(1.0, 1e-5) == pytest.approx(4.3772, abs=1e-4)
    assert am.gdp_delta(am.gdp_eps(0.5, 1e-5), 0.5) == pytest.approx(1e-5, rel=1e-6)
    assert am.compose_gdp([(1.0, 2.0), (2.0, 2.0)]) == pytest.approx(math.sqrt(0.25 + 1.0))
    assert am.compose_gdp([(1.0, SIGMA)] * 28) == pytest.approx(am.noisy_gd_mu(SIGMA, 28))


@pytest.mark.parametrize("sigma,steps", [(20.0, 28), (20.0, 206), (5.0, 10), (1.0, 1)])
def test_epsilon_invariant_under_sigma_doubling_and_four_times_steps(sigma, steps):
    a = am.noisy_gd_epsilon(sigma, steps, 1e-5)
    b = am.noisy_gd_epsilon(2 * sigma, 4 * steps, 1e-5)
    assert b == pytest.approx(a, rel=1e-9)
    # independent: dp-accounting's PLD on the composed events is invariant too
    pa = am.epsilon_dp_accounting(sigma, steps, 1e-5, "pld")
    pb = am.epsilon_dp_accounting(2 * sigma, 4 * steps, 1e-5, "pld")
    assert pb == pytest.approx(pa, rel=2e-3)
    # ... but not under (σ, T) → (2σ, 2T): a negative control
    assert am.noisy_gd_epsilon(2 * sigma, 2 * steps, 1e-5) < 0.9 * a


@pytest.mark.parametrize("steps", [1, 28, 206, 1110])
def test_gdp_epsilon_agrees_with_dp_accounting(steps):
    eps = am.noisy_gd_epsilon(SIGMA, steps, 1e-5)
    analytic = dp_accounting.get_epsilon_gaussian(SIGMA / math.sqrt(steps), 1e-5)
    assert eps == pytest.approx(analytic, rel=1e-6, abs=1e-8)
    pld = am.epsilon_dp_accounting(SIGMA, steps, 1e-5, "pld")
    assert eps == pytest.approx(pld, rel=2e-3, abs=1e-4)
    assert am.epsilon_dp_accounting(SIGMA, steps, 1e-5, "rdp") >= eps  # RDP is looser


# ---------------------------------------------------------------- toy data
def _toy(n_pri=14, n_pub=8, d=6, c=4, seed=0):
    rng = np.random.default_rng(seed)

    def unit(n):
        x = rng.normal(size=(n, d)).astype("float32")
        return x / np.linalg.norm(x, axis=1, keepdims=True)

    return (unit(n_pri), rng.integers(0, c, n_pri), unit(n_pub), rng.integers(0, c, n_pub), c)


def _onehot(y, c):
    return ops.one_hot(ops.convert_to_tensor(np.asarray(y, "int32")), c)


def _np(x):
    return ops.convert_to_numpy(x).astype(np.float64)


def test_closed_form_per_example_gradients_match_autodiff():
    x, y, _, _, c = _toy()
    w = np.random.default_rng(1).normal(size=(x.shape[1], c)).astype("float32") * 3
    closed = _np(core.per_example_gradients(ops.convert_to_tensor(w), ops.convert_to_tensor(x), _onehot(y, c)))
    for i in range(4):
        def loss(w_, i=i):
            logits = ops.matmul(ops.convert_to_tensor(x[i:i + 1]), w_)
            return -ops.sum(ops.log_softmax(logits)[0] * _onehot(y[i:i + 1], c)[0])

        (auto,) = gradient(loss, w)
        np.testing.assert_allclose(closed[i], _np(auto), atol=1e-5)
    # ‖x(p − y)ᵀ‖ = ‖x‖‖p − y‖ ≤ √2 for unit x
    norms = _np(core.per_example_norms(ops.convert_to_tensor(x), core.residuals(w, x, _onehot(y, c))))
    np.testing.assert_allclose(norms, np.linalg.norm(closed.reshape(len(x), -1), axis=1), rtol=1e-5)
    assert norms.max() <= math.sqrt(2) + 1e-6


def test_quantile_clipping():
    x, y, xp, yp, c = _toy(n_pub=40)
    w = ops.convert_to_tensor(np.random.default_rng(2).normal(size=(x.shape[1], c)).astype("float32"))
    norms_pub = core.per_example_norms(xp, core.residuals(w, xp, _onehot(yp, c)))
    tau = float(_np(core.public_clip_threshold(norms_pub, 0.9)))
    assert np.mean(_np(norms_pub) <= tau + 1e-7) >= 0.9
    g = _np(core.per_example_gradients(w, x, _onehot(y, c))).reshape(len(x), -1)
    s = _np(core.clip_factors(ops.convert_to_tensor(np.linalg.norm(g, axis=1).astype("float32")), tau))
    np.testing.assert_allclose(np.linalg.norm(g * s[:, None], axis=1),
                               np.minimum(np.linalg.norm(g, axis=1), tau), rtol=1e-5)


@pytest.mark.parametrize("policy,dim", [("truncate", None), ("truncate", 5), ("features", 5),
                                        ("complete", 6), ("complete", 2)])
def test_projection_orthonormal_and_non_expansive(policy, dim):
    x, y, xp, yp, c = _toy()
    w = ops.convert_to_tensor(np.random.default_rng(3).normal(size=(x.shape[1], c)).astype("float32"))
    g_pub = core.gradient_sum(xp, core.residuals(w, xp, _onehot(yp, c)))
    u, rank = core.public_subspace(g_pub, dim, policy, x_pub=xp)
    assert rank <= c - 1  # Σ_c of every residual is 0
    u = _np(u)
    expected = {"truncate": min(dim or rank, rank), "complete": dim}.get(policy)
    if expected is not None:
        assert u.shape == (x.shape[1], expected)
    np.testing.assert_allclose(u.T @ u, np.eye(u.shape[1]), atol=1e-5)
    proj = u @ u.T
    np.testing.assert_allclose(proj @ proj, proj, atol=1e-5)
    tau = 0.3
    g = _np(core.per_example_gradients(w, x, _onehot(y, c)))
    s = np.minimum(1.0, tau / np.linalg.norm(g.reshape(len(g), -1), axis=1))
    projected = np.einsum("dp,ndc->npc", u, g * s[:, None, None])
    assert np.linalg.norm(projected.reshape(len(g), -1), axis=1).max() <= tau * (1 + 1e-5)


def test_projection_rank_guard():
    x, y, xp, yp, c = _toy()
    w = ops.convert_to_tensor(np.ones((x.shape[1], c), "float32"))
    g_pub = core.gradient_sum(xp, core.residuals(w, xp, _onehot(yp, c)))
    with pytest.raises(ValueError, match="exceeds the rank"):
        core.public_subspace(g_pub, c + 1, "raise")
    # zero public gradient: rank 0, nothing kept (no private release)
    u, rank = core.public_subspace(ops.zeros((x.shape[1], c)), None, "truncate")
    assert rank == 0 and u.shape[1] == 0


def test_negative_control_unnormalised_basis_breaks_bound():
    # the raw public gradient as a "basis" (not orthonormal) is not non-expansive
    x, y, xp, yp, c = _toy()
    w = ops.convert_to_tensor(np.random.default_rng(3).normal(size=(x.shape[1], c)).astype("float32"))
    g_pub = _np(core.gradient_sum(xp, core.residuals(w, xp, _onehot(yp, c)))) * 10
    g = _np(core.per_example_gradients(w, x, _onehot(y, c)))
    tau = 0.3
    s = np.minimum(1.0, tau / np.linalg.norm(g.reshape(len(g), -1), axis=1))
    projected = np.einsum("dp,ndc->npc", g_pub, g * s[:, None, None])
    assert np.linalg.norm(projected.reshape(len(g), -1), axis=1).max() > tau


# ---------------------------------------------------------------- noise
@pytest.mark.parametrize("tau", [0.37, 2.5])
def test_noise_std_is_sigma_tau_on_a_P_by_C_matrix(tau):
    x, y, xp, yp, c = _toy(d=40, c=8)
    w = ops.convert_to_tensor(np.random.default_rng(4).normal(size=(40, c)).astype("float32"))
    g_pub = core.gradient_sum(xp, core.residuals(w, xp, _onehot(yp, c)))
    u, _ = core.public_subspace(g_pub, 30, "complete")  # 240 noise entries a draw
    seed = keras.random.SeedGenerator(7)
    xs, ys = ops.convert_to_tensor(x), _onehot(y, c)
    noise = []
    for _ in range(100):
        noisy, clean, _ = core.private_release(w, xs, ys, tau, SIGMA, seed, u)
        assert tuple(noisy.shape) == (30, c)  # P×C, not C
        noise.append(_np(noisy) - _np(clean))
    noise = np.stack(noise)
    std = noise.std()
    assert abs(std / (SIGMA * tau) - 1) < 0.03
    assert abs(noise.mean()) < 4 * SIGMA * tau / math.sqrt(noise.size)
    # negative control: the std is not σ alone (the multiplier must be scaled by τ)
    assert abs(std / SIGMA - 1) > 0.03
    # independent entries: correlation between two coordinates is small
    flat = noise.reshape(len(noise), -1)
    assert abs(np.corrcoef(flat[:, 0], flat[:, 1])[0, 1]) < 0.3


# ---------------------------------------------------------------- sensitivity
def _release_sums(trainer, w, x, y, xp, yp, c, clip=True, drop=None):
    """The noise-free release; ``drop=i`` removes example i (a zero weight keeps shapes static)."""
    tau, u, _, _ = trainer.public_statistics(w, xp, _onehot(yp, c))
    r = core.residuals(w, x, _onehot(y, c))
    scale = core.clip_factors(core.per_example_norms(x, r), tau) if clip else ops.ones((len(x),))
    if drop is not None:
        scale = scale * ops.convert_to_tensor((np.arange(len(x)) != drop).astype("float32"))
    return _np(core.gradient_sum(x, r, scale, u)), float(_np(tau))


def test_per_step_add_remove_sensitivity_by_brute_force():
    x, y, xp, yp, c = _toy()
    trainer = am.AdaMix(c, steps=6, delta=1e-3, learning_rate=0.5, pretrain_steps=5, subspace_dim=2,
                        rank_policy="complete", keep_trajectory=True, reproducible=True, seed=0)
    trainer.fit(x, y, public_data=(xp, yp))
    extra_x = x[:1] * 1.0  # an added record (a duplicate of a hard one)
    extra_y = (y[:1] + 1) % c
    worst = 0.0
    for rec in trainer.history:
        w = ops.convert_to_tensor(rec["weights"])
        full, tau = _release_sums(trainer, w, x, y, xp, yp, c)
        assert tau == pytest.approx(rec["tau"], rel=1e-5)
        for i in range(len(x)):  # remove one
            minus, tau_i = _release_sums(trainer, w, x, y, xp, yp, c, drop=i)
            assert tau_i == tau  # τ_t, U_t do not look at the private data
            worst = max(worst, np.linalg.norm(full - minus) / tau)
        plus, _ = _release_sums(trainer, w, np.concatenate([x, extra_x]), np.concatenate([y, extra_y]),
                                xp, yp, c)
        worst = max(worst, np.linalg.norm(plus - full) / tau)
    assert worst <= 1 + 1e-5
    assert worst > 0.5  # the bound is nearly attained (clipping is active)


def test_negative_control_unclipped_gradients_violate_sensitivity():
    x, y, xp, yp, c = _toy()
    trainer = am.AdaMix(c, steps=1, delta=1e-3, projection=False, pretrain_steps=50,
                        reproducible=True, seed=0)
    trainer.fit(x, y, public_data=(xp, yp))
    w = trainer.head.kernel
    full, tau = _release_sums(trainer, w, x, y, xp, yp, c, clip=False)
    gaps = []
    for i in range(len(x)):
        minus, _ = _release_sums(trainer, w, x, y, xp, yp, c, clip=False, drop=i)
        gaps.append(np.linalg.norm(full - minus))
    assert max(gaps) > tau * 1.01


# ---------------------------------------------------------------- per-instance ledger
def test_per_instance_ledger_bounded_by_worst_case_and_marked():
    x, y, xp, yp, c = _toy()
    trainer = am.AdaMix(c, steps=10, delta=1e-3, noise_multiplier=2.0, pretrain_steps=5,
                        subspace_dim=3, rank_policy="complete", track_per_instance=True,
                        reproducible=True, seed=0)
    trainer.fit(x, y, public_data=(xp, yp))
    ledger = trainer.per_instance
    assert ledger.not_for_release and ledger.steps == 10
    with pytest.warns(UserWarning, match="NOT covered"):
        mu = ledger.mu()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        eps = ledger.epsilon(1e-3)
    worst = trainer.privacy()
    assert mu.max() <= worst["mu"] * (1 + 1e-6)
    assert mu.min() < worst["mu"]
    assert eps.max() <= worst["epsilon"] + 1e-9
    # ledger with U = I and no clipping active equals √Σ‖g‖²/(τ²σ²) — a recomputation
    led = am.PerInstanceLedger(2)
    led.record([0.25, 1.0], tau=1.0, noise_multiplier=2.0)
    led.record([1.0, 1.0], tau=1.0, noise_multiplier=2.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        np.testing.assert_allclose(led.mu(), [math.sqrt(1.25) / 2, math.sqrt(2) / 2])


# ---------------------------------------------------------------- trainers
def test_trainers_api_and_privacy_report():
    x, y, xp, yp, c = _toy(n_pri=60)
    t = am.AdaMix(c, epsilon=1.0, delta=1e-3, noise_multiplier=5.0, reproducible=True,
                  seed=0).fit(x, y, public_data=(xp, yp))
    p = t.privacy()
    assert p["steps"] == am.calibrate_steps(1.0, 1e-3, 5.0) == len(t.history)
    assert p["epsilon"] <= 1.0 and "private data only" in p["scope"]
    pld = dp_accounting.pld.PLDAccountant()
    pld.compose(t.dp_event())
    assert pld.get_epsilon(1e-3) == pytest.approx(p["epsilon"], rel=2e-3)
    assert all(h["dim"] <= c - 1 for h in t.history)  # default: P = rank(G^pub)
    assert t.predict(x).shape == (len(x), c)
    assert isinstance(t.keras_model(), keras.Model)
    np.testing.assert_allclose(ops.convert_to_numpy(t.keras_model()(x)),
                               ops.convert_to_numpy(t.head(x)), atol=1e-6)  # x is unit-norm
    for base in (am.NoisyGD(c, epsilon=1.0, delta=1e-3, reproducible=True, seed=0),
                 am.PublicOnly(c), am.NonPrivate(c)):
        base.fit(x, y, public_data=(xp, yp))
        assert 0 <= base.error(x, y) <= 1
    public = am.PublicOnly(c).fit(x, y, public_data=(xp, yp))
    assert public.privacy()["epsilon"] == 0
    np.testing.assert_allclose(public.weights_, t.public_solution, atol=1e-5)  # same pre-training


def test_bad_input_is_rejected():
    x, y, xp, yp, c = _toy(n_pri=60)
    with pytest.raises(ValueError, match="public_data"):
        am.AdaMix(c, steps=2, delta=1e-3).fit(x, y)
    with pytest.raises(ValueError, match="1/N_private"):
        am.AdaMix(c, steps=2, delta=0.05).fit(x, y, public_data=(xp, yp))
    with pytest.raises(ValueError, match="NaN"):
        am.AdaMix(c, steps=2, delta=1e-3).fit(np.full_like(x, np.nan), y, public_data=(xp, yp))
    with pytest.raises(ValueError, match="exactly one"):
        am.AdaMix(c, steps=2, epsilon=1.0)
    with pytest.raises(ValueError, match="labels"):
        am.AdaMix(c, steps=2, delta=1e-3).fit(x, y + c, public_data=(xp, yp))
    with pytest.raises(ValueError, match="analytic"):
        am.AdaMix(c, steps=2, clip_norm="analytic", normalize=False)


def test_adamix_beats_public_only_on_digits():
    d = am.digits_mixed_split(public_per_class=2, seed=0)
    pub, te = (d["x_public"], d["y_public"]), (d["x_test"], d["y_test"])
    mixed = am.AdaMix(10, epsilon=1.0, learning_rate=2e-2, projection=False, reproducible=True, seed=0)
    mixed.fit(d["x_private"], d["y_private"], public_data=pub)
    x_test = d["x_test"] / np.linalg.norm(d["x_test"], axis=1, keepdims=True)
    public_error = np.mean(np.argmax(x_test @ mixed.public_solution, 1) != d["y_test"])
    assert mixed.error(*te) < public_error - 0.1


# ---------------------------------------------------------------- one noise source, one gate
@pytest.mark.parametrize("make", [
    lambda c: am.NoisyGD(c, steps=5, delta=1e-3, noise_multiplier=2.0),
    lambda c: am.AdaMix(c, steps=5, delta=1e-3, noise_multiplier=2.0, pretrain_steps=3),
], ids=["noisygd", "adamix"])
def test_global_keras_seed_does_not_replay_the_noise(make):
    """The noise came from SeedGenerator(None), which follows Python's global `random`: after
    keras.utils.set_random_seed(0) a re-run on the same data was bit-identical (so runs on D
    and on D minus one record would differ only by that record)."""
    x, y, xp, yp, c = _toy(n_pri=40)
    weights = []
    for _ in range(2):
        keras.utils.set_random_seed(0)
        weights.append(make(c).fit(x, y, public_data=(xp, yp)).weights_)
    gap = np.abs(weights[0] - weights[1]).max()
    print(f"\nmax |w1 − w2| after set_random_seed(0) twice: {gap:.3g}")
    assert gap > 1e-4


def test_reproducible_seed_replays_and_seed_alone_is_refused():
    x, y, _, _, c = _toy(n_pri=40)
    runs = [am.NoisyGD(c, steps=5, delta=1e-3, noise_multiplier=2.0, reproducible=True,
                       seed=3).fit(x, y).weights_ for _ in range(2)]
    np.testing.assert_array_equal(runs[0], runs[1])
    with pytest.raises(ValueError, match="reproducible"):
        am.NoisyGD(c, steps=5, delta=1e-3, seed=3)
    with pytest.raises(ValueError, match="explicit seed"):
        am.AdaMix(c, steps=5, delta=1e-3, reproducible=True)
    with pytest.raises(TypeError):
        core.gaussian_noise((2, 2), 1.0, None)  # never Keras' global seed


def test_gate_records_every_step_and_matches_dp_accounting():
    from kdp.training.gate import BudgetExceededError

    x, y, xp, yp, c = _toy(n_pri=60)
    sigma, delta = 3.0, 1e-3
    t = am.AdaMix(c, steps=7, delta=delta, noise_multiplier=sigma, pretrain_steps=5)
    for _ in range(2):
        t.fit(x, y, public_data=(xp, yp))
    ledger = t.privacy_ledger
    assert ledger is t.privacy_gate.ledger and len(ledger.runs()) == 2
    assert sum(e["count"] for e in ledger.entries) == 14
    assert all(e["event"] == {"class_name": "GaussianDpEvent", "noise_multiplier": sigma}
               for e in ledger.entries)
    rdp = dp_accounting.rdp.RdpAccountant()
    rdp.compose(am.noisy_gd_event(sigma, 14))
    assert t.privacy_spent()[0] == pytest.approx(rdp.get_epsilon(delta), rel=1e-9)
    pld = dp_accounting.pld.PLDAccountant()
    pld.compose(am.noisy_gd_event(sigma, 14))
    assert t.privacy_spent("pld")[0] == pytest.approx(pld.get_epsilon(delta), rel=1e-3)
    assert t.privacy()["epsilon"] <= t.privacy_spent("rdp")[0]  # GDP of one run: tighter
    # a budget refuses a whole fit before it starts: nothing recorded, weights unchanged
    eps_10 = am.epsilon_dp_accounting(sigma, 10, delta, "rdp")
    capped = am.NoisyGD(c, steps=7, delta=delta, noise_multiplier=sigma, epsilon_max=eps_10)
    capped.fit(x, y)
    before = capped.weights_
    with pytest.raises(BudgetExceededError):
        capped.fit(x, y)
    assert sum(e["count"] for e in capped.privacy_ledger.entries) == 7
    np.testing.assert_array_equal(capped.weights_, before)
    assert am.PublicOnly(c).fit(x, y, public_data=(xp, yp)).privacy_spent()[0] == 0
    assert am.NonPrivate(c).fit(x, y).privacy_spent()[0] == math.inf
