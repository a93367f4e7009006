"""Per-example clipping DP-SGD (`kdp.clipping`): clipped sums, noise, accounting, errors.

Runs on whichever ``KERAS_BACKEND`` is set (CI runs it on TensorFlow and JAX).
The reference for every clipped sum is a brute-force Python loop over the
examples (one ordinary gradient per example, clipped by hand in NumPy); the
accountant reference is dp-accounting called directly.
"""

import copy
import math

import dp_accounting
import keras
import numpy as np
import pytest

from kdp import audit, clipping
from kdp.clipping.engine import _chunked_sum
from kdp.admission import AdmissionError
from kdp.autodiff import compile_function, gradient
from kdp.model import DP_Model, DP_Sequential, DPParameters
from kdp.pipeline import DatasetMetadata

N, BATCH = 200, 16
SCCE = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _dense_model():
    inputs = keras.Input((10,))
    h = keras.layers.Dense(12, activation="tanh")(inputs)
    seq = keras.layers.Reshape((2, 6))(h)
    seq = keras.layers.Dense(5, activation="relu")(seq)    # sequence input, formed (6·5 ≤ 2·T·(6 + 5))
    seq = keras.layers.Dense(32, use_bias=False)(seq)       # sequence input, Gram (5·32 > 2·T·(5 + 32))
    out = keras.layers.Dense(3)(keras.layers.Flatten()(seq))
    return inputs, out, np.random.default_rng(1).normal(size=(BATCH, 10)).astype("float32")


def _conv_model():
    inputs = keras.Input((8, 8, 2))
    h = keras.layers.Conv2D(4, 3, activation="relu")(inputs)
    h = keras.layers.MaxPooling2D()(h)
    out = keras.layers.Dense(3)(keras.layers.Flatten()(h))
    return inputs, out, np.random.default_rng(1).normal(size=(BATCH, 8, 8, 2)).astype("float32")


def _embedding_model():
    inputs = keras.Input((5,), dtype="int32")
    h = keras.layers.Embedding(20, 8)(inputs)
    h = keras.layers.LayerNormalization()(h)
    h = keras.layers.Dense(6, activation="relu")(h)
    out = keras.layers.Dense(3)(keras.layers.GlobalAveragePooling1D()(h))
    return inputs, out, np.random.default_rng(1).integers(0, 20, (BATCH, 5)).astype("int32")


MODELS = {"dense": _dense_model, "conv2d": _conv_model, "embedding_layernorm": _embedding_model}


def _build(kind, clipping_norm=1.0, mode="flat", sigma=1.0, physical_batch_size=None, seed=0):
    inputs, outputs, x = MODELS[kind]()
    params = DPParameters(noise_multiplier=sigma, delta=1e-3, reproducible=True, seed=seed,
                          clipping_norm=clipping_norm, clipping=mode,
                          physical_batch_size=physical_batch_size)
    model = DP_Model(inputs, outputs, dp_parameters=params,
                     dataset_metadata=DatasetMetadata(x.shape[1:], 3, N, BATCH))
    model.compile(optimizer=keras.optimizers.SGD(1.0), loss=SCCE)
    y = np.random.default_rng(2).integers(0, 3, BATCH)
    w = np.ones(BATCH, "float32")
    w[-3:] = 0.0   # padding rows
    w[0] = 0.5     # a fractional weight
    return model, x, y, w


def clipped_sum(model, **options):
    """``(x, y, w) -> clipping.clipped_gradient_sum(model, x, y, w, **options)``, compiled
    (one trace per shape: JAX's eager mode compiles each primitive at its first use)."""
    return compile_function(lambda x, y, w: clipping.clipped_gradient_sum(model, x, y, w, **options))


def _brute_force(model, x, y, w):
    """Per-example gradients by a Python loop over the examples: ``[{path: g_i}]``."""
    trainable = model.trainable_variables
    others = [v.value for v in model.non_trainable_variables]

    @compile_function
    def gradients(values, x_i, y_i, w_i):
        def loss_i(*values):
            out, _ = model.stateless_call(list(values), others, x_i, training=True)
            return w_i * keras.ops.sum(SCCE.call(y_i, out))

        return gradient(loss_i, *values)

    values = [v.value for v in trainable]
    return [{v.path: _dense(g) for v, g in zip(trainable, gradients(values, x[i:i + 1], y[i:i + 1], w[i]))}
            for i in range(len(x))]


def _dense(g):
    if type(g).__name__ == "IndexedSlices":  # TensorFlow's sparse embedding gradient
        import tensorflow as tf

        g = tf.convert_to_tensor(g)
    return np.asarray(g, "float64")


def _clip_by_hand(model, per_example, mode, c):
    groups = clipping.clipping_groups(model) if mode == "per-layer" else {
        None: [v.path for v in model.trainable_variables]}
    c_l = c / math.sqrt(len(groups)) if mode == "per-layer" else c
    total = {p: 0.0 for p in per_example[0]}
    for g in per_example:
        for paths in groups.values():
            norm = math.sqrt(sum(float(np.sum(g[p] ** 2)) for p in paths))
            scale = min(1.0, c_l / norm) if norm > 0 else 1.0
            for p in paths:
                total[p] = total[p] + scale * g[p]
    return total


def _median_norm(per_example):
    return float(np.median([math.sqrt(sum(float(np.sum(v ** 2)) for v in g.values()))
                            for g in per_example if any(np.any(v) for v in g.values())]))


def _rel_err(a, b):
    a, b = np.asarray(a, "float64"), np.asarray(b, "float64")
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


@pytest.mark.parametrize("kind", sorted(MODELS))
@pytest.mark.parametrize("mode", ["flat", "per-layer"])
def test_clipped_sum_matches_brute_force(kind, mode):
    model, x, y, w = _build(kind, mode=mode)
    per_example = _brute_force(model, x, y, w)
    c = _median_norm(per_example)  # about half the examples are clipped
    model.dp_parameters = model.dp_parameters.replace(clipping_norm=c)
    expected = _clip_by_hand(model, per_example, mode, c)
    unclipped = {p: sum(g[p] for g in per_example) for p in expected}
    for ghost in (True, False):
        got = clipped_sum(model, ghost=ghost)(x, y, w)
        assert set(got) == set(expected)
        for path in expected:
            assert _rel_err(got[path], expected[path]) < 1e-5, (ghost, path)
    # Negative control: clipping really happened, so the unclipped sum is far off.
    assert max(_rel_err(unclipped[p], expected[p]) for p in expected) > 1e-2


def test_padding_rows_contribute_nothing():
    model, x, y, w = _build("dense")
    clipped = clipped_sum(model)
    got = clipped(x, y, w)
    x2 = x.copy()
    x2[w == 0] = 1e3 * np.random.default_rng(5).normal(size=x2[w == 0].shape)  # garbage padding
    again = clipped(x2, y, w)
    for p in got:
        np.testing.assert_allclose(np.asarray(again[p]), np.asarray(got[p]), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("chunk, rows_per_pass, computed", [(5, 4, 16), (6, 6, 16), (3, 3, 15)])
def test_virtual_batches_equal_one_batch(chunk, rows_per_pass, computed, monkeypatch):
    """Chunks of at most ``chunk`` rows, as few as hold the 16 rows and balanced
    (at most 5: 4 chunks of 4 rows, not 5+5+5+1; at most 6: 3 chunks of 6, the
    last padded) give the clipped sum, losses and outputs of the whole batch at
    once (outputs collected in the form of Keras' predictions). The rows of
    weight 0 are the last 3: with chunks of 3 rows, the sixth chunk (row 15 and
    padding) holds no row of positive weight and is skipped, its row's loss and
    outputs left 0."""
    from kdp.clipping import engine

    model, x, y, w = _build("conv2d", clipping_norm=0.5)
    assert w[-3:].tolist() == [0, 0, 0] and np.all(w[:-3] > 0)
    whole, losses, outputs = clipping.clipped_gradient_sum(model, x, y, w, with_losses=True,
                                                           with_outputs=True)
    rows = set()
    pass_sum = engine.clipped_gradient_sum
    monkeypatch.setattr(engine, "clipped_gradient_sum",
                        lambda m, xs, *a, **k: rows.add(int(xs.shape[0])) or pass_sum(m, xs, *a, **k))
    tensors = [keras.ops.convert_to_tensor(a) for a in (x, y, w)]
    chunked, chunk_losses, chunk_outputs = _chunked_sum(model, *tensors, chunk, like=model(x))
    assert rows == {rows_per_pass}
    for p in whole:
        assert _rel_err(chunked[p], whole[p]) < 1e-5
    chunk_losses, chunk_outputs = np.asarray(chunk_losses), np.asarray(chunk_outputs)
    assert chunk_losses.shape == (len(y),) and chunk_outputs.shape == outputs.shape
    assert _rel_err(chunk_losses[:computed], np.asarray(losses)[:computed]) < 1e-5
    assert _rel_err(chunk_outputs[:computed], np.asarray(outputs)[:computed]) < 1e-5
    assert np.all(chunk_losses[computed:] == 0) and np.all(chunk_outputs[computed:] == 0)
    assert computed == len(y) or np.any(np.asarray(outputs)[computed:] != 0)  # skipped, not computed as 0


def _objective_gradient(model, x, y, w, any_batch_size=False):
    """∇ of the real training objective (`stateless_compute_loss`, training=True),
    inside the privacy gate (recorded as one step, as any noisy objective).
    ``any_batch_size`` (TensorFlow): traced once with the batch size unknown, as
    Keras' ``fit`` traces its step after a second batch shape."""
    def compute(x, y, w):
        y_pred = model(x)
        others = [v.value for v in model.non_trainable_variables]
        metrics = [v.value for v in model.metrics_variables]

        def objective(*values):
            loss, _ = model.stateless_compute_loss(list(values), others, metrics, x=x, y=y, y_pred=y_pred,
                                                   sample_weight=w, training=True)
            return loss

        return gradient(objective, *[v.value for v in model.trainable_variables])

    if any_batch_size:
        import tensorflow as tf

        compute = tf.function(compute, input_signature=[
            tf.TensorSpec((None,) + x.shape[1:], x.dtype), tf.TensorSpec((None,), y.dtype),
            tf.TensorSpec((None,), w.dtype)])
    with model.privacy_gate.spend(model.step_plan().batch_mechanism):
        return compute(x, y, w)


@pytest.mark.parametrize("physical_batch_size", [None, 6])
def test_training_objective_gradient_is_clipped_sum_plus_noise(physical_batch_size):
    """Same seed state: ∇objective(w) − ∇objective(0) = ḡ / b exactly (the noise cancels)."""
    model, x, y, w = _build("dense", clipping_norm=0.3, physical_batch_size=physical_batch_size)
    model(x)
    with_data = _objective_gradient(model, x, y, w)
    noise_only = _objective_gradient(model, x, y, np.zeros_like(w))
    expected = clipping.clipped_gradient_sum(model, x, y, w)
    for v, g1, g0 in zip(model.trainable_variables, with_data, noise_only):
        assert np.std(np.asarray(g0)) > 0  # there is noise
        assert _rel_err(np.asarray(g1) - np.asarray(g0), np.asarray(expected[v.path]) / BATCH) < 1e-4


@pytest.mark.parametrize("kind, physical_batch_size", [("dense", None), ("embedding_layernorm", None),
                                                       ("dense", 6)])
def test_a_steps_metrics_are_those_of_the_per_example_pass(kind, physical_batch_size, monkeypatch):
    """The step's predictions come from the per-example pass (Keras' forward pass is
    then unused): its metrics (unweighted, Keras' ``metrics``) equal those of the
    model before the update, with or without virtual batches."""
    from kdp.training import objective as training_objective

    model, x, y, w = _build(kind, physical_batch_size=physical_batch_size)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss=SCCE,
                  metrics=[keras.metrics.SparseCategoricalAccuracy("acc"),
                           keras.metrics.SparseCategoricalCrossentropy("xent", from_logits=True)])
    taken = []
    take = training_objective.step_predictions

    def recorded(m, y_pred):
        predictions = take(m, y_pred)
        taken.append(predictions is not y_pred)  # the pass's outputs replaced Keras'
        return predictions

    monkeypatch.setattr(training_objective, "step_predictions", recorded)
    logits = np.asarray(model.predict(x, verbose=0))
    logs = model.train_on_batch(x, y, sample_weight=w, return_dict=True)
    xent = -(logits - np.log(np.exp(logits).sum(1, keepdims=True)))[np.arange(BATCH), y]
    assert logs["acc"] == pytest.approx(np.mean(logits.argmax(1) == y), abs=1e-6)
    assert logs["xent"] == pytest.approx(np.mean(xent), rel=1e-4)
    assert sum(taken) == 1, taken
    assert not model.__dict__["_kdp_pass_outputs"]  # nothing left for a later trace
    copy.deepcopy(model)  # the slot does not stop a trained model from being copied


@pytest.mark.parametrize("mode", ["flat", "per-layer"])
def test_noise_std_is_sigma_c_over_b(mode):
    sigma, c = 1.3, 0.7
    model, x, y, _ = _build("dense", clipping_norm=c, mode=mode, sigma=sigma)
    expected = sigma * c / BATCH
    assert all(s == pytest.approx(expected) for s in model.noise_stds().values())
    draws = audit.noise_draws(model, x, y, trials=100)  # ~43k draws: std error 0.35 %
    everything = np.concatenate([d.reshape(-1) for d in draws.values()])
    assert everything.size > 40_000
    assert abs(np.std(everything) / expected - 1) < 0.03
    assert abs(np.mean(everything)) < 0.03 * expected
    # Negative control: a 10 % error in the calibration would be detected.
    assert abs(np.std(everything) / (1.10 * expected) - 1) > 0.03
    # Consecutive draws differ (the seed generator moves).
    first = next(iter(draws.values()))
    assert not np.allclose(first[0], first[1])


def test_fit_trains_and_accounts_like_dp_accounting():
    sigma, delta = 1.1, 1e-3
    rng = np.random.default_rng(0)
    x = rng.normal(size=(N, 10)).astype("float32")
    y = (x[:, 0] > 0).astype("int32") + (x[:, 1] > 1).astype("int32")
    model = DP_Sequential(
        [keras.Input((10,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(3)],
        dp_parameters=DPParameters(noise_multiplier=sigma, delta=delta, clipping_norm=1.0),
        dataset_metadata=DatasetMetadata((10,), 3, N, BATCH),
    )
    model.compile(optimizer=keras.optimizers.SGD(0.5), loss=SCCE)
    before = [np.array(v) for v in model.trainable_variables]
    model.fit(x, y, epochs=2, verbose=0)
    assert any(not np.allclose(b, np.array(v)) for b, v in zip(before, model.trainable_variables))
    steps = 2 * math.ceil(N / BATCH)
    assert model.privacy_ledger.training_steps() == steps
    assert model.effective_noise_multiplier() == sigma
    acc = dp_accounting.rdp.RdpAccountant()
    acc.compose(dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(BATCH / N, dp_accounting.GaussianDpEvent(sigma)), steps))
    eps, d = model.privacy_spent("rdp")  # the RDP anchor below
    assert d == delta
    assert eps == pytest.approx(acc.get_epsilon(delta), rel=1e-9)
    # Negative control: another σ gives another ε.
    assert abs(eps - dp_accounting.rdp.RdpAccountant().compose(dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(BATCH / N, dp_accounting.GaussianDpEvent(1.2 * sigma)),
        steps)).get_epsilon(delta)) > 0.01


@pytest.mark.parametrize("batch_shapes", [None, 3, 1])
def test_fit_with_virtual_batches_is_one_step_per_poisson_batch(batch_shapes, monkeypatch):
    """Also with one padded size (the capacity), whose passes of padding are skipped:
    the default with virtual batches (``batch_shapes=None``); 3 gives the ladder."""
    from kdp.training import sampling

    sizes = []  # the rows of every Poisson batch `fit` draws

    class Recording(sampling.PoissonBatches):
        def __getitem__(self, index):
            batch = super().__getitem__(index)
            sizes.append(len(batch[2]))
            return batch

    monkeypatch.setattr(sampling, "PoissonBatches", Recording)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(N, 10)).astype("float32")
    y = rng.integers(0, 3, N).astype("int32")
    params = DPParameters(noise_multiplier=1.0, delta=1e-3, clipping_norm=1.0, physical_batch_size=6,
                          batch_shapes=batch_shapes)
    model = DP_Sequential(
        [keras.Input((10,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(3)],
        dp_parameters=params, dataset_metadata=DatasetMetadata((10,), 3, N, BATCH),
    )
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss=SCCE)
    model.fit(x, y, epochs=1, steps_per_epoch=4, verbose=0)
    assert model.privacy_ledger.training_steps() == 4
    assert all(np.all(np.isfinite(np.array(v))) for v in model.trainable_variables)
    ladder = sampling.poisson_batch_shapes(BATCH, N, 3)
    assert len(sizes) >= 4
    if batch_shapes == 3:  # the control: below the capacity, a draw of b ± 2s rows is padded less
        assert set(sizes) <= set(ladder) and min(sizes) < ladder[-1]
    else:
        assert set(sizes) == {ladder[-1]}
    assert params.batch_shapes == (3 if batch_shapes == 3 else 1)


@pytest.mark.parametrize("unroll", [False, True])
def test_recurrent_layers_train_or_are_refused_with_a_remedy_before_any_step(unroll):
    """JAX differentiates an LSTM's loop per example; TensorFlow cannot inside Keras'
    tape (a raw TypeError on a variant tensor): a `ClippingError` naming the
    remedies, raised when the step is traced, before any step is accounted.
    Unrolled, the LSTM trains on both backends."""
    from kdp.clipping import ClippingError

    rng = np.random.default_rng(0)
    x = rng.normal(size=(N, 5, 3)).astype("float32")
    y = rng.integers(0, 3, N).astype("int32")
    model = DP_Sequential(
        [keras.Input((5, 3)), keras.layers.LSTM(4, unroll=unroll), keras.layers.Dense(3)],
        dp_parameters=DPParameters(noise_multiplier=1.0, delta=1e-3, clipping_norm=1.0),
        dataset_metadata=DatasetMetadata((5, 3), 3, N, BATCH))
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss=SCCE)
    before = [np.array(v) for v in model.trainable_variables]
    if keras.backend.backend() == "tensorflow" and not unroll:
        with pytest.raises(ClippingError, match="unroll=True.*JAX"):
            model.fit(x, y, epochs=1, steps_per_epoch=2, verbose=0)
        assert model.privacy_ledger.training_steps() == 0
        assert all(np.array_equal(b, np.array(v)) for b, v in zip(before, model.trainable_variables))
        return
    model.fit(x, y, epochs=1, steps_per_epoch=2, verbose=0)
    assert model.privacy_ledger.training_steps() == 2
    assert all(not np.array_equal(b, np.array(v)) for b, v in zip(before, model.trainable_variables))


def _dp_sequential(layers, **params):
    model = DP_Sequential(layers, dp_parameters=DPParameters(delta=1e-3, clipping_norm=1.0, **params),
                          dataset_metadata=DatasetMetadata((6,), 3, N, BATCH))
    model.compile(optimizer="sgd", loss=SCCE)
    return model


def test_batchnorm_is_refused_and_frozen_batchnorm_warns():
    bn = keras.layers.BatchNormalization()
    model = _dp_sequential([keras.Input((6,)), keras.layers.Dense(8), bn, keras.layers.Dense(3)])
    with pytest.raises(AdmissionError, match=r"\(BatchNormalization\): its training forward pass writes"):
        model.check_dp()
    bn.trainable = False
    with pytest.warns(UserWarning, match="frozen BatchNormalization"):
        model.check_dp()


def test_other_errors():
    drop = _dp_sequential([keras.Input((6,)), keras.layers.Dense(8), keras.layers.Dropout(0.5),
                           keras.layers.Dense(3)])
    drop.check_dp()  # random layers draw per-example values (tests/test_real_models.py)
    model = DP_Sequential([keras.Input((6,)), keras.layers.Dense(3)],
                          dp_parameters=DPParameters(delta=1e-3, clipping_norm=1.0),
                          dataset_metadata=DatasetMetadata((6,), 3, N, BATCH))
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    with pytest.raises(clipping.ClippingError, match="keras.losses.Loss instance"):
        model.check_dp()
    with pytest.raises(ValueError, match="clipping must be one of"):
        DPParameters(clipping_norm=1.0, clipping="per-example")
    with pytest.raises(ValueError, match="clipping_norm must be finite"):
        DPParameters(clipping_norm=-1.0)
    with pytest.raises(ValueError, match="needs clipping='per-layer'"):
        DPParameters(clipping_norm={"dense": 1.0})
    bad = _dp_sequential([keras.Input((6,)), keras.layers.Dense(3, name="head")],
                         clipping="per-layer")
    bad.dp_parameters = bad.dp_parameters.replace(clipping_norm={"nope": 1.0})
    with pytest.raises(clipping.ClippingError, match="missing"):
        bad.check_dp()


def test_config_round_trip():
    params = DPParameters(noise_multiplier=2.0, clipping_norm={"a": 1.0, "b": 2.0}, clipping="per-layer",
                          physical_batch_size=64)
    again = DPParameters.from_config(params.get_config())
    assert again.get_config() == params.get_config()
    assert clipping.total_clipping_norm(again) == pytest.approx(math.sqrt(5.0))


# --- one example, one clipped contribution ---------------------------------------------

T_FOLD, D_FOLD, C_FOLD = 12, 4, 0.5


class _TimeFold(keras.layers.Layer):
    """Applies a Dense sub-layer to every time step: ``(b, T, d) -> (b·T, d) -> Dense -> (b, T, u)``."""

    def __init__(self, units, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(units)

    def build(self, input_shape):
        self.dense.build((None, input_shape[-1]))

    def call(self, t):
        z = self.dense(keras.ops.reshape(t, (-1, t.shape[-1])))
        return keras.ops.reshape(z, (-1, t.shape[1], self.dense.units))


def _folded(kind):
    inputs = keras.Input((T_FOLD, D_FOLD))
    if kind == "custom_layer":
        h = _TimeFold(3)(inputs)
    else:  # the graph itself folds time into rows around a top-level Dense
        h = keras.layers.Lambda(lambda t: keras.ops.reshape(t, (-1, D_FOLD)), output_shape=(D_FOLD,))(inputs)
        h = keras.layers.Dense(3)(h)
        h = keras.layers.Lambda(lambda t: keras.ops.reshape(t, (-1, T_FOLD, 3)), output_shape=(T_FOLD, 3))(h)
    return inputs, keras.layers.GlobalAveragePooling1D()(h)


def _contributions(model, x, y):
    """``‖ḡ(batch) − ḡ(batch with example k weighted 0)‖`` for every example ``k``."""
    w = np.ones(len(x), "float32")
    clipped = clipped_sum(model)
    full = clipped(x, y, w)
    out = []
    for k in range(len(x)):
        w_k = w.copy()
        w_k[k] = 0.0
        part = clipped(x, y, w_k)
        out.append(math.sqrt(sum(float(np.sum((np.asarray(full[p], "float64")
                                               - np.asarray(part[p], "float64")) ** 2)) for p in full)))
    return out


@pytest.mark.parametrize("kind", ["custom_layer", "graph_lambda"])
def test_dense_on_folded_time_steps_is_clipped_per_example(kind):
    """A Dense that sees ``b·T`` rows is clipped per example, not per row (was T·C = 6.0)."""
    keras.utils.set_random_seed(0)
    inputs, outputs = _folded(kind)
    model = DP_Model(inputs, outputs, dp_parameters=DPParameters(delta=1e-3, clipping_norm=C_FOLD),
                     dataset_metadata=DatasetMetadata((T_FOLD, D_FOLD), 3, N, 8))
    model.compile(optimizer="sgd", loss=SCCE)
    model.check_dp()  # each example's output depends on that example alone: accepted
    rng = np.random.default_rng(0)
    x = np.repeat(30 * rng.normal(size=(8, 1, D_FOLD)), T_FOLD, axis=1).astype("float32")  # equal steps
    y = np.argmin(np.asarray(model(x)), axis=1)  # wrong labels: large per-step gradients
    contributions = _contributions(model, x, y)
    assert max(contributions) <= C_FOLD * (1 + 1e-4), contributions
    assert min(contributions) > 0.9 * C_FOLD  # every example is clipped: the bound is attained
    exact = clipping.clipped_gradient_sum(model, x, y, ghost=False)
    default = clipping.clipped_gradient_sum(model, x, y)
    for p in exact:
        assert _rel_err(default[p], exact[p]) < 1e-5
    assert len(clipping.ghost_layers(model)) == 1  # ghost norms over the T rows of an example


def test_ghost_layers_of_a_dense_model_are_its_dense_layers():
    model, _, _, _ = _build("dense")
    ghost = clipping.ghost_layers(model)
    assert [layer.name for layer in ghost] == [
        layer.name for layer in model.layers if isinstance(layer, keras.layers.Dense)]
    assert len(ghost) == 4


def test_dense_whose_rows_are_not_examples_is_clipped_per_example():
    """Rows reversed around a Dense: the model is per-example, the Dense rows are not;
    each example's ghost norms are those of its own pass, so it is admitted and clipped."""
    flip = lambda t: keras.ops.flip(t, axis=0)  # noqa: E731
    model = _dp_sequential([keras.Input((6,)), keras.layers.Dense(8, activation="tanh"),
                            keras.layers.Lambda(flip), keras.layers.Dense(8, name="flipped"),
                            keras.layers.Lambda(flip), keras.layers.Dense(3)])
    model.check_dp()
    rng = np.random.default_rng(0)
    x = (10 * rng.normal(size=(8, 6))).astype("float32")
    y = rng.integers(0, 3, 8)
    assert max(_contributions(model, x, y)) <= 1.0 + 1e-4
    exact = clipping.clipped_gradient_sum(model, x, y, ghost=False)
    default = clipping.clipped_gradient_sum(model, x, y)
    for p in exact:
        assert _rel_err(default[p], exact[p]) < 1e-5


def test_layers_mixing_the_batch_are_refused():
    """Centring over the batch axis couples the examples: refused. The clipped sum runs every
    example alone, so even then one removal moves ḡ by at most C (was > 2·C)."""
    keras.utils.set_random_seed(0)
    centre = keras.layers.Lambda(lambda t: t - keras.ops.mean(t, axis=0, keepdims=True))
    model = _dp_sequential([keras.Input((6,)), keras.layers.Dense(8), centre, keras.layers.Dense(3)])
    with pytest.raises(clipping.ClippingError, match="mixes the examples of a batch"):
        model.check_dp()
    rng = np.random.default_rng(0)
    x = rng.normal(size=(BATCH, 6)).astype("float32")
    x[0] *= 100.0
    y = rng.integers(0, 3, BATCH)
    full = clipping.clipped_gradient_sum(model, x, y)
    rest = clipping.clipped_gradient_sum(model, x[1:], y[1:])
    moved = math.sqrt(sum(float(np.sum((np.asarray(full[p]) - np.asarray(rest[p])) ** 2)) for p in full))
    assert moved <= 1.0 + 1e-4
    # Negative controls: a per-example Lambda, and no Lambda at all, are accepted.
    for layers in ([keras.layers.Lambda(lambda t: t * 2.0)], []):
        _dp_sequential([keras.Input((6,)), keras.layers.Dense(8), *layers, keras.layers.Dense(3)]).check_dp()


def test_the_mixing_probe_traces_the_model_once_per_shape_on_jax(monkeypatch):
    """On JAX the probe's forward passes run compiled: the model is traced once per
    training mode and batch shape (2 shapes: the probe and the probe less one row),
    not run eagerly ten times, which compiles and keeps one executable per
    operation. Other backends run the ten passes eagerly."""
    model = _dp_sequential([keras.Input((6,)), keras.layers.Dense(8), keras.layers.Dense(3)])
    calls = []
    stateless_call = model.stateless_call
    monkeypatch.setattr(model, "stateless_call", lambda *a, **k: calls.append(1) or stateless_call(*a, **k))
    clipping.checks.check_examples_independent(model)
    assert len(calls) == (4 if keras.backend.backend() == "jax" else 10)


def test_virtual_batch_rows_follow_the_ladder_and_physical_batch_size():
    from kdp.training.objective import virtual_batch_rows
    from kdp.training.sampling import poisson_batch_shapes

    model = _build("dense", clipping_norm=0.3)[0]
    shapes = poisson_batch_shapes(BATCH, N)
    assert virtual_batch_rows(model, shapes[-1]) == shapes[-2]
    assert virtual_batch_rows(model, shapes[-2]) is None
    assert virtual_batch_rows(model, None) == shapes[-2]  # an unknown size (TensorFlow): at most that
    explicit = _build("dense", physical_batch_size=6)[0]        # physical_batch_size: chunks of 6 rows
    assert [virtual_batch_rows(explicit, rows) for rows in (None, 7, 6)] == [6, 6, None]


@pytest.mark.parametrize("rows, any_batch_size", [("capacity", False), ("capacity", True), ("small", True)])
def test_a_batch_above_the_ladder_runs_as_virtual_batches(rows, any_batch_size, monkeypatch):
    """A Poisson batch padded to the capacity (the ladder's last size) is summed in
    virtual batches of at most the ladder's size below it, which caps the step's memory; the
    gradient is unchanged: ∇objective(w) − ∇objective(0) = ḡ / b as for one pass.
    With the batch size unknown when traced (TensorFlow), every batch runs in passes
    of at most that size (a smaller batch: one pass of its own rows)."""
    if any_batch_size and keras.backend.backend() != "tensorflow":
        pytest.skip("TensorFlow traces one step for every batch size; a JAX step knows its rows")
    from kdp.clipping import engine
    from kdp.training.sampling import poisson_batch_shapes

    model, x, y, w = _build("dense", clipping_norm=0.3)
    shapes = poisson_batch_shapes(BATCH, N)
    if rows == "capacity":
        index = np.arange(shapes[-1]) % BATCH
        x, y, w = x[index], y[index], w[index]
    chunked = []
    chunked_sum = engine._chunked_sum
    monkeypatch.setattr(engine, "_chunked_sum", lambda *a, **k: chunked.append(a[-1]) or chunked_sum(*a, **k))
    model(x)
    with_data = _objective_gradient(model, x, y, w, any_batch_size)
    noise_only = _objective_gradient(model, x, y, np.zeros_like(w), any_batch_size)
    assert chunked == [shapes[-2]] * 2
    expected = clipping.clipped_gradient_sum(model, x, y, w)
    for v, g1, g0 in zip(model.trainable_variables, with_data, noise_only):
        assert _rel_err(np.asarray(g1) - np.asarray(g0), np.asarray(expected[v.path]) / BATCH) < 1e-4
