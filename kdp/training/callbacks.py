"""The Keras callbacks a DP model's `fit` knows: `DP_Accountant` (ε in the logs,
a budget for one `fit`) and `PrivacyJournal` (the ledger written ahead to a file).
Users import them from `kdp.callbacks`."""

import logging

import keras

from kdp import privacy
from kdp.training.ledger import LedgerJournal

logger = logging.getLogger("kdp")


class DP_Accountant(keras.callbacks.Callback):
    """Writes ``epsilon`` and ``delta`` into the logs (progress bar, `History`).

    Args:
        epsilon_max: optional budget for the `fit` it is passed to, enforced by the
            model's privacy gate with the model's own budget: training stops
            **before** the block of steps (``steps_per_execution``) whose ε would
            exceed it; a model whose ledger already exceeds it is refused.
        accountant: one of `kdp.privacy.ACCOUNTANTS` (for ε in the logs and the
            budget); ``None`` (default): the model's, that of its persistent budget
            (`kdp.training.PrivacyGate.accountant_for`).
        per_step: write this accountant's ε into the batch logs (every DP model's
            `fit` already writes its own accountant's ε there).
        log_fn: ``"logging"`` (or lip-dp's ``"all"``) to also log ε at each epoch
            end with `logging`. lip-dp's ``"wandb"`` or a function is refused:
            ``epsilon`` and ``delta`` are in the epoch logs, for any logging callback.
    """

    #: its batch-end hook writes its own ε; it reads nothing `fit` puts in the step logs.
    reads_batch_logs = False

    @property
    def async_safe(self):
        """Keras may dispatch its batch ends to a worker thread unless ``per_step``
        (the exact ε after every step reads the ledger as that step left it)."""
        return not self.per_step

    def __init__(self, epsilon_max=None, accountant=None, per_step=False, log_fn=None):
        super().__init__()
        if epsilon_max is not None and not epsilon_max > 0:
            raise ValueError(f"epsilon_max must be > 0, got {epsilon_max}")
        if log_fn not in (None, "logging", "all"):
            raise ValueError(
                f"log_fn must be None, 'logging' or 'all', got {log_fn!r}: kdp writes epsilon "
                "and delta into the epoch logs, so pass the logging callback of your choice "
                "(e.g. wandb's, or keras.callbacks.CSVLogger) to fit next to DP_Accountant")
        if accountant is not None:
            privacy.check_accountant(accountant)
        self.epsilon_max = epsilon_max
        self.accountant = accountant
        self.per_step = per_step
        self.log_fn = log_fn

    def on_train_begin(self, logs=None):
        if self.epsilon_max is None:
            return
        model = self._model  # the gate only: no JAX state sync (`self.model` would)
        gate = model.privacy_gate
        gate.add_budget(id(self), self.epsilon_max, self.accountant)
        gate.check(model.step_plan().fit_mechanism, 1)  # nothing allowed: refuse now

    def on_train_end(self, logs=None):
        self._model.privacy_gate.remove_budget(id(self))

    def _epsilon(self, logs):
        eps, delta = self._model.privacy_spent(self.accountant)
        if logs is not None:
            logs["epsilon"] = eps
            logs["delta"] = delta
        return eps

    def on_train_batch_end(self, batch, logs=None):
        if self.per_step:
            self._epsilon(logs)

    def on_epoch_end(self, epoch, logs=None):
        eps = self._epsilon(logs)
        if self.log_fn is not None:
            logger.info("epoch %d: epsilon=%.4f delta=%g", epoch + 1, eps,
                        self._model.dp_parameters.delta)


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
        self.journal = LedgerJournal(path)
