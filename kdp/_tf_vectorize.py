"""TensorFlow's vectorization (``pfor``) with a matrix product that does not crash.

``tf.vectorized_map`` (and ``GradientTape.jacobian``) turn each op of the
per-example function into an op on the whole batch. A product ``x @ w`` of an
example's ``(1, T, d)`` activations (one example, a sequence, as a layer sees it
under `kdp.autodiff`) with a weight ``w`` of shape ``(d, k)`` becomes the
broadcast product ``(n, 1, T, d) @ (d, k)``, and with oneDNN (TensorFlow's
default on x86-64) that product corrupts the heap on some CPUs with AVX-512
(seen on AMD EPYC with TensorFlow 2.20 and 2.21: ``free(): invalid pointer``
or ``dnnl::error``, and the process aborts; ``tf.matmul`` of those shapes alone
does it, with or without kdp). ``EinsumDense`` and ``MultiHeadAttention`` make
such products.

`vectorization` replaces, while it is active, ``pfor``'s conversion of
``BatchMatMulV2`` for a batch of examples times a loop-invariant matrix
(an unstacked ``w`` whose batch axes are all 1) by one 2-D product of the
flattened rows: the same numbers, one kernel call and no broadcast; every
other case keeps TensorFlow's own conversion. It also keeps ``pfor``'s warning
"Using a while_loop for converting <op>" off the console for random ops
(``StatelessRandomUniformV2`` and the like, from ``Dropout``): kdp draws each
example's random values on purpose (the gradient of the computation the batch
ran), so the loop is expected, once per op and trace; other ops still warn.
"""

import contextlib
import logging
import threading

_LOCK = threading.Lock()
_ACTIVE = [0]  # nesting depth of `vectorization`
_ORIGINAL = {}


class _RandomLoopFilter(logging.Filter):
    """Drops ``pfor``'s "Using a while_loop for converting <op>" for random ops."""

    def filter(self, record):
        message = record.getMessage()
        return not (message.startswith("Using a while_loop for converting ")
                    and "Random" in message.split(" ")[5])


_FILTER = _RandomLoopFilter()


def _convert_batch_matmul(pfor_input):
    """``pfor``'s converter of ``BatchMatMulV2``: a stacked ``x`` (rank ≥ 3 with the
    loop axis) times an unstacked ``y`` whose batch axes are all 1 (a matrix) is
    ``reshape(x, (-1, d)) @ matrix``; any other case is TensorFlow's conversion."""
    import tensorflow as tf
    from tensorflow.python.ops.parallel_for import pfor

    x, y = pfor_input.input(0), pfor_input.input(1)
    adj_x, adj_y = pfor_input.get_attr("adj_x"), pfor_input.get_attr("adj_y")
    x_rank, y_shape = x.t.shape.rank, y.t.shape
    if not (x.is_stacked and not y.is_stacked and not adj_x and x_rank is not None and x_rank >= 3
            and y_shape.rank is not None and y_shape.rank >= 2 and all(d == 1 for d in y_shape[:-2])):
        return _ORIGINAL["BatchMatMulV2"](pfor_input)
    matrix = tf.reshape(y.t, y_shape[-2:]) if y_shape.rank > 2 else y.t
    shape = tf.shape(x.t)
    rows = tf.reshape(x.t, tf.stack([-1, shape[-1]]))
    product = tf.matmul(rows, matrix, transpose_b=adj_y)
    out = tf.reshape(product, tf.concat([shape[:-1], tf.shape(product)[-1:]], 0))
    # y's unit batch axes broadcast against x's: they add leading axes when y has more
    extra = y_shape.rank - (x_rank - 1)
    if extra > 0:
        out = tf.reshape(out, tf.concat([shape[:1], tf.ones([extra], "int32"), tf.shape(out)[1:]], 0))
    out.set_shape(x.t.shape[:1].concatenate([1] * max(extra, 0)).concatenate(x.t.shape[1:-1])
                  .concatenate(product.shape[-1:]))
    return pfor.wrap(out, True)


@contextlib.contextmanager
def vectorization():
    """While active, ``tf.vectorized_map`` and ``GradientTape.jacobian`` (traced in
    this process) convert a batch-times-matrix product with `_convert_batch_matmul`,
    and ``pfor``'s loop warnings for random ops are dropped (`_RandomLoopFilter`).
    Re-entrant; the registry and the logger are restored when the outermost use ends."""
    from tensorflow.python.ops.parallel_for import pfor

    registry = getattr(pfor, "_pfor_converter_registry", None)
    if not isinstance(registry, dict) or "BatchMatMulV2" not in registry:
        yield  # a TensorFlow without this registry: its own conversion
        return
    with _LOCK:
        if _ACTIVE[0] == 0:
            _ORIGINAL["BatchMatMulV2"] = registry["BatchMatMulV2"]
            registry["BatchMatMulV2"] = _convert_batch_matmul
            logging.getLogger("tensorflow").addFilter(_FILTER)
        _ACTIVE[0] += 1
    try:
        yield
    finally:
        with _LOCK:
            _ACTIVE[0] -= 1
            if _ACTIVE[0] == 0:
                registry["BatchMatMulV2"] = _ORIGINAL.pop("BatchMatMulV2")
                logging.getLogger("tensorflow").removeFilter(_FILTER)
