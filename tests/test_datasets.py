"""Dataset loaders: shapes, splits, data-independent scaling, bounds, local .npz files."""

import numpy as np
import pytest

from kdp import datasets, domain_ranges
from kdp.pipeline import DatasetMetadata


def _norms(x):
    return np.linalg.norm(x.reshape(len(x), -1), axis=1)


def test_pipeline_reexports_the_loaders():
    from kdp import pipeline

    for name in ("load_digits", "load_breast_cancer", "load_wine", "load_iris", "load_mnist",
                 "load_fashion_mnist", "load_cifar10"):
        assert getattr(pipeline, name) is getattr(datasets, name)


def test_digits_shapes_split_and_metadata():
    (x, y), (xt, yt), md = datasets.load_digits()
    assert x.shape == (1437, 64) and xt.shape == (360, 64)
    assert x.dtype == np.float32 and y.dtype == np.int32
    assert isinstance(md, DatasetMetadata)
    assert md.input_shape == (64,) and md.nb_classes == 10
    assert md.nb_samples_train == 1437 and md.nb_samples_test == 360
    assert md.batch_size == 256
    # pixels / 16: values in [0, 1], and the domain bound √64 = 8
    assert x.min() >= 0 and x.max() <= 1 and md.max_norm == 8.0
    assert _norms(x).max() <= md.max_norm and _norms(xt).max() <= md.max_norm
    # stratified: every class keeps its share in both parts (within one example)
    counts, test_counts = np.bincount(y, minlength=10), np.bincount(yt, minlength=10)
    assert np.all(np.abs(test_counts - 0.2 * (counts + test_counts)) <= 1)


def test_digits_split_depends_on_seed_only():
    (a, _), _, _ = datasets.load_digits(seed=0)
    (b, _), _, _ = datasets.load_digits(seed=0)
    (c, _), _, _ = datasets.load_digits(seed=1)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)


def test_digits_scaling_is_the_fixed_map_x_over_16():
    from sklearn.datasets import load_digits as raw

    data = raw()
    (x, y), (xt, yt), _ = datasets.load_digits(test_size=0.2, seed=3)
    pool = np.concatenate([x, xt])
    expected = np.sort((data.data / 16.0).astype("float32"), axis=0)
    np.testing.assert_allclose(np.sort(pool, axis=0), expected, rtol=0, atol=1e-7)


def test_digits_images_and_input_bounds():
    (x, _), _, md = datasets.load_digits(flatten=False, batch_size=64)
    assert x.shape == (1437, 8, 8, 1) and md.input_shape == (8, 8, 1) and md.batch_size == 64
    (x, _), (xt, _), md = datasets.load_digits(input_bound=2.0)
    assert md.max_norm == 2.0
    assert _norms(x).max() <= 2.0 + 1e-5 and _norms(xt).max() <= 2.0 + 1e-5
    assert np.isclose(_norms(x).max(), 2.0, atol=1e-5)  # it did clip
    (x, _), _, md = datasets.load_digits(input_bound="normalize")
    assert md.max_norm == 1.0
    np.testing.assert_allclose(_norms(x), 1.0, atol=1e-5)
    # a radius above the domain bound keeps the (smaller) domain bound
    _, _, md = datasets.load_digits(input_bound=100.0)
    assert md.max_norm == 8.0
    with pytest.raises(ValueError):
        datasets.load_digits(input_bound="sphere")
    with pytest.raises(ValueError):
        datasets.load_digits(input_bound=-1.0)


@pytest.mark.parametrize("name, shape, classes", [
    ("breast_cancer", (455, 30), ["malignant", "benign"]),
    ("wine", (142, 13), ["class_0", "class_1", "class_2"]),
    ("iris", (120, 4), ["setosa", "versicolor", "virginica"]),
])
def test_a_bundled_table_is_mapped_by_its_declared_ranges(name, shape, classes):
    """Each column is (raw - low) / (high - low), clipped to [0, 1], minus 1/2, with
    the declared range (recomputed here from the raw data), and the bound is
    √d / 2. Negative control: the raw measurements, or their log1p (the former
    breast_cancer loader), are not what the loader returns."""
    from sklearn import datasets as raw

    (x, y), (xt, yt), md = datasets.load_dataset(name)
    assert x.shape == shape and x.dtype == np.float32 and md.input_shape == shape[1:]
    assert md.class_names == classes and md.nb_classes == len(classes)
    assert md.max_norm == pytest.approx(np.sqrt(shape[1]) / 2)
    assert _norms(x).max() <= md.max_norm + 1e-6 and _norms(xt).max() <= md.max_norm + 1e-6
    ranges = np.asarray(domain_ranges.RANGES[name])
    data = getattr(raw, f"load_{name}")()
    expected = np.clip((data.data - ranges[:, 0]) / (ranges[:, 1] - ranges[:, 0]), 0, 1) - 0.5
    pool = np.sort(np.concatenate([x, xt]), axis=0)
    np.testing.assert_allclose(pool, np.sort(expected, axis=0), atol=1e-6)
    for wrong in (data.data, np.log1p(data.data)):
        assert not np.allclose(pool, np.sort(wrong, axis=0), atol=1e-3)
    # the split is stratified
    counts, test_counts = np.bincount(y), np.bincount(yt)
    assert np.all(np.abs(test_counts - 0.2 * (counts + test_counts)) <= 1)
    schema = datasets.table_schema(name)
    assert schema.max_norm == md.max_norm and schema.feature_names == [
        str(c) for c in data.feature_names]


@pytest.mark.parametrize("name", sorted(domain_ranges.RANGES))
def test_the_declared_ranges_are_not_statistics_of_the_records(name):
    """Every record (train and test rows) lies inside its column's range, and each
    end is a natural zero or lies beyond the records by at least a tenth of the
    range: no end is a record's minimum or maximum, and no row sits at an end
    but at a natural zero (concavity, concave points). Negative control: the
    records' own min and max (the documentation's Min / Max, which these ranges
    replaced, up to its rounding) fail it."""
    from sklearn import datasets as raw

    x = getattr(raw, f"load_{name}")().data
    ranges = np.asarray(domain_ranges.RANGES[name])
    assert ranges.shape == (x.shape[1], 2)

    def violations(ranges):
        low, high = ranges[:, 0], ranges[:, 1]
        margin = 0.1 * (high - low)
        bad_low = ~((low == 0) & (x.min(0) >= 0) | (x.min(0) - low >= margin))
        bad_high = high - x.max(0) < margin
        return int(bad_low.sum() + bad_high.sum())

    assert violations(ranges) == 0
    assert ((x >= ranges[:, 0]) & (x <= ranges[:, 1])).all()
    at_an_end = (x == ranges[:, 1]) | ((x == ranges[:, 0]) & (ranges[:, 0] != 0))
    assert not at_an_end.any()
    documented = np.stack([x.min(0), x.max(0)], axis=1)
    assert violations(documented) == 2 * x.shape[1] - int((x.min(0) == 0).sum())


def test_a_table_loader_takes_an_input_bound_and_refuses_an_unknown_table():
    (x, _), _, md = datasets.load_breast_cancer(input_bound="normalize")
    np.testing.assert_allclose(_norms(x), 1.0, atol=1e-5)
    assert md.max_norm == 1.0
    (x, _), _, md = datasets.load_iris(input_bound=0.5)
    assert md.max_norm == 0.5 and _norms(x).max() <= 0.5 + 1e-6
    with pytest.raises(ValueError, match="no declared ranges for 'diabetes'"):
        datasets.table_schema("diabetes")


def _write_npz(path, rng, n_train, n_test, image_shape, label_shape=()):
    arrays = {
        "x_train": rng.integers(0, 256, (n_train,) + image_shape, dtype=np.uint8),
        "y_train": rng.integers(0, 10, (n_train,) + label_shape).astype(np.uint8),
        "x_test": rng.integers(0, 256, (n_test,) + image_shape, dtype=np.uint8),
        "y_test": rng.integers(0, 10, (n_test,) + label_shape).astype(np.uint8),
    }
    np.savez(path, **arrays)
    return arrays


@pytest.fixture
def no_network(monkeypatch):
    """Any call to keras.datasets fails the test."""
    import keras

    def boom(*args, **kwargs):
        raise AssertionError("the loader tried to download")

    for name in ("mnist", "fashion_mnist", "cifar10"):
        monkeypatch.setattr(getattr(keras.datasets, name), "load_data", boom)


@pytest.mark.parametrize("loader", [datasets.load_mnist, datasets.load_fashion_mnist])
def test_grayscale_npz(tmp_path, rng, loader, no_network):
    path = tmp_path / "small.npz"
    arrays = _write_npz(path, rng, 40, 10, (28, 28))
    (x, y), (xt, yt), md = loader(path=str(path), batch_size=16)
    assert x.shape == (40, 28, 28, 1) and xt.shape == (10, 28, 28, 1)
    np.testing.assert_allclose(x[..., 0], arrays["x_train"] / 255.0, atol=1e-7)
    np.testing.assert_array_equal(y, arrays["y_train"])
    assert y.dtype == np.int32
    assert md.nb_samples_train == 40 and md.batch_size == 16 and md.nb_classes == 10
    assert md.max_norm == pytest.approx(28.0) and _norms(x).max() <= 28.0
    (x, _), _, md = loader(path=str(path), flatten=True, input_bound=3.0, batch_size=40)
    assert x.shape == (40, 784) and md.input_shape == (784,) and md.max_norm == 3.0
    assert _norms(x).max() <= 3.0 + 1e-5


def test_cifar10_npz_labels_and_bound(tmp_path, rng, no_network):
    path = tmp_path / "cifar.npz"
    arrays = _write_npz(path, rng, 30, 6, (32, 32, 3), label_shape=(1,))
    (x, y), (xt, yt), md = datasets.load_cifar10(path=str(path), input_bound="normalize",
                                                 batch_size=8)
    assert x.shape == (30, 32, 32, 3) and y.shape == (30,) and yt.shape == (6,)
    np.testing.assert_array_equal(y, arrays["y_train"][:, 0])
    assert md.max_norm == 1.0 and md.class_names[0] == "airplane"
    np.testing.assert_allclose(_norms(x), 1.0, atol=1e-5)


def test_preprocessing_never_looks_at_other_examples(tmp_path, rng, no_network):
    """Changing every other record leaves record 0's preprocessed value unchanged."""
    a = _write_npz(tmp_path / "a.npz", rng, 20, 5, (28, 28))
    b = {k: v.copy() for k, v in a.items()}
    b["x_train"][1:] = rng.integers(0, 256, b["x_train"][1:].shape, dtype=np.uint8)
    b["x_train"][1:, :4] = 255  # very different statistics
    np.savez(tmp_path / "b.npz", **b)
    for bound in (None, 5.0, "normalize"):
        (xa, _), _, ma = datasets.load_mnist(path=str(tmp_path / "a.npz"), input_bound=bound,
                                             batch_size=4)
        (xb, _), _, mb = datasets.load_mnist(path=str(tmp_path / "b.npz"), input_bound=bound,
                                             batch_size=4)
        np.testing.assert_array_equal(xa[0], xb[0])
        assert ma.max_norm == mb.max_norm


def test_npz_missing_keys(tmp_path, no_network):
    np.savez(tmp_path / "bad.npz", x_train=np.zeros((2, 28, 28), np.uint8))
    with pytest.raises(KeyError, match="y_train"):
        datasets.load_mnist(path=str(tmp_path / "bad.npz"))


def test_load_dataset_dispatch():
    _, _, md = datasets.load_dataset("digits", batch_size=32)
    assert md.batch_size == 32
    with pytest.raises(ValueError, match="unknown dataset"):
        datasets.load_dataset("imagenet")


@pytest.mark.parametrize("name", sorted(datasets.LOADERS))
def test_a_batch_larger_than_the_training_set_is_refused(name, tmp_path, rng, no_network):
    """Like `DatasetMetadata`, every loader refuses batch_size > N (it used to cap it at N,
    silently changing the sampling rate q = b/N) and accepts batch_size = N."""
    kwargs = {}
    if name in ("mnist", "fashion_mnist", "cifar10"):
        shape = (32, 32, 3) if name == "cifar10" else (28, 28)
        _write_npz(tmp_path / "small.npz", rng, 40, 10, shape)
        kwargs["path"] = str(tmp_path / "small.npz")
    n = len(datasets.load_dataset(name, batch_size=1, **kwargs)[0][0])
    with pytest.raises(ValueError, match=f"batch_size=5000 is larger than the {n} training "
                                         f"examples: pass batch_size={n} or less"):
        datasets.load_dataset(name, batch_size=5000, **kwargs)
    with pytest.raises(ValueError, match=f"pass batch_size={n} or less"):
        DatasetMetadata((1,), 2, n, 5000)  # the same refusal, from the same place
    assert datasets.load_dataset(name, batch_size=n, **kwargs)[2].batch_size == n
