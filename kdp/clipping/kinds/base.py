"""The registry of layer kinds and the probes that record their calls.

A kind (`Kind`) names the layers it covers, replaces their ``call`` by one that
records what its per-example norm needs and passes one tensor ``z`` through the
probe of `kdp.autodiff.weighted_per_example_gradients` (whose cotangent ``G``
comes back), and turns (records, cotangents) into per-example squared norms and
the reweighted sum ``Σ_i c_i g_i``, without per-example gradients where they are
large ("ghost" / book-keeping clipping: Goodfellow 2015; Li et al. 2022, "Large
language models can be strong differentially private learners"; Bu et al.
2023, "Differentially private optimization on large model at small cost").
"""

from keras import ops

from kdp.clipping.loss import per_example_loss

KINDS = []


def register(kind):
    """Class decorator: adds an instance of the `Kind` subclass ``kind`` to the registry."""
    KINDS.append(kind())
    return kind


def kind_of(layer):
    """The registered `Kind` covering ``layer``, or ``None`` (per-example gradients)."""
    for kind in KINDS:
        if kind.covers(layer):
            return kind
    return None


def ghost_layers(model):
    """The layers of ``model`` whose per-example norms come from their registered
    kind (`kdp.clipping.kinds`), wherever they are called (also from inside
    another layer's ``call``, on any number of rows per example). Their
    variables get no per-example gradients."""
    return [layer for layer in model._flatten_layers(include_self=False) if kind_of(layer) is not None]


def plain(layer):
    """Built, with weights, all of them trainable, neither quantized nor LoRA-adapted:
    a LoRA layer's frozen kernel enters its forward pass, which the kinds do
    not model, so it is left to per-example gradients."""
    return (
        layer.built
        and bool(layer.trainable_weights)
        and len(layer.trainable_weights) == len(layer.weights)
        and not getattr(layer, "lora_enabled", False)
        and getattr(layer, "quantization_mode", None) is None
    )


class Kind:
    """One layer kind.

    Subclasses set ``layer_type`` (covered on an exact type match, `plain`) or
    override `covers`, give `call` and either `gradients` (per-example
    gradients, for small variables) or `per_example`, `sq_norms` and
    `weighted_sums`. A layer called several times in one example's pass gives
    one ``(aux, cotangent)`` pair per call, in call order; every array has a
    leading batch axis.
    """

    layer_type = None

    def covers(self, layer):
        return type(layer) is self.layer_type and plain(layer)

    def call(self, layer, record):
        """The replacement of ``layer.call``, in which ``record(aux, z)`` keeps
        ``aux`` (one tensor) and returns ``probe(z)``."""
        raise NotImplementedError

    def gradients(self, layer, calls):
        """``{variable.path: per-example gradients (batch, *variable.shape)}``."""
        raise NotImplementedError

    def per_example(self, layer, calls):
        """What `sq_norms` and `weighted_sums` need of the recorded calls."""
        return self.gradients(layer, calls)

    def sq_norms(self, layer, state):
        """Per-example squared norms of the gradient of all ``layer``'s variables, ``(batch,)``."""
        return sum(sum_squares(g) for g in state.values())

    def weighted_sums(self, layer, state, c):
        """``{variable.path: Σ_i c_i g_i}`` for per-example factors ``c`` ``(batch,)``."""
        return {p: ops.tensordot(ops.cast(c, g.dtype), g, axes=1) for p, g in state.items()}


def sum_squares(t):
    """``Σ t_i²`` over every axis but the first."""
    return ops.sum(ops.square(ops.reshape(t, (ops.shape(t)[0], -1))), axis=1)


def reduce_to(t, shape):
    """Per-example gradient of a parameter of shape ``shape`` broadcast (right-aligned)
    onto ``t``'s per-example shape: ``t (batch, *full)`` summed over the
    broadcast axes, ``(batch, *shape)``."""
    full = t.shape[1:]
    target = (1,) * (len(full) - len(shape)) + tuple(shape)
    axes = tuple(k + 1 for k, (n, m) in enumerate(zip(target, full)) if n == 1 and m != 1)
    if axes:
        t = ops.sum(t, axis=axes, keepdims=True)
    return ops.reshape(t, (-1, *shape))


def add_up(calls, fn):
    """``Σ_calls fn(aux, cotangent)``: a variable's gradient over a layer's calls."""
    total = None
    for a, g in calls:
        part = fn(a, g)
        total = part if total is None else total + part
    return total


_MISSING = object()


class Probes:
    """Within it, the ``call`` of every covered layer is its kind's (`Kind.call`):
    it records ``(layer, aux)`` and passes one tensor through ``probe``."""

    def __init__(self, layers):
        self.layers = [(layer, kind_of(layer)) for layer in layers]
        self.probe = lambda z: z
        self.records = []  # (layer, aux)
        self._saved = []

    def __enter__(self):
        for layer, kind in self.layers:
            self._saved.append((layer, layer.__dict__.get("call", _MISSING)))
            object.__setattr__(layer, "call", kind.call(layer, self._recorder(layer)))
        return self

    def __exit__(self, *exc):
        for layer, old in reversed(self._saved):
            if old is _MISSING:
                object.__delattr__(layer, "call")
            else:
                object.__setattr__(layer, "call", old)
        self._saved = []
        self.records = []

    def _recorder(self, layer):
        def record(aux, z):
            self.records.append((layer, aux))
            return self.probe(z)

        return record

    def called(self):
        """The covered layers in the order the latest example run called them, one entry per call."""
        return [layer for layer, _ in self.records]

    def example_loss(self, loss):
        """``forward`` of `autodiff.weighted_per_example_gradients`: one example's
        loss; as ``aux`` the records of the covered layers' calls, then the
        example's outputs (the model's predictions for it)."""
        def forward(call, probe, x, y):
            self.probe, self.records = probe, []
            outputs = call(x)
            value = ops.sum(per_example_loss(loss, y, outputs))
            return value, [a for _, a in self.records] + [outputs]

        return forward
