"""Keras callbacks for privacy accounting and budget enforcement."""

import logging

import keras

from kdp import accounting
from kdp.adaptive_clipping import AdaptiveQuantileClipping

logger = logging.getLogger("kdp")


class DP_Accountant(keras.callbacks.Callback):
    """Writes ``epsilon`` and ``delta`` into the logs (progress bar, `History`).

    Args:
        epsilon_max: optional budget. Training stops **before** the step whose ε
            would exceed it; a model whose ledger already exceeds it is refused.
        accountant: ``"rdp"`` or ``"pld"``.
        per_step: also write ε into the batch logs (the progress bar shows it).
        log_fn: ``"logging"`` to also log ε at each epoch end with `logging`.
    """

    def __init__(self, epsilon_max=None, accountant="rdp", per_step=False, log_fn=None):
        super().__init__()
        if epsilon_max is not None and not epsilon_max > 0:
            raise ValueError(f"epsilon_max must be > 0, got {epsilon_max}")
        if log_fn not in (None, "logging"):
            raise ValueError(f"log_fn must be None or 'logging', got {log_fn!r}")
        self.epsilon_max = epsilon_max
        self.accountant = accountant
        self.per_step = per_step
        self.log_fn = log_fn

    def on_train_begin(self, logs=None):
        self._allowed_steps = None
        if self.epsilon_max is None:
            return
        spec = self.model.privacy_spec()
        eps, _ = self.model.privacy_spent(self.accountant)
        if eps > self.epsilon_max:
            raise RuntimeError(
                f"privacy budget exhausted: the model already spent ε={eps:.4g} > "
                f"epsilon_max={self.epsilon_max}"
            )
        self._start_steps = self.model.privacy_ledger.training_steps()
        self._allowed_steps = accounting.max_steps(
            self.epsilon_max, spec["noise_multiplier"], spec["sampling_rate"], spec["delta"],
            self.accountant, spec["sampling"], spec["steps_per_epoch"],
            self.model.privacy_ledger.events(),
            planned=accounting.planned_events_fn(self.model),  # e.g. adaptive clipping
        )
        if self._allowed_steps == 0:
            raise RuntimeError(
                f"privacy budget exhausted: one more step would exceed epsilon_max={self.epsilon_max}"
            )

    def _epsilon(self, logs):
        eps, delta = self.model.privacy_spent(self.accountant)
        if logs is not None:
            logs["epsilon"] = eps
            logs["delta"] = delta
        return eps

    def on_train_batch_end(self, batch, logs=None):
        if self.per_step:
            self._epsilon(logs)
        if self._allowed_steps is not None:
            model = self._model  # the ledger only: no JAX state sync (`self.model` would)
            done = model.privacy_ledger.training_steps() - self._start_steps
            if done + 1 > self._allowed_steps:
                model.stop_training = True

    def on_epoch_end(self, epoch, logs=None):
        eps = self._epsilon(logs)
        if self.log_fn == "logging":
            logger.info("epoch %d: epsilon=%.4f delta=%g", epoch + 1, eps, self.model.dp_parameters.delta)


class PrivacyJournal(keras.callbacks.Callback):
    """Makes `fit` write the privacy ledger ahead to a durable file.

    Pass it to `fit` next to your own checkpointing (`ModelCheckpoint`, a custom
    saver). Before every step, `fit` records the step in the model's ledger and
    writes the whole ledger to ``path`` (atomic replace + fsync); when training
    starts, it merges the file into the model's ledger. A run killed at any
    instant and restarted from any checkpoint therefore counts every step that
    ran, including those of the interrupted epoch. Use one journal per model
    lineage and training set; a journal of another training on the same data
    adds up (conservative).

    With `keras.callbacks.BackupAndRestore` no journal needs to be passed: `fit`
    keeps one in its ``backup_dir`` (file `FILENAME`), deleted with the backup
    when training completes.

    Args:
        path: the journal file (JSON), e.g. ``"run/privacy_ledger.json"``.
    """

    FILENAME = "kdp_privacy_ledger.json"

    def __init__(self, path):
        super().__init__()
        from kdp.ledger import LedgerJournal

        self.journal = LedgerJournal(path)

__all__ = ["DP_Accountant", "PrivacyJournal", "AdaptiveQuantileClipping"]
