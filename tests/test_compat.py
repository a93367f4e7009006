"""lip-dp code in kdp: each call a lip-dp user would paste is accepted (run
here) or refused with an error that names the kdp replacement (matched here).

Calls are written as lip-dp's README, notebooks and tests write them
(https://github.com/deel-ai/lipdp).
"""

import importlib
import math
import re

import keras
import pytest

import kdp
import kdp.compat
import kdp.pipeline
from kdp import layers, losses
from kdp.callbacks import AdaptiveQuantileClipping
from kdp.pipeline import DatasetMetadata, bound_clip_value, bound_normalize

N, D, B = 120, 16, 30
REFUSED = [name for name in kdp.compat.__all__ if name != "LipDPNameError"]
REFUSAL = (TypeError, ValueError)  # signature refusals: either type, the message is what counts


def metadata(shape=(D,)):
    return DatasetMetadata(input_shape=shape, nb_classes=4, nb_samples_train=N, batch_size=B)


def lipdp_model(stack, shape=(D,), strategy="global"):
    """lip-dp's `DP_Sequential(layers=..., dp_parameters=..., dataset_metadata=...)`."""
    model = kdp.DP_Sequential(
        layers=stack,
        dp_parameters=kdp.DPParameters(noisify_strategy=strategy, noise_multiplier=2.0, delta=1e-5),
        dataset_metadata=metadata(shape),
    )
    model.compile(optimizer=keras.optimizers.SGD(0.01),
                  loss=losses.DP_TauCategoricalCrossentropy(18.0), metrics=["accuracy"])
    return model


def mlp():
    return lipdp_model([
        layers.DP_BoundedInput(input_shape=(D,), upper_bound=1.0),
        layers.DP_QuickSpectralDense(32), layers.DP_GroupSort(2), layers.DP_QuickSpectralDense(4),
    ])


def data(rng):
    return rng.normal(size=(N, D)).astype("float32") / 4, rng.integers(0, 4, N)


# --- names kdp does not define: refused, with a replacement that exists ----------------


def _resolve(dotted):
    """The object a dotted ``kdp.`` / ``keras.`` name designates, or an ImportError."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attribute in parts[cut:]:
            obj = getattr(obj, attribute)
        return obj
    raise ImportError(dotted)


@pytest.mark.parametrize("name", REFUSED)
def test_refused_name_points_to_an_existing_replacement(name):
    refused = getattr(kdp.compat, name)
    with pytest.raises(kdp.compat.LipDPNameError, match=re.escape(name)) as error:
        refused("mnist", batch_size=256)
    pointers = re.findall(r"\b(?:kdp|keras)(?:\.\w+)+", str(error.value))
    assert pointers, f"{name}: the message names no kdp or keras replacement"
    for dotted in pointers:
        _resolve(dotted)
    assert name in refused.__doc__


def test_refused_names_where_lipdp_had_them():
    """deel.lipdp.layers and deel.lipdp.dynamic names, refused in kdp.layers and kdp.callbacks
    (outside their __all__)."""
    lipdp_layers = [name for name in REFUSED if name.startswith("DP_")]
    assert len(lipdp_layers) == 10
    for name in lipdp_layers:
        assert getattr(layers, name) is getattr(kdp.compat, name) and name not in layers.__all__
    name = "LaplaceAdaptiveLossGradientClipping"
    assert getattr(kdp.callbacks, name) is getattr(kdp.compat, name)
    assert name not in kdp.callbacks.__all__


def test_permute_pointer_works():
    """The layer the DP_Permute and DP_GNP_Factory messages tell the user to write."""

    class DP_Permute(layers.DPNormNonIncreasingLayer, keras.layers.Permute):
        pass

    model = lipdp_model([layers.DP_BoundedInput(input_shape=(4, 4), upper_bound=1.0),
                         DP_Permute((2, 1)), layers.DP_Flatten(), layers.DP_QuickSpectralDense(4)],
                        shape=(4, 4))
    assert list(kdp.compute_gradient_bounds(model).values()) == [pytest.approx(math.sqrt(2))]


def test_lipdp_loaders_refused_where_lipdp_had_them():
    with pytest.raises(kdp.compat.LipDPNameError, match="kdp.pipeline.load_mnist"):
        kdp.pipeline.load_and_prepare_images_data(
            "mnist", batch_size=1000, drop_remainder=True, bound_fct=bound_clip_value(20.0))
    with pytest.raises(RuntimeError, match="DatasetMetadata"):
        kdp.pipeline.prepare_tabular_data(None, None, None, None, batch_size=200)
    assert "load_and_prepare_images_data" not in kdp.pipeline.__all__


# --- lip-dp calls that run unchanged -------------------------------------------------


def test_lipdp_readme_model_builds_and_has_bounds():
    """lip-dp's README model, layer for layer (its `"local"` strategy is `"per-layer"`)."""
    model = lipdp_model([
        layers.DP_BoundedInput(input_shape=(8, 8, 1), upper_bound=5.0),
        layers.DP_QuickSpectralConv2D(filters=8, kernel_size=3, kernel_initializer="orthogonal",
                                      strides=1, use_bias=False),
        layers.DP_GroupSort(2),
        layers.DP_ScaledL2NormPooling2D(pool_size=2, strides=2),
        layers.DP_QuickSpectralConv2D(filters=8, kernel_size=3, kernel_initializer="orthogonal",
                                      strides=1, use_bias=False),
        layers.DP_GroupSort(2),
        layers.DP_ScaledL2NormPooling2D(pool_size=2, strides=2),
        layers.DP_Flatten(),
        layers.DP_QuickSpectralDense(16),
        layers.DP_GroupSort(2),
        layers.DP_QuickSpectralDense(4),
    ], shape=(8, 8, 1), strategy="per-layer")
    bounds = kdp.compute_gradient_bounds(model)
    assert len(bounds) == 4 and all(0 < b < math.inf for b in bounds.values())


def test_lipdp_layers_accepted():
    model = lipdp_model([
        layers.DP_BoundedInput(input_shape=(4, 4, 2), upper_bound=1.0),
        layers.DP_SpectralConv2D(4, 3), layers.DP_AddBias(norm_max=1), layers.DP_ReLU(),
        layers.DP_LayerCentering(), layers.DP_ScaledGlobalL2NormPooling2D(),
        layers.DP_Reshape((4,)),
        *layers.make_residuals("1-lip-add", [layers.DP_QuickSpectralDense(4), layers.DP_GroupSort(2)]),
        layers.DP_SpectralDense(4), layers.DP_ClipGradient(math.sqrt(2)),
    ], shape=(4, 4, 2))
    assert len(kdp.compute_gradient_bounds(model)) == len(model.trainable_variables) == 4


@pytest.mark.parametrize("loss,lipschitz", [
    (losses.DP_TauCategoricalCrossentropy(18.0), math.sqrt(2)),
    (losses.DP_TauBCE(tau=20.0), 1.0),
    (losses.DP_MulticlassHinge(min_margin=1.0), 1.0),
    (losses.DP_MulticlassKR(), 1.0),
    (losses.DP_MulticlassHKR(alpha=10.0, min_margin=1.0), 11.0),
    (losses.DP_KCosineSimilarity(K=1.0), 1.0),
    (losses.DP_MeanAbsoluteError(), 1.0),
])
def test_lipdp_losses_accepted(loss, lipschitz):
    assert loss.get_L() == pytest.approx(lipschitz)


def test_lipdp_parameters_metadata_and_bounds_accepted():
    params = kdp.DPParameters("global", 2.0, 1e-5)  # lip-dp's dataclass field order
    assert (params.noisify_strategy, params.noise_multiplier, params.delta) == ("global", 2.0, 1e-5)
    md = DatasetMetadata(input_shape=(28, 28, 1), nb_classes=10, nb_samples_train=60000,
                         nb_samples_test=10000, class_names=[str(i) for i in range(10)],
                         batch_size=1000, max_norm=20.0)
    assert md.steps_per_epoch == 60 and md.sampling_rate == 1000 / 60000
    assert bound_clip_value(20.0)[1] == 20.0 and bound_normalize()[1] == 1.0


def test_lipdp_accounting_calls_accepted(rng):
    model = mlp()
    epochs = kdp.accounting.get_max_epochs(3.0, model, epochs_max=1024)
    assert 0 < epochs <= 1024
    assert kdp.accounting.get_max_epochs(3.0, model, epochs_max=2) == min(2, epochs)
    eps, delta = kdp.accounting.get_eps_delta(model, epochs)
    assert eps <= 3.0 < kdp.accounting.get_eps_delta(model, epochs + 1)[0] and delta == 1e-5
    x, y = data(rng)
    history = model.fit(x, y, epochs=1, verbose=0,
                        callbacks=[kdp.DP_Accountant(log_fn="all"), kdp.DP_Accountant(log_fn="logging")])
    assert history.history["epsilon"][0] > 0


# --- lip-dp calls refused, the error naming the kdp replacement ------------------------


def test_bias_refused_with_pointer():
    with pytest.raises(ValueError, match="DP_AddBias"):
        layers.DP_SpectralDense(10, use_bias=True)


def test_local_strategy_refused_with_pointer():
    with pytest.raises(ValueError, match="per-layer"):
        kdp.DPParameters(noisify_strategy="local", noise_multiplier=4.0, delta=1e-5)


def test_plain_dense_refused_with_pointer(rng):
    model = kdp.DP_Sequential(
        [keras.Input((D,)), keras.layers.Dense(4)],
        dp_parameters=kdp.DPParameters("global", 2.0, 1e-5),
        dataset_metadata=DatasetMetadata((D,), 4, N, B, max_norm=10.0))
    model.compile(optimizer="sgd", loss=losses.DP_TauCategoricalCrossentropy(1.0))
    with pytest.raises(ValueError, match=r"DP_QuickSpectralDense.*clipping_norm"):
        model.fit(*data(rng), epochs=1, verbose=0)


def test_tf_data_refused_with_pointer(rng):
    tf = pytest.importorskip("tensorflow")
    x, y = data(rng)
    ds_train = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(N).batch(B, drop_remainder=True)
    with pytest.raises(ValueError, match=r"NumPy arrays.*sampling='shuffle'"):
        mlp().fit(ds_train, epochs=1, verbose=0)


# --- lip-dp signatures kdp's own names accept, or refuse naming the kdp argument -------


def test_clip_gradient_mode_accepted():
    assert layers.DP_ClipGradient(math.sqrt(2), mode="dynamic").clip_value == pytest.approx(math.sqrt(2))
    assert layers.DP_ClipGradient(math.sqrt(2), "fixed").clip_value == pytest.approx(math.sqrt(2))


def test_clip_gradient_without_value_refused_with_pointer():
    with pytest.raises(REFUSAL, match="get_L"):
        layers.DP_ClipGradient(None, mode="dynamic")


def test_centering_flags_refused_with_pointer():
    with pytest.raises(REFUSAL, match="axes="):
        layers.DP_LayerCentering(pixelwise=False, channelwise=True)


def test_groupsort_n_refused_with_pointer():
    with pytest.raises(REFUSAL, match="group_size"):
        layers.DP_GroupSort(n=2)


def test_bounded_input_enforce_clipping():
    layers.DP_BoundedInput(input_shape=(D,), upper_bound=1.0, enforce_clipping=True)
    with pytest.raises(REFUSAL, match="max_norm"):
        layers.DP_BoundedInput(input_shape=(D,), upper_bound=1.0, enforce_clipping=False)


def test_k_cosine_axis_accepted():
    assert losses.DP_KCosineSimilarity(K=1.0, axis=-1).get_L() == 1.0


def test_metadata_steps_refused_with_pointer():
    with pytest.raises(REFUSAL, match=r"DatasetMetadata\.steps_per_epoch"):
        DatasetMetadata(input_shape=(D,), nb_classes=4, nb_samples_train=N, nb_samples_test=10,
                        class_names=None, nb_steps_per_epochs=N // B, batch_size=B, max_norm=1.0)


def test_sequential_debug():
    stack = [layers.DP_BoundedInput(input_shape=(D,), upper_bound=1.0), layers.DP_QuickSpectralDense(4)]
    kdp.DP_Sequential(layers=stack, dp_parameters=kdp.DPParameters("global", 2.0, 1e-5),
                      dataset_metadata=metadata(), debug=False)
    with pytest.raises(REFUSAL, match="compute_gradient_bounds"):
        kdp.DP_Sequential(layers=list(stack), dp_parameters=kdp.DPParameters("global", 2.0, 1e-5),
                          dataset_metadata=metadata(), debug=True)


def test_model_of_layer_list_refused_with_pointer():
    with pytest.raises(REFUSAL, match="DP_Sequential"):
        kdp.DP_Model([layers.DP_BoundedInput(input_shape=(D,), upper_bound=1.0),
                      layers.DP_QuickSpectralDense(4)],
                     dp_parameters=kdp.DPParameters("global", 2.0, 1e-5), dataset_metadata=metadata())


def test_get_max_epochs_lipdp_signature():
    model = mlp()
    with pytest.raises(REFUSAL, match="epochs_max="):
        kdp.accounting.get_max_epochs(3.0, model, 5)
    assert kdp.accounting.get_max_epochs(3.0, model, epochs_max=5, safe=True) == \
        kdp.accounting.get_max_epochs(3.0, model, epochs_max=5)
    with pytest.raises(REFUSAL, match="safe=True"):
        kdp.accounting.get_max_epochs(3.0, model, safe=False)
    with pytest.raises(REFUSAL, match="exact"):
        kdp.accounting.get_max_epochs(3.0, model, atol=1e-2)


def test_accountant_log_fn_refused_with_pointer():
    for log_fn in ("wandb", print):
        with pytest.raises(REFUSAL, match="logs"):
            kdp.DP_Accountant(log_fn=log_fn)


def test_adaptive_clipping_dataset_refused_with_pointer():
    with pytest.raises(REFUSAL, match="arrays"):
        AdaptiveQuantileClipping(ds_train=None, patience=1, noise_multiplier=2.2, quantile=0.9,
                                 learning_rate=1.0)
