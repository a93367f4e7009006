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

How ḡ is computed (no Python loop over examples): one vectorized pass
(`jax.vmap` / `tf.vectorized_map` in `kdp.autodiff`) runs every example alone,
as a batch of one, so example ``i``'s gradient depends on ``x_i`` and the
weights only: padding rows, repeated rows or a layer mixing the batch axis
cannot carry one example into another's clipped gradient (a layer that smuggles
a tensor of the batch's forward pass into the per-example one through a Python
attribute, rather than a Keras variable, would). Inside that pass:

* **Dense layers: "book-keeping" ghost clipping.** A zero probe is added to the
  pre-activation output ``z = a·W + b`` of every plain `Dense` call, whose input
  ``a`` is kept; the backward pass gives the cotangents ``G = ∂(w_i ℓ_i)/∂z``.
  Example ``i``'s kernel-gradient norm is ``‖a_i‖·‖G_i‖`` for one row and, for
  ``T`` rows ``(T, d)`` (a sequence, or a Dense applied to folded time steps),
  ``√⟨A_iA_iᵀ, G_iG_iᵀ⟩`` (Gram form, when ``T² < d·units``) or the norm of the
  materialised ``A_iᵀG_i``. The clipped sum is then ``Σ_i c_i A_iᵀG_i`` with
  ``c_i = min(1, C/‖g_i‖)``: no per-example kernel gradient.
* **Every other trainable variable** (Conv2D, Embedding, LayerNormalization,
  custom layers): per-example gradients.
* Norms of both kinds are summed per example (``"flat"``) or per layer
  (``"per-layer"``: layer ``l`` clipped at ``C_l``, ``Σ_l C_l² = C²``).

Memory: ``physical_batch_size=k`` computes ḡ over chunks of ``k`` rows of the
(padded) Poisson batch in a loop inside the step ("virtual batches"): one
logical step, one noise draw, one optimizer update, one accounted step.

Accounting: sensitivity of ḡ is ``C`` (add/remove one example; per-layer:
``√Σ C_l² = C``), noise ``σ·C``: one Poisson-subsampled Gaussian with
multiplier ``σ``, recorded in the same ledger as the clipless path. It holds
for what the training step really computes because a model whose training
forward pass writes a variable or adds a loss term is refused
(`kdp.admission`), as are stochastic layers.
"""

import math
import warnings

import keras
import numpy as np
from keras import ops

from kdp import admission, autodiff

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


def ghost_dense_layers(model):
    """The layers whose per-example norms ghost clipping computes: every plain
    `Dense` of ``model`` (`_is_ghost_dense`), wherever it is called (also from
    inside another layer's ``call``, on any number of rows per example)."""
    return [layer for layer in model._flatten_layers(include_self=False) if _is_ghost_dense(layer)]


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
    """Raise `ClippingError` (or `kdp.admission.AdmissionError`) if per-example
    clipping of ``model`` would not be DP.

    * the loss must be a `keras.losses.Loss` (its ``call`` gives per-example values);
    * stochastic layers (Dropout, GaussianNoise, ...) are refused: the
      per-example passes would not see the forward pass's random draws;
    * a training forward pass that writes a variable (a trainable
      `BatchNormalization`'s moving statistics) or adds a loss term is refused
      (`kdp.admission.check_forward_pass`); a frozen BatchNormalization runs in
      inference mode (a warning: its statistics must be public);
    * a model whose output for one example depends on other examples of its
      batch is refused (`_check_examples_independent`).
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
        if isinstance(layer, keras.layers.BatchNormalization) and not layer.trainable:
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
    group_clipping_norms(model)  # validates a per-layer dict
    admission.check_forward_pass(model)
    _check_examples_independent(model)
    return {}


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

    The clipped sum does not rest on this check: `clipped_gradient_sum` runs
    every example alone, so nothing one example does to the others' rows reaches
    the update. But a model that mixes its batch (statistics or a mean over the
    batch axis) would then be trained on a computation the batch did not run,
    so it is refused. Functional probe, in training and inference mode, on
    random rows plus a repeated row and an all-zero row (a padded Poisson
    batch's padding): perturbing or removing row ``k`` must leave every other
    row of every output unchanged (`_same`). A layer that mixes only on inputs
    the probe does not hold passes it.

    Raises:
        ClippingError: naming the mixing (e.g. a Lambda centring over the batch axis).
    """
    rng = np.random.default_rng(0)
    xs, rows = admission.probe_batch(model, rng)
    fixed_batch = model.inputs[0].shape[0] is not None if getattr(model, "inputs", None) else False
    if not fixed_batch:
        xs = [np.concatenate([x, x[:1], np.zeros_like(x[:1])]) for x in xs]
        rows += 2
    elif rows >= 3:
        for x in xs:
            x[-2], x[-1] = x[0], 0
    trainable = [v.value for v in model.trainable_variables]
    others = [v.value for v in model.non_trainable_variables]

    def run(batch, training):
        out, _ = model.stateless_call(trainable, others, batch if len(batch) > 1 else batch[0],
                                      training=training)
        return [ops.convert_to_numpy(o) for o in keras.tree.flatten(out)]

    def refuse(how, training):
        raise ClippingError(
            f"{model.name}: the output for one example changes when another example of the batch "
            f"is {how} (training={training}): a layer mixes the examples of a batch (e.g. statistics "
            "or a mean over the batch axis), and the clipped per-example gradients would not be "
            "those of the computation the batch runs. Per-example clipping needs each example's "
            "output to depend on that example alone."
        )

    for training in (True, False):
        ref = run(xs, training)
        if any(len(o.shape) == 0 or o.shape[0] != rows for o in ref):
            raise ClippingError(f"{model.name}: every output must have one row per example (batch axis first)")
        for k in sorted({0, rows - 1}):
            out = run([_perturb_row(x, k, rng) for x in xs], training)
            if not all(_same(np.delete(a, k, 0), np.delete(b, k, 0)) for a, b in zip(ref, out)):
                refuse("perturbed", training)
            if not fixed_batch and rows > 1:
                out = run([np.delete(x, k, 0) for x in xs], training)
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
    and passes ``z = aW + b`` through ``probe``."""

    def __init__(self, layers):
        self.layers = list(layers)
        self.probe = lambda z: z
        self.records = []  # (layer, input)
        self._saved = []

    def __enter__(self):
        for layer in self.layers:
            self._saved.append((layer, layer.__dict__.get("call", _MISSING)))
            object.__setattr__(layer, "call", self._make_call(layer))
        return self

    def __exit__(self, *exc):
        for layer, old in reversed(self._saved):
            if old is _MISSING:
                object.__delattr__(layer, "call")
            else:
                object.__setattr__(layer, "call", old)
        self._saved = []
        self.records = []

    def _make_call(self, layer):
        def call(inputs, training=None):
            z = ops.matmul(inputs, layer.kernel)
            if layer.bias is not None:
                z = ops.add(z, layer.bias)
            self.records.append((layer, inputs))
            z = self.probe(z)
            return layer.activation(z) if layer.activation is not None else z

        return call

    def example_loss(self, loss):
        """``forward`` of `autodiff.weighted_per_example_gradients`: one example's
        loss, the inputs of the covered Dense calls as ``aux``."""
        def forward(call, probe, x, y):
            self.probe, self.records = probe, []
            value = ops.sum(per_example_loss(loss, y, call(x)))
            return value, [a for _, a in self.records]

        return forward


def _as_rows(t):
    """One example's rows: ``(batch, 1, ..., d) -> (batch, T, d)``."""
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
    ``min(1, C_l/‖g_il‖)``. Example ``i``'s gradient is that of the model run on
    example ``i`` alone (`autodiff.weighted_per_example_gradients`), so it
    depends on no other row of the batch: padding, repeated rows and layers that
    mix the batch axis cannot move the sum by more than ``C`` per example.
    Usable eagerly and inside a traced training step.

    Args:
        model: a DP model in clipping mode (compiled).
        x, y: one batch; weights: per-example weights in ``[0, 1]`` (default 1).
        ghost: use the ghost (book-keeping) norms for the Dense layers
            (`ghost_dense_layers`); ``False`` differentiates every variable.
    """
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

    dense = ghost_dense_layers(model) if ghost else []
    dense_ids = {id(layer) for layer in dense}
    others = [v for v in trainable if id(owners.get(id(v))) not in dense_ids]

    # One vectorized pass, each example alone: Dense inputs and output cotangents
    # (ghost norms), per-example gradients of every other variable.
    ctx = _GhostDense(dense)
    with ctx:
        inputs, cotangents, grads = autodiff.weighted_per_example_gradients(
            model, ctx.example_loss(model.loss), x, y, weights, others)
        called = [layer for layer, _ in ctx.records]

    sq = {}  # group -> (batch,) squared norms

    def add(g, value):
        sq[g] = value if g not in sq else sq[g] + value

    calls = {}
    for layer, a, g in zip(called, inputs, cotangents):
        entry = calls.setdefault(id(layer), (layer, [], []))
        entry[1].append(_as_rows(ops.cast(a, g.dtype)))
        entry[2].append(_as_rows(g))
    for key, (layer, a_list, g_list) in calls.items():
        a = ops.concatenate(a_list, axis=1) if len(a_list) > 1 else a_list[0]
        g = ops.concatenate(g_list, axis=1) if len(g_list) > 1 else g_list[0]
        calls[key] = (layer, a, g)
        add(group(layer.kernel), _kernel_sq_norms(a, g))
        if layer.bias is not None:
            add(group(layer.bias), ops.sum(ops.square(ops.sum(g, axis=1)), axis=1))
    for v, g in zip(others, grads):
        add(group(v), ops.sum(ops.square(ops.reshape(g, (batch, -1))), axis=1))

    factors = {}
    for g, s in sq.items():
        factors[g] = ops.minimum(1.0, norms[g] / ops.maximum(ops.sqrt(s), 1e-12))

    out = {v.path: ops.zeros(v.shape, v.dtype) for v in trainable}  # a Dense never called: 0
    for layer, a, g in calls.values():
        f = factors[group(layer.kernel)]
        out[layer.kernel.path] = ops.einsum("btd,btu->du", a * f[:, None, None], g)
        if layer.bias is not None:
            out[layer.bias.path] = ops.einsum("bu,b->u", ops.sum(g, axis=1), factors[group(layer.bias)])
    for v, g in zip(others, grads):
        out[v.path] = ops.tensordot(factors[group(v)], g, axes=1)
    return {v.path: ops.cast(out[v.path], v.dtype) for v in trainable}  # the variable's dtype


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
    "clipping_groups", "ghost_dense_layers", "group_clipping_norms", "total_clipping_norm",
]
