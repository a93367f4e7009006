"""Shared by the benchmark scripts: a step timer, the peak memory reading and the
Clipless MLP they all time."""

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


def peak_rss_mb():
    """This process's peak RSS in MB (it sees XLA's and TensorFlow's allocators):
    ``VmHWM`` on Linux, reset by ``exec``, unlike ``ru_maxrss``, which a child
    started by `subprocess` can inherit from its parent's peak; elsewhere
    `resource.getrusage`."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def clipless_mlp(nb_samples, batch_size, activation="groupsort", **dp_parameters):
    """The Lipschitz MLP 784→512→512→10 (``"groupsort"``: `DP_GroupSort(2)`, or
    ``"relu"``: `DP_ReLU`) as a compiled `DP_Sequential` with per-layer noise
    (σ = 1), SGD and τ-cross-entropy; ``dp_parameters`` go to `DPParameters`."""
    import kdp
    from kdp import layers, losses

    act = {"groupsort": lambda: layers.DP_GroupSort(2), "relu": layers.DP_ReLU}[activation]
    model = kdp.DP_Sequential(
        [layers.DP_BoundedInput((784,), 10.0), layers.DP_QuickSpectralDense(512), act(),
         layers.DP_QuickSpectralDense(512), act(), layers.DP_QuickSpectralDense(10)],
        dp_parameters=kdp.DPParameters("per-layer", 1.0, 1e-5, **dp_parameters),
        dataset_metadata=kdp.DatasetMetadata((784,), 10, nb_samples, batch_size),
    )
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss=losses.DP_TauCategoricalCrossentropy(1.0))
    return model
