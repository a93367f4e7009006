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

from kdp import accounting, clipping, distribute
from kdp.clipping import check_clipping_parameters
from kdp.bounds import BoundError, bound_sqrt, compute_gradient_bounds, loss_lipschitz
from kdp.layers.base import serializable
from kdp.layers.clip import DP_ClipGradient
from kdp.ledger import LedgerJournal, PrivacyLedger
from kdp.pipeline import DatasetMetadata, PoissonBatches, ShuffledBatches, check_batch_shapes, draw_seed

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
            ``"shuffle"`` (shuffled batches of at most ``b`` records, each record
            at most once per pass, e.g. from a `tf.data` pipeline; accounted
            without amplification under replace-one, one Gaussian per pass).
        reproducible: fix the noise and sampling seeds (``seed``, default 0).
            **For tests only**: by default every draw is seeded from the OS
            entropy, so nobody can predict the noise.
        seed: the seed used when ``reproducible=True``.
        allow_large_delta: accept ``delta >= 1/N`` (not recommended).
        clipping_norm: ``C`` enables **per-example clipping** DP-SGD for models of
            ordinary Keras layers (`kdp.clipping`): a float, or with
            ``clipping="per-layer"`` a dict ``{layer name: C_l}`` (``C² = Σ C_l²``).
            ``None`` (default): Clipless DP-SGD with the bound pass.
        clipping: ``"flat"`` (one norm per example) or ``"per-layer"`` (a float
            ``C`` is split equally, ``C_l = C/√L``).
        physical_batch_size: with clipping, compute the clipped sum over chunks
            of this many rows (virtual batches: one logical, accounted step).
        epsilon_max: a privacy budget enforced over **every** `fit` of the model
            (it is saved with the model): `fit` stops before the step that would
            exceed it, and refuses to start on a model whose ledger already does.
        batch_shapes: how many static sizes Poisson batches are padded to
            (`kdp.pipeline.poisson_batch_shapes`): 3 (default) pads by about 3 %
            of the rows at b = 1024 for up to three compilations of the step; 1
            pads every batch to the capacity ``b + 6√b + 8`` (one compilation,
            +19 % rows at b = 1024). Speed only: the guarantee is the same.
    """

    def __init__(self, noisify_strategy="per-layer", noise_multiplier=1.0, delta=1e-5,
                 sampling="poisson", reproducible=False, seed=None, allow_large_delta=False,
                 clipping_norm=None, clipping="flat", physical_batch_size=None, epsilon_max=None,
                 batch_shapes=3):
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
        if epsilon_max is not None and not (epsilon_max > 0 and math.isfinite(epsilon_max)):
            raise ValueError(f"epsilon_max must be a finite number > 0, got {epsilon_max}")
        self.epsilon_max = None if epsilon_max is None else float(epsilon_max)
        self.clipping_norm, self.clipping, self.physical_batch_size = check_clipping_parameters(
            clipping_norm, clipping, physical_batch_size)
        self.batch_shapes = check_batch_shapes(batch_shapes)

    def draw_seed(self, offset=0):
        """The fixed seed (+ offset) if reproducible, else 31 bits of OS entropy."""
        return draw_seed(self.reproducible, self.seed, offset)

    def get_config(self):
        return {
            "noisify_strategy": self.noisify_strategy, "noise_multiplier": self.noise_multiplier,
            "delta": self.delta, "sampling": self.sampling, "reproducible": self.reproducible,
            "seed": self.seed, "allow_large_delta": self.allow_large_delta,
            "clipping_norm": self.clipping_norm, "clipping": self.clipping,
            "physical_batch_size": self.physical_batch_size, "epsilon_max": self.epsilon_max,
            "batch_shapes": self.batch_shapes,
        }

    @classmethod
    def from_config(cls, config):
        return cls(**config)

    def __repr__(self):
        return "DPParameters(" + ", ".join(f"{k}={v!r}" for k, v in self.get_config().items()) + ")"


def _as(cls, value):
    return cls.from_config(value) if isinstance(value, dict) else value


class _LedgerCallback(keras.callbacks.Callback):
    """Write-ahead recording of every noisy step in the model's ledger, and the
    model's own budget (`DPParameters.epsilon_max`).

    A step is spent from the moment it may run: **before** each execution (a block
    of ``steps_per_execution`` steps) the block is recorded in the ledger and, with
    a journal, written durably; after it, steps that provably did not run (the
    end of an epoch inside a block) are taken back. So a process killed at any
    instant, even between a step and its callbacks, has every step it ran on file.
    `fit` puts this callback first, so other callbacks (checkpoints, accountants)
    see a ledger that already covers the step they observe.

    Args:
        journal: a `LedgerJournal`, or ``None`` (the ledger then lives in memory and
            in the files the model is saved to).
    """

    def __init__(self, journal=None):
        super().__init__()
        self.journal = journal

    # Every method reads ``self._model``, not ``self.model``: the Keras property
    # copies the JAX training state back into the variables at each access
    # (three times a step here), and the ledger needs no variable value.

    def on_train_begin(self, logs=None):
        self._new_run = True
        self._allowed = None  # computed at the first step, after any checkpoint restore
        self._run_steps = 0

    def on_epoch_begin(self, epoch, logs=None):
        self._recorded = 0  # steps of this epoch in the ledger (run or about to run)

    def _block(self):
        return max(1, int(getattr(self._model, "steps_per_execution", 1) or 1))

    def on_train_batch_begin(self, batch, logs=None):
        model, block = self._model, self._block()
        if self._allowed is None:
            self._allowed = model._allowed_steps()  # raises if the budget is exhausted
        if self._run_steps + block > self._allowed:
            raise RuntimeError(
                f"privacy budget: {block} more step(s) would exceed "
                f"epsilon_max={model.dp_parameters.epsilon_max} (spent ε="
                f"{model.privacy_spent()[0]:.4g}); nothing was run"
            )
        model._record_steps(block, new_run=self._new_run)
        self._new_run = False
        self._recorded += block
        self._run_steps += block
        if self.journal is not None:
            self.journal.write(model.privacy_ledger)  # durable before the step runs

    def on_train_batch_end(self, batch, logs=None):
        done = batch + 1  # Keras passes the index of the last step executed
        if done != self._recorded:
            if done < self._recorded:  # recorded ahead but never run
                self._model.privacy_ledger.retract_training_steps(self._recorded - done)
            else:  # never happens with Keras' loops; record late rather than never
                self._model._record_steps(done - self._recorded)
            self._run_steps += done - self._recorded
            self._recorded = done
            if self.journal is not None:
                self.journal.write(self._model.privacy_ledger)
        if self._run_steps + self._block() > self._allowed:
            self._model.stop_training = True  # the next block would exceed the budget


class DPModelMixin:
    """Clipless DP-SGD training shared by `DP_Model` and `DP_Sequential`."""

    def _init_dp(self, dp_parameters, dataset_metadata, ledger=None):
        self.dp_parameters = _as(DPParameters, dp_parameters)
        self.dataset_metadata = _as(DatasetMetadata, dataset_metadata)
        self.privacy_ledger = _as(PrivacyLedger, ledger) or PrivacyLedger()
        if self.dp_parameters is not None:
            self._noise_seed = keras.random.SeedGenerator(self.dp_parameters.draw_seed())

    def _reseed_noise(self):
        """Give the noise generator a fresh state from the OS entropy (unless
        ``reproducible``). Called by every `fit`: the state is never saved, and a
        restarted or resumed run must not replay (nor let anyone predict) noise.
        Uses both words of Keras' seed state: 64 bits (JAX), 2 × 31 bits (TF)."""
        if self.dp_parameters is None or self.dp_parameters.reproducible:
            return
        state = self._noise_seed.state
        dtype = keras.backend.standardize_dtype(state.dtype)
        modulus = 2**32 if dtype == "uint32" else 2**31 - 2  # TF folds int64 seeds mod 2^31 - 2
        entropy = os.urandom(16)
        words = [int.from_bytes(entropy[i:i + 8], "little") % modulus for i in (0, 8)]
        state.assign(np.array(words, dtype=dtype))

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
        if self.dp_parameters.clipping_norm is not None:
            return clipping.check_model(self)
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
        if self.dp_parameters.clipping_norm is not None:
            return clipping.noise_stds(self)  # σ·C/b
        bounds = compute_gradient_bounds(self)
        sigma = self.dp_parameters.noise_multiplier
        b = self.dataset_metadata.batch_size
        if self.dp_parameters.noisify_strategy == "global":
            total = bound_sqrt(sum(d * d for d in bounds.values()))  # a tensor after a clip
            return {p: sigma * total / b for p in bounds}
        coefs = self._noise_coefficients()
        return {p: sigma * coefs.get(p, 1.0) * d / b for p, d in bounds.items()}

    def effective_noise_multiplier(self):
        """``σ_eff``: the noise multiplier of the one Gaussian a step is equivalent to."""
        sigma = self.dp_parameters.noise_multiplier
        if self.dp_parameters.noisify_strategy == "global" or self.dp_parameters.clipping_norm is not None:
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
        # Data-parallel: one calibrated draw per global step (kdp/distribute.py).
        return term * ops.cast(distribute.noise_share(), term.dtype)

    # -- the training objective --------------------------------------------------
    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        self._require_dp_config()
        values = self.loss.call(y, y_pred)
        if sample_weight is not None:
            values = values * ops.reshape(ops.cast(sample_weight, values.dtype), ops.shape(values))
        b = self.dataset_metadata.batch_size
        if training and self.dp_parameters.sampling == "shuffle":
            # Checked when the batch shape is static (always under JAX; TensorFlow
            # may trace with an unknown batch size, then the user's promise stands).
            rows = values.shape[0] if len(values.shape) else None
            if rows is not None and rows > b:
                raise ValueError(
                    f"a shuffled batch of {rows} records > dataset_metadata.batch_size={b}: "
                    "the accountant assumes batches of at most b records"
                )
        if training and self.dp_parameters.clipping_norm is not None:
            total = clipping.clipped_objective(self, x, y, values, sample_weight)  # grad: ḡ/b
        else:
            total = ops.sum(values) / b
        if self.losses:
            total = total + ops.sum(self.losses) * ops.cast(distribute.noise_share(), total.dtype)
        if training:
            total = total + self._noise_term()
        return total

    def compile(self, *args, **kwargs):
        super().compile(*args, **kwargs)
        self._set_cotangent_scale()

    def make_train_function(self, force=False):
        """Keras' compiled step, rebuilt whenever the calibration it baked in changed.

        σ, the strategy, the noise coefficients and the batch size are Python
        numbers when the step is traced: if any changed since (e.g. a second `fit`
        after setting ``dp_parameters.noise_multiplier``), a cached step would add
        the old noise while the ledger records the new one. (Clip thresholds live
        in variables and are read by the step itself.)
        """
        signature = None if self.dp_parameters is None else repr((
            self.dp_parameters.get_config(),
            None if self.dataset_metadata is None else self.dataset_metadata.get_config(),
            sorted(self._noise_coefficients().items()),
        ))
        if signature != getattr(self, "_traced_noise_signature", None):
            force = True
        self._traced_noise_signature = signature
        return super().make_train_function(force=force)

    def compile_from_config(self, config):
        """Recompile a model loaded by `keras.models.load_model` (Keras skips it for
        a custom `compile`; ours only adds the cotangent scale), so a loaded model
        resumes training with its optimizer state."""
        self.compile(**keras.saving.deserialize_keras_object(config))
        if getattr(self, "optimizer", None) is not None and self.built:
            self.optimizer.build(self.trainable_variables)

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
        sampling = self.dp_parameters.sampling
        # Shuffled batches of at most b records: a pass has at least ⌊N/b⌋ steps.
        steps_per_epoch = (md.steps_per_epoch if sampling == "poisson"
                           else max(1, md.nb_samples_train // md.batch_size))
        return {
            "noise_multiplier": self.effective_noise_multiplier(),
            "sampling_rate": md.sampling_rate,
            "sampling": sampling,
            "steps_per_epoch": steps_per_epoch,
            "delta": self.dp_parameters.delta,
        }

    def _record_steps(self, steps, new_run=False):
        spec = self._spec_cache
        self.privacy_ledger.record_training_steps(
            steps, spec["noise_multiplier"], spec["sampling_rate"], spec["sampling"],
            spec["steps_per_epoch"], new_run=new_run,
        )

    def privacy_spent(self, accountant="rdp"):
        """``(ε, δ)`` spent so far by every release in the ledger."""
        delta = self.dp_parameters.delta
        return accounting.epsilon_of_events(self.privacy_ledger.events(), delta, accountant), delta

    def _allowed_steps(self):
        """How many more steps ``epsilon_max`` allows (``inf`` without a budget);
        raises a clear error when it allows none."""
        eps_max = self.dp_parameters.epsilon_max
        if eps_max is None:
            return math.inf
        spent, _ = self.privacy_spent()
        spec = self._spec_cache
        allowed = 0 if spent > eps_max else accounting.max_steps(
            eps_max, spec["noise_multiplier"], spec["sampling_rate"], spec["delta"], "rdp",
            spec["sampling"], spec["steps_per_epoch"], self.privacy_ledger.events(),
            planned=accounting.planned_events_fn(self),  # e.g. adaptive clipping's releases
        )
        if allowed == 0:
            raise RuntimeError(
                f"privacy budget exhausted: this model's ledger already spent ε={spent:.4g} "
                f"(δ={self.dp_parameters.delta:g}) over {self.privacy_ledger.training_steps()} "
                f"steps, and DPParameters(epsilon_max={eps_max:g}) allows no further step. "
                "Training it more would break its guarantee."
            )
        return allowed

    # -- the ledger in files -------------------------------------------------------
    def merge_ledger(self, ledger):
        """Combine ``ledger`` (a `PrivacyLedger`) into the model's: nothing already
        spent is ever lost (see `PrivacyLedger.merge`)."""
        self.privacy_ledger = self.privacy_ledger.merge(ledger)

    def save_own_variables(self, store):
        """Keras' weights saving, plus the ledger: every weights file (``.keras``,
        ``.weights.h5``, `ModelCheckpoint`, `BackupAndRestore`) carries the ledger
        that covers its weights. The noise generator's state is never saved."""
        super().save_own_variables(store)
        text = self.privacy_ledger.to_json().encode("utf-8")
        store[_LEDGER_KEY] = np.frombuffer(text, dtype="uint8")

    def load_own_variables(self, store):
        """Keras' weights loading; the file's ledger is merged into the model's (a
        model that loads an older checkpoint keeps the steps it ran since)."""
        if _LEDGER_KEY in store.keys():
            text = bytes(np.asarray(store[_LEDGER_KEY], dtype="uint8")).decode("utf-8")
            self.merge_ledger(PrivacyLedger.from_json(text))
            store = _WithoutKey(store, _LEDGER_KEY)
        super().load_own_variables(store)
        self._reseed_noise()

    # -- fit ---------------------------------------------------------------------
    def fit(self, x=None, y=None, batch_size=None, epochs=1, callbacks=None,
            validation_split=0.0, sample_weight=None, class_weight=None,
            steps_per_epoch=None, **kwargs):
        """Keras ``fit`` with Clipless DP-SGD.

        Arrays ``x, y`` (``len(x)`` must be ``dataset_metadata.nb_samples_train``)
        are sampled with Poisson sampling, or, with
        ``DPParameters(sampling="shuffle")``, cut into shuffled batches of exactly
        ``b`` records per pass. Datasets and generators are only accepted with
        ``sampling="shuffle"`` (batches of at most ``b`` records, each record at
        most once per pass). ``sample_weight`` and
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
            seed = self.dp_parameters.draw_seed(offset=1) if self.dp_parameters.reproducible else None
            replicas = distribute.num_replicas(self)  # data-parallel: shard the global batch
            if self.dp_parameters.sampling == "poisson":
                x, steps_per_epoch = self._poisson_batches(x, y, weights, steps_per_epoch, seed, replicas)
                kwargs["shuffle"] = False  # each batch is already a fresh Poisson draw
            elif md.batch_size % replicas:
                raise ValueError(f"shuffled batches of b={md.batch_size} records cannot be split "
                                 f"evenly over {replicas} replicas: choose b divisible by {replicas}")
            else:
                x = ShuffledBatches(x, y, md.batch_size, weights, steps_per_epoch, seed=seed)
            y = sample_weight = None
        elif self.dp_parameters.sampling == "poisson":
            raise ValueError(
                "fit received a dataset or generator, whose batches kdp cannot make Poisson. "
                "Pass NumPy arrays (Poisson sampling), or set DPParameters(sampling='shuffle') "
                "to train on shuffled fixed-size batches with the matching (weaker) accounting."
            )
        elif class_weight is not None or sample_weight is not None:
            raise ValueError("with a dataset, put the weights (in [0, 1]) in the dataset itself")
        callbacks = list(callbacks or [])
        journal = _journal_for(callbacks)
        if journal is not None:  # recover the steps of a run that was killed
            self.merge_ledger(journal.read())
        self._allowed_steps()  # a clear error now if the budget is already spent
        self._reseed_noise()
        callbacks = [_LedgerCallback(journal)] + callbacks
        return super().fit(x, y, epochs=epochs, callbacks=callbacks, sample_weight=sample_weight,
                           steps_per_epoch=steps_per_epoch, **kwargs)

    def _poisson_batches(self, x, y, weights, steps_per_epoch, seed, replicas):
        """``(data, steps_per_epoch)`` for Keras' `fit`: `PoissonBatches` padded to
        ``dp_parameters.batch_shapes`` sizes.

        * TensorFlow fixes a `PyDataset`'s batch shape from its first two batches:
          with several sizes it gets an endless `tf.data` stream whose batch axis
          is unknown instead (not under tf.distribute, which keeps one size).
        * On an accelerator a second thread prepares the next batch while the step
          runs (there the host work is most of a small step). Not on the CPU, where
          the step uses every core and Keras' thread pool costs ≈ 0.1 s per epoch;
          not when seeded, where one draw order is wanted.
        """
        tensorflow = keras.backend.backend() == "tensorflow"
        shapes = 1 if tensorflow and replicas > 1 else self.dp_parameters.batch_shapes
        workers = 2 if seed is None and distribute.on_accelerator() else 1
        batches = PoissonBatches(x, y, self.dataset_metadata.batch_size, weights, steps_per_epoch,
                                 seed=seed, multiple_of=replicas, shapes=shapes, workers=workers)
        if tensorflow and len(batches.shapes) > 1:
            return batches.as_tf_dataset(), len(batches)
        return batches, steps_per_epoch

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

    def train_on_batch(self, x, y=None, sample_weight=None, class_weight=None, return_dict=False):
        """Keras ``train_on_batch``; under `tf.distribute` the batch is sharded over
        the replicas (Keras would give each replica the whole batch: R× the data
        gradient against one noise draw). See `kdp.distribute.sharded_train_on_batch`."""
        if class_weight is None:
            logs = distribute.sharded_train_on_batch(self, x, y, sample_weight, return_dict)
            if logs is not None:
                return logs
        elif distribute.num_replicas(self) > 1:
            raise ValueError("train_on_batch with several replicas: pass sample_weight, not class_weight")
        return super().train_on_batch(x, y, sample_weight=sample_weight, class_weight=class_weight,
                                      return_dict=return_dict)

    # -- serialization -------------------------------------------------------------
    def _dp_config(self):
        return {
            "dp_parameters": None if self.dp_parameters is None else self.dp_parameters.get_config(),
            "dataset_metadata": None if self.dataset_metadata is None else self.dataset_metadata.get_config(),
            "privacy_ledger": self.privacy_ledger.get_config(),
        }


_LEDGER_KEY = "kdp_privacy_ledger"


class _WithoutKey:
    """A read-only view of a Keras weights store without one key."""

    def __init__(self, store, key):
        self._store, self._key = store, key

    def keys(self):
        return [k for k in self._store.keys() if k != self._key]

    def __len__(self):
        return len(self.keys())

    def __contains__(self, key):
        return key != self._key and key in self._store

    def __getitem__(self, key):
        if key == self._key:
            raise KeyError(key)
        return self._store[key]


def _journal_for(callbacks):
    """The `LedgerJournal` that `fit` writes ahead to: a `PrivacyJournal`
    callback's, else one inside the ``backup_dir`` of a `BackupAndRestore`."""
    from kdp.callbacks import PrivacyJournal

    for cb in callbacks:
        if isinstance(cb, PrivacyJournal):
            return cb.journal
    for cb in callbacks:
        if isinstance(cb, keras.callbacks.BackupAndRestore):
            return LedgerJournal(os.path.join(cb.backup_dir, PrivacyJournal.FILENAME))
    return None


def _is_stream(x):
    return hasattr(x, "element_spec") or isinstance(x, keras.utils.PyDataset)


@serializable
class DP_Model(DPModelMixin, keras.Model):
    """A functional Keras model trained with Clipless DP-SGD.

    Args:
        inputs, outputs: as for `keras.Model`; every layer must be a DP layer.
        dp_parameters: `DPParameters`.
        dataset_metadata: `DatasetMetadata`.
        privacy_ledger: the `PrivacyLedger` of a model trained before (restored
            by `keras.models.load_model`).
    """

    # ``*args`` makes this a "functional-like constructor" in Keras' sense: its
    # `get_config` is then the full functional graph (layers, inputs, outputs)
    # and `from_config` rebuilds the graph and passes the DP arguments back.
    def __init__(self, inputs, outputs, *args, dp_parameters=None, dataset_metadata=None,
                 privacy_ledger=None, **kwargs):
        if args:
            raise TypeError("DP_Model(inputs, outputs, dp_parameters=..., dataset_metadata=...): "
                            "pass the other arguments by keyword")
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
        model._init_dp(dp["dp_parameters"], dp["dataset_metadata"], dp["privacy_ledger"])
        return model


__all__ = [
    "DPParameters", "DP_Model", "DP_Sequential", "DatasetMetadata", "compute_gradient_bounds",
]
