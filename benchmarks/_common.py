"""Shared by the benchmark scripts: the time of a step as a user sees it
(`fit_step_time`), a per-step callback timer, the peak memory reading
(`_runs.peak_rss_mb`) and the Clipless MLP they all time."""

import statistics
import time

import keras
import numpy as np
from _runs import peak_rss_mb  # noqa: F401  (re-exported for the scripts)


def fit_step_time(model, x, y, batch_size, steps, warmup, repeats=1):
    """Seconds per step of one `fit`: its wall time divided by its number of steps.

    What a user sees: the whole loop, with drawing and padding kdp's Poisson
    batches, the noise and the projections, and Keras dispatching batch ends
    asynchronously where the backend allows it (JAX). No callback with a
    batch-end hook is passed: one would make Keras wait for every step (a
    per-step timer would also miss the host's work between two steps).

    Before timing, a ``fit`` of ``warmup`` steps compiles the training step;
    for a kdp model (one with ``dp_parameters``), one `train_on_batch` per padded
    Poisson batch size (sample weights 0) then compiles every size, so that the
    timed ``fit`` compiles nothing. A plain Keras model (batches of ``batch_size``,
    reshuffled every epoch) stops at the end of ``x``: it runs whole epochs,
    at least ``steps`` steps in all; kdp's ``fit`` runs
    ``steps`` Poisson steps in one epoch. The clock stops at the end of
    training (Keras' ``on_train_end``, a hook that leaves batch ends
    asynchronous) once the last update's weights can be read: before ``fit``
    deletes its data iterator, which on TensorFlow took 0.3–1.3 s in about one
    ``fit`` in three when the pipeline was autotuned (Keras' own pipeline of
    NumPy arrays; 2.21), a cost of ending a ``fit``, not of its steps. With
    ``repeats > 1`` the timed ``fit`` runs that many times and the median of
    its times is returned (the machine's own noise).
    """
    end = _TrainEnd()
    if getattr(model, "dp_parameters", None) is None:
        per_epoch = len(x) // batch_size
        epochs = -(-steps // per_epoch)
        model.fit(x, y, batch_size=batch_size, epochs=1, steps_per_epoch=min(warmup, per_epoch), verbose=0)

        def timed():
            model.fit(x, y, batch_size=batch_size, shuffle=True, epochs=epochs, steps_per_epoch=per_epoch,
                      verbose=0, callbacks=[end])
            return epochs * per_epoch
    else:
        from kdp.pipeline import poisson_batch_shapes

        md = model.dataset_metadata
        model.fit(x, y, epochs=1, steps_per_epoch=warmup, verbose=0)
        for size in poisson_batch_shapes(md.batch_size, md.nb_samples_train, model.dp_parameters.batch_shapes):
            model.train_on_batch(x[:size], y[:size], sample_weight=np.zeros(size, "float32"))

        def timed():
            model.fit(x, y, epochs=1, steps_per_epoch=steps, verbose=0, callbacks=[end])
            return steps
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        done = timed()
        times.append((end.time - start) / done)
    return statistics.median(times)


class _TrainEnd(keras.callbacks.Callback):
    """The time at which training ended and its last update's weights could be read."""

    def on_train_end(self, logs=None):
        keras.ops.convert_to_numpy(self.model.trainable_variables[-1])  # the last update has run
        self.time = time.perf_counter()


class StepTimer(keras.callbacks.Callback):
    """Wall time of each training step (from batch begin to batch end).

    A callback with a batch-end hook turns off Keras' asynchronous dispatch of
    batch ends: the host then waits for every step. `fit_step_time` times a step
    as a user's ``fit`` runs it."""

    def __init__(self):
        super().__init__()
        self.times = []

    def on_train_batch_begin(self, batch, logs=None):
        self._start = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        self.times.append(time.perf_counter() - self._start)

    def median(self):
        return float(np.median(self.times))


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
