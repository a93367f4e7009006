"""DP models: Clipless DP-SGD inside the ordinary Keras `fit`.

The training objective is ``Σ_i w_i ℓ_i / b + Σ_v ⟨v − stop_gradient(v), ξ_v⟩``:

* ``Σ_i w_i ℓ_i / b``: per-example losses summed and divided by the **expected**
  batch size ``b`` (DESIGN §3.2; padding rows have ``w_i = 0``);
* the second term is exactly 0 in value but its gradient with respect to ``v``
  is ``ξ_v``, a fresh Gaussian draw of std ``σ c_v Δ_v / b`` ("per-layer") or
  ``σ √(Σ_v Δ_v²) / b`` ("global"), ``Δ_v`` the per-example bound of the bound
  pass (DESIGN §3.3).

So Keras' own ``train_step`` on every backend (TensorFlow, JAX, torch) computes
the noisy gradient in one ordinary backward pass, the optimizer consumes it, and
the kernel constraints project the weights: no backend-specific training code.
Noise comes from a `keras.random.SeedGenerator` tracked by the model, so each
step and variable draws independently, also in the stateless JAX step.
"""

import math
import os

import keras
import numpy as np
from keras import ops

from kdp import accounting
from kdp.bounds import BoundError, compute_gradient_bounds, loss_lipschitz
from kdp.layers.base import serializable
from kdp.layers.clip import DP_ClipGradient
from kdp.ledger import PrivacyLedger
from kdp.pipeline import DatasetMetadata, PoissonBatches

NOISIFY_STRATEGIES = ("per-layer", "global")


class DPParameters:
    """Privacy parameters of a DP model.

    Args:
        noisify_strategy: ``"per-layer"`` (std ``σ c_v Δ_v / b`` per variable) or
            ``"global"`` (std ``σ √(Σ Δ_v²) / b`` everywhere).
        noise_multiplier: ``σ > 0``.
        delta: the δ of the reported (ε, δ); must be ``< 1/N`` unless
            ``allow_large_delta=True``.
        sampling: ``"poisson"`` (default, what the accountant assumes) or
            ``"shuffle"`` (fixed-size shuffled batches, e.g. from a `tf.data`
            pipeline; accounted without amplification under replace-one).
        reproducible: fix the noise and sampling seeds (``seed``, default 0).
            **For tests only**: by default every draw is seeded from the OS
            entropy, so nobody can predict the noise.
        seed: the seed used when ``reproducible=True``.
        allow_large_delta: accept ``delta >= 1/N`` (not recommended).
    """

    def __init__(self, noisify_strategy="per-layer", noise_multiplier=1.0, delta=1e-5,
                 sampling="poisson", reproducible=False, seed=None, allow_large_delta=False):
        if noisify_strategy not in NOISIFY_STRATEGIES:
            raise ValueError(
                f"noisify_strategy must be one of {NOISIFY_STRATEGIES}, got {noisify_strategy!r}"
            )
        if not noise_multiplier > 0 or not math.isfinite(noise_multiplier):
            raise ValueError(f"noise_multiplier must be a finite number > 0, got {noise_multiplier}")
        if not 0 < delta < 1:
            raise ValueError(f"delta must be in (0, 1), got {delta}")
        if sampling not in accounting.SAMPLINGS:
            raise ValueError(f"sampling must be one of {accounting.SAMPLINGS}, got {sampling!r}")
        if seed is not None and not reproducible:
            raise ValueError("seed fixes the noise: pass reproducible=True as well (tests only)")
        self.noisify_strategy = noisify_strategy
        self.noise_multiplier = float(noise_multiplier)
        self.delta = float(delta)
        self.sampling = sampling
        self.reproducible = bool(reproducible)
        self.seed = (0 if seed is None else int(seed)) if reproducible else None
        self.allow_large_delta = bool(allow_large_delta)

    def draw_seed(self, offset=0):
        """The fixed seed (+ offset) if reproducible, else 31 bits of OS entropy."""
        if self.reproducible:
            return self.seed + offset
        return int.from_bytes(os.urandom(4), "little") >> 1

    def get_config(self):
        return {
            "noisify_strategy": self.noisify_strategy, "noise_multiplier": self.noise_multiplier,
            "delta": self.delta, "sampling": self.sampling, "reproducible": self.reproducible,
            "seed": self.seed, "allow_large_delta": self.allow_large_delta,
        }

    @classmethod
    def from_config(cls, config):
        return cls(**config)

    def __repr__(self):
        return "DPParameters(" + ", ".join(f"{k}={v!r}" for k, v in self.get_config().items()) + ")"


def _as(cls, value):
    return cls.from_config(value) if isinstance(value, dict) else value


class _LedgerCallback(keras.callbacks.Callback):
    """Records every executed noisy step in the model's ledger, batch by batch."""

    def on_epoch_begin(self, epoch, logs=None):
        self._recorded = 0

    def on_train_batch_end(self, batch, logs=None):
        done = batch + 1  # Keras passes the index of the last step executed
        self.model._record_steps(done - self._recorded)
        self._recorded = done


class DPModelMixin:
    """Clipless DP-SGD training shared by `DP_Model` and `DP_Sequential`."""

    def _init_dp(self, dp_parameters, dataset_metadata, ledger=None):
        self.dp_parameters = _as(DPParameters, dp_parameters)
        self.dataset_metadata = _as(DatasetMetadata, dataset_metadata)
        self.privacy_ledger = _as(PrivacyLedger, ledger) or PrivacyLedger()
        if self.dp_parameters is not None:
            self._noise_seed = keras.random.SeedGenerator(self.dp_parameters.draw_seed())

    # -- checks ------------------------------------------------------------------
    def _require_dp_config(self):
        if self.dp_parameters is None or self.dataset_metadata is None:
            raise ValueError(f"{self.name}: pass dp_parameters= and dataset_metadata= to train it")

    def check_dp(self):
        """Raise a clear error if training this model would not be DP as claimed."""
        self._require_dp_config()
        n = self.dataset_metadata.nb_samples_train
        if self.dp_parameters.delta >= 1.0 / n and not self.dp_parameters.allow_large_delta:
            raise ValueError(
                f"delta={self.dp_parameters.delta} >= 1/N = {1.0 / n:.3g}: such a δ allows "
                "releasing a record in the clear. Lower it or pass allow_large_delta=True."
            )
        if self.optimizer is None or self.loss is None:
            raise ValueError(f"{self.name}: compile the model with a kdp loss first")
        loss_lipschitz(self.loss)
        for layer in self._flatten_layers(include_self=False):
            if getattr(layer, "activity_regularizer", None) is not None:
                raise BoundError(f"{layer.name}: activity regularizers depend on the data; remove it")
        bounds = compute_gradient_bounds(self)
        bad = {p: b for p, b in bounds.items() if not (b >= 0 and math.isfinite(b))}
        if bad:
            raise BoundError(f"non-finite gradient bounds: {bad}")
        return bounds

    # -- noise -------------------------------------------------------------------
    def _noise_coefficients(self):
        coefs = {}
        for layer in self._flatten_layers(include_self=False):
            for v in layer.trainable_weights:
                coefs[v.path] = float(getattr(layer, "nm_coef", 1.0))
        return coefs

    def noise_stds(self):
        """``{variable.path: std}`` of the Gaussian noise added to the batch gradient."""
        bounds = compute_gradient_bounds(self)
        sigma = self.dp_parameters.noise_multiplier
        b = self.dataset_metadata.batch_size
        if self.dp_parameters.noisify_strategy == "global":
            total = math.sqrt(sum(d * d for d in bounds.values()))
            return {p: sigma * total / b for p in bounds}
        coefs = self._noise_coefficients()
        return {p: sigma * coefs.get(p, 1.0) * d / b for p, d in bounds.items()}

    def effective_noise_multiplier(self):
        """``σ_eff``: the noise multiplier of the one Gaussian a step is equivalent to."""
        sigma = self.dp_parameters.noise_multiplier
        if self.dp_parameters.noisify_strategy == "global":
            return sigma
        coefs = self._noise_coefficients()
        return accounting.effective_noise_multiplier(
            sigma * coefs.get(v.path, 1.0) for v in self.trainable_variables
        )

    def _noise_term(self):
        stds = self.noise_stds()
        term = ops.zeros(())
        for v in self.trainable_variables:
            value = v.value
            noise = keras.random.normal(v.shape, stddev=stds[v.path], dtype=value.dtype,
                                        seed=self._noise_seed)
            term = term + ops.sum((value - ops.stop_gradient(value)) * noise)
        return term

    # -- the training objective --------------------------------------------------
    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        self._require_dp_config()
        values = self.loss.call(y, y_pred)
        if sample_weight is not None:
            values = values * ops.reshape(ops.cast(sample_weight, values.dtype), ops.shape(values))
        total = ops.sum(values) / self.dataset_metadata.batch_size
        if self.losses:
            total = total + ops.sum(self.losses)
        if training:
            total = total + self._noise_term()
        return total

    def compile(self, *args, **kwargs):
        super().compile(*args, **kwargs)
        self._set_cotangent_scale()

    def _set_cotangent_scale(self):
        if self.dataset_metadata is None:
            return
        for layer in self._flatten_layers(include_self=False):
            if isinstance(layer, DP_ClipGradient):
                layer.cotangent_scale = 1.0 / self.dataset_metadata.batch_size

    # -- accounting --------------------------------------------------------------
    def privacy_spec(self):
        """The per-step mechanism: ``{noise_multiplier, sampling_rate, sampling,
        steps_per_epoch, delta}``."""
        self._require_dp_config()
        md = self.dataset_metadata
        return {
            "noise_multiplier": self.effective_noise_multiplier(),
            "sampling_rate": md.sampling_rate,
            "sampling": self.dp_parameters.sampling,
            "steps_per_epoch": md.steps_per_epoch,
            "delta": self.dp_parameters.delta,
        }

    def _record_steps(self, steps):
        spec = self._spec_cache
        self.privacy_ledger.record_training_steps(
            steps, spec["noise_multiplier"], spec["sampling_rate"], spec["sampling"],
            spec["steps_per_epoch"],
        )

    def privacy_spent(self, accountant="rdp"):
        """``(ε, δ)`` spent so far by every release in the ledger."""
        delta = self.dp_parameters.delta
        return accounting.epsilon_of_events(self.privacy_ledger.events(), delta, accountant), delta

    # -- fit ---------------------------------------------------------------------
    def fit(self, x=None, y=None, batch_size=None, epochs=1, callbacks=None,
            validation_split=0.0, sample_weight=None, class_weight=None,
            steps_per_epoch=None, **kwargs):
        """Keras ``fit`` with Clipless DP-SGD.

        Arrays ``x, y`` are sampled with Poisson sampling (``len(x)`` must be
        ``dataset_metadata.nb_samples_train``); datasets and generators are only
        accepted with ``DPParameters(sampling="shuffle")``. ``sample_weight`` and
        ``class_weight`` must lie in [0, 1] (a weight above 1 scales an example's
        gradient beyond its bound). Other arguments are those of `keras.Model.fit`.
        """
        self.check_dp()
        self._set_cotangent_scale()
        self._spec_cache = self.privacy_spec()
        md = self.dataset_metadata
        if validation_split:
            raise ValueError("validation_split would change N: pass validation_data instead")
        if batch_size is not None and batch_size != md.batch_size:
            raise ValueError(
                f"batch_size={batch_size} differs from dataset_metadata.batch_size={md.batch_size}"
            )
        if isinstance(x, (np.ndarray, list, tuple)) or hasattr(x, "__array__") and not _is_stream(x):
            x, y, weights = self._check_arrays(x, y, sample_weight, class_weight)
            x = PoissonBatches(x, y, md.batch_size, weights, steps_per_epoch,
                               seed=self.dp_parameters.draw_seed(offset=1) if self.dp_parameters.reproducible else None)
            y = sample_weight = None
        elif self.dp_parameters.sampling == "poisson":
            raise ValueError(
                "fit received a dataset or generator, whose batches kdp cannot make Poisson. "
                "Pass NumPy arrays (Poisson sampling), or set DPParameters(sampling='shuffle') "
                "to train on shuffled fixed-size batches with the matching (weaker) accounting."
            )
        elif class_weight is not None or sample_weight is not None:
            raise ValueError("with a dataset, put the weights (in [0, 1]) in the dataset itself")
        callbacks = [_LedgerCallback()] + list(callbacks or [])
        return super().fit(x, y, epochs=epochs, callbacks=callbacks, sample_weight=sample_weight,
                           steps_per_epoch=steps_per_epoch, **kwargs)

    def _check_arrays(self, x, y, sample_weight, class_weight):
        x = np.asarray(x)
        y = np.asarray(y)
        n = self.dataset_metadata.nb_samples_train
        if len(x) != n or len(y) != n:
            raise ValueError(
                f"got {len(x)} examples but dataset_metadata.nb_samples_train={n}: "
                "the sampling rate would be wrong"
            )
        if not np.all(np.isfinite(x)) or np.issubdtype(y.dtype, np.floating) and not np.all(np.isfinite(y)):
            raise ValueError("the training data contains NaN or infinite values")
        weights = np.ones(n, dtype="float32") if sample_weight is None else np.asarray(sample_weight, "float32").reshape(n)
        if class_weight is not None:
            labels = y.argmax(-1) if y.ndim > 1 and y.shape[-1] > 1 else y.reshape(n).astype(int)
            weights = weights * np.array([class_weight.get(int(c), 1.0) for c in labels], "float32")
        if weights.min() < 0 or weights.max() > 1:
            raise ValueError(
                "sample_weight and class_weight must lie in [0, 1]: a weight above 1 scales an "
                "example's gradient beyond its bound and would break the guarantee"
            )
        return x, y, weights

    # -- serialization -------------------------------------------------------------
    def _dp_config(self):
        return {
            "dp_parameters": None if self.dp_parameters is None else self.dp_parameters.get_config(),
            "dataset_metadata": None if self.dataset_metadata is None else self.dataset_metadata.get_config(),
            "privacy_ledger": self.privacy_ledger.get_config(),
        }


def _is_stream(x):
    return hasattr(x, "element_spec") or isinstance(x, keras.utils.PyDataset)


@serializable
class DP_Model(DPModelMixin, keras.Model):
    """A functional Keras model trained with Clipless DP-SGD.

    Args:
        inputs, outputs: as for `keras.Model`; every layer must be a DP layer.
        dp_parameters: `DPParameters`.
        dataset_metadata: `DatasetMetadata`.
    """

    def __init__(self, inputs, outputs, dp_parameters=None, dataset_metadata=None,
                 privacy_ledger=None, **kwargs):
        super().__init__(inputs=inputs, outputs=outputs, **kwargs)
        self._init_dp(dp_parameters, dataset_metadata, privacy_ledger)

    def get_config(self):
        return {**super().get_config(), **self._dp_config()}


@serializable
class DP_Sequential(DPModelMixin, keras.Sequential):
    """A `keras.Sequential` of DP layers trained with Clipless DP-SGD.

    Args:
        layers: the DP layers, usually starting with `DP_BoundedInput(input_shape, upper_bound)`.
        dp_parameters: `DPParameters`.
        dataset_metadata: `DatasetMetadata`.
    """

    def __init__(self, layers=None, dp_parameters=None, dataset_metadata=None,
                 privacy_ledger=None, **kwargs):
        super().__init__(layers=layers, **kwargs)
        self._init_dp(dp_parameters, dataset_metadata, privacy_ledger)

    def get_config(self):
        return {**super().get_config(), **self._dp_config()}

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        dp = {k: config.pop(k, None) for k in ("dp_parameters", "dataset_metadata", "privacy_ledger")}
        model = super().from_config(config, custom_objects=custom_objects)
        model._init_dp(**dp)
        return model


__all__ = [
    "DPParameters", "DP_Model", "DP_Sequential", "DatasetMetadata", "compute_gradient_bounds",
]
