"""Per-example clipping of real models: dict and list inputs (a keras_hub backbone),
random layers (dropout, augmentation), LoRA, frozen backbones and augmentation
multiplicity (`kdp.clipping`, `kdp.autodiff.ExampleSeeds`).

Runs on whichever ``KERAS_BACKEND`` is set (CI runs it on TensorFlow and JAX).
Tiny configurations with random weights: nothing is downloaded. The reference
for every clipped sum is a Python loop over the examples, each run alone with
its own seeds, clipped by hand in NumPy.
"""

import math

import keras
import keras_hub
import numpy as np
import pytest
from test_clipping import clipped_sum

from kdp import autodiff, clipping
from kdp.admission import AdmissionError
from kdp.model import DP_Model, DPParameters
from kdp.pipeline import DatasetMetadata
from kdp.training.validation import DataValidationError, validate_batch

N, BATCH, T = 40, 5, 8
SCCE = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _compile(inputs, outputs, input_shape, **params):
    params = {"noise_multiplier": 1.0, "delta": 1e-3, "reproducible": True, "seed": 0,
              "clipping_norm": 1.0, "batch_shapes": 1, **params}  # one compiled step
    model = DP_Model(inputs, outputs, dp_parameters=DPParameters(**params),
                     dataset_metadata=DatasetMetadata(input_shape, 3, N, BATCH))
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss=SCCE)
    return model


def _bert(dropout=0.1, lora=False, frozen=False, **params):
    """A tiny `BertBackbone` (dict inputs) with a classification head."""
    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.BertBackbone(
        vocabulary_size=50, num_layers=1, num_heads=2, hidden_dim=16, intermediate_dim=32,
        max_sequence_length=T, dropout=dropout)
    if lora:
        backbone.enable_lora(2)
    if frozen:
        backbone.trainable = False
    head = keras.layers.Dense(3)(keras.layers.Dropout(dropout)(backbone.output["pooled_output"]))
    return _compile(backbone.input, head, (T,), **params)


def _bert_data(rows, seed=1):
    rng = np.random.default_rng(seed)
    mask = np.ones((rows, T), "int32")
    mask[:, 6:] = 0
    x = {"token_ids": rng.integers(1, 50, (rows, T)).astype("int32") * mask,
         "segment_ids": np.zeros((rows, T), "int32"), "padding_mask": mask}
    return x, rng.integers(0, 3, rows)


def _rows(x, i):
    return keras.tree.map_structure(lambda a: a[i:i + 1], x)


def _loop(model, x, y, w, index=lambda i: i):
    """Example ``i``'s gradient ``∇(w_i ℓ_i)``, run alone with the seeds of example
    ``index(i)``: a list of ``{path: g_i}`` and the losses ``ℓ_i``."""
    trainable = model.trainable_variables
    others = [v.value for v in model.non_trainable_variables]
    seeds = autodiff.ExampleSeeds(model)

    def loss(i, xi, yi, *values):
        seeds.start(i)
        with seeds:
            out, _ = model.stateless_call(list(values), others, xi, training=True)
        return keras.ops.sum(SCCE.call(yi, out))

    @autodiff.compile_function
    def example(i, xi, yi, wi, values):
        grads = autodiff.gradient(lambda *v: wi * loss(i, xi, yi, *v), *values)
        return [_dense(g) for g in grads], loss(i, xi, yi, *values)

    grads, losses = [], []
    for i in range(len(y)):
        g, value = example(np.int32(index(i)), _rows(x, i), y[i:i + 1], np.float32(w[i]),
                           [v.value for v in trainable])
        grads.append({v.path: np.asarray(gv, "float64") for v, gv in zip(trainable, g)})
        losses.append(float(value))
    return grads, losses


def _dense(g):
    if type(g).__name__ == "IndexedSlices":  # TensorFlow's sparse embedding gradient
        import tensorflow as tf

        return tf.convert_to_tensor(g)
    return g


def _norm(g):
    return math.sqrt(sum(float(np.sum(v ** 2)) for v in g.values()))


def _clip(per_example, c):
    out = {p: 0.0 for p in per_example[0]}
    for g in per_example:
        scale = min(1.0, c / max(_norm(g), 1e-30))
        for p in out:
            out[p] = out[p] + scale * g[p]
    return out


def _rel_err(got, expected):
    num = math.sqrt(sum(float(np.sum((np.asarray(got[p], "float64") - expected[p]) ** 2)) for p in expected))
    return num / max(_norm(expected), 1e-30)


def _contribution_norms(model, x, y, w):
    """``‖ḡ(batch) − ḡ(batch with example k weighted 0)‖`` for every example ``k``."""
    clipped = clipped_sum(model)
    full = clipped(x, y, w)
    out = []
    for k in range(len(y)):
        w_k = w.copy()
        w_k[k] = 0.0
        part = clipped(x, y, w_k)
        out.append(_norm({p: np.asarray(full[p], "float64") - np.asarray(part[p], "float64") for p in full}))
    return out


@pytest.mark.parametrize("lora", [False, True], ids=["dropout", "dropout_lora"])
def test_bert_clipped_sum_is_the_per_example_loop(lora):
    """Dict inputs and dropout: ḡ = Σ_i min(1, C/‖g_i‖) g_i, g_i of example i run alone with
    its own dropout masks; each example moves ḡ by at most C."""
    model = _bert(lora=lora)
    x, y = _bert_data(BATCH)
    w = np.ones(BATCH, "float32")
    w[-1] = 0.0  # a padding row
    per_example, _ = _loop(model, x, y, w)
    c = float(np.median([_norm(g) for g in per_example[:-1]]))  # about half are clipped
    model.dp_parameters = model.dp_parameters.replace(clipping_norm=c)
    expected = _clip(per_example, c)
    got = clipped_sum(model)(x, y, w)
    assert set(got) == {v.path for v in model.trainable_variables}
    assert _rel_err(got, expected) < 1e-4
    if lora:  # only the adapters of the backbone's dense layers are trained, not their kernels
        assert any("lora_kernel_a" in p for p in got)
        frozen = [v.path for v in model.non_trainable_variables if v.path.endswith("/kernel")]
        assert frozen and not set(frozen) & set(got)
    assert max(_contribution_norms(model, x, y, w)) <= c * (1 + 1e-4)
    # Negative controls: one dropout mask shared by every example, or an unclipped
    # sum, is far from what the step computes.
    shared, _ = _loop(model, x, y, w, index=lambda i: 0)
    assert _rel_err(got, _clip(shared, c)) > 1e-2
    assert _rel_err(got, _clip(per_example, 2 * c)) > 1e-2


def test_reported_loss_is_that_of_the_per_example_pass():
    model = _bert()
    x, y = _bert_data(BATCH)
    _, losses = _loop(model, x, y, np.ones(BATCH, "float32"))

    def forward(call, probe, xi, yi):
        return keras.ops.sum(SCCE.call(yi, call(xi))), []

    got = keras.ops.convert_to_numpy(autodiff.per_example_values(model, forward, x, y))
    np.testing.assert_allclose(got, losses, rtol=1e-4)


@pytest.mark.parametrize("variant", ["dropout", "lora", "frozen_backbone"])
def test_fit_bert(variant):
    model = _bert(lora=variant == "lora", frozen=variant == "frozen_backbone")
    x, y = _bert_data(N)
    frozen = [keras.ops.convert_to_numpy(v.value) for v in model.non_trainable_variables]
    history = model.fit(x, y, epochs=1, steps_per_epoch=2, verbose=0)
    assert np.isfinite(history.history["loss"][-1])
    assert history.history["epsilon"][-1] > 0
    assert model.privacy_ledger.training_steps() == 2
    for before, v in zip(frozen, model.non_trainable_variables):
        if "seed_generator" not in v.path:
            np.testing.assert_array_equal(before, keras.ops.convert_to_numpy(v.value))


def test_fit_list_inputs_and_row_validation():
    a, b = keras.Input((4,)), keras.Input((3,), dtype="int32")
    h = keras.layers.Concatenate()([a, keras.layers.Flatten()(keras.layers.Embedding(5, 2)(b))])
    model = _compile([a, b], keras.layers.Dense(3)(keras.layers.Dropout(0.2)(h)), (4,),
                     physical_batch_size=2)
    rng = np.random.default_rng(0)
    x = [rng.normal(size=(N, 4)).astype("float32"), rng.integers(0, 5, (N, 3)).astype("int32")]
    y = rng.integers(0, 3, N)
    history = model.fit(x, y, epochs=1, steps_per_epoch=2, verbose=0)
    assert np.isfinite(history.history["loss"][-1])
    with pytest.raises(DataValidationError, match="different numbers of rows"):
        validate_batch(model, [x[0], x[1][:-1]], y)
    with pytest.raises(DataValidationError, match="different numbers of rows"):
        validate_batch(model, {"a": x[0][:-1], "b": x[1]}, y)


class ScaledViews(keras.layers.Layer):
    """A deterministic "augmentation": row ``r`` of the batch times ``1 + r``, so an
    example's ``K`` copies are the views ``x, 2x, …, Kx``."""

    def call(self, x):
        return x * (1.0 + keras.ops.cast(keras.ops.arange(keras.ops.shape(x)[0]), x.dtype))[:, None]


def test_augmentation_multiplicity_averages_the_views_then_clips():
    k = 3
    keras.utils.set_random_seed(0)
    inputs = keras.Input((6,))
    h = keras.layers.Dense(8, activation="tanh")(ScaledViews()(inputs))
    model = _compile(inputs, keras.layers.Dense(3)(h), (6,), augmentation_multiplicity=k)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(BATCH, 6)).astype("float32")
    y = rng.integers(0, 3, BATCH)
    w = np.ones(BATCH, "float32")
    views = [_loop(model, x * (1.0 + v), y, w)[0] for v in range(k)]  # each view alone
    mean = [{p: sum(view[i][p] for view in views) / k for p in views[0][i]} for i in range(BATCH)]
    c = float(np.median([_norm(g) for g in mean]))
    model.dp_parameters = model.dp_parameters.replace(clipping_norm=c)
    got = clipping.clipped_gradient_sum(model, x, y, w)
    assert _rel_err(got, _clip(mean, c)) < 1e-5
    # Negative controls: each view clipped separately, or one view only, is another sum.
    assert _rel_err(got, {p: sum(_clip(view, c)[p] for view in views) / k for p in got}) > 1e-3
    model.dp_parameters = model.dp_parameters.replace(augmentation_multiplicity=1)
    assert _rel_err(clipping.clipped_gradient_sum(model, x, y, w), _clip(mean, c)) > 1e-2


def test_fit_with_keras_augmentation_layers():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8, 8, 2))
    h = keras.layers.RandomFlip(seed=1)(inputs)
    h = keras.layers.RandomTranslation(0.1, 0.1, seed=2)(h)
    h = keras.layers.Conv2D(3, 3, activation="relu")(keras.layers.GaussianNoise(0.1)(h))
    outputs = keras.layers.Dense(3)(keras.layers.Flatten()(keras.layers.SpatialDropout2D(0.2)(h)))
    model = _compile(inputs, outputs, (8, 8, 2), augmentation_multiplicity=2,
                     physical_batch_size=3)
    model.check_dp()  # random per-row transforms do not mix the batch
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(N, 8, 8, 2)).astype("float32"), rng.integers(0, 3, N)
    history = model.fit(x, y, epochs=1, steps_per_epoch=2, verbose=0)
    assert np.isfinite(history.history["loss"][-1]) and history.history["epsilon"][-1] > 0


def test_views_differ_between_copies_and_examples():
    """A RandomFlip inside the per-example pass flips each of an example's K copies,
    and each example, with its own draw (not one draw shared by the batch)."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((2, 4, 1))
    model = _compile(inputs, keras.layers.Flatten()(keras.layers.RandomFlip("horizontal", seed=3)(inputs)),
                     (2, 4, 1), augmentation_multiplicity=8)
    x = np.tile(np.arange(8, dtype="float32").reshape(1, 2, 4, 1), (6, 1, 1, 1))

    def forward(call, probe, xi, yi):
        out = call(xi)  # (8 copies, 8 values): flipped copies start with 3
        return keras.ops.sum(keras.ops.cast(keras.ops.equal(out[:, 0], 3.0), "float32")), []

    flipped = keras.ops.convert_to_numpy(
        autodiff.per_example_values(model, forward, x, np.zeros(6), views=8))
    assert len(set(np.round(flipped * 8).astype(int).tolist())) > 1  # the examples' draws differ
    assert np.any((flipped > 0) & (flipped < 1))  # an example's copies draw differently


def test_batchnorm_and_batch_mixing_are_still_refused_with_random_layers():
    def model_with(layer):
        inputs = keras.Input((6,))
        h = keras.layers.Dropout(0.2)(keras.layers.Dense(8)(inputs))
        return _compile(inputs, keras.layers.Dense(3)(layer(h)), (6,))

    with pytest.raises(AdmissionError, match=r"\(BatchNormalization\): its training forward pass writes"):
        model_with(keras.layers.BatchNormalization()).check_dp()
    centre = keras.layers.Lambda(lambda t: t - keras.ops.mean(t, axis=0, keepdims=True))
    with pytest.raises(clipping.ClippingError, match="mixes the examples of a batch"):
        model_with(centre).check_dp()
    model_with(keras.layers.Lambda(lambda t: 2.0 * t)).check_dp()  # per-example: accepted
    with pytest.raises(ValueError, match="SeedGenerator"):  # Keras' global seed: refused
        model_with(UnseededDropout()).check_dp()


class UnseededDropout(keras.layers.Layer):
    """Draws from Keras' global random state (no `keras.random.SeedGenerator`)."""

    def call(self, x, training=None):
        return keras.random.dropout(x, 0.5) if training else x


def test_augmentation_multiplicity_parameter():
    params = DPParameters(delta=1e-3, clipping_norm=1.0, augmentation_multiplicity=4)
    assert DPParameters.from_config(params.get_config()).augmentation_multiplicity == 4
    for bad in (0, 1.5, True, "2"):
        with pytest.raises(ValueError, match="augmentation_multiplicity"):
            DPParameters(delta=1e-3, clipping_norm=1.0, augmentation_multiplicity=bad)
    with pytest.raises(ValueError, match="needs per-example clipping"):
        DPParameters(delta=1e-3, augmentation_multiplicity=2)


class _RandomLayerThat(keras.layers.Layer):
    """A random layer (its own `keras.random.SeedGenerator`) that also adds a loss
    term, writes a variable, or mixes its batch: adversarial cases for admission."""

    def __init__(self, does, **kwargs):
        super().__init__(**kwargs)
        self.does = does
        self.seed_generator = keras.random.SeedGenerator(1)

    def build(self, input_shape):
        self.total = self.add_weight(shape=(), initializer="zeros", trainable=False)

    def call(self, x, training=None):
        if training:
            x = keras.random.dropout(x, 0.3, seed=self.seed_generator)
            if self.does == "add_loss":
                self.add_loss(keras.ops.mean(x ** 2))
            if self.does == "state":
                self.total.assign(self.total + keras.ops.mean(x))
        if self.does == "mix":
            x = x - keras.ops.mean(x, axis=0, keepdims=True)
        return x


@pytest.mark.parametrize("does,error,message", [
    ("add_loss", AdmissionError, "adds a loss term"),
    ("state", AdmissionError, "writes"),
    ("mix", clipping.ClippingError, "mixes the examples of a batch"),
])
def test_random_layers_that_add_a_loss_keep_state_or_mix_are_refused_before_any_step(does, error, message):
    """With augmentation multiplicity too: K views of an example are one record,
    but a loss term, a state or a mixing over the batch still escapes the bound."""
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(N, 6)).astype("float32"), rng.integers(0, 3, N)

    def model_with(layer):
        inputs = keras.Input((6,))
        outputs = keras.layers.Dense(3)(layer(keras.layers.Dense(8)(inputs)))
        return _compile(inputs, outputs, (6,), augmentation_multiplicity=3)

    model = model_with(_RandomLayerThat(does))
    with pytest.raises(error, match=message):
        model.fit(x, y, epochs=1, verbose=0)
    assert model.privacy_ledger.training_steps() == 0
    control = model_with(_RandomLayerThat("nothing"))
    control.fit(x, y, epochs=1, verbose=0)  # the same random layer alone trains
    assert control.privacy_ledger.training_steps() > 0


class CallCounter(keras.layers.Layer):
    """The identity, counting its calls (at trace time in a compiled step)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.calls = 0

    def call(self, x):
        self.calls += 1
        return x


def test_step_reports_the_loss_of_its_only_per_example_pass(monkeypatch):
    """With dropout and K = 3 views, a step's loss is Σ_i w_i mean_k ℓ_ik / b of the
    per-example pass whose gradients are clipped (each example run alone with its
    seeds), and the step's objective runs the model no more often than that one
    gradient pass does: no second per-example pass for the loss."""
    from kdp.training import objective as objective_module

    k = 3
    keras.utils.set_random_seed(0)
    counter = CallCounter()
    inputs = keras.Input((6,))
    h = counter(keras.layers.Dropout(0.5, seed=4)(keras.layers.Dense(8, activation="tanh")(inputs)))
    model = _compile(inputs, keras.layers.Dense(3)(h), (6,), augmentation_multiplicity=k)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(BATCH, 6)).astype("float32")
    y = rng.integers(0, 3, BATCH)
    w = np.array([1.0, 0.5, 1.0, 0.0, 1.0], "float32")

    per_objective = []
    original = objective_module.objective

    def counted(*args, **kwargs):
        before = counter.calls
        out = original(*args, **kwargs)
        if args[5]:  # objective(model, x, y, y_pred, sample_weight, training, ...)
            per_objective.append(counter.calls - before)
        return out

    monkeypatch.setattr(objective_module, "objective", counted)
    trainable = [keras.ops.convert_to_numpy(v.value) for v in model.trainable_variables]
    reported = model.train_on_batch(x, y, sample_weight=w, return_dict=True)["loss"]
    assert per_objective

    # (a) Each example alone, its K copies with its own seeds, at the step's weights
    # and the generators' states its objective read (Keras' forward pass drew first).
    others = [v.value for v in model.non_trainable_variables]
    seeds = autodiff.ExampleSeeds(model)

    @autodiff.compile_function
    def example_loss(i, xi, yi):
        seeds.start(i)
        with seeds:
            out, _ = model.stateless_call(trainable, others, xi, training=True)
        return keras.ops.sum(SCCE.call(yi, out)) / k

    by_hand = [float(example_loss(np.int32(i), np.repeat(x[i:i + 1], k, 0), np.repeat(y[i:i + 1], k)))
               for i in range(BATCH)]
    np.testing.assert_allclose(reported, float(np.dot(w, by_hand)) / BATCH, rtol=1e-5)

    # (b) The step's objective traces the model exactly as often as the per-example
    # gradient pass alone (JAX adds a shape-only trace). Control: a gradient pass
    # followed by a separate per-example loss pass; the counter sees the extra one.
    def forward(call, probe, xi, yi):
        return keras.ops.sum(SCCE.call(yi, call(xi))), []

    counts = []

    def both_passes(x, y, w):
        start = counter.calls
        clipping.clipped_gradient_sum(model, x, y, w)
        counts.append(counter.calls - start)
        values = autodiff.per_example_values(model, forward, x, y, views=k)
        counts.append(counter.calls - start - counts[-1])
        return values

    autodiff.evaluate_shapes(both_passes, x, y, w)
    once, second = counts[:2]
    assert once >= 1 and second >= 1
    assert per_objective == [once] * len(per_objective)
    # Negative control for (a): without dropout and views, the loss is another value.
    out, _ = model.stateless_call(trainable, others, x, training=False)
    plain = keras.ops.convert_to_numpy(SCCE.call(y, out))
    assert abs(reported - float(np.dot(w, plain)) / BATCH) > 1e-3
