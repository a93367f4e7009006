"""Recipes: a private model and its training schedule from public facts only.

`recipe` takes what is public about a classification task (the input shape,
the number of classes, the number of training records ``N``, the target ε and
δ, and the method) and returns a `Recipe`: batch size, epochs, learning rate,
clipping or loss-gradient clipping values, τ and widths, each set by a rule
written below, and `Recipe.build`, which builds, compiles and calibrates the
model (`make_private`). It never sees the data's values, so choosing with it
costs no privacy.

The rules and their sources:

* **δ** (when not given): ``10^-(⌊log10 N⌋ + 2)``, below ``1/(10 N)``
  (Ponomareva et al. 2023, *How to DP-fy ML*, §5.2: δ ≪ 1/N).
* **batch size**: the power of two nearest ``8 √N``, within ``[32, N/4]`` and at
  most 4096. Larger batches raise the signal-to-noise ratio of each step at a
  fixed ε (Sander et al. 2023, *TAN without a burn*, §3; Ponomareva et al. §5.4);
  ``N/4`` keeps at least four steps per epoch.
* **epochs** (per-example clipping): 20, and ``20 · 2.5/ε`` (at most 60) below
  ε = 2.5: at a small ε the noise per step is large and more, noisier steps
  average it better at the same ε (Sander et al. §3: at a fixed total noise,
  quality improves with the number of steps; Ponomareva et al. §5.4.1).
  Clipless: 30.
* **optimizer**: Adam (Ponomareva et al. §5.4.2: adaptive optimisers are robust
  to the noise scale), learning rate 0.01.
* **per-example clipping** (``method="clipping"``, Abadi et al. 2016): an MLP
  ``Dense(w, relu) → Dense(classes)``, ``w`` the power of two nearest ``4 d``
  within ``[64, 512]`` (``d`` the input size); clipping norm ``C = 1`` and
  ``0.1`` from ε = 5 (a small C makes every example's gradient count with norm
  C, which helps when the noise is small; De et al. 2022 §3, Ponomareva §5.3).
* **Clipless** (``method="clipless"``, Béthune et al. 2024):
  ``DP_LayerCentering("all") → DP_BoundedInput(X) → DP_Flatten →
  [DP_QuickSpectralDense(w) → DP_GroupSort(2)] → DP_QuickSpectralDense(classes)
  → DP_ClipGradient(C)``, τ-cross-entropy.

  - Each example is centred on its own mean and projected onto the ball of
    radius ``X = max_norm / 8``: for data whose examples have norms above an
    eighth of the domain's bound this is per-example normalisation, which
    narrows the distribution of input norms (the paper's §3.1 and Fig. 15),
    and it stays 1-Lipschitz, so the model keeps its robustness certificate.
  - ``τ = 32 / X``, so that τ times the logits' scale is 32 (τ costs no privacy:
    the loss's bound is √2 for every τ; τ = 8 capped the non-private accuracy of
    the Lipschitz model on digits at 0.91, τ = 32 gave 0.98).
  - ``C = √2 / 50``: the gradient of the loss with respect to the logits is
    clipped to the same small norm for every example (measured: the bound of
    the unclipped τ-cross-entropy was twice the real gradient norms, so half the
    noise was wasted); the bound pass starts from ``C``, so the noise shrinks
    with it, and Adam is invariant to the gradient's scale.
  - No hidden layer (``w = 0``, a linear Lipschitz model) below N = 10 000: on
    digits every hidden layer tried lost to it at every ε; above, one hidden
    layer of width ``w`` (as for clipping), without bias (a bias's radius adds
    to the hidden layer's norm bound and so to the noise).
* ``method="auto"``: Clipless. On digits it is as accurate as per-example
  clipping at every ε measured and 3× faster per run, since it computes no
  per-example gradient (``benchmarks/recipes_digits.py``).

The rules were set on scikit-learn's digits (N = 1437) and measured on its
breast-cancer data (N = 455), where they do not work (see the README's
"Measured results"): they are a starting point, not a guarantee of accuracy.
"""

import math

METHODS = ("auto", "clipless", "clipping")

#: the largest batch size a recipe picks
MAX_BATCH_SIZE = 4096
#: Clipless: inputs are projected onto the ball of radius ``max_norm / INPUT_BOUND_FRACTION``
INPUT_BOUND_FRACTION = 8.0
#: Clipless: τ · input_bound
TAU_TIMES_BOUND = 32.0
#: Clipless: a hidden layer from this many training records on
CLIPLESS_HIDDEN_MIN_SAMPLES = 10_000


class Recipe:
    """A model and schedule chosen by `recipe` (see the module docstring for the rules).

    Attributes: ``method``, ``input_shape``, ``nb_classes``, ``nb_samples``,
    ``target_epsilon``, ``delta``, ``batch_size``, ``epochs``, ``learning_rate``,
    ``width``, ``clipping_norm`` (clipping), ``tau``, ``loss_clip`` and
    ``input_bound`` (Clipless), and ``rules`` (name -> the rule that set it).
    """

    def __init__(self, **values):
        self.rules = values.pop("rules")
        self.__dict__.update(values)

    def metadata(self):
        """The `DatasetMetadata` of the recipe (``N``, ``b``, shapes)."""
        from kdp.metadata import DatasetMetadata

        return DatasetMetadata(self.input_shape, self.nb_classes, self.nb_samples,
                               self.batch_size, max_norm=self.max_norm)

    def build(self, seed=None):
        """A compiled DP model, calibrated with ``make_private(target_epsilon, epochs)``
        (so ``target_epsilon`` is also its budget). ``seed`` seeds the
        initialisation only (the noise always uses the OS entropy)."""
        import keras

        from kdp.model import DP_Sequential, DPParameters

        if seed is not None:
            keras.utils.set_random_seed(seed)
        layers, loss = (self._clipping_layers() if self.method == "clipping"
                        else self._clipless_layers())
        params = dict(delta=self.delta)
        if self.method == "clipping":
            params["clipping_norm"] = self.clipping_norm
        else:
            params["noisify_strategy"] = "global"
        model = DP_Sequential(layers, dp_parameters=DPParameters(**params),
                              dataset_metadata=self.metadata(), name=f"dp_{self.method}_recipe")
        model.compile(optimizer=keras.optimizers.Adam(self.learning_rate), loss=loss,
                      metrics=["accuracy"])
        model.make_private(target_epsilon=self.target_epsilon, epochs=self.epochs)
        return model

    def _clipping_layers(self):
        import keras

        return ([keras.Input(self.input_shape), keras.layers.Flatten(),
                 keras.layers.Dense(self.width, activation="relu"),
                 keras.layers.Dense(self.nb_classes)],
                keras.losses.SparseCategoricalCrossentropy(from_logits=True))

    def _clipless_layers(self):
        import keras

        from kdp import layers as L
        from kdp import losses

        hidden = ([L.DP_QuickSpectralDense(self.width), L.DP_GroupSort(2)] if self.width else [])
        return ([keras.Input(self.input_shape), L.DP_LayerCentering(axes="all"),
                 L.DP_BoundedInput(upper_bound=self.input_bound), L.DP_Flatten(), *hidden,
                 L.DP_QuickSpectralDense(self.nb_classes), L.DP_ClipGradient(self.loss_clip)],
                losses.DP_TauCategoricalCrossentropy(self.tau))

    def describe(self):
        """The chosen values, one line each, with the rule that set them."""
        return "\n".join(f"{name} = {getattr(self, name)!r}: {rule}"
                         for name, rule in self.rules.items())

    def __repr__(self):
        values = ", ".join(f"{k}={getattr(self, k)!r}" for k in self.rules)
        return f"Recipe({values})"


def recipe(input_shape, nb_classes, nb_samples, target_epsilon, delta=None, method="auto",
           max_norm=None):
    """Choose a private model and schedule from public facts (rules in the module docstring).

    Args:
        input_shape: the shape of one example.
        nb_classes: the number of classes (≥ 2).
        nb_samples: ``N``, the number of training records.
        target_epsilon: ε > 0 to reach at the end of training.
        delta: δ in ``(0, 1/N)``; default ``10^-(⌊log10 N⌋ + 2)``.
        method: ``"clipless"``, ``"clipping"`` or ``"auto"``.
        max_norm: a public bound on every input's L2 norm (the domain's, e.g.
            ``√d`` for pixels in [0, 1]); the model refuses inputs above it.
            Clipless projects each centred input onto radius ``max_norm / 8``
            (``1/8`` without it).

    Returns:
        A `Recipe`; ``recipe(...).build()`` gives the calibrated, compiled model
        and ``.epochs`` the number of epochs to pass to ``fit``.
    """
    input_shape = tuple(int(d) for d in input_shape)
    n, classes = int(nb_samples), int(nb_classes)
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if not (target_epsilon > 0 and math.isfinite(target_epsilon)):
        raise ValueError(f"target_epsilon must be a finite number > 0, got {target_epsilon}")
    if classes < 2:
        raise ValueError(f"nb_classes must be >= 2, got {nb_classes}")
    if n < 8:
        raise ValueError(f"nb_samples must be >= 8 for a private training, got {nb_samples}")
    if delta is None:
        delta = 10.0 ** -(math.floor(math.log10(n)) + 2)
    if not 0 < delta < 1.0 / n:
        raise ValueError(f"delta must be in (0, 1/N) = (0, {1.0 / n:.3g}), got {delta}")
    if max_norm is not None and not max_norm > 0:
        raise ValueError(f"max_norm must be > 0, got {max_norm}")

    batch_size = _power_of_two(8 * math.sqrt(n), 32, min(MAX_BATCH_SIZE, n // 4))
    if method == "auto":
        method = "clipless"
    epochs = int(round(min(60, 20 * max(1.0, 2.5 / target_epsilon))))
    d = math.prod(input_shape)
    values = dict(method=method, input_shape=input_shape, nb_classes=classes, nb_samples=n,
                  target_epsilon=float(target_epsilon), delta=float(delta),
                  batch_size=batch_size, epochs=epochs, max_norm=max_norm)
    rules = {
        "method": "as asked; auto: Clipless",
        "delta": "given, or 10^-(floor(log10 N) + 2) < 1/(10 N)",
        "batch_size": "the power of two nearest 8 sqrt(N), in [32, min(N/4, 4096)]",
        "epochs": "clipping: 20, and 20 * 2.5/epsilon (at most 60) below epsilon = 2.5",
    }
    if method == "clipping":
        values.update(width=_power_of_two(4 * d, 64, 512), learning_rate=1e-2,
                      clipping_norm=1.0 if target_epsilon < 5 else 0.1)
        rules.update(width="the power of two nearest 4 d, in [64, 512]",
                     learning_rate="Adam 0.01",
                     clipping_norm="1, and 0.1 from epsilon = 5")
    else:
        input_bound = (1.0 if max_norm is None else max_norm) / INPUT_BOUND_FRACTION
        values.update(width=0 if n < CLIPLESS_HIDDEN_MIN_SAMPLES else _power_of_two(4 * d, 64, 512),
                      learning_rate=1e-2, epochs=30, input_bound=input_bound,
                      tau=TAU_TIMES_BOUND / input_bound, loss_clip=math.sqrt(2.0) / 50)
        rules.update(width="0 (a linear Lipschitz model) below N = 10000, else the power of two "
                           "nearest 4 d in [64, 512], no bias",
                     learning_rate="Adam 0.01", epochs="Clipless: 30",
                     input_bound="each example centred on its own mean, then projected onto "
                                 "the ball of radius max_norm/8 (1/8 without max_norm)",
                     tau="32 / input_bound (tau times the logits' scale = 32)",
                     loss_clip="L/50 = sqrt(2)/50: every example's logit gradient clipped "
                               "to the same small norm")
    return Recipe(rules=rules, **values)


def _power_of_two(x, lo, hi):
    """The power of two nearest ``x`` (in log scale), clamped to ``[lo, hi]``."""
    value = 2 ** int(round(math.log2(max(x, 1.0))))
    return int(max(lo, min(hi, value)))
