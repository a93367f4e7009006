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
