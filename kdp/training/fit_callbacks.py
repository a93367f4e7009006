"""The callbacks a DP model's `fit` adds to Keras' loop: the gate's and the progress bar.

Both are safe for Keras' asynchronous dispatch of batch ends (``async_safe``):
on a backend that allows it (JAX), Keras converts a step's logs and calls every
batch-end hook on a worker thread, so the host never waits for a step to
finish before it dispatches the next one, as for a plain Keras model. What
must happen before the next step (the budget stop) is decided when a block of
steps begins, from host-side state only (the ledger); what a batch end writes
(ε in the step's logs) comes from a copy of the ledger taken when the block
began. A user callback with its own batch-end hook opts the whole `fit` into
synchronous dispatch, as in Keras.
"""

import threading

import keras

from kdp.training.ledger import PrivacyLedger

#: how many times an epoch's step logs compute ε when PLD is computed
PLD_POINTS_PER_EPOCH = 4


class GateCallback(keras.callbacks.Callback):
    """`fit`'s side of the gate.

    * Before each block of steps (``steps_per_execution``), on the main thread:
      stops training after this block if the budgets would not allow the next
      one (`fit` then warns), and keeps a copy of the ledger as it will stand
      once the block has run.
    * At each batch end (on a worker thread where Keras dispatches them so):
      writes ``epsilon`` into the step's logs from that copy (when anything reads
      them; with PLD an upper bound, `_ahead`).
    * At each epoch's end (after Keras waited for every batch end): takes back
      the steps of a block that provably did not run (the end of an epoch inside
      a block: neither Keras nor the step's host check saw them), and writes the
      exact ``epsilon``, ``delta`` into the epoch's logs.

    It is first in `fit`'s list, so other callbacks (checkpoints, accountants)
    see a ledger that covers the step they observe. It reads ``self._model``, not
    ``self.model`` (whose JAX state sync would cost three copies of the weights
    per step). On several processes (``processes``) it checks that their ledgers
    and budgets agree at the first step and at every epoch's end.
    """

    #: reads host-side state only: Keras may dispatch its batch ends asynchronously
    async_safe = True

    def __init__(self, mechanism, block, processes=None, epsilon_per_step=True):
        super().__init__()
        self.mechanism, self.block = mechanism, block
        self.processes = processes
        self.epsilon_per_step = epsilon_per_step
        self._verified = processes is None
        self._lock = threading.Lock()

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch
        self._recorded = 0  # steps of this epoch recorded (run or about to run)
        self._done = 0  # steps of this epoch that ran (the furthest batch end seen)
        self._ledgers = {}  # first step of a block -> the ledger once the block ran

    def on_train_batch_begin(self, batch, logs=None):
        if not self._verified:
            self.processes.verify()
            self._verified = True
        gate = self._model.privacy_gate
        runs = self._steps_in_block(batch)
        self._recorded += self.block
        if self.epsilon_per_step:
            after = PrivacyLedger([dict(e) for e in gate.ledger.entries])
            after.record(self.mechanism, runs, gate.run)
            self._ledgers[batch] = after
        # the block about to run spends `runs` steps; stop after it if the next would not fit
        if gate.remaining(self.mechanism) - runs < self.block and not self._last_step(batch + runs):
            self._model.stop_training = True
            # the limits in force, for the warning after fit (a callback's is gone by then)
            self._model._budget_stop = gate.budgets()

    def on_train_batch_end(self, batch, logs=None):
        done = batch + 1  # Keras passes the index of the last step executed
        with self._lock:
            self._done = max(self._done, done)
        first = (done - 1) // self.block * self.block
        ledger = self._ledgers.pop(first, None)
        if logs is None or ledger is None:  # nothing reads the step's logs
            return
        ran = ledger.entries[-1]["count"] - (first + self._steps_in_block(first) - done)
        ledger.entries[-1]["count"] = ran  # a stream's last block may be shorter than planned
        gate = self._model.privacy_gate
        logs["epsilon"] = gate.privacy_spent(ahead=self._ahead(gate, done), ledger=ledger)[0]

    def on_epoch_end(self, epoch, logs=None):
        gate = self._model.privacy_gate
        if self._done < self._recorded:
            gate.settle(self._recorded - self._done)
            self._recorded = self._done
        if self.processes is not None:
            self.processes.verify()
        if logs is not None:  # every later callback sees ε and δ, with or without DP_Accountant
            logs["epsilon"], logs["delta"] = self._model.privacy_spent()

    def _steps_in_block(self, first):
        """How many steps the block starting at step ``first`` of the epoch runs:
        fewer than ``block`` at the end of an epoch of known length."""
        steps = (self.params or {}).get("steps")
        return self.block if not steps else max(0, min(self.block, steps - first))

    def _ahead(self, gate, done):
        """Steps to the next of `PLD_POINTS_PER_EPOCH` points of the epoch (its end
        included) when ε is computed with PLD (≈ 30 ms an ε, against ≈ 0.3 ms
        with RDP, which stays exact every step): a step's logs show the ε of that
        point, an upper bound, and the epoch's end its exact ε."""
        steps = (self.params or {}).get("steps")
        if not steps or gate.accountant == "rdp":
            return 0
        every = -(-steps // PLD_POINTS_PER_EPOCH)
        return min(-done % every, max(steps - done, 0))

    def _last_step(self, done):
        params = self.params or {}
        return self._epoch + 1 == params.get("epochs") and done == params.get("steps")


class ProgbarLogger(keras.callbacks.ProgbarLogger):
    """Keras' progress bar, except that:

    * it never goes back: Keras runs asynchronous batch ends on a pool of
      threads, in any order (the bar would show step 3, then step 1); a batch
      end older than the one shown is skipped, and one is drawn at a time;
    * an epoch cut short by the privacy budget ends at the number of steps that
      ran (Keras would show the full epoch)."""

    #: Keras dispatches its own progress bar's batch ends asynchronously too
    async_safe = True

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._drawing = threading.Lock()

    def _update_progbar(self, batch, logs=None):
        with self._drawing:
            if batch + 1 > self.seen:
                super()._update_progbar(batch, logs)

    def on_epoch_end(self, epoch, logs=None):
        if getattr(self._model, "_budget_stop", False) and self.progbar is not None:
            self.target = self.progbar.target = self.seen
        super().on_epoch_end(epoch, logs)


def reads_batch_logs(callbacks, verbose):
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


def fit_callbacks(callbacks, mechanism, block, processes, verbose):
    """Keras' callback list for a DP model's `fit`: the gate's first, then the
    user's, and the progress bar where Keras would put its own (none at
    ``verbose=0``)."""
    gate = GateCallback(mechanism, block, processes, reads_batch_logs(callbacks, verbose))
    callbacks = [gate] + list(callbacks)
    if verbose != 0 and not any(isinstance(cb, keras.callbacks.ProgbarLogger) for cb in callbacks):
        callbacks.append(ProgbarLogger())
    return callbacks
