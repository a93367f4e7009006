"""One `fit` of a DP model: arrays → validation → sampling → plan → gate → Keras' loop.

`fit_session` is what `DP_Model.fit` does:

1. refuse, before anything changes (no weight projected, nothing recorded), what
   cannot be trained as claimed: a bad configuration, invalid data
   (`kdp.training.validation`), a budget already spent (the model's or a
   `DP_Accountant`'s);
2. sample the arrays or a `kdp.RecordSource` (`kdp.training.sampling`: Poisson by
   default; a source's batches are read and validated one by one,
   `kdp.training.sources`) at the rate of the model's `StepPlan`, or validate a
   stream in shuffle mode;
3. project the constrained weights, reseed the noise and open a run in the
   ledger; the compiled step then spends, through the gated train function
   (`kdp.training.stepping`), one recorded release of the plan per step: its
   ``fit_mechanism`` on batches kdp draws, its ``batch_mechanism`` (no
   amplification) on a stream's;
4. run Keras' own loop with the gate's callback first (budget stop, ε in the
   logs, provable refunds at an epoch's end) and a progress bar that ends where a
   budget stop ends the epoch (`kdp.training.fit_callbacks`: both let Keras
   dispatch batch ends asynchronously, so the host never waits for a step).
"""

import contextlib
import importlib.util
import os
import warnings

import keras
import numpy as np

from kdp import distribute, privacy
from kdp.training import budget
from kdp.training.callbacks import DP_Accountant, PrivacyJournal
from kdp.training.fit_callbacks import fit_callbacks
from kdp.training.ledger import LedgerJournal
from kdp.training.processes import DistributedTrainingError, ProcessGroup
from kdp.training.sampling import ArrayRecords, fit_batches
from kdp.training.sources import RecordSource, ValidatedRecords, as_source
from kdp.training.stepping import finish_releases, kdp_error, set_cotangent_scale
from kdp.training.validation import DataValidationError, probe_loss, validate_batch, validate_stream


#: the warning of a `fit` on a dataset or generator (shuffle mode)
STREAM_ACCOUNTING = (
    "{name}: kdp does not draw the batches of a dataset or generator, so it cannot prove "
    "that a record is used once per epoch: each step is accounted as one Gaussian release "
    "without amplification (any record may be in every step, at most once per batch; a "
    "repeated record is refused). This costs far more ε than kdp's own shuffled passes "
    "(and a budget set by make_private stops such a fit sooner): pass NumPy arrays or a "
    "kdp.RecordSource to have each pass accounted as one release.")


def fit_session(model, keras_fit, x=None, y=None, batch_size=None, epochs=1, callbacks=None,
                validation_split=0.0, sample_weight=None, class_weight=None,
                steps_per_epoch=None, **kwargs):
    """`DP_Model.fit` (see its docstring); ``keras_fit`` is Keras' own ``fit``."""
    model._check_dp_once()
    set_cotangent_scale(model)
    message = budget.plain_calibration_warning(model)
    if message:
        warnings.warn(message, stacklevel=3)
    md, params = model.dataset_metadata, model.dp_parameters
    if validation_split:
        raise ValueError("validation_split would change N: pass validation_data instead")
    if batch_size is not None and batch_size != md.batch_size:
        raise ValueError(
            f"batch_size={batch_size} differs from dataset_metadata.batch_size={md.batch_size}")
    callbacks = list(callbacks or [])
    stream = False  # a dataset or generator: kdp does not draw its batches
    journal = _journal_for(callbacks)
    processes = ProcessGroup.of(model)
    source = as_source(x, y, sample_weight)
    if source is x and (y is not None or sample_weight is not None):
        raise ValueError("a RecordSource holds its labels and weights (RecordSource(labels=, "
                         "sample_weight=) or (x, y[, w]) records): pass neither y nor sample_weight")
    if processes is not None:
        records = _join_processes(model, processes, x if source is None else source, y,
                                  sample_weight, class_weight, journal, kwargs)
        x, steps_per_epoch = fit_batches(records, md.batch_size, params, steps_per_epoch,
                                         replicas=distribute.local_replicas(model),
                                         processes=processes)
        y = sample_weight = None
    elif source is not None or is_arrays(x):
        records = (_check_source(model, source, class_weight) if source is not None
                   else ArrayRecords(*_check_arrays(model, x, y, sample_weight, class_weight)))
        x, steps_per_epoch = fit_batches(
            records, md.batch_size, params, steps_per_epoch,
            replicas=distribute.num_replicas(model),  # data-parallel: shard the global batch
            prefetch=None if source is None else source.prefetch)
        y = sample_weight = None
    elif params.sampling == "poisson":
        raise ValueError(
            "fit received a dataset or generator, whose batches kdp cannot make Poisson. "
            "Pass NumPy arrays, or a kdp.RecordSource over anything that reads a record by "
            "index (files, a memmap, HDF5, a Hugging Face dataset): both are Poisson-sampled, "
            "reading only the sampled records. A stream without random access can only be "
            "trained with DPParameters(sampling='shuffle'), each of its steps accounted as "
            "one Gaussian release without amplification.")
    elif class_weight is not None or sample_weight is not None:
        raise ValueError("with a dataset, put the weights (in [0, 1]) in the dataset itself")
    else:
        x = validate_stream(model, x, md.batch_size)
        stream = True
        warnings.warn(STREAM_ACCOUNTING.format(name=model.name), stacklevel=3)
    # Each batch is already a fresh draw (or the stream's own order); Keras'
    # shuffle would reorder, and for shuffled passes interleave, them.
    kwargs["shuffle"] = False
    _check_tensorboard(callbacks)
    plan = model.step_plan()
    gate = model.privacy_gate
    mechanism = plan.batch_mechanism if stream else plan.fit_mechanism
    if journal is not None and processes is None:  # recover the steps of a run that was killed
        model.merge_ledger(journal.read())
    _check_budgets(model, callbacks, mechanism)  # refused: nothing changed, not even the weights
    planned = max(epochs - kwargs.get("initial_epoch", 0), 0)
    message = budget.default_noise_warning(
        model, mechanism, planned, planned * (steps_per_epoch or plan.steps_per_epoch),
        budgeted=gate.epsilon_max is not None or any(
            isinstance(cb, DP_Accountant) and cb.epsilon_max is not None for cb in callbacks))
    if message:
        warnings.warn(message, stacklevel=3)
    model.project_weights()
    model._budget_stop = []  # the budgets [(epsilon_max, accountant)] that stopped this fit
    gate.journal = journal if processes is None or processes.index == 0 else None
    object.__setattr__(model, "_release_per_call", (mechanism, plan.block))  # untracked by Keras
    if processes is None:
        gate.begin_run(noise_seed=model._noise_seed, reproducible=params.reproducible)
    else:  # one run, named by process 0, in every process's ledger; process 0's noise seed
        model._reseed_noise()
        gate.run, gate.processes = processes.run, processes
    try:
        callbacks = fit_callbacks(callbacks, mechanism, plan.block, processes,
                                  kwargs.get("verbose", "auto"))
        with _sharded_input(processes):
            try:
                history = keras_fit(x, y, epochs=epochs, callbacks=callbacks,
                                    sample_weight=sample_weight, steps_per_epoch=steps_per_epoch,
                                    **kwargs)
            except Exception as e:  # a refusal raised inside a tf.data pipeline: kdp's own type
                translated = kdp_error(e)
                if translated is e:
                    raise
                raise translated from e
        if getattr(model.optimizer, "use_ema", False):
            # Keras ended on its moving average of the weights, which averages the updates
            # before their constraints: back onto the certified sets (post-processing).
            model.project_weights()
            _own_buffers(model)
        if processes is not None:
            processes.verify()
        if model._budget_stop:
            warnings.warn(_budget_stop_message(model), stacklevel=3)
        return history
    except Exception as e:
        if processes is None or isinstance(e, (DistributedTrainingError, NotImplementedError)):
            raise
        raise processes.failure(e, journal) from e
    finally:
        gate.journal = gate.processes = None
        object.__setattr__(model, "_release_per_call", None)  # untracked by Keras
        finish_releases(model)


def _own_buffers(model):
    """Give each trainable variable a buffer of its own after Keras ended `fit` on
    its moving average (``var.assign(average)``): under JAX the weight and its
    average then hold one array, which the next `fit` or `train_on_batch` would
    donate twice and fail ("Attempt to donate the same buffer twice"; plain Keras
    3 models fail the same way)."""
    for v in model.trainable_variables:
        v.assign(keras.ops.copy(v.value))


def _check_budgets(model, callbacks, mechanism):
    """Raise `BudgetExceededError` now if the model's budget or a `DP_Accountant`'s
    allows no step (the callback would refuse only after the weights were projected)."""
    gate = model.privacy_gate
    extra = [cb for cb in callbacks if isinstance(cb, DP_Accountant) and cb.epsilon_max is not None]
    for cb in extra:
        gate.add_budget(("precheck", id(cb)), cb.epsilon_max, cb.accountant)
    try:
        gate.check(mechanism, 1)
    finally:
        for cb in extra:
            gate.remove_budget(("precheck", id(cb)))


def _join_processes(model, processes, x, y, sample_weight, class_weight, journal, kwargs):
    """`fit`'s checks on one of several processes: usage errors raised here (the
    same on every process), then this shard's validation and the handshake
    (`ProcessGroup.join`: every process raises, or none). Returns the records
    this process samples: its validated arrays, or its range of a
    `RecordSource` (validated batch by batch)."""
    source = x if isinstance(x, RecordSource) else None
    if source is None and not is_arrays(x):
        raise ValueError("on several processes, fit takes each process's shard of the records "
                         "as arrays, or its range of a shared kdp.RecordSource(start=, stop=) "
                         "(Poisson sampling at the global rate b/N)")
    if model.dp_parameters.sampling != "poisson":
        raise ValueError("training on several processes needs Poisson sampling (sampling='poisson')")
    if kwargs.get("validation_data") is not None:
        raise ValueError("validation_data is not supported on several processes: evaluate "
                         "after training (a model's evaluation is not private anyway)")
    _check_engine(model, processes)
    error, shard = None, None
    if source is None:
        try:
            shard = validate_batch(model, x, y, sample_weight, class_weight)
            probe_loss(model, shard[0], shard[1])
        except Exception as e:  # noqa: BLE001 (reported by every process, so all raise together)
            error = f"{type(e).__name__}: {e}"
    if journal is not None:  # recover the steps of a run that was killed
        model.merge_ledger(journal.read())
    rows = len(source) if source is not None else 0 if shard is None else len(shard[1])
    processes.join(rows, error, shard=shard, source=source)
    return ArrayRecords(*shard) if source is None else ValidatedRecords(source, model, class_weight)


def _check_source(model, source, class_weight):
    """A source's records as `fit` reads them (validated batch by batch), once its
    size is checked against ``N``."""
    n = model.dataset_metadata.nb_samples_train
    if len(source) != n:
        raise DataValidationError(
            f"{source!r} has {len(source)} records but dataset_metadata.nb_samples_train={n}: "
            "the sampling rate would be wrong")
    return ValidatedRecords(source, model, class_weight)


def _check_arrays(model, x, y, sample_weight, class_weight):
    n = model.dataset_metadata.nb_samples_train
    x, y, weights = validate_batch(model, x, y, sample_weight, class_weight)
    probe_loss(model, x, y)
    if len(y) != n:
        raise DataValidationError(
            f"got {len(y)} examples but dataset_metadata.nb_samples_train={n}: "
            "the sampling rate would be wrong")
    return x, y, weights


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


def _journal_for(callbacks):
    """The `LedgerJournal` that `fit` writes ahead to: a `PrivacyJournal`
    callback's, else one inside the ``backup_dir`` of a `BackupAndRestore`."""
    for cb in callbacks:
        if isinstance(cb, PrivacyJournal):
            return cb.journal
    for cb in callbacks:
        if isinstance(cb, keras.callbacks.BackupAndRestore):
            return LedgerJournal(os.path.join(cb.backup_dir, PrivacyJournal.FILENAME))
    return None


def _budget_stop_message(model):
    eps, delta = model.privacy_spent()
    limits = " and ".join(f"epsilon_max={e:.4g} ({privacy.accountant_name(a)})"
                          for e, a in model._budget_stop)
    return (f"{model.name}: training stopped by the privacy budget {limits} after "
            f"{model.privacy_ledger.training_steps(model.privacy_gate.run)} steps of this fit "
            f"({model.privacy_ledger.training_steps()} in the ledger), at ε={eps:.4g} "
            f"(δ={delta:g}); the next step would exceed it.")


def _check_tensorboard(callbacks):
    """Refuse `keras.callbacks.TensorBoard` without the ``tensorboard`` package
    now: it would fail at its first write, after a step was spent."""
    if (any(isinstance(cb, keras.callbacks.TensorBoard) for cb in callbacks)
            and importlib.util.find_spec("tensorboard") is None):
        raise ImportError(
            "keras.callbacks.TensorBoard needs the tensorboard package, which TensorFlow 2.21 "
            "and later no longer install: pip install \"kdp[tensorboard]\" (or pip install "
            "tensorboard). Nothing was spent.")


def is_arrays(x):
    """Whether ``x`` is in-memory arrays (sampled by kdp), not a dataset or generator."""
    if isinstance(x, (np.ndarray, list, tuple, dict)):
        return True
    return hasattr(x, "__array__") and not (hasattr(x, "element_spec")
                                           or isinstance(x, keras.utils.PyDataset))
