"""Loss-gradient clipping: a fixed threshold lowers the noise (Béthune et al. 2024,
§3.1), an adaptive one (the private quantile estimate of Andrew et al. 2021) is
private and fully accounted.

Runs on whichever ``KERAS_BACKEND`` is set (CI runs it on TensorFlow and JAX).
The noise is isolated as in ``test_training.py``: zero sample weights (no data
gradient), SGD with learning rate 1, projections detached, so a step moves each
variable by minus its noise. Expected stds and ε are written out by hand
(bound formulas, dp-accounting events built here), never taken from kdp.
"""

import math

import dp_accounting
import keras
import numpy as np
import pytest
from keras import ops

import kdp
from kdp import accounting, layers, losses
from kdp.adaptive_clipping import (AdaptiveQuantileClipping, logit_gradient_norms,
                                   output_clip_layer)
from kdp.autodiff import gradient, per_example_gradients
from kdp.layers.clip import per_example_units
from kdp.model import DP_Sequential, DPParameters
from kdp.pipeline import DatasetMetadata

SQRT2 = math.sqrt(2.0)  # L of DP_TauCategoricalCrossentropy
D_IN, X0, B_NORM, K = 16, 2.0, 0.5, 6
N, BATCH = 256, 32  # q = 1/8, 8 steps per epoch
SIGMA, DELTA = 1.5, 1e-3


def _model(clip=None, sigma=SIGMA, strategy="global", seed=0, width=32):
    stack = [
        layers.DP_BoundedInput((D_IN,), X0),
        layers.DP_QuickSpectralDense(width),
        layers.DP_AddBias(B_NORM),
        layers.DP_GroupSort(2),
        layers.DP_QuickSpectralDense(K),
    ]
    if clip is not None:
        stack.append(layers.DP_ClipGradient(clip))
    params = DPParameters(strategy, sigma, DELTA, reproducible=True, seed=seed)
    model = DP_Sequential(stack, dp_parameters=params,
                          dataset_metadata=DatasetMetadata((D_IN,), K, N, BATCH))
    model.compile(optimizer=keras.optimizers.SGD(1.0), loss=losses.DP_TauCategoricalCrossentropy(2.0))
    model.build((None, D_IN))
    model.privacy_gate.accountant = "rdp"  # the accountant of `_hand_epsilon`
    return model


def _data(seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(N, D_IN)).astype("float32"), rng.integers(0, K, N).astype("int32")


def _global_std(L_eff, sigma=SIGMA):
    """By hand: Δ_W1 = X0·L, Δ_bias = L, Δ_W2 = (X0 + B)·L; std = σ‖Δ‖/b."""
    deltas = [X0 * L_eff, L_eff, (X0 + B_NORM) * L_eff]
    return sigma * math.sqrt(sum(d * d for d in deltas)) / BATCH


def _measured_std(model, steps):
    """RMS of the update of the first kernel over ``steps`` zero-signal steps."""
    for v in model.trainable_variables:
        v.constraint = None  # the update is then exactly −noise
    x, y = _data(1)
    snapshots = [np.array(model.trainable_variables[0])]

    class Snap(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            # `self.model` syncs the JAX training state into the variables first
            snapshots.append(np.array(self.model.trainable_variables[0]))

    model.fit(x, y, sample_weight=np.zeros(N), epochs=1, steps_per_epoch=steps, verbose=0,
              callbacks=[Snap()])
    assert len(snapshots) == steps + 1
    return float(np.sqrt(np.mean(np.diff(np.stack(snapshots), axis=0) ** 2)))


def _within(measured, expected, tol):
    return abs(measured / expected - 1) < tol


# --- a fixed threshold ------------------------------------------------------------------

def test_fixed_clip_below_L_lowers_the_measured_noise():
    clip = 0.3
    model = _model(clip)
    expected = _global_std(clip)
    assert all(s == pytest.approx(expected, rel=1e-6) for s in model.noise_stds().values())
    assert expected < 0.25 * _global_std(SQRT2)
    measured = _measured_std(model, 16)  # 16 × 512 draws: relative error of the RMS ~ 0.8 %
    assert _within(measured, expected, 0.05), (measured, expected)
    # negative control: the unclipped value is far outside the tolerance
    assert not _within(measured, _global_std(SQRT2), 0.05)


def test_threshold_changes_the_noise_without_recompiling():
    """The traced step reads the threshold variable: assigning it changes the noise
    std of the next steps, with the same compiled train function."""
    model = _model(5.0)  # above L: the bound stays L
    first = _measured_std(model, 12)
    assert _within(first, _global_std(SQRT2), 0.06), first
    compiled = model.train_function
    output_clip_layer(model).clip_value = 0.2
    assert model.noise_stds()[model.trainable_variables[0].path] == pytest.approx(_global_std(0.2), rel=1e-6)
    second = _measured_std(model, 12)
    assert model.train_function is compiled
    assert _within(second, _global_std(0.2), 0.06), (second, _global_std(0.2))


def test_clipped_logit_gradients_are_at_most_C():
    """Per example, the cotangent that leaves the clip layer (the gradient with
    respect to the logits) has norm min(‖∂ℓ/∂ŷ‖, C) ≤ C, and the last kernel's
    per-example gradient respects the min(L, C)-based bound."""
    clip = 0.25
    model = _model(clip)
    x, y = _data(2)
    x = x[:64] * 3.0  # large inputs: raw logit-gradient norms spread up to ~L
    y = y[:64]
    layer = output_clip_layer(model)
    loss = model.loss
    logits = model(x)  # the clip layer is the identity forward
    raw = logit_gradient_norms(model, x, y)
    assert raw.max() > 2 * clip  # the test is not vacuous: many examples get clipped
    with per_example_units(model):
        (g,) = gradient(lambda z: ops.sum(loss.call(ops.convert_to_tensor(y), layer(z))), logits)
    clipped = np.linalg.norm(np.asarray(g).reshape(len(x), -1), axis=1)
    assert clipped.max() <= clip * (1 + 1e-5)
    np.testing.assert_allclose(clipped, np.minimum(raw, clip), rtol=1e-4, atol=1e-7)
    # through the whole model: ‖∇_W2 ℓ_i‖ ≤ (X0 + B)·C for every example
    grads = per_example_gradients(model, loss, x, y)
    last = np.asarray(grads[model.layers[-2].kernel.path]).reshape(len(x), -1)
    assert np.linalg.norm(last, axis=1).max() <= (X0 + B_NORM) * clip * (1 + 1e-5)


def test_lipschitz_constant_ignores_the_clip_and_config_keeps_the_threshold():
    model = _model(0.05)
    assert float(kdp.lipschitz_constant(model)) == pytest.approx(1.0, rel=1e-6)  # not 0.05
    layer = output_clip_layer(model)
    layer.clip_value = 0.123
    again = layers.DP_ClipGradient.from_config(layer.get_config())
    assert again.clip_value == pytest.approx(0.123)
    with pytest.raises(ValueError):
        layer.clip_value = 0.0
    with pytest.raises(ValueError, match="DP_ClipGradient"):
        AdaptiveQuantileClipping(*_data()).set_model(_model(None))


# --- the private quantile ------------------------------------------------------------------

def test_quantile_estimate_converges_to_the_true_quantile():
    """Andrew et al.'s mechanism on synthetic norms (lognormal, N = 5000) with
    small noise: C drifts from 20× the 90th percentile to it, and every release
    is in the ledger."""
    model = _model(1.0)
    rng = np.random.default_rng(0)
    norms = rng.lognormal(mean=-1.0, sigma=0.6, size=5000)
    truth = float(np.quantile(norms, 0.9))
    cb = AdaptiveQuantileClipping(np.zeros((5000, D_IN)), np.zeros(5000), quantile=0.9,
                                  noise_multiplier=2.0, learning_rate=0.2, batch_size=500, seed=1)
    cb.set_model(model)
    c, trace = 20 * truth, []
    for _ in range(400):
        sample = norms[rng.random(len(norms)) < cb.sampling_rate]
        _, c = cb.release(sample, c)
        trace.append(c)
    final = float(np.mean(trace[-100:]))
    assert abs(final / truth - 1) < 0.05, (final, truth)
    assert abs(np.mean(norms <= final) - 0.9) < 0.02
    assert model.privacy_ledger.releases("quantile") == 400
    # negative control: another target quantile lands elsewhere
    cb.quantile, c = 0.5, truth
    for _ in range(300):
        _, c = cb.release(norms[rng.random(len(norms)) < cb.sampling_rate], c)
    assert abs(np.mean(norms <= c) - 0.5) < 0.05


def _hand_epsilon(train_steps, releases, q_q, sigma_q, sigma=SIGMA, q=BATCH / N):
    """dp-accounting's own RdpAccountant, fed the events built here."""
    acc = dp_accounting.rdp.RdpAccountant()
    acc.compose(dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), train_steps))
    if releases:
        acc.compose(dp_accounting.SelfComposedDpEvent(
            dp_accounting.PoissonSampledDpEvent(q_q, dp_accounting.GaussianDpEvent(sigma_q)), releases))
    return acc.get_epsilon(DELTA)


@pytest.mark.parametrize("every,patience,epochs,releases", [
    ("epoch", 2, 3, 2),   # at the start of epochs 0 and 2 (lip-dp's ⌊3/2⌋ = 1 undercounts)
    ("step", 3, 2, 6),    # before steps 0, 3, …, 15 of 16
])
def test_epsilon_is_the_composition_with_the_exact_number_of_releases(every, patience, epochs, releases):
    sigma_q = 1.0  # small: the releases cost a visible share of ε
    model = _model(SQRT2)
    x, y = _data()
    cb = AdaptiveQuantileClipping(x, y, quantile=0.9, patience=patience, every=every,
                                  noise_multiplier=sigma_q, learning_rate=0.5)
    history = model.fit(x, y, epochs=epochs, verbose=0, callbacks=[cb, kdp.DP_Accountant()]).history
    steps = epochs * (N // BATCH)
    assert model.privacy_ledger.training_steps() == steps
    assert model.privacy_ledger.releases("quantile") == releases == len(cb.history)
    assert len(history["clip_value"]) == epochs and all(c > 0 for c in history["clip_value"])
    assert history["clip_value"][-1] != pytest.approx(SQRT2)  # the threshold moved
    expected = _hand_epsilon(steps, releases, BATCH / N, sigma_q)
    assert history["epsilon"][-1] == pytest.approx(expected, rel=1e-6)
    # negative controls: leaving the releases out, or lip-dp's count, is detected
    for wrong in (0, epochs // patience):
        if wrong != releases:
            assert history["epsilon"][-1] > _hand_epsilon(steps, wrong, BATCH / N, sigma_q) * 1.01


def test_budgets_include_the_planned_releases():
    """`get_max_epochs` and `DP_Accountant(epsilon_max)` count the quantile
    releases still to come (the callback registers its plan in ``set_model``)."""
    sigma_q, eps_max, spe = 1.0, 1.5, N // BATCH
    model = _model(SQRT2, sigma=3.0)
    x, y = _data()
    without = accounting.get_max_epochs(eps_max, model)
    cb = AdaptiveQuantileClipping(x, y, patience=1, noise_multiplier=sigma_q)
    cb.set_model(model)
    with_plan = accounting.get_max_epochs(eps_max, model)

    def eps(e):  # by hand: e epochs, one release at the start of each
        return _hand_epsilon(e * spe, e, BATCH / N, sigma_q, sigma=3.0)

    assert eps(with_plan) <= eps_max < eps(with_plan + 1)
    assert with_plan < without  # the negative control: ignoring the plan overspends
    assert accounting.get_eps_delta(model, with_plan)[0] == pytest.approx(eps(with_plan), rel=1e-6)
    history = model.fit(x, y, epochs=with_plan + 3, verbose=0,
                        callbacks=[kdp.DP_Accountant(epsilon_max=eps_max), cb]).history
    spent, _ = model.privacy_spent()
    assert spent <= eps_max
    assert model.privacy_ledger.training_steps() >= with_plan * spe  # stopped by the budget…
    assert model.privacy_ledger.training_steps() < (with_plan + 1) * spe  # …not by epochs
    assert model.privacy_ledger.releases("quantile") == len(history["epsilon"])
