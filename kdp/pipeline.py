"""Data for DP training, in one import (lip-dp's layout): `DatasetMetadata`, the
data-independent input bounds, the loaders of `kdp.datasets` and `fit`'s
samplers (`kdp.training.sampling`)."""

from kdp.datasets import (
    load_breast_cancer, load_cifar10, load_dataset, load_digits, load_fashion_mnist, load_iris,
    load_mnist, load_wine,
)
from kdp.metadata import DatasetMetadata, bound_clip_value, bound_normalize
from kdp.training.sampling import (
    PoissonBatches, ShuffledBatches, check_batch_shapes, poisson_batch_shapes, poisson_capacity,
)
from kdp.training.seeds import draw_seed

__all__ = [
    "DatasetMetadata", "draw_seed", "PoissonBatches", "ShuffledBatches", "check_batch_shapes",
    "poisson_batch_shapes", "poisson_capacity", "bound_clip_value", "bound_normalize",
    "load_breast_cancer", "load_cifar10", "load_dataset", "load_digits", "load_fashion_mnist",
    "load_iris", "load_mnist", "load_wine",
]

# lip-dp's pipeline names: each raises an error that names the loader to use instead.
from kdp.compat import (  # noqa: E402
    default_delta_value, load_adbench_data, load_and_prepare_images_data, prepare_tabular_data,
)
