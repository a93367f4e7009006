"""DP models: Clipless (or per-example clipping) DP-SGD inside the ordinary Keras `fit`.

`DP_Model` and `DP_Sequential` are thin Keras overrides over `kdp.training`:

* the noisy objective (`kdp.training.objective`) replaces ``compute_loss`` and is
  built only inside the privacy gate;
* the compiled train function is wrapped by the gate (`kdp.training.gate`): every
  call (`fit`, `train_on_batch`, a custom loop around `train_on_batch`) is
  checked against the budgets and recorded in the ledger **before** it runs;
* every batch passes the one input validator (`kdp.training.validation`) first;
* constrained (projected) weights are projected before the first step of every
  `fit` and before every `train_on_batch`, so assigned or loaded weights cannot
  break a bound.
"""

import contextlib
import importlib.util
import os
import warnings

import keras
import numpy as np

from kdp import clipping, distribute
from kdp.bounds import BoundError, compute_gradient_bounds, loss_lipschitz
from kdp.layers.base import serializable
from kdp.layers.clip import DP_ClipGradient
from kdp.layers.constraints import project
from kdp.metadata import DatasetMetadata
from kdp.training import budget, objective, saving, seeds, statement
from kdp.training.config import NOISIFY_STRATEGIES, DPParameters  # noqa: F401 (public names)
from kdp.training.gate import PrivacyGate
from kdp.training.ledger import LedgerJournal, PrivacyLedger
from kdp.training.processes import DistributedTrainingError, ProcessGroup
from kdp.training.sampling import fit_batches
from kdp.training.validation import output_width, probe_loss, validate_batch, validate_stream


def _as(cls, value):
    return cls.from_config(value) if isinstance(value, dict) else value


class _GateCallback(keras.callbacks.Callback):
    """`fit`'s side of the gate: takes back the steps of a block that provably did
    not run (the end of an epoch inside a ``steps_per_execution`` block), stops
    training before a block the budgets would not allow (`fit` then warns), and
    writes ``epsilon`` (RDP) into every step's logs (when anything reads them:
    the progress bar at ``verbose=1``, a callback's batch-end hook) and
    ``epsilon``, ``delta`` into every epoch's.

    The gate itself records each block before it runs (the wrapped train
    function); this callback is first in `fit`'s list, so other callbacks
    (checkpoints, accountants) see a ledger that covers the step they observe.
    It reads ``self._model``, not ``self.model`` (whose JAX state sync would cost
    three copies of the weights per step).

    On several processes (``processes``, a `ProcessGroup`) it checks that their
    ledgers and budgets agree at the first step (every callback's budget is then
    in force) and at every epoch's end, so that they stop together.
    """

    def __init__(self, mechanism, processes=None, epsilon_per_step=True):
        super().__init__()
        self.mechanism = mechanism
        self.processes = processes
        self.epsilon_per_step = epsilon_per_step
        self._verified = processes is None

    def _block(self):
        return max(1, int(getattr(self._model, "steps_per_execution", 1) or 1))

    def on_epoch_begin(self, epoch, logs=None):
        self._recorded = 0  # steps of this epoch recorded (run or about to run)
        self._epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        if not self._verified:
            self.processes.verify()
            self._verified = True
        self._recorded += self._block()

    def on_train_batch_end(self, batch, logs=None):
        gate = self._model.privacy_gate
        done = batch + 1  # Keras passes the index of the last step executed
        if done < self._recorded:
            gate.settle(self._recorded - done)
            self._recorded = done
        if logs is not None and self.epsilon_per_step:  # RDP: ~0.3 ms, skipped if unread
            logs["epsilon"] = gate.privacy_spent()[0]
        if gate.remaining(self.mechanism) < self._block() and not self._last_step(done):
            self._model.stop_training = True
            self._model._budget_stop = True

    def _last_step(self, done):
        params = self.params or {}
        return self._epoch + 1 == params.get("epochs") and done == params.get("steps")

    def on_epoch_end(self, epoch, logs=None):
        if self.processes is not None:
            self.processes.verify()
        # First in fit's list: every later callback (History, TensorBoard,
        # checkpoints, the user's) sees ε and δ, with or without DP_Accountant.
        if logs is not None:
            logs["epsilon"], logs["delta"] = self._model.privacy_spent()


class _ProgbarLogger(keras.callbacks.ProgbarLogger):
    """Keras' progress bar, except that an epoch cut short by the privacy budget
    ends at the number of steps that ran (Keras would show the full epoch)."""

    def on_epoch_end(self, epoch, logs=None):
        if getattr(self._model, "_budget_stop", False) and self.progbar is not None:
            self.target = self.progbar.target = self.seen
        super().on_epoch_end(epoch, logs)


class DPModelMixin:
    """DP training shared by `DP_Model` and `DP_Sequential`."""

    def _init_dp(self, dp_parameters, dataset_metadata, ledger=None):
        self.privacy_gate = PrivacyGate(1e-5, _as(PrivacyLedger, ledger) or PrivacyLedger(),
                                        name=self.name)
        self.dp_parameters = dp_parameters
        self.dataset_metadata = _as(DatasetMetadata, dataset_metadata)
        params = self.dp_parameters
        if params is not None:
            self._noise_seed = seeds.seed_generator(params.reproducible, params.seed)

    @property
    def dp_parameters(self):
        """The model's immutable `DPParameters` (assign a new one to change them)."""
        return self._dp_parameters

    @dp_parameters.setter
    def dp_parameters(self, params):
        self._dp_parameters = params = _as(DPParameters, params)
        if params is not None:  # the gate reports at this δ and enforces this budget
            self.privacy_gate.delta = params.delta
            self.privacy_gate.epsilon_max = params.epsilon_max

    @property
    def privacy_ledger(self):
        """The `PrivacyLedger` of every private release made with this model."""
        return self.privacy_gate.ledger

    @privacy_ledger.setter
    def privacy_ledger(self, ledger):
        self.privacy_gate.ledger = ledger

    def _reseed_noise(self):
        """A fresh noise state from the OS entropy (unless ``reproducible``), at
        every `fit` and load: the state is never saved, and a restarted or
        resumed run must not replay (nor let anyone predict) noise. (Several JAX
        processes share process 0's draw: `seeds.shared_os_seed`.)"""
        if self.dp_parameters is not None and not self.dp_parameters.reproducible:
            seeds.reseed(self._noise_seed)

    # -- checks ------------------------------------------------------------------
    def _require_dp_config(self):
        if self.dp_parameters is None or self.dataset_metadata is None:
            raise ValueError(f"{self.name}: pass dp_parameters= and dataset_metadata= to train it")

    def check_dp(self):
        """Raise a clear error if training this model would not be DP as claimed."""
        self.check_delta()
        if self.optimizer is None or self.loss is None:
            raise ValueError(f"{self.name}: compile the model with a kdp loss first")
        self._check_output_width()
        if self.dp_parameters.clipping_norm is not None:
            return clipping.check_model(self)
        loss_lipschitz(self.loss)
        for layer in self._flatten_layers(include_self=False):
            if getattr(layer, "activity_regularizer", None) is not None:
                raise BoundError(f"{layer.name}: activity regularizers depend on the data; remove it")
        bounds = compute_gradient_bounds(self)
        bad = {p: b for p, b in bounds.items() if not (b >= 0 and np.isfinite(b))}
        if bad:
            raise BoundError(f"non-finite gradient bounds: {bad}")
        return bounds

    def check_delta(self):
        """Refuse ``δ ≥ 1/N`` (unless ``allow_large_delta``): such a δ allows
        releasing a record in the clear."""
        self._require_dp_config()
        n = self.dataset_metadata.nb_samples_train
        if self.dp_parameters.delta >= 1.0 / n and not self.dp_parameters.allow_large_delta:
            raise ValueError(
                f"delta={self.dp_parameters.delta} >= 1/N = {1.0 / n:.3g}: such a δ allows "
                "releasing a record in the clear. Lower it or pass allow_large_delta=True."
            )

    def _check_output_width(self):
        """``DatasetMetadata.nb_classes`` must match the model's output width (one
        output per class, or one output for two classes)."""
        width, k = output_width(self), self.dataset_metadata.nb_classes
        if width is not None and width != k and not (width == 1 and k <= 2):
            raise ValueError(
                f"{self.name} has {width} outputs but DatasetMetadata(nb_classes={k}): set "
                f"nb_classes={width}, or end the model with a layer of {k} units.")

    def _noise_signature(self):
        """What a traced step bakes in: the privacy configuration and the public
        noise coefficients."""
        if self.dp_parameters is None:
            return None
        return repr((
            self.dp_parameters.get_config(),
            None if self.dataset_metadata is None else self.dataset_metadata.get_config(),
            sorted(objective.noise_coefficients(self).items()),
        ))

    def _check_dp_once(self):
        """`check_dp` unless it already passed for this configuration, loss,
        optimizer and set of trainable variables (`fit` checks before building
        the step, which would check again)."""
        key = repr((self._noise_signature(), id(self.loss), id(self.optimizer),
                    [v.path for v in self.trainable_variables]))
        if key != getattr(self, "_dp_checked", None):
            self.check_dp()
            self._dp_checked = key

    def project_weights(self):
        """Apply every variable's constraint (the certified projections of the
        Lipschitz layers): weights set by `set_weights`, `assign` or a loaded
        file satisfy the bounds before they are trained. Run by the gate before
        the first step of every `fit` and before every `train_on_batch`."""
        for v in self.trainable_variables:
            if v.constraint is not None:
                v.assign(project(v.constraint, v.value))

    # -- noise and accounting (kdp.training.objective / budget) --------------------
    def noise_stds(self):
        """``{variable.path: std}`` of the Gaussian noise added to the batch gradient."""
        return objective.noise_stds(self)

    def effective_noise_multiplier(self):
        """``σ_eff``: the noise multiplier of the one Gaussian a step is equivalent to."""
        return objective.effective_noise_multiplier(self)

    def privacy_spec(self):
        """The per-step mechanism of `fit` (`kdp.training.budget.privacy_spec`)."""
        return budget.privacy_spec(self)

    def make_private(self, target_epsilon, epochs, delta=None):
        """Privacy in one call: set σ so that ``epochs`` epochs of `fit` reach at most
        ``target_epsilon`` (at ``delta``, default ``dp_parameters.delta``) for this
        model's own noise, and enforce that target as its budget; return σ.
        See `kdp.training.budget.make_private`."""
        return budget.make_private(self, target_epsilon, epochs, delta)

    def privacy_statement(self, accountant="rdp"):
        """A text for a model card: mechanism, adjacency, sampling, the releases in
        the ledger, ε at several δ and what the guarantee does not cover
        (`kdp.training.statement.privacy_statement`)."""
        return statement.privacy_statement(self, accountant)

    def privacy_spent(self, accountant="rdp"):
        """``(ε, δ)`` spent so far by every release in the ledger."""
        return self.privacy_gate.privacy_spent(accountant)

    def merge_ledger(self, ledger):
        """Combine ``ledger`` into the model's (`PrivacyLedger.merge`): the same
        history seen twice counts once, independent trainings are composed."""
        self.privacy_gate.merge(ledger)

    # -- the training objective --------------------------------------------------
    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        self._require_dp_config()
        return objective.objective(self, x, y, y_pred, sample_weight, training, self._noise_seed)

    def compile(self, *args, **kwargs):
        super().compile(*args, **kwargs)
        self._set_cotangent_scale()

    def train_step(self, *args):
        """Keras' step (the objective is `compute_loss`); its logs reshaped where
        Keras 3 could not reduce them over several TensorFlow workers."""
        return distribute.logs_for_reduction(self, super().train_step(*args))

    def _maybe_symbolic_build(self, iterator=None, data_batch=None):
        # TensorFlow only: Keras 3 fails to reduce a nested per-replica batch over
        # several workers (kdp.distribute.first_local_batch).
        if iterator is not None and distribute.process_count(self) > 1:
            for _, _, batches in iterator:
                data_batch = distribute.first_local_batch(self, next(batches))
                break
            iterator = None
        return super()._maybe_symbolic_build(iterator=iterator, data_batch=data_batch)

    def make_train_function(self, force=False):
        """Keras' compiled step, wrapped by the privacy gate, and rebuilt whenever
        the calibration it baked in changed.

        σ, the strategy, the noise coefficients and the batch size are Python
        numbers when the step is traced: if any changed since, a cached step
        would add the old noise while the ledger records the new one. (Clip
        thresholds live in variables and are read by the step itself.)
        """
        signature = self._noise_signature()
        if signature != getattr(self, "_traced_noise_signature", None):
            force = True
        self._traced_noise_signature = signature
        if self.train_function is not None and not force:
            return self.train_function
        self._check_dp_once()
        self._set_cotangent_scale()
        super().make_train_function(force=True)
        self.train_function = self._gated(self.train_function)
        return self.train_function

    def _gated(self, function):
        """``function`` (Keras' train function) behind the gate: each call spends
        the step plan set by `fit` or `train_on_batch` (by default: one block of
        ``steps_per_execution`` steps without amplification), refunded only when
        the failure proves that no step ran (`_steps_not_run`)."""
        def gated(*args, **kwargs):
            mechanism, count = self._step_plan or (
                budget.batch_mechanism(self.privacy_spec()),
                max(1, int(getattr(self, "steps_per_execution", 1) or 1)))
            error = []

            def refund():
                return _steps_not_run(error[0], count) if error else 0

            with self.privacy_gate.spend(mechanism, count, refund=refund):
                try:
                    return function(*args, **kwargs)
                except BaseException as e:
                    error.append(e)
                    raise

        return gated

    _step_plan = None

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

    # -- the ledger in files -------------------------------------------------------
    def save_own_variables(self, store):
        """Keras' weights saving, plus the ledger (`kdp.training.saving`). The
        noise generator's state is never saved."""
        super().save_own_variables(store)
        saving.save_ledger(store, self.privacy_ledger)

    def load_own_variables(self, store):
        """Keras' weights loading; the file's ledger is merged into the model's."""
        ledger, store = saving.load_ledger(store)
        if ledger is not None:
            self.merge_ledger(ledger)
        super().load_own_variables(store)
        self._reseed_noise()

    # -- fit ---------------------------------------------------------------------
    def fit(self, x=None, y=None, batch_size=None, epochs=1, callbacks=None,
            validation_split=0.0, sample_weight=None, class_weight=None,
            steps_per_epoch=None, **kwargs):
        """Keras ``fit`` with DP-SGD.

        Arrays ``x, y`` (``len(x)`` must be ``dataset_metadata.nb_samples_train``)
        are sampled with Poisson sampling, or, with
        ``DPParameters(sampling="shuffle")``, cut into shuffled batches of exactly
        ``b`` records per pass. Datasets and generators are only accepted with
        ``sampling="shuffle"`` (batches of at most ``b`` records, each record at
        most once per pass: the user's promise); each of their batches passes
        the validator. ``sample_weight`` and ``class_weight`` must lie in [0, 1].
        Other arguments are those of `keras.Model.fit`.

        The logs hold ``epsilon`` (after every step, when anything reads the step
        logs: the progress bar, a callback's batch-end hook) and ``delta`` (each
        epoch).
        Their ``loss`` is the value of the private objective, ``Σ_i w_i ℓ_i / b``
        per batch (``b`` the expected batch size; the noise term's value is 0):
        an unbiased estimate of the mean training loss, not the batch mean.
        Metrics and ``val_*`` are Keras' own (padding rows have weight 0).

        On several processes (JAX after ``keras.distribution.initialize`` with a
        `keras.distribution.DataParallel`; TensorFlow under
        `MultiWorkerMirroredStrategy`), every process calls `fit` with its own
        disjoint shard of the records (arrays; the shards sum to
        ``nb_samples_train``): see `kdp.training.processes`. Process 0 writes the
        journal; a failed step raises `DistributedTrainingError`.
        """
        self._check_dp_once()
        self._set_cotangent_scale()
        spec = self.privacy_spec()
        message = budget.plain_calibration_warning(self)
        if message:
            warnings.warn(message, stacklevel=2)
        md, params = self.dataset_metadata, self.dp_parameters
        if validation_split:
            raise ValueError("validation_split would change N: pass validation_data instead")
        if batch_size is not None and batch_size != md.batch_size:
            raise ValueError(
                f"batch_size={batch_size} differs from dataset_metadata.batch_size={md.batch_size}"
            )
        callbacks = list(callbacks or [])
        journal = _journal_for(callbacks)
        processes = ProcessGroup.of(self)
        if processes is not None:
            x = self._join_processes(processes, x, y, sample_weight, class_weight, journal, kwargs)
            x, steps_per_epoch = fit_batches(*x, md.batch_size, params, steps_per_epoch,
                                             replicas=distribute.local_replicas(self),
                                             processes=processes)
            y = sample_weight = None
        elif _is_arrays(x):
            x, y, weights = self._check_arrays(x, y, sample_weight, class_weight)
            x, steps_per_epoch = fit_batches(
                x, y, weights, md.batch_size, params, steps_per_epoch,
                replicas=distribute.num_replicas(self))  # data-parallel: shard the global batch
            y = sample_weight = None
        elif params.sampling == "poisson":
            raise ValueError(
                "fit received a dataset or generator, whose batches kdp cannot make Poisson. "
                "Pass NumPy arrays (Poisson sampling), or set DPParameters(sampling='shuffle') "
                "to train on shuffled fixed-size batches with the matching (weaker) accounting."
            )
        elif class_weight is not None or sample_weight is not None:
            raise ValueError("with a dataset, put the weights (in [0, 1]) in the dataset itself")
        else:
            x = validate_stream(self, x, md.batch_size)
        # Each batch is already a fresh draw (or the stream's own order); Keras'
        # shuffle would reorder, and for shuffled passes interleave, them.
        kwargs["shuffle"] = False
        _check_tensorboard(callbacks)
        gate, mechanism = self.privacy_gate, budget.fit_mechanism(spec)
        if journal is not None and processes is None:  # recover the steps of a run that was killed
            self.merge_ledger(journal.read())
        gate.check(mechanism, 1)  # a clear error now if the budget is already spent
        self.project_weights()
        self._reseed_noise()
        self._budget_stop = False
        gate.journal = journal if processes is None or processes.index == 0 else None
        _set_step_plan(self, (mechanism, _block(self)))
        if processes is None:
            gate.start_run()
        else:  # one run, named by process 0, in every process's ledger
            gate.run, gate.processes = processes.run, processes
        try:
            per_step = _reads_batch_logs(callbacks, kwargs.get("verbose", "auto"))
            callbacks = [_GateCallback(mechanism, processes, per_step)] + callbacks
            if not any(isinstance(cb, keras.callbacks.ProgbarLogger) for cb in callbacks):
                callbacks.append(_ProgbarLogger())  # where Keras would put its own
            with _sharded_input(processes):
                history = super().fit(x, y, epochs=epochs, callbacks=callbacks,
                                      sample_weight=sample_weight, steps_per_epoch=steps_per_epoch,
                                      **kwargs)
            if processes is not None:
                processes.verify()
            if self._budget_stop:
                warnings.warn(_budget_stop_message(self), stacklevel=2)
            return history
        except Exception as e:
            if processes is None or isinstance(e, (DistributedTrainingError, NotImplementedError)):
                raise
            raise processes.failure(e, journal) from e
        finally:
            gate.journal = gate.processes = None
            _set_step_plan(self, None)

    def _join_processes(self, processes, x, y, sample_weight, class_weight, journal, kwargs):
        """`fit`'s checks on one of several processes: usage errors raised here
        (the same on every process), then this shard's validation and the
        handshake (`ProcessGroup.join`: every process raises, or none).
        Returns ``(x, y, weights)`` of the validated shard."""
        if not _is_arrays(x):
            raise ValueError("on several processes, fit takes each process's shard of the records "
                             "as arrays (Poisson sampling at the global rate b/N)")
        if self.dp_parameters.sampling != "poisson":
            raise ValueError("training on several processes needs Poisson sampling (sampling='poisson')")
        if kwargs.get("validation_data") is not None:
            raise ValueError("validation_data is not supported on several processes: evaluate "
                             "after training (a model's evaluation is not private anyway)")
        _check_engine(self, processes)
        error, shard = None, None
        try:
            shard = validate_batch(self, x, y, sample_weight, class_weight)
            probe_loss(self, shard[0], shard[1])
        except Exception as e:  # noqa: BLE001 (reported by every process, so all raise together)
            error = f"{type(e).__name__}: {e}"
        if journal is not None:  # recover the steps of a run that was killed
            self.merge_ledger(journal.read())
        processes.join(0 if shard is None else len(shard[1]), error)
        return shard

    def _check_arrays(self, x, y, sample_weight, class_weight):
        n = self.dataset_metadata.nb_samples_train
        x, y, weights = validate_batch(self, x, y, sample_weight, class_weight)
        probe_loss(self, x, y)
        if len(y) != n:
            raise ValueError(
                f"got {len(y)} examples but dataset_metadata.nb_samples_train={n}: "
                "the sampling rate would be wrong"
            )
        return x, y, weights

    def train_on_batch(self, x, y=None, sample_weight=None, class_weight=None, return_dict=False):
        """Keras ``train_on_batch`` behind the gate: the batch is validated, the
        weights projected, and the step recorded before it runs as one Gaussian
        mechanism **without** sampling amplification (kdp did not sample the
        batch; use `fit` for Poisson sampling). Under `tf.distribute` the batch
        is sharded over the replicas (`kdp.distribute.sharded_train_on_batch`).
        Refused on several processes (use `fit`)."""
        if distribute.process_count(self) > 1:
            raise ValueError(f"{self.name}: train_on_batch is not supported on several processes "
                             "(each would account its own batch): call fit on every process")
        x, y, weights = validate_batch(self, x, y, sample_weight, class_weight)
        mechanism = budget.batch_mechanism(self.privacy_spec())
        self.privacy_gate.check(mechanism, 1)  # refused: nothing changes, not even the weights
        self.project_weights()
        _set_step_plan(self, (mechanism, 1))
        try:
            logs = distribute.sharded_train_on_batch(self, x, y, weights, return_dict)
            if logs is not None:
                return logs
            return super().train_on_batch(x, y, sample_weight=weights, return_dict=return_dict)
        finally:
            _set_step_plan(self, None)

    # -- serialization -------------------------------------------------------------
    def _dp_config(self):
        return {
            "dp_parameters": None if self.dp_parameters is None else self.dp_parameters.get_config(),
            "dataset_metadata": None if self.dataset_metadata is None else self.dataset_metadata.get_config(),
            "privacy_ledger": self.privacy_ledger.get_config(),
        }


def _set_step_plan(model, plan):
    """``(mechanism, count)`` spent by each call of the gated train function
    (set outside Keras' attribute tracking, which would wrap the dict)."""
    object.__setattr__(model, "_step_plan", plan)


def _check_engine(model, processes):
    """Refuse an engine configuration under which the processes would not train
    one model on one global batch."""
    if keras.backend.backend() == "jax":
        import jax

        if distribute.num_replicas(model) != jax.device_count():
            raise ValueError(
                f"{model.name}: {processes.count} JAX processes need a distribution whose batch "
                f"axis spans all {jax.device_count()} devices of all processes: call "
                "keras.distribution.set_distribution(keras.distribution.DataParallel()) on every "
                "process before building the model")
    elif distribute.local_replicas(model) != 1:
        raise NotImplementedError(
            f"{model.name}: MultiWorkerMirroredStrategy with {distribute.local_replicas(model)} "
            "devices per worker is not supported: run one worker process per device")


@contextlib.contextmanager
def _sharded_input(processes):
    """JAX: each process already passes its own shard, so Keras' distribution
    must not shard the input again (``auto_shard_dataset`` off during `fit`)."""
    distribution = (keras.distribution.distribution()
                    if processes is not None and keras.backend.backend() == "jax" else None)
    if not hasattr(distribution, "auto_shard_dataset"):
        yield
        return
    before = distribution.auto_shard_dataset
    distribution.auto_shard_dataset = False
    try:
        yield
    finally:
        distribution.auto_shard_dataset = before


def _steps_not_run(error, count):
    """How many of the ``count`` steps of a failed train-function call provably
    did not run.

    * JAX: the step is a pure function; a failed call returns no state: none ran.
    * TensorFlow: an exception raised in Python (tracing, shapes, dtypes) comes
      before any execution: none ran. At run time (`tf.errors.OpError`) only a
      refusal of kdp's validator (`validate_stream`, at the batch's ``get_next``,
      before its gradient exists) in a one-step call proves it; any other run-time
      failure is charged in full (optimizer updates are not transactional, and
      TensorFlow may increment ``optimizer.iterations`` before a failed read).
    """
    if keras.backend.backend() != "tensorflow":
        return count
    import tensorflow as tf

    if not isinstance(error, tf.errors.OpError):
        return count
    return count if count == 1 and "DataValidationError" in str(error) else 0


def _block(model):
    return max(1, int(getattr(model, "steps_per_execution", 1) or 1))


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


def _budget_stop_message(model):
    eps, delta = model.privacy_spent()
    limits = ", ".join(f"epsilon_max={e:g}" for e, _ in model.privacy_gate.budgets())
    return (f"{model.name}: training stopped by the privacy budget ({limits}) after "
            f"{model.privacy_ledger.training_steps(model.privacy_gate.run)} steps of this fit "
            f"({model.privacy_ledger.training_steps()} in the ledger), at ε={eps:.4g} "
            f"(δ={delta:g}); the next step would exceed it.")


def _reads_batch_logs(callbacks, verbose):
    """Whether anything reads the per-step logs: Keras' progress bar at
    ``verbose=1`` (``"auto"``), or a callback with its own batch-end hook."""
    if verbose not in (0, 2):
        return True
    base = keras.callbacks.Callback

    def reads(cb):
        if isinstance(cb, (keras.callbacks.ProgbarLogger, keras.callbacks.History)):
            return False
        declared = getattr(cb, "reads_batch_logs", None)  # e.g. DP_Accountant: writes only
        if declared is not None:
            return declared
        return (type(cb).on_train_batch_end is not base.on_train_batch_end
                or type(cb).on_batch_end is not base.on_batch_end)

    return any(reads(cb) for cb in callbacks)


def _check_tensorboard(callbacks):
    """Refuse `keras.callbacks.TensorBoard` without the ``tensorboard`` package
    now: it would fail at its first write, after a step was spent."""
    if (any(isinstance(cb, keras.callbacks.TensorBoard) for cb in callbacks)
            and importlib.util.find_spec("tensorboard") is None):
        raise ImportError(
            "keras.callbacks.TensorBoard needs the tensorboard package, which TensorFlow 2.21 "
            "and later no longer install: pip install \"kdp[tensorboard]\" (or pip install "
            "tensorboard). Nothing was spent.")


def _is_arrays(x):
    if isinstance(x, (np.ndarray, list, tuple, dict)):
        return True
    return hasattr(x, "__array__") and not (hasattr(x, "element_spec")
                                           or isinstance(x, keras.utils.PyDataset))


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
    def __init__(self, inputs, outputs=None, *args, dp_parameters=None, dataset_metadata=None,
                 privacy_ledger=None, **kwargs):
        if outputs is None or (isinstance(inputs, (list, tuple))
                               and any(isinstance(x, keras.layers.Layer) for x in inputs)):
            raise TypeError(
                "DP_Model(inputs, outputs, ...) takes a functional graph; lip-dp's "
                "DP_Model(dp_layers, ...) is kdp.DP_Sequential(dp_layers, dp_parameters=..., "
                "dataset_metadata=...)")
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
        debug: lip-dp's; only ``False`` (``kdp.compute_gradient_bounds(model)``
            gives the bounds).
    """

    def __init__(self, layers=None, dp_parameters=None, dataset_metadata=None,
                 privacy_ledger=None, debug=False, **kwargs):
        if debug:
            raise ValueError("DP_Sequential has no debug mode (lip-dp's debug=True): inspect the "
                             "per-example gradient bounds with kdp.compute_gradient_bounds(model)")
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
