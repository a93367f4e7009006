"""Dataset loaders: arrays plus the `DatasetMetadata` the privacy analysis needs.

Every loader returns ``(x_train, y_train), (x_test, y_test), metadata`` with
``float32`` inputs, ``int32`` class ids and a `DatasetMetadata` whose
``max_norm`` is a bound on every example's L2 norm.

All preprocessing is **data independent**: each example is transformed on its
own by a fixed public map (pixels divided by their maximum value 16 or 255,
a table's columns mapped from declared domain ranges onto [-1/2, 1/2],
optional per-example clipping or normalisation). No mean, standard deviation,
min or max is ever computed from the data, so preprocessing costs no privacy.
The norm bound is either the bound of the input domain (``√d`` for pixels in
``[0, 1]``, ``√d / 2`` for a centred table) or that of the chosen input bound
function.

* ``load_digits``, ``load_breast_cancer``, ``load_wine`` and ``load_iris`` use
  scikit-learn's bundled copies (no download) and an 80/20 stratified split
  with a fixed seed.
* ``load_mnist``, ``load_fashion_mnist`` and ``load_cifar10`` read a local
  ``.npz`` (keys ``x_train, y_train, x_test, y_test``) when ``path`` is given,
  and otherwise call ``keras.datasets`` (which downloads once, then caches).
"""

import math

import numpy as np

from kdp import domain_ranges
from kdp.metadata import DatasetMetadata, bound_clip_value, bound_normalize

DIGITS_CLASSES = [str(i) for i in range(10)]
MNIST_CLASSES = DIGITS_CLASSES
FASHION_MNIST_CLASSES = [
    "T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
    "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot",
]
CIFAR10_CLASSES = [
    "airplane", "automobile", "bird", "cat", "deer",
    "dog", "frog", "horse", "ship", "truck",
]


def input_bound_fn(input_bound):
    """``(fn, bound)`` for an ``input_bound`` option, or ``(None, None)``.

    Args:
        input_bound: ``None`` (no transform), a number ``C > 0`` (project each
            example onto the L2 ball of radius ``C``, `bound_clip_value`) or
            ``"normalize"`` (scale each example to unit norm, `bound_normalize`).
    """
    if input_bound is None:
        return None, None
    if isinstance(input_bound, str):
        if input_bound != "normalize":
            raise ValueError(f"input_bound must be None, a number or 'normalize', got {input_bound!r}")
        return bound_normalize()
    if isinstance(input_bound, bool) or not isinstance(input_bound, (int, float, np.number)):
        raise ValueError(f"input_bound must be None, a number or 'normalize', got {input_bound!r}")
    return bound_clip_value(float(input_bound))


def _finish(x_train, y_train, x_test, y_test, domain_bound, input_bound, batch_size,
            class_names):
    """Apply the input bound, build the metadata, cast dtypes."""
    fn, bound = input_bound_fn(input_bound)
    if fn is not None:
        x_train, x_test = fn(x_train), fn(x_test)
        if domain_bound is not None:
            bound = min(bound, domain_bound)
    else:
        bound = domain_bound
    x_train = np.ascontiguousarray(x_train, dtype="float32")
    x_test = np.ascontiguousarray(x_test, dtype="float32")
    y_train = np.asarray(y_train).reshape(-1).astype("int32")
    y_test = np.asarray(y_test).reshape(-1).astype("int32")
    n = len(x_train)
    metadata = DatasetMetadata(
        input_shape=x_train.shape[1:],
        nb_classes=len(class_names),
        nb_samples_train=n,
        batch_size=batch_size,
        nb_samples_test=len(x_test),
        class_names=class_names,
        max_norm=bound,
    )
    return (x_train, y_train), (x_test, y_test), metadata


def _split(x, y, test_size, seed):
    from sklearn.model_selection import train_test_split

    x_train, x_test, y_train, y_test = train_test_split(
        x, y, test_size=test_size, stratify=y, random_state=seed
    )
    return x_train, y_train, x_test, y_test


def load_digits(batch_size=256, input_bound=None, flatten=True, test_size=0.2, seed=0):
    """scikit-learn's bundled 8×8 digits (1 797 images, 10 classes; no download).

    Pixels (integers 0..16) are divided by 16, so ``‖x‖ ≤ 8`` for every possible
    image: ``metadata.max_norm = 8`` unless ``input_bound`` sets a smaller one.

    Args:
        batch_size: expected batch size stored in the metadata, at most the
            number of training examples N (1 437 with the defaults).
        input_bound: ``None``, a clipping radius, or ``"normalize"`` (see
            `input_bound_fn`).
        flatten: ``(64,)`` vectors (default) or ``(8, 8, 1)`` images.
        test_size: fraction held out for testing (stratified).
        seed: seed of the split.

    Returns:
        ``(x_train, y_train), (x_test, y_test), metadata``; 1 437 / 360 examples
        with the defaults.
    """
    from sklearn import datasets

    data = datasets.load_digits()
    x = data.images.astype("float32") / 16.0
    x = x.reshape(len(x), -1) if flatten else x[..., None]
    x_train, y_train, x_test, y_test = _split(x, data.target, test_size, seed)
    return _finish(x_train, y_train, x_test, y_test, math.sqrt(64.0), input_bound, batch_size,
                   DIGITS_CLASSES)


def table_schema(name):
    """The `TabularSchema` kdp maps a scikit-learn bundled table with: one
    `Numeric` column per measurement, over its declared domain (`domain_ranges`),
    centred (each feature in [-1/2, 1/2], ``max_norm = √d / 2``).

    Args:
        name: ``"breast_cancer"``, ``"wine"`` or ``"iris"``.
    """
    return _schema(name, _bundled(name).feature_names)


def _bundled(name):
    """scikit-learn's bundled table ``name``, refused without declared ranges."""
    from sklearn import datasets

    if name not in domain_ranges.RANGES:
        raise ValueError(
            f"no declared ranges for {name!r}; one of {sorted(domain_ranges.RANGES)}")
    return getattr(datasets, f"load_{name}")()


def _schema(name, feature_names):
    from kdp.tabular import Numeric, TabularSchema

    return TabularSchema({str(column): Numeric(low, high) for column, (low, high)
                          in zip(feature_names, domain_ranges.RANGES[name])})


def _load_table(name, batch_size, input_bound, test_size, seed):
    """A scikit-learn bundled table mapped by `table_schema` and split."""
    data = _bundled(name)
    schema = _schema(name, data.feature_names)
    x = schema.transform({str(column): values
                          for column, values in zip(data.feature_names, data.data.T)})
    x_train, y_train, x_test, y_test = _split(x, data.target, test_size, seed)
    return _finish(x_train, y_train, x_test, y_test, schema.max_norm, input_bound, batch_size,
                   [str(c) for c in data.target_names])


_TABLE_DOC = """scikit-learn's bundled {title} ({shape}; no download).

    Every column is mapped from a declared domain range (`domain_ranges`: stated
    from what the column measures, not from the records) onto [0, 1], clipped,
    and centred to [-1/2, 1/2] (`table_schema`): a fixed public map, so the
    features cost no privacy, and ``metadata.max_norm = √{d} / 2`` unless
    ``input_bound`` sets a smaller one.
    Train a recipe on them with ``kind="table", max_norm=metadata.max_norm``.

    Args:
        batch_size: expected batch size stored in the metadata.
        input_bound: ``None``, a clipping radius, or ``"normalize"`` (see
            `input_bound_fn`).
        test_size: fraction held out for testing (stratified).
        seed: seed of the split.

    Returns:
        ``(x_train, y_train), (x_test, y_test), metadata``; {split} examples
        with the defaults. Labels: {labels}.
    """


def load_breast_cancer(batch_size=64, input_bound=None, test_size=0.2, seed=0):
    return _load_table("breast_cancer", batch_size, input_bound, test_size, seed)


def load_wine(batch_size=32, input_bound=None, test_size=0.2, seed=0):
    return _load_table("wine", batch_size, input_bound, test_size, seed)


def load_iris(batch_size=32, input_bound=None, test_size=0.2, seed=0):
    return _load_table("iris", batch_size, input_bound, test_size, seed)


load_breast_cancer.__doc__ = _TABLE_DOC.format(
    title="Wisconsin diagnostic breast cancer data", shape="569 × 30", d=30, split="455 / 114",
    labels="0 malignant, 1 benign")
load_wine.__doc__ = _TABLE_DOC.format(
    title="wine recognition data", shape="178 × 13, 3 cultivars", d=13, split="142 / 36",
    labels="the cultivars 0, 1, 2")
load_iris.__doc__ = _TABLE_DOC.format(
    title="iris data", shape="150 × 4, 3 species", d=4, split="120 / 30",
    labels="0 setosa, 1 versicolor, 2 virginica")


def _load_npz(path):
    with np.load(path, allow_pickle=False) as f:
        missing = {"x_train", "y_train", "x_test", "y_test"} - set(f.files)
        if missing:
            raise KeyError(f"{path}: missing arrays {sorted(missing)} (has {sorted(f.files)})")
        return (f["x_train"], f["y_train"]), (f["x_test"], f["y_test"])


def _load_images(keras_name, path, batch_size, input_bound, flatten, class_names):
    if path is not None:
        (x_train, y_train), (x_test, y_test) = _load_npz(path)
    else:
        import keras

        (x_train, y_train), (x_test, y_test) = getattr(keras.datasets, keras_name).load_data()
    x_train = np.asarray(x_train, dtype="float32") / 255.0
    x_test = np.asarray(x_test, dtype="float32") / 255.0
    if x_train.ndim == 3:  # grayscale (N, H, W): add the channel axis
        x_train, x_test = x_train[..., None], x_test[..., None]
    if flatten:
        x_train = x_train.reshape(len(x_train), -1)
        x_test = x_test.reshape(len(x_test), -1)
    domain_bound = math.sqrt(float(np.prod(x_train.shape[1:])))  # pixels in [0, 1]
    return _finish(x_train, y_train, x_test, y_test, domain_bound, input_bound, batch_size,
                   class_names)


def load_mnist(path=None, batch_size=256, input_bound=None, flatten=False):
    """MNIST, ``(28, 28, 1)`` pixels in ``[0, 1]`` (``max_norm = 28`` by default).

    Args:
        path: a local ``.npz`` with ``x_train, y_train, x_test, y_test`` (uint8
            pixels 0..255); ``None`` downloads through ``keras.datasets``.
        batch_size, input_bound, flatten: as in `load_digits`.
    """
    return _load_images("mnist", path, batch_size, input_bound, flatten, MNIST_CLASSES)


def load_fashion_mnist(path=None, batch_size=256, input_bound=None, flatten=False):
    """Fashion-MNIST, ``(28, 28, 1)`` pixels in ``[0, 1]``; arguments as `load_mnist`."""
    return _load_images("fashion_mnist", path, batch_size, input_bound, flatten,
                        FASHION_MNIST_CLASSES)


def load_cifar10(path=None, batch_size=256, input_bound=None, flatten=False):
    """CIFAR-10, ``(32, 32, 3)`` pixels in ``[0, 1]`` (``max_norm = √3072``);
    arguments as `load_mnist`."""
    return _load_images("cifar10", path, batch_size, input_bound, flatten, CIFAR10_CLASSES)


LOADERS = {
    "digits": load_digits,
    "breast_cancer": load_breast_cancer,
    "wine": load_wine,
    "iris": load_iris,
    "mnist": load_mnist,
    "fashion_mnist": load_fashion_mnist,
    "cifar10": load_cifar10,
}


def load_dataset(name, **kwargs):
    """``LOADERS[name](**kwargs)``, with a clear error for an unknown name."""
    if name not in LOADERS:
        raise ValueError(f"unknown dataset {name!r}; choose one of {sorted(LOADERS)}")
    return LOADERS[name](**kwargs)


__all__ = [
    "load_digits", "load_breast_cancer", "load_wine", "load_iris", "table_schema", "load_mnist",
    "load_fashion_mnist", "load_cifar10", "load_dataset", "input_bound_fn", "LOADERS",
]
