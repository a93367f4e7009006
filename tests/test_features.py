"""`DP_ConcatFeatures` (branches side by side) and the recipes' "scattering+pixels" features."""

import math

import keras
import numpy as np
import pytest
from test_normalization import _apply, _norms, per_example_gradients_of_output

import kdp
from kdp import layers as L
from kdp import recipes


def test_the_branches_outputs_are_flattened_side_by_side():
    x = np.random.default_rng(0).normal(2.0, 3.0, size=(3, 4, 4, 2)).astype("float32")
    layer = L.DP_ConcatFeatures([[L.DP_GroupNormalization()], [], [L.DP_Flatten()]])
    y = _apply(layer, x)
    assert y.shape == (3, 3 * 32)
    np.testing.assert_allclose(y[:, :32], _apply(L.DP_GroupNormalization(), x).reshape(3, -1),
                               atol=1e-5)
    np.testing.assert_allclose(y[:, 32:64], x.reshape(3, -1))
    np.testing.assert_allclose(y[:, 64:], x.reshape(3, -1))


def test_the_output_norm_bound_adds_the_branches_squares_and_is_reached():
    """``X_out = √(n + X²)`` for a normalisation (``√n``) next to the input itself
    (``X``), reached within 1e-4 by a large-variance input of norm ``X``; negative
    control: the same outputs exceed a bound 1 % smaller."""
    layer = L.DP_ConcatFeatures([[L.DP_GroupNormalization(groups=1)], []])
    keras.Sequential([keras.Input((6, 6)), layer])
    x = np.random.default_rng(1).normal(size=(64, 6, 6))
    x *= 5.0 / _norms(x)[:, None, None]
    bound = layer.propagate_inputs(5.0)
    assert bound == pytest.approx(math.sqrt(36 + 25))
    measured = _norms(_apply(layer, x.astype("float32"))).max()
    assert bound * (1 - 1e-4) <= measured <= bound * (1 + 1e-5)
    assert measured > 0.99 * bound


def test_the_input_cotangents_of_the_branches_add():
    """``G_in = Σ_b G_in,b``: two copies of the input receive the same cotangent
    slice, so ``Jᵀg = 2 g_1``; with ``‖g‖ = 1`` that is √2, 0.71 of the bound 2
    (measured by autodiff); negative control: the cotangent of one branch (1)
    is exceeded."""
    layer = L.DP_ConcatFeatures([[], []])
    model = keras.Sequential([keras.Input((5,)), layer])
    rng = np.random.default_rng(2)
    x = rng.normal(size=(8, 5)).astype("float32")
    half = rng.normal(size=(8, 5))
    g = np.concatenate([half, half], axis=1)
    g /= _norms(g)[:, None]
    cot = per_example_gradients_of_output(model, x, g.astype("float32"))
    assert layer.backpropagate_inputs(1.0, 1.0) == 2.0
    assert _norms(cot).max() <= 2.0 * (1 + 1e-6)
    assert _norms(cot).min() == pytest.approx(math.sqrt(2), rel=1e-5)
    assert _norms(cot).max() > 1.0 + 1e-3


def test_a_trainable_branch_keeps_its_weights_and_its_parameter_bound():
    """A dense branch next to the input: the model trains its kernel, and the
    bound pass gives it the bound it has in a plain chain (the branch's output
    cotangent is a slice of ``G``)."""
    branch = L.DP_QuickSpectralDense(3, name="dense_branch")
    model = keras.Sequential([keras.Input((6,)), L.DP_BoundedInput(upper_bound=2.0),
                              L.DP_ConcatFeatures([[branch], []]), L.DP_QuickSpectralDense(2)])
    assert branch.kernel in model.trainable_weights and len(model.trainable_weights) == 2
    plain = keras.Sequential([keras.Input((6,)), L.DP_BoundedInput(upper_bound=2.0),
                              L.DP_QuickSpectralDense(3, name="alone")])
    inner = model.layers[1].backpropagate_params(2.0, 1.0)
    assert inner[branch.kernel.path] == pytest.approx(
        kdp.bounds.backpropagate(plain, 2.0, 1.0)[1][plain.layers[-1].kernel.path])


def test_config_round_trip(tmp_path):
    layer = L.DP_ConcatFeatures([[L.DP_Scattering2D(J=1, L=4), L.DP_GroupNormalization()],
                                 [L.DP_GroupNormalization(groups=1)]], name="views")
    model = keras.Sequential([keras.Input((8, 8)), layer])
    model.save(tmp_path / "m.keras")
    loaded = keras.saving.load_model(tmp_path / "m.keras")
    x = np.random.default_rng(3).uniform(size=(2, 8, 8)).astype("float32")
    np.testing.assert_allclose(keras.ops.convert_to_numpy(loaded(x)),
                               keras.ops.convert_to_numpy(model(x)), atol=1e-5)
    assert [len(b) for b in loaded.layers[0].branches] == [2, 1]
    with pytest.raises(ValueError, match="at least one branch"):
        L.DP_ConcatFeatures([])


@pytest.mark.parametrize("input_shape", [(8, 8), (64,)])
def test_the_recipes_pixel_features_are_the_scattering_features_and_the_standardised_pixels(
        input_shape):
    """``features="scattering+pixels"``: the extractor's output is, per example,
    the flattened output of the scattering recipe's extractor followed by the
    pixels standardised as one group (computed here in numpy); its norm stays
    within the recipe's ``√n``; auto uses it below 12 pixels a side."""
    kind = dict(kind="image") if input_shape == (64,) else {}
    r = recipes.recipe(input_shape, 10, 1000, 3.0, max_norm=8.0,
                       features="scattering+pixels", **kind)
    assert (r.method, r.width, r.feature_shape) == ("clipping", 0, (2 * 2 * 81 + 64,))
    x = np.random.default_rng(4).uniform(size=(6, *input_shape)).astype("float32")
    got = r.feature_extractor().predict(x, verbose=0)
    scattering = recipes.recipe(input_shape, 10, 1000, 3.0, max_norm=8.0, features="scattering",
                                **kind).feature_extractor().predict(x, verbose=0)
    pixels = x.reshape(6, -1) - x.reshape(6, -1).mean(1, keepdims=True)
    pixels /= np.sqrt((pixels ** 2).mean(1, keepdims=True) + 1e-5)
    np.testing.assert_allclose(got, np.concatenate([scattering.reshape(6, -1), pixels], 1),
                               atol=1e-4)
    assert _norms(got).max() <= math.sqrt(r.feature_shape[0])
    assert r.metadata(on_features=True).max_norm == math.sqrt(r.feature_shape[0])
    model = r.build(seed=0)
    assert model.output_shape == (None, 10)
    assert recipes.recipe(input_shape, 10, 1000, 3.0, max_norm=8.0, **kind).features == (
        "scattering+pixels")
