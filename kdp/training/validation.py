"""The one input validator: refuses, before anything is spent, data that would
break a bound the privacy guarantee relies on.

`validate_batch` runs on every batch that reaches a DP model's noisy step (all
of `fit`'s arrays at once, each batch read from a `kdp.RecordSource`, each
`train_on_batch` batch, each batch of a dataset in shuffle mode) **before** the
step is recorded in the ledger, so a refused batch costs nothing. It checks

* records: a batch kdp did not sample (`train_on_batch`, a dataset's batch)
  holds no record twice (`check_distinct_records`);

* shapes: every input (each array of a multi-input model's dict or list),
  label and weight has the same number of rows, at most
  ``max_rows`` (the expected batch size ``b`` for shuffled batches), and one
  input's examples have ``DatasetMetadata.input_shape``;
* values: inputs (and float labels) are finite;
* weights (``sample_weight`` times ``class_weight``): finite and in [0, 1]
  (a weight above 1 scales an example's gradient beyond its bound).
  ``class_weight`` is public (declared, not computed from the rows), so one
  whose largest value ``w_max`` exceeds 1 is divided by ``w_max``
  (`normalized_class_weight`): the same relative weights with every weight in
  [0, 1], which is the training with weights ``w`` and the sensitivity scaled
  by ``w_max``, so the ledger's release stays exact. ``sample_weight`` (per
  record) is never rescaled: a record-dependent scale would change the other
  records' terms;
* labels, for kdp losses: integer class ids in ``[0, K)``, label vectors ``K``
  wide, and for single-label losses (``DPLoss.labels``) one class per example:
  ``"one-hot"`` (hinge, KR, HKR: after clipping to [0, 1], one entry 1 and the
  others 0) or ``"distribution"`` (τ-cross-entropy: entries in [0, 1] after
  clipping, summing to at most 1). Multi-hot labels exceed their ``get_L()``;
* labels for Keras losses (per-example clipping): class ids in ``[0, K)`` for a
  sparse categorical loss; and, once per `fit` (`probe_loss`), the loss is
  computed on two examples outside any step, so labels it cannot take are
  refused with their real shapes;
* input norms, for Clipless models whose gradient bounds use
  ``DatasetMetadata.max_norm`` (no `DP_BoundedInput`, or one whose radius is
  above ``max_norm``): every example's L2 norm is at most ``max_norm``. Such
  data is **refused**, not clipped; clip it first
  (`kdp.pipeline.bound_clip_value`) or start the model with `DP_BoundedInput`
  and leave ``max_norm`` out;
* input values, for a model that starts with ``DP_BoxInput(refuse_outside=True)``
  (a box assumed, not declared: `kdp.recipes` reads ``max_norm = √d`` as
  columns in [0, 1]): every value inside the box. A row outside is refused
  rather than silently clamped.

Errors never quote values of the private data.
"""

import weakref

import keras
import numpy as np

TOLERANCE = 1e-5


class DataValidationError(ValueError):
    """Training data that would break the privacy guarantee (nothing was spent)."""


def validate_batch(model, x, y, sample_weight=None, class_weight=None, max_rows=None,
                   distinct=False):
    """Check one batch (or a whole training set) for ``model``; return ``(x, y, weights)``.

    Args:
        model: a DP model (`DP_Model`, `DP_Sequential`).
        x, y: inputs (an array or a structure of arrays) and labels.
        sample_weight: per-example weights or ``None`` (all 1).
        class_weight: optional ``{class id: weight}``.
        max_rows: the largest number of rows allowed.
        distinct: refuse a record held twice (`check_distinct_records`): for a
            batch one step trains on as given, not for the records kdp samples.

    Returns:
        ``(x, y, weights)`` as NumPy arrays, ``weights`` of shape ``(rows,)``.

    Raises:
        DataValidationError: see the module docstring.
    """
    x = keras.tree.map_structure(np.asarray, x) if is_structure(x) else np.asarray(x)
    leaves = keras.tree.flatten(x)
    if not leaves:
        raise DataValidationError("no input data")
    rows = len(leaves[0])
    if y is None:
        raise DataValidationError("DP training needs labels y (with the inputs x)")
    y = np.asarray(y)
    if any(len(leaf) != rows for leaf in leaves) or len(y) != rows:
        raise DataValidationError("inputs and labels have different numbers of rows")
    metadata = getattr(model, "dataset_metadata", None)
    expected = getattr(metadata, "input_shape", None)
    if expected and len(leaves) == 1 and tuple(leaves[0].shape[1:]) != tuple(expected):
        raise DataValidationError(
            f"examples of shape {tuple(leaves[0].shape[1:])} but DatasetMetadata(input_shape="
            f"{tuple(expected)})")
    if max_rows is not None and rows > max_rows:
        raise DataValidationError(
            f"a batch of {rows} rows > {max_rows}, the most the accountant assumes "
            "(dataset_metadata.batch_size)")
    for leaf in leaves:
        if not np.issubdtype(leaf.dtype, np.number) or not all(
                np.all(np.isfinite(block)) for block in _row_blocks(leaf)):
            raise DataValidationError("the inputs contain NaN, infinite or non-numeric values")
    if not np.issubdtype(y.dtype, np.number) and y.dtype != bool:
        raise DataValidationError(f"labels must be numbers, got dtype {y.dtype}")
    if np.issubdtype(y.dtype, np.floating) and not np.all(np.isfinite(y)):
        raise DataValidationError("the labels contain NaN or infinite values")
    weights = _weights(y, rows, sample_weight, class_weight)
    _check_labels(model, y)
    _check_norms(model, leaves)
    _check_box(model, leaves)
    if distinct:
        check_distinct_records(x, y, weights)
    return x, y, weights


def is_structure(x):
    """Whether ``x`` is the inputs of a multi-input model: a dict, or a list or
    tuple of arrays (Keras' convention; a list of numbers or of lists is one array)."""
    if isinstance(x, dict):
        return True
    return isinstance(x, (list, tuple)) and bool(x) and all(hasattr(a, "shape") for a in x)


def check_distinct_records(x, y, weights):
    """Refuse a batch that holds the same record twice (identical inputs and label,
    weight > 0): its sum would move by ``k·Δ`` for a record seen ``k`` times, while
    a step is accounted for sensitivity ``Δ``. Rows of weight 0 (padding) are
    ignored. Used for batches kdp did not sample (`train_on_batch`, a dataset's
    batches); `fit` samples each record at most once per batch itself.

    Raises:
        DataValidationError: naming the rows and the multiplicity.
    """
    live = np.flatnonzero(np.asarray(weights) > 0)
    if len(live) < 2:
        return
    parts = [np.ascontiguousarray(np.asarray(leaf)[live]).reshape(len(live), -1).view(np.uint8)
             for leaf in keras.tree.flatten(x) + [np.asarray(y)]]
    rows = np.ascontiguousarray(np.concatenate(parts, axis=1))
    keys = rows.view(np.dtype((np.void, rows.shape[1]))).ravel()
    _, first, counts = np.unique(keys, return_index=True, return_counts=True)
    if counts.max() > 1:
        twice = live[first[np.argmax(counts)]]
        raise DataValidationError(
            f"the batch holds the same record {counts.max()} times (row {twice} and "
            f"{counts.max() - 1} identical row(s)): its gradient would count {counts.max()}× "
            "against a step accounted for one record. Remove the repeats (sample indices "
            "without replacement, or let fit sample), or, if identical rows are distinct people, "
            "account for them with group privacy (a group of k records costs the ε of "
            "sensitivity k·Δ). Nothing was spent.")


def _weights(y, rows, sample_weight, class_weight):
    weights = (np.ones(rows, "float32") if sample_weight is None
               else np.asarray(sample_weight, "float32"))
    if weights.size != rows:
        raise DataValidationError(f"sample_weight has {weights.size} values for {rows} examples")
    weights = weights.reshape(rows)
    if class_weight is not None:
        class_weight = normalized_class_weight(class_weight)
        ids = y.argmax(-1) if y.ndim > 1 and y.shape[-1] > 1 else y.reshape(rows).astype(int)
        weights = weights * np.array([class_weight.get(int(c), 1.0) for c in ids], "float32")
    if not np.all(np.isfinite(weights)) or np.any(weights < 0) or np.any(weights > 1):
        raise DataValidationError(
            "sample_weight and class_weight must be finite and lie in [0, 1]: a weight above 1 "
            "scales an example's gradient beyond its bound and would break the guarantee")
    return weights


def normalized_class_weight(class_weight):
    """``{class: w / w_max}`` when the largest weight ``w_max`` exceeds 1, else
    ``class_weight`` unchanged (the module docstring says why this is exact).

    Raises:
        DataValidationError: a weight that is negative or not finite.
    """
    values = np.asarray(list(class_weight.values()), "float64")
    if not np.all(np.isfinite(values)) or np.any(values < 0):
        raise DataValidationError("class_weight values must be finite and >= 0")
    top = values.max() if values.size else 0.0
    return class_weight if top <= 1 else {c: w / top for c, w in class_weight.items()}


def output_width(model):
    """The width of the model's (single) output, or ``None``."""
    try:
        shape = model.output_shape if not isinstance(model.output_shape, list) else None
    except (AttributeError, ValueError):
        return None
    return None if not shape else shape[-1]


def _is_sparse_keras_loss(loss):
    name = getattr(loss, "name", None) or getattr(loss, "__name__", "") or ""
    return "sparse_categorical" in str(name)


def _check_labels(model, y):
    loss = getattr(model, "loss", None)
    kind = getattr(loss, "labels", None)
    width = output_width(model)
    if width is None or width < 2:
        return
    sparse = y.ndim <= 1 or (y.ndim == 2 and y.shape[-1] == 1)
    if kind is None:  # a Keras loss (per-example clipping bounds its gradient anyway)
        if sparse and _is_sparse_keras_loss(loss):
            _check_class_ids(y, width)  # out of range: NaN on JAX, a failed step on TF
        return
    if sparse:
        _check_class_ids(y, width)
        return
    if y.shape[-1] != width:
        raise DataValidationError(
            f"label vectors have {y.shape[-1]} entries but the model has {width} outputs")
    if kind == "any":
        return
    clipped = np.clip(y.astype("float64"), 0.0, 1.0).reshape(-1, width)
    sums = clipped.sum(-1)
    if kind == "one-hot":
        binary = np.all((clipped == 0) | (clipped == 1))
        if not binary or np.any(np.abs(sums - 1) > TOLERANCE):
            raise DataValidationError(
                f"{type(loss).__name__} needs one true class per example (one-hot or "
                "±1 label vectors, or integer ids); multi-hot or soft labels exceed its get_L()")
    elif kind == "distribution" and np.any(sums > 1 + TOLERANCE):
        raise DataValidationError(
            f"{type(loss).__name__} needs label vectors with entries in [0, 1] summing to at most "
            "1 (one class per example); multi-hot labels exceed its get_L()")


def _check_class_ids(y, width):
    if np.issubdtype(y.dtype, np.floating) and not np.all(y == np.round(y)):
        raise DataValidationError("sparse labels must be integer class ids")
    if y.size and (y.min() < 0 or y.max() >= width):
        raise DataValidationError(
            f"class ids must lie in [0, {width}) for a model with {width} outputs")


def probe_loss(model, x, y, rows=2):
    """Compute the loss on the first ``rows`` examples, outside any step (nothing
    is released), so that labels the loss cannot take are refused with their
    real shapes (an error from inside the step would quote the padded batch).
    Once per built model, loss and shapes and dtypes of an example and its label
    (the outcome depends on nothing else)."""
    from kdp.autodiff import evaluate_shapes

    key = (model.loss, repr(keras.tree.map_structure(_example_spec, (x, y))))
    probed = _PROBED.setdefault(model, set())
    if model.built and key in probed:
        return
    x_few = keras.tree.map_structure(lambda a: a[:rows], x)
    y_few = y[:rows]
    shapes = []

    def forward(x_, y_):
        y_pred = model(x_, training=False)
        shapes.append(tuple(y_pred.shape))
        return model.loss(y_, y_pred)

    try:
        # Shapes only where the model is built (JAX: no executable compiled and kept).
        evaluate_shapes(forward, x_few, y_few) if model.built else forward(x_few, y_few)
    except Exception as e:  # noqa: BLE001 (any refusal of the loss is reported)
        outputs = "(N" + "".join(f", {d}" for d in shapes[0][1:]) + ")" if shapes else "unknown"
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DataValidationError(
            f"{_loss_name(model.loss)} cannot take labels of shape {(len(y),) + y.shape[1:]} for "
            f"outputs of shape {outputs}: {first}. A sparse loss takes class ids of shape "
            "(N,), a categorical one label vectors of shape (N, classes). Nothing was spent."
        ) from e
    if model.built:
        probed.add(key)


#: model -> the ``(loss, example specs)`` `probe_loss` accepted for it
_PROBED = weakref.WeakKeyDictionary()


def _example_spec(array):
    return tuple(array.shape[1:]), str(array.dtype)


def _loss_name(loss):
    return getattr(loss, "name", None) or getattr(loss, "__name__", None) or type(loss).__name__


def input_bound_needed(model):
    """True for a Clipless model whose gradient bounds use ``DatasetMetadata.max_norm``
    (`kdp.bounds.uses_input_bound`): every example's norm must be at most it."""
    from kdp.bounds import uses_input_bound

    if getattr(getattr(model, "dp_parameters", None), "clipping_norm", None) is not None:
        return False
    return uses_input_bound(model, getattr(getattr(model, "dataset_metadata", None), "max_norm", None))


def _check_norms(model, leaves):
    bound = getattr(getattr(model, "dataset_metadata", None), "max_norm", None)
    if bound is None or not input_bound_needed(model):
        return
    check_input_norms(leaves, bound, "DatasetMetadata(max_norm={:g})",
                      "or start the model with DP_BoundedInput and leave max_norm out of "
                      "DatasetMetadata")


def _check_box(model, leaves):
    """Refuse values outside the box of a first ``DP_BoxInput(refuse_outside=True)``."""
    from kdp.layers import DP_BoxInput

    first = next((layer for layer in getattr(model, "layers", ())
                  if not isinstance(layer, keras.layers.InputLayer)), None)
    if not (isinstance(first, DP_BoxInput) and first.refuse_outside) or len(leaves) != 1:
        return
    low, high = (np.broadcast_to(np.asarray(v, "float64"), leaves[0].shape[1:])
                 for v in (first.low, first.high))
    slack = TOLERANCE * (high - low)
    for block in _row_blocks(leaves[0]):
        if np.any(block < low - slack) or np.any(block > high + slack):
            box = (f"[{first.low:g}, {first.high:g}]" if np.ndim(first.low) == np.ndim(first.high) == 0
                   else "its box")
            raise DataValidationError(
                f"a value lies outside {box}, the box the model's first layer "
                "DP_BoxInput(refuse_outside=True) assumes (kdp.recipes reads max_norm = sqrt(d) "
                "as columns in [0, 1]). Declare the columns' public range with "
                "recipe(feature_range=(low, high)), or pass feature_range=False to train on the "
                "rows as they are, bounded by max_norm alone. Nothing was spent.")


def check_input_norms(leaves, bound, stated, remedy):
    """Raise `DataValidationError` if an example of ``leaves`` (arrays of examples)
    has an L2 norm above ``bound``; ``stated`` (formatted with the bound) names
    where the bound was stated, ``remedy`` how else to train."""
    limit = (bound * (1 + TOLERANCE)) ** 2
    for leaf in leaves:
        for block in _row_blocks(leaf):  # float64 temporaries of one block, not of the data
            flat = block.reshape(len(block), -1).astype("float64")
            if flat.size and np.max(np.einsum("ij,ij->i", flat, flat)) > limit:
                raise DataValidationError(
                    f"an example's L2 norm exceeds {stated.format(bound)}, the input bound the "
                    f"gradient bounds are computed from. Clip the data first "
                    f"(kdp.pipeline.bound_clip_value), {remedy}.")


def _row_blocks(array, elements=1 << 22):
    """``array`` in blocks of rows of about ``elements`` values (the checks'
    temporaries stay small for a large in-memory training set)."""
    rows = max(1, elements // max(1, int(np.prod(array.shape[1:]))))
    return (array[start:start + rows] for start in range(0, len(array), rows))


def validate_stream(model, data, max_rows):
    """``data`` (a `tf.data.Dataset`, a `keras.utils.PyDataset` or a generator of
    ``(x, y[, sample_weight])`` batches) with `validate_batch` applied to every
    batch before it reaches the step (``max_rows``: the expected batch size; no
    record twice). A refused batch raises before its step runs (the gate refunds
    the step)."""
    def check(batch):
        if not isinstance(batch, (tuple, list)) or len(batch) not in (2, 3):
            raise DataValidationError("each batch must be (x, y) or (x, y, sample_weight)")
        return validate_batch(model, *batch, max_rows=max_rows, distinct=True)

    if hasattr(data, "element_spec"):  # tf.data: the same check, run by tf.data itself
        import tensorflow as tf

        def checked(*batch):
            flat = tf.nest.flatten(batch)

            def run(*arrays):
                check(tuple(tf.nest.pack_sequence_as(batch, list(arrays))))
                return np.array(True)

            ok = tf.numpy_function(run, flat, tf.bool, stateful=True)
            with tf.control_dependencies([ok]):
                return tf.nest.pack_sequence_as(batch, [tf.identity(t) for t in flat])

        return data.map(checked)
    if isinstance(data, keras.utils.PyDataset):
        return _ValidatedPyDataset(data, check)
    if hasattr(data, "__next__") or hasattr(data, "__iter__"):
        return (tuple(check(batch)) for batch in data)
    raise DataValidationError(f"cannot train on {type(data).__name__}: pass arrays or a dataset")


class _ValidatedPyDataset(keras.utils.PyDataset):
    """A `PyDataset` whose batches pass `validate_batch` first."""

    def __init__(self, dataset, check):
        super().__init__()
        self.dataset, self.check = dataset, check

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, index):
        return tuple(self.check(self.dataset[index]))

    def on_epoch_begin(self):
        self.dataset.on_epoch_begin()

    def on_epoch_end(self):
        self.dataset.on_epoch_end()
