"""`kdp.RecordSource`: training on records read by index.

Measured through the real `fit` path, on the current backend:

* only drawn records are read (an instrumented source), each draw once, and the
  draws are Poisson: every record's inclusion count is Binomial(draws, q);
* the source path trains exactly as in-memory arrays: with a seed, the same
  batches and the same weights; the same ledger and ε (also for a memmap and an
  HDF5 dataset);
* a bad record (NaN, a label out of range, a file that cannot be decoded, a
  weight above 1) refuses the step, naming the record's index, and the ledger
  holds exactly the steps that ran (a refused first batch: nothing, and the
  weights did not move);
* the readers' errors (not a tuple, ragged shapes) name the record.

Multi-process ranges are tested with the handshake in tests/test_multiprocess.py.
"""

import math
import threading

import keras
import numpy as np
import pytest
from scipy import stats

import kdp
from kdp import layers, losses
from kdp.model import DP_Sequential, DPParameters
from kdp.pipeline import DatasetMetadata
from kdp.training.sampling import PoissonBatches
from kdp.training.sources import RecordSource, ValidatedRecords
from kdp.training.validation import DataValidationError

N, B, D, K = 240, 24, 6, 3


def _model(seed=None, n=N, b=B, sigma=1.0):
    params = DPParameters("per-layer", sigma, 1e-3, reproducible=seed is not None, seed=seed)
    model = DP_Sequential(
        [layers.DP_BoundedInput((D,), 1.0), layers.DP_QuickSpectralDense(8), layers.DP_GroupSort(2),
         layers.DP_QuickSpectralDense(K)],
        dp_parameters=params, dataset_metadata=DatasetMetadata((D,), K, n, b))
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss=losses.DP_TauCategoricalCrossentropy(1.0))
    return model


def _data(n=N, seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, D)).astype("float32"), rng.integers(0, K, n)


class Recorded:
    """A user's source (len and [i] only) that records every index it is asked for."""

    def __init__(self, x, y):
        self.x, self.y, self.reads = x, y, []
        self._lock = threading.Lock()

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        with self._lock:
            self.reads.append(int(i))
        return self.x[i], self.y[i]


class _Steps(keras.callbacks.Callback):
    """The number of steps that ran (ended)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def on_train_batch_end(self, batch, logs=None):
        self.count += 1


@pytest.fixture
def draws(monkeypatch):
    """Every Poisson draw `fit` makes, as index arrays."""
    drawn = []
    sample = PoissonBatches.sample_indices

    def spy(self):
        idx = sample(self)
        drawn.append(idx)
        return idx

    monkeypatch.setattr(PoissonBatches, "sample_indices", spy)
    return drawn


# --- reading -------------------------------------------------------------------------


def test_only_the_drawn_records_are_read_each_once_per_draw(draws):
    x, y = _data()
    source = Recorded(x, y)
    model = _model()
    model.fit(kdp.RecordSource(source), epochs=2, verbose=0)
    assert draws and model.privacy_ledger.training_steps() == 2 * math.ceil(N / B)
    expected = np.sort(np.concatenate(draws))
    assert np.array_equal(np.sort(source.reads), expected)  # nothing else, nothing twice


def test_the_drawn_records_are_poisson_samples_at_rate_b_over_n(draws):
    """Each record's inclusion count over T draws is Binomial(T, q): the mean, a
    two-sided test per record (Bonferroni) and the χ² dispersion; a negative
    control at rate 1.2 q is caught by the same checks."""
    x, y = _data()
    source = Recorded(x, y)
    model = _model(sigma=5.0)
    model.fit(kdp.RecordSource(source), epochs=15, verbose=0)
    q, draws_count = B / N, len(draws)
    counts = np.bincount(np.asarray(source.reads), minlength=N)

    def poisson_at(rate):
        p_each = min(stats.binomtest(int(c), draws_count, rate).pvalue for c in counts) * N
        dispersion = np.sum((counts - draws_count * rate) ** 2 / (draws_count * rate * (1 - rate)))
        two_sided = min(stats.chi2.sf(dispersion, N), stats.chi2.cdf(dispersion, N))
        mean_ok = abs(counts.mean() - draws_count * rate) < 4 * math.sqrt(
            draws_count * rate * (1 - rate) / N)
        return p_each > 1e-3 and two_sided > 1e-3 and mean_ok

    assert poisson_at(q)
    assert not poisson_at(1.2 * q)  # negative control


def test_a_source_trains_exactly_as_the_same_arrays():
    """Seeded: the same draws read from a source, a memmap, an HDF5 dataset and
    in-memory arrays give the same weights, ledger and ε."""
    import h5py

    x, y = _data()
    results = {}

    def train(name, *args, **kwargs):
        keras.utils.set_random_seed(0)  # the same initial weights
        model = _model(seed=7)
        model.fit(*args, epochs=2, verbose=0, **kwargs)
        results[name] = ([np.array(v) for v in model.trainable_variables],
                         model.privacy_spent(), model.privacy_ledger.events())

    train("arrays", x, y)
    train("source", kdp.RecordSource(Recorded(x, y)))
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        memmap = np.memmap(f"{folder}/x.f32", "float32", "w+", shape=x.shape)
        memmap[:] = x
        train("memmap", memmap, y)
        with h5py.File(f"{folder}/x.h5", "w") as f:
            f["x"], f["y"] = x, y
        with h5py.File(f"{folder}/x.h5", "r") as f:
            train("hdf5", kdp.RecordSource(f["x"], labels=f["y"]))
    weights, spent, runs = results.pop("arrays")
    for name, (w, s, r) in results.items():
        assert s == spent, name
        assert r == runs, name  # the same ledger key: one composed Poisson Gaussian
        for a, b in zip(w, weights):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=name)


def test_the_comparison_catches_other_batches():
    """Negative control for the test above: a source whose records are shifted
    by one index trains to other weights."""
    x, y = _data()
    keras.utils.set_random_seed(0)
    a = _model(seed=7)
    keras.utils.set_random_seed(0)
    b = _model(seed=7)
    a.fit(x, y, epochs=1, verbose=0)
    b.fit(kdp.RecordSource(np.roll(x, 1, axis=0), labels=y), epochs=1, verbose=0)
    assert not all(np.allclose(np.array(u), np.array(v), atol=1e-6)
                   for u, v in zip(a.trainable_variables, b.trainable_variables))


def test_files_decoded_by_a_transform_with_reader_threads(tmp_path):
    paths = []
    x, y = _data()
    for i, row in enumerate(x):
        paths.append(tmp_path / f"{i}.npy")
        np.save(paths[-1], row)
    source = kdp.RecordSource([str(p) for p in paths], labels=y, transform=np.load, readers=4)
    assert source.readers == 4
    model = _model()
    model.fit(source, epochs=1, verbose=0)
    assert model.privacy_ledger.training_steps() == math.ceil(N / B)
    got, labels, weights = source.read([3, 5, 8])
    np.testing.assert_array_equal(got, x[[3, 5, 8]])
    np.testing.assert_array_equal(labels, y[[3, 5, 8]])
    np.testing.assert_array_equal(weights, 1.0)


def test_ranges_weights_and_an_empty_read():
    x, y = _data()
    w = np.linspace(0, 1, N).astype("float32")
    source = RecordSource(x, labels=y, sample_weight=w, start=100, stop=160)
    assert len(source) == 60 and source.total == N and "[100:160]" in repr(source)
    got, labels, weights = source.read([0, 59])
    np.testing.assert_array_equal(got, x[[100, 159]])
    np.testing.assert_array_equal(weights, w[[100, 159]])
    empty = source.read([])
    assert [a.shape for a in empty] == [(0, D), (0,), (0,)]
    recorded = Recorded(x, y)
    fresh = RecordSource(recorded)
    assert [a.shape for a in fresh.read([])] == [(0, D), (0,), (0,)]
    assert recorded.reads == [0]  # an empty first read learns the shapes from record 0
    fresh.read([4])
    fresh.read([])
    assert recorded.reads == [0, 4]  # later empty draws read nothing
    mixed = RecordSource([(x[i], y[i], 0.5) if i % 2 else (x[i], y[i]) for i in range(N)])
    np.testing.assert_array_equal(mixed.read([1, 2, 3])[2], [0.5, 1.0, 0.5])  # (x, y[, w]) records
    with pytest.raises(IndexError, match=r"outside \[0, 60\)"):
        source.read([60])


def test_an_empty_first_draw_trains_noise_only(draws):
    """A first Poisson draw of no record (probability ≈ e^-b) is a release of noise
    only: it trains. The labels are still checked against the loss before anything
    is spent (control: labels of the wrong width are refused, nothing spent)."""
    n, b = 1000, 4
    x, y = _data(n=n)

    def model():
        params = DPParameters("per-layer", 1.0, 1e-4, reproducible=True, seed=18)
        m = DP_Sequential([layers.DP_BoundedInput((D,), 1.0), layers.DP_QuickSpectralDense(K)],
                          dp_parameters=params, dataset_metadata=DatasetMetadata((D,), K, n, b))
        m.compile(optimizer=keras.optimizers.SGD(0.1), loss=losses.DP_TauCategoricalCrossentropy(1.0))
        return m

    trained = model()
    trained.fit(RecordSource(x, labels=y), epochs=1, steps_per_epoch=3, verbose=0)
    assert len(draws[0]) == 0 and trained.privacy_ledger.training_steps() == 3
    draws.clear()
    refused = model()
    with pytest.raises(DataValidationError, match="label"):
        refused.fit(RecordSource(x, labels=np.eye(K + 2)[y % (K + 2)]), epochs=1,
                    steps_per_epoch=3, verbose=0)
    assert len(draws[0]) == 0 and refused.privacy_ledger.training_steps() == 0


def test_refused_constructions():
    with pytest.raises(TypeError, match="len\\(\\) and \\[index\\].*sampling='shuffle'"):
        RecordSource(iter(range(3)))
    with pytest.raises(ValueError, match="labels has 3 entries for 4 records"):
        RecordSource(np.zeros((4, 2)), labels=np.zeros(3))
    with pytest.raises(ValueError, match="not a range"):
        RecordSource(np.zeros((4, 2)), labels=np.zeros(4), start=3, stop=2)
    x, y = _data()
    model = _model()
    with pytest.raises(ValueError, match="pass neither y nor sample_weight"):
        model.fit(RecordSource(x, labels=y), y, epochs=1, verbose=0)
    with pytest.raises(DataValidationError, match="has 239 records but .*nb_samples_train=240"):
        model.fit(RecordSource(x, labels=y, stop=N - 1), epochs=1, verbose=0)
    assert model.privacy_ledger.training_steps() == 0


def test_a_stream_is_refused_under_poisson_sampling_pointing_to_a_source():
    import tensorflow as tf

    x, y = _data()
    with pytest.raises(ValueError, match="kdp.RecordSource.*sampling='shuffle'"):
        _model().fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(B), epochs=1, verbose=0)


# --- validation before release ------------------------------------------------------


@pytest.mark.parametrize("break_record, message", [
    (lambda x, y, w: x.__setitem__(131, np.nan), "record 131 of .*NaN"),
    (lambda x, y, w: y.__setitem__(131, K), r"record 131 of .*class ids must lie in \[0, 3\)"),
    (lambda x, y, w: w.__setitem__(131, 2.0), "record 131 of .*in \\[0, 1\\]"),
], ids=["nan", "label", "weight"])
def test_a_bad_record_refuses_its_step_and_only_the_steps_that_ran_are_charged(break_record, message):
    x, y = _data()
    w = np.ones(N, "float32")
    break_record(x, y, w)
    model, steps = _model(), _Steps()
    with pytest.raises(DataValidationError, match=message + ".*nothing was spent"):
        model.fit(RecordSource(x, labels=y, sample_weight=w), epochs=40, verbose=0, callbacks=[steps])
    assert model.privacy_ledger.training_steps() == steps.count < 40 * math.ceil(N / B)


def test_a_refused_first_batch_spends_nothing_and_moves_no_weight(tmp_path):
    """Every record's file is corrupt: the first draw, read before anything is
    spent, is refused, naming its first record."""
    paths = []
    for i in range(N):
        paths.append(str(tmp_path / f"{i}.npy"))
        (tmp_path / f"{i}.npy").write_bytes(b"not an array")
    model = _model()
    model.build((None, D))
    before = [np.array(v) for v in model.trainable_variables]
    with pytest.raises(DataValidationError, match=r"record \d+ of .* could not be read: "
                                                  r"\w+Error.*Nothing was spent"):
        model.fit(RecordSource(paths, labels=np.zeros(N, "int64"), transform=np.load), epochs=1,
                  verbose=0)
    assert model.privacy_ledger.training_steps() == 0
    assert all(np.array_equal(a, np.array(v)) for a, v in zip(before, model.trainable_variables))


def test_the_refusal_is_checked_before_the_step_not_after(monkeypatch):
    """Negative control: with the batch validation switched off, the same NaN
    record is trained on (the ledger charges the step)."""
    x, y = _data()
    x[:] = np.nan
    monkeypatch.setattr(ValidatedRecords, "read", lambda self, idx, rows: _unchecked(self, idx, rows))
    model = _model()
    model.fit(RecordSource(x, labels=y), epochs=1, steps_per_epoch=2, verbose=0)
    assert model.privacy_ledger.training_steps() == 2


def _unchecked(records, indices, rows):
    x, y, w = records.source.read(indices)
    return tuple(np.concatenate([a, np.zeros((rows - len(a),) + a.shape[1:], a.dtype)]) for a in (x, y, w))


def test_readers_name_the_record_they_cannot_stack():
    x, y = _data()
    ragged = [(x[i][: D - (i == 5)], y[i]) for i in range(N)]
    with pytest.raises(DataValidationError, match=r"record 5's input has shape \(5,\), record 0's \(6,\)"):
        RecordSource(ragged).read(np.arange(8))
    with pytest.raises(DataValidationError, match="record 2 of .* is not \\(x, y\\)"):
        RecordSource(list(x)).read([2])


def test_a_record_above_the_input_bound_is_named():
    """A Clipless model without `DP_BoundedInput` takes ``max_norm`` on trust
    from the data: a source's record above it refuses its step."""
    x, y = _data()
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    x[17] *= 3.0
    model = DP_Sequential(
        [keras.Input((D,)), layers.DP_QuickSpectralDense(K)],
        dp_parameters=DPParameters("per-layer", 1.0, 1e-3),
        dataset_metadata=DatasetMetadata((D,), K, N, B, max_norm=1.0))
    model.compile(optimizer="sgd", loss=losses.DP_TauCategoricalCrossentropy(1.0))
    steps = _Steps()
    with pytest.raises(DataValidationError, match="record 17 of .*L2 norm exceeds .*max_norm=1"):
        model.fit(RecordSource(x, labels=y), epochs=60, verbose=0, callbacks=[steps])
    assert model.privacy_ledger.training_steps() == steps.count


def test_large_arrays_are_checked_block_by_block_to_the_last_row():
    """The validator's temporaries cover a block of rows (not the data); a bad
    value or norm in the last block is still found."""
    from kdp.training.validation import _row_blocks, validate_batch

    n, d = 5000, 1000
    x, y = np.zeros((n, d), "float32"), np.zeros(n, "int64")
    assert len(list(_row_blocks(x))) == 2
    model = DP_Sequential([keras.Input((d,)), layers.DP_QuickSpectralDense(K)],
                          dp_parameters=DPParameters("per-layer", 1.0, 1e-3),
                          dataset_metadata=DatasetMetadata((d,), K, n, 50, max_norm=1.0))
    model.compile(optimizer="sgd", loss=losses.DP_TauCategoricalCrossentropy(1.0))
    validate_batch(model, x, y)  # the control: accepted
    x[-1, :4] = 1.0  # norm 2
    with pytest.raises(DataValidationError, match="L2 norm exceeds"):
        validate_batch(model, x, y)
    x[-1, -1] = np.inf
    with pytest.raises(DataValidationError, match="NaN, infinite"):
        validate_batch(model, x, y)


def test_reader_processes_read_the_same_records_and_name_a_bad_one(tmp_path):
    """``processes=True``: the transform runs in spawned worker processes (a
    Python decoder that holds the GIL); the rows are those of one reader, and a
    record a worker cannot read is named by its index."""
    x, y = _data(n=64)
    paths = []
    for i, row in enumerate(x):
        paths.append(str(tmp_path / f"{i}.npy"))
        np.save(paths[-1], row)
    ids = np.arange(0, 64, 3)
    one = RecordSource(paths, labels=y, transform=np.load)
    many = RecordSource(paths, labels=y, transform=np.load, readers=2, processes=True)
    for a, b in zip(one.read(ids), many.read(ids)):
        np.testing.assert_array_equal(a, b)
    (tmp_path / "30.npy").write_bytes(b"broken")
    with pytest.raises(DataValidationError, match=r"record 30 of .* could not be read: \w+Error"):
        many.read(ids)
    with pytest.raises(ValueError, match="readers must be at least 1"):
        RecordSource(paths, labels=y, readers=0)
    with pytest.raises(TypeError, match="the transform to worker processes, but they do not pickle"):
        RecordSource(paths, labels=y, transform=lambda p: np.load(p), processes=True)


def test_shuffled_passes_read_a_source_like_arrays():
    """``sampling="shuffle"`` through a source: the same unamplified ledger as the
    arrays, each pass reading every record at most once."""
    x, y = _data()
    recorded = Recorded(x, y)
    a, b = (_model(), _model())
    for model in (a, b):
        model.dp_parameters = model.dp_parameters.replace(sampling="shuffle")
    a.fit(x, y, epochs=2, verbose=0)
    b.fit(RecordSource(recorded), epochs=2, verbose=0)
    assert a.privacy_ledger.events() == b.privacy_ledger.events()
    assert a.privacy_spent() == b.privacy_spent()
    # two passes of ⌊N/b⌋ batches of b records, and at most two batches Keras reads
    # to learn the shapes (TensorFlow's signature: read, never trained on, no release)
    assert 2 * (N // B) * B <= len(recorded.reads) <= (2 * (N // B) + 2) * B


@pytest.mark.parametrize("prefetch", [True, False])
def test_prefetch_on_or_off_charges_exactly_the_steps_that_ran(prefetch):
    x, y = _data()
    model, steps = _model(), _Steps()
    model.fit(RecordSource(x, labels=y, prefetch=prefetch), epochs=2, verbose=0, callbacks=[steps])
    assert model.privacy_ledger.training_steps() == steps.count == 2 * math.ceil(N / B)
