"""`DP_Model.predict_proba` (the loss's link) and class weights above 1 (rescaled, exact)."""

import keras
import numpy as np
import pytest

from kdp import layers as L
from kdp import losses
from kdp.losses.probabilities import output_probabilities
from kdp.model import DP_Sequential, DPParameters
from kdp.training.validation import DataValidationError, normalized_class_weight


def _softmax(z):
    e = np.exp(z - z.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def test_each_likelihood_loss_maps_outputs_with_its_own_link():
    z = np.array([[0.2, -0.1, 0.05], [-0.3, 0.4, 0.0]])
    np.testing.assert_allclose(output_probabilities(losses.DP_TauCategoricalCrossentropy(8.0), z),
                               _softmax(8.0 * z))
    np.testing.assert_allclose(output_probabilities(losses.DP_TauBCE(5.0), z),
                               1 / (1 + np.exp(-5.0 * z)))
    sparse = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    np.testing.assert_allclose(output_probabilities(sparse, z), _softmax(z))
    bce = keras.losses.BinaryCrossentropy(from_logits=True)
    np.testing.assert_allclose(output_probabilities(bce, z), 1 / (1 + np.exp(-z)))
    # negative control: τ matters (a softmax without τ would give miscalibrated probabilities)
    assert not np.allclose(output_probabilities(losses.DP_TauCategoricalCrossentropy(8.0), z),
                           _softmax(z))
    with pytest.raises(TypeError, match="probability"):
        output_probabilities(losses.DP_MulticlassHinge(), z)


def _model(seed=0):
    keras.utils.set_random_seed(seed)
    model = DP_Sequential(
        [keras.Input((4,)), L.DP_BoundedInput(upper_bound=2.0), L.DP_QuickSpectralDense(2),
         L.DP_AddBias(2.0), L.DP_ClipGradient(0.1)],
        dp_parameters=DPParameters(noise_multiplier=1.0, delta=1e-4, reproducible=True, seed=7),
        dataset_metadata=dict(input_shape=(4,), nb_classes=2, nb_samples_train=64,
                              batch_size=16, max_norm=2.0))
    model.compile(optimizer=keras.optimizers.SGD(0.1),
                  loss=losses.DP_TauCategoricalCrossentropy(4.0))
    return model


def test_predict_proba_of_a_model_is_softmax_of_tau_logits():
    model = _model()
    x = np.random.default_rng(0).uniform(size=(8, 4)).astype("float32")
    np.testing.assert_allclose(model.predict_proba(x), _softmax(4.0 * model.predict(x, verbose=0)),
                               rtol=1e-5)


def test_class_weight_above_one_is_rescaled_by_its_largest_value():
    assert normalized_class_weight({0: 1.0, 1: 4.0}) == {0: 0.25, 1: 1.0}
    same = {0: 0.5, 1: 1.0}
    assert normalized_class_weight(same) is same
    with pytest.raises(DataValidationError):
        normalized_class_weight({0: -1.0, 1: 1.0})


def test_a_step_with_class_weights_above_one_is_the_step_with_weights_over_their_max():
    """Same noise seed: class_weight {0: 1, 1: 4} gives exactly the update of
    sample_weight = w / 4 (the sensitivity scaled by w_max = 4, the ledger
    unchanged). Negative control: the raw weights as sample_weight are refused."""
    rng = np.random.default_rng(1)
    x = rng.uniform(size=(16, 4)).astype("float32")
    y = (rng.uniform(size=16) > 0.5).astype("int32")
    a, b = _model(), _model()
    a.train_on_batch(x, y, class_weight={0: 1.0, 1: 4.0})
    b.train_on_batch(x, y, sample_weight=np.where(y == 1, 1.0, 0.25).astype("float32"))
    for va, vb in zip(a.trainable_variables, b.trainable_variables):
        np.testing.assert_allclose(np.asarray(va), np.asarray(vb), rtol=1e-6, atol=1e-7)
    assert a.privacy_ledger.events() == b.privacy_ledger.events()
    c = _model()
    with pytest.raises(DataValidationError, match=r"\[0, 1\]"):
        c.train_on_batch(x, y, sample_weight=np.where(y == 1, 4.0, 1.0).astype("float32"))
