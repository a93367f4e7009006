"""`DatasetMetadata` and the data-independent input bounds: what the privacy
analysis knows about the training set, and the public per-example maps that
bound its norms."""

import math

import numpy as np


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
        nb_steps_per_epochs: lip-dp's, refused: the steps follow from ``N`` and
            ``b`` (`steps_per_epoch`).
    """

    def __init__(self, input_shape, nb_classes, nb_samples_train, batch_size,
                 nb_samples_test=None, class_names=None, max_norm=None, *,
                 nb_steps_per_epochs=None):
        if nb_steps_per_epochs is not None:
            raise TypeError(
                "DatasetMetadata takes no nb_steps_per_epochs (lip-dp's): drop it, the steps "
                "per epoch are DatasetMetadata.steps_per_epoch = ceil(nb_samples_train / "
                "batch_size), batch_size being the expected Poisson batch size")
        self.input_shape = tuple(int(d) for d in input_shape)
        self.nb_classes = int(nb_classes)
        self.nb_samples_train = int(nb_samples_train)
        self.batch_size = int(batch_size)
        self.nb_samples_test = None if nb_samples_test is None else int(nb_samples_test)
        self.class_names = None if class_names is None else [str(c) for c in class_names]
        self.max_norm = None if max_norm is None else float(max_norm)
        if self.nb_samples_train < 1:
            raise ValueError(f"nb_samples_train must be >= 1, got {nb_samples_train}")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if self.batch_size > self.nb_samples_train:
            raise ValueError(
                f"batch_size={batch_size} is larger than the {self.nb_samples_train} training "
                f"examples: pass batch_size={self.nb_samples_train} or less (a batch larger "
                "than the dataset is not a subsample)")
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
