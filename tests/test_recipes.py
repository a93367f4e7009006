"""`kdp.recipes`: rules of public facts, and models calibrated to the target."""

import math

import pytest

from kdp import recipes
from kdp.training import budget


def test_table_tau_grows_with_rows_for_one_binary_output():
    """τ·X: 64 for tables, 128 for one binary output from BINARY_TAU_MIN_SAMPLES rows
    (the size rule picked leave-one-dataset-out on the recipe suite); images keep 32."""
    def tau_x(classes, n, **facts):
        r = recipes.recipe((6,), classes, n, 3.0, max_norm=1.0, method="clipless", **facts)
        return r.tau * r.input_bound

    large = recipes.BINARY_TAU_MIN_SAMPLES
    assert tau_x(2, large - 1) == recipes.TAU_TIMES_BOUND_TABLE
    assert tau_x(2, large) == recipes.TAU_TIMES_BOUND_BINARY_LARGE
    assert recipes.TAU_TIMES_BOUND_BINARY_LARGE > recipes.TAU_TIMES_BOUND_TABLE
    assert tau_x(3, 10 * large) == recipes.TAU_TIMES_BOUND_TABLE  # more classes: no size rule
    image = recipes.recipe((8, 8), 2, 10 * large, 3.0, features=None, method="clipless")
    assert image.tau * image.input_bound == recipes.TAU_TIMES_BOUND
    assert "128 / input_bound" in recipes.recipe((6,), 2, large, 3.0, max_norm=1.0,
                                                  method="clipless").rules["tau"]


def test_rules_follow_the_public_facts():
    digits = recipes.recipe((8, 8), 10, 1437, 3.0, features=None)
    assert digits.batch_size == 256 and digits.delta == 1e-5 and digits.method == "clipless"
    assert digits.width == 0 and digits.epochs == 30 and digits.input_bound == 1.0 / 8
    assert digits.tau * digits.input_bound == 32.0 and digits.loss_clip == math.sqrt(2) / 50
    pixels = dict(features=None, max_norm=8.0)
    assert recipes.recipe((8, 8), 10, 1437, 3.0, **pixels).input_bound == 1.0
    assert recipes.recipe((64,), 10, 1437, 3.0, kind="image", **pixels).input_bound == 1.0
    mnist = recipes.recipe((28, 28, 1), 10, 60000, 3.0, features=None)
    assert mnist.batch_size == 2048 and mnist.delta == 1e-6 and mnist.width == 512
    assert mnist.method == "clipless"
    # features="auto": scattering (then per-example clipping, linear) from 8 x 8 pixels,
    # with the standardised pixels next to it below 12 x 12
    auto = recipes.recipe((28, 28, 1), 10, 60000, 3.0)
    assert (auto.features, auto.method, auto.width, auto.feature_shape) == (
        "scattering", "clipping", 0, (7, 7, 81))
    auto_digits = recipes.recipe((8, 8), 10, 1437, 3.0)
    assert (auto_digits.features, auto_digits.method, auto_digits.feature_shape) == (
        "scattering+pixels", "clipping", (2 * 2 * 81 + 64,))
    assert recipes.recipe((11, 20), 10, 600, 3.0).features == "scattering+pixels"
    assert recipes.recipe((12, 20), 10, 600, 3.0).features == "scattering"
    assert recipes.recipe((7, 28), 10, 600, 3.0).features is None
    assert digits.features is None and digits.feature_shape is None
    flat_digits = recipes.recipe((64,), 10, 1437, 3.0, max_norm=8.0, kind="image")
    assert (flat_digits.image_grid, flat_digits.features) == ((8, 8), "scattering+pixels")
    assert recipes.recipe((49,), 10, 1437, 3.0, max_norm=7.0, kind="image").features is None
    flat = recipes.recipe((784,), 10, 4000, 3.0, max_norm=28.0, kind="image")  # MNIST as columns
    assert (flat.image_grid, flat.features, flat.feature_shape) == ((28, 28), "scattering", (7, 7, 81))
    assert recipes.recipe((3072,), 10, 4000, 3.0, max_norm=56.0, kind="image").features is None
    with pytest.warns(UserWarning, match="kind='image'"):  # 784 = 28²: an image, or a table?
        assert recipes.recipe((784,), 10, 4000, 3.0, max_norm=28.0).features is None  # a table
    scatter_clipless = recipes.recipe((28, 28), 10, 60000, 3.0, method="clipless")
    assert scatter_clipless.width == 0 and scatter_clipless.input_bound == (7 * 7 * 81) ** 0.5 / 8
    clipping = dict(input_shape=(8, 8), nb_classes=10, nb_samples=1437, method="clipping",
                    features=None)
    assert recipes.recipe(target_epsilon=1.0, **clipping).epochs == 50
    assert recipes.recipe(target_epsilon=8.0, **clipping).epochs == 20
    assert recipes.recipe(target_epsilon=0.1, **clipping).epochs == 60
    assert recipes.recipe(target_epsilon=8.0, **clipping).clipping_norm == 0.1
    assert recipes.recipe((30,), 2, 400, 8.0, method="clipping", max_norm=5.0).clipping_norm == 1.0
    small = recipes.recipe((30,), 2, 100, 3.0, feature_range=(0, 1), method="clipless")
    assert small.outputs == 1
    for classes, n in ((2, 100), (2, 10_000), (3, 100)):  # tables: per-example clipping
        table = recipes.recipe((30,), classes, n, 3.0, feature_range=(0, 1))
        outputs = 1 if classes == 2 else classes
        assert (table.method, table.outputs, table.width) == ("clipping", outputs, 128)
    three = recipes.recipe((13,), 3, 133, 3.0, feature_range=(0, 1))  # a table's MLP: 60 epochs
    assert (three.method, three.width, three.clipping_norm, three.epochs) == ("clipping", 64, 1.0, 60)
    large = recipes.recipe((40,), 3, 37500, 8.0, feature_range=(0, 1))
    assert (large.method, large.width, large.epochs) == ("clipping", 128, 60)
    # Adam 0.03 for a table's MLP (chosen on the suite), 0.01 for every other recipe
    assert three.learning_rate == large.learning_rate == 0.03
    assert small.learning_rate == digits.learning_rate == auto.learning_rate == 0.01
    assert recipes.recipe(target_epsilon=1.0, **clipping).learning_rate == 0.01
    assert small.width == 128 and small.epochs == 30  # Clipless: a hidden layer at every size too
    assert recipes.recipe((30,), 2, 100, 3.0, feature_range=(0, 1), method="clipping").width == 128
    assert small.batch_size == 32 and small.delta < 1 / (10 * 100)
    for r in (digits, mnist, small):
        text = r.describe()
        assert all(name in text for name in ("batch_size", "epochs", "learning_rate"))


@pytest.mark.parametrize("facts,why", [
    (dict(input_shape=(6,), max_norm=1.0), "per-example clipping for tables"),
    (dict(input_shape=(8, 8)), "per-example clipping on scattering features"),
    (dict(input_shape=(8, 8), features=None), "Clipless for images without fixed features"),
])
def test_describe_says_when_auto_chose_the_method_and_why(facts, why):
    def method_line(**more):
        r = recipes.recipe(nb_classes=3, nb_samples=1000, target_epsilon=3.0, **facts, **more)
        return next(line for line in r.describe().splitlines() if line.startswith("method = "))

    chosen = method_line()
    assert "chosen automatically (method='auto')" in chosen and why in chosen
    assert "as asked" not in chosen
    method = chosen.split("'")[1]
    asked = method_line(method=method)  # control: the same method, asked explicitly
    assert asked == f"method = {method!r}: as asked"
    features = next(line for line in recipes.recipe(
        nb_classes=3, nb_samples=1000, target_epsilon=3.0, **facts).describe().splitlines()
        if line.startswith("features = "))
    assert ("as given" in features) == ("features" in facts)
    assert ("features='auto'" in features) == ("features" not in facts)


@pytest.mark.parametrize("kwargs,match", [
    (dict(method="clipless2"), "method"),
    (dict(delta=1e-3), "delta"),
    (dict(target_epsilon=0.0), "target_epsilon"),
    (dict(target_epsilon=math.inf), "target_epsilon"),
    (dict(nb_classes=1), "nb_classes"),
    (dict(max_norm=-1.0), "max_norm"),
    (dict(kind="graph"), "kind"),
    (dict(input_shape=(30,)), "max_norm"),  # a table needs its public norm bound
    (dict(features="wavelets"), "features"),
    (dict(input_shape=(64,), kind="table", features="scattering"), "features='scattering'"),
])
def test_bad_facts_are_refused(kwargs, match):
    facts = dict(input_shape=(8, 8), nb_classes=10, nb_samples=1437, target_epsilon=3.0)
    with pytest.raises(ValueError, match=match):
        recipes.recipe(**{**facts, **kwargs})


def test_a_one_dimensional_square_shape_warns_only_when_kind_is_not_given():
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        recipes.recipe((784,), 10, 4000, 3.0, max_norm=14.0, kind="table")
        recipes.recipe((784,), 10, 4000, 3.0, max_norm=28.0, kind="image")
        recipes.recipe((785,), 10, 4000, 3.0, max_norm=28.0)  # not a square
        recipes.recipe((49,), 3, 400, 3.0, max_norm=3.5)  # too small for the image rule
        recipes.recipe((64, 64), 10, 4000, 3.0)  # an image's grid: nothing to ask
    with pytest.warns(UserWarning, match="flattened 8x8 grey image"):
        recipes.recipe((64,), 10, 1437, 3.0, max_norm=8.0)


@pytest.mark.parametrize("method", ["clipless", "clipping"])
def test_the_built_model_reaches_the_target_after_the_recipes_epochs(method):
    r = recipes.recipe((8, 8), 10, 1437, 2.0, method=method, max_norm=8.0)
    model = r.build(seed=0)
    eps, delta = budget.get_eps_delta(model, r.epochs)
    assert 0.995 * 2.0 <= eps <= 2.0 and delta == r.delta
    assert model.dp_parameters.epsilon_max == 2.0
    assert (model.dp_parameters.clipping_norm is not None) == (method == "clipping")
    assert model.dataset_metadata.batch_size == r.batch_size
    assert model.output_shape[-1] == 10


@pytest.mark.parametrize("nb_samples", [1437, 20000])  # linear, and one hidden layer
def test_the_clipless_recipe_bounds_every_examples_gradient_and_the_bound_is_tight(nb_samples):
    """Measured per-example gradient norms of the recipe's Clipless model (centring,
    projection onto max_norm/8, loss-gradient clip) against its bounds: never above,
    and the largest reaches 90 % of its bound (every logit gradient is clipped to C,
    so the bound is nearly attained). Negative control:
    the same check against half the bounds finds the violation."""
    import numpy as np

    import kdp
    from kdp.autodiff import per_example_gradients
    from kdp.pipeline import load_digits

    (x, y), _, md = load_digits()
    r = recipes.recipe(md.input_shape, md.nb_classes, nb_samples, 3.0, 1e-5, method="clipless",
                       max_norm=md.max_norm, kind="image", features=None)
    model = r.build(seed=0)
    x, y = x[:64] * 1.0, y[:64]
    bounds = kdp.compute_gradient_bounds(model)
    grads = per_example_gradients(model, model.loss, x, y)
    ratios = np.concatenate([
        np.sqrt((np.asarray(g, "float64").reshape(len(x), -1) ** 2).sum(1)) / bounds[path]
        for path, g in grads.items()])
    assert ratios.max() <= 1 + 1e-4
    assert ratios.max() >= 0.9
    assert (2 * ratios).max() > 1 + 1e-4  # the check would catch a bound twice too small


def _table(rows=256, d=6, seed=0):
    """A binary table in [0, 1]^d whose label depends on two columns."""
    import numpy as np

    rng = np.random.default_rng(seed)
    x = rng.uniform(size=(rows, d)).astype("float32")
    y = (x[:, 0] + 0.5 * x[:, 1] > 0.8).astype("int32")
    return x, y


@pytest.mark.parametrize("head", ["feature_range", "max_norm"])
def test_a_binary_tables_clipless_recipe_keeps_magnitudes_and_bounds_every_gradient(head):
    """The table recipe: no per-row centring, radius the centred box's half diagonal
    (`DP_BoxInput` of ``feature_range``, or `DP_BoundedInput` of ``max_norm`` for
    rows centred beforehand), a bounded bias, one output. Measured per-example
    gradient norms (kernels and bias) never exceed their bounds and reach 90 % of
    them; negative control: half the bounds are exceeded."""
    import numpy as np

    import kdp
    from kdp import layers as L
    from kdp.autodiff import per_example_gradients

    x, y = _table()
    facts = dict(method="clipless")
    if head == "feature_range":
        facts.update(feature_range=(0, 1))
    else:
        x, facts["max_norm"] = x - 0.5, 6 ** 0.5 / 2
    r = recipes.recipe((6,), 2, len(x), 3.0, **facts)
    assert r.kind == "table" and r.outputs == 1 and r.input_bound == pytest.approx(6 ** 0.5 / 2)
    assert r.loss_clip == 1 / 50 and r.tau * r.input_bound == pytest.approx(
        recipes.TAU_TIMES_BOUND_TABLE)
    model = r.build(seed=0)
    kinds = [type(layer) for layer in model.layers]
    assert L.DP_LayerCentering not in kinds and L.DP_AddBias in kinds
    assert (L.DP_BoxInput in kinds) == (head == "feature_range") != (L.DP_BoundedInput in kinds)
    assert model.output_shape[-1] == 1
    bounds = kdp.compute_gradient_bounds(model)
    grads = per_example_gradients(model, model.loss, x[:64], y[:64])
    assert len(grads) == 3  # the hidden and the output kernels, and the bias
    ratios = np.concatenate([
        np.sqrt((np.asarray(g, "float64").reshape(64, -1) ** 2).sum(1)) / bounds[path]
        for path, g in grads.items()])
    assert ratios.max() <= 1 + 1e-4
    assert ratios.max() >= 0.9
    assert (2 * ratios).max() > 1 + 1e-4


@pytest.mark.parametrize("method", ["clipless", "clipping"])
def test_a_declared_column_range_trains_the_same_model_as_rows_centred_beforehand(method):
    """``feature_range=(0, 1)`` on raw rows in [0, 1] and ``max_norm = √d / 2`` on the
    rows moved by ``-1/2`` give the same bounds, noise and sampling, hence the same
    trained model (reproducible noise, one seed); so does ``max_norm = √d`` alone,
    read as ``feature_range=(0, 1)``."""
    import warnings

    import numpy as np

    import kdp

    x, y = _table()
    models = []
    for data, facts in ((x, dict(feature_range=(0, 1))), (x - 0.5, dict(max_norm=6 ** 0.5 / 2)),
                        (x, dict(max_norm=6 ** 0.5))):  # the last: (0, 1) assumed, with a warning
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            r = recipes.recipe((6,), 2, len(x), 3.0, method=method, **facts)
        r.epochs = 2
        model = r.build(seed=0, noise_seed=7)
        model.fit(data, y, epochs=2, verbose=0)
        models.append((model, data))
    (boxed, raw), (centred, shifted), (assumed, _) = models
    np.testing.assert_array_equal(assumed.predict(raw, verbose=0), boxed.predict(raw, verbose=0))
    if method == "clipless":
        assert sorted(kdp.compute_gradient_bounds(boxed).values()) == pytest.approx(
            sorted(kdp.compute_gradient_bounds(centred).values()))
    np.testing.assert_allclose(boxed.predict(raw, verbose=0), centred.predict(shifted, verbose=0),
                               atol=1e-4)
    assert boxed.privacy_spent() == pytest.approx(centred.privacy_spent())


def test_a_table_with_the_uncentred_bound_assumes_unit_columns_and_a_bad_range_is_refused():
    import warnings

    with pytest.warns(UserWarning, match="read as columns in \\[0, 1\\]"):
        assumed = recipes.recipe((6,), 2, 400, 3.0, method="clipless", max_norm=6 ** 0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        r = recipes.recipe((6,), 2, 400, 3.0, method="clipless", feature_range=(0, 1))
        recipes.recipe((6,), 2, 400, 3.0, method="clipless", max_norm=6 ** 0.5 / 2)
        uncentred = recipes.recipe((6,), 2, 400, 3.0, method="clipless", max_norm=6 ** 0.5,
                                   feature_range=False)
    assert (r.max_norm, r.input_bound) == pytest.approx((6 ** 0.5, 6 ** 0.5 / 2))
    assert (assumed.feature_range, assumed.feature_range_assumed) == ((0.0, 1.0), True)
    assert (assumed.max_norm, assumed.input_bound) == pytest.approx((6 ** 0.5, 6 ** 0.5 / 2))
    assert not r.feature_range_assumed
    assert uncentred.feature_range is None and uncentred.input_bound == pytest.approx(6 ** 0.5)
    wide = recipes.recipe((2,), 2, 400, 3.0, method="clipless", feature_range=([-1, 0], [3, 1]))
    assert wide.max_norm == pytest.approx(10 ** 0.5) and wide.input_bound == pytest.approx(
        (4 + 0.25) ** 0.5)
    # a max_norm below the box's: the bound of the centred rows is ||x|| + ||c|| (c = 0 here),
    # and fit checks the rows against it (it is a claim the noise relies on)
    tight = recipes.recipe((6,), 2, 400, 3.0, method="clipless", feature_range=(-1, 1),
                           max_norm=0.5)
    assert tight.input_bound == 0.5
    x, y = _table(400)
    with pytest.raises(ValueError, match="max_norm"):
        tight.build(seed=0).fit(x, y, epochs=1, verbose=0)
    for bad, match in [(dict(feature_range=(0, 1), kind="image", input_shape=(8, 8)), "tables"),
                       (dict(feature_range=1.0), "pair"),
                       (dict(feature_range=(1, 0)), "low < high"),
                       (dict(feature_range=(0, [1, 1])), "does not fit")]:
        with pytest.raises(ValueError, match=match):
            recipes.recipe(**{**dict(input_shape=(6,), nb_classes=2, nb_samples=400,
                                     target_epsilon=3.0), **bad})


@pytest.mark.parametrize("method", ["clipless", "clipping"])
def test_a_binary_table_trains_with_one_output_auroc_and_probabilities(method):
    """One output, AUROC in the logs, and predict_proba = the loss's link of the logits."""
    import numpy as np

    x, y = _table()
    r = recipes.recipe((6,), 2, len(x), 8.0, method=method, feature_range=(0, 1))
    r.epochs = 2
    model = r.build(seed=0)
    assert float(model.optimizer.learning_rate) == pytest.approx(r.learning_rate)
    history = model.fit(x, y, epochs=2, verbose=0)
    assert {"accuracy", "auroc"} <= set(history.history)
    logits = model.predict(x[:16], verbose=0)
    proba = model.predict_proba(x[:16])
    tau = getattr(model.loss, "tau", 1.0)
    np.testing.assert_allclose(proba, 1 / (1 + np.exp(-tau * logits)), rtol=1e-5)
    assert logits.shape == (16, 1) and np.all((proba >= 0) & (proba <= 1))


def test_the_moving_average_rule_and_its_clamp():
    digits = recipes.recipe((8, 8), 10, 1437, 3.0, features=None)
    steps = 30 * 1437 / 256
    assert digits.ema_momentum == pytest.approx(1 - 10 / steps)
    scattering = recipes.recipe((8, 8), 10, 1437, 3.0)  # per-example clipping: 20 epochs
    assert scattering.ema_momentum == pytest.approx(1 - 10 / (20 * 1437 / 256))
    assert recipes.recipe((8, 8), 10, 40, 8.0, features=None).ema_momentum == 0.9  # 37.5 steps
    assert recipes.recipe((8, 8), 10, 10 ** 7, 3.0).ema_momentum == 0.999
    table = recipes.recipe((30,), 2, 4000, 8.0, max_norm=5.0)  # a table's MLP: averaged
    assert table.method == "clipping" and table.epochs == recipes.TABLE_MLP_EPOCHS
    assert table.ema_momentum == pytest.approx(1 - 10 / (60 * 4000 / table.batch_size))
    optimizer = table.build(seed=0).optimizer
    assert optimizer.use_ema and optimizer.ema_momentum == table.ema_momentum
    clipless = recipes.recipe((30,), 2, 4000, 8.0, max_norm=5.0, method="clipless")
    assert clipless.ema_momentum is None  # a Clipless table model: none (leave-one-out)
    assert not clipless.build(seed=0).optimizer.use_ema


def test_a_clipless_recipe_ends_on_its_moving_average_projected_back_onto_the_bounds():
    """Keras averages the updates before their constraints, so its moving average
    of a Lipschitz kernel leaves the unit ball (negative control, measured on the
    optimizer's average); `fit` projects it back: the trained kernel's largest
    singular value is at most 1 and the model differs from the last iterate's
    average only by that projection."""
    import keras
    import numpy as np

    from kdp.pipeline import load_digits

    (x, y), _, md = load_digits()
    r = recipes.recipe(md.input_shape, md.nb_classes, len(x), 3.0, method="clipless",
                       max_norm=md.max_norm, kind="image", features=None)
    r.epochs = 3
    model = r.build(seed=0, noise_seed=0)  # the noise decides whether the average leaves the ball
    assert model.optimizer.use_ema and model.optimizer.ema_momentum == r.ema_momentum
    model.fit(x, y, epochs=3, verbose=0)
    kernel = model.trainable_variables[0]
    average = model.optimizer._model_variables_moving_average[0]
    top = lambda v: np.linalg.svd(keras.ops.convert_to_numpy(v), compute_uv=False)[0]  # noqa: E731
    assert top(kernel) <= 1 + 1e-5
    assert top(average) > 1 + 1e-4  # what Keras left: outside the ball
    assert np.abs(keras.ops.convert_to_numpy(kernel) - keras.ops.convert_to_numpy(average)).max() < 0.05


@pytest.mark.parametrize("method", ["clipping", "clipless"])
def test_a_model_with_a_moving_average_trains_again_after_fit(method):
    """Keras ends `fit` by assigning the average to the weights; under JAX both could
    then hold one array, and the next `fit` fail ("donate the same buffer twice").
    A second `fit` within the budget trains, and every step is recorded."""
    import numpy as np

    from kdp.pipeline import load_digits

    (x, y), _, md = load_digits()
    r = recipes.recipe(md.input_shape, md.nb_classes, len(x), 8.0, method=method,
                       max_norm=md.max_norm, kind="image", features=None)
    r.epochs = 2
    model = r.build(seed=0)
    assert model.optimizer.use_ema
    model.fit(x, y, epochs=1, verbose=0)
    first = [np.array(w) for w in model.get_weights()]
    model.fit(x, y, epochs=1, verbose=0)
    assert any(np.abs(a - b).max() > 0 for a, b in zip(first, model.get_weights()))
    assert model.privacy_ledger.training_steps() == 2 * math.ceil(len(x) / r.batch_size)


def test_overwriting_the_weights_with_their_average_during_training_is_refused():
    import keras
    import numpy as np

    from kdp.bounds import BoundError

    r = recipes.recipe((8, 8), 10, 1437, 3.0, method="clipless", max_norm=8.0, features=None)
    model = r.build(seed=0)
    model.compile(optimizer=keras.optimizers.Adam(1e-2, use_ema=True, ema_overwrite_frequency=5),
                  loss=model.loss)
    x = np.random.default_rng(0).uniform(size=(1437, 8, 8)).astype("float32")
    with pytest.raises(BoundError, match="ema_overwrite_frequency"):
        model.fit(x, np.zeros(1437, "int64"), epochs=1, verbose=0)
    assert model.privacy_ledger.training_steps() == 0


@pytest.mark.parametrize("method", ["clipping", "clipless"])
@pytest.mark.parametrize("path", ["fit", "train_on_batch", "saved"])
def test_rows_outside_an_assumed_box_are_refused_before_anything_is_spent(path, method, tmp_path):
    """``max_norm = √d`` alone assumes columns in [0, 1]: rows outside are refused
    (not clamped) on every training path, also after saving, whichever the
    method; a declared ``feature_range=(0, 1)`` clamps the same rows (the
    negative control)."""
    import warnings

    import keras
    import numpy as np

    from kdp.training.validation import DataValidationError

    x, y = _table()
    outside = x - 0.5  # centred by hand: values in [-0.5, 0.5], norms inside sqrt(6)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = recipes.recipe((6,), 2, len(x), 3.0, max_norm=6 ** 0.5, method=method).build(seed=0)
    if path == "saved":
        model.save(str(tmp_path / "assumed.keras"))
        model = keras.models.load_model(str(tmp_path / "assumed.keras"))
    train = ((lambda: model.train_on_batch(outside[:32], y[:32])) if path == "train_on_batch"
             else (lambda: model.fit(outside, y, epochs=1, verbose=0)))
    with pytest.raises(DataValidationError, match="outside \\[0, 1\\].*feature_range"):
        train()
    assert model.privacy_ledger.training_steps() == 0
    declared = recipes.recipe((6,), 2, len(x), 3.0, feature_range=(0, 1),
                              method=method).build(seed=0)
    declared.fit(outside, y, epochs=1, verbose=0)
    assert declared.privacy_ledger.training_steps() > 0
    model.fit(x, y, epochs=1, verbose=0)  # the rows inside the box train
    assert model.privacy_ledger.training_steps() > 0


def test_a_table_model_with_a_declared_range_saves_and_loads(tmp_path):
    """`DP_BoxInput`'s per-column box survives `.keras` saving (the reloaded model
    predicts the same, and its gradient bounds are the same)."""
    import keras
    import numpy as np

    import kdp

    x, _ = _table()
    low, high = [0.0] * 6, [1.0, 1.0, 2.0, 1.0, 1.0, 3.0]
    model = recipes.recipe((6,), 2, len(x), 3.0, feature_range=(low, high),
                           method="clipless").build(seed=0)
    path = str(tmp_path / "table.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    box = next(layer for layer in loaded.layers if isinstance(layer, kdp.layers.DP_BoxInput))
    assert (box.low, box.high) == (low, high)
    np.testing.assert_allclose(loaded.predict(2 * x, verbose=0), model.predict(2 * x, verbose=0),
                               atol=1e-6)
    assert sorted(kdp.compute_gradient_bounds(loaded).values()) == pytest.approx(
        sorted(kdp.compute_gradient_bounds(model).values()))
