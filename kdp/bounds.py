"""The bound pass: per-example gradient-norm bounds for every trainable variable.

Forward, each layer turns a bound on its input norm into one on its output norm;
backward, starting from the loss's Lipschitz constant ``L = loss.get_L()``, each
layer turns a bound on its output cotangent into bounds on its parameters'
gradients and on its input cotangent (Béthune et al. 2024, Alg. 1, in
per-example units: nothing here is divided by the batch size).

Works on `keras.Sequential` stacks, functional graphs (fan-out sums the cotangent
bounds of the branches; a layer used twice sums its parameter bounds) and nested
models. It refuses, naming it, any layer without the protocol, a `DPLayer` that
does not state its bounds (`kdp.layers.base`), a layer whose ``call`` was
redefined after its bounds were stated, and a Sequential or functional model
that overrides ``call`` (the pass walks its layer graph, not that code).

Bounds are Python floats, except inside a traced function (the training step)
downstream of a `DP_ClipGradient`: its threshold is a variable (adaptive clipping
changes it between steps without recompiling), so there ``min(G, C)`` is a
backend tensor, and so is every bound the backward pass derives from it. Run
eagerly, the same pass gives floats (the current threshold). Layers combine
bounds with ``+`` and ``*`` (which work on both); anything else (a square root,
a minimum) goes through `bound_sqrt` / `bound_min` or `keras.ops`.
"""

import contextlib
import functools
import math
import numbers

import keras
from keras import ops
from keras.src.models.functional import Functional

from kdp.layers.base import BOUND_METHODS, DPLayer
from kdp.layers.clip import DP_ClipGradient


class BoundError(ValueError):
    """A model or loss that the bound pass cannot certify."""


def _is_functional(model):
    return hasattr(model, "_nodes_by_depth") and not isinstance(model, keras.Sequential)


def _owner(cls, name):
    """The first class of ``cls.__mro__`` whose body defines ``name`` (or None)."""
    return next((k for k in cls.__mro__ if name in vars(k)), None)


@functools.lru_cache(maxsize=None)
def _model_problem(cls, walked):
    """Why the graph of a ``cls`` model is not what its ``call`` computes, or None."""
    owner = _owner(cls, "call")
    if owner is walked:
        return None
    return (
        f"overrides call() (in {owner.__name__}): the bound pass walks the model's "
        "layers, not the code of its call. Use a plain keras.Sequential or functional "
        "model (kdp.DP_Sequential, kdp.DP_Model), or put the computation in a DP layer "
        "that states its bounds."
    )


@functools.lru_cache(maxsize=None)
def _layer_problem(cls):
    """Why the bounds of a ``cls`` layer may not describe its ``call``, or None."""
    missing = [m for m in BOUND_METHODS if _owner(cls, m) is DPLayer]
    if missing:
        return (
            f"does not state its bounds ({', '.join(missing)}), and the bound pass "
            "does not assume it is the identity. Implement the three bound methods, or "
            "inherit kdp.layers.DPNormNonIncreasingLayer if the layer is parameterless, "
            "1-Lipschitz and maps 0 to 0."
        )
    call = _owner(cls, "call")
    if call is None:
        return None
    for method in BOUND_METHODS:
        owner = _owner(cls, method)
        # a layer class above `call` that wrote the bounds or mixed them in
        for stated in call.__mro__[1:]:
            if hasattr(stated, "call") and (stated is owner or owner in stated.__bases__):
                return (
                    f"redefines call() in {call.__name__} but inherits {method} from "
                    f"{stated.__name__}, where it describes another call(). State the "
                    f"three bound methods in {call.__name__}."
                )
    return None


def _check(op):
    if isinstance(op, keras.layers.InputLayer):
        return
    if isinstance(op, keras.Sequential):
        problem = _model_problem(type(op), keras.Sequential)
    elif _is_functional(op):
        problem = _model_problem(type(op), Functional)
    elif isinstance(op, DPLayer):
        problem = _layer_problem(type(op))
    else:
        problem = (
            "has no DP bound protocol, so no per-example gradient bound can be "
            "certified through it. Use kdp.layers (e.g. DP_QuickSpectralDense for "
            "Dense, DP_LayerCentering instead of BatchNormalization, no Dropout) or "
            "implement propagate_inputs / backpropagate_inputs / backpropagate_params. "
            "Or keep the layer and train with per-example clipping instead: "
            "DPParameters(clipping_norm=...)."
        )
    if problem is None and "call" in vars(op):
        problem = "has its call() replaced on the instance: its bounds describe another call()."
    if problem is not None:
        kind = "Model" if isinstance(op, keras.Model) else "Layer"
        raise BoundError(f"{kind} {getattr(op, 'name', op)!r} ({type(op).__name__}) {problem}")


def is_float_bound(bound):
    """True for a plain Python/NumPy number (not a backend tensor)."""
    return isinstance(bound, numbers.Real)


def bound_sqrt(bound):
    """``√bound`` for a float (``math.sqrt``) or a tensor (``keras.ops.sqrt``)."""
    return math.sqrt(bound) if is_float_bound(bound) else ops.sqrt(bound)


def bound_min(a, b):
    """``min(a, b)`` for floats, ``keras.ops.minimum`` when either is a tensor."""
    return min(a, b) if is_float_bound(a) and is_float_bound(b) else ops.minimum(a, b)


# In a Jacobian pass (`lipschitz_constant`) a `DP_ClipGradient` is the identity:
# it bounds loss cotangents, not the input-output Lipschitz constant.
_JACOBIAN_PASS = [False]


@contextlib.contextmanager
def _jacobian_pass():
    saved = _JACOBIAN_PASS[0]
    _JACOBIAN_PASS[0] = True
    try:
        yield
    finally:
        _JACOBIAN_PASS[0] = saved


def _add_params(total, new):
    for path, bound in new.items():
        total[path] = total[path] + bound if path in total else bound


# --- modules: a DP layer, a chain, a functional graph -------------------------

def propagate(module, input_bound):
    """Bound on the output norm of ``module`` given a bound on its input norm."""
    _check(module)
    if isinstance(module, keras.Sequential):
        return chain_propagate(module.layers, input_bound)
    if _is_functional(module):
        return _graph_forward(module, input_bound)[0]
    if isinstance(module, keras.layers.InputLayer):
        return input_bound
    return module.propagate_inputs(input_bound)


def backpropagate(module, input_bound, gradient_bound):
    """``(G_in, {variable.path: bound})`` for ``module`` given X and G."""
    _check(module)
    if isinstance(module, keras.Sequential):
        return chain_backpropagate(module.layers, input_bound, gradient_bound)
    if _is_functional(module):
        return _graph_backward(module, input_bound, gradient_bound)
    if isinstance(module, keras.layers.InputLayer):
        return gradient_bound, {}
    if _JACOBIAN_PASS[0] and isinstance(module, DP_ClipGradient):
        return gradient_bound, {}
    return (
        module.backpropagate_inputs(input_bound, gradient_bound),
        module.backpropagate_params(input_bound, gradient_bound),
    )


def chain_propagate(layers, input_bound):
    for layer in layers:
        input_bound = propagate(layer, input_bound)
    return input_bound


def chain_backpropagate(layers, input_bound, gradient_bound):
    inputs = []
    for layer in layers:
        inputs.append(input_bound)
        input_bound = propagate(layer, input_bound)
    params = {}
    for layer, x in zip(reversed(layers), reversed(inputs)):
        gradient_bound, new = backpropagate(layer, x, gradient_bound)
        _add_params(params, new)
    return gradient_bound, params


def _graph_nodes(model):
    for depth in sorted(model._nodes_by_depth, reverse=True):
        for node in model._nodes_by_depth[depth]:
            if node.operation is not None and not node.is_input:
                yield node


def _single_or_list(values):
    return values[0] if len(values) == 1 else list(values)


def _graph_forward(model, input_bound):
    bounds = {id(t): input_bound for t in model.inputs}
    trace = []
    for node in _graph_nodes(model):
        x = _single_or_list([bounds[id(t)] for t in node.input_tensors])
        out = propagate(node.operation, x)
        for t in node.output_tensors:
            bounds[id(t)] = out
        trace.append((node, x))
    outputs = [bounds[id(t)] for t in model.outputs]
    return _single_or_list(outputs), trace


def _graph_backward(model, input_bound, gradient_bound):
    if len(model.outputs) != 1 or len(model.inputs) != 1:
        raise BoundError(f"{model.name}: the bound pass supports one input and one output")
    _, trace = _graph_forward(model, input_bound)
    cotangents = {id(model.outputs[0]): gradient_bound}
    params = {}
    for node, x in reversed(trace):
        outs = [cotangents[id(t)] for t in node.output_tensors if id(t) in cotangents]
        if not outs:
            continue  # a branch that does not reach the output
        g_in, new = backpropagate(node.operation, x, sum(outs))
        _add_params(params, new)
        g_in = g_in if isinstance(g_in, (list, tuple)) else [g_in]
        for t, g in zip(node.input_tensors, g_in):
            cotangents[id(t)] = cotangents[id(t)] + g if id(t) in cotangents else g
    return cotangents.get(id(model.inputs[0]), 0.0), params


# --- public entry points -------------------------------------------------------

def loss_lipschitz(loss):
    """``loss.get_L()``, or a clear error for a loss without a per-example constant."""
    get_l = getattr(loss, "get_L", None)
    if get_l is None:
        raise BoundError(
            f"Loss {loss!r} has no get_L(): its per-example Lipschitz constant is "
            "unknown, so the noise cannot be calibrated. Use a kdp.losses loss, or keep "
            "this loss and train with per-example clipping: DPParameters(clipping_norm=...)."
        )
    return get_l()


def compute_gradient_bounds(model, loss=None, input_bound=None):
    """Per-example gradient-norm bound of every trainable variable of ``model``.

    Args:
        model: a built model made of DP layers (Sequential, functional or nested).
        loss: a loss with ``get_L()``; defaults to ``model.loss``.
        input_bound: bound on the input norm if the model does not start with
            `DP_BoundedInput`; defaults to ``model.dataset_metadata.max_norm``.

    Returns:
        ``{variable.path: bound}``: for every example ``i``,
        ``‖∇_v ℓ(f(x_i), y_i)‖₂ ≤ bound`` (Béthune et al. 2024, Alg. 1).
        Bounds are Python floats when called eagerly. Called inside a traced
        function (``tf.function``, ``jax.jit``: the training step), the bound
        of a variable whose gradient flows through a `DP_ClipGradient` is a
        scalar tensor computed from the layer's threshold variable, so the
        noise follows the threshold without recompiling.

    Raises:
        BoundError: a layer without the protocol, a loss without ``get_L()``, a
            missing input bound, or a trainable variable left without a bound.
    """
    if not model.built:
        raise BoundError(f"{model.name} is not built: call it on data or give an input shape")
    loss = model.loss if loss is None else loss
    if loss is None:
        raise BoundError("No loss: compile the model with a kdp loss or pass loss=")
    if input_bound is None:
        metadata = getattr(model, "dataset_metadata", None)
        input_bound = getattr(metadata, "max_norm", None)
    _ensure_input_bound(model, input_bound)
    _, params = backpropagate(model, input_bound, loss_lipschitz(loss))
    bounds = {}
    for v in model.trainable_variables:
        if v.path not in params:
            raise BoundError(f"No gradient bound for trainable variable {v.path!r}")
        bounds[v.path] = params[v.path]
    return bounds


def uses_input_bound(module, input_bound):
    """True when a stated ``input_bound`` enters ``module``'s gradient bounds: no
    layer caps the inputs (the bound pass needs it), or a capping layer's radius
    is above it (`DP_BoundedInput` takes the smaller). Then every input's norm
    must be checked against it: the noise is calibrated to it."""
    try:
        capped = backpropagate(module, None, 1.0)[1]
    except TypeError:  # None reached the arithmetic of a layer: nothing caps the inputs
        return True
    stated = backpropagate(module, input_bound, 1.0)[1]
    return any(not math.isclose(float(stated[path]), float(capped[path]), rel_tol=1e-12)
               for path in capped)


def _ensure_input_bound(model, input_bound):
    try:
        out = propagate(model, input_bound)
    except TypeError:  # None reached the arithmetic of a layer
        out = None
    if out is None:
        raise BoundError(
            f"{model.name}: no input norm bound. Start the model with "
            "DP_BoundedInput(upper_bound=...) or set DatasetMetadata(max_norm=...)."
        )


def lipschitz_constant(model):
    """Upper bound on the L2 Lipschitz constant of ``model`` (input -> output).

    `DP_ClipGradient` layers count as the identity they are in the forward pass
    (their threshold bounds loss cotangents only, not the Jacobian)."""
    with _jacobian_pass():
        g_in, _ = backpropagate(model, 1.0, 1.0)
    return g_in
