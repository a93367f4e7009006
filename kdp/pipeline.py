"""Data: dataset metadata, data-independent input bounds, Poisson batches."""

import math
import os
import threading

import numpy as np
import keras


class DatasetMetadata:
    """What the privacy analysis needs to know about the training set.

    Args:
        input_shape: shape of one example.
        nb_classes: number of classes (outputs).
        nb_samples_train: ``N``, the number of training records.
        batch_size: the **expected** batch size ``b``; the sampling rate is
            ``q = b/N`` and the loss is divided by ``b``.
        nb_samples_test: size of the test set, if any.
        class_names: optional names of the classes.
        max_norm: input norm bound, if the model does not start with
            `DP_BoundedInput`.
    """

    def __init__(self, input_shape, nb_classes, nb_samples_train, batch_size,
                 nb_samples_test=None, class_names=None, max_norm=None):
        self.input_shape = tuple(int(d) for d in input_shape)
        self.nb_classes = int(nb_classes)
        self.nb_samples_train = int(nb_samples_train)
        self.batch_size = int(batch_size)
        self.nb_samples_test = None if nb_samples_test is None else int(nb_samples_test)
        self.class_names = None if class_names is None else [str(c) for c in class_names]
        self.max_norm = None if max_norm is None else float(max_norm)
        if self.nb_samples_train < 1:
            raise ValueError(f"nb_samples_train must be >= 1, got {nb_samples_train}")
        if not 1 <= self.batch_size <= self.nb_samples_train:
            raise ValueError(
                f"batch_size must be in [1, nb_samples_train={self.nb_samples_train}], "
                f"got {batch_size}: a batch larger than the dataset is not a subsample"
            )
        if self.max_norm is not None and not self.max_norm > 0:
            raise ValueError(f"max_norm must be > 0, got {max_norm}")

    @property
    def sampling_rate(self):
        """``q = b / N``."""
        return self.batch_size / self.nb_samples_train

    @property
    def steps_per_epoch(self):
        """``⌈N / b⌉``: one epoch is (about) one expected pass over the data."""
        return math.ceil(self.nb_samples_train / self.batch_size)

    def get_config(self):
        return {
            "input_shape": list(self.input_shape), "nb_classes": self.nb_classes,
            "nb_samples_train": self.nb_samples_train, "batch_size": self.batch_size,
            "nb_samples_test": self.nb_samples_test, "class_names": self.class_names,
            "max_norm": self.max_norm,
        }

    @classmethod
    def from_config(cls, config):
        return cls(**config)

    def __repr__(self):
        args = ", ".join(f"{k}={v!r}" for k, v in self.get_config().items() if v is not None)
        return f"DatasetMetadata({args})"


def draw_seed(reproducible, seed, offset=0):
    """``seed + offset`` if ``reproducible`` (tests only), else 31 bits of OS entropy."""
    if reproducible:
        return seed + offset
    return int.from_bytes(os.urandom(4), "little") >> 1


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
    """Poisson-sampled batches from in-memory arrays, padded to static shapes.

    Each step includes every record independently with probability ``q = b/N``
    (Poisson sampling, DESIGN §3.4). The batch is padded with zeros up to the
    smallest of ``shapes`` that holds it (a batch above the largest, the
    capacity, up to a multiple of the capacity: nothing is ever truncated), and a
    weight vector marks the real rows (their sample weight) and the padding (0).
    ``len`` is ``steps_per_epoch`` (``⌈N/b⌉``).

    Args:
        x, y: arrays with ``N`` rows.
        batch_size: the expected batch size ``b``.
        sample_weight: optional per-record weights in ``[0, 1]``.
        steps_per_epoch: defaults to ``⌈N/b⌉``.
        seed: ``None`` (default) draws from the OS entropy; an int makes the
            sampling reproducible (for tests only).
        multiple_of: round the padded sizes up to a multiple of this (the number
            of data-parallel replicas, which shard the global batch evenly).
            The sampling rate stays the global ``b/N``.
        shapes: the number of padded sizes (`poisson_batch_shapes`); the default
            1 pads every batch to the capacity (one compiled shape).
        workers: Keras' `PyDataset` threads that prepare batches ahead of the
            step (1: prepared when needed). Every batch is still one fresh,
            independent draw: the generator is used under a lock, and a draw
            that is prepared but never trained on releases nothing. With more
            than one worker the order of the draws depends on the threads, so
            a seeded sampling is only reproducible with ``workers=1``.
    """

    def __init__(self, x, y, batch_size, sample_weight=None, steps_per_epoch=None, seed=None,
                 multiple_of=1, shapes=1, workers=1):
        super().__init__(workers=workers, use_multiprocessing=False)
        self.x, self.y = x, y
        self.nb_samples = len(x)
        self.sampling_rate = batch_size / self.nb_samples
        self.shapes = poisson_batch_shapes(batch_size, self.nb_samples, shapes, multiple_of)
        self.sample_weight = (
            np.ones(self.nb_samples, dtype="float32") if sample_weight is None
            else np.asarray(sample_weight, dtype="float32")
        )
        self.steps = steps_per_epoch or math.ceil(self.nb_samples / batch_size)
        self.rng = np.random.default_rng(seed)
        self._rng_lock = threading.Lock()

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

    def __getitem__(self, index):
        idx = self.sample_indices()
        size = self.padded_size(len(idx))
        return (_pad(self.x, idx, size), _pad(self.y, idx, size), _pad(self.sample_weight, idx, size))

    def as_tf_dataset(self):
        """These batches as an endless `tf.data.Dataset` whose batch axis is
        unknown (``None``), so that TensorFlow accepts every padded size (Keras
        would fix the batch size of a `PyDataset` from its first two batches)."""
        import tensorflow as tf

        signature = tuple(tf.TensorSpec((None,) + a.shape[1:], tf.as_dtype(a.dtype))
                          for a in (self.x, self.y, self.sample_weight))

        def batches():
            while True:
                yield self[0]

        dataset = tf.data.Dataset.from_generator(batches, output_signature=signature)
        return dataset.prefetch(self.workers)  # batches prepared ahead, as with workers


class ShuffledBatches(keras.utils.PyDataset):
    """Shuffled batches of exactly ``b`` records (``sampling="shuffle"`` only).

    Each pass over the data is a fresh random permutation cut into ``⌊N/b⌋``
    batches (the remainder is dropped), so a record is in at most one batch per
    pass: what the ``"shuffle"`` accounting assumes. Batch ``index`` belongs to
    pass ``index // ⌊N/b⌋``, so ``steps_per_epoch`` must be a multiple of
    ``⌊N/b⌋``. Same arguments as `PoissonBatches`.
    """

    def __init__(self, x, y, batch_size, sample_weight=None, steps_per_epoch=None, seed=None):
        super().__init__()
        self.x, self.y = x, y
        self.nb_samples = len(x)
        self.batch_size = int(batch_size)
        self.sample_weight = (
            np.ones(self.nb_samples, dtype="float32") if sample_weight is None
            else np.asarray(sample_weight, dtype="float32")
        )
        self.steps_per_pass = max(1, self.nb_samples // self.batch_size)
        self.steps = steps_per_epoch or self.steps_per_pass
        if self.steps % self.steps_per_pass:
            raise ValueError(
                f"with shuffled batches, steps_per_epoch ({self.steps}) must be a multiple "
                f"of the steps of one pass, N // b = {self.steps_per_pass}"
            )
        self.rng = np.random.default_rng(seed)
        self._order = None

    def __len__(self):
        return self.steps

    def __getitem__(self, index):
        position = index % self.steps_per_pass
        if self._order is None or position == 0:
            self._order = self.rng.permutation(self.nb_samples)
        idx = self._order[position * self.batch_size:(position + 1) * self.batch_size]
        return self.x[idx], self.y[idx], self.sample_weight[idx]


def _pad(array, idx, size):
    """``array[idx]`` followed by zero rows up to ``size`` rows (one gather, no temporary)."""
    out = np.empty((size,) + array.shape[1:], dtype=array.dtype)
    np.take(array, idx, axis=0, out=out[: len(idx)])
    out[len(idx):] = 0
    return out


def bound_clip_value(clip_value):
    """``(fn, bound)``: ``fn`` projects each example onto the L2 ball of radius
    ``clip_value`` (NumPy, data independent, so free of privacy cost)."""
    if not clip_value > 0:
        raise ValueError(f"clip_value must be > 0, got {clip_value}")

    def fn(x):
        x = np.asarray(x, dtype="float32")
        norms = np.linalg.norm(x.reshape(len(x), -1), axis=1)
        scale = np.minimum(1.0, clip_value / np.maximum(norms, 1e-12))
        return x * scale.reshape((-1,) + (1,) * (x.ndim - 1))

    return fn, float(clip_value)


def bound_normalize():
    """``(fn, 1.0)``: ``fn`` scales each example to unit L2 norm (zeros stay zero)."""

    def fn(x):
        x = np.asarray(x, dtype="float32")
        norms = np.linalg.norm(x.reshape(len(x), -1), axis=1)
        return x / np.maximum(norms, 1e-12).reshape((-1,) + (1,) * (x.ndim - 1))

    return fn, 1.0

# The loaders live in kdp.datasets; kdp.pipeline re-exports them (lip-dp's layout).
from kdp.datasets import (  # noqa: E402
    load_breast_cancer, load_cifar10, load_dataset, load_digits, load_fashion_mnist, load_mnist,
)

__all__ = [
    "DatasetMetadata", "draw_seed", "PoissonBatches", "ShuffledBatches", "check_batch_shapes", "poisson_batch_shapes",
    "poisson_capacity",
    "bound_clip_value",
    "bound_normalize", "load_breast_cancer", "load_cifar10", "load_dataset", "load_digits",
    "load_fashion_mnist", "load_mnist",
]
