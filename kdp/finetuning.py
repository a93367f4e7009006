"""Fine-tuning a pretrained Keras model with per-example clipping, from public facts.

`fine_tuning_recipe` takes what is public about a private fine-tuning (the
number of private examples ``N``, the target ε and δ, and the number of
trainable parameters of each part one could train) and returns a
`FineTuningRecipe`: the part to train, the clipping norm, batch size, epochs,
learning rate and the noise multiplier σ, each with its source
(`FineTuningRecipe.describe`). `FineTuningRecipe.apply` makes a Keras model
train that part only, wraps it in `kdp.DP_Model`, compiles it and calibrates it
with ``make_private``. It never sees the data, so choosing with it costs no
privacy (the pretraining data must be public).

The rules and their sources:

* **δ** (when not given): ``10^-(⌊log10 N⌋ + 2)`` < ``1/(10 N)``, as
  `kdp.recipes` (Ponomareva et al. 2023, §5.2: δ ≪ 1/N).
* **batch size**: the power of two nearest ``8 √N`` in ``[32, min(N/4, 4096)]``,
  `kdp.recipes`' rule (Sander et al. 2023: larger batches raise the
  signal-to-noise ratio at a fixed ε). Li et al. (2022) and De et al. (2022)
  both fine-tune with large batches; De et al. use 4096, the rule's cap.
* **epochs**: `kdp.recipes.clipping_epochs` (kdp's default: 20, and
  ``20 · 2.5/ε``, at most 60, below ε = 2.5). Not taken from the papers.
* **σ**: the smallest noise multiplier whose ``epochs · ⌈N/b⌉`` Poisson steps
  at rate ``b/N`` cost at most ε at δ with kdp's accountant (the smaller of PLD
  and RDP, `kdp.privacy.calibrate_noise_multiplier`), the σ that
  ``make_private`` sets for the same schedule.
* **what to train** (``train="auto"``): the largest of ``"all"``, ``"lora"``,
  ``"head"`` (among those whose parameter count is given) for which the
  expected norm of the noise on the averaged clipped gradient, ``σ C √d / b``
  for ``d`` trained parameters, is at most ``C``, the largest norm of the
  averaged signal; ``"head"`` if none. This is kdp's rule. Its motivation:
  the noise grows with ``√d`` while the clipped signal does not, so fewer
  trained parameters suffer less from it (Yu et al. 2022 train low-rank
  adapters, LoRA, for that reason; Tramèr and Boneh 2021 train linear models
  on fixed features). Li et al. (2022) show that full fine-tuning of large
  pretrained language models works well despite ``d``: the rule is
  conservative for them. A smaller ε never gives a larger part (σ only grows).
  It is a default, not a measured optimum: on the digits demonstration
  (``benchmarks/bench_finetune.py``, a small MLP pretrained on other classes)
  full fine-tuning beat its choice at ε = 1, 3 and 8 (0.922 / 0.950 / 0.970
  against 0.726 / 0.760 for the head and 0.944 for LoRA). With a convnet
  pretrained on 6,000 generated letters and fine-tuned on the ten digits
  (``--public letters --architecture convnet``), its choice beat DP training
  from scratch at ε = 3 and 8 in 8 seeds of 8 (+0.036, +0.038) and at ε = 1
  in 5 of 8 (+0.012 ± 0.032).
* **clipping norm**: ``C = 0.1`` for ``"lora"`` and ``"all"`` (Li et al. 2022
  fine-tune with a small C such as 0.1, where nearly every gradient is clipped
  and the update is close to a mean of normalised gradients); ``C = 1`` for
  ``"head"`` (De et al. 2022 use C = 1; also `kdp.recipes`' default).
* **learning rate**: Adam at ``1e-2`` for every part, `kdp.recipes`' rate for a
  model trained with clipping (kdp's default, not from the papers). Adam at
  ``1e-3`` for ``"lora"`` and ``"all"`` was measured first and lost: on the
  digits demonstration (``benchmarks/bench_finetune.py``, ε = 1) LoRA and full
  fine-tuning reached 0.401 and 0.506 with it, as its 200 steps barely
  trained the new head.
* **LoRA rank**: 4 (kdp's default; Yu et al. 2022 use small ranks).

References: D. Yu et al. *Differentially Private Fine-tuning of Language Models*,
ICLR 2022 (arXiv:2110.06500); X. Li, F. Tramèr, P. Liang, T. Hashimoto. *Large
Language Models Can Be Strong Differentially Private Learners*, ICLR 2022
(arXiv:2110.05679); S. De, L. Berrada, J. Hayes, S. L. Smith, B. Balle.
*Unlocking High-Accuracy Differentially Private Image Classification through
Scale*, 2022 (arXiv:2204.13650); F. Tramèr, D. Boneh. *Differentially Private
Learning Needs Better Features (or Much More Data)*, ICLR 2021
(arXiv:2011.11660); T. Sander, P. Stock, A. Sablayrolles. *TAN Without a Burn*,
ICML 2023 (arXiv:2210.03403); N. Ponomareva et al. *How to DP-fy ML*, JAIR 2023
(arXiv:2303.00654).
"""

import dataclasses
import functools
import math

__all__ = ["FineTuningRecipe", "fine_tuning_recipe", "parameter_counts", "PARTS"]

PARTS = ("head", "lora", "all")
"""The parts one can train, smallest first."""
#: LoRA's rank (kdp's default)
LORA_RANK = 4
#: clipping norm per part
CLIPPING_NORMS = {"head": 1.0, "lora": 0.1, "all": 0.1}
#: Adam's learning rate per part (kdp's defaults)
LEARNING_RATES = {"head": 1e-2, "lora": 1e-2, "all": 1e-2}

_SOURCES = {
    "delta": "given, or 10^-(floor(log10 N) + 2) < 1/(10 N) (kdp.recipes; Ponomareva et al. "
             "2023, 5.2)",
    "batch_size": "the power of two nearest 8 sqrt(N), in [32, min(N/4, 4096)] (kdp.recipes; "
                  "Sander et al. 2023; large batches as in Li et al. 2022 and De et al. 2022)",
    "epochs": "kdp default (kdp.recipes.clipping_epochs): 20, and 20 * 2.5/epsilon (at most "
              "60) below epsilon = 2.5",
    "noise_multiplier": "kdp's accountant (min of PLD and RDP, Poisson sampling): the "
                        "smallest sigma whose epochs * ceil(N/b) steps reach at most epsilon",
    "clipping_norm": "head: 1 (De et al. 2022); lora and all: 0.1 (Li et al. 2022)",
    "learning_rate": "kdp default: Adam 1e-2 for every part (kdp.recipes' rate with "
                     "clipping)",
    "lora_rank": "kdp default (Yu et al. 2022 train low-rank adapters of small rank)",
}


@dataclasses.dataclass(frozen=True)
class FineTuningRecipe:
    """The choices of `fine_tuning_recipe` (rules and sources in the module docstring).

    Attributes: ``train`` (``"head"``, ``"lora"`` or ``"all"``), ``nb_samples``,
    ``target_epsilon``, ``delta``, ``batch_size``, ``epochs``, ``noise_multiplier``
    (σ for this schedule with kdp's accountant), ``clipping_norm``,
    ``learning_rate``, ``lora_rank``, ``parameters`` (the trained parameter count,
    or None), ``noise_to_signal`` (``σ √d / b``, or None) and ``train_source``
    (why this part).
    """

    train: str
    nb_samples: int
    target_epsilon: float
    delta: float
    batch_size: int
    epochs: int
    noise_multiplier: float
    clipping_norm: float
    learning_rate: float
    lora_rank: int
    parameters: int | None
    noise_to_signal: float | None
    train_source: str

    @property
    def steps(self):
        """The number of training steps, ``epochs · ⌈N/b⌉``."""
        return self.epochs * math.ceil(self.nb_samples / self.batch_size)

    @property
    def sampling_rate(self):
        """The Poisson sampling rate ``b/N``."""
        return self.batch_size / self.nb_samples

    def describe(self):
        """Each choice, one line each: its value and its source."""
        lines = [f"train = {self.train!r}: {self.train_source}"]
        for name in ("delta", "batch_size", "epochs", "noise_multiplier", "clipping_norm",
                     "learning_rate", "lora_rank"):
            value = getattr(self, name)
            shown = f"{value:.4g}" if isinstance(value, float) else repr(value)
            lines.append(f"{name} = {shown}: {_SOURCES[name]}")
        return "\n".join(lines)

    def dp_parameters(self, **overrides):
        """The `kdp.DPParameters` of the recipe (δ, C, σ; ``overrides`` replace any)."""
        from kdp.model import DPParameters

        values = dict(delta=self.delta, clipping_norm=self.clipping_norm,
                      noise_multiplier=self.noise_multiplier)
        return DPParameters(**{**values, **overrides})

    def apply(self, model, loss, nb_classes=None, input_shape=None, head=None, metrics=None,
              optimizer=None, **dp_overrides):
        """Make ``model`` train the recipe's part, wrap, compile and calibrate it.

        ``"head"`` freezes every top-level layer but ``head``; ``"lora"`` enables
        LoRA (rank ``lora_rank``) on every `Dense` and `EinsumDense` layer outside
        ``head`` and freezes their other weights and every other layer outside it;
        ``"all"`` trains everything. The model is then wrapped in `kdp.DP_Model`
        (its graph and weights as they are), compiled with Adam at
        ``learning_rate`` and calibrated with ``make_private(target_epsilon,
        epochs)``.

        Args:
            model: a functional Keras model (e.g. a keras_hub task model, or a
                pretrained backbone with a new head); its layers are changed in place.
            loss: a per-example Keras loss.
            nb_classes: the number of classes (default: the last output's width).
            input_shape: one example's shape (default: that of ``model.inputs[0]``;
                required when it is dynamic, e.g. ``(sequence_length,)`` for keras_hub).
            head: the name(s) of the top-level layers of the head (default: the
                last top-level layer with weights).
            metrics: Keras metrics for ``compile``.
            optimizer: default ``keras.optimizers.Adam(learning_rate)``.
            **dp_overrides: replace fields of `dp_parameters` (e.g. ``seed``).

        Returns:
            The compiled `kdp.DP_Model`, calibrated so that ``fit(x, y,
            epochs=recipe.epochs)`` reaches at most ``target_epsilon``.
        """
        import keras

        from kdp.metadata import DatasetMetadata
        from kdp.model import DP_Model

        heads = _head_layers(model, head)
        if self.train == "lora" and not _lora_layers(model, heads):
            raise ValueError(f"{model.name} has no Dense or EinsumDense layer outside its head for "
                             "LoRA adapters (Keras' LoRA covers those layers): train='lora' would "
                             "train the head alone; use train='head' or 'all'")
        _set_trainable(model, self.train, heads, self.lora_rank)
        if input_shape is None:
            input_shape = tuple(model.inputs[0].shape[1:])
            if None in input_shape:
                raise ValueError(f"{model.name}'s first input has a dynamic shape "
                                 f"{input_shape}: pass input_shape (e.g. (sequence_length,))")
        if nb_classes is None:
            nb_classes = max(2, int(model.outputs[-1].shape[-1]))
        md = DatasetMetadata(input_shape=input_shape, nb_classes=nb_classes,
                             nb_samples_train=self.nb_samples, batch_size=self.batch_size)
        dp_model = DP_Model(model.input, model.output, dp_parameters=self.dp_parameters(**dp_overrides),
                            dataset_metadata=md, name=f"dp_finetune_{self.train}")
        dp_model.compile(optimizer=optimizer or keras.optimizers.Adam(self.learning_rate),
                         loss=loss, metrics=metrics)
        dp_model.make_private(target_epsilon=self.target_epsilon, epochs=self.epochs)
        return dp_model


def fine_tuning_recipe(nb_samples, target_epsilon, delta=None, train="auto", parameters=None,
                       lora_rank=LORA_RANK):
    """Choose a private fine-tuning from public facts (rules in the module docstring).

    Args:
        nb_samples: ``N``, the number of private training examples.
        target_epsilon: ε > 0 to reach at the end of fine-tuning.
        delta: δ in ``(0, 1/N)``; default ``10^-(⌊log10 N⌋ + 2)``.
        train: ``"head"``, ``"lora"``, ``"all"``, or ``"auto"`` (the largest part,
            among those of ``parameters``, whose noise-to-signal ratio
            ``σ √d / b`` is at most 1).
        parameters: ``{part: number of trained parameters}`` (`parameter_counts`
            gives it for a Keras model); required for ``"auto"``.
        lora_rank: LoRA's rank.

    Returns:
        A `FineTuningRecipe`.
    """
    from kdp.recipes import _power_of_two, clipping_epochs, MAX_BATCH_SIZE

    n = int(nb_samples)
    if n < 8:
        raise ValueError(f"nb_samples must be >= 8 for a private training, got {nb_samples}")
    if not (target_epsilon > 0 and math.isfinite(target_epsilon)):
        raise ValueError(f"target_epsilon must be a finite number > 0, got {target_epsilon}")
    if train not in (*PARTS, "auto"):
        raise ValueError(f"train must be one of {(*PARTS, 'auto')}, got {train!r}")
    parameters = dict(parameters or {})
    unknown = set(parameters) - set(PARTS)
    if unknown:
        raise ValueError(f"parameters' keys must be among {PARTS}, got {sorted(unknown)}")
    if train == "auto" and not parameters:
        raise ValueError("train='auto' needs parameters={part: count} (kdp.finetuning."
                         "parameter_counts(model) gives it)")
    if delta is None:
        delta = 10.0 ** -(math.floor(math.log10(n)) + 2)
    if not 0 < delta < 1.0 / n:
        raise ValueError(f"delta must be in (0, 1/N) = (0, {1.0 / n:.3g}), got {delta}")
    batch_size = _power_of_two(8 * math.sqrt(n), 32, min(MAX_BATCH_SIZE, n // 4))
    epochs = clipping_epochs(target_epsilon)
    steps = epochs * math.ceil(n / batch_size)
    sigma = _noise_multiplier(float(target_epsilon), batch_size / n, steps, float(delta))

    def ratio(part):
        return sigma * math.sqrt(parameters[part]) / batch_size

    if train == "auto":
        fits = [p for p in PARTS if p in parameters and ratio(p) <= 1.0]
        train = fits[-1] if fits else "head"
        source = ("chosen automatically (kdp's rule): the largest part whose expected noise norm "
                  "sigma C sqrt(d) / b is at most C (" + ", ".join(
                      f"{p}: {ratio(p):.3g}" for p in PARTS if p in parameters)
                  + "); fewer parameters, less noise (Yu et al. 2022; Tramer and Boneh 2021)")
    else:
        source = "as asked"
    count = parameters.get(train)
    return FineTuningRecipe(
        train=train, nb_samples=n, target_epsilon=float(target_epsilon), delta=float(delta),
        batch_size=batch_size, epochs=epochs, noise_multiplier=sigma,
        clipping_norm=CLIPPING_NORMS[train], learning_rate=LEARNING_RATES[train],
        lora_rank=int(lora_rank), parameters=count,
        noise_to_signal=None if count is None else ratio(train), train_source=source)


@functools.lru_cache(maxsize=256)
def _noise_multiplier(target_epsilon, sampling_rate, steps, delta):
    """σ from kdp's accountant (`kdp.privacy.calibrate_noise_multiplier`), cached."""
    from kdp.privacy import calibrate_noise_multiplier

    return float(calibrate_noise_multiplier(target_epsilon, sampling_rate, steps, delta))


def parameter_counts(model, head=None, lora_rank=LORA_RANK):
    """``{part: trained parameters}`` for ``model`` (nothing is changed): ``"head"``
    (the weights of the ``head`` layers, default the last top-level layer with
    weights), ``"lora"`` (the head and rank-``lora_rank`` adapters of every
    `Dense` and `EinsumDense` layer outside it; left out when there is none, e.g.
    a convnet, where it would train the head alone) and ``"all"`` (every weight)."""
    heads = _head_layers(model, head)
    count = sum(math.prod(v.shape) for layer in heads for v in layer.weights)
    counts = {"head": int(count), "all": int(sum(math.prod(v.shape) for v in model.weights))}
    adapted = _lora_layers(model, heads)
    if adapted:
        counts["lora"] = int(count + sum(lora_rank * (math.prod(layer.kernel.shape[:-1]) + layer.kernel.shape[-1])
                                         for layer in adapted))
    return counts


def _head_layers(model, head):
    if head is None:
        with_weights = [layer for layer in model.layers if layer.weights]
        if not with_weights:
            raise ValueError(f"{model.name} has no layer with weights")
        return [with_weights[-1]]
    names = [head] if isinstance(head, str) else list(head)
    return [model.get_layer(name) for name in names]


def _inside(layer, heads):
    return any(layer is h or layer in h._flatten_layers() for h in heads)


def _lora_layers(model, heads):
    import keras

    return [layer for layer in model._flatten_layers(include_self=False)
            if isinstance(layer, (keras.layers.Dense, keras.layers.EinsumDense))
            and not _inside(layer, heads)]


def _set_trainable(model, train, heads, rank):
    """Set which variables of ``model`` train for ``train`` (see `FineTuningRecipe.apply`)."""
    model.trainable = True
    for layer in model._flatten_layers(include_self=False):
        layer.trainable = True
    if train == "all":
        return
    for layer in model.layers:
        if not any(layer is h for h in heads):
            layer.trainable = False
    if train == "head":
        return
    for layer in _lora_layers(model, heads):
        layer.trainable = True
        if not getattr(layer, "lora_enabled", False):
            layer.enable_lora(rank)
        for variable in layer.weights:
            if "lora" not in variable.path.split("/")[-1]:
                variable.trainable = False
