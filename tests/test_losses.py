"""The losses' per-example Lipschitz constants, checked numerically (Béthune et al. 2024, §3).

For every loss, ``‖∂ℓ_i/∂ŷ_i‖₂ ≤ get_L()`` on random, extreme, unbalanced and
adversarial (gradient-ascent) logits; the largest ratio found is printed and,
where the docstring says the constant is tight, must be ≥ 0.99. A deel-lip-style
batch-weighted KR loss is the negative control: the same check must catch it.
"""

import math

import keras
import numpy as np
import pytest
from keras import ops

from kdp import autodiff, losses
from kdp.bounds import BoundError, compute_gradient_bounds
from kdp.layers import DP_BoundedInput, DP_GroupSort, DP_QuickSpectralDense
from kdp.losses.base import DPLoss

TOL = 1e-6
BATCH = 16


# --- the check -------------------------------------------------------------------

def per_example_gradients(loss, y, logits):
    """Row i is ∂ℓ_i/∂ŷ_i: the gradient of Σ_i ℓ_i w.r.t. the logits (float64)."""
    y = ops.convert_to_tensor(y)
    (g,) = autodiff.gradient(lambda p: ops.sum(loss.call(y, p)), np.asarray(logits, "float32"))
    return np.asarray(ops.convert_to_numpy(g), dtype="float64")


def gradient_norms(loss, y, logits):
    g = per_example_gradients(loss, y, logits)
    assert np.all(np.isfinite(g)), f"{loss.name}: non-finite gradient"
    return np.linalg.norm(g, axis=-1)


def check_bound(loss, y, logits, what=""):
    """Assert every per-example gradient norm ≤ get_L()·(1+TOL); return the largest ratio."""
    ratio = float(np.max(gradient_norms(loss, y, logits)) / loss.get_L())
    assert ratio <= 1 + TOL, (
        f"{loss.name} {loss.get_config()} {what}: per-example gradient norm is "
        f"{ratio:.6g} × get_L()"
    )
    return ratio


def ascend(loss, y, logits, steps=10, seed=0):
    """Gradient ascent on ‖∂ℓ_i/∂ŷ_i‖² (row by row, normalised steps), plus random
    proposals kept only where they increase the norm (the norm of a piecewise
    linear loss's gradient has zero gradient). Returns the final logits."""
    rng = np.random.default_rng(seed)
    y_t = ops.convert_to_tensor(y)

    def squared_norms_sum(p):
        (g,) = autodiff.gradient(lambda q: ops.sum(loss.call(y_t, q)), p)
        return ops.sum(ops.square(g))

    ascent = autodiff.compile_function(lambda p: autodiff.gradient(squared_norms_sum, p))
    x = np.asarray(logits, "float32")
    scale = np.maximum(np.linalg.norm(x, axis=-1, keepdims=True), 1e-3)
    step = 0.3 * scale
    best = gradient_norms(loss, y, x)
    for _ in range(steps):
        (d,) = ascent(x)
        # None (tensorflow) where the gradient norm does not depend on ŷ at all
        d = np.zeros(x.shape) if d is None else np.asarray(ops.convert_to_numpy(d), "float64")
        d = np.nan_to_num(d)
        d_norm = np.linalg.norm(d, axis=-1, keepdims=True)
        direction = np.where(d_norm > 0, d / np.maximum(d_norm, 1e-30), 0.0)
        noise = rng.normal(size=x.shape)
        noise /= np.linalg.norm(noise, axis=-1, keepdims=True)
        candidate = (x + step * (direction + 0.3 * noise)).astype("float32")
        norms = gradient_norms(loss, y, candidate)
        better = norms >= best
        x = np.where(better[:, None], candidate, x)
        best = np.where(better, norms, best)
        step = np.where(better[:, None], step * 1.2, step * 0.6)
    return x


# --- the losses under test ---------------------------------------------------------
# name -> (factories over extreme hyper-parameters, output counts, label kind, tight)

CASES = {
    "tau_cce": ([lambda t=t: losses.DP_TauCategoricalCrossentropy(t) for t in (1e-3, 1.0, 1e3)],
                (2, 10), "class", True),
    "tau_bce": ([lambda t=t: losses.DP_TauBCE(t) for t in (1e-3, 1.0, 1e3)],
                (1, 3), "binary", True),  # tight for one output
    "hinge": ([lambda m=m: losses.DP_MulticlassHinge(m) for m in (1e-3, 1.0, 1e3)],
              (2, 10), "class", True),
    "kr": ([losses.DP_MulticlassKR], (2, 10), "class", True),
    "hkr": ([lambda a=a, m=m: losses.DP_MulticlassHKR(a, m)
             for a, m in ((0.0, 1.0), (1e-3, 1e-3), (10.0, 1.0), (1e3, 1e3), (1e3, 1e-3))],
            (2, 10), "class", True),
    "kcos": ([lambda k=k: losses.DP_KCosineSimilarity(k) for k in (1e-3, 1.0, 1e3)],
             (2, 10), "class", True),
    "mae": ([losses.DP_MeanAbsoluteError], (1, 10), "class", True),  # tight for one output
}


def make_labels(kind, classes, n, rng, unbalanced=False):
    if kind == "binary":
        if unbalanced:
            y = np.zeros((n, classes), "float32")
            y[-1] = 1.0
            return y
        return rng.integers(0, 2, size=(n, classes)).astype("float32")
    if classes == 1:  # regression target (MAE)
        return np.zeros((n, 1), "float32") if unbalanced else rng.normal(size=(n, 1)).astype("float32")
    if unbalanced:
        return np.array([0] * (n - 1) + [1], "int32")
    return rng.integers(0, classes, size=(n,)).astype("int32")


LOGIT_SCALES = (0.0, 1e-4, 1e-2, 1.0, 1e2, 1e3)


def run_all_checks(factory, classes_list, kind, rng, ascent=True):
    """Every check of the acceptance list for one loss; returns the largest ratios.

    The losses are per-example (checked below), so the random and extreme cases
    are stacked into one batch per loss; the unbalanced batch is its own batch.
    """
    worst = {"random/extreme": 0.0, "unbalanced": 0.0, "gradient ascent": 0.0}

    def record(what, ratio):
        worst[what] = max(worst[what], ratio)

    for make in factory:
        loss = make()
        for classes in classes_list:
            y = make_labels(kind, classes, BATCH, rng)
            z = rng.normal(size=(BATCH, classes))
            u = rng.uniform(-1.0, 1.0, size=(BATCH, classes))
            # random, tiny and extreme (|ŷ| up to 1e3) logits ...
            cases = [s * z for s in LOGIT_SCALES] + [s * u for s in LOGIT_SCALES]
            # ... confidently wrong and confidently right at |ŷ| = 1e3
            if kind == "binary":
                wrong = 1e3 * (1.0 - 2.0 * y)
            else:
                ids = y.reshape(-1).astype(int) if classes > 1 else np.zeros(BATCH, int)
                wrong = -1e3 * np.eye(classes)[ids] + 1e3 * np.eye(classes)[(ids + 1) % classes]
            cases += [wrong, -wrong]
            labels = np.concatenate([y] * len(cases))
            record("random/extreme", check_bound(loss, labels, np.concatenate(cases), "random/extreme"))
            # unbalanced batch: one example of a rare class among many
            y_rare = make_labels(kind, classes, 4 * BATCH, rng, unbalanced=True)
            z_rare = rng.normal(size=(4 * BATCH, classes))
            for s in (0.0, 1e3) if ascent else (1.0,):
                record("unbalanced", check_bound(loss, y_rare, s * z_rare, f"unbalanced {s}"))
            if ascent:  # logits found by gradient ascent on the gradient norm
                starts = np.concatenate([s * z for s in (1e-2, 1.0, 10.0, 1e2)])
                start_labels = np.concatenate([y] * 4)  # same shape as y_rare
                found = ascend(loss, start_labels, starts)
                record("gradient ascent", check_bound(loss, start_labels, found, "gradient ascent"))
    return worst


@pytest.mark.parametrize("name", list(CASES))
def test_per_example_gradient_bound(name, rng):
    factories, classes_list, kind, tight = CASES[name]
    by_case = run_all_checks(factories, classes_list, kind, rng)
    worst = max(by_case.values())
    details = ", ".join(f"{k} {v:.6f}" for k, v in by_case.items())
    print(f"\n[kdp] {name}: largest ‖∂ℓ_i/∂ŷ_i‖ / get_L() = {worst:.8f} ({details})")
    if tight:
        assert worst >= 0.99, f"{name}: get_L() claimed tight but the largest ratio is {worst}"


def test_claimed_constants():
    assert losses.DP_TauCategoricalCrossentropy(5.0).get_L() == pytest.approx(math.sqrt(2))
    assert losses.DP_TauBCE(5.0).get_L() == 1.0
    assert losses.DP_MulticlassHinge(2.0).get_L() == 1.0
    assert losses.DP_MulticlassKR().get_L() == 1.0
    assert losses.DP_MulticlassHKR(3.0, 1.0).get_L() == 4.0
    assert losses.DP_KCosineSimilarity(4.0).get_L() == 0.25
    assert losses.DP_MeanAbsoluteError().get_L() == 1.0


def test_exact_values(rng):
    """The formulas of the docstrings, computed independently in numpy."""
    y = np.array([0, 2, 1], "int32")
    z = rng.normal(size=(3, 3)).astype("float32")
    oh = np.eye(3)[y]
    np_ = lambda v: np.asarray(ops.convert_to_numpy(v))  # noqa: E731
    tau = 3.0
    lse = np.log(np.sum(np.exp(tau * z), -1))
    np.testing.assert_allclose(np_(losses.DP_TauCategoricalCrossentropy(tau).call(y, z)),
                               (lse - tau * np.sum(oh * z, -1)) / tau, rtol=1e-5)
    c = 2 * math.sqrt(2 / 3)
    w = np.where(oh == 1, c / 2, c / 4)
    s = 2 * oh - 1
    m = 0.7
    hinge = np.sum(w * np.maximum(0, m / 2 - s * z), -1)
    kr = -np.sum(w * s * z, -1)
    np.testing.assert_allclose(np_(losses.DP_MulticlassHinge(m).call(y, z)), hinge, rtol=1e-5)
    np.testing.assert_allclose(np_(losses.DP_MulticlassKR().call(y, z)), kr, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np_(losses.DP_MulticlassHKR(2.0, m).call(y, z)), 2 * hinge + kr,
                               rtol=1e-5, atol=1e-6)
    k = 0.5
    kcos = -np.sum(oh * z, -1) / np.maximum(np.linalg.norm(z, axis=-1), k)
    np.testing.assert_allclose(np_(losses.DP_KCosineSimilarity(k).call(y, z)), kcos, rtol=1e-5)
    np.testing.assert_allclose(np_(losses.DP_MeanAbsoluteError().call(y, z)),
                               np.mean(np.abs(z - oh), -1), rtol=1e-5)
    yb = (rng.uniform(size=(3, 3)) > 0.5).astype("float32")
    bce = np.mean(np.logaddexp(0, tau * z) - tau * yb * z, -1) / tau
    np.testing.assert_allclose(np_(losses.DP_TauBCE(tau).call(yb, z)), bce, rtol=1e-5)


def test_kcosine_gradient_finite_at_zero():
    """ŷ = 0 (e.g. a zero input through a bias-free model) must not give NaN."""
    g = per_example_gradients(losses.DP_KCosineSimilarity(2.0), np.array([0, 1]), np.zeros((2, 3)))
    np.testing.assert_allclose(g, -0.5 * np.eye(3)[[0, 1]], atol=1e-7)


# --- per-example independence, labels, weights, config ---------------------------

def all_losses():
    return [
        losses.DP_TauCategoricalCrossentropy(2.0), losses.DP_TauBCE(2.0),
        losses.DP_MulticlassHinge(0.5), losses.DP_MulticlassKR(),
        losses.DP_MulticlassHKR(5.0, 0.5), losses.DP_KCosineSimilarity(0.7),
        losses.DP_MeanAbsoluteError(),
    ]


def labels_for(loss, classes, n, rng):
    kind = "binary" if isinstance(loss, losses.DP_TauBCE) else "class"
    return make_labels(kind, classes, n, rng)


def independence_violation(loss, y, logits, rng):
    """Largest change of ℓ_i (i ≠ j) when example j is replaced, over j."""
    base = np.asarray(ops.convert_to_numpy(loss.call(y, logits)))
    worst = 0.0
    for j in (0, len(y) - 1):
        y2, z2 = np.array(y), np.array(logits)
        y2[j] = y2[(j + 1) % len(y)] if y2.ndim == 1 else 1 - y2[j]
        z2[j] = 1e3 * rng.normal(size=z2.shape[1:])
        new = np.asarray(ops.convert_to_numpy(loss.call(y2, z2.astype("float32"))))
        keep = np.arange(len(y)) != j
        worst = max(worst, float(np.max(np.abs(new[keep] - base[keep]) / (1 + np.abs(base[keep])))))
    return worst


@pytest.mark.parametrize("index", range(7))
def test_per_example_independence(index, rng):
    loss = all_losses()[index]
    y = labels_for(loss, 4, 12, rng)
    z = rng.normal(size=(12, 4)).astype("float32")
    assert independence_violation(loss, y, z, rng) <= 1e-6


@pytest.mark.parametrize("index", [0, 2, 3, 4, 5, 6])
def test_integer_and_one_hot_labels_agree(index, rng):
    loss = all_losses()[index]
    y = rng.integers(0, 5, size=(8,))
    z = rng.normal(size=(8, 5)).astype("float32")
    one_hot = np.eye(5, dtype="float32")[y]
    ref = ops.convert_to_numpy(loss.call(one_hot, z))
    for labels in (y.astype("int32"), y.astype("int64"), y.reshape(-1, 1), y.astype("float32")):
        np.testing.assert_allclose(ops.convert_to_numpy(loss.call(labels, z)), ref, rtol=1e-6)
    # through Loss.__call__ (which casts the labels to the loss dtype) as well
    np.testing.assert_allclose(float(loss(y, z)), float(loss(one_hot, z)), rtol=1e-6)


@pytest.mark.parametrize("index", range(7))
def test_sample_weight(index, rng):
    loss = all_losses()[index]
    config = {**loss.get_config(), "reduction": "sum"}
    summed = type(loss).from_config(config)
    y = labels_for(loss, 3, 10, rng)
    z = rng.normal(size=(10, 3)).astype("float32")
    sw = rng.uniform(size=(10,)).astype("float32")
    sw[::3] = 0.0  # padding of a Poisson batch: zero weights
    per_example = np.asarray(ops.convert_to_numpy(loss.call(y, z)))
    np.testing.assert_allclose(float(summed(y, z, sample_weight=sw)), np.sum(sw * per_example),
                               rtol=1e-5)
    np.testing.assert_allclose(float(loss(y, z, sample_weight=sw)), np.sum(sw * per_example) / 10,
                               rtol=1e-5)
    # zero-weighted rows do not matter, whatever they hold
    z2 = z.copy()
    z2[::3] = 1e3
    np.testing.assert_allclose(float(summed(y, z2, sample_weight=sw)), float(summed(y, z, sample_weight=sw)),
                               rtol=1e-5)


@pytest.mark.parametrize("index", range(7))
def test_get_config_round_trip(index, rng):
    loss = all_losses()[index]
    y = labels_for(loss, 3, 6, rng)
    z = rng.normal(size=(6, 3)).astype("float32")
    for clone in (type(loss).from_config(loss.get_config()),
                  keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(loss))):
        assert type(clone) is type(loss)
        assert clone.get_config() == loss.get_config()
        assert clone.get_L() == loss.get_L()
        np.testing.assert_allclose(ops.convert_to_numpy(clone.call(y, z)),
                                   ops.convert_to_numpy(loss.call(y, z)), rtol=1e-6)


def test_invalid_hyper_parameters():
    for bad in (lambda: losses.DP_TauCategoricalCrossentropy(0.0), lambda: losses.DP_TauBCE(-1.0),
                lambda: losses.DP_MulticlassHinge(0.0), lambda: losses.DP_MulticlassHKR(-1.0),
                lambda: losses.DP_KCosineSimilarity(0.0)):
        with pytest.raises(ValueError):
            bad()


# --- negative control: deel-lip's batch-weighted KR ---------------------------------

class BatchWeightedKR(DPLoss):
    """deel-lip-style multiclass KR: example i of class c weighted by b/n_c (and
    b/(b − n_k) on the other classes k), n_c counted **in the batch**; it claims
    L = 1 like lip-dp does. Not per-example: the check must catch it."""

    def call(self, y_true, y_pred):
        y = ops.one_hot(ops.cast(ops.reshape(y_true, (-1,)), "int32"), y_pred.shape[-1])
        b = ops.cast(ops.shape(y_pred)[0], y_pred.dtype)
        n_pos = ops.sum(y, axis=0, keepdims=True)
        weights = y * b / ops.maximum(n_pos, 1.0) - (1 - y) * b / ops.maximum(b - n_pos, 1.0)
        return -ops.mean(weights * y_pred, axis=-1)

    def get_L(self):
        return 1.0


def test_negative_control_batch_weighted_kr(rng):
    loss = BatchWeightedKR()
    classes = 10
    # even a balanced batch exceeds the claim: √(1 + 1/(K−1)) for K classes ...
    y = np.repeat(np.arange(classes), 4).astype("int32")
    z = rng.normal(size=(len(y), classes))
    balanced = float(np.max(gradient_norms(loss, y, z)))
    assert balanced == pytest.approx(math.sqrt(1 + 1 / (classes - 1)), rel=1e-5)
    # ... and an unbalanced one (one rare example among 99) by far
    y_rare = np.array([0] * 99 + [1], "int32")
    z_rare = rng.normal(size=(100, classes))
    with pytest.raises(AssertionError, match="per-example gradient norm"):
        check_bound(loss, y_rare, z_rare, "unbalanced")
    ratio = float(np.max(gradient_norms(loss, y_rare, z_rare)))
    print(f"\n[kdp] batch-weighted KR, 1 rare among 100: ratio {ratio:.3f} (claimed 1)")
    assert ratio > 5
    # so is the full acceptance routine, and the independence check
    with pytest.raises(AssertionError):
        run_all_checks([BatchWeightedKR], (10,), "class", rng, ascent=False)
    assert independence_violation(loss, y, z.astype("float32"), rng) > 1e-3
    # the per-example KR passes the same unbalanced check
    check_bound(losses.DP_MulticlassKR(), y_rare, z_rare, "unbalanced")


# --- the bound pass refuses a loss without get_L() ----------------------------------

def small_model():
    model = keras.Sequential([
        DP_BoundedInput(input_shape=(6,), upper_bound=2.0),
        DP_QuickSpectralDense(8), DP_GroupSort(2), DP_QuickSpectralDense(3),
    ])
    model(np.zeros((1, 6), "float32"))
    return model


def test_bound_pass_refuses_loss_without_get_L():
    model = small_model()
    for bad in (keras.losses.CategoricalCrossentropy(), "categorical_crossentropy",
                lambda y, p: ops.mean(p)):
        with pytest.raises(BoundError, match="get_L"):
            compute_gradient_bounds(model, loss=bad)
    with pytest.raises(BoundError, match="No loss"):
        compute_gradient_bounds(model)  # not compiled, no loss given
    bounds = compute_gradient_bounds(model, loss=losses.DP_MulticlassHKR(3.0))
    assert set(bounds) == {v.path for v in model.trainable_variables}
    for value in bounds.values():  # X·G with X = 2, G = 1 + α
        assert value == pytest.approx(2.0 * 4.0)


# --- labels outside {0, 1}: the bound must still hold ---------------------------

@pytest.mark.parametrize("index", [0, 2, 3, 4])
def test_plus_minus_one_encoding_reads_as_one_hot(index, rng):
    loss = all_losses()[index]
    y = rng.integers(0, 4, size=(8,))
    z = (50 * rng.normal(size=(8, 4))).astype("float32")
    pm_one = 2.0 * np.eye(4, dtype="float32")[y] - 1.0
    np.testing.assert_allclose(ops.convert_to_numpy(loss.call(pm_one, z)),
                               ops.convert_to_numpy(loss.call(y.astype("int32"), z)), rtol=1e-6)
    check_bound(loss, pm_one, z, "±1 labels")


def test_bce_labels_outside_zero_one(rng):
    loss = losses.DP_TauBCE(3.0)
    z = (1e3 * rng.normal(size=(8, 1))).astype("float32")
    y01 = rng.integers(0, 2, size=(8, 1)).astype("float32")
    np.testing.assert_allclose(ops.convert_to_numpy(loss.call(2 * y01 - 1, z)),
                               ops.convert_to_numpy(loss.call(y01, z)), rtol=1e-6)
    for labels in (2 * y01 - 1, np.full((8, 1), -5.0, "float32"), np.full((8, 1), 7.0, "float32")):
        check_bound(loss, labels, z, "labels outside [0, 1]")
    # soft labels are kept (and within the bound)
    soft = np.full((8, 1), 0.3, "float32")
    assert not np.allclose(ops.convert_to_numpy(loss.call(soft, z)), ops.convert_to_numpy(loss.call(y01, z)))
    check_bound(loss, soft, z, "soft labels")
