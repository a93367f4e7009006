"""`kdp.recipes`: rules of public facts, and models calibrated to the target."""

import math

import pytest

from kdp import recipes
from kdp.training import budget


def test_rules_follow_the_public_facts():
    digits = recipes.recipe((64,), 10, 1437, 3.0)
    assert digits.batch_size == 256 and digits.delta == 1e-5 and digits.method == "clipless"
    assert digits.width == 0 and digits.epochs == 30 and digits.input_bound == 1.0 / 8
    assert digits.tau * digits.input_bound == 32.0 and digits.loss_clip == math.sqrt(2) / 50
    assert recipes.recipe((64,), 10, 1437, 3.0, max_norm=8.0).input_bound == 1.0
    mnist = recipes.recipe((28, 28, 1), 10, 60000, 3.0)
    assert mnist.batch_size == 2048 and mnist.delta == 1e-6 and mnist.width == 512
    clipping = dict(input_shape=(64,), nb_classes=10, nb_samples=1437, method="clipping")
    assert recipes.recipe(target_epsilon=1.0, **clipping).epochs == 50
    assert recipes.recipe(target_epsilon=8.0, **clipping).epochs == 20
    assert recipes.recipe(target_epsilon=0.1, **clipping).epochs == 60
    assert recipes.recipe(target_epsilon=8.0, **clipping).clipping_norm == 0.1
    small = recipes.recipe((30,), 2, 100, 3.0)
    assert small.batch_size == 32 and small.delta < 1 / (10 * 100)
    for r in (digits, mnist, small):
        text = r.describe()
        assert all(name in text for name in ("batch_size", "epochs", "learning_rate"))


@pytest.mark.parametrize("kwargs,match", [
    (dict(method="clipless2"), "method"),
    (dict(delta=1e-3), "delta"),
    (dict(target_epsilon=0.0), "target_epsilon"),
    (dict(target_epsilon=math.inf), "target_epsilon"),
    (dict(nb_classes=1), "nb_classes"),
    (dict(max_norm=-1.0), "max_norm"),
])
def test_bad_facts_are_refused(kwargs, match):
    facts = dict(input_shape=(64,), nb_classes=10, nb_samples=1437, target_epsilon=3.0)
    with pytest.raises(ValueError, match=match):
        recipes.recipe(**{**facts, **kwargs})


@pytest.mark.parametrize("method", ["clipless", "clipping"])
def test_the_built_model_reaches_the_target_after_the_recipes_epochs(method):
    r = recipes.recipe((64,), 10, 1437, 2.0, method=method, max_norm=8.0)
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
                       max_norm=md.max_norm)
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
