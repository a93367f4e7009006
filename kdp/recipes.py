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
  A table's MLP (per-example clipping, every table): 60 at every ε, as 20
  under-trains a large table: gen_50k_3c's MLP reached 0.804 / 0.808 at
  ε = 3 / 8 in 20 epochs, below its own 0.818 at ε = 1 in 50, and 60 epochs
  moved gen_20k_5c from 0.677 / 0.687 to 0.740 / 0.772; leave-one-dataset-out
  selection over the suite's tables picks 60 for every held-out table
  (``python benchmarks/recipes_suite.py``, 2026-11-27). Clipless: 30.
* **optimizer**: Adam (Ponomareva et al. §5.4.2: adaptive optimisers are robust
  to the noise scale), learning rate 0.01, and 0.03 for a table's MLP
  (`TABLE_MLP_LEARNING_RATE`). At 0.01 the MLP is under-trained at a small ε:
  it ranks well but predicts near the majority class (gen_2k_lin at ε = 1:
  accuracy 0.727 for a 0.700 majority, AUROC 0.938), its mean predicted
  probability far below the positive rate (0.17 for 0.30). Among 0.01, 0.03
  and 0.1, leave-one-dataset-out selection over the suite's twelve tables
  picks 0.03 for every held-out table (mean accuracy / AUROC 0.828 / 0.927
  against 0.806 / 0.919 at 0.01, 0.798 / 0.906 at 0.1), e.g. gen_2k_lin
  0.858 at ε = 1, gen_4k_2c 0.832 / 0.881 / 0.909, iris 0.847 / 0.934 / 0.976
  (``python benchmarks/recipes_suite.py``, 2026-11-27).
* **features** (``features="auto"``, the default): images of at least 8×8
  pixels (shape ``(H, W)`` or ``(H, W, C)``, or a square grey image flattened
  with ``kind="image"``) go through fixed, data-independent features first: a
  scattering transform (`kdp.layers.DP_Scattering2D`, J = 2, 8 angles,
  non-expansive) and a per-example normalisation of each of its channels
  (`kdp.layers.DP_GroupNormalization`, output norm ``√n``), the "ScatterNet +
  GroupNorm + linear" of Tramèr and Boneh (2021), followed by a linear model.
  Below 12 pixels a side, where J = 2 leaves at most 2×2 positions, the
  pixels themselves, standardised per example as one group, go next to them
  (``"scattering+pixels"``, `kdp.layers.DP_ConcatFeatures`). Smaller images
  (no image of under 8 pixels a side was measured) and tables use none.
  ``Recipe.feature_extractor()`` computes the features once (no privacy cost:
  each example's depend on it alone), and ``build(on_features=True)`` the
  model that trains on them. Chosen leave-one-dataset-out on the suite's
  eight image sets of 8×8 to 28×28 pixels (``benchmarks/recipes_suite.py``):
  all eight folds picked this rule among eleven (mean accuracy 0.897,
  against 0.894 with the pixels at every size, 0.882 for scattering alone,
  0.822 for the former "scattering from 16 pixels, Clipless on pixels
  below" and 0.758 for Clipless on pixels). On the three 8×8 sets the pixels
  add 0.02–0.06 (digits: 0.908 / 0.942 / 0.955 at ε = 1 / 3 / 8, against
  0.881 / 0.921 / 0.936 for scattering alone and 0.887 / 0.936 / 0.950 for
  Clipless on pixels); on the 12×12 sets scattering gains 0.20–0.26 over
  Clipless on pixels.
* **per-example clipping** (``method="clipping"``, Abadi et al. 2016): an MLP
  ``Dense(w, relu) → Dense(classes)``, ``w`` the power of two nearest ``4 d``
  within ``[64, 512]`` (``d`` the input size), or a linear model on scattering
  features; clipping norm ``C = 1``, and for images ``0.1`` from ε = 5 (a
  small C makes every example's gradient count with norm C, which helps when
  the noise is small; De et al. 2022 §3, Ponomareva §5.3). Tables keep
  ``C = 1``: a logistic regression's row gradient ``|p − y|·‖(x, 1)‖`` is often
  below 1, and clipping every row to the same small norm whatever its loss
  pushed three of the suite's seven tables to the majority class at ε = 8
  (measured with the linear models tables had then).
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
  - Images: no hidden layer (``w = 0``, a linear Lipschitz model) below
    N = 10 000: on digits every hidden layer tried lost to it at every ε;
    above, one hidden layer of width ``w`` (as for clipping), without bias (a
    bias's radius adds to the hidden layer's norm bound and so to the noise).
    Tables: that hidden layer at every size (below).
* **a moving average of the weights** (images): the model ends training on an
  exponential moving average of its noisy iterates (Keras' ``use_ema``),
  momentum ``1 − 10/T`` for ``T`` steps within ``[0.9, 0.999]`` (the last ≈ T/10
  steps; De et al. 2022, §3: averaging is post-processing, it costs no
  privacy); `fit` projects the average back onto the Lipschitz layers' sets.
  On the suite's eight image sets it raised the accuracy of Clipless on
  pixels on every set (by 0.001–0.041) and left the scattering models' where
  it was (0.882 on average with and without it, each set within 0.011). A
  table's MLP (per-example clipping, Adam 0.03) has it too: leave-one-dataset-out
  selection over the suite's twelve tables picks it for every held-out table
  (mean accuracy / AUROC 0.831 / 0.928 against 0.828 / 0.927 without; at
  Adam 0.01 it loses, 0.804 / 0.917 against 0.806 / 0.919;
  ``python benchmarks/recipes_suite.py``, 2026-11-28). A Clipless table model
  has none: the average lowered the AUROC of an older table rule (Clipless
  for two classes, clipping otherwise, uncentred: 0.858 against 0.865), and
  it is not measured on a Clipless model with the current table rules.
* **Tables** (``kind="table"``, the default for a 1-D ``input_shape``): the
  columns are unrelated quantities, so nothing is centred across them and no
  row is shrunk: each column is centred on its own public range, either by
  the model (``feature_range=(low, high)``: `DP_BoxInput` clamps each row to
  the box and moves it by the box's centre; the bound ``X`` is the box's half
  diagonal; ``max_norm = √d`` alone is read as ``feature_range=(0, 1)``, and
  rows outside that box are refused) or beforehand (``max_norm``, e.g.
  `kdp.tabular.TabularSchema.max_norm`, then ``DP_BoundedInput(max_norm)``);
  then a hidden `DP_QuickSpectralDense` layer with `DP_GroupSort`, the output
  `DP_QuickSpectralDense` layer and a bias `DP_AddBias(X)` (an MLP with
  Lipschitz weights); per-example clipping builds the plain MLP
  ``Dense(w, relu) → Dense(outputs)``. Two classes use **one** output (τ-binary cross-entropy,
  ``L = 1``, or Keras' binary cross-entropy) and the model tracks AUROC.
  **Every table gets one hidden layer** of width ``w`` (the power of two
  nearest ``4 d`` in [64, 512]; GroupSort for Clipless, ReLU and 60 epochs for
  clipping), which images get only from N = 10 000: on the suite's tables
  other than gen_2k_lin and gen_6k_lin_3c (ten), the table rule with it at
  every size scored 0.813 / 0.920 (mean accuracy / AUROC over tables and
  ε = 1, 3, 8), against 0.802 / 0.908 from 1 000 rows, 0.792 / 0.891 from
  5 000 and 0.784 / 0.886 from 10 000 (the image rule), and
  leave-one-dataset-out selection picks "every size" for each of the ten
  (``python benchmarks/recipes_suite.py``, 2026-11-27). It holds on the two
  tables whose classes are split by hyperplanes (where a linear model is
  right): there the clipping MLP reached 0.727 / 0.858 / 0.873 (gen_2k_lin, AUROC 0.938 /
  0.946 / 0.948) and 0.722 / 0.732 / 0.729 (gen_6k_lin_3c; non-private
  logistic regression 0.872 / 0.949 and 0.727), at or above every linear
  variant (the best, Clipless with τ·X = 128: 0.755 / 0.859 / 0.864 and
  0.626 / 0.628 / 0.627). The rules assume the
  columns centred at their declared range's midpoint (`kdp.tabular`'s default:
  a public offset that about halves ``max_norm``); on the same ten tables a
  linear table rule's mean accuracy / AUROC is 0.784 / 0.886 centred and
  0.737 / 0.853 uncentred, and leave-one-dataset-out selection picks
  centring for each. Clipless uses τ·X = 64 (images: 32), and 128 for one
  binary output from N = 1 000 training rows: in that linear rule, 64
  everywhere scored 0.782 / 0.884, 128 everywhere 0.782 / 0.885, 256 0.780 /
  0.881, and the size rule 0.784 / 0.886, picked for each of the ten among
  thresholds of 1 000, 2 000, 5 000 and 10 000 rows
  (``python benchmarks/recipes_suite.py``, 2026-11-27).
* ``method="auto"``: per-example clipping on scattering features and for
  tables, Clipless otherwise (images without features). On digits' pixels
  Clipless is as accurate as per-example clipping at ε = 1 and 3 (0.881 /
  0.935 against 0.880 / 0.931, 3 seeds) and computes no per-example
  gradient. On the suite's twelve tables (centred, each model with the
  hidden layer), per-example clipping on every table (an MLP, C = 1, 60
  epochs) with Adam 0.01 scored 0.806 / 0.919 (accuracy / AUROC), against
  0.805 / 0.916 for Clipless on one binary output from 1 000 rows and
  0.803 / 0.915 for Clipless on every binary table, and leave-one-dataset-out
  selection picked it for 11 of the 12 held-out tables (gen_2k_lin: Clipless
  from 1 000 rows); Clipless led on iris and gen_4k_2c (0.811 / 0.848
  against 0.789 / 0.826 at ε = 1 / 3). With Adam 0.03 (above) the MLP leads
  there too (0.832 / 0.881; 0.813 / 0.876 with the moving average) and is
  picked for all twelve (0.828 / 0.927; 0.831 / 0.928 with the average;
  ``python benchmarks/recipes_suite.py``, 2026-11-27/28). On
  the seven generated image sets (8×8 to 28×28
  pixels), the linear model on the recipe's features with per-example
  clipping (and the moving average) is ahead of Clipless on pixels on each,
  by 0.056 to 0.245 in accuracy averaged over ε = 1, 3, 8
  (``benchmarks/recipes_suite.py``; README, "Measured results").

`DP_Model.predict_proba` turns the outputs into probabilities with the loss's
own link (``softmax(τ·z)`` for τ-cross-entropy, ``sigmoid(τ·z)`` for the
binary one).

The image rules were chosen leave-one-dataset-out on eight image sets
(scikit-learn's digits and seven generated sets of 8×8 to 28×28 pixels), the
table rules on twelve tables (``benchmarks/recipes_suite.py``, whose tables the
README shows, with where the rules lose): a starting point, not a guarantee
of accuracy.
"""

import math
import warnings

METHODS = ("auto", "clipless", "clipping")
KINDS = ("image", "table")

#: the largest batch size a recipe picks
MAX_BATCH_SIZE = 4096
#: Clipless: inputs are projected onto the ball of radius ``max_norm / INPUT_BOUND_FRACTION``
INPUT_BOUND_FRACTION = 8.0
#: Clipless: τ · input_bound
TAU_TIMES_BOUND = 32.0
#: Clipless, tables: τ · input_bound
TAU_TIMES_BOUND_TABLE = 64.0
#: Clipless, one binary output: τ · input_bound from `BINARY_TAU_MIN_SAMPLES` training rows
TAU_TIMES_BOUND_BINARY_LARGE = 128.0
BINARY_TAU_MIN_SAMPLES = 1_000
#: the scales and angles of the scattering features (``features="scattering"``)
SCATTERING_J, SCATTERING_L = 2, 8
#: ``features="auto"``: scattering features for images at least this many pixels a side
SCATTERING_MIN_SIDE = 8
#: ``features="auto"``: the standardised pixels next to the scattering features below this side
PIXELS_MAX_SIDE = 12
#: the fixed image features a recipe can put first
IMAGE_FEATURES = ("scattering", "scattering+pixels")
FEATURES = ("auto", None, *IMAGE_FEATURES)
#: Clipless on images: a hidden layer from this many training records on (tables: always)
CLIPLESS_HIDDEN_MIN_SAMPLES = 10_000
#: per-example clipping: the epochs of a table's MLP
TABLE_MLP_EPOCHS = 60
#: Adam's learning rate: every recipe, but a table's MLP (`TABLE_MLP_LEARNING_RATE`)
LEARNING_RATE = 1e-2
TABLE_MLP_LEARNING_RATE = 3e-2
#: the moving average of the weights: momentum ``1 − EMA_HORIZON / T`` for ``T`` steps,
#: within ``[EMA_MIN, EMA_MAX]``
EMA_HORIZON, EMA_MIN, EMA_MAX = 10.0, 0.9, 0.999


class Recipe:
    """A model and schedule chosen by `recipe` (see the module docstring for the rules).

    Attributes: ``method``, ``kind``, ``features``, ``feature_shape`` (the shape of
    one example's fixed features, or None), ``image_grid`` (an image's ``(H, W[,
    C])``, or None), ``input_shape``, ``nb_classes``,
    ``nb_samples``, ``target_epsilon``, ``delta``, ``batch_size``, ``epochs``, ``learning_rate``,
    ``width``, ``clipping_norm`` (clipping), ``tau``, ``loss_clip`` and
    ``input_bound`` (Clipless), ``max_norm`` (the bound of a raw input),
    ``feature_range`` (a table's column box, or None), ``feature_range_assumed``
    (True when the box was read from ``max_norm = √d``), ``ema_momentum``
    (the moving average of the weights, or None), and ``rules`` (name -> the rule
    that set it).
    """

    def __init__(self, **values):
        self.rules = values.pop("rules")
        self.__dict__.update(values)

    def metadata(self, on_features=False):
        """The `DatasetMetadata` of the recipe (``N``, ``b``, shapes); ``on_features``:
        of the model `build(on_features=True)` gives (the features' shape and norm)."""
        from kdp.metadata import DatasetMetadata

        if on_features:
            self._require_features()
            return DatasetMetadata(self.feature_shape, self.nb_classes, self.nb_samples,
                                   self.batch_size, max_norm=math.sqrt(math.prod(self.feature_shape)))
        return DatasetMetadata(self.input_shape, self.nb_classes, self.nb_samples,
                               self.batch_size, max_norm=self.max_norm)

    def _require_features(self):
        if not self.features:
            raise ValueError("this recipe has no fixed features (features=None): build() on the "
                             "inputs themselves")

    def feature_extractor(self):
        """The recipe's fixed feature layers as a Keras model without weights
        (scattering, then the per-channel normalisation): each example's features
        depend on that example alone, so computing them once costs no privacy.
        ``extractor.predict(x)`` then ``build(on_features=True).fit`` on the result
        trains the same model as ``build().fit(x)`` without recomputing the
        features at every step (5–10× faster on 28×28 images on a CPU, measured in
        the recipe suite)."""
        import keras

        self._require_features()
        return keras.Sequential([keras.Input(self.input_shape), *self._features()],
                                name="fixed_features")

    @property
    def outputs(self):
        """The model's output width: 1 for two classes of a table, else ``nb_classes``."""
        return 1 if self.kind == "table" and self.nb_classes == 2 else self.nb_classes

    def build(self, seed=None, on_features=False, noise_seed=None, calibrate=False):
        """A compiled DP model, calibrated with ``make_private(target_epsilon, epochs)``
        (so ``target_epsilon`` is also its budget). ``seed`` seeds the
        initialisation only; the noise and the sampling use the OS entropy unless
        ``noise_seed`` (an int) asks for a reproducible run
        (``DPParameters(reproducible=True, seed=noise_seed)``).
        ``on_features=True``: the model without its fixed feature layers, to
        train on `feature_extractor`'s outputs (its inputs' bound is theirs).
        ``calibrate=True`` (one binary output): reserve a private calibration of
        its probabilities within the target (`kdp.calibration.reserve`, before
        `make_private`); after `fit`, ``kdp.calibration.calibrate(model, x, y)``."""
        import keras

        from kdp.model import DP_Sequential, DPParameters

        if seed is not None:
            keras.utils.set_random_seed(seed)
        inputs = ([keras.Input(self.feature_shape)] if on_features
                  else [keras.Input(self.input_shape), *self._features()])
        layers, loss = (self._clipping_layers(inputs) if self.method == "clipping"
                        else self._clipless_layers(inputs))
        params = dict(delta=self.delta)
        if noise_seed is not None:
            params.update(reproducible=True, seed=int(noise_seed))
        if self.method == "clipping":
            params["clipping_norm"] = self.clipping_norm
        else:
            params["noisify_strategy"] = "global"
        model = DP_Sequential(layers, dp_parameters=DPParameters(**params),
                              dataset_metadata=self.metadata(on_features),
                              name=f"dp_{self.method}_recipe")
        ema = (dict(use_ema=True, ema_momentum=self.ema_momentum)
               if self.ema_momentum is not None else {})
        model.compile(optimizer=keras.optimizers.Adam(self.learning_rate, **ema), loss=loss,
                      metrics=self._metrics())
        if calibrate:
            if self.outputs != 1:
                raise ValueError("calibrate=True takes a two-class table (one output)")
            from kdp.calibration import reserve

            reserve(model, self.target_epsilon)
        model.make_private(target_epsilon=self.target_epsilon, epochs=self.epochs)
        return model

    def _metrics(self):
        import keras

        if self.outputs == 1:  # one logit: positive above 0
            return [keras.metrics.BinaryAccuracy(threshold=0.0, name="accuracy"),
                    keras.metrics.AUC(from_logits=True, name="auroc")]
        return ["accuracy"]

    def _box(self):
        """`DP_BoxInput` of the ``feature_range`` first (refusing rows outside an
        assumed one), or nothing."""
        from kdp.layers import DP_BoxInput

        return [] if self.feature_range is None else [
            DP_BoxInput(*self.feature_range, refuse_outside=self.feature_range_assumed)]

    def _clipping_layers(self, inputs):
        import keras

        hidden = [keras.layers.Dense(self.width, activation="relu")] if self.width else []
        loss = (keras.losses.BinaryCrossentropy(from_logits=True) if self.outputs == 1
                else keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return ([*inputs, *self._box(), keras.layers.Flatten(),
                 *hidden, keras.layers.Dense(self.outputs)], loss)

    def _features(self):
        """The fixed feature layers (after a reshape of a flattened image to its
        grid): none, or a scattering transform followed by a per-example
        normalisation of each of its channels, and for ``"scattering+pixels"``
        the pixels normalised as one group next to them (`DP_ConcatFeatures`)."""
        from kdp import layers as L

        if not self.features:
            return []
        unflatten = [L.DP_Reshape(self.image_grid)] if self.image_grid != self.input_shape else []
        scattering = [L.DP_Scattering2D(J=SCATTERING_J, L=SCATTERING_L), L.DP_GroupNormalization()]
        if self.features == "scattering":
            return [*unflatten, *scattering]
        return [*unflatten, L.DP_ConcatFeatures([scattering, [L.DP_GroupNormalization(groups=1)]])]

    def _clipless_layers(self, inputs):
        import keras

        from kdp import layers as L
        from kdp import losses

        hidden = ([L.DP_QuickSpectralDense(self.width), L.DP_GroupSort(2)] if self.width else [])
        if self.kind == "table":
            head = self._box() or [L.DP_BoundedInput(upper_bound=self.input_bound)]
            bias = [L.DP_AddBias(norm_max=self.input_bound)]
        else:
            head = [L.DP_LayerCentering(axes="all"),
                    L.DP_BoundedInput(upper_bound=self.input_bound)]
            bias = []
        loss = (losses.DP_TauBCE(self.tau) if self.outputs == 1
                else losses.DP_TauCategoricalCrossentropy(self.tau))
        return ([*inputs, *head, L.DP_Flatten(), *hidden,
                 L.DP_QuickSpectralDense(self.outputs), *bias,
                 L.DP_ClipGradient(self.loss_clip)], loss)

    def describe(self):
        """The chosen values, one line each, with the rule that set them."""
        return "\n".join(f"{name} = {getattr(self, name)!r}: {rule}"
                         for name, rule in self.rules.items())

    def __repr__(self):
        values = ", ".join(f"{k}={getattr(self, k)!r}" for k in self.rules)
        return f"Recipe({values})"


def recipe(input_shape, nb_classes, nb_samples, target_epsilon, delta=None, method="auto",
           max_norm=None, kind=None, features="auto", feature_range=None):
    """Choose a private model and schedule from public facts (rules in the module docstring).

    Args:
        input_shape: the shape of one example.
        nb_classes: the number of classes (≥ 2).
        nb_samples: ``N``, the number of training records.
        target_epsilon: ε > 0 to reach at the end of training.
        delta: δ in ``(0, 1/N)``; default ``10^-(⌊log10 N⌋ + 2)``.
        method: ``"clipless"``, ``"clipping"`` or ``"auto"``.
        max_norm: a public bound on every input's L2 norm (the domain's, e.g.
            ``√d`` for pixels in [0, 1]; for a table, `kdp.tabular.TabularSchema.max_norm`
            of its centred columns, ``√d / 2`` for ``d`` columns in [0, 1]
            moved by ``-1/2``). Clipless caps (projects)
            every input onto a ball: of radius ``max_norm`` for tables, and,
            for images, each centred input onto ``max_norm / 8`` (``1/8``
            without it). Required for tables unless ``feature_range`` is given.
        kind: ``"image"`` or ``"table"``; default ``"table"`` for a 1-D
            ``input_shape``, else ``"image"`` (a 1-D shape of ``s²`` values,
            ``s ≥ 8``, could be a flattened image: it warns unless ``kind`` is
            given).
        features: ``"auto"`` (for images of at least 8×8 pixels
            ``"scattering+pixels"`` below 12 pixels a side, ``"scattering"``
            from there; else none), ``None``, ``"scattering"`` or
            ``"scattering+pixels"`` (images of shape ``(H, W)`` or ``(H, W,
            C)``, or square grey images flattened to ``(H·H,)``, which are
            reshaped first): a fixed scattering transform
            (`kdp.layers.DP_Scattering2D`, J = 2) and a per-example
            normalisation of each channel (`kdp.layers.DP_GroupNormalization`)
            first, with ``"+pixels"`` the pixels standardised per example next
            to them, then a linear model (Tramèr and Boneh 2021); the
            features' norm bound ``√n`` replaces ``max_norm`` after them.
        feature_range: tables only: ``(low, high)``, the public range of every
            column (scalars, or one value per column), e.g. ``(0, 1)`` for
            columns already mapped to [0, 1]. The model then starts with
            `kdp.layers.DP_BoxInput`, which clamps each row to that box and
            moves it by the box's centre, and the rules' ``max_norm`` is the
            centred box's half diagonal (``√d / 2`` for ``d`` columns in
            [0, 1]); ``max_norm``, if given too, bounds the raw rows. Leave it
            out for rows centred beforehand (`kdp.tabular.TabularSchema` does).
            Left out with ``max_norm = √d`` (``d`` columns), the recipe reads
            the rows as columns in [0, 1] and assumes ``(0, 1)`` (it warns):
            the model centres them, and `fit` refuses a row with a value
            outside [0, 1] (nothing spent) instead of clamping it
            (``DP_BoxInput(refuse_outside=True)``). ``False``: no box, the
            rows as they are, bounded by ``max_norm`` alone.

    Returns:
        A `Recipe`; ``recipe(...).build()`` gives the calibrated, compiled model
        and ``.epochs`` the number of epochs to pass to ``fit``.
    """
    input_shape = tuple(int(d) for d in input_shape)
    n, classes = int(nb_samples), int(nb_classes)
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if kind is None and len(input_shape) == 1 and _image_grid(input_shape) and input_shape[0] >= 64:
        side = math.isqrt(input_shape[0])
        warnings.warn(
            f"recipe: input_shape {input_shape} is read as a table (the default for a 1-D "
            f"shape). If it is a flattened {side}x{side} grey image, pass kind='image' (fixed "
            f"scattering features: 0.1-0.25 more accurate than pixels on the suite's generated "
            f"images); pass kind='table' to silence this warning.", stacklevel=2)
    kind = kind or ("table" if len(input_shape) == 1 else "image")
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
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
    if features not in FEATURES:
        raise ValueError(f"features must be one of {FEATURES}, got {features!r}")
    grid = _image_grid(input_shape) if kind == "image" else None
    if features in IMAGE_FEATURES and grid is None:
        raise ValueError(f"features={features!r} takes images of shape (H, W) or (H, W, C), or "
                         "square grey images flattened to (H * H,)")
    features_rule = "as given"
    if features == "auto":
        features_rule = ("chosen automatically (features='auto'): a scattering transform (J = 2, "
                         "8 angles) and a per-channel normalisation for images of at least 8 x 8 "
                         "pixels, with the standardised pixels next to them below 12 x 12; else "
                         "none")
        side = min(grid[:2]) if grid else 0
        features = (None if side < SCATTERING_MIN_SIDE
                    else "scattering+pixels" if side < PIXELS_MAX_SIDE else "scattering")
    assumed = (feature_range is None and kind == "table" and max_norm is not None
               and math.isclose(max_norm, math.sqrt(math.prod(input_shape))))
    if assumed:
        warnings.warn(
            f"recipe: max_norm = sqrt(d) = {max_norm:.4g} is read as columns in [0, 1]: the "
            "model centres them (DP_BoxInput) and fit refuses a row with a value outside "
            "[0, 1]. Pass feature_range=(low, high) to declare the columns' range, or "
            "feature_range=False to keep the rows uncentred (on the suite's tables the mean "
            "accuracy fell from 0.784 to 0.737 uncentred).", stacklevel=2)
        feature_range = (0.0, 1.0)
    elif feature_range is False:
        feature_range = None
    if feature_range is not None:
        if kind != "table":
            raise ValueError("feature_range is for tables (images are centred per example)")
        box = _box_input(feature_range, input_shape)
        max_norm = box.box_norm if max_norm is None else max_norm
        centred_norm = box.propagate_inputs(max_norm)
    elif kind == "table" and max_norm is None:
        raise ValueError("a table's recipe needs max_norm, the public bound on a row's L2 norm "
                         "(kdp.tabular.TabularSchema.max_norm; sqrt(d) / 2 for d columns in "
                         "[0, 1] centred by -1/2), or feature_range=(low, high), the columns' "
                         "public range, which the model centres itself")

    batch_size = _power_of_two(8 * math.sqrt(n), 32, min(MAX_BATCH_SIZE, n // 4))
    method_rule = _method_rule(method, kind, features)
    if method == "auto":
        method = "clipping" if features or kind == "table" else "clipless"
    epochs = clipping_epochs(target_epsilon)
    d = math.prod(input_shape)
    wide = _power_of_two(4 * d, 64, 512)
    feature_shape = (_feature_shape(grid, with_pixels=features == "scattering+pixels")
                     if features else None)
    values = dict(method=method, kind=kind, features=features, feature_shape=feature_shape,
                  input_shape=input_shape, image_grid=grid,
                  nb_classes=classes,
                  nb_samples=n, target_epsilon=float(target_epsilon), delta=float(delta),
                  batch_size=batch_size, epochs=epochs, max_norm=max_norm,
                  feature_range=None if feature_range is None else (box.low, box.high),
                  feature_range_assumed=assumed)
    rules = {
        "method": method_rule,
        "kind": "as given, or table for a 1-D input shape, else image",
        "feature_range": "as given; for a table with max_norm = sqrt(d) and none given, "
                         "(0, 1) assumed (training rows outside it are refused); False: none",
        "features": features_rule,
        "delta": "given, or 10^-(floor(log10 N) + 2) < 1/(10 N)",
        "batch_size": "the power of two nearest 8 sqrt(N), in [32, min(N/4, 4096)]",
        "epochs": "clipping: 20, and 20 * 2.5/epsilon (at most 60) below epsilon = 2.5; a "
                  "table's MLP: 60",
    }
    if method == "clipping":
        values.update(width=0 if features else wide, learning_rate=LEARNING_RATE,
                      clipping_norm=1.0 if target_epsilon < 5 or kind == "table" else 0.1)
        if kind == "table":
            values.update(epochs=TABLE_MLP_EPOCHS, learning_rate=TABLE_MLP_LEARNING_RATE)
        rules.update(width="0 (a linear model) on scattering features; else the power of two "
                           "nearest 4 d, in [64, 512]",
                     learning_rate=f"Adam {LEARNING_RATE:g}; a table's MLP: Adam "
                                   f"{TABLE_MLP_LEARNING_RATE:g}",
                     clipping_norm="1, and 0.1 from epsilon = 5 for images")
    else:
        if kind == "table":
            input_bound = max_norm if feature_range is None else centred_norm
            bound_rule = ("tables: each row projected onto the ball of radius max_norm (no "
                          "per-row centring; the schema centres each column on its range), "
                          "or with feature_range clamped to the box and moved by its centre "
                          "(bound: the box's half diagonal); a bias of that norm on the "
                          "outputs")
        else:
            norm = (math.sqrt(math.prod(feature_shape)) if feature_shape
                    else 1.0 if max_norm is None else max_norm)
            input_bound = norm / INPUT_BOUND_FRACTION
            bound_rule = ("images: each example centred on its own mean, then projected onto "
                          "the ball of radius max_norm/8 (1/8 without max_norm; on scattering "
                          "features their norm bound sqrt(#features) / 8)")
        binary = kind == "table" and classes == 2
        loss_bound = 1.0 if binary else math.sqrt(2.0)
        hidden = kind == "table" or (n >= CLIPLESS_HIDDEN_MIN_SAMPLES and not features)
        values.update(width=wide if hidden else 0,
                      learning_rate=LEARNING_RATE, epochs=30, input_bound=input_bound,
                      tau=_tau_times_bound(kind, binary, n) / input_bound,
                      loss_clip=loss_bound / 50)
        rules.update(width="tables: the power of two nearest 4 d in [64, 512]; images: 0 (a "
                           "linear Lipschitz model) below N = 10000 and on scattering "
                           "features, else the same, no bias",
                     learning_rate=f"Adam {LEARNING_RATE:g}", epochs="Clipless: 30",
                     input_bound=bound_rule,
                     tau="32 / input_bound (tau times the logits' scale = 32); tables: "
                         "64 / input_bound, one binary output from N = 1000: 128 / input_bound",
                     loss_clip="L/50 (L = sqrt(2), or 1 for one binary output): every "
                               "example's logit gradient clipped to the same small norm")
    steps = values["epochs"] * n / batch_size
    averaged = kind == "image" or method == "clipping"
    values["ema_momentum"] = ema_momentum(steps) if averaged else None
    rules["ema_momentum"] = ("images and a table's MLP: 1 - 10/T for T training steps, in "
                             "[0.9, 0.999] (the trained weights are a moving average of the "
                             "last ~T/10 noisy iterates); a Clipless table model: none")
    return Recipe(rules=rules, **values)


def _method_rule(asked, kind, features):
    """The rule `Recipe.describe` gives for ``method``: as asked, or why ``"auto"`` chose it."""
    if asked != "auto":
        return "as asked"
    why = ("per-example clipping for tables" if kind == "table"
           else "per-example clipping on scattering features" if features
           else "Clipless for images without fixed features")
    return f"chosen automatically (method='auto'): {why}"


def ema_momentum(steps):
    """The moving average's momentum for ``steps`` training steps: ``1 − 10/T`` within
    ``[0.9, 0.999]`` (`EMA_HORIZON`, `EMA_MIN`, `EMA_MAX`)."""
    return min(EMA_MAX, max(EMA_MIN, 1.0 - EMA_HORIZON / steps))


def clipping_epochs(target_epsilon):
    """The epochs of per-example clipping (but a table's MLP): 20, and
    ``20 · 2.5/ε`` (at most 60) below ε = 2.5."""
    return int(round(min(60, 20 * max(1.0, 2.5 / target_epsilon))))


def _tau_times_bound(kind, binary, n):
    """τ · input_bound of a Clipless recipe: `TAU_TIMES_BOUND` for images,
    `TAU_TIMES_BOUND_TABLE` for tables, `TAU_TIMES_BOUND_BINARY_LARGE` for one
    binary output from `BINARY_TAU_MIN_SAMPLES` training rows."""
    if kind != "table":
        return TAU_TIMES_BOUND
    return (TAU_TIMES_BOUND_BINARY_LARGE if binary and n >= BINARY_TAU_MIN_SAMPLES
            else TAU_TIMES_BOUND_TABLE)


def _box_input(feature_range, input_shape):
    """The built `DP_BoxInput` of a table's declared column range ``(low, high)``."""
    from kdp.layers import DP_BoxInput

    try:
        low, high = feature_range
    except (TypeError, ValueError):
        raise ValueError(
            f"feature_range must be a pair (low, high), got {feature_range!r}") from None
    layer = DP_BoxInput(low, high)
    layer.build((None, *input_shape))
    return layer


def _image_grid(input_shape):
    """The ``(H, W)`` or ``(H, W, C)`` grid of an image's pixels: its shape, or
    ``(s, s)`` for a flattened square grey image of ``s² ≥ 16`` values (e.g.
    MNIST as 784 columns); ``None`` for anything else."""
    if len(input_shape) in (2, 3):
        return input_shape
    side = math.isqrt(input_shape[0]) if len(input_shape) == 1 else 0
    return (side, side) if side >= 4 and side * side == input_shape[0] else None


def _feature_shape(input_shape, with_pixels=False):
    """The shape of one example's scattering features (`DP_Scattering2D`, J =
    `SCATTERING_J`, L = `SCATTERING_L`), or ``(n,)`` for those and the pixels
    flattened side by side (``with_pixels``); after the normalisations their norm
    is at most ``√n`` for their ``n`` values (`DP_GroupNormalization`)."""
    from kdp.layers.scattering import scattering_channels, scattering_grid

    M, N = scattering_grid(input_shape[0], input_shape[1], SCATTERING_J)
    channels = input_shape[2] if len(input_shape) == 3 else 1
    scale = 2 ** SCATTERING_J
    shape = (M // scale, N // scale, channels * scattering_channels(SCATTERING_J, SCATTERING_L))
    return (math.prod(shape) + math.prod(input_shape),) if with_pixels else shape


def _power_of_two(x, lo, hi):
    """The power of two nearest ``x`` (in log scale), clamped to ``[lo, hi]``."""
    value = 2 ** int(round(math.log2(max(x, 1.0))))
    return int(max(lo, min(hi, value)))
