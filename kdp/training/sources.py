"""Training records read by index: data that does not have to fit in memory.

Poisson sampling (Abadi et al. 2016) needs nothing but random access: each step
draws the indices of its records (`kdp.training.sampling.PoissonBatches`) and
reads those records only. A `RecordSource` wraps anything with ``__len__`` and
``__getitem__`` over record indices (a NumPy array or `np.memmap`, an HDF5 or
zarr dataset, a Hugging Face `datasets.Dataset`, a `grain` random-access
source, a list of file names with a decoding ``transform``), so `fit` trains on
it with exactly the accounting of in-memory arrays: the same plan, the same
ledger entry, the same ε.

Each drawn batch is read on the host (by reader threads or processes when
asked), validated by `kdp.training.validation.validate_batch` and padded,
ahead of the step on an accelerator (a bounded prefetch): a record that would
break a bound refuses the step, naming the record's index, before anything is
charged (`ValidatedRecords`).

What the source promises: record ``i`` is the same at every read (a source that
is not deterministic, e.g. a random augmentation in ``transform``, is the
user's responsibility: each read is then a different record, which the
accounting does not cover), and one record is one individual.
"""

import concurrent.futures
import os
import threading
import weakref

import numpy as np

from kdp import _reader_processes
from kdp.training.validation import DataValidationError, probe_loss, validate_batch

class RecordSource:
    """Records read by index, for `DP_Model.fit` (Poisson sampling, reading only
    the sampled records).

    Args:
        records: anything with ``len(records)`` and ``records[i]`` for record
            indices ``i`` (arrays, memmaps, HDF5 datasets, Hugging Face datasets,
            a list of file names, a user class).
        labels: optional labels indexable like ``records`` (an array of ``N``
            labels). Without them, each record (after ``transform``) must be a
            tuple ``(x, y)`` or ``(x, y, sample_weight)``.
        transform: optional ``record -> x`` (with ``labels``) or ``record -> (x,
            y[, w])``, run on the host for each read record (e.g. decode an image
            file). Must be deterministic (the module's docstring).
        sample_weight: optional per-record weights in [0, 1], indexable like
            ``records`` (a third element of a record takes their place).
        start, stop: this process's range of record indices when several
            processes share one source (default: all records). ``fit`` checks
            that the processes' ranges partition the source.
        readers: how many records of one batch are read (and transformed) at
            once (default 1): threads, which help when reading waits (a network
            file system, a decoder that releases the GIL), or processes.
        processes: read in ``readers`` worker processes (started by ``spawn``)
            instead of threads: for a transform written in Python that holds
            the GIL (decoding small images with Pillow). ``records`` and
            ``transform`` must pickle (e.g. a list of paths and a function
            defined at a module's top level, not in a notebook), and, as for
            any spawned process, a script's top-level code must be guarded by
            ``if __name__ == "__main__":`` (each worker imports the script).
        prefetch: read the next batches while the step runs (2 threads, at
            most 2 batches ahead). Default (``None``): on an accelerator only
            (on a CPU the step uses every core). TensorFlow's stream of
            several padded sizes holds one batch ahead in any case.
        name: what identifies the source across processes (default: a memmap's
            file name, an HDF5 dataset's file and name, else the type's name).

    Arrays and memmaps without a ``transform`` are read with one fancy-indexing
    call (sorted indices: sequential on disk).
    """

    def __init__(self, records, labels=None, transform=None, *, sample_weight=None, start=0,
                 stop=None, readers=1, processes=False, prefetch=None, name=None):
        if not (hasattr(records, "__len__") and hasattr(records, "__getitem__")):
            raise TypeError(
                f"a RecordSource needs records that support len() and [index], got "
                f"{type(records).__name__}. A stream without random access (a tf.data pipeline, "
                "a generator) cannot be Poisson-sampled: train it with "
                "DPParameters(sampling='shuffle') and its weaker accounting.")
        if transform is not None and not callable(transform):
            raise TypeError("transform must be a callable record -> x or (x, y[, w])")
        if isinstance(labels, (list, tuple)):
            labels = np.asarray(labels)
        self.records, self.labels, self.transform = records, labels, transform
        self.sample_weight = None if sample_weight is None else np.asarray(sample_weight, "float32")
        self.total = len(records)
        for what, values in (("labels", labels), ("sample_weight", self.sample_weight)):
            if values is not None and len(values) != self.total:
                raise ValueError(f"{what} has {len(values)} entries for {self.total} records")
        stop = self.total if stop is None else int(stop)
        if not 0 <= int(start) <= stop <= self.total:
            raise ValueError(f"start={start}, stop={stop} is not a range of the {self.total} records")
        self.start, self.stop = int(start), stop
        self.readers = int(readers)
        if self.readers < 1:
            raise ValueError(f"readers must be at least 1, got {readers!r}")
        self.processes, self.prefetch = bool(processes), prefetch
        if self.processes:
            _check_pickles(records, transform)
        self.name = name or _default_name(records)
        self._vectorised = transform is None and labels is not None and _is_array_like(records)
        self._pool = None
        self._pool_lock = threading.Lock()
        self._shapes = None  # zero rows of inputs and labels, once a read has seen them

    def __len__(self):
        return self.stop - self.start

    def __repr__(self):
        part = "" if len(self) == self.total else f"[{self.start}:{self.stop}]"
        return f"RecordSource({self.name}{part}, {len(self)} records)"

    def __getstate__(self):  # a thread pool does not pickle
        return {**self.__dict__, "_pool": None, "_pool_lock": None}

    def __setstate__(self, state):
        self.__dict__.update(state, _pool_lock=threading.Lock())

    def read(self, indices):
        """The records at local ``indices`` (``0 ≤ i < len(self)``, sorted).

        Returns:
            ``(x, y, weights)`` as stacked NumPy arrays, one row per index
            (``weights`` all 1 unless given).

        Raises:
            DataValidationError: a record that cannot be read or stacked (its
                index in the source is named; nothing was spent).
        """
        local = np.asarray(indices, dtype="int64")
        if local.size and (local.min() < 0 or local.max() >= len(self)):
            raise IndexError(f"indices outside [0, {len(self)}) of {self!r}")
        ids = self.start + local
        if self._vectorised and len(ids):
            x, y = np.asarray(self.records[ids]), np.asarray(self.labels[ids])
            w = None
        else:
            items = [self._pair(i, item) for i, item in zip(ids.tolist(), self._items(ids.tolist()))]
            x, y, w = (_stack([item[k] for item in items], ids, what)
                       for k, what in enumerate(("input", "label", "weight")))
            if not len(ids):
                x, y = self._empty()
        if self._shapes is None:
            self._shapes = tuple(np.zeros((0,) + a.shape[1:], a.dtype) for a in (x, y))
        if self.sample_weight is not None:
            w = self.sample_weight[ids]
        return x, y, np.ones(len(ids), "float32") if w is None else np.asarray(w, "float32")

    def _load(self, i):
        """Record ``i`` (an index of the whole source), read and transformed."""
        try:
            item = self.records[i]
            return item if self.transform is None else self.transform(item)
        except Exception as e:  # noqa: BLE001 (the record's index is what the user needs)
            raise self._unreadable(i, f"{type(e).__name__}: {e}") from e

    def _unreadable(self, i, cause):
        return DataValidationError(f"record {i} of {self!r} could not be read: {cause}. "
                                   "Nothing was spent.")

    def _pair(self, i, item):
        """``(x, y, w or None)`` of record ``i`` from its transformed ``item``."""
        if self.labels is not None:
            return item, self.labels[i], None
        if not isinstance(item, (tuple, list)) or len(item) not in (2, 3):
            raise DataValidationError(
                f"record {i} of {self!r} is not (x, y) or (x, y, sample_weight): pass labels= "
                "or a transform that returns such a tuple. Nothing was spent.")
        return item[0], item[1], item[2] if len(item) == 3 else None

    def _items(self, ids):
        """The transformed records at ``ids``, read by ``readers`` threads or processes."""
        if not ids or (self.readers == 1 and not self.processes):
            return [self._load(i) for i in ids]
        with self._pool_lock:
            if self._pool is None:
                self._pool = (
                    _reader_processes.pool(self.readers, self.records, self.transform)
                    if self.processes else
                    concurrent.futures.ThreadPoolExecutor(self.readers, "kdp-reader"))
                weakref.finalize(self, self._pool.shutdown, wait=False, cancel_futures=True)
        if not self.processes:
            return list(self._pool.map(self._load, ids))
        size = -(-len(ids) // (4 * self.readers))  # a few chunks per process: fewer messages
        chunks = [ids[k:k + size] for k in range(0, len(ids), size)]
        items = []
        for chunk, loaded in zip(chunks, self._pool.map(_reader_processes.load, chunks)):
            for i, (item, error) in zip(chunk, loaded):
                if error is not None:
                    raise self._unreadable(i, error)
                items.append(item)
        return items

    def _empty(self):
        """Zero rows of inputs and labels (a draw of no record) in the records'
        shapes: those of an earlier read, else record ``start`` is read to learn
        them (its values are not used)."""
        if self._shapes is not None:
            return self._shapes
        x, y, _ = self._pair(self.start, self._load(self.start))
        x, y = np.asarray(x), np.asarray(y)
        return np.zeros((0,) + x.shape, x.dtype), np.zeros((0,) + y.shape, y.dtype)


def as_source(x, y=None, sample_weight=None):
    """The `RecordSource` `fit` reads ``x`` through: ``x`` itself, or a
    `np.memmap` with its labels ``y`` (validated batch by batch, never read
    whole); ``None`` for in-memory arrays and streams."""
    if isinstance(x, RecordSource):
        return x
    if isinstance(x, np.memmap) and y is not None:
        return RecordSource(x, labels=y, sample_weight=sample_weight)
    return None


class ValidatedRecords:
    """A `RecordSource` as `fit` reads it: each batch validated for ``model``
    (`validate_batch`, with ``class_weight``) and padded with zero-weight rows.

    A refused batch raises `DataValidationError` naming the first refused
    record's index in the source: the step that would use it is never released.
    The first batch read (the primed one, before any step) also passes
    `probe_loss` (labels the loss cannot take are refused with their real shapes).
    """

    def __init__(self, source, model, class_weight=None):
        self.source, self.model, self.class_weight = source, model, class_weight
        self._probed = False

    def __len__(self):
        return len(self.source)

    def read(self, indices, rows):
        """``(x, y, weights)`` of the records at ``indices``, padded to ``rows`` rows."""
        x, y, w = self.source.read(indices)
        try:
            x, y, w = validate_batch(self.model, x, y, w, self.class_weight)
        except DataValidationError as error:
            raise self._named(error, indices, x, y, w) from None
        padded = tuple(_padded(a, rows) for a in (x, y, w))
        if not self._probed:  # an empty draw (noise only) is probed on its padding rows
            probe_loss(self.model, *((x, y) if len(y) else padded[:2]))
            self._probed = True
        return padded

    def _named(self, error, indices, x, y, w):
        """``error`` naming the first record that is refused on its own."""
        for row, i in enumerate(indices):
            try:
                validate_batch(self.model, x[row:row + 1], y[row:row + 1], w[row:row + 1],
                               self.class_weight)
            except DataValidationError as own:
                return DataValidationError(
                    f"record {self.source.start + int(i)} of {self.source!r}: {str(own).rstrip('.')}. "
                    "The step that would have used it was not run; nothing was spent.")
        return error


def _check_pickles(records, transform):
    """Refuse, at once, records or a transform that worker processes cannot receive."""
    import pickle

    for what, value in (("records", records), ("transform", transform)):
        try:
            pickle.dumps(value)
        except Exception as e:  # noqa: BLE001 (any pickling failure)
            raise TypeError(
                f"RecordSource(processes=True) sends the {what} to worker processes, but they do "
                f"not pickle ({type(e).__name__}: {e}). Define the transform at a module's top "
                "level (not a lambda or a notebook function), pass records such as a list of "
                "paths, or use reader threads (processes=False).") from e


def _stack(values, ids, what):
    """One array of ``values`` (one per record); a record whose shape differs is named."""
    if what == "weight":  # a record without its own weight weighs 1
        return (None if all(v is None for v in values)
                else np.asarray([1.0 if v is None else v for v in values], "float32"))
    arrays = [np.asarray(v) for v in values]
    for i, a in zip(ids, arrays):
        if a.shape != arrays[0].shape:
            raise DataValidationError(
                f"record {i}'s {what} has shape {a.shape}, record {ids[0]}'s {arrays[0].shape}: "
                "the records of a source must share one shape. Nothing was spent.")
    return np.stack(arrays) if arrays else None


def _padded(array, rows):
    """``array`` followed by zero rows up to ``rows`` rows."""
    out = np.zeros((rows,) + array.shape[1:], dtype=array.dtype)
    out[:len(array)] = array
    return out


def _is_array_like(records):
    return hasattr(records, "shape") and hasattr(records, "dtype") and len(records.shape) >= 1


def _default_name(records):
    filename = getattr(records, "filename", None)  # np.memmap
    if isinstance(filename, (str, os.PathLike)):
        return str(filename)
    file, dataset = getattr(records, "file", None), getattr(records, "name", None)  # h5py
    if isinstance(dataset, str) and hasattr(file, "filename"):
        return f"{file.filename}:{dataset}"
    return type(records).__name__


__all__ = ["RecordSource"]
