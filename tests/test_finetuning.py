"""`kdp.finetuning`: the recipe follows its stated rules, its σ meets the target ε
with kdp's accountant (and 10% less noise does not), and applying it trains the
part it chose."""

import keras
import numpy as np
import pytest

from kdp.finetuning import FineTuningRecipe, PARTS, fine_tuning_recipe, parameter_counts
from kdp.privacy import compute_epsilon

COUNTS = {"head": 650, "lora": 5_000, "all": 100_000}


def _model():
    inputs = keras.Input((16,))
    hidden = keras.layers.Dense(8, activation="relu", name="h1")(inputs)
    return keras.Model(inputs, keras.layers.Dense(3, name="head")(hidden))


def test_a_smaller_epsilon_never_trains_a_larger_part():
    recipes = [fine_tuning_recipe(2_000, eps, parameters=COUNTS) for eps in (8.0, 2.0, 0.5)]
    ranks = [PARTS.index(r.train) for r in recipes]
    assert ranks == sorted(ranks, reverse=True) and ranks[0] > ranks[-1], ranks
    for r in recipes:               # the largest part whose sigma sqrt(d) / b is at most 1
        fits = [p for p in PARTS if r.noise_multiplier * np.sqrt(COUNTS[p]) / r.batch_size <= 1]
        assert r.train == (fits[-1] if fits else "head")
        assert r.noise_to_signal == pytest.approx(
            r.noise_multiplier * np.sqrt(r.parameters) / r.batch_size)


def test_choices_follow_the_stated_rules():
    r = fine_tuning_recipe(10_000, 3.0, train="all")
    assert isinstance(r, FineTuningRecipe)
    assert r.delta == 1e-6 and r.batch_size == 1024 and r.epochs == 20
    assert r.clipping_norm == 0.1 and r.learning_rate == 1e-2          # Li et al. 2022; kdp
    head = fine_tuning_recipe(10_000, 1.0, train="head")
    assert head.clipping_norm == 1.0 and head.learning_rate == 1e-2 and head.epochs == 50
    with pytest.raises(dataclasses_error()):
        r.train = "head"                                                 # frozen
    with pytest.raises(ValueError, match="parameters"):
        fine_tuning_recipe(1_000, 3.0)                                   # auto needs the counts
    with pytest.raises(ValueError, match="delta"):
        fine_tuning_recipe(1_000, 3.0, delta=1e-2, train="head")


def dataclasses_error():
    import dataclasses

    return dataclasses.FrozenInstanceError


@pytest.mark.parametrize("n, eps", [(627, 1.0), (20_000, 8.0)])
def test_sigma_reaches_the_target_and_ten_percent_less_exceeds_it(n, eps):
    r = fine_tuning_recipe(n, eps, train="head")
    spent = compute_epsilon(r.noise_multiplier, r.sampling_rate, r.steps, r.delta)
    assert spent <= eps * (1 + 1e-9) and spent > 0.98 * eps
    assert compute_epsilon(0.9 * r.noise_multiplier, r.sampling_rate, r.steps, r.delta) > eps


def test_describe_names_each_source():
    text = fine_tuning_recipe(2_000, 2.0, parameters=COUNTS).describe()
    lines = dict(line.split(" = ", 1) for line in text.splitlines())
    assert set(lines) == {"train", "delta", "batch_size", "epochs", "noise_multiplier",
                          "clipping_norm", "learning_rate", "lora_rank"}
    assert "Yu et al. 2022" in lines["train"]
    assert "Li et al. 2022" in lines["clipping_norm"] and "De et al. 2022" in lines["clipping_norm"]
    assert "Sander et al. 2023" in lines["batch_size"]
    assert "kdp default" in lines["epochs"] and "kdp default" in lines["learning_rate"]
    assert "accountant" in lines["noise_multiplier"]


def test_parameter_counts():
    assert parameter_counts(_model()) == {"head": 27, "lora": 27 + 4 * (16 + 8), "all": 136 + 27}


def test_lora_is_no_part_of_a_model_without_dense_layers_outside_its_head():
    """A convnet whose only Dense layer is its head: LoRA would train the head alone, so
    it is not counted (``"auto"`` cannot choose it) and asking for it is refused."""
    inputs = keras.Input((8, 8, 1))
    hidden = keras.layers.Flatten()(keras.layers.Conv2D(4, 3, name="c")(inputs))
    model = keras.Model(inputs, keras.layers.Dense(3, name="head")(hidden))
    counts = parameter_counts(model)
    assert counts == {"head": 6 * 6 * 4 * 3 + 3, "all": 3 * 3 * 4 + 4 + 6 * 6 * 4 * 3 + 3}
    assert fine_tuning_recipe(4096, 8.0, parameters=counts).train in ("head", "all")
    recipe = fine_tuning_recipe(64, 3.0, train="lora")
    with pytest.raises(ValueError, match="no Dense or EinsumDense layer outside its head"):
        recipe.apply(model, keras.losses.SparseCategoricalCrossentropy(from_logits=True))


@pytest.mark.parametrize("part", PARTS)
def test_apply_trains_the_chosen_part(part):
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(64, 16)).astype("float32"), rng.integers(0, 3, 64)
    model = _model()
    before = keras.ops.convert_to_numpy(model.get_layer("h1").weights[0]).copy()
    r = fine_tuning_recipe(64, 3.0, train=part, parameters=parameter_counts(model))
    dp = r.apply(model, keras.losses.SparseCategoricalCrossentropy(from_logits=True), seed=0,
                 reproducible=True)
    assert dp.dp_parameters.noise_multiplier == pytest.approx(r.noise_multiplier, rel=1e-3)
    assert dp.dp_parameters.clipping_norm == r.clipping_norm
    trained = sum(int(np.prod(v.shape)) for v in dp.trainable_variables)
    assert trained == r.parameters
    dp.fit(x, y, epochs=1, verbose=0)
    assert 0 < dp.privacy_spent()[0] <= 3.0
    moved = not np.allclose(keras.ops.convert_to_numpy(model.get_layer("h1").weights[0]), before)
    assert moved == (part == "all")
