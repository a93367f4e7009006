"""Certified robustness: no L2 attack inside the certified radius flips a prediction."""

import math

import keras
import numpy as np
import pytest
from keras import ops

from kdp import autodiff, certificates
from kdp.bounds import lipschitz_constant
from kdp.certificates import CertifiedAccuracy, certified_accuracy, certified_radius
from kdp.layers import DP_BoundedInput, DP_GroupSort, DP_QuickSpectralDense
from kdp.model import DP_Sequential

DIM, CLASSES, N = 8, 4, 48


@pytest.fixture(scope="module")
def model():
    keras.utils.set_random_seed(1)
    m = DP_Sequential([
        DP_BoundedInput(input_shape=(DIM,), upper_bound=10.0),
        DP_QuickSpectralDense(16), DP_GroupSort(2),
        DP_QuickSpectralDense(16), DP_GroupSort(2),
        DP_QuickSpectralDense(CLASSES),
    ])
    m(np.zeros((1, DIM), "float32"))
    return m


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(3)
    x = rng.normal(size=(N, DIM)).astype("float32")
    return x, rng.integers(0, CLASSES, size=(N,))


def logits_of(model, x):
    return np.asarray(ops.convert_to_numpy(model(ops.convert_to_tensor(x), training=False)), "float64")


def class_margin(logits, cls):
    """f_c − max_{j≠c} f_j for the given class c of each row (< 0: flipped)."""
    own = logits[np.arange(len(cls)), cls]
    others = np.where(np.eye(logits.shape[1], dtype=bool)[cls], -np.inf, logits)
    return own - others.max(axis=1)


def pgd(model, x, radius, steps=40):
    """Projected gradient descent on the margin of the clean prediction, each
    example in its own L2 ball. Returns every iterate (steps + 1, n, d)."""
    cls = np.argmax(logits_of(model, x), axis=1)
    mask = np.eye(CLASSES, dtype="float32")[cls]

    def total_margin(xs):
        out = model(xs, training=False)
        own = ops.sum(out * mask, axis=1)
        runner_up = ops.max(out - 1e9 * mask, axis=1)
        return ops.sum(own - runner_up)

    r = radius[:, None].astype("float64")
    rng = np.random.default_rng(0)
    delta = rng.normal(size=x.shape)
    delta *= 0.5 * r / np.linalg.norm(delta, axis=1, keepdims=True)
    iterates = [x + delta]
    step = 2.5 * r / steps
    for _ in range(steps):
        (g,) = autodiff.gradient(total_margin, (x + delta).astype("float32"))
        g = np.asarray(ops.convert_to_numpy(g), "float64")
        delta -= step * g / np.maximum(np.linalg.norm(g, axis=1, keepdims=True), 1e-12)
        norms = np.linalg.norm(delta, axis=1, keepdims=True)
        delta *= np.minimum(1.0, r / np.maximum(norms, 1e-12))
        iterates.append(x + delta)
    return np.stack(iterates).astype("float32"), cls


def test_lipschitz_of_the_model(model):
    assert lipschitz_constant(model) == pytest.approx(1.0)


def test_radius_formula(model, data):
    x, _ = data
    logits = logits_of(model, x)
    top2 = np.sort(logits, axis=1)[:, ::-1][:, :2]
    expected = (top2[:, 0] - top2[:, 1]) / math.sqrt(2.0)
    np.testing.assert_allclose(certified_radius(model, x), expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(certified_radius(model, x, lipschitz=2.0), expected / 2,
                               rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(certified_radius(model, x, batch_size=7), expected, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError):
        certified_radius(model, x, lipschitz=0.0)


def test_attack_never_beats_the_certificate(model, data):
    x, _ = data
    ell = lipschitz_constant(model)
    radius = certified_radius(model, x)
    assert np.all(radius > 0)
    iterates, cls = pgd(model, x, 0.99 * radius)
    clean = class_margin(logits_of(model, x), cls)
    for xs in iterates:
        margin = class_margin(logits_of(model, xs), cls)
        assert np.all(margin > 0), "a prediction flipped inside the certified radius"
        # the stronger statement behind the certificate: margin drops at rate ≤ ℓ√2
        dist = np.linalg.norm(xs.astype("float64") - x, axis=1)
        assert np.all(margin >= clean - ell * math.sqrt(2) * dist - 1e-4)
    # the attack did work: it used the ball and ate most of the margin somewhere
    final = class_margin(logits_of(model, iterates[-1]), cls)
    print(f"\n[kdp] PGD at 0.99 r: largest fraction of the margin removed "
          f"{np.max(1 - final / clean):.3f}")
    assert np.max(1 - final / clean) > 0.3


def test_negative_control_wrong_lipschitz_is_broken(model, data):
    """The same attack flips predictions inside a radius computed with ℓ/3 (×3)."""
    x, _ = data
    ell = lipschitz_constant(model)
    inflated = certified_radius(model, x, lipschitz=ell / 3)
    np.testing.assert_allclose(inflated, 3 * certified_radius(model, x), rtol=1e-5)
    iterates, cls = pgd(model, x, 0.99 * inflated)
    flipped = np.zeros(len(x), bool)
    for xs in iterates:
        flipped |= class_margin(logits_of(model, xs), cls) < 0
    print(f"\n[kdp] PGD at 0.99 × (3 r): {flipped.sum()}/{len(x)} predictions flipped")
    assert flipped.sum() > 0


def test_certified_accuracy(model, data):
    x, y = data
    logits = logits_of(model, x)
    correct = np.argmax(logits, axis=1) == y
    radius = certified_radius(model, x)
    assert certified_accuracy(model, x, y, 0.0) == pytest.approx(correct.mean())
    previous = 1.0
    for r in (0.0, 0.01, 0.05, 0.1, 0.5, 100.0):
        acc = certified_accuracy(model, x, y, r)
        assert acc == pytest.approx(np.mean(correct & ((radius > r) | (r == 0))))
        assert acc <= previous
        previous = acc
    assert certified_accuracy(model, x, y, 100.0) == 0.0
    one_hot = np.eye(CLASSES)[y]
    assert certified_accuracy(model, x, one_hot, 0.05) == certified_accuracy(model, x, y, 0.05)


def test_metric(model, data):
    x, y = data
    logits = logits_of(model, x).astype("float32")
    for r in (0.0, 0.05):
        metric = CertifiedAccuracy(r, lipschitz=1.0)
        metric.update_state(y[:20], logits[:20])
        metric.update_state(y[20:], logits[20:])
        assert float(metric.result()) == pytest.approx(certified_accuracy(model, x, y, r))
    # sample weights (the padding of a Poisson batch) and a wrong ℓ
    sw = np.ones(N, "float32")
    sw[::2] = 0.0
    metric = CertifiedAccuracy(0.05, lipschitz=2.0, name="cert_acc_005")
    metric.update_state(np.eye(CLASSES)[y], logits, sample_weight=sw)
    radius = certified_radius(model, x, lipschitz=2.0)
    expected = np.mean(((np.argmax(logits, 1) == y) & (radius > 0.05))[1::2])
    assert float(metric.result()) == pytest.approx(expected)
    # serialization
    clone = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(metric))
    assert type(clone) is CertifiedAccuracy
    assert (clone.radius, clone.lipschitz, clone.name) == (0.05, 2.0, "cert_acc_005")
    assert keras.metrics.get(keras.saving.serialize_keras_object(metric)).radius == 0.05
    with pytest.raises(ValueError):
        CertifiedAccuracy(-1.0)


def test_single_output_radius():
    """One logit thresholded at 0: radius |f(x)|/ℓ."""
    keras.utils.set_random_seed(2)
    m = keras.Sequential([DP_BoundedInput(input_shape=(4,), upper_bound=5.0), DP_QuickSpectralDense(1)])
    x = np.random.default_rng(0).normal(size=(10, 4)).astype("float32")
    np.testing.assert_allclose(certified_radius(m, x), np.abs(logits_of(m, x)[:, 0]), rtol=1e-5)
    y = (logits_of(m, x)[:, 0] > 0).astype(int)
    assert certificates.certified_accuracy(m, x, y, 0.0) == 1.0
