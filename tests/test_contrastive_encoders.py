"""Contrastive DP training of a keras_hub text encoder (a tiny BERT with random
weights, dict inputs): exact per-pair norms against per-pair autodiff, the
clipped pair gradients and their recombination, negative controls, Logit-DP
training through the ledger, and the clipless refusal."""

import functools

import keras
import numpy as np
import pytest
from keras import ops

from kdp.autodiff import compile_function, gradient
from kdp.bounds import BoundError
from kdp.contrastive import ContrastiveTrainer, embed
from kdp.losses import DP_InfoNCE

keras_hub = pytest.importorskip("keras_hub")

VOCAB, SEQ = 50, 8
KEYS = ("token_ids", "segment_ids", "padding_mask")


def _bert(seed=0):
    """A BERT backbone as a model ``{token_ids, segment_ids, padding_mask} -> (n, 16)``."""
    keras.utils.set_random_seed(seed)
    backbone = keras_hub.models.BertBackbone(
        vocabulary_size=VOCAB, num_layers=1, num_heads=2, hidden_dim=16, intermediate_dim=32,
        max_sequence_length=SEQ, dropout=0.0)
    inputs = {k: keras.Input((SEQ,), dtype="int32", name=k) for k in KEYS}
    return keras.Model(inputs, backbone(inputs)["pooled_output"])


@pytest.fixture(scope="module")
@functools.cache  # once per process, even if the fixture is set up again
def bert():
    return _bert()


def _tokens(n, rng):
    """``n`` token sequences of random lengths (2 to SEQ), zero-padded, two segments."""
    lengths = rng.integers(2, SEQ + 1, size=n)
    mask = (np.arange(SEQ)[None] < lengths[:, None]).astype("int32")
    ids = rng.integers(1, VOCAB, size=(n, SEQ)).astype("int32") * mask
    segments = (np.arange(SEQ)[None] >= (lengths[:, None] + 1) // 2).astype("int32") * mask
    return {"token_ids": ids, "segment_ids": segments, "padding_mask": mask}


def _pairs(n, seed=0):
    """Anchors and positives: two token sequences per pair."""
    rng = np.random.default_rng(seed)
    return _tokens(n, rng), _tokens(n, rng)


def _row(x, k):
    return {key: v[k:k + 1] for key, v in x.items()}


def _dense(g):
    if keras.backend.backend() == "tensorflow":  # an embedding's gradient is IndexedSlices
        import tensorflow as tf

        g = tf.convert_to_tensor(g)
    return np.asarray(g, "float64")


def _bruteforce(encoder, loss, x, xp):
    """``g_ij = ∇_w S_ij`` for every pair, one pair at a time, and its two halves: through
    the anchor alone (``J_iᵀ v_j``) and through the positive alone (``J'_jᵀ u_i``).
    Returns three ``(n, n, p)`` arrays."""
    others = [v.value for v in encoder.non_trainable_variables]

    def pair_grad(params, a, b):
        def s(stop_a, stop_b, *p):
            fa, _ = encoder.stateless_call(list(p), others, a, training=False)
            fb, _ = encoder.stateless_call(list(p), others, b, training=False)
            fa = ops.stop_gradient(fa) if stop_a else fa
            fb = ops.stop_gradient(fb) if stop_b else fb
            return ops.sum(loss.similarities(fa, fb))

        return [gradient(lambda *p: s(*stops, *p), *params)
                for stops in ((False, False), (False, True), (True, False))]

    fn = compile_function(pair_grad)
    params = [v.value for v in encoder.trainable_variables]
    n = len(x["token_ids"])
    out = [[[np.concatenate([_dense(t).ravel() for t in g]) for g in fn(params, _row(x, i), _row(xp, j))]
            for j in range(n)] for i in range(n)]
    return tuple(np.array([[out[i][j][k] for j in range(n)] for i in range(n)]) for k in range(3))


N_PAIRS, BATCH, CLIP = 16, 4, 20.0


@pytest.fixture(scope="module")
@functools.cache  # once per process, even if the fixture is set up again
def trainer(bert):
    """A Logit-DP trainer of the BERT encoder; its padded batches have 16 rows."""
    return ContrastiveTrainer(bert, DP_InfoNCE(1.0), "logit-dp", batch_size=BATCH, clip_norm=CLIP,
                              noise_multiplier=1.0, delta=1e-3, reproducible=True, seed=0,
                              optimizer=keras.optimizers.Adam(1e-2))


@pytest.fixture(scope="module")
@functools.cache  # once per process, even if the fixture is set up again
def soundness(trainer):
    """Five pairs: the brute-force pair gradients, the engine's exact norms and the
    trainer's Logit-DP gradient (the five pairs padded to the trainer's 16 rows)."""
    engine = trainer.engine
    x, xp = _pairs(5)
    g, ga, gb = _bruteforce(trainer.encoder, trainer.loss, x, xp)
    norms = compile_function(engine.pair_norms)(*engine.variables(), x, xp)
    pad = {k: np.zeros((N_PAIRS - 5, SEQ), "int32") for k in KEYS}
    grads, _ = trainer.batch_gradient(*({k: np.concatenate([z[k], pad[k]]) for k in KEYS}
                                        for z in (x, xp)),
                                      mask=np.arange(N_PAIRS) < 5)
    params, others = engine.variables()
    T = engine.loss.coefficients(engine.similarities(params, others, x, xp), ops.ones((5,)))
    return {"g": g, "ga": ga, "gb": gb, "norms": _dense(norms), "T": _dense(T),
            "gbar": np.concatenate([_dense(t).ravel() for t in grads])}


def test_pair_norms_and_clipped_gradients_match_per_pair_autodiff(trainer, soundness):
    g, norms = soundness["g"], soundness["norms"]
    brute = np.linalg.norm(g, axis=-1)
    # rtol on the pairs, atol for the Gram form's float32 cancellation on a near-zero pair
    np.testing.assert_allclose(norms, brute, rtol=2e-3, atol=1e-3 * brute.max())
    # every clipped pair gradient is within B, and the trainer's gradient (one reweighted
    # backward pass, padding masked) is Σ_ij T_ij Clip_B(g_ij) of the brute-force g_ij
    scale = np.minimum(1.0, CLIP / np.maximum(norms, 1e-30))
    assert np.linalg.norm(scale[..., None] * g, axis=-1).max() <= CLIP * (1 + 1e-3)
    assert (brute > CLIP).any() and (brute < CLIP).any()  # the clip acts on some pairs, not all
    expected = np.einsum("ij,ij,ijp->p", soundness["T"], scale, g)
    np.testing.assert_allclose(soundness["gbar"], expected, rtol=2e-3,
                               atol=1e-4 * np.abs(expected).max())


def test_negative_controls_a_halved_norm_or_a_wrong_cross_term_is_caught(soundness):
    g, ga, gb, norms = (soundness[k] for k in ("g", "ga", "gb", "norms"))
    brute = np.linalg.norm(g, axis=-1)
    np.testing.assert_allclose(ga + gb, g, rtol=1e-4, atol=1e-6 * np.abs(g).max())
    # norms underestimated by 2 (a doubled clip): some clipped pair gradient exceeds B
    scale = np.minimum(1.0, CLIP / np.maximum(norms / 2, 1e-30))
    assert np.linalg.norm(scale[..., None] * g, axis=-1).max() > 1.5 * CLIP
    # ‖g_ij‖² = ‖J_iᵀv_j‖² + ‖J'_jᵀu_i‖² + 2⟨J_iᵀv_j, J'_jᵀu_i⟩: a dropped or flipped
    # cross term is far from the norms that match the brute force
    selfs = np.sum(ga * ga, -1) + np.sum(gb * gb, -1)
    cross = 2 * np.sum(ga * gb, -1)
    np.testing.assert_allclose(np.sqrt(selfs + cross), brute, rtol=1e-4, atol=1e-5 * brute.max())
    for wrong in (np.sqrt(selfs), np.sqrt(np.maximum(selfs - cross, 0))):
        assert np.max(np.abs(wrong - norms)) > 0.05 * brute.max()


def test_clipless_refuses_a_keras_hub_encoder(bert):
    with pytest.raises(BoundError, match="kdp Lipschitz layers.*logit-dp"):
        ContrastiveTrainer(bert, DP_InfoNCE(1.0, norm_floor=0.5), "clipless",
                           noise_multiplier=1.0)


def test_naive_clips_the_batch_gradient_of_the_encoder(bert):
    naive = ContrastiveTrainer(bert, DP_InfoNCE(1.0), "naive", batch_size=BATCH, clip_norm=0.5,
                               noise_multiplier=1.0, delta=1e-3)
    grads, value = naive.batch_gradient(*_pairs(5))
    norm = np.linalg.norm(np.concatenate([_dense(g).ravel() for g in grads]))
    assert np.isfinite(float(value)) and norm == pytest.approx(0.5, rel=1e-4)  # clipped to B


def test_logit_dp_fit_trains_the_encoder_and_spends_epsilon(trainer):
    encoder = trainer.encoder  # trained in place: the last test of the module
    x, xp = _pairs(N_PAIRS, seed=1)
    before = [np.asarray(v.value).copy() for v in encoder.trainable_variables]
    history = trainer.fit(x, xp, epochs=1, steps_per_epoch=2)
    eps = trainer.privacy_spent()[0]
    assert 0 < eps < np.inf and history["epsilon"][-1] == eps
    assert sum(e["count"] for e in trainer.privacy_ledger.entries) == 2
    assert np.all(np.isfinite(history["step_loss"]))
    after = [np.asarray(v.value) for v in encoder.trainable_variables]
    assert all(np.all(np.isfinite(w)) for w in after)
    assert any(not np.allclose(a, b) for a, b in zip(before, after))
    assert embed(encoder, x).shape == (N_PAIRS, 16)
