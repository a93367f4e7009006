"""Sampling of `fit`'s batches: Poisson batches padded to static shapes (the
default, what the accountant assumes) and shuffled fixed-size passes (opt-in).

Poisson sampling (Abadi et al. 2016; Zhu and Wang 2019 for its amplification)
includes every record independently with probability ``q = b/N`` at each step.
Static shapes: each batch is padded with zero-weight rows to one of a few fixed
sizes (a "ladder"), never truncated.
"""

import math
import threading

import keras
import numpy as np

from kdp import distribute
from kdp.training.seeds import draw_seed, numpy_generator


def poisson_capacity(batch_size, nb_samples):
    """The largest static batch size for Poisson batches of mean ``b``: ``b + 6√b + 8`` (≤ N).

    A larger batch (probability < 1e-9) is padded to the next multiple of this
    capacity, never truncated.
    """
    return min(nb_samples, int(math.ceil(batch_size + 6 * math.sqrt(batch_size) + 8)))


#: ``count → c_j``: the padding ladder has the sizes ``b + c_j·s`` and the capacity.
_LADDER_OFFSETS = {1: (), 2: (1.0,), 3: (0.5, 2.0)}


def check_batch_shapes(count):
    """``count`` as an int if it is a valid number of padded sizes, else a `ValueError`."""
    if count not in _LADDER_OFFSETS:
        raise ValueError(f"batch_shapes must be one of {sorted(_LADDER_OFFSETS)}, got {count!r}")
    return int(count)


def poisson_batch_shapes(batch_size, nb_samples, count=3, multiple_of=1):
    """The static sizes Poisson batches are padded to (a padding ladder).

    A Poisson batch has ``B ~ Binomial(N, q)`` records, mean ``b`` and standard
    deviation ``s = √(b(1 − q))``. It is padded to the smallest size of the
    ladder that holds it: ``b + c_j·s`` for the offsets ``c_j`` of ``count``
    (3: ``c = 0.5, 2``; 2: ``c = 1``; 1: none), and the capacity
    `poisson_capacity` last. Each size is one compiled shape; the expected
    padding falls from ``6√b + 8`` rows (one shape: +19 % rows at b = 1024) to
    about ``0.8·s`` with three (+3 %). The padded size depends on the private
    ``B`` only through the running time, which kdp does not protect (README);
    nothing released depends on it.

    Args:
        batch_size: the expected batch size ``b``.
        nb_samples: ``N``.
        count: the number of sizes, 1 to 3.
        multiple_of: round every size up to a multiple of this (data-parallel
            replicas shard the global batch evenly).

    Returns:
        The sorted tuple of sizes; the last one is the capacity.
    """
    count = check_batch_shapes(count)
    capacity = poisson_capacity(batch_size, nb_samples)
    spread = math.sqrt(batch_size * (1.0 - batch_size / nb_samples))
    sizes = {capacity} | {min(capacity, math.ceil(batch_size + c * spread)) for c in _LADDER_OFFSETS[count]}
    multiple_of = max(1, int(multiple_of))
    return tuple(sorted({-(-size // multiple_of) * multiple_of for size in sizes}))


class PoissonBatches(keras.utils.PyDataset):
    """Poisson-sampled batches from in-memory arrays or a record source, padded
    to static shapes.

    Each step includes every record independently with probability ``q = b/N``
    (Poisson sampling, Abadi et al. 2016). The batch is padded with zeros up to the
    smallest of ``shapes`` that holds it (a batch above the largest, the
    capacity, up to a multiple of the capacity: nothing is ever truncated), and a
    weight vector marks the real rows (their sample weight) and the padding (0).
    ``len`` is ``steps_per_epoch`` (``⌈N/b⌉``).

    Only the drawn records are read (`as_records`): from a
    `kdp.training.sources.ValidatedRecords` each batch is read and validated in
    `__getitem__`, so with ``workers > 1`` the reading runs ahead of the step.

    Args:
        x, y: arrays with ``N`` rows; or ``x`` records read by index (an object
            with ``read(indices, rows)``, `as_records`) and ``y`` ``None``.
        batch_size: the expected batch size ``b``.
        sample_weight: optional per-record weights in ``[0, 1]`` (arrays only).
        steps_per_epoch: defaults to ``⌈N/b⌉``.
        seed: ``None`` (default) draws from the OS entropy; an int makes the
            sampling reproducible (for tests only).
        multiple_of: round the padded sizes up to a multiple of this (the number
            of data-parallel replicas, which shard the global batch evenly).
            The sampling rate stays the global ``b/N``.
        shapes: the number of padded sizes (`poisson_batch_shapes`); the default
            1 pads every batch to the capacity (one compiled shape).
        workers: Keras' `PyDataset` threads that prepare batches ahead of the
            step (1: prepared when needed), at most ``max(2, workers)``
            batches ahead. Every batch is still one fresh,
            independent draw: the generator is used under a lock, and a draw
            that is prepared but never trained on releases nothing. With more
            than one worker the order of the draws depends on the threads, so
            a seeded sampling is only reproducible with ``workers=1``.
        population: ``N``, the records of the whole dataset when ``x`` is one
            process's shard of it (default ``len(x)``): the sampling rate is
            ``b/N`` and an epoch ``⌈N/b⌉`` steps.
        reference_rows: the shard size the padded sizes are computed for (the
            largest shard, so that every process has the same sizes; default
            ``len(x)``).
        agree: ``records -> records``, called with each draw's size on every
            process: the size to pad to (the largest over the processes, so
            that they share one shape; `kdp.training.processes`). Needs
            ``workers=1`` (the processes must call it in the same order).
    """

    def __init__(self, x, y, batch_size, sample_weight=None, steps_per_epoch=None, seed=None,
                 multiple_of=1, shapes=1, workers=1, population=None, reference_rows=None,
                 agree=None):
        if agree is not None and workers != 1:
            raise ValueError("agree= needs workers=1: every process must agree on its draws in order")
        super().__init__(workers=workers, use_multiprocessing=False, max_queue_size=max(2, workers))
        self.records = as_records(x, y, sample_weight)
        self.nb_samples = len(self.records)
        population = population or self.nb_samples
        reference = reference_rows or self.nb_samples
        self.sampling_rate = batch_size / population
        expected = batch_size if reference == population else self.sampling_rate * reference
        self.shapes = poisson_batch_shapes(expected, reference, shapes, multiple_of)
        self.steps = steps_per_epoch or math.ceil(population / batch_size)
        self.rng = numpy_generator(seed is not None, seed)
        self._rng_lock = threading.Lock()
        self._agree = agree
        self._primed = None
        self._prime_lock = threading.Lock()

    @property
    def capacity(self):
        """The largest padded size; larger batches take a multiple of it."""
        return self.shapes[-1]

    def __len__(self):
        return self.steps

    def sample_indices(self):
        """One Poisson draw: the indices of the records in the next batch."""
        with self._rng_lock:  # NumPy generators are not thread safe
            uniforms = self.rng.random(self.nb_samples)
        return np.flatnonzero(uniforms < self.sampling_rate)

    def padded_size(self, records):
        """The static size a batch of ``records`` rows is padded to."""
        for size in self.shapes:
            if records <= size:
                return size
        return self.capacity * math.ceil(records / self.capacity)

    def draw(self):
        """One Poisson draw, read (and, from a source, validated) and padded."""
        idx = self.sample_indices()
        size = self.padded_size(len(idx) if self._agree is None else self._agree(len(idx)))
        return self.records.read(idx, size)

    def prime(self):
        """Draw and read the first batch now (it is the next one served): a
        source's first records are then read and validated before `fit` spends
        anything. Returns it."""
        with self._prime_lock:
            if self._primed is None:
                self._primed = self.draw()
            return self._primed

    def __getitem__(self, index):
        with self._prime_lock:
            primed, self._primed = self._primed, None
        return self.draw() if primed is None else primed

    def as_tf_dataset(self):
        """These batches as an endless `tf.data.Dataset` whose batch axis is
        unknown (``None``), so that TensorFlow accepts every padded size (Keras
        would fix the batch size of a `PyDataset` from its first two batches).

        Without tf.data's autotuning, which has nothing to tune here (one
        generator, a fixed prefetch): deleting an autotuned iterator, which
        Keras does at the end of every ``fit``, waited for its tuning thread and
        stalled about one ``fit`` in three by 0.3–1.3 s (TensorFlow 2.21, also
        with a plain Keras ``fit`` on a `tf.data` pipeline)."""
        import tensorflow as tf

        signature = keras.tree.map_structure(
            lambda a: tf.TensorSpec((None,) + a.shape[1:], tf.as_dtype(a.dtype)), self.prime())

        def batches():
            while True:
                yield self[0]

        options = tf.data.Options()
        options.autotune.enabled = False
        dataset = tf.data.Dataset.from_generator(batches, output_signature=signature)
        return dataset.prefetch(self.workers).with_options(options)  # batches prepared ahead, as with workers


class ShuffledBatches(keras.utils.PyDataset):
    """Shuffled batches of exactly ``b`` records (``sampling="shuffle"`` only).

    Each pass over the data is a fresh random permutation cut into ``⌊N/b⌋``
    batches (the remainder is dropped), so a record is in at most one batch per
    pass: what the ``"shuffle"`` accounting assumes. Batch ``index`` of epoch
    ``e`` belongs to pass ``(e, index // ⌊N/b⌋)`` and is cut from that pass's
    permutation, whatever the order in which batches are requested (Keras may
    prefetch or reorder them); ``steps_per_epoch`` must be a multiple of
    ``⌊N/b⌋``. `fit` visits the batches in order (``shuffle=False``), so ``n``
    steps touch at most ``⌈n / ⌊N/b⌋⌉`` passes. Same arguments as `PoissonBatches`.
    """

    def __init__(self, x, y, batch_size, sample_weight=None, steps_per_epoch=None, seed=None):
        super().__init__()
        self.records = as_records(x, y, sample_weight)
        self.nb_samples = len(self.records)
        self.batch_size = int(batch_size)
        self.steps_per_pass = max(1, self.nb_samples // self.batch_size)
        self.steps = steps_per_epoch or self.steps_per_pass
        if self.steps % self.steps_per_pass:
            raise ValueError(
                f"with shuffled batches, steps_per_epoch ({self.steps}) must be a multiple "
                f"of the steps of one pass, N // b = {self.steps_per_pass}"
            )
        self._entropy = draw_seed(seed is not None, seed)
        self._epoch = -1  # batches requested before the first epoch (shape probes) are never trained on
        self._permutations = {}
        self._lock = threading.Lock()

    def __len__(self):
        return self.steps

    def on_epoch_begin(self):
        with self._lock:
            self._epoch += 1
            self._permutations.clear()

    def permutation(self, index):
        """The permutation of the pass that batch ``index`` of the current epoch belongs to."""
        key = (self._epoch, index // self.steps_per_pass)
        with self._lock:
            if key not in self._permutations:
                rng = np.random.default_rng([self._entropy, key[0] + 1, key[1]])
                self._permutations[key] = rng.permutation(self.nb_samples)
            return self._permutations[key]

    def __getitem__(self, index):
        position = index % self.steps_per_pass
        idx = self.permutation(index)[position * self.batch_size:(position + 1) * self.batch_size]
        return self.records.read(np.sort(idx), len(idx))


class ArrayRecords:
    """Validated in-memory arrays read by index (`as_records`); ``x`` an array or a
    structure of arrays (a dict or list of a multi-input model), one row per record."""

    def __init__(self, x, y, sample_weight=None):
        self.x, self.y = keras.tree.lists_to_tuples(x), y  # tf.data and Keras' PyDataset take tuples
        self.weights = (np.ones(len(y), dtype="float32") if sample_weight is None
                        else np.asarray(sample_weight, dtype="float32"))

    def __len__(self):
        return len(self.y)

    def read(self, indices, rows):
        """``(x, y, weights)`` of the records at ``indices``, zero rows up to ``rows``
        (in every array of ``x``)."""
        x = keras.tree.map_structure(lambda a: _pad(a, indices, rows), self.x)
        return (x,) + tuple(_pad(a, indices, rows) for a in (self.y, self.weights))


def as_records(x, y=None, sample_weight=None):
    """What the samplers read from: ``x`` itself if it reads records by index
    (``read(indices, rows) -> (x, y, weights)`` padded to ``rows`` rows, e.g.
    `kdp.training.sources.ValidatedRecords`), else `ArrayRecords` of the arrays."""
    if hasattr(x, "read") and y is None:
        return x
    return ArrayRecords(x, y, sample_weight)


def _process_batches(records, batch_size, params, steps_per_epoch, replicas, processes, seed):
    """`fit_batches` for one process of several (Poisson sampling: `fit` refused the rest)."""
    if seed is not None:  # the same seed on every process would draw correlated shards
        seed = seed + 7919 * processes.index
    jax = keras.backend.backend() == "jax"
    batches = PoissonBatches(
        records, None, batch_size, None, steps_per_epoch, seed=seed, multiple_of=replicas,
        shapes=params.batch_shapes, population=processes.model.dataset_metadata.nb_samples_train,
        reference_rows=max(processes.rows), agree=processes.agree_rows if jax else None)
    if jax:
        return batches, len(batches)
    strategy = processes.model.distribute_strategy
    return strategy.distribute_datasets_from_function(lambda context: batches.as_tf_dataset()), len(batches)


def _pad(array, idx, size):
    """``array[idx]`` followed by zero rows up to ``size`` rows (one gather, no temporary)."""
    out = np.empty((size,) + array.shape[1:], dtype=array.dtype)
    np.take(array, idx, axis=0, out=out[: len(idx)])
    out[len(idx):] = 0
    return out


def fit_batches(records, batch_size, params, steps_per_epoch=None, replicas=1, processes=None,
                prefetch=None):
    """``(data, steps_per_epoch)`` for Keras' `fit` on validated records.

    Poisson sampling (``params.sampling == "poisson"``): `PoissonBatches` padded to
    ``params.batch_shapes`` sizes. TensorFlow fixes a `PyDataset`'s batch shape
    from its first two batches, so with several sizes it gets an endless
    `tf.data` stream whose batch axis is unknown (not under `tf.distribute`, which
    keeps one size). A second thread prepares the next batch while the step
    runs (``prefetch``; by default on an accelerator, where the host work is
    most of a small step; not on the CPU, where the step uses every core and
    Keras' thread pool costs ≈ 0.1 s per epoch), never when seeded, where one
    draw order is wanted.

    Shuffled passes (``"shuffle"``): `ShuffledBatches` of exactly ``b`` records.

    Args:
        records: `ArrayRecords` of the validated training arrays, or a source's
            `kdp.training.sources.ValidatedRecords` (validated per batch).
        batch_size: the expected batch size ``b``.
        params: the model's `DPParameters` (sampling, batch shapes, seed).
        steps_per_epoch: Keras' argument (default: one pass).
        replicas: data-parallel replicas sharing each global batch.
        processes: the `kdp.training.processes.ProcessGroup` when several
            processes train together: ``records`` are this process's shard,
            sampled at the global rate ``b/N``; ``replicas`` counts this
            process's replicas. JAX: the processes agree on one padded size per
            step. TensorFlow: each worker feeds its own batches to its replica
            (``distribute_datasets_from_function``; the replicas' shapes may
            differ, only gradients are reduced).
        prefetch: prepare batches ahead of the step (two threads) when
            unseeded: ``True``, ``False`` or ``None`` (on an accelerator only).

    Returns:
        ``(data, steps_per_epoch)``; a `PoissonBatches` ``data`` has read its
        first batch (`PoissonBatches.prime`), so a source's first records were
        validated before anything is spent.
    """
    seed = params.draw_seed(offset=1) if params.reproducible else None
    if processes is not None:
        return _process_batches(records, batch_size, params, steps_per_epoch, replicas,
                                processes, seed)
    if params.sampling == "shuffle":
        if batch_size % replicas:
            raise ValueError(f"shuffled batches of b={batch_size} records cannot be split "
                             f"evenly over {replicas} replicas: choose b divisible by {replicas}")
        return ShuffledBatches(records, None, batch_size, None, steps_per_epoch, seed=seed), steps_per_epoch
    tensorflow = keras.backend.backend() == "tensorflow"
    shapes = 1 if tensorflow and replicas > 1 else params.batch_shapes
    ahead = distribute.on_accelerator() if prefetch is None else prefetch
    workers = 2 if seed is None and ahead else 1
    batches = PoissonBatches(records, None, batch_size, None, steps_per_epoch, seed=seed,
                             multiple_of=replicas, shapes=shapes, workers=workers)
    batches.prime()
    if tensorflow and len(batches.shapes) > 1:
        return batches.as_tf_dataset(), len(batches)
    return batches, steps_per_epoch
