"""Shared by the benchmark scripts: a callback timing every training step."""

import time

import keras
import numpy as np


class StepTimer(keras.callbacks.Callback):
    """Wall time of each training step (from batch begin to batch end)."""

    def __init__(self):
        super().__init__()
        self.times = []

    def on_train_batch_begin(self, batch, logs=None):
        self._start = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        self.times.append(time.perf_counter() - self._start)

    def median(self):
        return float(np.median(self.times))
