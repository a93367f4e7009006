"""Adaptive loss-gradient clipping with private quantile thresholds.

A `DP_ClipGradient` as the model's last layer clips each example's gradient with
respect to the logits at ``C``, and the bound pass starts from ``min(L, C)``, so
the noise shrinks with ``C`` (Béthune et al. 2024, §3.1). Which ``C``? As training
converges the logit-gradient norms fall far below ``L``; a good threshold is a
high quantile (the paper keeps the 90th percentile) of those norms, which depend
on the private data. `AdaptiveQuantileClipping` estimates it privately with the
mechanism of Andrew et al. (2021, "Differentially private learning with adaptive
clipping"):

* on a Poisson sample (rate ``q``, expected size ``b_q``) count the examples whose
  logit-gradient norm is at most ``C`` and release
  ``b̄ = (Σ_i 1[‖∇_ŷ ℓ_i‖ ≤ C] + N(0, σ_q²)) / b_q`` (the count has sensitivity 1
  under add/remove-one, so each release is a Poisson-subsampled Gaussian with
  noise multiplier ``σ_q``);
* update ``C ← C · exp(−η (b̄ − γ))`` (geometric step towards the quantile ``γ``).

Every release is appended to the model's privacy ledger (entry kind
``"quantile"``) **before** the new threshold is used, so ε reported by
`DP_Accountant` counts exactly the releases made. Budgets computed before
training include the releases still to come: the callback registers its plan on
the model in ``set_model`` (Keras calls it in ``fit``; call it yourself before
`kdp.accounting.get_max_epochs`), and `get_max_epochs`, `get_eps_delta`,
``DP_Accountant(epsilon_max=...)`` compose ``n`` steps of training with the
releases those ``n`` steps bring along.

Not implemented: lip-dp's sparse-vector (SVT) variant.
"""

import math

import keras
import numpy as np
from keras import ops

from kdp import privacy
from kdp.training import budget
from kdp.training.ledger import quantile_mechanism
from kdp.training.seeds import numpy_generator
from kdp.autodiff import gradient
from kdp.bounds import loss_lipschitz
from kdp.layers.clip import DP_ClipGradient

EVERY = ("epoch", "step")


def output_clip_layer(model):
    """The `DP_ClipGradient` that produces ``model``'s output, or a clear error."""
    layer = None
    if isinstance(model, keras.Sequential):
        layer = model.layers[-1] if model.layers else None
    elif getattr(model, "outputs", None) and len(model.outputs) == 1:
        history = getattr(model.outputs[0], "_keras_history", None)
        layer = history.operation if history is not None else None
    if not isinstance(layer, DP_ClipGradient):
        raise ValueError(
            f"{model.name}: adaptive clipping needs a DP_ClipGradient as the model's last "
            "layer (it clips the gradient with respect to the logits); add "
            "kdp.layers.DP_ClipGradient(clip_value=L) after the output layer"
        )
    return layer


def logit_gradient_norms(model, x, y, loss=None, chunk=256):
    """``‖∂ℓ_i/∂ŷ_i‖`` for every example (unclipped, unweighted, per-example units).

    One forward pass and the gradient of ``Σ_i ℓ(ŷ_i, y_i)`` with respect to the
    logits ``ŷ`` (row ``i`` of it is example ``i``'s own gradient: the loss is
    per-example). Cheap: no parameter gradient. Compiled once per model, loss
    and ``chunk`` (rows are padded to a multiple of ``chunk``). The values depend
    on the data: releasing them, or anything computed from them, costs privacy
    unless ``x`` is public.
    """
    loss = model.loss if loss is None else loss
    x = np.asarray(x)
    y = np.asarray(y)
    n = len(x)
    if n == 0:
        return np.zeros(0)
    cache = model.__dict__.setdefault("_kdp_logit_norm_fns", {})
    key = (id(loss), int(chunk))
    if key not in cache:
        cache[key] = _compiled_norms(model, loss)
    fn = cache[key]
    rows = -(-n // chunk) * chunk
    xp = np.zeros((rows,) + x.shape[1:], x.dtype)
    yp = np.zeros((rows,) + y.shape[1:], y.dtype)
    xp[:n], yp[:n] = x, y
    out = [np.asarray(ops.convert_to_numpy(fn(xp[i:i + chunk], yp[i:i + chunk])), "float64")
           for i in range(0, rows, chunk)]
    return np.concatenate(out)[:n]


def _norms_of(g):
    g = ops.reshape(g, (ops.shape(g)[0], -1))
    return ops.sqrt(ops.sum(ops.square(g), axis=1))


def _compiled_norms(model, loss):
    backend = keras.backend.backend()
    if backend == "jax":  # stateless: the variables are arguments, never baked in
        import jax

        def norms(trainable, others, x, y):
            logits, _ = model.stateless_call(trainable, others, x, training=False)
            return _norms_of(jax.grad(lambda z: ops.sum(loss.call(y, z)))(logits))

        jitted = jax.jit(norms)
        return lambda x, y: jitted([v.value for v in model.trainable_variables],
                                   [v.value for v in model.non_trainable_variables], x, y)

    def norms(x, y):
        (g,) = gradient(lambda z: ops.sum(loss.call(y, z)), model(x, training=False))
        return _norms_of(g)

    if backend == "tensorflow":
        import tensorflow as tf

        return tf.function(norms, reduce_retracing=True)  # reads the variables live
    return norms


def quantile_update(clip_value, count, expected_size, quantile, learning_rate):
    """Andrew et al.'s geometric step: ``C · exp(−η (count / b − γ))``.

    ``count`` is the (noisy) number of norms ``≤ C`` and ``expected_size`` the
    public expected sample size ``b``."""
    fraction = count / expected_size
    return clip_value * math.exp(-learning_rate * (fraction - quantile))


class AdaptiveQuantileClipping(keras.callbacks.Callback):
    """Private adaptive threshold for the last `DP_ClipGradient` (Andrew et al. 2021).

    Every ``patience`` epochs (``every="epoch"``, at the start of epochs 0,
    ``patience``, ``2·patience``… of each ``fit``) or steps (``every="step"``,
    before steps 0, ``patience``…), draws a Poisson sample of ``(x, y)`` at rate
    ``q = batch_size / len(x)``, releases the noisy fraction ``b̄`` of
    logit-gradient norms ``≤ C`` and sets ``C ← C·exp(−η(b̄ − γ))``. Writes
    ``clip_value`` (the threshold used by the epoch) and ``unclipped_fraction``
    (the last release ``b̄``) into the epoch logs.

    Privacy: each release is ``PoissonSampledDpEvent(q, GaussianDpEvent(σ_q))``,
    recorded in ``model.privacy_ledger`` before its threshold is used. A fit of
    ``n`` steps makes ``⌈n / P⌉`` releases, ``P = patience·steps_per_epoch`` or
    ``patience``; this plan is registered on the model in ``set_model``, so
    `kdp.accounting.get_max_epochs` and ``DP_Accountant(epsilon_max=...)``
    include it (call ``callback.set_model(model)`` before `get_max_epochs` if
    you compute the budget before ``fit``). The training mechanism itself is
    unchanged (its noise multiplier is relative to the bound, which follows C).

    Args:
        x, y: the data the norms are measured on: the **private training set**
            (``len(x) = N``), or, with ``public=True``, public data.
        quantile: the target ``γ`` (the paper keeps ``≥ 0.9``: heavy clipping turns
            the loss into a Wasserstein/KR one, robust but less accurate).
        patience: release every ``patience`` epochs or steps.
        noise_multiplier: ``σ_q``, the std of the noise on the count; default
            ``batch_size / 20`` (Andrew et al.'s recommendation: std 0.05 on ``b̄``).
        learning_rate: ``η`` of the geometric update (Andrew et al. use 0.2).
        batch_size: expected size ``b_q`` of each sample; default the model's
            ``dataset_metadata.batch_size``.
        every: ``"epoch"`` or ``"step"`` (``steps_per_execution`` must be 1).
        initial_clip_value: optional starting threshold (default: the layer's).
        min_clip_value, max_clip_value: optional public limits on ``C``.
        public: ``x`` is public (disjoint from and independent of the private
            data): nothing is recorded. Wrong use breaks the guarantee.
        seed: seed of the sampling and the noise, **for tests only** (default:
            the OS entropy, or the model's seed if its ``DPParameters`` are
            ``reproducible``).
        ds_train: lip-dp's dataset, refused: pass the arrays ``x, y``.
    """

    def __init__(self, x=None, y=None, quantile=0.9, patience=1, noise_multiplier=None,
                 learning_rate=0.2, batch_size=None, every="epoch", initial_clip_value=None,
                 min_clip_value=None, max_clip_value=None, public=False, seed=None, *,
                 ds_train=None):
        super().__init__()
        if x is None or y is None or ds_train is not None:
            raise TypeError(
                "AdaptiveQuantileClipping(x, y, ...) samples the training set itself: pass the "
                "arrays x, y that fit trains on, not lip-dp's ds_train (a batched dataset)")
        if not 0 < quantile < 1:
            raise ValueError(f"quantile must be in (0, 1), got {quantile}")
        if int(patience) != patience or patience < 1:
            raise ValueError(f"patience must be an integer >= 1, got {patience}")
        if every not in EVERY:
            raise ValueError(f"every must be one of {EVERY}, got {every!r}")
        if noise_multiplier is not None and not noise_multiplier > 0:
            raise ValueError(f"noise_multiplier must be > 0, got {noise_multiplier}")
        if not learning_rate > 0:
            raise ValueError(f"learning_rate must be > 0, got {learning_rate}")
        self.x = np.asarray(x)
        self.y = np.asarray(y)
        if len(self.x) != len(self.y) or len(self.x) == 0:
            raise ValueError("x and y must be non-empty and of the same length")
        self.quantile = float(quantile)
        self.patience = int(patience)
        self.every = every
        self._noise_multiplier_arg = noise_multiplier
        self._batch_size_arg = batch_size
        self.learning_rate = float(learning_rate)
        self.initial_clip_value = initial_clip_value
        self.min_clip_value = min_clip_value
        self.max_clip_value = max_clip_value
        self.public = bool(public)
        self.seed = seed
        self.history = []  # (fit-relative step, released fraction b̄, new C)
        self._in_fit = False
        self._rng = None

    # -- set-up ---------------------------------------------------------------------
    def set_model(self, model):
        super().set_model(model)
        self._in_fit = False  # `on_train_begin` starts a fit
        self.layer = output_clip_layer(model)
        b = self._batch_size_arg or model.dataset_metadata.batch_size
        if not 0 < b <= len(self.x):
            raise ValueError(f"batch_size must be in (0, len(x)={len(self.x)}], got {b}")
        self.batch_size = float(b)
        self.sampling_rate = self.batch_size / len(self.x)
        self.noise_multiplier = float(self._noise_multiplier_arg or self.batch_size / 20.0)
        if not self.public:
            budget.register_release_plan(model, self)

    def detach(self):
        """Remove this callback's planned releases from the model's budgets."""
        if self.model is not None:
            budget.unregister_release_plan(self.model, self)

    def set_params(self, params):
        # Keras sets the params of a `fit` (its steps per epoch) before any hook.
        super().set_params(params)
        self._fit_steps_per_epoch = (params or {}).get("steps")

    def _steps_per_epoch(self, default):
        steps = getattr(self, "_fit_steps_per_epoch", None)
        return int(steps) if steps else int(default)

    def planned_events(self, steps):
        """The releases made during the next ``steps`` training steps (from now:
        during ``fit``, those already made are in the ledger)."""
        if self.public:
            return []
        default = self._model.step_plan().steps_per_epoch
        period = self.patience * (self._steps_per_epoch(default) if self.every == "epoch" else 1)
        done, made = (self._fit_step, self._made) if self._in_fit else (0, 0)
        count = max(0, -(-(done + int(steps)) // period) - made)
        return [privacy.quantile_event(self.noise_multiplier, self.sampling_rate, count)]

    # -- the mechanism ------------------------------------------------------------------
    def _generator(self):
        if self._rng is None:
            params = getattr(self.model, "dp_parameters", None)
            seed = self.seed
            if seed is None and params is not None and params.reproducible:
                seed = params.draw_seed(offset=7)
            self._rng = numpy_generator(seed is not None, seed)  # OS entropy when seed is None
        return self._rng

    def release(self, norms, clip_value):
        """One private release on the ``norms`` of a Poisson sample: returns
        ``(b̄, new C)``. Records it in the ledger first (unless public)."""
        count = float(np.sum(np.asarray(norms) <= clip_value))
        if self.public:
            noisy = count + self._generator().normal(0.0, self.noise_multiplier)
        else:
            mechanism = quantile_mechanism(self.noise_multiplier, self.sampling_rate)
            with self._model.privacy_gate.spend(mechanism):
                noisy = count + self._generator().normal(0.0, self.noise_multiplier)
        new = quantile_update(clip_value, noisy, self.batch_size, self.quantile, self.learning_rate)
        if self.min_clip_value is not None:
            new = max(new, float(self.min_clip_value))
        if self.max_clip_value is not None:
            new = min(new, float(self.max_clip_value))
        return noisy / self.batch_size, new

    def _update(self):
        if hasattr(self.model, "jax_state_sync"):  # JAX: variables live again, then assign
            self.model.jax_state_sync()
        mask = self._generator().random(len(self.x)) < self.sampling_rate
        norms = logit_gradient_norms(self.model, self.x[mask], self.y[mask])
        clip_value = self.layer.clip_value
        fraction, new = self.release(norms, clip_value)
        self.layer.clip_value = new
        self._made += 1
        self._fraction = fraction
        self.history.append((self._fit_step, fraction, new))

    # -- Keras hooks ------------------------------------------------------------------------
    def on_train_begin(self, logs=None):
        if self.every == "step" and int(getattr(self.model, "steps_per_execution", 1) or 1) != 1:
            raise ValueError("AdaptiveQuantileClipping(every='step') needs steps_per_execution=1")
        loss_lipschitz(self.model.loss)  # a kdp loss (per-example call)
        if self.initial_clip_value is not None and not self.history:
            self.layer.clip_value = self.initial_clip_value
        self._in_fit = True
        self._fit_step = 0
        self._made = 0
        self._epochs_begun = 0
        self._fraction = float("nan")

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch_first_step = self._fit_step
        if self.every == "epoch" and self._epochs_begun % self.patience == 0:
            self._update()
        self._epochs_begun += 1
        self._epoch_clip_value = self.layer.clip_value if self.every == "epoch" else None

    def on_train_batch_begin(self, batch, logs=None):
        if self.every == "step" and self._fit_step % self.patience == 0:
            self._update()

    def on_train_batch_end(self, batch, logs=None):
        self._fit_step = self._epoch_first_step + batch + 1

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs["clip_value"] = (self._epoch_clip_value if self._epoch_clip_value is not None
                                  else self.layer.clip_value)
            logs["unclipped_fraction"] = self._fraction

    def on_train_end(self, logs=None):
        self._in_fit = False
        self._fit_steps_per_epoch = None


__all__ = ["AdaptiveQuantileClipping", "logit_gradient_norms", "output_clip_layer",
           "quantile_update"]
