"""TensorFlow's vectorization (``pfor``) with a matrix product that does not crash,
a max-pooling gradient on oneDNN's kernel and depthwise convolutions without a loop.

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

* ``BatchMatMulV2`` for a batch of examples times a loop-invariant matrix
  (an unstacked ``w`` whose batch axes are all 1) by one 2-D product of the
  flattened rows: the same numbers, one kernel call and no broadcast; every
  other case keeps TensorFlow's own conversion;
* ``MaxPoolGrad`` by one whose pooled input is a ``MaxPool`` of the flattened
  input computed beside it. ``pfor`` feeds the gradient the forward pool's
  output through a reshape, and oneDNN's layout pass replaces ``MaxPoolGrad``
  by its own kernel only when that input comes from a ``MaxPool`` directly:
  TensorFlow's generic kernel took 30 ms of a 65 ms per-example pass of the
  convnet of ``benchmarks/bench_clipping_step.py`` (b = 256, one core), oneDNN's
  under 1 ms. The pool is recomputed from the same input, so the numbers are
  the same;
* ``DepthwiseConv2dNative`` and its input gradient, with a loop-invariant
  filter, by the same op on the examples' rows flattened into one batch.
  ``pfor``'s own conversion (the examples folded into the channels, the
  filter repeated for each) ran in a loop over the examples instead: one call
  per example, 139 ms of op time a step for a depthwise and two separable
  convolutions on 128 examples of 28×28×8 (TensorFlow 2.20, 2 CPU cores).

It also keeps ``pfor``'s warning
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


def _convert_max_pool_grad(pfor_input):
    """``pfor``'s converter of ``MaxPoolGrad`` (see the module): the examples' rows
    flattened into one batch, the pooled input recomputed by ``MaxPool``."""
    import tensorflow as tf
    from tensorflow.python.ops import gen_nn_ops
    from tensorflow.python.ops.parallel_for import pfor

    pfor_input.stack_inputs()
    examples = pfor_input.pfor.loop_len_vector
    flat = [tf.reshape(t, tf.concat([[-1], tf.shape(t)[2:]], 0))
            for t in (pfor_input.stacked_input(0), pfor_input.stacked_input(2))]
    attrs = {name: pfor_input.get_attr(name)
             for name in ("ksize", "strides", "padding", "explicit_paddings", "data_format")}
    pooled = gen_nn_ops.max_pool(flat[0], **attrs)
    grad = gen_nn_ops.max_pool_grad(flat[0], pooled, flat[1], **attrs)
    return pfor.wrap(tf.reshape(grad, tf.concat([examples, [-1], tf.shape(grad)[1:]], 0)), True)


def _convert_depthwise(pfor_input):
    """``pfor``'s converter of ``DepthwiseConv2dNative`` and of its input gradient
    ``DepthwiseConv2dNativeBackpropInput`` (see the module) for a loop-invariant
    filter: the examples' rows flattened into one batch; a filter that varies
    with the example is TensorFlow's conversion."""
    import tensorflow as tf
    from tensorflow.python.ops.parallel_for import pfor

    op = pfor_input.op_type
    data = 0 if op == "DepthwiseConv2dNative" else 2
    unstacked = [i for i in range(pfor_input.num_inputs) if i != data]
    if any(pfor_input.input(i).is_stacked for i in unstacked):
        return _ORIGINAL[op](pfor_input)
    pfor_input.stack_inputs(stack_indices=[data])
    inputs = [pfor_input.unstacked_input(i) for i in unstacked]
    stacked = pfor_input.stacked_input(data)
    examples = pfor_input.pfor.loop_len_vector
    rows = tf.reshape(stacked, tf.concat([[-1], tf.shape(stacked)[2:]], 0))
    if op == "DepthwiseConv2dNative":
        args = [rows, inputs[0]]
    else:  # input_sizes: the one example's sizes, times the examples on the batch axis
        sizes = inputs[0] * tf.concat([examples, tf.ones_like(inputs[0][1:])], 0)
        args = [sizes, inputs[1], rows]
    out = pfor._create_op(op, args, [x.dtype for x in pfor_input.outputs],
                          attrs=pfor_input.op.node_def.attr).outputs[0]
    return pfor.wrap(tf.reshape(out, tf.concat([examples, [-1], tf.shape(out)[1:]], 0)), True)


#: the ``pfor`` converters `vectorization` replaces, by op type (looked up when called)
_CONVERTERS = {"BatchMatMulV2": lambda p: _convert_batch_matmul(p),
               "MaxPoolGrad": lambda p: _convert_max_pool_grad(p),
               "DepthwiseConv2dNative": lambda p: _convert_depthwise(p),
               "DepthwiseConv2dNativeBackpropInput": lambda p: _convert_depthwise(p)}


@contextlib.contextmanager
def vectorization():
    """While active, ``tf.vectorized_map`` and ``GradientTape.jacobian`` (traced in
    this process) convert the ops of `_CONVERTERS` with kdp's converters, and
    ``pfor``'s loop warnings for random ops are dropped (`_RandomLoopFilter`).
    Re-entrant; the registry and the logger are restored when the outermost use ends."""
    from tensorflow.python.ops.parallel_for import pfor

    registry = getattr(pfor, "_pfor_converter_registry", None)
    if not isinstance(registry, dict) or not all(op in registry for op in _CONVERTERS):
        yield  # a TensorFlow without this registry: its own conversion
        return
    with _LOCK:
        if _ACTIVE[0] == 0:
            for op, convert in _CONVERTERS.items():
                _ORIGINAL[op] = registry[op]
                registry[op] = convert
            logging.getLogger("tensorflow").addFilter(_FILTER)
        _ACTIVE[0] += 1
    try:
        yield
    finally:
        with _LOCK:
            _ACTIVE[0] -= 1
            if _ACTIVE[0] == 0:
                for op in _CONVERTERS:
                    registry[op] = _ORIGINAL.pop(op)
                logging.getLogger("tensorflow").removeFilter(_FILTER)
