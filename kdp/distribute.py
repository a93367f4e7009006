"""Data-parallel DP training: the backend-specific facts, in one place.

kdp trains on the distribution engines Keras already has; this module only
answers the two questions whose answer depends on the engine.

* **JAX** (`keras.distribution.DataParallel`, or any distribution with a batch
  axis): the train step is *one* SPMD program over the global batch. The batch
  is sharded along the ``batch`` mesh axis, the variables (the noise seed
  included) are replicated, and ``compute_loss`` sees the global batch. The
  objective ``Σ w_i ℓ_i / b + Σ_v ⟨v − sg(v), ξ_v⟩`` is then exactly the
  single-device one: one draw of ξ per step, nothing to correct.
* **TensorFlow** (`tf.distribute.MirroredStrategy`): Keras runs ``train_step``
  once per replica on its shard of the global batch, and the optimizer
  **sums** the replicas' gradients (``all_reduce(SUM)`` in
  `keras/src/backend/tensorflow/optimizer.py`). Keras' own losses are scaled by
  ``1/R`` for that reason; kdp's objective divides by the *global* expected
  batch ``b`` instead, so the data term sums to ``Σ_all w_i ∇ℓ_i / b`` as it
  should. The noise seed is a mirrored variable: every replica draws the
  **same** ξ, and the sum would carry ``R·ξ`` (std ``R`` times too large); with
  independent seeds it would carry std ``√R`` times too large. So only replica
  0 keeps its draw (`noise_share`): the reduced gradient carries exactly one
  calibrated draw. Data-independent terms (regularization losses) are weighted
  the same way so that they too are counted once.

Sampling is unchanged: Poisson sampling at the global rate ``q = b/N`` makes
the global batch, padded to a static size divisible by `num_replicas`, and the
engine shards it.

**Several processes** (`process_layout` > 1: JAX after
``keras.distribution.initialize``/``jax.distributed.initialize``, TensorFlow
under `tf.distribute.MultiWorkerMirroredStrategy`) train on the same engines;
each process holds a shard of the records and samples it at the global rate
(`kdp.training.processes`). The facts that depend on the engine are here:
how many processes and which one this is (`process_layout`), how they exchange
a small array (`allgather`), and the two Keras 3 gaps of
`MultiWorkerMirroredStrategy` (`first_local_batch`, `logs_for_reduction`).
"""

import keras


def num_replicas(model=None):
    """How many data-parallel replicas share one global batch (1 without distribution).

    JAX: the size of the batch axis of the mesh of the current
    `keras.distribution` distribution. TensorFlow: ``num_replicas_in_sync`` of
    the model's strategy (the strategy whose scope created it), else of the
    current one.
    """
    backend = keras.backend.backend()
    if backend == "jax":
        distribution = keras.distribution.distribution()
        if distribution is None:
            return 1
        mesh = distribution.device_mesh
        axis = getattr(distribution, "batch_dim_name", None)
        if axis in mesh.axis_names:
            return int(mesh.shape[mesh.axis_names.index(axis)])
        return 1
    if backend == "tensorflow":
        import tensorflow as tf

        strategy = getattr(model, "distribute_strategy", None) or tf.distribute.get_strategy()
        return int(strategy.num_replicas_in_sync)
    return 1


def on_accelerator():
    """Whether the backend computes on a GPU or TPU (not only the CPU)."""
    backend = keras.backend.backend()
    if backend == "jax":
        import jax

        return jax.default_backend() != "cpu"
    if backend == "tensorflow":
        import tensorflow as tf

        return any(d.device_type != "CPU" for d in tf.config.list_logical_devices())
    return False


def noise_share():
    """The weight of this replica's copy of a replicated term (noise, regularizers).

    The gradients of the replicas are summed, so a term every replica computes
    identically must count on one replica only: ``1`` on replica 0, ``0`` on
    the others, under `tf.distribute`; ``1`` everywhere else (one device, or
    one SPMD program under JAX). Returns a Python float or a scalar tensor.
    """
    if keras.backend.backend() != "tensorflow":
        return 1.0
    import tensorflow as tf

    context = tf.distribute.get_replica_context()
    if context is None or context.num_replicas_in_sync == 1:
        return 1.0
    return tf.cast(tf.equal(context.replica_id_in_sync_group, 0), "float32")


def replica_values(variable):
    """The copies of ``variable`` held by each device, as NumPy arrays.

    One array without distribution; under JAX one per addressable shard of the
    (replicated) array; under `tf.distribute` one per mirrored component.
    Used to check that the replicas agree.
    """
    import numpy as np

    value = getattr(variable, "value", variable)
    if keras.backend.backend() == "jax" and hasattr(value, "addressable_data"):
        # (`addressable_shards` fails on some arrays of a multi-process run)
        return [np.asarray(value.addressable_data(i))
                for i in range(len(value.sharding.addressable_devices))]
    components = getattr(value, "values", None)
    if components is not None and not callable(components):
        return [np.asarray(c) for c in components]
    return [np.asarray(value)]


def process_layout(model=None):
    """``(count, index)``: how many processes train ``model`` together, and this one's rank.

    JAX: `jax.process_count` / `jax.process_index` once ``jax.distributed`` is
    initialized (``(1, 0)`` before: asking JAX would start its backend and
    forbid a later ``initialize``). TensorFlow: the workers of the model's
    `MultiWorkerMirroredStrategy` (replicas over local devices) and the rank of
    this worker's first replica. ``(1, 0)`` everywhere else.
    """
    count = process_count(model)
    if count == 1:
        return 1, 0
    if keras.backend.backend() == "jax":
        import jax

        return count, int(jax.process_index())
    strategy = _tf_multi_worker_strategy(model)
    first = strategy.experimental_distribute_values_from_function(
        lambda context: context.replica_id_in_sync_group)
    rank = int(strategy.experimental_local_results(first)[0])
    return count, rank // len(strategy.extended.worker_devices)


def process_count(model=None):
    """The number of processes in `process_layout` (cheap: no rank lookup)."""
    backend = keras.backend.backend()
    if backend == "jax":
        import jax

        return int(jax.process_count()) if _jax_distributed_initialized() else 1
    if backend == "tensorflow":
        strategy = _tf_multi_worker_strategy(model)
        if strategy is not None:
            return strategy.num_replicas_in_sync // len(strategy.extended.worker_devices)
    return 1


def _jax_distributed_initialized():
    import jax

    initialized = getattr(jax.distributed, "is_initialized", None)  # JAX >= 0.5
    if initialized is not None:
        return bool(initialized())
    from jax._src import distributed

    return distributed.global_state.client is not None


def local_replicas(model=None):
    """The data-parallel replicas of ``model`` on this process's devices."""
    count, _ = process_layout(model)
    return num_replicas(model) // count


def allgather(model, array):
    """Every process's ``array`` (same shape and dtype on all), stacked: shape ``(P, ...)``.

    A collective: every process of the run must call it, in the same order.
    JAX: `jax.experimental.multihost_utils.process_allgather`. TensorFlow: the
    strategy's ``gather`` of one value per replica (one replica per worker).
    """
    import numpy as np

    array = np.asarray(array)
    if keras.backend.backend() == "jax":
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(array))
    import tensorflow as tf

    strategy = _tf_multi_worker_strategy(model)
    values = strategy.experimental_distribute_values_from_function(
        lambda context: tf.constant(array[None]))
    logger = tf.get_logger()
    level = logger.level
    logger.setLevel("ERROR")  # `strategy.gather` traces a new function per call: a warning after 5
    try:
        return np.asarray(strategy.gather(values, axis=0))
    finally:
        logger.setLevel(level)


def _tf_multi_worker_strategy(model):
    """The model's `MultiWorkerMirroredStrategy` if it spans several workers, else None."""
    import tensorflow as tf

    strategy = getattr(model, "distribute_strategy", None) or tf.distribute.get_strategy()
    if not isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
        return None
    if strategy.num_replicas_in_sync == len(strategy.extended.worker_devices):
        return None  # one worker: the single-host case
    return strategy


def first_local_batch(model, batch):
    """A distributed batch as one plain batch, for Keras' symbolic build only.

    Keras 3 builds a model under a strategy from the first batch reduced with
    ``strategy.reduce("MEAN")``, which fails on a nested per-replica batch under
    `MultiWorkerMirroredStrategy`: the first local replica's batch has the
    right structure and shapes."""
    from keras import tree

    strategy = model.distribute_strategy
    return tree.map_structure(lambda v: strategy.experimental_local_results(v)[0], batch)


def build_inputs(model, iterator, data_batch):
    """``(iterator, data_batch)`` for Keras' symbolic build: on several processes
    (TensorFlow) the first local batch instead of the iterator, whose nested
    per-replica batch Keras 3 fails to reduce over workers (`first_local_batch`)."""
    if iterator is None or process_count(model) <= 1:
        return iterator, data_batch
    for _, _, batches in iterator:
        return None, first_local_batch(model, next(batches))
    return None, data_batch


def logs_for_reduction(model, logs):
    """The step's logs in a shape Keras 3 can reduce over several workers.

    Under `MultiWorkerMirroredStrategy` Keras reduces each log with
    ``strategy.reduce("MEAN", v, axis=0)``, which refuses a scalar: each
    scalar becomes a vector of one element (reduced back to the mean over the
    replicas). Unchanged everywhere else."""
    if keras.backend.backend() != "tensorflow" or _tf_multi_worker_strategy(model) is None:
        return logs
    from keras import ops

    return {k: ops.reshape(v, (1,)) if len(ops.shape(v)) == 0 else v for k, v in logs.items()}


def sharded_train_on_batch(model, x, y=None, sample_weight=None, return_dict=False):
    """``train_on_batch`` with the batch sharded over `tf.distribute` replicas.

    Keras' TensorFlow ``train_on_batch`` hands the *whole* batch to every
    replica (``strategy.run`` with plain tensors) and then sums the replicas'
    gradients: each example would count ``R`` times against one noise draw.
    (`fit` does not have this problem: its distributed dataset shards the
    batch.) This pads the batch with zero-weight rows to a multiple of ``R``,
    gives row block ``r`` to replica ``r`` and runs Keras' train function.

    Returns ``None`` when there is nothing to shard (one replica, or JAX, whose
    ``train_on_batch`` already shards the global batch): the caller then runs
    Keras' own ``train_on_batch``.
    """
    replicas = num_replicas(model)
    if keras.backend.backend() != "tensorflow" or replicas == 1:
        return None
    import numpy as np
    import tensorflow as tf
    from keras import tree
    from keras.src.utils.python_utils import pythonify_logs

    rows = len(tree.flatten(x)[0])
    if sample_weight is None:
        sample_weight = np.ones(rows, "float32")
    pad = (-rows) % replicas
    size = (rows + pad) // replicas
    strategy = model.distribute_strategy

    def shard(t):
        t = np.asarray(t)
        if pad:
            t = np.concatenate([t, np.zeros((pad,) + t.shape[1:], t.dtype)])
        return strategy.experimental_distribute_values_from_function(
            lambda context: tf.constant(t[context.replica_id_in_sync_group * size:
                                          (context.replica_id_in_sync_group + 1) * size]))

    model._maybe_symbolic_build(data_batch=(x, y, sample_weight))
    model.make_train_function()
    model.reset_metrics()
    data = tree.map_structure(shard, (x, y, sample_weight))
    logs = pythonify_logs(model.train_function(iter([data])))
    return logs if return_dict else model._flatten_metrics_in_order(logs)

__all__ = ["allgather", "local_replicas", "noise_share", "num_replicas", "process_count",
           "process_layout", "replica_values", "sharded_train_on_batch"]
