"""A small DP training run for the fault-injection test of `test_ledger.py`.

Usage: ``python tests/ledger_fault_run.py WORKDIR [--kill-at STEP --kill-when begin|end]``

Trains a small `DP_Sequential` for `EPOCHS` epochs with Keras' `BackupAndRestore`
(backup in ``WORKDIR/backup``). With ``--kill-at g`` the process sends itself
SIGKILL at the beginning or at the end of its global step ``g`` (0-based): no
Python cleanup, no callback after it, exactly like a crash. Run again without
``--kill-at``, it restores the checkpoint and finishes. At the end it saves the
model to ``WORKDIR/final.keras`` and writes ``WORKDIR/result.json``: the ledger,
its number of steps and ε.
"""

import argparse
import json
import os
import signal

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402

from kdp import layers, losses  # noqa: E402
from kdp.model import DP_Sequential, DPParameters  # noqa: E402
from kdp.pipeline import DatasetMetadata  # noqa: E402

N, BATCH, EPOCHS, SIGMA, DELTA = 120, 30, 5, 1.5, 1e-3
STEPS_PER_EPOCH = N // BATCH


def build():
    model = DP_Sequential(
        [layers.DP_BoundedInput((6,), 1.0), layers.DP_QuickSpectralDense(8), layers.DP_GroupSort(2),
         layers.DP_QuickSpectralDense(3)],
        dp_parameters=DPParameters("global", SIGMA, DELTA),
        dataset_metadata=DatasetMetadata((6,), 3, N, BATCH),
    )
    model.compile(optimizer="adam", loss=losses.DP_TauCategoricalCrossentropy(1.0))
    model.build((None, 6))
    return model


def data():
    rng = np.random.default_rng(0)
    return rng.normal(size=(N, 6)).astype("float32"), rng.integers(0, 3, N)


class Kill(keras.callbacks.Callback):
    def __init__(self, step, when):
        super().__init__()
        self.step, self.when, self.seen = step, when, 0

    def _maybe_kill(self, hook):
        if hook == self.when and self.seen == self.step:
            os.kill(os.getpid(), signal.SIGKILL)

    def on_train_batch_begin(self, batch, logs=None):
        self._maybe_kill("begin")

    def on_train_batch_end(self, batch, logs=None):
        self._maybe_kill("end")
        self.seen += 1


def run(workdir, kill_at=None, kill_when="end"):
    """Train (resuming from ``workdir/backup`` if there is one); return the result."""
    model = build()
    callbacks = [keras.callbacks.BackupAndRestore(os.path.join(workdir, "backup"))]
    if kill_at is not None:
        callbacks.append(Kill(kill_at, kill_when))
    x, y = data()
    model.fit(x, y, epochs=EPOCHS, verbose=0, callbacks=callbacks)
    model.save(os.path.join(workdir, "final.keras"))
    eps, delta = model.privacy_spent()
    result = {"entries": model.privacy_ledger.entries, "steps": model.privacy_ledger.training_steps(),
              "epsilon": eps, "delta": delta}
    with open(os.path.join(workdir, "result.json"), "w") as f:
        json.dump(result, f)
    return result


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("workdir")
    parser.add_argument("--kill-at", type=int, default=None)
    parser.add_argument("--kill-when", choices=("begin", "end"), default="end")
    args = parser.parse_args()
    run(args.workdir, args.kill_at, args.kill_when)


if __name__ == "__main__":
    main()
