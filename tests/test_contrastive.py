"""Contrastive DP training: Logit-DP identities, per-pair norms, batch sensitivities,
the clipless bound, negative controls, noise calibration and accounting.

Batches are padded to one static size (``CAP``) and pairs are removed by
masking, so every function compiles once; `test_masking_equals_removal` checks
that a masked pair is exactly a removed one.
"""

import math
import os

import dp_accounting
import keras
import numpy as np
import pytest
from keras import ops

from kdp import accounting
from kdp.bounds import BoundError
from kdp.contrastive import (ContrastiveTrainer, PairGradients, clipless_pair_bound, embed,
                             knn_accuracy, same_class_pairs)
from kdp.autodiff import compile_function
from kdp.layers import DP_BoundedInput, DP_GroupSort, DP_SpectralDense
from kdp.losses.contrastive import (DP_InfoNCE, DP_Spreadout, infonce_constant,
                                    paper_infonce_constant)

CAP = 256
DIM = 6
X0 = 2.0
NS = (2, 3, 17, 64, 256)
TEMPERATURES = (0.1, 0.5, 1.0)


def _encoder(linear=False, seed=0):
    keras.utils.set_random_seed(seed)
    layers = [DP_BoundedInput((DIM,), upper_bound=X0)]
    layers += [DP_SpectralDense(4)] if linear else [DP_SpectralDense(8), DP_GroupSort(2),
                                                    DP_SpectralDense(4)]
    model = keras.Sequential(layers)
    model.build((None, DIM))
    return model


def _flat(grads):
    return np.concatenate([np.ravel(np.asarray(g, "float64")) for g in grads])


def _gbar_fn(engine, clip_norm):
    """Compiled ``(params, others, x, xp, mask) -> ḡ`` (Logit-DP, or autodiff if None)."""
    if clip_norm is None:
        return compile_function(lambda p, o, x, xp, m: engine.loss_gradient(p, o, x, xp, m)[0])
    return compile_function(lambda p, o, x, xp, m: engine.logit_dp_gradient(p, o, x, xp, m,
                                                                          clip_norm)[0])


def _pad(a, size=CAP):
    out = np.zeros((size,) + a.shape[1:], "float32")
    out[: len(a)] = a
    return out


def _masks(n, k, size=CAP):
    m = np.zeros(size, "float32")
    m[:n] = 1
    mo = m.copy()
    mo[k] = 0
    return m, mo


def _diff(fn, engine, x, xp, m, mo):
    p, o = engine.variables()
    return np.linalg.norm(_flat(fn(p, o, x, xp, m)) - _flat(fn(p, o, x, xp, mo)))


def _random_batch(rng, size=CAP):
    scale = rng.uniform(0.2, 3.0, size=(size, 1))
    x = rng.normal(size=(size, DIM)) * scale / np.sqrt(DIM)
    xp = x + 0.5 * rng.normal(size=(size, DIM)) * scale / np.sqrt(DIM)
    return x.astype("float32"), xp.astype("float32")


def _worst_case_batch(n, kernel, scale, rng, noise=0.05, size=CAP):
    """Kong et al.'s worst case: pair n removed; rows i<n see +1 on column n and −1
    elsewhere, row n sees −1 on its positive and +1 elsewhere (for a linear encoder)."""
    d0 = np.asarray(kernel)[:, 0]
    d0 = d0 / np.linalg.norm(d0) * scale
    jitter = lambda k: noise * scale * rng.normal(size=(k, DIM))  # noqa: E731
    x = np.concatenate([d0 + jitter(n - 1), -d0 + jitter(1)])
    xp = np.concatenate([-d0 + jitter(n - 1), d0 + jitter(1)])
    return _pad(x.astype("float32"), size), _pad(xp.astype("float32"), size)


# -- the losses ---------------------------------------------------------------------------

def test_constants_table_and_paper_negative_control():
    # the setting of Kong et al.'s experiments (τ = 1, cosine)
    for n, safe, paper in [(2, 3.7616, 2.0), (10, 10.1154, 9.2136), (100, 15.7517, 15.6128),
                           (1000, 16.6696, 16.6549)]:
        assert infonce_constant(n) == pytest.approx(safe, abs=1e-3)
        assert paper_infonce_constant(n) == pytest.approx(paper, abs=1e-3)
    assert infonce_constant(math.inf) == pytest.approx(2 * (1 + math.e ** 2))
    assert infonce_constant(10, 0.5) == pytest.approx(4 * (1 + 9 * math.e ** 4 / (math.e ** 4 + 9)))
    # The worst-case logits, through the loss's own coefficients: the coefficient
    # change G1 + G2 + (n−1)L (what ‖ḡ(X) − ḡ(X°)‖/B equals when the clipped pair
    # gradients align with the signs) exceeds the paper's constant, not ours.
    loss = DP_InfoNCE(1.0)
    for n in (3, 10, 100):
        S = -np.ones((n, n), "float32")
        S[:, n - 1] = 1.0
        S[n - 1, :] = 1.0
        S[n - 1, n - 1] = -1.0
        m = np.ones(n, "float32")
        mo = m.copy()
        mo[-1] = 0
        T = np.asarray(loss.coefficients(S, m), "float64")
        To = np.asarray(loss.coefficients(S, mo), "float64")
        total = np.abs(T - To).sum()  # row n, column n and the changed coefficients
        assert total > paper_infonce_constant(n) * 1.005, (n, total)
        assert total <= infonce_constant(n) * (1 + 1e-5), (n, total)


def test_loss_values_coefficients_and_serialization():
    rng = np.random.default_rng(0)
    f, fp = rng.normal(size=(5, 4)).astype("float32"), rng.normal(size=(5, 4)).astype("float32")
    loss = DP_InfoNCE(0.5)
    u = f / np.linalg.norm(f, axis=1, keepdims=True)
    v = fp / np.linalg.norm(fp, axis=1, keepdims=True)
    z = u @ v.T / 0.5
    ref = np.log(np.exp(z).sum(1)) - np.diag(z)
    np.testing.assert_allclose(np.asarray(loss(fp, f)) * 5, ref.sum(), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(loss.call(fp, f)), ref, rtol=1e-5)
    T = np.asarray(loss.coefficients(u @ v.T))
    np.testing.assert_allclose(T.sum(1), 0, atol=1e-6)  # rows of (P − I)/τ sum to 0
    for obj in (DP_InfoNCE(0.3, similarity="dot", radius=2.0, norm_floor=0.1), DP_Spreadout()):
        back = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(obj))
        assert type(back) is type(obj) and back.get_config() == obj.get_config()
    with pytest.raises(BoundError, match="ContrastiveTrainer"):
        loss.get_L()


# -- Lemma 4.1 and the efficient norms --------------------------------------------------

@pytest.mark.parametrize("loss", [DP_InfoNCE(0.5), DP_InfoNCE(0.1, similarity="dot", radius=1.5),
                                  DP_Spreadout()], ids=["infonce", "infonce-dot", "spreadout"])
def test_recombined_gradient_with_infinite_clip_is_autodiff(loss):
    engine = PairGradients(_encoder(), loss)
    rng = np.random.default_rng(1)
    x, xp = _random_batch(rng, 12)
    mask = np.ones(12, "float32")
    mask[9:] = 0  # padding rows
    p, o = engine.variables()
    auto = _flat(_gbar_fn(engine, None)(p, o, x, xp, mask))
    rec = _flat(_gbar_fn(engine, math.inf)(p, o, x, xp, mask))
    assert np.linalg.norm(rec - auto) <= 1e-5 * np.linalg.norm(auto)


@pytest.mark.parametrize("method", ["gram", "blocks"])
def test_pair_norms_match_bruteforce(method):
    engine = PairGradients(_encoder(), DP_InfoNCE(0.5), block_rows=3, method=method)
    rng = np.random.default_rng(2)
    x, xp = _random_batch(rng, 7)
    p, o = engine.variables()
    norms = np.asarray(compile_function(engine.pair_norms)(p, o, x, xp), "float64")
    brute = compile_function(engine.pair_gradients)(p, o, x, xp)
    ref = np.sqrt(sum(np.sum(np.asarray(g, "float64").reshape(7, 7, -1) ** 2, -1) for g in brute))
    # float32 Gram expansion: error relative to the largest norm
    np.testing.assert_allclose(norms, ref, rtol=1e-5, atol=1e-5 * ref.max())
    # and each brute-force pair gradient is ∇_w S_ij: Σ_ij T_ij g_ij = ∇𝓛
    S = engine.similarities(p, o, x, xp)
    T = np.asarray(engine.loss.coefficients(S), "float64")
    recombined = np.concatenate([np.einsum("ij,ij...->...", T, np.asarray(g, "float64")).ravel()
                                 for g in brute])
    auto = _flat(_gbar_fn(engine, None)(p, o, x, xp, np.ones(7, "float32")))
    assert np.linalg.norm(recombined - auto) <= 1e-5 * np.linalg.norm(auto)


def test_masking_equals_removal():
    engine = PairGradients(_encoder(), DP_InfoNCE(0.5))
    rng = np.random.default_rng(3)
    x, xp = _random_batch(rng, 9)
    p, o = engine.variables()
    m = np.ones(9, "float32")
    m[4] = 0
    fn = _gbar_fn(engine, 0.3)
    masked = _flat(fn(p, o, x, xp, m))
    keep = np.flatnonzero(m)
    removed = _flat(fn(p, o, x[keep], xp[keep], np.ones(8, "float32")))
    assert np.linalg.norm(masked - removed) <= 1e-5 * np.linalg.norm(removed)


# -- sensitivity --------------------------------------------------------------------------

@pytest.mark.parametrize("tau", TEMPERATURES)
def test_logit_dp_sensitivity_random_and_adversarial(tau, record_property):
    rng = np.random.default_rng(4)
    ratios = []
    # random batches, nonlinear encoder, clip norm in the middle of the norms
    engine = PairGradients(_encoder(), DP_InfoNCE(tau))
    fn = _gbar_fn(engine, 0.3)
    x, xp = _random_batch(rng)
    for n in NS:
        k = int(rng.integers(n))
        d = _diff(fn, engine, x, xp, *_masks(n, k))
        ratios.append(d / DP_InfoNCE(tau).sensitivity(n, 0.3))
    # adversarial: the worst-case logit pattern, every pair gradient clipped
    lin = _encoder(linear=True)
    engine = PairGradients(lin, DP_InfoNCE(tau))
    fn = _gbar_fn(engine, 1e-4)
    for n in NS:
        x, xp = _worst_case_batch(n, lin.trainable_variables[0].value, 1.5, rng)
        d = _diff(fn, engine, x, xp, *_masks(n, n - 1))
        ratios.append(d / DP_InfoNCE(tau).sensitivity(n, 1e-4))
    record_property("ratios", [float(r) for r in ratios])
    print(f"\nlogit-dp tau={tau}: max ratio {max(ratios):.3f}", np.round(ratios, 3))
    assert max(ratios) <= 1.0
    assert max(ratios) > 0.05  # the test measures something


def test_logit_dp_sensitivity_dot_similarity():
    rng = np.random.default_rng(5)
    lin = _encoder(linear=True)
    loss = DP_InfoNCE(0.5, similarity="dot", radius=1.0)
    engine = PairGradients(lin, loss)
    fn = _gbar_fn(engine, 1e-4)
    ratios = []
    for n in NS:
        x, xp = _worst_case_batch(n, lin.trainable_variables[0].value, 0.95, rng)
        ratios.append(_diff(fn, engine, x, xp, *_masks(n, n - 1)) / loss.sensitivity(n, 1e-4))
    print(f"\nlogit-dp dot: max ratio {max(ratios):.3f}", np.round(ratios, 3))
    assert 0.05 < max(ratios) <= 1.0


def test_spreadout_sensitivity_at_most_6B():
    rng = np.random.default_rng(6)
    ratios = []
    for loss, scale in [(DP_Spreadout(), 1.5), (DP_Spreadout("dot", radius=1.0), 0.95)]:
        lin = _encoder(linear=True)
        engine = PairGradients(lin, loss)
        fn = _gbar_fn(engine, 1e-4)
        for n in NS:
            x, xp = _worst_case_batch(n, lin.trainable_variables[0].value, scale, rng)
            ratios.append(_diff(fn, engine, x, xp, *_masks(n, n - 1)) / (6 * 1e-4))
        x, xp = _random_batch(rng)
        for n in NS:
            ratios.append(_diff(fn, engine, x, xp, *_masks(n, int(rng.integers(n)))) / (6 * 1e-4))
    print(f"\nspreadout: max ratio {max(ratios):.3f}", np.round(ratios, 3))
    assert 0.05 < max(ratios) <= 1.0


def test_per_anchor_clipping_violates_the_bound_at_large_n():
    """Negative control: clipping each anchor's loss gradient gives O(n B)."""
    n, B, tau = 256, 1e-4, 1.0
    lin = _encoder(linear=True)
    loss = DP_InfoNCE(tau)
    engine = PairGradients(lin, loss)
    rng = np.random.default_rng(7)
    x0 = rng.normal(size=DIM)
    x0 = 1.5 * x0 / np.linalg.norm(x0)
    x1 = rng.normal(size=DIM)
    x1 = 1.5 * x1 / np.linalg.norm(x1)
    x = np.tile(x0, (n, 1)).astype("float32")
    xp = x.copy()
    xp[-1] = x1  # the removed pair's positive differs; every other embedding is equal
    p, o = engine.variables()

    @compile_function
    def per_anchor_gradients(p, o, x, xp, mask):
        u = engine.embeddings(p, o, x)
        v = engine.embeddings(p, o, xp)
        T = loss.coefficients(ops.matmul(u, ops.transpose(v)), mask)
        ja, jb = engine.jacobians(p, o, x), engine.jacobians(p, o, xp)
        return [ops.einsum("idp,id->ip", a, ops.matmul(T, v)) + ops.einsum("jdp,ij,id->ip", b, T, u)
                for a, b in zip(ja, jb)]  # ∇_w ℓ^{(i)} for every anchor i

    def per_anchor_clipped_sum(mask):
        rows = per_anchor_gradients(p, o, x, xp, mask)
        r = np.concatenate([np.asarray(t, "float64") for t in rows], axis=1)
        norms = np.linalg.norm(r, axis=1, keepdims=True)
        return (r * np.minimum(1, B / np.maximum(norms, 1e-30))).sum(0)

    m, mo = _masks(n, n - 1, n)
    anchor = np.linalg.norm(per_anchor_clipped_sum(m) - per_anchor_clipped_sum(mo))
    bound = loss.sensitivity(n, B)
    logit = _diff(_gbar_fn(engine, B), engine, x, xp, m, mo)
    print(f"\nper-anchor clipping: {anchor / bound:.2f} x bound; logit-dp {logit / bound:.3f} x")
    assert anchor > 5 * bound
    assert logit <= bound


def test_clipless_bound_holds_per_pair_and_per_batch():
    rng = np.random.default_rng(8)
    ratios, pair_ratios = [], []
    for linear in (False, True):
        enc = _encoder(linear=linear)
        loss = DP_InfoNCE(0.5, norm_floor=0.3)
        bound, betas = clipless_pair_bound(enc, loss)
        assert bound == pytest.approx(2 * math.sqrt(sum(b * b for b in betas.values())))
        engine = PairGradients(enc, loss)
        fn = _gbar_fn(engine, None)
        norms_fn = compile_function(engine.pair_norms)
        if not linear:  # move the weights: the kernels stay certified by their projection
            trainer = ContrastiveTrainer(enc, loss, "non-private", batch_size=32, jit_compile=True,
                                         optimizer=keras.optimizers.SGD(0.5))
            xa, xb = _random_batch(rng, 200)
            trainer.fit(xa, xb, epochs=2)
        batches = [_random_batch(rng)]
        batches += [_worst_case_batch(n, enc.trainable_variables[0].value, 0.3 * 1.05, rng, 0.3)
                    for n in (3, 64)] if linear else []
        for x, xp in batches:
            p, o = engine.variables()
            pair_ratios.append(float(np.max(np.asarray(norms_fn(p, o, x, xp)))) / bound)
            for n in NS:
                d = _diff(fn, engine, x, xp, *_masks(n, int(rng.integers(n))))
                ratios.append(d / loss.sensitivity(n, bound))
    print(f"\nclipless: max batch ratio {max(ratios):.4f}, max pair ratio {max(pair_ratios):.3f}")
    assert max(pair_ratios) <= 1.0 and max(ratios) <= 1.0
    assert max(pair_ratios) > 0.05


def _attaining_input(encoder, target, rng, samples=20000, steps=60):
    """An input with ``‖x‖ = X0`` and ``‖f(x)‖`` just below ``target``: bisection on the
    great circle between the random inputs of smallest and largest output norm."""
    x = rng.normal(size=(samples, DIM))
    x = X0 * x / np.linalg.norm(x, axis=1, keepdims=True)
    norms = np.linalg.norm(np.asarray(encoder(x.astype("float32"))), axis=1)
    assert norms.min() < target < norms.max()
    lo, hi = x[np.argmin(norms)], x[np.argmax(norms)]

    def point(t):
        p = (1 - t) * lo + t * hi
        return (X0 * p / np.linalg.norm(p)).astype("float32")

    a, b = 0.0, 1.0
    for _ in range(steps):
        m = (a + b) / 2
        if np.linalg.norm(np.asarray(encoder(point(m)[None]))) < target:
            a = m
        else:
            b = m
    return point(a)


@pytest.mark.parametrize("linear", [True, False])
@pytest.mark.parametrize("similarity", ["dot", "cosine"])
def test_clipless_bound_is_attained_and_a_smaller_bound_is_caught(linear, similarity):
    """The clipless bound is tight over the declared input ball, so no smaller constant
    is sound for these encoders: the pair ``(x, x)`` with ``‖x‖ = X0`` and ``‖f(x)‖ = t``
    (``t = r`` for the dot product, ``κ`` for cosine) attains it. There the embedding
    map is linear with ``‖∂h/∂f‖ = G/t``, every cotangent has norm ``G``, every
    orthogonal layer keeps ``‖x‖ = X0`` (its kernel gradient ``x ⊗ δ`` has norm
    ``X0·G``) and the two halves of ``g_xx`` coincide. Negative control: a bound 1 %
    smaller is exceeded."""
    rng = np.random.default_rng(11)
    enc = _encoder(linear=linear)
    loss = (DP_InfoNCE(0.5, similarity="dot", radius=0.5) if similarity == "dot"
            else DP_InfoNCE(0.5, norm_floor=0.3))
    bound, _ = clipless_pair_bound(enc, loss)
    target = loss.radius if similarity == "dot" else loss.norm_floor
    x = _attaining_input(enc, target * (1 - 1e-4), rng)[None]
    engine = PairGradients(enc, loss)
    p, o = engine.variables()
    measured = float(np.asarray(engine.pair_norms(p, o, x, x))[0, 0])
    brute = math.sqrt(sum(float(np.sum(np.square(np.asarray(g, "float64"))))
                          for g in engine.pair_gradients(p, o, x, x)))
    print(f"\nclipless bound {bound:.4f}: attained {measured / bound:.5f} "
          f"(brute force {brute / bound:.5f})")
    assert measured == pytest.approx(brute, rel=1e-4)
    assert measured <= bound * (1 + 1e-5)
    assert measured > 0.99 * bound  # a bound 1 % too small is caught


def test_clipless_refusals():
    with pytest.raises(BoundError, match="norm_floor"):
        clipless_pair_bound(_encoder(), DP_InfoNCE(0.5))
    plain = keras.Sequential([keras.layers.Dense(4)])
    plain.build((None, DIM))
    with pytest.raises(BoundError):
        clipless_pair_bound(plain, DP_InfoNCE(0.5, norm_floor=0.3), input_bound=1.0)


def test_a_stated_input_bound_below_the_encoders_cap_is_checked():
    """The encoder caps its inputs at X0 = 2; ``input_bound=0.5`` below it makes the
    pair bound use 0.5, so pairs above 0.5 would break it: refused before any step
    (they trained unchecked before). Negative control: the bound computed from 0.5
    is far below the one the data needs."""
    loss = DP_InfoNCE(0.5, norm_floor=0.3)
    small, _ = clipless_pair_bound(_encoder(), loss, input_bound=0.5)
    capped, _ = clipless_pair_bound(_encoder(), loss)
    assert small < 0.5 * capped  # what the check protects
    trainer = ContrastiveTrainer(_encoder(), loss, "clipless", batch_size=4, noise_multiplier=1.0,
                                 delta=1e-3, input_bound=0.5)
    x = np.random.default_rng(0).normal(size=(20, DIM)).astype("float32")  # norms ≈ 2.4
    with pytest.raises(ValueError, match="input_bound=0.5"):
        trainer.fit(x, x)
    assert trainer.privacy_ledger.entries == []
    inside = 0.4 * x / np.linalg.norm(x, axis=1, keepdims=True)
    trainer.fit(inside, inside)  # rows within the stated bound train
    ContrastiveTrainer(_encoder(), loss, "clipless", batch_size=4, noise_multiplier=1.0,
                       delta=1e-3).fit(x, x)  # without input_bound the cap bounds the rows


@pytest.mark.parametrize("mixer", ["centring", "on_zero_row", "on_repeat"])
def test_an_encoder_mixing_its_batch_is_refused_before_anything_is_spent(mixer):
    """Refused for what its inference pass does, whatever the layer's type: a Lambda
    centring over the batch axis, and layers that mix only when the batch holds an
    all-zero row (the padding of a Poisson batch) or a repeated row, which rows of
    real data alone would not show."""
    from test_admission import _MixOnRepeat, _MixOnZeroRow

    layer = {"centring": lambda: keras.layers.Lambda(lambda t: t - ops.mean(t, axis=0)),
             "on_zero_row": _MixOnZeroRow, "on_repeat": _MixOnRepeat}[mixer]()
    encoder = keras.Sequential([keras.Input((DIM,)), layer, keras.layers.Dense(4)])
    with pytest.raises(ValueError, match="mixes the examples of a batch.*sensitivity bounds"):
        ContrastiveTrainer(encoder, DP_InfoNCE(), "logit-dp", batch_size=4, noise_multiplier=1.0,
                           delta=1e-3)


class _Subclassed(keras.Model):
    """An encoder that declares no inputs; ``mix``: mixes its batch when it holds an
    all-zero row (a padded batch)."""

    def __init__(self, mix):
        from test_admission import _MixOnZeroRow

        super().__init__()
        self.dense, self.mixer = keras.layers.Dense(4), (_MixOnZeroRow() if mix else None)

    def call(self, x, training=None):
        return self.dense(self.mixer(x) if self.mixer else x)


@pytest.mark.parametrize("mix", [True, False])
def test_an_encoder_without_declared_inputs_is_probed_like_the_training_rows(mix):
    """A subclassed encoder is probed when `fit` sees rows: refused before anything is
    spent if it mixes its batch, trained otherwise (the negative control)."""
    encoder = _Subclassed(mix)
    encoder(np.ones((2, DIM), "float32"))
    trainer = ContrastiveTrainer(encoder, DP_InfoNCE(), "logit-dp", batch_size=4, noise_multiplier=1.0,
                                 delta=1e-3)
    x = np.random.default_rng(0).normal(size=(20, DIM)).astype("float32")
    if mix:
        with pytest.raises(ValueError, match="mixes the examples of a batch"):
            trainer.fit(x, x, steps_per_epoch=1)
        assert trainer.privacy_ledger.entries == []
    else:
        trainer.fit(x, x, steps_per_epoch=1)
        assert trainer.privacy_ledger.training_steps() == 1


class _StateCarrier(keras.layers.Layer):
    """Adds to every row the mean of the previous batch and writes this batch's, in
    inference too: a channel from one step's examples to the next step's embeddings."""

    def build(self, shape):
        self.m = self.add_weight(shape=(shape[-1],), initializer="zeros", trainable=False, name="m")

    def call(self, x, training=None):
        out = x + self.m
        self.m.assign(ops.mean(x, axis=0))
        return out


def test_a_loss_term_or_a_state_the_encoder_writes_reaches_nothing():
    """Adversarial: an ``add_loss`` term and a variable written in inference are
    admitted because they reach nothing: the Logit-DP gradient is that of the same
    encoder without them, and after `fit` the written variable is still its initial
    value (`stateless_call` drops the new state). Control: called directly, the
    layer does write it."""
    from test_admission import _AddLoss

    def encoder(*extra):
        keras.utils.set_random_seed(0)
        return keras.Sequential([keras.Input((DIM,)), keras.layers.Dense(4), *extra])

    x = np.random.default_rng(0).normal(size=(20, DIM)).astype("float32")
    gradients = []
    for extra in ((), (_AddLoss(name="adds_a_loss"),), (_StateCarrier(name="carries_state"),)):
        trainer = ContrastiveTrainer(encoder(*extra), DP_InfoNCE(), "logit-dp", batch_size=4, clip_norm=0.5,
                                     noise_multiplier=1.0, delta=1e-3)
        gradients.append(np.concatenate([np.ravel(g) for g in trainer.batch_gradient(x[:8], x[8:16])[0]]))
    np.testing.assert_allclose(gradients[1], gradients[0], rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(gradients[2], gradients[0], rtol=1e-6, atol=1e-7)
    trainer.fit(x, x, steps_per_epoch=2)
    state = trainer.encoder.layers[-1].m
    assert np.all(np.asarray(state) == 0.0)
    trainer.encoder(x[:4])
    assert np.any(np.asarray(state) != 0.0)  # the write that was dropped


def test_batch_normalization_in_inference_is_admitted_with_a_warning():
    """Negative control: with ``training=False`` a BatchNormalization is a fixed
    per-example map (its statistics must be public): admitted, and it trains."""
    encoder = keras.Sequential([keras.Input((DIM,)), keras.layers.Dense(4),
                                keras.layers.BatchNormalization()])
    with pytest.warns(UserWarning, match="BatchNormalization runs in inference mode"):
        trainer = ContrastiveTrainer(encoder, DP_InfoNCE(), "logit-dp", batch_size=4,
                                     noise_multiplier=1.0, delta=1e-3)
    x = np.random.default_rng(0).normal(size=(20, DIM)).astype("float32")
    trainer.fit(x, x, steps_per_epoch=1)
    assert trainer.privacy_ledger.training_steps() == 1


# -- noise and accounting ----------------------------------------------------------------

@pytest.mark.parametrize("strategy", ["logit-dp", "naive", "clipless"])
def test_noise_std_is_sigma_sensitivity_over_b(strategy):
    enc = _encoder()
    loss = DP_InfoNCE(0.5, norm_floor=0.3)
    sigma, b, N = 1.3, 16, 100
    trainer = ContrastiveTrainer(enc, loss, strategy, batch_size=b, clip_norm=0.2,
                                 noise_multiplier=sigma, delta=1e-3, reproducible=True, seed=0)
    trainer.nb_pairs = N
    expected_delta = (0.4 if strategy == "naive" else loss.sensitivity(
        N + 1, 0.2 if strategy == "logit-dp" else trainer.pair_bound))
    assert trainer.sensitivity() == pytest.approx(expected_delta)
    rng = np.random.default_rng(9)
    x, xp = _random_batch(rng, 40)
    mask = (rng.random(40) < 0.5).astype("float32")
    clean = _flat(trainer.batch_gradient(x, xp, mask)[0]) / b
    draws = [_flat(trainer.noisy_gradient(x, xp, mask)[0]) - clean for _ in range(60)]
    assert not np.allclose(draws[0], draws[1])
    std = np.std(np.stack(draws))
    assert std == pytest.approx(sigma * expected_delta / b, rel=0.03)


def test_sensitivity_sizes_and_accounting():
    enc = _encoder()
    loss = DP_InfoNCE(1.0)
    sup = ContrastiveTrainer(enc, loss, "logit-dp", clip_norm=0.5, noise_multiplier=1.0,
                             sensitivity_size="supremum")
    assert sup.sensitivity() == pytest.approx(0.5 * 2 * (1 + math.e ** 2))
    rng = np.random.default_rng(10)
    x, xp = _random_batch(rng, 120)
    trainer = ContrastiveTrainer(enc, loss, "logit-dp", batch_size=12, clip_norm=0.5,
                                 target_epsilon=3.0, delta=1e-3, reproducible=True, seed=0)
    history = trainer.fit(x, xp, epochs=2)
    steps = 2 * math.ceil(120 / 12)
    assert trainer.privacy_ledger.training_steps() == steps
    eps = accounting.compute_epsilon(trainer.noise_multiplier, 0.1, steps, 1e-3, "rdp")
    assert history["epsilon"][-1] == pytest.approx(eps, rel=1e-6)
    assert eps <= 3.0 + 1e-3 and eps > 2.9
    assert trainer.sensitivity() == pytest.approx(loss.sensitivity(121, 0.5))
    with pytest.raises(ValueError, match="delta"):
        ContrastiveTrainer(enc, loss, "logit-dp", batch_size=12, noise_multiplier=1.0,
                           delta=0.1).fit(x, xp)


def test_non_private_training_lowers_the_loss():
    enc = _encoder()
    rng = np.random.default_rng(11)
    centers = rng.normal(size=(4, DIM))
    labels = rng.integers(4, size=200)
    x = (centers[labels] + 0.3 * rng.normal(size=(200, DIM))).astype("float32")
    xp = (centers[labels] + 0.3 * rng.normal(size=(200, DIM))).astype("float32")
    loss = DP_InfoNCE(0.5)
    trainer = ContrastiveTrainer(enc, loss, "non-private", batch_size=32,
                                 optimizer=keras.optimizers.Adam(1e-2))

    def full_loss():
        p, o = trainer.engine.variables()
        return float(loss.batch_loss(trainer.engine.similarities(p, o, x, xp))) / len(x)

    before = full_loss()
    trainer.fit(x, xp, epochs=3)
    assert full_loss() < before - 0.1


# -- evaluation -----------------------------------------------------------------------------

def test_pairs_and_knn():
    rng = np.random.default_rng(12)
    y = rng.integers(3, size=60)
    x = np.eye(3)[y] + 0.01 * rng.normal(size=(60, 3))
    a, b, labels = same_class_pairs(x, y)
    assert np.all(a.argmax(1) == labels) and np.all(b.argmax(1) == labels)
    assert len(a) == sum(np.sum(y == c) // 2 for c in range(3))
    assert knn_accuracy(x, y, x + 0.01, y, k=3) == 1.0
    assert knn_accuracy(x, y, x, y, k=3, mode="agreement") == 1.0
    shuffled = rng.permutation(y)
    assert knn_accuracy(x, shuffled, x, y, k=1) < 0.7
    enc = _encoder()
    e = embed(enc, rng.normal(size=(5, DIM)), DP_InfoNCE())
    np.testing.assert_allclose(np.linalg.norm(e, axis=1), 1, rtol=1e-5)


# -- one noise source, one gate -------------------------------------------------------------

def _low_words_fixed(monkeypatch):
    """OS draws whose last 4 bytes are fixed: a seed of 32 bits or fewer is then constant."""
    real = os.urandom
    monkeypatch.setattr(os, "urandom", lambda n: real(max(n - 4, 0)) + b"\x07" * min(n, 4))


def test_noise_seed_has_64_bits_and_ignores_the_global_seed(monkeypatch):
    """The noise seed had 31 bits (``os.urandom(4)``): OS draws agreeing on 32 bits gave
    bit-identical noise."""
    enc = _encoder()
    x = np.ones((4, DIM), "float32")

    def noise():
        keras.utils.set_random_seed(0)
        trainer = ContrastiveTrainer(enc, DP_InfoNCE(0.5), "logit-dp", batch_size=4,
                                     noise_multiplier=1.0, delta=1e-3, jit_compile=False)
        trainer.nb_pairs = 50
        clean = _flat(trainer.batch_gradient(x, x)[0]) / 4
        return _flat(trainer.noisy_gradient(x, x)[0]) - clean

    assert not np.allclose(noise(), noise())
    _low_words_fixed(monkeypatch)
    a, b = noise(), noise()
    print(f"\nOS draws agreeing on 32 bits: max |noise1 − noise2| = {np.abs(a - b).max():.3g}")
    assert np.abs(a - b).max() > 0.1 * np.abs(a).max()


def test_gate_records_steps_before_they_run_and_enforces_the_budget():
    from kdp.training.gate import BudgetExceededError
    from kdp.training.ledger import training_mechanism

    enc = _encoder()
    x, xp = _random_batch(np.random.default_rng(14), 60)
    kwargs = dict(batch_size=6, clip_norm=0.5, noise_multiplier=1.2, delta=1e-3)
    trainer = ContrastiveTrainer(enc, DP_InfoNCE(1.0), "logit-dp", **kwargs)
    with pytest.raises(ValueError, match="reproducible"):
        ContrastiveTrainer(enc, DP_InfoNCE(1.0), "logit-dp", seed=1, **kwargs)
    with pytest.raises(ValueError, match="explicit seed"):
        ContrastiveTrainer(enc, DP_InfoNCE(1.0), "logit-dp", reproducible=True, **kwargs)
    trainer.fit(x, xp, epochs=2)
    assert trainer.privacy_ledger is trainer.privacy_gate.ledger
    [entry] = trainer.privacy_ledger.entries
    mechanism = {k: v for k, v in entry.items() if k not in ("run", "seq", "count")}
    assert entry["count"] == 20 and mechanism == training_mechanism(1.2, 0.1, "poisson", None)
    acc = dp_accounting.rdp.RdpAccountant()
    acc.compose(dp_accounting.PoissonSampledDpEvent(0.1, dp_accounting.GaussianDpEvent(1.2)), 20)
    assert trainer.privacy_spent()[0] == pytest.approx(acc.get_epsilon(1e-3), rel=1e-9)
    # one more epoch fits a budget of 25 steps, two do not: refused before anything runs
    eps_25 = accounting.compute_epsilon(1.2, 0.1, 25, 1e-3)
    capped = ContrastiveTrainer(enc, DP_InfoNCE(1.0), "logit-dp", epsilon_max=eps_25, **kwargs)
    capped.fit(x, xp, epochs=2)
    weights = [np.array(v) for v in enc.trainable_variables]
    with pytest.raises(BudgetExceededError):
        capped.fit(x, xp, epochs=1)
    assert sum(e["count"] for e in capped.privacy_ledger.entries) == 20
    assert all(np.array_equal(w, np.array(v)) for w, v in zip(weights, enc.trainable_variables))
    plain = ContrastiveTrainer(enc, DP_InfoNCE(1.0), "non-private", batch_size=6)
    assert plain.privacy_spent()[0] == 0
    plain.fit(x, xp)
    assert plain.privacy_spent()[0] == math.inf
