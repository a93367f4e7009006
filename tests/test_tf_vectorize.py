"""TensorFlow's vectorization of a batch-times-matrix product and of the max-pooling
gradient (`kdp._tf_vectorize`): the same numbers as a loop over the examples,
TensorFlow's own conversion restored afterwards, and, where this CPU's oneDNN aborts on the broadcast
product that ``pfor`` makes, kdp's per-example gradients of an ``EinsumDense``
model run to the end."""

import keras
import numpy as np
import pytest

from kdp import _tf_vectorize
from kdp._tf_vectorize import vectorization

pytestmark = pytest.mark.skipif(keras.backend.backend() != "tensorflow",
                                reason="TensorFlow's pfor conversion")


def _registry():
    from tensorflow.python.ops.parallel_for import pfor

    return pfor._pfor_converter_registry


def _counted(monkeypatch, converter):
    """Wraps kdp's converter named ``converter``; returns the list its calls append to."""
    calls = []
    convert = getattr(_tf_vectorize, converter)
    monkeypatch.setattr(_tf_vectorize, converter, lambda p: calls.append(1) or convert(p))
    return calls


@pytest.mark.parametrize("example, weight, adjoint", [
    ((1, 6, 4), (4, 3), False), ((1, 6, 4), (3, 4), True), ((2, 1, 6, 4), (4, 3), False),
    ((1, 6, 4), (1, 4, 3), False), ((6, 4), (1, 1, 4, 3), False),  # unit batch axes
    ((2, 6, 4), (2, 4, 3), False)])  # a batch of matrices: TensorFlow's own conversion
def test_per_example_products_and_gradients_match_a_loop(example, weight, adjoint, monkeypatch):
    import tensorflow as tf

    rng = np.random.default_rng(0)
    x = tf.constant(rng.normal(size=(5, *example)), "float32")
    w = tf.constant(rng.normal(size=weight), "float32")
    calls = _counted(monkeypatch, "_convert_batch_matmul")

    def one(xi):
        with tf.GradientTape() as tape:
            tape.watch(w)
            out = tf.matmul(xi, w, adjoint_b=adjoint)
            value = tf.reduce_sum(tf.sin(out))
        return out, tape.gradient(value, w)

    with vectorization():
        out, grads = tf.function(lambda x: tf.vectorized_map(one, x))(x)
    loop = [one(x[i]) for i in range(5)]
    np.testing.assert_allclose(out, np.stack([o for o, _ in loop]), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(grads, np.stack([g for _, g in loop]), rtol=1e-5, atol=1e-6)
    assert calls  # the conversion went through the replacement


@pytest.mark.parametrize("example, pool, strides, padding", [
    ((1, 6, 6, 3), 2, 2, "VALID"), ((1, 7, 5, 2), 3, 2, "SAME"), ((2, 5, 5, 1), 2, 1, "VALID"),
    ((1, 5, 6, 2), 2, 2, [[0, 0], [1, 0], [0, 1], [0, 0]])])  # explicit padding
def test_per_example_max_pooling_gradients_match_a_loop(example, pool, strides, padding, monkeypatch):
    import tensorflow as tf

    rng = np.random.default_rng(1)
    x = tf.constant(rng.normal(size=(4, *example)), "float32")
    calls = _counted(monkeypatch, "_convert_max_pool_grad")

    def one(xi):
        with tf.GradientTape() as tape:
            tape.watch(xi)
            value = tf.reduce_sum(tf.sin(3.0 * tf.nn.max_pool2d(xi, pool, strides, padding)))
        return tape.gradient(value, xi)

    with vectorization():
        grads = tf.function(lambda x: tf.vectorized_map(one, x))(x)
    np.testing.assert_allclose(grads, np.stack([one(x[i]) for i in range(4)]), rtol=1e-5, atol=1e-6)
    assert calls  # the conversion went through the replacement


@pytest.mark.parametrize("example, kernel, strides, padding, per_example_kernel", [
    ((1, 6, 6, 3), (3, 3, 3, 2), 1, "VALID", False), ((2, 7, 5, 2), (2, 3, 2, 1), 2, "SAME", False),
    ((1, 6, 6, 3), (3, 3, 3, 2), 1, "VALID", True)])  # a kernel per example: TensorFlow's own
def test_per_example_depthwise_convolutions_and_input_gradients_match_a_loop(
        example, kernel, strides, padding, per_example_kernel, monkeypatch):
    import tensorflow as tf

    rng = np.random.default_rng(2)
    x = tf.constant(rng.normal(size=(4, *example)), "float32")
    w = tf.constant(rng.normal(size=((4,) if per_example_kernel else ()) + kernel), "float32")
    calls = _counted(monkeypatch, "_convert_depthwise")

    def one(xi, wi):
        with tf.GradientTape() as tape:
            tape.watch(xi)
            out = tf.nn.depthwise_conv2d(xi, wi, (1, strides, strides, 1), padding)
            value = tf.reduce_sum(tf.sin(out))
        return out, tape.gradient(value, xi)

    with vectorization():
        if per_example_kernel:
            out, grads = tf.function(lambda x, w: tf.vectorized_map(lambda a: one(*a), (x, w)))(x, w)
        else:
            out, grads = tf.function(lambda x: tf.vectorized_map(lambda xi: one(xi, w), x))(x)
    loop = [one(x[i], w[i] if per_example_kernel else w) for i in range(4)]
    np.testing.assert_allclose(out, np.stack([o for o, _ in loop]), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(grads, np.stack([g for _, g in loop]), rtol=1e-5, atol=1e-5)
    assert len(calls) == 2  # the convolution and its input gradient went through the replacement


def test_tensorflows_conversion_is_restored_after_nested_uses_and_errors():
    original = {op: _registry()[op] for op in _tf_vectorize._CONVERTERS}
    assert set(original) == {"BatchMatMulV2", "MaxPoolGrad", "DepthwiseConv2dNative",
                             "DepthwiseConv2dNativeBackpropInput"}

    def replaced():
        return all(_registry()[op] is convert for op, convert in _tf_vectorize._CONVERTERS.items())

    with vectorization():
        with vectorization():
            assert replaced()
        assert replaced()
    assert {op: _registry()[op] for op in original} == original
    with pytest.raises(RuntimeError, match="inside"):
        with vectorization():
            raise RuntimeError("inside")
    assert {op: _registry()[op] for op in original} == original
    assert _tf_vectorize._FILTER not in __import__("logging").getLogger("tensorflow").filters


def _vectorize_a_random_op_and_an_unconverted_op():
    """Vectorizes per-example dropout-like noise (random ops) and an op pfor loops over
    (a string join), and returns the ops pfor said it loops over."""
    import logging

    import tensorflow as tf

    said = []

    class Record(logging.Handler):
        def emit(self, record):
            said.append(record.getMessage())

    handler = Record(level=logging.WARNING)
    logger = logging.getLogger("tensorflow")
    logger.addHandler(handler)
    try:
        def one(xi):
            seed = tf.cast(xi[:2], "int32")  # a seed per example, as kdp gives random layers
            noise = tf.random.stateless_uniform(tf.shape(xi), seed=seed)
            return xi * noise, tf.strings.reduce_join(tf.strings.as_string(xi))

        with vectorization():
            tf.vectorized_map(one, tf.reshape(tf.range(12.0), (4, 3)), fallback_to_while_loop=True)
        inside = list(said)
        said.clear()
        tf.vectorized_map(one, tf.reshape(tf.range(12.0), (4, 3)), fallback_to_while_loop=True)
    finally:
        logger.removeHandler(handler)
    ops = lambda messages: {m.split(" ")[5] for m in messages if m.startswith("Using a while_loop")}
    return ops(inside), ops(said)


def test_loop_warnings_for_random_ops_are_dropped_and_others_kept():
    inside, outside = _vectorize_a_random_op_and_an_unconverted_op()
    random_ops = {op for op in outside if "Random" in op}
    assert random_ops, f"pfor loops over no random op here: {outside}"  # what the filter must drop
    assert not inside & random_ops, inside
    assert inside == outside - random_ops and inside, (inside, outside)  # other ops still warn


#: seconds a run expected to abort gets (kdp's own run of the same model takes about 10)
ABORT_WAIT_S = 120

RAW_PRODUCT = """
import numpy as np, tensorflow as tf
x, w = tf.constant(np.ones((8, 1, 6, 4), "float32")), tf.constant(np.ones((4, 6), "float32"))
for _ in range(20):
    tf.function(tf.matmul)(x, w).numpy()
print("done")
"""

EINSUM_MODEL = """
import keras, numpy as np
from kdp.autodiff import per_example_gradients
inputs = keras.Input((6, 4))
h = keras.layers.EinsumDense("abc,cd->abd", (6, 5), activation="tanh")(inputs)
outputs = keras.layers.Dense(3)(keras.layers.Flatten()(h))
model = keras.Model(inputs, outputs)
loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
x, y = np.ones((8, 6, 4), "float32"), np.zeros(8, "int32")
for _ in range(20):
    grads = per_example_gradients(model, loss, x, y)
assert all(g.shape[0] == 8 for g in grads.values())
print("done")
"""


def test_per_example_gradients_of_an_einsum_dense_model_run_where_the_raw_product_aborts(
        forks, tmp_path):
    """kdp's per-example gradients, which make the product ``(n, 1, T, d) @ (d, k)``
    under ``pfor``, run to the end. Where that product alone aborts (this CPU's
    oneDNN), the same gradients with TensorFlow's own conversion abort too: the
    replacement is what avoids it. A run expected to abort is killed after
    ``ABORT_WAIT_S``: a corrupted heap may also hang, which counts as not done."""
    def run(name, source, **timeout):
        (tmp_path / f"{name}.py").write_text(source)
        return forks.run([tmp_path / f"{name}.py"], tmp_path, tmp_path / f"{name}.log", **timeout)

    code, output = run("kdp", EINSUM_MODEL)
    assert code == 0 and "done" in output, output
    if run("raw", RAW_PRODUCT, timeout=ABORT_WAIT_S)[0] == 0:
        return  # a CPU on which the product does not abort: nothing to contrast
    unprotected = "import contextlib, kdp.autodiff\nkdp.autodiff.vectorization = contextlib.nullcontext\n"
    code, output = run("unprotected", unprotected + EINSUM_MODEL, timeout=ABORT_WAIT_S)
    assert code != 0 and "done" not in output
