"""The privacy gate, the ledger's runs and the input validator, attacked as an
adversarial user would (one test per attack).

Each test reproduces a way in which a noisy step could run without being
recorded, be recorded wrongly, or break a bound, and checks that kdp refuses
it before anything is spent, or records exactly what ran. The ε of reference
is computed independently with dp-accounting.
"""

import warnings

import dp_accounting
import keras
import numpy as np
import pytest

import kdp
from kdp import layers, losses
from kdp.model import DP_Sequential, DPParameters
from kdp.pipeline import DatasetMetadata

D, K = 8, 4


def _model(n=64, b=16, sigma=2.0, delta=1e-3, loss=None, units=K, lr=0.05, epsilon_max=None,
           bounded=True, max_norm=None, sampling="poisson", **params):
    stack = ([layers.DP_BoundedInput((D,), 2.0)] if bounded else [keras.Input((D,))])
    stack += [layers.DP_QuickSpectralDense(16), layers.DP_GroupSort(2),
              layers.DP_QuickSpectralDense(units)]
    model = DP_Sequential(
        stack,
        dp_parameters=DPParameters("global", sigma, delta, epsilon_max=epsilon_max, sampling=sampling,
                                   **params),
        dataset_metadata=DatasetMetadata((D,), units, n, b, max_norm=max_norm))
    model.compile(optimizer=keras.optimizers.SGD(lr), loss=loss or losses.DP_TauCategoricalCrossentropy(2.0))
    model.privacy_gate.accountant = "rdp"  # the accountant of `_gaussian_eps`
    return model


def _data(n=64, units=K, scale=0.3, seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, D)).astype("float32") * scale, rng.integers(0, units, n)


def _gaussian_eps(sigma, q, steps, delta):
    """Independent ε: ``steps`` × Poisson(q)-subsampled Gaussian(σ), RDP."""
    acc = dp_accounting.rdp.RdpAccountant()
    event = dp_accounting.GaussianDpEvent(sigma) if q == 1 else \
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma))
    acc.compose(event, steps)
    return acc.get_epsilon(delta)


# -- shuffled batches use each record once per pass ------------------------------------------------

class _UseCounter(keras.metrics.Metric):
    """Counts how often each record (its label is its id) is trained on; never reset."""

    def __init__(self, n, **kwargs):
        super().__init__(name="uses", **kwargs)
        self.n = n
        self.counts = self.add_variable(shape=(n,), initializer="zeros", name="counts")

    def update_state(self, y_true, y_pred, sample_weight=None):
        ids = keras.ops.reshape(keras.ops.cast(y_true, "int32"), (-1,))
        hits = keras.ops.one_hot(ids, self.n)
        if sample_weight is not None:
            hits = hits * keras.ops.reshape(keras.ops.cast(sample_weight, hits.dtype), (-1, 1))
        self.counts.assign(self.counts + keras.ops.sum(hits, axis=0))

    def reset_state(self):
        pass

    def result(self):
        return keras.ops.max(self.counts)


def test_shuffled_batches_use_each_record_once_per_pass():
    n, b, epochs = 200, 20, 20
    x, _ = _data(n)
    ids = np.arange(n)
    model = _model(n, b, units=n, sampling="shuffle")
    counter = _UseCounter(n)
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss=losses.DP_TauCategoricalCrossentropy(2.0),
                  metrics=[counter])
    model.fit(x, ids, epochs=epochs, verbose=0)
    counts = keras.ops.convert_to_numpy(counter.counts)
    assert counts.sum() == epochs * n  # every pass uses every record (b divides N)
    assert counts.max() == epochs  # not 25 of 20, as when Keras' shuffle interleaves the passes
    eps = model.privacy_spent()[0]
    truth = dp_accounting.rdp.RdpAccountant()
    truth.compose(dp_accounting.GaussianDpEvent(2.0 / 2), epochs)  # replace-one, one Gaussian a pass
    assert eps == pytest.approx(truth.get_epsilon(1e-3), rel=1e-6)


# -- merging independent trainings composes them ---------------------------------------------------

def test_merging_independent_trainings_composes_them():
    x, y = _data()
    trials = []
    for lr in (0.01, 0.05, 0.1):  # a hyper-parameter search: identical privacy settings
        model = _model(lr=lr)
        model.fit(x, y, epochs=2, verbose=0)
        trials.append(model)
    merged = trials[0].privacy_ledger
    for other in trials[1:]:
        merged = merged.merge(other.privacy_ledger)
    steps = 3 * 2 * 4
    assert merged.training_steps() == steps
    spent = kdp.accounting.epsilon_of_events(merged.events(), 1e-3, "rdp")
    assert spent == pytest.approx(_gaussian_eps(2.0, 16 / 64, steps, 1e-3), rel=1e-6)
    # the same history seen twice (a checkpoint, then the journal) counts once
    again = merged.merge(trials[1].privacy_ledger).merge(merged)
    assert again == merged


def test_ledger_runs_merge_by_identity():
    from kdp.training.ledger import PrivacyLedger, training_mechanism

    mech = training_mechanism(1.0, 0.25, "poisson", 4)
    a = PrivacyLedger()
    a.record(mech, 8, "run-a")
    later = PrivacyLedger(a.entries)
    later.record(mech, 3, "run-a")  # the same run, continued
    assert a.merge(later) == later and later.merge(a) == later
    b = PrivacyLedger()
    b.record(mech, 8, "run-b")  # the same settings, another training
    assert a.merge(b).training_steps() == 16
    corrupt = PrivacyLedger()
    corrupt.record(training_mechanism(3.0, 0.25, "poisson", 4), 8, "run-a")
    with pytest.raises(ValueError, match="disagree"):
        a.merge(corrupt)


# -- train_on_batch is accounted and budgeted ------------------------------------------------------

def test_train_on_batch_is_recorded_budgeted_and_validated():
    x, y = _data()
    model = _model()
    steps = 12
    for i in range(steps):
        model.train_on_batch(x[i:i + 16], y[i:i + 16])
    assert model.privacy_ledger.training_steps() == steps  # unrecorded, it would be 0 (ε 0)
    # a batch kdp did not sample: no amplification
    assert model.privacy_spent()[0] == pytest.approx(_gaussian_eps(2.0, 1, steps, 1e-3), rel=1e-6)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        model.train_on_batch(x[:16], y[:16], sample_weight=np.full(16, 1000.0))
    assert model.privacy_ledger.training_steps() == steps  # the refused batch cost nothing


def test_train_on_batch_stops_at_the_budget():
    x, y = _data()
    budget = _gaussian_eps(2.0, 1, 5, 1e-3) * 1.0001  # allows exactly 5 steps
    model = _model(epsilon_max=budget)
    for _ in range(5):
        model.train_on_batch(x[:16], y[:16])
    before = [w.copy() for w in model.get_weights()]
    with pytest.raises(RuntimeError, match="budget"):
        model.train_on_batch(x[:16], y[:16])
    assert model.privacy_ledger.training_steps() == 5
    assert model.privacy_spent()[0] <= budget
    assert all(np.array_equal(a, b) for a, b in zip(before, model.get_weights()))


def test_noisy_objective_outside_the_gate_is_refused():
    x, y = _data()
    model = _model()
    model.train_on_batch(x[:16], y[:16])  # builds everything
    with pytest.raises(RuntimeError, match="privacy gate"):
        model.compute_loss(x[:16], y[:16], model(x[:16]), training=True)
    model.compute_loss(x[:16], y[:16], model(x[:16]), training=False)  # no noise: allowed


# -- a callback budget holds with steps_per_execution ----------------------------------------------

def test_accountant_budget_holds_with_steps_per_execution():
    x, y = _data(128)
    model = _model(128, 16, sigma=1.0)
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss=losses.DP_TauCategoricalCrossentropy(2.0),
                  steps_per_execution=4)
    allowed = 41  # not a multiple of the block: a check per block would run up to 44 steps
    eps_max = kdp.accounting.compute_epsilon(1.0, 16 / 128, allowed, 1e-3, "rdp") * (1 + 1e-9)
    assert kdp.accounting.max_steps(eps_max, 1.0, 16 / 128, 1e-3, "rdp") == allowed
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(x, y, epochs=100, verbose=0, callbacks=[kdp.DP_Accountant(epsilon_max=eps_max)])
    steps = model.privacy_ledger.training_steps()
    assert model.privacy_spent()[0] <= eps_max  # not 44 steps of 41 allowed
    assert allowed - 4 < steps <= allowed
    assert any("privacy budget" in str(w.message) for w in caught)  # the stop is not silent


# -- shuffle mode with a dataset: batches are validated before spending ----------------------------

def _dataset(x, y, batch, weights=None):
    import tensorflow as tf

    parts = (x, y) if weights is None else (x, y, weights)
    return tf.data.Dataset.from_tensor_slices(parts).batch(batch)


@pytest.mark.parametrize("bad", ["rows", "weights"])
def test_shuffle_mode_dataset_batches_are_validated_before_spending(bad):
    x, y = _data()
    model = _model(sampling="shuffle")
    data = (_dataset(x, y, 4 * 16) if bad == "rows"
            else _dataset(x, y, 16, np.full(64, 50.0, "float32")))
    with pytest.raises(Exception, match="rows|records|weight"):
        model.fit(data, epochs=3, verbose=0)
    assert model.privacy_ledger.training_steps() == 0  # unvalidated, TF would charge 12 steps
    model.fit(_dataset(x, y, 16), epochs=2, verbose=0)  # a valid pipeline trains
    assert model.privacy_ledger.training_steps() == 8


# -- the declared input bound is checked -----------------------------------------------------------

def test_data_beyond_max_norm_is_refused():
    x, y = _data(scale=10.0)  # norms ≈ 28
    model = _model(bounded=False, max_norm=1.0)
    with pytest.raises(ValueError, match="max_norm"):
        model.fit(x, y, epochs=1, verbose=0)
    with pytest.raises(ValueError, match="max_norm"):
        model.train_on_batch(x[:16], y[:16])
    assert model.privacy_ledger.training_steps() == 0
    clipped, _ = kdp.bound_clip_value(1.0)
    model.fit(clipped(x), y, epochs=1, verbose=0)  # clipped data trains
    assert model.privacy_ledger.training_steps() == 4


def test_a_max_norm_that_tightens_a_capping_layer_is_checked():
    """`DP_BoundedInput(2)` caps the inputs at 2; ``max_norm = 0.5`` below it makes
    the bound pass use 0.5. Unchecked, data of norm 1.5 passes the cap and its
    per-example gradients exceed the bounds the noise is calibrated to."""
    from kdp.autodiff import per_example_gradients

    x, y = _data(scale=1.5 / np.sqrt(D))  # norms ≈ 1.5: inside the cap, above max_norm
    model = _model(max_norm=0.5)
    loss = model.loss
    bounds = kdp.compute_gradient_bounds(model, loss)
    grads = per_example_gradients(model, loss, x[:16], y[:16])
    ratio = max(float(np.max(np.linalg.norm(np.asarray(g).reshape(16, -1), axis=1))) / bounds[p]
                for p, g in grads.items())
    assert ratio > 1.5  # what the check prevents: gradients above their bounds
    with pytest.raises(ValueError, match="max_norm"):
        model.fit(x, y, epochs=1, verbose=0)
    with pytest.raises(ValueError, match="max_norm"):
        model.train_on_batch(x[:16], y[:16])
    assert model.privacy_ledger.training_steps() == 0
    _model(max_norm=2.0).fit(x, y, epochs=1, verbose=0)  # a max_norm at the cap changes nothing
    _model().fit(5.0 * x, y, epochs=1, verbose=0)  # without max_norm the cap bounds the inputs


# -- multi-hot labels are refused by single-label losses -------------------------------------------

@pytest.mark.parametrize("loss", [losses.DP_TauCategoricalCrossentropy(2.0), losses.DP_MulticlassHinge(),
                                  losses.DP_MulticlassKR(), losses.DP_MulticlassHKR(2.0)],
                         ids=["tau_cce", "hinge", "kr", "hkr"])
def test_multi_hot_labels_are_refused_for_single_label_losses(loss):
    x, y = _data()
    model = _model(loss=loss)
    multi = np.zeros((64, K), "float32")
    multi[:, 0] = 1
    multi[:, 1] = 1
    with pytest.raises(ValueError, match="class per example"):
        model.fit(x, multi, epochs=1, verbose=0)
    with pytest.raises(ValueError, match="class ids"):
        model.fit(x, np.full(64, K + 8), epochs=1, verbose=0)
    assert model.privacy_ledger.training_steps() == 0
    model.fit(x, np.eye(K, dtype="float32")[y], epochs=1, verbose=0)  # one-hot is fine
    assert model.privacy_ledger.training_steps() == 4


# -- assigned weights are projected before the first step ------------------------------------------

class _KernelNormAtFirstStep(keras.callbacks.Callback):
    def on_train_batch_begin(self, batch, logs=None):
        if batch == 0 and not hasattr(self, "sigma_max"):
            kernel = keras.ops.convert_to_numpy(self.model.layers[1].kernel)
            self.sigma_max = float(np.linalg.norm(kernel, 2))


def test_set_weights_cannot_break_the_bound_of_the_first_step():
    x, y = _data()
    model = _model()
    model.build((None, D))
    kernel = model.layers[1].kernel
    w = np.random.default_rng(1).normal(size=kernel.shape).astype("float32")
    weights = model.get_weights()
    weights[0] = 3.0 * w / np.linalg.norm(w, 2)  # a "pretrained" kernel with σ_max 3
    model.set_weights(weights)
    probe = _KernelNormAtFirstStep()
    model.fit(x, y, epochs=1, verbose=0, callbacks=[probe])
    assert probe.sigma_max <= 1.0 + 1e-5  # unprojected: 3.0 (first-step gradient/bound ratio 9)

    model.layers[1].kernel.assign(weights[0])  # the same through train_on_batch
    model.make_train_function()
    seen, inner = [], model.train_function

    def spy(*args):
        seen.append(float(np.linalg.norm(keras.ops.convert_to_numpy(model.layers[1].kernel), 2)))
        return inner(*args)

    model.train_function = spy
    model.train_on_batch(x[:16], y[:16])
    assert seen and seen[0] <= 1.0 + 1e-5


# -- NaN sample weights are refused ----------------------------------------------------------------

def test_nan_sample_weight_is_refused():
    x, y = _data()
    model = _model()
    weights = np.ones(64, "float32")
    weights[3] = np.nan
    with pytest.raises(ValueError, match="finite"):
        model.fit(x, y, sample_weight=weights, epochs=1, verbose=0)
    with pytest.raises(ValueError, match="finite"):
        model.train_on_batch(x[:16], y[:16], sample_weight=weights[:16])
    assert model.privacy_ledger.training_steps() == 0


# -- a first step that fails costs nothing ---------------------------------------------------------

def test_a_step_that_fails_before_running_is_not_charged():
    x, y = _data()
    model = _model()
    with pytest.raises(Exception):
        model.fit(x[:, :D - 1], y, epochs=1, verbose=0)  # wrong input shape
    with pytest.raises(Exception):
        model.fit(x, np.array(["a"] * 64), epochs=1, verbose=0)  # string labels
    assert model.privacy_ledger.training_steps() == 0

    clip = DP_Sequential([keras.Input((D,)), keras.layers.Dense(K)],
                         dp_parameters=DPParameters(noise_multiplier=1.0, delta=1e-3, clipping_norm=1.0),
                         dataset_metadata=DatasetMetadata((D,), K, 64, 16))
    clip.compile(optimizer=keras.optimizers.SGD(0.1),
                 loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    with pytest.raises(Exception):  # one-hot labels for a sparse loss: fails while tracing
        clip.train_on_batch(x[:16], np.eye(K, dtype="float32")[y[:16]][:, :, None])
    assert clip.privacy_ledger.training_steps() == 0
    clip.train_on_batch(x[:16], y[:16])
    assert clip.privacy_ledger.training_steps() == 1


def test_a_check_on_a_cold_gate_computes_one_epsilon_and_agrees_with_the_allowance(monkeypatch):
    """`check` tests the count it is asked for (one ε per budget) where `remaining`
    bisects (some 12 ε here); both refuse from the same count on."""
    from kdp.privacy import limits
    from kdp.training.gate import BudgetExceededError, PrivacyGate
    from kdp.training.ledger import training_mechanism

    calls = []
    epsilon_of_events = limits.epsilon_of_events
    monkeypatch.setattr(limits, "epsilon_of_events",
                        lambda *a, **k: calls.append(1) or epsilon_of_events(*a, **k))
    step = training_mechanism(2.0, 0.25, "poisson", 4)

    def cold_gate():
        return PrivacyGate(1e-3, epsilon_max=_gaussian_eps(2.0, 0.25, 40, 1e-3) * (1 + 1e-9),
                           accountant="rdp")

    cold_gate().check(step, 40)
    assert len(calls) == 1
    with pytest.raises(BudgetExceededError, match=r"\(40 allowed\)"):
        cold_gate().check(step, 41)
    gate = cold_gate()
    calls.clear()
    assert gate.remaining(step) == 40 and len(calls) > 5  # the bisection
    calls.clear()
    gate.check(step, 40)  # from the cached allowance
    with pytest.raises(BudgetExceededError):
        gate.check(step, 41)
    assert not calls


def test_budget_allowance_follows_every_change_of_the_ledger():
    """The gate caches how many steps a budget allows; any change of the ledger
    (through the gate, directly, or by a merge) must be seen."""
    from kdp.training.gate import PrivacyGate
    from kdp.training.ledger import PrivacyLedger, training_mechanism

    step = training_mechanism(2.0, 0.25, "poisson", 4)
    gate = PrivacyGate(1e-3, epsilon_max=_gaussian_eps(2.0, 0.25, 40, 1e-3) * (1 + 1e-9),
                       accountant="rdp")
    assert gate.remaining(step) == 40
    with gate.spend(step, 5):
        pass
    assert gate.remaining(step) == 35
    gate.ledger.record(step, 3, gate.run)  # outside the gate, into the same entry
    assert gate.remaining(step) == 32
    other = PrivacyLedger()
    other.record(step, 10, "another-training")
    gate.merge(other)
    assert gate.remaining(step) == 22
    with pytest.raises(RuntimeError, match="budget"):
        with gate.spend(step, 23):
            pass
    assert gate.ledger.training_steps() == 18  # the refused block recorded nothing
