"""The recipe suite's datasets and its one scoring function.

Imports numpy and scikit-learn only (no kdp, no keras), so that every runner
(kdp's suite, and the external baselines in their own venvs) can import it from
the ``benchmarks`` folder and sees the very same rows, split and scores.

Every dataset is available without a download: scikit-learn's bundled copies
(digits, breast_cancer, wine, iris) and ``make_classification`` draws with a
fixed ``random_state``. Features are mapped to ``[0, 1]`` per column from
*public* ranges only (no statistic of the training rows is used, which would
leak privacy); values outside the declared range are clipped. After that
mapping every row of ``d`` columns has L2 norm at most ``max_norm = sqrt(d)``.

* digits: pixels / 16 (the 8x8 images' intensities are 0..16 by construction);
  ``input_shape = (8, 8)`` (the model flattens), ``max_norm = 8``.
* breast_cancer, wine, iris: declared domain ranges, stated from what each
  column measures (round numbers beyond every record, not the records' min or
  max), read from ``kdp/domain_ranges.py``.
* gen_*: ``make_classification(n_features=20, n_informative=5, n_redundant=2)``
  (``gen_2k_10c``: ``n_informative=10``; ``gen_20k_5c``: 8, five classes
  40/25/15/12/8 %, added with the ``clipping_long`` variant as a second large
  multi-class table; ``gen_4k_2c``: two classes 75/25 %, and ``gen_10k_4c``:
  6 informative, four classes 40/30/20/10 %, both added before any run on them,
  so that the N of a Clipless rule is seen between 1,500 and 15,000 training rows), declared range ``[-5, 5]`` per feature (we generated the
  data: the range is a public design choice), clipped. The N in each name
  (500, 4k, 5k, 10k, 50k, 2k, 20k) counts all rows *before* the split.
  ``make_classification``'s classes are clusters at the vertices of a
  hypercube, each with its own covariance: a hidden layer helps there
  (non-private MLP ahead of logistic regression on most of them).
* gen_2k_lin (two classes 70/30 %), gen_6k_lin_3c (three classes 50/30/20 %):
  classes split by parallel hyperplanes (`_generated_linear`:
  ``make_regression``'s linear target with noise, cut at quantiles), declared
  range [-5, 5]. Added, before any run on them, because a linear-logistic
  table outside the suite (the calibration benchmark's clinical table) lost
  0.01-0.03 AUROC with the table rules' hidden layer: the suite had no table
  where a linear model is right.
* glyph_digits, glyph_letters: generated 28x28 grey images of handwriting-like
  characters (`render_glyphs`): the ten digits (5,400 rows) or the 26 lowercase
  letters (8,000 rows), each drawn in one of the 21 faces of the fonts that
  matplotlib ships, randomly rotated, sheared, scaled, shifted, thickened or
  thinned, blurred, elastically deformed and overlaid with pixel noise; values
  in [0, 1] by construction, ``max_norm = 28``. Their only role is to give the
  image rules data of another size and source than digits to be scored on
  (non-private logistic regression / MLP on 4,050 training rows: about 0.91 /
  0.95 on the digits, 0.80 / 0.87 on the letters).
* glyph_digits_8, glyph_digits_12 (3,000 rows each), glyph_letters_8,
  glyph_letters_12, glyph_letters_16 (6,000 each): the same drawings at 8×8,
  12×12 and 16×16 pixels (drawn at 32, 24 and 32 pixels, then averaged over
  4×4, 2×2 and 2×2 blocks), so that the image rules' size threshold is chosen
  leave-one-dataset-out with other sets of every size.

Split: stratified 75 / 25 train / test with ``random_state=0``, the same for
every seed (seeds vary the training only).

    from suite_data import load, DATASETS, delta_for, scores
    data = load("digits")          # SuiteData; data.flat_train() -> (n, 64)
"""

import dataclasses
import functools
import importlib.util
import json
import math
import os
import pathlib

import numpy as np
from sklearn import datasets as skdatasets
from sklearn.metrics import accuracy_score, roc_auc_score
from sklearn.model_selection import train_test_split

TEST_SIZE = 0.25
SPLIT_SEED = 0

# --- public ranges ---------------------------------------------------------
def _domain_ranges():
    """``kdp/domain_ranges.py`` read from its file, without importing kdp (the
    baselines' environments do not install it): the declared per-column ranges
    of breast_cancer, wine and iris, the same constants `kdp.datasets` maps
    those tables with."""
    path = pathlib.Path(__file__).resolve().parent.parent / "kdp" / "domain_ranges.py"
    spec = importlib.util.spec_from_file_location("kdp_domain_ranges", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_RANGES = _domain_ranges()
BREAST_CANCER_RANGES, WINE_RANGES, IRIS_RANGES = _RANGES.BREAST_CANCER, _RANGES.WINE, _RANGES.IRIS

#: declared range of every generated feature (a design choice, hence public)
GENERATED_RANGE = (-5.0, 5.0)


@dataclasses.dataclass(frozen=True)
class SuiteData:
    """One dataset of the suite, already mapped to ``[0, 1]`` and split.

    ``x_*`` are float32 of shape ``(n,) + input_shape``, ``y_*`` int64 labels in
    ``0 .. nb_classes - 1``; ``low`` / ``high`` are the declared per-column
    ranges (in the flattened column order) that were mapped to ``[0, 1]``;
    ``max_norm`` is the exact L2 bound of a row after the mapping (``sqrt(d)``);
    ``nb_rows`` is the total before the split."""

    name: str
    kind: str  # "image" or "table"
    nb_classes: int
    input_shape: tuple
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    max_norm: float
    low: np.ndarray
    high: np.ndarray
    nb_rows: int
    source: str

    @property
    def nb_train(self):
        return len(self.y_train)

    @property
    def nb_features(self):
        return int(np.prod(self.input_shape))

    def flat_train(self):
        return self.x_train.reshape(len(self.x_train), -1)

    def flat_test(self):
        return self.x_test.reshape(len(self.x_test), -1)


def map_to_unit(x, low, high):
    """``(x - low) / (high - low)`` per column, clipped to ``[0, 1]``, float32."""
    low = np.asarray(low, np.float64)
    high = np.asarray(high, np.float64)
    return np.clip((np.asarray(x, np.float64) - low) / (high - low), 0.0, 1.0).astype(np.float32)


def _unit_schema(d):
    """`kdp.tabular.TabularSchema` of ``d`` numeric columns declared in [0, 1] and
    centred (its default): what a table's declared ranges give once `map_to_unit`
    has applied them."""
    from kdp.tabular import Numeric, TabularSchema

    return TabularSchema({i: Numeric(0.0, 1.0) for i in range(d)})


def centre(x):
    """A table's features (in [0, 1]) moved to their ranges' midpoint by the
    schema: ``x - 1/2``."""
    return _unit_schema(x.shape[1]).transform(dict(enumerate(x.T)))


def centred_max_norm(data):
    """The exact norm bound of ``data``'s rows once centred (`centre`): ``sqrt(d) / 2``."""
    return _unit_schema(math.prod(data.input_shape)).max_norm


def _make(name, kind, x, y, low, high, input_shape, source):
    x = map_to_unit(x.reshape(len(x), -1), low, high)
    y = np.asarray(y, np.int64)
    x_train, x_test, y_train, y_test = train_test_split(
        x, y, test_size=TEST_SIZE, stratify=y, random_state=SPLIT_SEED)
    shape = tuple(input_shape)
    return SuiteData(
        name=name, kind=kind, nb_classes=int(y.max()) + 1, input_shape=shape,
        x_train=x_train.reshape((-1,) + shape), y_train=y_train,
        x_test=x_test.reshape((-1,) + shape), y_test=y_test,
        max_norm=float(math.sqrt(x.shape[1])),
        low=np.broadcast_to(np.asarray(low, np.float64), x.shape[1:]).copy(),
        high=np.broadcast_to(np.asarray(high, np.float64), x.shape[1:]).copy(),
        nb_rows=len(y), source=source)


def _digits():
    d = skdatasets.load_digits()
    return _make("digits", "image", d.data, d.target, 0.0, 16.0, (8, 8),
                 "sklearn load_digits (1,797 8x8 images), pixels / 16")


#: the font faces of `render_glyphs` (TrueType files shipped with matplotlib)
GLYPH_FONTS = (
    "DejaVuSans", "DejaVuSans-Bold", "DejaVuSans-Oblique", "DejaVuSans-BoldOblique",
    "DejaVuSansMono", "DejaVuSansMono-Bold", "DejaVuSansMono-Oblique", "DejaVuSansMono-BoldOblique",
    "DejaVuSerif", "DejaVuSerif-Bold", "DejaVuSerif-Italic", "DejaVuSerif-BoldItalic",
    "STIXGeneral", "STIXGeneralBol", "STIXGeneralItalic", "STIXGeneralBolIta",
    "cmr10", "cmb10", "cmss10", "cmti10", "cmtt10")


@functools.lru_cache(maxsize=None)
def _glyph_outline(char, font):
    """The closed contours of ``char`` in ``font``, centred, longest side 1."""
    import os

    import matplotlib
    from matplotlib.font_manager import FontProperties
    from matplotlib.textpath import TextPath

    fname = os.path.join(os.path.dirname(matplotlib.__file__), "mpl-data", "fonts", "ttf",
                         font + ".ttf")
    contours = TextPath((0, 0), char, size=1.0,
                        prop=FontProperties(fname=fname)).to_polygons(closed_only=True)
    points = np.concatenate(contours)
    low, high = points.min(axis=0), points.max(axis=0)
    return [(np.asarray(c) - (low + high) / 2) / max(high - low) for c in contours]


def render_glyphs(chars, n, seed, size=28, box=20, supersample=3):
    """``(x, y)``: ``n`` grey ``size × size`` images in [0, 1] (float32) of the
    characters ``chars`` (label = index in ``chars``), drawn at random in the
    `GLYPH_FONTS`: the outline is rotated (N(0, 8°)), sheared (N(0, 0.12)),
    scaled to ``box`` pixels (× U(0.75, 1.1), aspect × e^N(0, 0.12)), shifted
    (N(0, 0.7) px), filled (even-odd, ``supersample``² points a pixel), thickened
    or thinned, blurred, elastically deformed (a smooth field of ≈ 1 px) and
    overlaid with N(0, 0.05) noise."""
    from matplotlib.path import Path
    from scipy import ndimage

    rng = np.random.default_rng(seed)
    grid = (np.arange(size * supersample) + 0.5) / supersample - size / 2
    gx, gy = np.meshgrid(grid, -grid)
    points = np.stack([gx.ravel(), gy.ravel()], axis=1)
    rows, cols = np.meshgrid(np.arange(size), np.arange(size), indexing="ij")
    y = rng.integers(0, len(chars), n)
    fonts = rng.integers(0, len(GLYPH_FONTS), n)
    x = np.empty((n, size, size), np.float32)
    for i in range(n):
        angle, shear = np.deg2rad(rng.normal(0, 8)), rng.normal(0, 0.12)
        scale, aspect = box * rng.uniform(0.75, 1.1), np.exp(rng.normal(0, 0.12))
        rotation = np.array([[np.cos(angle), -np.sin(angle)], [np.sin(angle), np.cos(angle)]])
        m = rotation @ np.array([[1, shear], [0, 1]]) @ np.diag([scale * aspect, scale / aspect])
        shift = rng.normal(0, 0.7, 2)
        inside = np.zeros(len(points), bool)
        for contour in _glyph_outline(chars[y[i]], GLYPH_FONTS[fonts[i]]):
            inside ^= Path(contour @ m.T + shift).contains_points(points)
        img = inside.reshape(size, supersample, size, supersample).mean(axis=(1, 3))
        thicken = rng.uniform(-0.6, 0.9)
        if thicken > 0:
            img = np.maximum(img, ndimage.grey_dilation(img, size=(2, 2)) * thicken)
        img = ndimage.gaussian_filter(img, rng.uniform(0.3, 0.9))
        dx, dy = (ndimage.gaussian_filter(rng.normal(0, 1, (size, size)), 3) * 6 for _ in "xy")
        img = ndimage.map_coordinates(img, [rows + dy, cols + dx], order=1, mode="constant")
        img = img / max(float(img.max()), 1e-6) + rng.normal(0, 0.05, img.shape)
        x[i] = np.clip(img, 0.0, 1.0)
    return x, y


def _glyphs(name, chars, n, seed, side=28):
    """Glyphs of ``side × side`` pixels: drawn at ``side · k`` pixels (``k`` the
    integer nearest ``28 / side``, the character ``20/28`` of that), then averaged
    over ``k × k`` blocks, as scikit-learn's 8×8 digits were made from 32×32
    bitmaps, so that the distortions keep their size relative to the character."""
    pool = max(1, round(28 / side))
    size = side * pool
    x, y = render_glyphs(chars, n, seed, size=size, box=round(20 * size / 28))
    x = x.reshape(n, side, pool, side, pool).mean(axis=(2, 4))
    return _make(name, "image", x, y, 0.0, 1.0, (side, side),
                 f"render_glyphs({chars!r}, n={n}, seed={seed}, size={size}), {pool}x{pool} "
                 f"blocks averaged: {side}x{side} generated characters")


def _table(name, loader, ranges, source):
    d = loader()
    ranges = np.asarray(ranges, np.float64)
    assert ranges.shape == (d.data.shape[1], 2), (name, ranges.shape, d.data.shape)
    return _make(name, "table", d.data, d.target, ranges[:, 0], ranges[:, 1],
                 (d.data.shape[1],), source)


def _generated(name, n, nb_classes, weights, n_informative=5, random_state=0):
    x, y = skdatasets.make_classification(
        n_samples=n, n_features=20, n_informative=n_informative, n_redundant=2,
        n_classes=nb_classes, weights=weights, random_state=random_state)
    low, high = GENERATED_RANGE
    return _make(name, "table", x, y, low, high, (20,),
                 f"make_classification(n_samples={n}, n_features=20, n_informative="
                 f"{n_informative}, n_redundant=2, n_classes={nb_classes}, weights={weights}, "
                 f"random_state={random_state}), range [-5, 5] clipped")


def _generated_linear(name, n, quantiles, noise=60.0, random_state=0):
    """A table whose classes are split by parallel hyperplanes: ``make_regression``'s
    linear target (5 of 20 features informative, Gaussian noise) cut at its
    ``quantiles`` (so the class sizes are their gaps)."""
    x, t = skdatasets.make_regression(n_samples=n, n_features=20, n_informative=5, noise=noise,
                                      random_state=random_state)
    y = np.searchsorted(np.quantile(t, quantiles), t)
    low, high = GENERATED_RANGE
    return _make(name, "table", x, y, low, high, (20,),
                 f"make_regression(n_samples={n}, n_features=20, n_informative=5, noise={noise}, "
                 f"random_state={random_state}) cut at quantiles {list(quantiles)}, range "
                 f"[-5, 5] clipped")


#: name -> loader (no argument) returning a `SuiteData`
DATASETS = {
    "digits": _digits,
    "glyph_digits": lambda: _glyphs("glyph_digits", "0123456789", 5_400, seed=28),
    "glyph_letters": lambda: _glyphs("glyph_letters", "abcdefghijklmnopqrstuvwxyz", 8_000,
                                     seed=26),
    "glyph_digits_8": lambda: _glyphs("glyph_digits_8", "0123456789", 3_000, seed=8, side=8),
    "glyph_digits_12": lambda: _glyphs("glyph_digits_12", "0123456789", 3_000, seed=12, side=12),
    "glyph_letters_8": lambda: _glyphs("glyph_letters_8", "abcdefghijklmnopqrstuvwxyz", 6_000,
                                       seed=88, side=8),
    "glyph_letters_12": lambda: _glyphs("glyph_letters_12", "abcdefghijklmnopqrstuvwxyz", 6_000,
                                        seed=1212, side=12),
    "glyph_letters_16": lambda: _glyphs("glyph_letters_16", "abcdefghijklmnopqrstuvwxyz", 6_000,
                                        seed=16, side=16),
    "breast_cancer": lambda: _table(
        "breast_cancer", skdatasets.load_breast_cancer, BREAST_CANCER_RANGES,
        "sklearn load_breast_cancer (569 x 30), declared domain ranges"),
    "wine": lambda: _table("wine", skdatasets.load_wine, WINE_RANGES,
                           "sklearn load_wine (178 x 13), declared domain ranges"),
    "iris": lambda: _table("iris", skdatasets.load_iris, IRIS_RANGES,
                           "sklearn load_iris (150 x 4), declared domain ranges"),
    "gen_500_bal": lambda: _generated("gen_500_bal", 500, 2, None, random_state=500),
    "gen_5k_imb": lambda: _generated("gen_5k_imb", 5_000, 2, [0.9, 0.1], random_state=5_000),
    "gen_50k_3c": lambda: _generated("gen_50k_3c", 50_000, 3, [0.6, 0.3, 0.1], random_state=50_000),
    "gen_2k_10c": lambda: _generated("gen_2k_10c", 2_000, 10, None, n_informative=10,
                                     random_state=2_000),
    "gen_20k_5c": lambda: _generated("gen_20k_5c", 20_000, 5, [0.4, 0.25, 0.15, 0.12, 0.08],
                                     n_informative=8, random_state=20_000),
    "gen_4k_2c": lambda: _generated("gen_4k_2c", 4_000, 2, [0.75, 0.25], random_state=4_000),
    "gen_10k_4c": lambda: _generated("gen_10k_4c", 10_000, 4, [0.4, 0.3, 0.2, 0.1],
                                     n_informative=6, random_state=10_000),
    "gen_2k_lin": lambda: _generated_linear("gen_2k_lin", 2_000, [0.7], random_state=2_001),
    "gen_6k_lin_3c": lambda: _generated_linear("gen_6k_lin_3c", 6_000, [0.5, 0.8],
                                               random_state=6_001),
}

#: the datasets with at most a few thousand rows (the cheap ones)
SMALL = ("digits", "breast_cancer", "wine", "iris")


#: an environment variable naming a folder of saved datasets (`load`)
CACHE_VARIABLE = "SUITE_DATA_CACHE"
#: the array fields of `SuiteData` (the others are saved as JSON)
_ARRAYS = ("x_train", "y_train", "x_test", "y_test", "low", "high")


@functools.lru_cache(maxsize=None)
def load(name):
    """The `SuiteData` called ``name`` (cached: treat its arrays as read-only).

    Where the environment variable `CACHE_VARIABLE` names a folder, the dataset is
    read from ``<folder>/<name>.npz`` when that file exists, and otherwise built
    and saved there. The generated images are drawn with the fonts of the
    installed matplotlib, so the saved arrays carry the very same rows to a
    machine with another version."""
    if name not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}; one of {sorted(DATASETS)}")
    folder = os.environ.get(CACHE_VARIABLE)
    if not folder:
        return DATASETS[name]()
    path = pathlib.Path(folder) / f"{name}.npz"
    if path.exists():
        with np.load(path) as saved:
            meta = json.loads(str(saved["meta"]))
            return SuiteData(**{k: saved[k] for k in _ARRAYS}, **meta | dict(
                input_shape=tuple(meta["input_shape"])))
    data = DATASETS[name]()
    meta = {f.name: getattr(data, f.name) for f in dataclasses.fields(data)
            if f.name not in _ARRAYS}
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(path, meta=json.dumps(meta), **{k: getattr(data, k) for k in _ARRAYS})
    return data


def delta_for(n):
    """kdp's recipe rule: δ = 10^-(⌊log10 n⌋ + 2), i.e. below 1 / (10 n)."""
    n = int(n)
    if n < 1:
        raise ValueError(f"n must be positive, got {n}")
    return 10.0 ** -(len(str(n)) - 1 + 2)


def _softmax(z):
    z = z - z.max(axis=1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=1, keepdims=True)


def scores(y_true, proba_or_scores, nb_classes):
    """``{"accuracy", "auroc"}`` of predictions ``(n, nb_classes)``: class
    probabilities or unnormalised scores (logits); a 1-D array is accepted for
    binary tasks as P(y = 1). Accuracy: argmax (1-D: P > 0.5). AUROC: binary,
    of the positive-class score (``s1 - s0``, monotone in P(y=1) for both
    probabilities and logits); multiclass, macro one-vs-rest on the
    probabilities (rows that are not probabilities get a softmax). Non-finite
    predictions (a diverged model) are zeroed, which counts as a guess."""
    y_true = np.asarray(y_true).astype(np.int64)
    s = np.nan_to_num(np.asarray(proba_or_scores, np.float64), nan=0.0, posinf=1e30, neginf=-1e30)
    if s.ndim == 1:
        if nb_classes != 2:
            raise ValueError("1-D scores are only accepted for binary tasks")
        s = np.stack([1.0 - s, s], axis=1)
    if s.shape != (len(y_true), nb_classes):
        raise ValueError(f"expected shape {(len(y_true), nb_classes)}, got {s.shape}")
    accuracy = float(accuracy_score(y_true, s.argmax(axis=1)))
    if nb_classes == 2:
        auroc = float(roc_auc_score(y_true, s[:, 1] - s[:, 0]))
    else:
        is_proba = np.all(s >= 0) and np.allclose(s.sum(axis=1), 1.0, atol=1e-4)
        p = s if is_proba else _softmax(s)
        p = p / p.sum(axis=1, keepdims=True)  # roc_auc_score wants exact sums
        auroc = float(roc_auc_score(y_true, p, multi_class="ovr", average="macro",
                                    labels=list(range(nb_classes))))
    return {"accuracy": accuracy, "auroc": auroc}


def describe():
    """One line per dataset (for a README or a log)."""
    lines = []
    for name in DATASETS:
        d = load(name)
        lines.append(f"{name:>13} {d.kind:>5} rows={d.nb_rows:>6} train={d.nb_train:>6} "
                     f"test={len(d.y_test):>5} classes={d.nb_classes:>2} shape={d.input_shape} "
                     f"max_norm={d.max_norm:.3f} delta={delta_for(d.nb_train):g}")
    return "\n".join(lines)


if __name__ == "__main__":
    print(describe())
