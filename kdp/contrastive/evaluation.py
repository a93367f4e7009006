"""Pair data and evaluation of contrastive embeddings: k-NN accuracy, DP fine-tuning."""

import keras
import numpy as np

from kdp.training.validation import is_structure


def same_class_pairs(x, y, seed=0):
    """Positive pairs of two different examples of the same class (as in the
    Logit-DP code): each class is shuffled, cut in two halves, and the halves are
    paired. Returns ``(anchors, positives, labels)``; every example is used at
    most once, so a record (pair) holds two examples.

    The pairing uses the labels but is a fixed public procedure applied to the
    training set before training: privacy is stated for pairs as records.
    """
    x = np.asarray(x)
    y = np.asarray(y).reshape(-1)
    rng = np.random.default_rng(seed)
    anchors, positives, labels = [], [], []
    for c in np.unique(y):
        idx = rng.permutation(np.flatnonzero(y == c))
        half = len(idx) // 2
        anchors.append(x[idx[:half]])
        positives.append(x[idx[half:2 * half]])
        labels.append(np.full(half, c))
    order = rng.permutation(sum(len(l) for l in labels))
    return (np.concatenate(anchors)[order], np.concatenate(positives)[order],
            np.concatenate(labels)[order])


def embed(encoder, x, loss=None, batch_size=512):
    """Embeddings of ``x``: ``loss.embed(encoder(x))`` if a contrastive loss is
    given, else the encoder outputs scaled to unit norm. NumPy ``(n, d)``. ``x`` is
    an array or a structure (dict, list) of arrays with one row per example."""
    x = keras.tree.map_structure(np.asarray, x) if is_structure(x) else np.asarray(x, "float32")
    out = []
    for start in range(0, len(keras.tree.flatten(x)[0]), batch_size):
        f = encoder(keras.tree.map_structure(lambda a: a[start:start + batch_size], x),
                    training=False)
        if loss is not None:
            f = loss.embed(f)
        out.append(np.asarray(f))
    e = np.concatenate(out)
    if loss is None:
        e = e / np.maximum(np.linalg.norm(e, axis=1, keepdims=True), 1e-12)
    return e


def knn_accuracy(train_embeddings, train_labels, test_embeddings, test_labels, k=3,
                 mode="vote"):
    """k-NN accuracy of embeddings, neighbours by largest dot product.

    Args:
        mode: ``"vote"`` (majority vote of the k neighbours, ties to the nearest
            neighbour's label) or ``"agreement"`` (the Logit-DP paper's metric: the
            fraction of all k·n neighbour labels equal to the query's label).
    """
    a = np.asarray(train_embeddings, "float64")
    b = np.asarray(test_embeddings, "float64")
    ya = np.asarray(train_labels).reshape(-1)
    yb = np.asarray(test_labels).reshape(-1)
    sims = b @ a.T
    nn = np.argsort(-sims, axis=1)[:, :k]
    labels = ya[nn]
    if mode == "agreement":
        return float(np.mean(labels == yb[:, None]))
    if mode != "vote":
        raise ValueError(f"mode must be 'vote' or 'agreement', got {mode!r}")
    preds = []
    for row in labels:
        values, counts = np.unique(row, return_counts=True)
        best = values[counts == counts.max()]
        preds.append(row[0] if row[0] in best else best[0])
    return float(np.mean(np.asarray(preds) == yb))


def finetune_head(encoder, x_train, y_train, nb_classes, loss=None, epochs=5, batch_size=64,
                  noise_multiplier=1.0, delta=None, learning_rate=1e-2, tau=8.0,
                  head_layers=None, x_test=None, y_test=None, seed=None, verbose=0,
                  reproducible=False):
    """Fine-tune a Lipschitz head on frozen embeddings with the supervised DP path.

    The embeddings ``loss.embed(encoder(x))`` (norm ≤ 1 for cosine, ≤ r for dot)
    are a fixed public map of each example (the encoder is already released), so
    the head is an ordinary `kdp.DP_Sequential` trained by Clipless DP-SGD
    (``fit``), with its own privacy ledger. If the head is trained on the same
    records as the encoder, the total privacy cost is the composition of both.

    Args:
        head_layers: DP layers after `DP_BoundedInput` (default: one
            `DP_SpectralDense(nb_classes)`, a linear Lipschitz head).
        tau: temperature of `DP_TauCategoricalCrossentropy`.
        reproducible, seed: fix the head's noise and sampling (tests only; both
            are needed, see `kdp.DPParameters`).

    Returns:
        ``(head, history)``; ``history.history`` has ``val_accuracy`` if a test set
        is given.
    """
    from kdp.layers import DP_BoundedInput, DP_SpectralDense
    from kdp.losses import DP_TauCategoricalCrossentropy
    from kdp.model import DP_Sequential, DPParameters
    from kdp.pipeline import DatasetMetadata

    from kdp.training import seeds

    seeds.check_seed(reproducible, seed)
    e_train = embed(encoder, x_train, loss)
    d = e_train.shape[1]
    bound = loss.embedding_norm_bound() if loss is not None else 1.0
    n = len(e_train)
    delta = delta if delta is not None else 1.0 / (10 * n)
    layers = [DP_BoundedInput((d,), upper_bound=bound)]
    layers += list(head_layers) if head_layers is not None else [DP_SpectralDense(nb_classes)]
    params = DPParameters("global", noise_multiplier, delta, reproducible=reproducible, seed=seed)
    head = DP_Sequential(layers, dp_parameters=params,
                         dataset_metadata=DatasetMetadata((d,), nb_classes, n, batch_size))
    head.compile(optimizer=keras.optimizers.Adam(learning_rate),
                 loss=DP_TauCategoricalCrossentropy(tau), metrics=["accuracy"])
    validation = None
    if x_test is not None:
        validation = (embed(encoder, x_test, loss), np.asarray(y_test).reshape(-1))
    history = head.fit(e_train, np.asarray(y_train).reshape(-1), epochs=epochs,
                       validation_data=validation, verbose=verbose)
    return head, history


__all__ = ["embed", "finetune_head", "knn_accuracy", "same_class_pairs"]
