"""Acceptance tests of the DP layers and of the bound pass.

Every guarantee is checked against an independent measurement that can fail:
per-example gradients by autodiff against `compute_gradient_bounds`, layer
outputs against the propagated norm bounds, exact singular values (SVD of the
kernel or of the full convolution operator) against the certified ``‖W‖₂ ≤ 1``,
and a broken layer that the same check must catch. Runs on the backend that
``KERAS_BACKEND`` selects (TensorFlow and JAX).
"""

import functools
import math

import keras
import numpy as np
import pytest
from keras import ops

import kdp
from kdp import layers as L
from kdp import losses
from kdp.autodiff import compile_function, gradient, per_example_gradients
from kdp.bounds import BoundError, chain_propagate, propagate

RTOL = 1e-4
N_TRAIN, BATCH = 40, 8  # 5 Poisson steps per epoch


# --- models mixing every layer ------------------------------------------------

def mlp_quick():
    return [
        L.DP_BoundedInput((10,), upper_bound=1.0),
        L.DP_QuickSpectralDense(16), L.DP_GroupSort(2),
        L.DP_QuickSpectralDense(16), L.DP_GroupSort(2),
        L.DP_QuickSpectralDense(4),
    ]


def mlp_mixed():
    return [
        L.DP_BoundedInput((12,), upper_bound=2.0),
        L.DP_BoxInput(-0.2, np.linspace(0.1, 0.8, 12)),
        L.DP_SpectralDense(16), L.DP_AddBias(0.5), L.DP_ReLU(), L.DP_LayerCentering(),
        L.DP_Residual([L.DP_QuickSpectralDense(16), L.DP_GroupSort(2)], merge="add"),
        *L.make_residuals("1-lip-add", [L.DP_SpectralDense(16), L.DP_AddBias(0.2), L.DP_GroupSort(4)]),
        L.DP_Reshape((4, 4)), L.DP_QuickSpectralDense(4), L.DP_AddBias(0.3),
        L.DP_LayerCentering("all"), L.DP_Flatten(), L.DP_ClipGradient(0.5),
        L.DP_QuickSpectralDense(3),
    ]


def convnet():
    """Both conv layers with strides 1 and 2, 'same' and 'valid' padding."""
    return [
        L.DP_BoundedInput((10, 10, 2), upper_bound=1.5),
        L.DP_QuickSpectralConv2D(4, 3, strides=1, padding="valid"),  # 10 -> 8
        L.DP_GroupSort(2),
        L.DP_SpectralConv2D(4, 3, strides=1, padding="same"),  # 8 -> 8
        L.DP_LayerCentering("spatial"),
        L.DP_SpectralConv2D(4, 3, strides=2, padding="same"),  # 8 -> 4
        L.DP_AddBias(0.3), L.DP_ReLU(),
        L.DP_Residual([L.DP_QuickSpectralConv2D(4, 3, padding="same"), L.DP_GroupSort(4)],
                      merge="add"),
        L.DP_ScaledL2NormPooling2D(2),  # 4 -> 2
        L.DP_QuickSpectralConv2D(6, 2, strides=2, padding="valid"),  # 2 -> 1
        L.DP_LayerCentering(), L.DP_GroupSort(2), L.DP_ScaledGlobalL2NormPooling2D(),
        L.DP_ClipGradient(0.7), L.DP_SpectralDense(3),
    ]


SEQUENTIAL = {"mlp_quick": mlp_quick, "mlp_mixed": mlp_mixed, "convnet": convnet}


def _dp_kwargs(input_shape, classes):
    return dict(
        dp_parameters=kdp.DPParameters(noise_multiplier=1.0, reproducible=True, seed=0),
        dataset_metadata=kdp.DatasetMetadata(input_shape, classes, N_TRAIN, BATCH),
    )


def make_sequential(name):
    layers = SEQUENTIAL[name]()
    shape = layers[0].example_shape
    model = kdp.DP_Sequential(layers, **_dp_kwargs(shape, layers[-1].units))
    model.build((None,) + shape)
    return model


def make_functional():
    """A graph with fan-out: ``h`` feeds three branches that DP_Add merges."""
    inputs = keras.Input((12,))
    h = L.DP_QuickSpectralDense(16)(L.DP_BoundedInput(upper_bound=2.0)(inputs))
    a = L.DP_AddBias(0.4)(L.DP_QuickSpectralDense(16)(L.DP_GroupSort(2)(h)))
    b = L.DP_ReLU()(h)
    c = L.DP_Add(0.5)([a, b])
    d = L.DP_Add(1.0)([c, h])
    outputs = L.DP_SpectralDense(3)(L.DP_GroupSort(4)(d))
    return kdp.DP_Model(inputs, outputs, **_dp_kwargs((12,), 3))


def make_model(name):
    return make_functional() if name == "functional" else make_sequential(name)


MODELS = list(SEQUENTIAL) + ["functional"]
LOSSES = {
    "mlp_quick": lambda: losses.DP_TauCategoricalCrossentropy(tau=8.0),
    "mlp_mixed": lambda: losses.DP_MulticlassHKR(alpha=2.0, min_margin=0.5),
    "convnet": lambda: losses.DP_MulticlassHKR(alpha=5.0, min_margin=1.0),
    "functional": lambda: losses.DP_TauCategoricalCrossentropy(tau=4.0),
}


def input_shape(model):
    return tuple(model.inputs[0].shape[1:])


def input_bound(model):
    return next(l.upper_bound for l in model._flatten_layers() if isinstance(l, L.DP_BoundedInput))


def random_batch(model, n=BATCH, scale=1.0, seed=0):
    rng = np.random.default_rng(seed)
    x = (scale * rng.normal(size=(n,) + input_shape(model))).astype("float32")
    y = rng.integers(0, model.compute_output_shape((1,) + input_shape(model))[-1], size=n)
    return x, y


def on_sphere(x, radius):
    norms = np.sqrt((x.reshape(len(x), -1) ** 2).sum(1))
    return (x * (radius / norms).reshape((-1,) + (1,) * (x.ndim - 1))).astype("float32")


# --- the soundness check --------------------------------------------------------

def _norms(g):
    g = np.asarray(g)
    return np.sqrt((g.reshape(len(g), -1).astype("float64") ** 2).sum(1))


def gradient_ratios(model, loss, x, y, gradients=per_example_gradients):
    """``{variable.path: per-example ‖∇_v ℓ_i‖ / bound_v}`` (``gradients``:
    `per_example_gradients` or a compiled version of it)."""
    bounds = kdp.compute_gradient_bounds(model, loss)
    grads = gradients(model, loss, x, y)
    assert set(grads) == set(bounds)
    return {p: _norms(g) / bounds[p] for p, g in grads.items()}


def check_soundness(model, loss, x, y, rtol=RTOL, gradients=per_example_gradients):
    """``(largest ratio, [variables whose gradient exceeded its bound])``."""
    ratios = gradient_ratios(model, loss, x, y, gradients)
    worst = max(float(r.max()) for r in ratios.values())
    violations = [p for p, r in ratios.items() if r.max() > 1.0 + rtol]
    return worst, violations


def _gradient_fn(objective):
    """``x ↦ ∇ objective(x)``, compiled once for the ascent's steps (a second-order
    gradient op by op is slow on both backends: on TensorFlow, eager
    `tf.vectorized_map` traces again at every call)."""
    return compile_function(lambda x: gradient(objective, x)[0])


def ascend(model, loss, x, y, steps=3, lr=0.3):
    """Gradient ascent of ``Σ_v Σ_i (‖∇_v ℓ_i‖ / bound_v)²`` on the inputs, keeping
    every input on the sphere of the input bound."""
    radius = input_bound(model)
    bounds = kdp.compute_gradient_bounds(model, loss)

    def objective(xb):
        grads = per_example_gradients(model, loss, xb, y)
        return sum(ops.sum(ops.square(g)) / bounds[p] ** 2 for p, g in grads.items())

    x = on_sphere(x, radius)
    step = _gradient_fn(objective)
    for _ in range(steps):
        d = np.nan_to_num(np.asarray(step(x)))
        x = on_sphere(x + lr * radius * on_sphere(d + 1e-12, 1.0), radius)
    return x


def soundness_report(model, loss, seed=0):
    """Largest ratio and violations over random inputs, inputs far beyond the bound
    (clipped by `DP_BoundedInput`), exactly at the bound, and adversarial ones."""
    x, y = random_batch(model, seed=seed)
    radius = input_bound(model)
    # compiled for the report's four batches (the weights do not change within it)
    compiled = compile_function(lambda xb, yb: per_example_gradients(model, loss, xb, yb))
    check = functools.partial(check_soundness, gradients=lambda m, l, xb, yb: compiled(xb, yb))
    results = [
        check(model, loss, x, y),                          # random
        check(model, loss, 5.0 * x, y),                    # clipped by DP_BoundedInput
        check(model, loss, on_sphere(x, radius), y),       # exactly at the bound
        check(model, loss, ascend(model, loss, x, y), y),  # adversarial
    ]
    return max(r[0] for r in results), sorted({p for r in results for p in r[1]})


def train(model, loss, epochs=10, lr=0.5):
    """Noisy Clipless DP-SGD updates (5 per epoch) through the model's own `fit`
    (the kernel constraints project after every update)."""
    model.compile(optimizer=keras.optimizers.SGD(learning_rate=lr), loss=loss)
    x, y = random_batch(model, n=N_TRAIN, seed=1)
    model.fit(x, y, epochs=epochs, verbose=0)
    return int(model.optimizer.iterations)


@functools.lru_cache(maxsize=None)
def soundness_run(name):
    """Soundness of ``name`` at initialisation and after ≥ 50 large updates (cached:
    the "not vacuous" test reads the same run)."""
    keras.utils.set_random_seed(0)
    model, loss = make_model(name), LOSSES[name]()
    before = {v.path: np.array(v) for v in model.trainable_variables}
    init = soundness_report(model, loss)
    steps = train(model, loss)
    moved = max(np.abs(np.array(v) - before[v.path]).max() for v in model.trainable_variables)
    trained = soundness_report(model, loss, seed=2)
    return {"init": init, "trained": trained, "steps": steps, "moved": moved, "model": model}


@pytest.mark.parametrize("name", MODELS)
def test_gradient_bounds_are_sound(name):
    run = soundness_run(name)
    (worst, bad), (worst_after, bad_after) = run["init"], run["trained"]
    print(f"{name}: largest ratio grad/bound {worst:.4f} at init, {worst_after:.4f} after "
          f"{run['steps']} updates")
    assert not bad, f"{name} at init: gradients above their bounds for {bad} (ratio {worst})"
    assert run["steps"] >= 50 and run["moved"] > 0.1, "training did not move the weights"
    assert not bad_after, f"{name} after training: gradients above bounds for {bad_after} ({worst_after})"


def test_bounds_are_not_vacuous():
    run = soundness_run("mlp_quick")
    assert not run["init"][1] and not run["trained"][1]
    worst = max(run["init"][0], run["trained"][0])
    print(f"mlp_quick: largest observed grad-norm / bound = {worst:.4f} "
          f"(init {run['init'][0]:.4f}, trained {run['trained'][0]:.4f})")
    assert worst >= 0.2


@L.base.serializable
class _TripledDense(L.DP_QuickSpectralDense):
    """Broken on purpose: the kernel is used ×3 and never projected, and the
    bounds of a 1-Lipschitz dense layer are restated for this call."""

    propagate_inputs = L.DP_QuickSpectralDense.propagate_inputs
    backpropagate_inputs = L.DP_QuickSpectralDense.backpropagate_inputs
    backpropagate_params = L.DP_QuickSpectralDense.backpropagate_params

    def build(self, input_shape):
        super().build(input_shape)
        self.kernel.constraint = None

    def call(self, inputs):
        return ops.matmul(inputs, 3.0 * self.kernel)


def test_negative_control_broken_layer_is_caught():
    model = kdp.DP_Sequential([
        L.DP_BoundedInput((10,), upper_bound=1.0),
        L.DP_QuickSpectralDense(16), L.DP_GroupSort(2),
        _TripledDense(16), L.DP_GroupSort(2), L.DP_QuickSpectralDense(4),
    ], **_dp_kwargs((10,), 4))
    model.build((None, 10))
    loss = losses.DP_TauCategoricalCrossentropy(tau=8.0)
    x, y = random_batch(model)
    worst, bad = check_soundness(model, loss, on_sphere(x, 1.0), y)
    print(f"negative control: largest ratio {worst:.3f}, violations {bad}")
    assert bad, "a ×3 kernel without projection went unnoticed"
    assert worst > 1.5


class _ShiftOnly(L.DP_BoxInput):
    """Broken on purpose: moves the inputs by the box's centre without clamping them."""

    def call(self, inputs):
        return inputs - ops.cast((self._low + self._high) / 2.0, inputs.dtype)


def _box_check(layer, low, high, rng):
    """``(largest output norm / stated bound, the corners' norm / stated bound)``
    over inputs inside, on the corners of, and far outside the box."""
    d = len(high)
    corners = np.where(rng.random((64, d)) < 0.5, low, high)
    inside = low + (high - low) * rng.random((64, d))
    outside = 10.0 * rng.normal(size=(64, d))
    x = np.concatenate([inside, corners, outside]).astype("float32")
    bound = layer.propagate_inputs(None)
    return _norms(layer(x)).max() / bound, _norms(layer(corners.astype("float32"))).max() / bound


def test_box_input_centres_and_its_bound_is_the_exact_half_diagonal(rng):
    low, high = -0.5 * np.ones(6), np.array([0.1, 0.2, 0.5, 1.0, 2.0, 4.0])
    layer = L.DP_BoxInput(low, high)
    layer.build((None, 6))
    half_diagonal = float(np.linalg.norm((high - low) / 2))
    assert layer.propagate_inputs(None) == pytest.approx(half_diagonal, rel=1e-12)
    assert layer.propagate_inputs(0.1) == pytest.approx(0.1 + np.linalg.norm((high + low) / 2))
    assert layer.backpropagate_inputs(1.0, 0.7) == 0.7 and layer.backpropagate_params(1.0, 1.0) == {}
    inside = (low + (high - low) * rng.random((5, 6))).astype("float32")
    np.testing.assert_allclose(np.asarray(layer(inside)), inside - (low + high) / 2, atol=1e-6)
    worst, corners = _box_check(layer, low, high, rng)
    assert worst <= 1 + 1e-6 and corners == pytest.approx(1.0, abs=1e-6)  # sound and attained
    # negative control: the same check catches a shift without the clamp
    broken = _ShiftOnly(low, high)
    broken.build((None, 6))
    assert _box_check(broken, low, high, rng)[0] > 2.0


@pytest.mark.parametrize("low,high,match", [
    (1.0, 1.0, "low < high"),
    (0.0, [1.0, -1.0], "low < high"),
    (0.0, np.inf, "finite"),
    ([0.0, 0.0], [1.0, 1.0, 1.0], "broadcast"),
])
def test_box_input_refuses_a_bad_box(low, high, match):
    with pytest.raises(ValueError, match=match):
        L.DP_BoxInput(low, high)


def test_box_input_refuses_a_box_of_another_shape():
    with pytest.raises(ValueError, match="does not fit"):
        L.DP_BoxInput(0.0, [1.0, 2.0, 3.0]).build((None, 4))


def test_clip_gradient_is_tight_and_sound():
    """The cotangent is clipped per example at ``clip_value``: far above the bound
    without the clip, exactly at it with."""
    clip = 0.05
    model = kdp.DP_Sequential([
        L.DP_BoundedInput((6,), upper_bound=1.0), L.DP_QuickSpectralDense(4),
        L.DP_ClipGradient(clip), L.DP_QuickSpectralDense(3),
    ], **_dp_kwargs((6,), 3))
    model.build((None, 6))
    loss = losses.DP_MulticlassKR()  # gradient norm exactly 1 everywhere
    x, y = random_batch(model)
    ratios = gradient_ratios(model, loss, on_sphere(x, 1.0), y)
    first = model.layers[1].kernel.path
    np.testing.assert_allclose(ratios[first], 1.0, rtol=1e-3)


@pytest.mark.parametrize("group_size", [2, 3])
def test_group_sort_gradient_norm_preserving_at_ties(group_size):
    """At ties (a == b) the Jacobian must stay a permutation: ‖Jᵀg‖ = ‖g‖ exactly
    (min and max taken separately would both route g to the same input)."""
    layer = L.DP_GroupSort(group_size)
    x = np.array([[1.0, 1.0, 1.0, 2.0, 2.0, 0.0]], "float32")
    g = np.array([[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]], "float32")
    (d,) = gradient(lambda t: ops.sum(layer(t) * g), x)
    np.testing.assert_allclose(np.linalg.norm(np.asarray(d)), np.linalg.norm(g), rtol=1e-6)


# --- forward bounds ---------------------------------------------------------------

def _layer_outputs_and_bounds(model):
    """Pairs (layer, sub-model to its output, propagated bound of its output)."""
    if isinstance(model, keras.Sequential):
        out = []
        for i, layer in enumerate(model.layers):
            sub = keras.Sequential(model.layers[: i + 1])
            out.append((layer, sub, chain_propagate(model.layers[: i + 1], None)))
        return out
    from kdp.bounds import _graph_forward

    _, trace = _graph_forward(model, None)
    out = []
    for node, x in trace:
        sub = keras.Model(model.inputs[0], node.output_tensors[0])
        out.append((node.operation, sub, propagate(node.operation, x)))
    return out


@pytest.mark.parametrize("name", MODELS)
def test_forward_bounds(name):
    model = make_model(name)
    x, _ = random_batch(model, scale=3.0)
    xs = np.concatenate([x, on_sphere(x, input_bound(model))])
    for layer, sub, bound in _layer_outputs_and_bounds(model):
        norms = _norms(sub(xs))
        assert norms.max() <= bound * (1 + 1e-5), f"{layer.name}: {norms.max()} > {bound}"


# --- projections ------------------------------------------------------------------

KERNEL_LAYERS = [
    ("dense", lambda: L.DP_SpectralDense(5), (7,)),
    ("quick_dense", lambda: L.DP_QuickSpectralDense(9), (7,)),
    ("conv_s1_same", lambda: L.DP_SpectralConv2D(3, 3, strides=1, padding="same"), (6, 6, 2)),
    ("conv_s2_valid", lambda: L.DP_SpectralConv2D(4, 3, strides=2, padding="valid"), (6, 6, 2)),
    ("quick_conv_s2_same", lambda: L.DP_QuickSpectralConv2D(3, 3, strides=2, padding="same"), (6, 6, 2)),
    ("quick_conv_s1_valid", lambda: L.DP_QuickSpectralConv2D(4, 2, strides=1, padding="valid"), (6, 6, 2)),
]


def operator_norm(layer, shape):
    """Exact largest singular value of the (linear) layer on inputs of ``shape``:
    the SVD of the kernel for dense layers, of the full operator matrix (the layer
    applied to every basis vector) for convolutions."""
    if len(shape) == 1:
        matrix = np.asarray(layer.kernel)
    else:
        n = math.prod(shape)
        basis = np.eye(n, dtype="float32").reshape((n,) + shape)
        matrix = np.asarray(layer(basis)).reshape(n, -1)
    return float(np.linalg.svd(matrix.astype("float64"), compute_uv=False)[0])


@pytest.mark.parametrize("kind,make,shape", KERNEL_LAYERS, ids=[k[0] for k in KERNEL_LAYERS])
def test_projection_certifies_unit_norm(kind, make, shape, rng):
    layer = make()
    layer.build((None,) + shape)
    sigmas = [operator_norm(layer, shape)]
    kernel = layer.kernel
    for scale in (0.01, 0.3, 3.0, 30.0):
        for _ in range(3):  # aggressive updates, each followed by the projection
            noisy = np.asarray(kernel) + scale * rng.normal(size=kernel.shape)
            kernel.assign(kernel.constraint(ops.convert_to_tensor(noisy, "float32")))
            sigmas.append(operator_norm(layer, shape))
    print(f"{kind}: largest singular value {max(sigmas):.7f} (init {sigmas[0]:.7f})")
    assert max(sigmas) <= 1 + 1e-6
    if kind.endswith("dense") and not kind.startswith("quick"):
        # the full projection converges: orthogonal up to its tolerance
        assert min(sigmas) >= 1 - 1e-3


class _UserOrthogonal(keras.initializers.Orthogonal):
    """A user's initializer class (drawn eagerly, not by the compiled program)."""


INITIALIZERS = {
    "orthogonal, int seed": lambda: keras.initializers.Orthogonal(seed=5),
    "glorot, int seed": lambda: keras.initializers.GlorotUniform(seed=7),
    "default orthogonal": lambda: "orthogonal",
    "constant": lambda: keras.initializers.Constant(0.1),
    "user class": lambda: _UserOrthogonal(seed=3),
    "seed generator": lambda: keras.initializers.Orthogonal(seed=keras.random.SeedGenerator(4)),
    "unseeded function": lambda: (lambda shape, dtype=None: keras.random.normal(shape, dtype=dtype)),
}


@pytest.mark.parametrize("name", list(INITIALIZERS))
@pytest.mark.parametrize("make,shape", [(L.DP_QuickSpectralDense, (12,)),
                                        (lambda i, **k: L.DP_QuickSpectralConv2D(i, 3, **k), (5, 5, 4))],
                         ids=["dense", "conv"])
def test_initial_kernel_is_the_certified_projection_of_its_draw(name, make, shape):
    """Every initializer gives a certified kernel, and where the draw can be
    repeated (an integer seed) it is the full projection of that draw."""
    from kdp.layers.constraints import full_projection
    from kdp.layers.dense import FULL_ITERATIONS, FULL_TOLERANCE

    layers = [make(6, kernel_initializer=INITIALIZERS[name]()) for _ in range(2)]
    for layer in layers:
        layer.build((None,) + shape)
        assert operator_norm(layer, shape) <= 1 + 1e-6
    kernels = [np.asarray(layer.kernel) for layer in layers]
    init = layers[0].kernel_initializer
    if isinstance(getattr(init, "seed", None), int):
        full = full_projection(FULL_ITERATIONS, FULL_TOLERANCE, layers[0].kernel.constraint.scale)
        w = init(kernels[0].shape, "float32")
        expected = np.asarray(full(ops.reshape(w, (-1, kernels[0].shape[-1])))).reshape(kernels[0].shape)
        np.testing.assert_allclose(kernels[0], expected, atol=1e-6)
    if name == "default orthogonal":  # two layers, two seeds: two kernels
        assert not np.allclose(kernels[0], kernels[1])


# --- serialization ------------------------------------------------------------------

SINGLE_LAYERS = [
    (lambda: L.DP_BoundedInput((5,), upper_bound=0.7), (5,)),
    (lambda: L.DP_BoxInput([-1.0, 0.0, 0.0, 2.0, 0.5], 3.0), (5,)),
    (lambda: L.DP_SpectralDense(4, nm_coef=2.0), (5,)),
    (lambda: L.DP_QuickSpectralDense(6), (5,)),
    (lambda: L.DP_SpectralConv2D(3, 3, strides=2, padding="valid"), (6, 6, 2)),
    (lambda: L.DP_QuickSpectralConv2D(3, (3, 2), strides=(1, 2), padding="same"), (6, 6, 2)),
    (lambda: L.DP_GroupSort(2), (6,)),
    (lambda: L.DP_GroupSort(3), (6,)),
    (lambda: L.DP_ReLU(), (6,)),
    (lambda: L.DP_ScaledL2NormPooling2D(2), (6, 6, 2)),
    (lambda: L.DP_ScaledGlobalL2NormPooling2D(), (6, 6, 2)),
    (lambda: L.DP_Flatten(), (6, 6, 2)),
    (lambda: L.DP_Reshape((2, 3)), (6,)),
    (lambda: L.DP_LayerCentering("spatial"), (6, 6, 2)),
    (lambda: L.DP_AddBias(0.5), (6, 6, 2)),
    (lambda: L.DP_ClipGradient(0.3), (6,)),
    (lambda: L.DP_Residual([L.DP_QuickSpectralDense(6), L.DP_GroupSort(2)], merge="add"), (6,)),
]


@pytest.mark.parametrize("make,shape", SINGLE_LAYERS, ids=lambda v: getattr(v, "__name__", None) if callable(v) else str(v))
def test_layer_config_round_trip(make, shape, rng):
    layer = make()
    x = rng.normal(size=(3,) + shape).astype("float32")
    layer.build((None,) + shape)
    for v in layer.weights:  # non-trivial weights (a bias of zeros proves nothing)
        v.assign(v.constraint(np.asarray(v) + 0.3) if v.constraint else np.asarray(v) + 0.3)
    clone = type(layer).from_config(layer.get_config())
    clone.build((None,) + shape)
    clone.set_weights(layer.get_weights())
    assert type(clone) is type(layer)
    np.testing.assert_allclose(np.asarray(clone(x)), np.asarray(layer(x)), rtol=1e-6, atol=1e-6)
    assert clone.propagate_inputs(2.0) == layer.propagate_inputs(2.0)
    assert clone.backpropagate_inputs(2.0, 1.5) == layer.backpropagate_inputs(2.0, 1.5)


@pytest.mark.parametrize("name", ["convnet", "mlp_mixed", "functional"])
def test_model_save_load(name, tmp_path):
    model, loss = soundness_run(name)["model"], LOSSES[name]()  # trained and compiled
    x, _ = random_batch(model, seed=5)
    path = tmp_path / f"{name}.keras"
    model.save(path)
    loaded = keras.models.load_model(path)
    assert type(loaded) is type(model)
    np.testing.assert_allclose(np.asarray(loaded(x)), np.asarray(model(x)), rtol=1e-5, atol=1e-6)
    bounds = kdp.compute_gradient_bounds(model, loss)
    loaded_bounds = kdp.compute_gradient_bounds(loaded, loss)
    assert len(bounds) == len(loaded_bounds)
    assert sorted(bounds.values()) == pytest.approx(sorted(loaded_bounds.values()))


# --- clear errors ---------------------------------------------------------------------

@pytest.mark.parametrize("bad", [
    lambda: keras.layers.Dense(4, name="plain_dense"),
    lambda: keras.layers.BatchNormalization(name="batch_norm"),
    lambda: keras.layers.Dropout(0.1, name="dropout"),
])
def test_unsupported_layer_is_named(bad):
    layer = bad()
    for model in (
        keras.Sequential([L.DP_BoundedInput((4,), 1.0), L.DP_QuickSpectralDense(4), layer,
                          L.DP_QuickSpectralDense(2)]),
        _functional_with(layer),
    ):
        model.build((None, 4))
        with pytest.raises(BoundError, match=layer.name):
            kdp.compute_gradient_bounds(model, losses.DP_MulticlassKR())


def _functional_with(layer):
    inputs = keras.Input((4,))
    h = L.DP_QuickSpectralDense(4)(L.DP_BoundedInput(upper_bound=1.0)(inputs))
    return keras.Model(inputs, L.DP_QuickSpectralDense(2)(layer(h)))


def test_loss_without_lipschitz_constant_is_refused():
    model = make_model("mlp_quick")
    with pytest.raises(BoundError, match="get_L"):
        kdp.compute_gradient_bounds(model, keras.losses.CategoricalCrossentropy())


def test_missing_input_bound_is_refused():
    model = keras.Sequential([keras.Input((4,)), L.DP_QuickSpectralDense(2)])
    with pytest.raises(BoundError, match="input norm bound"):
        kdp.compute_gradient_bounds(model, losses.DP_MulticlassKR())
    assert kdp.compute_gradient_bounds(model, losses.DP_MulticlassKR(), input_bound=3.0)


# --- bounds must be stated, never assumed ------------------------------------------------

class _Times10(L.DPLayer, keras.layers.Layer):
    """×10 with no bounds stated: the bound pass must not take it for the identity."""

    def call(self, inputs):
        return 10.0 * inputs


class _StatedTimes10(_Times10):
    """The same ×10 with its bounds stated."""

    def propagate_inputs(self, input_bound):
        return 10.0 * input_bound

    def backpropagate_inputs(self, input_bound, gradient_bound):
        return 10.0 * gradient_bound

    def backpropagate_params(self, input_bound, gradient_bound):
        return {}


class _ReLUTimes10(L.DP_ReLU):
    """Redefines the call of an opted-in layer and keeps its (identity) bounds."""

    def call(self, inputs):
        return 10.0 * super().call(inputs)


def _replaced_call(name):
    layer = L.DP_ReLU(name=name)
    layer.call = lambda inputs: 10.0 * inputs
    return layer


def _scaled_stack(layer):
    model = kdp.DP_Sequential([
        L.DP_BoundedInput((6,), upper_bound=1.0), L.DP_QuickSpectralDense(6), layer,
        L.DP_QuickSpectralDense(3),
    ], **_dp_kwargs((6,), 3))
    model.build((None, 6))
    return model


@pytest.mark.parametrize("make", [
    lambda: _Times10(name="times10"),
    lambda: _ReLUTimes10(name="times10"),
    lambda: _replaced_call("times10"),
], ids=["no_bounds", "call_redefined", "call_replaced"])
def test_layer_without_stated_bounds_is_refused(make):
    model = _scaled_stack(make())
    with pytest.raises(BoundError, match="times10"):
        kdp.compute_gradient_bounds(model, losses.DP_MulticlassKR())
    with pytest.raises(BoundError, match="times10"):
        kdp.lipschitz_constant(model)


def test_stated_bounds_of_a_scaling_layer_are_sound():
    model = _scaled_stack(_StatedTimes10())
    loss = losses.DP_MulticlassKR()
    x, y = random_batch(model)
    worst, bad = check_soundness(model, loss, on_sphere(x, 1.0), y)
    assert not bad and worst > 0.5, (worst, bad)
    assert kdp.lipschitz_constant(model) == pytest.approx(10.0)


class _Sequential10(keras.Sequential):
    def call(self, inputs, training=None, mask=None):
        return 10.0 * super().call(inputs, training=training, mask=mask)


class _Functional10(keras.Model):
    def call(self, inputs, training=None, mask=None):
        return 10.0 * super().call(inputs, training=training, mask=mask)


@pytest.mark.parametrize("kind", ["sequential", "functional", "nested"])
def test_model_with_its_own_call_is_refused(kind):
    layers = [L.DP_BoundedInput((4,), 1.0), L.DP_QuickSpectralDense(3)]
    if kind == "functional":
        inputs = keras.Input((4,))
        model = _Functional10(inputs, layers[1](layers[0](inputs)), name="own_call")
    else:
        model = _Sequential10(layers, name="own_call")
        if kind == "nested":
            model = keras.Sequential([keras.Input((4,)), model])
    model.build((None, 4))
    x = np.ones((1, 4), "float32")
    # the model computes 10× what its layer graph (the bound pass's view) computes
    np.testing.assert_allclose(model(x), 10.0 * np.asarray(keras.Sequential(layers)(x)), rtol=1e-6)
    with pytest.raises(BoundError, match="own_call.*overrides call"):
        kdp.compute_gradient_bounds(model, losses.DP_MulticlassKR())
    with pytest.raises(BoundError, match="own_call"):
        kdp.lipschitz_constant(model)


# --- float32 precision of the projections (TF32 emulated on the CPU) -----------------------

from kdp import lipschitz  # noqa: E402


def _round_to_tf32(x):
    """``x`` rounded to nearest (even) with 10 stored mantissa bits, as TF32 does."""
    bits = ops.view(x, "int32")
    odd = ops.bitwise_and(ops.right_shift(bits, 13), 1)
    return ops.view(ops.bitwise_and(bits + 0x0FFF + odd, -8192), "float32")


def _is_float32(x):
    return keras.backend.standardize_dtype(x.dtype) == "float32"


@pytest.fixture
def emulated_tf32(monkeypatch):
    """The backend's float32 matmuls behave as on an Ampere or later GPU: inputs
    rounded to TF32, accumulation in float32. JAX: unless the product asks for
    ``precision=HIGHEST`` (or the default precision is float32); TensorFlow: while
    TF32 execution is enabled (its default). kdp is told an accelerator is visible."""
    backend = keras.backend.backend()
    if backend == "jax":
        import jax

        original = jax.numpy.matmul

        def full_precision(precision):
            if precision is None:
                return jax.config.jax_default_matmul_precision in ("float32", "highest")
            ps = precision if isinstance(precision, (tuple, list)) else (precision,)
            return all(jax.lax.Precision(p) == jax.lax.Precision.HIGHEST for p in ps)

        def matmul(a, b, *args, precision=None, **kwargs):
            if not full_precision(precision) and _is_float32(a) and _is_float32(b):
                a, b = _round_to_tf32(a), _round_to_tf32(b)
            return original(a, b, *args, precision=precision, **kwargs)

        monkeypatch.setattr(jax.numpy, "matmul", matmul)
    elif backend == "tensorflow":
        import tensorflow as tf

        original = tf.linalg.matmul

        def matmul(a, b, *args, **kwargs):
            a, b = tf.convert_to_tensor(a), tf.convert_to_tensor(b)
            if (tf.config.experimental.tensor_float_32_execution_enabled()
                    and _is_float32(a) and _is_float32(b)):
                a, b = _round_to_tf32(a), _round_to_tf32(b)
            return original(a, b, *args, **kwargs)

        monkeypatch.setattr(tf, "matmul", matmul)
        monkeypatch.setattr(tf.linalg, "matmul", matmul)
        enabled = tf.config.experimental.tensor_float_32_execution_enabled()
        tf.config.experimental.enable_tensor_float_32_execution(True)
    else:
        pytest.skip("TF32 emulation for JAX and TensorFlow only")
    monkeypatch.setattr(lipschitz, "_accelerator_visible", lambda: True, raising=False)
    yield
    if backend == "tensorflow":
        tf.config.experimental.enable_tensor_float_32_execution(enabled)


def _relative_error(product, a, b):
    exact = a.astype("float64") @ b.astype("float64")
    return float(np.abs(np.asarray(product, "float64") - exact).max() / np.abs(exact).max())


def test_precise_matmul_is_float32_accurate_under_tf32(emulated_tf32, rng):
    a = rng.normal(size=(64, 48)).astype("float32")
    b = rng.normal(size=(48, 32)).astype("float32")
    plain = _relative_error(ops.matmul(a, b), a, b)
    precise = _relative_error(lipschitz.precise_matmul(a, b), a, b)
    a_t, b_t = ops.convert_to_tensor(a), ops.convert_to_tensor(b)
    split = _relative_error(lipschitz.split_matmul(a_t, b_t), a, b)
    print(f"relative error under emulated TF32: ops.matmul {plain:.2e}, "
          f"precise_matmul {precise:.2e}, split_matmul {split:.2e}")
    assert plain > 1e-4  # the emulation is on
    assert precise < 1e-6 and split < 1e-6


def _sigma_max(w):
    return float(np.linalg.svd(np.asarray(w, "float64"), compute_uv=False)[0])


def _projected_sigmas(projection, w, times):
    sigmas = []
    for _ in range(times):
        w = projection(w)
        sigmas.append(_sigma_max(w))
    return sigmas


@pytest.mark.parametrize("projection,times", [
    (L.OrthogonalProjection(iterations=1), 5),
    (L.OrthogonalProjection(15, 1e-5), 1),
], ids=["quick_x5", "full"])
def test_projection_certified_under_tf32(projection, times, emulated_tf32, monkeypatch):
    """Under TF32 products the projection leaves ‖W‖₂ above 1 + FLOAT_MARGIN
    (the reproduction); kdp's own products are not affected."""
    w = ops.convert_to_tensor(np.random.default_rng(3).normal(size=(64, 32)), "float32")
    with monkeypatch.context() as m:  # the projection with plain `ops.matmul` products
        m.setattr(lipschitz, "precise_matmul", ops.matmul, raising=False)
        reduced = _projected_sigmas(projection, w, times)
    certified = _projected_sigmas(projection, w, times)
    print(f"σ_max with TF32 products {max(reduced):.7f}, with kdp's products "
          f"{max(certified):.7f} (1 + FLOAT_MARGIN = {1 + lipschitz.FLOAT_MARGIN})")
    assert max(reduced) > 1 + lipschitz.FLOAT_MARGIN
    assert max(certified) <= 1 + lipschitz.FLOAT_MARGIN
