"""Per-example clipping DP-SGD for any Keras 3 model (the non-Lipschitz fallback).

Enabled by ``DPParameters(clipping_norm=C, clipping="flat"|"per-layer")`` on a
`DP_Model` / `DP_Sequential` made of **ordinary** Keras layers, compiled with any
Keras loss whose ``call`` returns per-example values (e.g.
``keras.losses.SparseCategoricalCrossentropy(from_logits=True)``).

The training objective keeps the shape of the clipless one, so Keras' own
``train_step`` runs it on every backend::

    stop_gradient(Σ_i w_i ℓ_i / b) + Σ_v ⟨v − stop_gradient(v), stop_gradient(ḡ_v) / b⟩ + noise term

where ``ḡ = Σ_i clip_C(∇(w_i ℓ_i))`` is the clipped per-example gradient sum,
computed inside the traced step, and the noise term (`DPModelMixin._noise_term`)
adds ``ξ_v`` of std ``σ·C / b``: the optimizer receives ``(ḡ + ξ)/b``, exactly
DP-SGD (Abadi et al. 2016). Padding rows (weight 0) contribute nothing.

How ḡ is computed (no Python loop over examples):

* **Dense layers: "book-keeping" ghost clipping.** One forward pass adds a zero
  probe to the pre-activation output ``z = a·W + b`` of every covered `Dense`
  call and keeps its input ``a``; one backward pass gives the cotangents
  ``G = ∂(Σ w_i ℓ_i)/∂z``. The per-example kernel-gradient norm is
  ``‖a_i‖·‖G_i‖`` for 2-D inputs and, for sequences ``(T, d)``,
  ``√⟨A_iA_iᵀ, G_iG_iᵀ⟩`` (Gram form, when ``T² < d·units``) or the norm of
  the materialised ``A_iᵀG_i``. The clipped sum is then ``Aᵀ(c ⊙ G)`` with
  ``c_i = min(1, C/‖g_i‖)``: no per-example gradient and no second backward pass.
* **Every other trainable variable** (Conv2D, Embedding, LayerNormalization,
  custom layers): vectorized per-example gradients (`jax.vmap` /
  `tf.vectorized_map` in `kdp.autodiff`), each example run as a batch of one.
* Norms of both kinds are summed per example (``"flat"``) or per layer
  (``"per-layer"``: layer ``l`` clipped at ``C_l``, ``Σ_l C_l² = C²``).

Memory: ``physical_batch_size=k`` computes ḡ over chunks of ``k`` rows of the
(padded) Poisson batch in a loop inside the step ("virtual batches"): one
logical step, one noise draw, one optimizer update, one accounted step.

Accounting: sensitivity of ḡ is ``C`` (add/remove one example; per-layer:
``√Σ C_l² = C``), noise ``σ·C``: one Poisson-subsampled Gaussian with
multiplier ``σ``, recorded in the same ledger as the clipless path.
"""

import math
import warnings
import weakref

import keras
import numpy as np
from keras import ops
from keras.src.models.functional import Functional

from kdp import autodiff

CLIPPING_MODES = ("flat", "per-layer")


class ClippingError(ValueError):
    """The model cannot be trained with per-example clipping as configured."""


# --- configuration ------------------------------------------------------------------


def check_clipping_parameters(clipping_norm, clipping, physical_batch_size):
    """Validate the clipping arguments of `DPParameters` (returns them normalised)."""
    if clipping not in CLIPPING_MODES:
        raise ValueError(f"clipping must be one of {CLIPPING_MODES}, got {clipping!r}")
    if clipping_norm is not None:
        if isinstance(clipping_norm, dict):
            if clipping != "per-layer":
                raise ValueError("a dict of clipping norms {layer name: C_l} needs clipping='per-layer'")
            clipping_norm = {str(k): float(c) for k, c in clipping_norm.items()}
            norms = list(clipping_norm.values())
        else:
            clipping_norm = float(clipping_norm)
            norms = [clipping_norm]
        if not norms or not all(c > 0 and math.isfinite(c) for c in norms):
            raise ValueError(f"clipping_norm must be finite and > 0, got {clipping_norm}")
    if physical_batch_size is not None:
        physical_batch_size = int(physical_batch_size)
        if physical_batch_size < 1:
            raise ValueError(f"physical_batch_size must be >= 1, got {physical_batch_size}")
        if clipping_norm is None:
            raise ValueError("physical_batch_size (virtual batches) needs clipping_norm")
    return clipping_norm, clipping, physical_batch_size


def total_clipping_norm(dp_parameters):
    """``C``: the L2 sensitivity of the clipped sum (``√Σ C_l²`` per layer)."""
    c = dp_parameters.clipping_norm
    return math.sqrt(sum(v * v for v in c.values())) if isinstance(c, dict) else float(c)


# --- model inspection -----------------------------------------------------------------


def _owned_variables(layer):
    return [v for v in getattr(layer, "_trainable_variables", []) if v.trainable]


def _owners(model):
    """``{id(variable): layer}``, the innermost layer that created each trainable variable."""
    owners = {}
    for layer in model._flatten_layers(include_self=False):
        for v in _owned_variables(layer):
            owners[id(v)] = layer
    return owners


def _is_ghost_dense(layer):
    """A plain `keras.layers.Dense` whose weights are all trainable (the ghost path)."""
    return (
        type(layer) is keras.layers.Dense
        and not getattr(layer, "lora_enabled", False)
        and getattr(layer, "quantization_mode", None) is None
        and layer.built
        and bool(layer.trainable_weights)
        and len(layer.trainable_weights) == len(layer.weights)
    )


def _runs_its_graph(layer):
    """A Functional or Sequential model whose ``call`` is the stock one (runs its graph)."""
    return isinstance(layer, keras.Model) and type(layer).call in (Functional.call, keras.Sequential.call)


def _graph_layers(model):
    """The layers that ``model``'s graph calls directly (through nested graph models)."""
    if not _runs_its_graph(model):
        return []
    out = []
    for layer in model.layers:
        out.extend(_graph_layers(layer) if _runs_its_graph(layer) else [layer])
    return list({id(layer): layer for layer in out}.values())


_PLAN_BATCHES = (2, 3)
_GHOST_PLANS = weakref.WeakKeyDictionary()  # model -> {(input spec, layers): ids of ghost layers}


def ghost_dense_layers(model, x):
    """The Dense layers whose per-example norms ghost clipping may compute.

    Ghost norms take row ``i`` of a Dense input to be example ``i``. A layer
    qualifies if it is a plain `Dense` (`_is_ghost_dense`) called by the model's
    graph directly (also through nested Functional / Sequential models) and a
    shape-only trace of ``model(x, training=True)`` at batch sizes 2 and 3 shows
    every one of its calls made by the graph itself (not from inside another
    layer's ``call``) on an input whose leading dimension is that batch size.
    Any other Dense, e.g. one applied by a custom layer to ``(batch·T, d)``
    rows, is left to the exact vectorized per-example path.

    Args:
        model: a built model; x: a batch (only its non-batch shape and dtype are used).

    Returns:
        A list of layers.
    """
    graph = _graph_layers(model)
    candidates = [layer for layer in graph if _is_ghost_dense(layer)]
    if not candidates:
        return []
    spec = tuple(x.shape[1:]), keras.backend.standardize_dtype(x.dtype)
    key = (spec, tuple(id(layer) for layer in graph), tuple(id(layer) for layer in candidates))
    cache = _GHOST_PLANS.setdefault(model, {})
    if key not in cache:
        ok = {id(layer): True for layer in candidates}
        called = set()
        with _GhostDense(candidates, watch=graph) as ctx:
            for b in _PLAN_BATCHES:
                ctx.records = []
                autodiff.trace_shapes(lambda t: model(t, training=True), (b,) + spec[0], spec[1])
                for layer, a, nested in ctx.records:
                    called.add(id(layer))
                    if nested or a.shape[0] != b:
                        ok[id(layer)] = False
            ctx.records = []
        cache[key] = frozenset(i for i in called if ok[i])
    return [layer for layer in candidates if id(layer) in cache[key]]


def clipping_groups(model):
    """``{layer name: [variable paths]}``: the clipping groups of ``"per-layer"``."""
    owners = _owners(model)
    groups = {}
    for v in model.trainable_variables:
        layer = owners.get(id(v))
        if layer is None:
            raise ClippingError(f"cannot tell which layer owns the trainable variable {v.path!r}")
        groups.setdefault(layer.name, []).append(v.path)
    return groups


def group_clipping_norms(model):
    """``{layer name: C_l}`` (``"per-layer"``) or ``{None: C}`` (``"flat"``)."""
    params = model.dp_parameters
    if params.clipping == "flat":
        return {None: float(params.clipping_norm)}
    groups = clipping_groups(model)
    c = params.clipping_norm
    if isinstance(c, dict):
        missing = sorted(set(groups) - set(c))
        extra = sorted(set(c) - set(groups))
        if missing or extra:
            raise ClippingError(
                f"clipping_norm dict must name every layer with trainable weights: "
                f"missing {missing}, unknown {extra}"
            )
        return {name: c[name] for name in groups}
    share = float(c) / math.sqrt(len(groups))  # equal split: Σ C_l² = C²
    return {name: share for name in groups}


_STOCHASTIC = ("seed_generator", "_seed_generator")


def check_model(model):
    """Raise `ClippingError` if per-example clipping of ``model`` would not be DP.

    * the loss must be a `keras.losses.Loss` (its ``call`` gives per-example values);
    * layers that mix the examples of a batch are refused: `BatchNormalization`
      in a trainable state (frozen ones run in inference mode: a warning);
    * stochastic layers (Dropout, GaussianNoise, ...) are refused: the
      per-example passes would not see the forward pass's random draws;
    * activity regularizers (data-dependent penalties) are refused;
    * any other mixing of examples is refused by a functional probe
      (`_check_examples_independent`): e.g. a Lambda centring over the batch axis.
    """
    loss = model.loss
    if not isinstance(loss, keras.losses.Loss):
        raise ClippingError(
            f"clipping needs a keras.losses.Loss instance whose call() is per-example "
            f"(e.g. keras.losses.SparseCategoricalCrossentropy(from_logits=True)), got {loss!r}"
        )
    if not model.trainable_variables:
        raise ClippingError(f"{model.name} has no trainable variables")
    for layer in model._flatten_layers(include_self=False):
        if isinstance(layer, keras.layers.BatchNormalization):
            if layer.trainable:
                raise ClippingError(
                    f"{layer.name}: BatchNormalization mixes the examples of a batch (batch "
                    "statistics; moving averages of private data), so per-example gradients "
                    "are not defined. Freeze it (layer.trainable = False: inference mode) or "
                    "use LayerNormalization / GroupNormalization."
                )
            warnings.warn(
                f"{layer.name}: frozen BatchNormalization runs in inference mode with fixed "
                "statistics; fine for DP as long as those statistics are public.",
                stacklevel=3,
            )
        if any(isinstance(getattr(layer, a, None), keras.random.SeedGenerator) for a in _STOCHASTIC):
            raise ClippingError(
                f"{layer.name}: stochastic layers ({type(layer).__name__}) are not supported "
                "with per-example clipping yet; remove it"
            )
        if getattr(layer, "activity_regularizer", None) is not None:
            raise ClippingError(f"{layer.name}: activity regularizers depend on the data; remove it")
    group_clipping_norms(model)  # validates a per-layer dict
    _check_examples_independent(model)
    return {}


_PROBE_ROWS = 4


def _probe_batch(model, rng):
    """A small random batch shaped like the model's inputs: ``(list of arrays, rows)``."""
    meta = model.dataset_metadata
    specs = list(getattr(model, "inputs", None) or [keras.KerasTensor((None,) + meta.input_shape)])
    rows = specs[0].shape[0] or _PROBE_ROWS
    xs = []
    for spec in specs:
        fill = meta.input_shape if len(specs) == 1 and len(meta.input_shape) == len(spec.shape) - 1 else None
        shape = [rows] + [d if d is not None else (fill[i] if fill else 3) for i, d in enumerate(spec.shape[1:])]
        dtype = keras.backend.standardize_dtype(spec.dtype)
        if "int" in dtype or dtype == "bool":
            xs.append(rng.integers(0, 2, shape).astype(dtype))
        else:
            xs.append(rng.normal(size=shape).astype(dtype))
    return xs, rows


def _perturb_row(x, k, rng):
    x = x.copy()
    if x.dtype.kind in "iub":
        x[k] = (1 - x[k].astype("int64")).astype(x.dtype)
    else:
        x[k] = rng.normal(size=x[k].shape).astype(x.dtype)
    return x


def _same(a, b):
    """Equal up to 1e-4 (1e-2 for 16-bit values) of the largest magnitude."""
    rtol = 1e-2 if np.asarray(a).dtype.itemsize <= 2 else 1e-4
    a, b = np.asarray(a, "float64"), np.asarray(b, "float64")
    if a.shape != b.shape:
        return False
    scale = max(float(np.max(np.abs(a), initial=0.0)), float(np.max(np.abs(b), initial=0.0)))
    return bool(np.allclose(a, b, rtol=0.0, atol=rtol * scale, equal_nan=True))


def _check_examples_independent(model):
    """Refuse a model whose output for one example depends on other examples.

    Per-example clipping bounds one example's contribution only if example
    ``i``'s loss depends on example ``i`` alone (Abadi et al. 2016). Functional
    probe, in training and inference mode, on a small random batch: perturbing
    or removing row ``k`` must leave every other row of every output unchanged
    (`_same`), and every input row of a ghost-clipped Dense
    (`ghost_dense_layers`) other than ``k``.

    Raises:
        ClippingError: naming the mixing (e.g. a Lambda centring over the batch axis).
    """
    rng = np.random.default_rng(0)
    xs, rows = _probe_batch(model, rng)
    fixed_batch = model.inputs[0].shape[0] is not None if getattr(model, "inputs", None) else False
    ghost = ghost_dense_layers(model, xs[0]) if len(xs) == 1 else []
    trainable = [v.value for v in model.trainable_variables]
    others = [v.value for v in model.non_trainable_variables]

    def run(batch, training):
        with _GhostDense(ghost) as ctx:
            out, _ = model.stateless_call(trainable, others, batch if len(batch) > 1 else batch[0],
                                          training=training)
            dense = [(layer, ops.convert_to_numpy(a)) for layer, a, _ in ctx.records]
        return [ops.convert_to_numpy(o) for o in keras.tree.flatten(out)], dense

    def refuse(how, training):
        raise ClippingError(
            f"{model.name}: the output for one example changes when another example of the batch "
            f"is {how} (training={training}): a layer mixes the examples of a batch (e.g. statistics "
            "or a mean over the batch axis), so clipping per example does not bound one example's "
            "contribution. Per-example clipping needs each example's output to depend on that "
            "example alone."
        )

    for training in (True, False):
        ref, ref_dense = run(xs, training)
        if any(len(o.shape) == 0 or o.shape[0] != rows for o in ref):
            raise ClippingError(f"{model.name}: every output must have one row per example (batch axis first)")
        for k in sorted({0, rows - 1}):
            out, dense = run([_perturb_row(x, k, rng) for x in xs], training)
            if not all(_same(np.delete(a, k, 0), np.delete(b, k, 0)) for a, b in zip(ref, out)):
                refuse("perturbed", training)
            for (layer, a), (_, b) in zip(ref_dense, dense):
                if not _same(np.delete(a, k, 0), np.delete(b, k, 0)):
                    raise ClippingError(
                        f"{layer.name}: the rows of this Dense layer's input are not the examples of "
                        "the batch (an earlier layer moves data across rows), so its gradient cannot "
                        "be clipped per example; keep the batch axis of the tensors between layers."
                    )
            if not fixed_batch and rows > 1:
                out, _ = run([np.delete(x, k, 0) for x in xs], training)
                if not all(_same(np.delete(a, k, 0), b) for a, b in zip(ref, out)):
                    refuse("removed", training)


# --- the clipped gradient sum ------------------------------------------------------------


def per_example_loss(loss, y, y_pred):
    """``loss.call`` summed over every non-batch axis: shape ``(batch,)``."""
    values = loss.call(y, y_pred)
    if len(values.shape) > 1:
        values = ops.sum(ops.reshape(values, (ops.shape(values)[0], -1)), axis=1)
    return values


_MISSING = object()


class _GhostDense:
    """Swaps the ``call`` of covered Dense layers for one that records its input
    and passes ``z = aW + b`` through ``probe``; calls of the ``watch`` layers mark
    the Dense calls made from inside them as nested."""

    def __init__(self, layers, watch=()):
        self.layers = list(layers)
        covered = {id(layer) for layer in self.layers}
        self.watch = [layer for layer in watch if id(layer) not in covered]
        self.probe = lambda z: z
        self.records = []  # (layer, input, nested)
        self._depth = 0
        self._saved = []

    def __enter__(self):
        for layer in self.layers:
            self._patch(layer, self._make_call(layer))
        for layer in self.watch:
            self._patch(layer, self._make_marker(layer.call))
        return self

    def __exit__(self, *exc):
        for layer, old in reversed(self._saved):
            if old is _MISSING:
                object.__delattr__(layer, "call")
            else:
                object.__setattr__(layer, "call", old)
        self._saved = []

    def _patch(self, layer, call):
        self._saved.append((layer, layer.__dict__.get("call", _MISSING)))
        object.__setattr__(layer, "call", call)

    def _make_marker(self, inner):
        def call(*args, **kwargs):
            self._depth += 1
            try:
                return inner(*args, **kwargs)
            finally:
                self._depth -= 1

        return call

    def _make_call(self, layer):
        def call(inputs, training=None):
            z = ops.matmul(inputs, layer.kernel)
            if layer.bias is not None:
                z = ops.add(z, layer.bias)
            self.records.append((layer, inputs, self._depth > 0))
            z = self.probe(z)
            return layer.activation(z) if layer.activation is not None else z

        return call

    def forward(self, model, loss, x, y):
        def run(probe):
            self.probe, self.records = probe, []
            values = per_example_loss(loss, y, model(x, training=True))
            return values, [a for _, a, _ in self.records]

        return run

    def layers_of_calls(self):
        return [layer for layer, _, _ in self.records]


def _as_sequence(t):
    """``(batch, ..., d) -> (batch, T, d)``."""
    if len(t.shape) == 2:
        return ops.expand_dims(t, 1)
    return ops.reshape(t, (-1, int(math.prod(t.shape[1:-1])), t.shape[-1]))


def _kernel_sq_norms(a, g):
    """Per-example ``‖a_iᵀ g_i‖_F²`` for ``a (B, T, d)``, ``g (B, T, u)``."""
    t, d, u = a.shape[1], a.shape[2], g.shape[2]
    if t == 1:
        return ops.sum(ops.square(a[:, 0]), axis=1) * ops.sum(ops.square(g[:, 0]), axis=1)
    if t * t <= d * u:  # Gram form: Σ_{s,t} (a_s·a_t)(g_s·g_t)
        ga = ops.einsum("bsd,btd->bst", a, a)
        gg = ops.einsum("bsu,btu->bst", g, g)
        return ops.sum(ga * gg, axis=(1, 2))
    return ops.sum(ops.square(ops.einsum("btd,btu->bdu", a, g)), axis=(1, 2))


def clipped_gradient_sum(model, x, y, weights=None, ghost=True):
    """``{variable.path: Σ_i clip(∇_v (w_i ℓ_i))}`` on one batch, vectorized.

    Flat clipping scales example ``i``'s whole gradient by
    ``min(1, C/‖g_i‖)``; per-layer clipping scales each layer's part by
    ``min(1, C_l/‖g_il‖)``. Usable eagerly and inside a traced training step.

    Args:
        model: a DP model in clipping mode (compiled).
        x, y: one batch; weights: per-example weights in ``[0, 1]`` (default 1).
        ghost: use the ghost (book-keeping) path for the Dense layers of
            `ghost_dense_layers`; ``False`` computes every per-example gradient
            with vectorized autodiff.
    """
    loss = model.loss
    x = ops.convert_to_tensor(x)
    y = ops.convert_to_tensor(y)
    batch = ops.shape(x)[0]
    weights = ops.ones((batch,), "float32") if weights is None else ops.reshape(
        ops.cast(weights, "float32"), (-1,))
    trainable = list(model.trainable_variables)
    owners = _owners(model)
    flat = model.dp_parameters.clipping == "flat"
    norms = group_clipping_norms(model)

    def group(v):
        return None if flat else owners[id(v)].name

    dense = ghost_dense_layers(model, x) if ghost else []
    dense_ids = {id(l) for l in dense}
    others = [v for v in trainable if id(owners.get(id(v))) not in dense_ids]

    sq = {}  # group -> (batch,) squared norms

    def add(g, value):
        sq[g] = value if g not in sq else sq[g] + value

    # Dense layers: one probed forward/backward (ghost norms).
    calls = {}
    if dense:
        ghost_ctx = _GhostDense(dense)
        with ghost_ctx:
            run = ghost_ctx.forward(model, loss, x, y)
            _, inputs, cotangents = autodiff.probe_cotangents(run, weights)
            called = ghost_ctx.layers_of_calls()
        for layer, a, g in zip(called, inputs, cotangents):
            if a.shape[0] is not None and x.shape[0] is not None and a.shape[0] != x.shape[0]:
                raise ClippingError(f"{layer.name}: input rows {a.shape[0]} != batch {x.shape[0]}")
            calls.setdefault(id(layer), (layer, [], []))
            calls[id(layer)][1].append(_as_sequence(ops.cast(a, g.dtype)))
            calls[id(layer)][2].append(_as_sequence(g))
        for layer, a_list, g_list in calls.values():
            a = ops.concatenate(a_list, axis=1) if len(a_list) > 1 else a_list[0]
            g = ops.concatenate(g_list, axis=1) if len(g_list) > 1 else g_list[0]
            calls[id(layer)] = (layer, a, g)
            add(group(layer.kernel), _kernel_sq_norms(a, g))
            if layer.bias is not None:
                add(group(layer.bias), ops.sum(ops.square(ops.sum(g, axis=1)), axis=1))

    # Everything else: vectorized per-example gradients.
    grads = []
    if others:
        grads = autodiff.weighted_per_example_gradients(
            model, lambda yt, yp: per_example_loss(loss, yt, yp), x, y, weights, others
        )
        for v, g in zip(others, grads):
            add(group(v), ops.sum(ops.square(ops.reshape(g, (batch, -1))), axis=1))

    factors = {}
    for g, s in sq.items():
        c = norms[g]
        factors[g] = ops.minimum(1.0, c / ops.maximum(ops.sqrt(s), 1e-12))

    out = {}
    for layer, a, g in calls.values():
        f = factors[group(layer.kernel)]
        out[layer.kernel.path] = ops.einsum("btd,btu->du", a * f[:, None, None], g)
        if layer.bias is not None:
            out[layer.bias.path] = ops.einsum("bu,b->u", ops.sum(g, axis=1), factors[group(layer.bias)])
    for v, g in zip(others, grads):
        f = factors[group(v)]
        out[v.path] = ops.tensordot(f, g, axes=1)
    for v in trainable:  # keep the kernel/variable dtype
        out[v.path] = ops.cast(out[v.path], v.dtype)
    return out


def _chunked_sum(model, x, y, weights, chunk):
    """`clipped_gradient_sum` over chunks of ``chunk`` rows (virtual batches)."""
    batch = x.shape[0]  # None when TensorFlow traced an unknown batch size
    if batch is not None and batch <= chunk:
        return clipped_gradient_sum(model, x, y, weights)
    n_rows = ops.shape(x)[0]
    pad = (-n_rows) % chunk
    x = _pad_rows(x, pad)
    y = _pad_rows(y, pad)
    weights = _pad_rows(weights, pad)
    steps = (n_rows + pad) // chunk
    init = [ops.zeros(v.shape, v.dtype) for v in model.trainable_variables]
    paths = [v.path for v in model.trainable_variables]

    def body(i, acc):
        start = i * chunk
        xs = _rows(x, start, chunk)
        ys = _rows(y, start, chunk)
        ws = _rows(weights, start, chunk)
        part = clipped_gradient_sum(model, xs, ys, ws)
        return [a + part[p] for a, p in zip(acc, paths)]

    total = ops.fori_loop(0, steps, body, init)
    return dict(zip(paths, total))


def _pad_rows(t, pad):
    widths = [[0, pad]] + [[0, 0]] * (len(t.shape) - 1)
    return ops.pad(t, widths)


def _rows(t, start, size):
    begin = [start] + [0] * (len(t.shape) - 1)
    shape = [size] + list(t.shape[1:])
    return ops.slice(t, begin, shape)


def clipped_objective(model, x, y, values, sample_weight):
    """The clipping-mode data term: value ``Σ w_i ℓ_i / b``, gradient ``ḡ / b``.

    ``values`` are the weighted per-example losses of Keras' forward pass (used
    for the value only); the noise term is added by the model.
    """
    b = model.dataset_metadata.batch_size
    x = ops.convert_to_tensor(x)
    weights = (ops.ones((ops.shape(x)[0],), "float32") if sample_weight is None
               else ops.reshape(ops.cast(sample_weight, "float32"), (-1,)))
    chunk = model.dp_parameters.physical_batch_size
    if chunk:
        gbar = _chunked_sum(model, x, ops.convert_to_tensor(y), weights, chunk)
    else:
        gbar = clipped_gradient_sum(model, x, y, weights)
    total = ops.stop_gradient(ops.sum(values) / b)
    for v in model.trainable_variables:
        value = v.value
        total = total + ops.sum((value - ops.stop_gradient(value)) * ops.stop_gradient(gbar[v.path] / b))
    return total


__all__ = [
    "CLIPPING_MODES", "ClippingError", "check_model", "clipped_gradient_sum", "clipped_objective",
    "clipping_groups", "ghost_dense_layers", "group_clipping_norms", "noise_stds", "total_clipping_norm",
]
