"""Data-parallel DP training on 4 virtual CPU devices.

JAX: `keras.distribution.DataParallel` over ``--xla_force_host_platform_device_count=4``.
TensorFlow: `tf.distribute.MirroredStrategy` over 4 logical CPU devices.

Device counts are fixed when the backend initialises, so the measurements run
in a process of their own (this file run as a script, ``--worker``, forked from
one that has imported Keras and kdp: `tests/_forks.py`) that prints one JSON
line; the tests below check it, on the current ``KERAS_BACKEND``. What is
measured, through the real `fit` path (Poisson batches, Keras' compiled
``train_step``, the engine's gradient reduction):

* noise: every sample weight 0 and SGD(1) with the projections detached, so a
  step moves each variable by minus the noise of the reduced gradient. Its std
  is compared with the single-device calibration, written out by hand
  (``σ c_v Δ_v / b``, as in tests/test_training.py);
* exactness: 6 `train_on_batch` steps on the same Poisson batches (global
  rate, padded to a multiple of 4), each taken on 4 replicas from the weights
  the one-device run had before it, with the same seeds, give the one-device
  step's weights (one noise draw, gradients reduced to the global sum); after 4
  more `fit` steps the replicas hold identical weights. Step by step, not along
  two trajectories: summing a gradient over 4 replicas rounds differently
  (about 1e-7), and a `GroupSort` pair closer than that changes order, which
  moves one example's gradient by O(1);
* ε and sampling: the ledgers of the 1- and 4-device `fit` runs give the same
  ε, equal to `compute_epsilon` at the global rate with σ_eff written by hand;
  the Poisson batches `fit` drew have the global rate, a size divisible by 4
  and mean size b;
* negative controls, measured by the same tests: noise at full std on every
  replica (TensorFlow: 4 identical draws summed, std × 4; JAX: impossible, one
  SPMD program draws once), a per-replica sampling rate (``b/R`` as the batch
  size: noise std × 4, the sampling rate and global batch ÷ 4, ε different),
  and (TensorFlow) Keras' own ``train_on_batch``, which gives the whole batch to
  every replica (the weights leave the single-device trajectory);
* the per-example clipping path (`DPParameters(clipping_norm=...)`): exactness
  and the noise std ``σ C / b`` on 4 replicas.
"""

import functools
import json
import math
import os
import sys

import numpy as np
import pytest

R = 4
D_IN, X0, B_NORM, SIGMA, NM_COEF = 24, 2.0, 0.5, 1.5, 2.5
N, BATCH = 256, 32
SQRT2 = math.sqrt(2.0)
WIDTH = 384          # the measured bias: WIDTH draws a step, few steps (a step is mostly overhead)
STEPS = 30           # bias: 384 × 30 draws, relative s.e. of the std 0.66 % (3 % = 4.5 s.e.)
CONTROL_STEPS = 30   # the controls are off by a factor 4, not 3 %
EXACT_STEPS = 6


def expected_stds(batch=BATCH):
    """By hand: Δ_W1 = X0·L, Δ_bias = L, Δ_W2 = (X0 + B)·L, std = σ c Δ / b (per-layer)."""
    deltas = [X0 * SQRT2, SQRT2, (X0 + B_NORM) * SQRT2]
    return [SIGMA * c * d / batch for c, d in zip([NM_COEF, 1.0, 1.0], deltas)]


def lipschitz_model(seed, batch=BATCH, lr=1.0):
    """The measured model: per-layer noise (c = 2.5 on the first kernel), SGD(lr)."""
    import keras

    from kdp import layers, losses
    from kdp.model import DP_Sequential, DPParameters
    from kdp.pipeline import DatasetMetadata

    params = DPParameters("per-layer", SIGMA, 1e-3, reproducible=seed is not None, seed=seed)
    model = DP_Sequential(
        [layers.DP_BoundedInput((D_IN,), X0), layers.DP_QuickSpectralDense(WIDTH, nm_coef=NM_COEF),
         layers.DP_AddBias(B_NORM), layers.DP_GroupSort(2), layers.DP_QuickSpectralDense(8)],
        dp_parameters=params, dataset_metadata=DatasetMetadata((D_IN,), 8, N, batch))
    model.compile(optimizer=keras.optimizers.SGD(lr), loss=losses.DP_TauCategoricalCrossentropy(2.0))
    return model


# --- the worker (a process of its own, with 4 devices) --------------------------------


def _worker():
    backend = os.environ["KERAS_BACKEND"]
    if backend == "tensorflow":
        import tensorflow as tf

        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * R)
    import contextlib

    import keras

    import kdp.distribute
    import kdp.model
    from kdp import layers, losses
    from kdp.model import DP_Model, DP_Sequential, DPParameters
    from kdp.pipeline import DatasetMetadata, PoissonBatches

    if backend == "jax":
        import jax

        assert len(jax.devices()) == R, jax.devices()
        engine = keras.distribution.DataParallel(devices=jax.devices())
    else:
        devices = [d.name for d in tf.config.list_logical_devices("CPU")]
        assert len(devices) == R, devices
        engine = tf.distribute.MirroredStrategy(devices)

    def scope(distributed):
        return engine.scope() if distributed else contextlib.nullcontext()

    sampled = []  # (rows, records, rate) of every Poisson batch `fit` draws

    class RecordingBatches(PoissonBatches):
        def sample_indices(self):
            self._idx = super().sample_indices()
            return self._idx

        def __getitem__(self, index):
            bx, by, bw = super().__getitem__(index)
            sampled.append((len(bw), len(self._idx), self.sampling_rate))
            return bx, by, bw

    kdp.training.sampling.PoissonBatches = RecordingBatches

    def sampling():
        rows, records, rates = zip(*sampled)
        sampled.clear()
        return {"rows": sorted(set(rows)), "mean_records": float(np.mean(records)),
                "draws": len(records), "rate": rates[0]}

    rng = np.random.default_rng(0)
    x = rng.normal(size=(N, D_IN)).astype("float32")
    y = rng.integers(0, 8, N)

    def clipping_model(seed, lr=1.0):
        inputs = keras.Input((D_IN,))
        h = keras.layers.Dense(16, activation="tanh")(inputs)
        outputs = keras.layers.Dense(8)(h)
        params = DPParameters(noise_multiplier=SIGMA, delta=1e-3, reproducible=True, seed=seed,
                              clipping_norm=0.7)
        model = DP_Model(inputs, outputs, dp_parameters=params,
                         dataset_metadata=DatasetMetadata((D_IN,), 8, N, BATCH))
        model.compile(optimizer=keras.optimizers.SGD(lr),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

    class Snapshots(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.snaps = []

        def on_train_begin(self, logs=None):
            self.snaps.append([np.array(v) for v in self.model.trainable_variables])

        def on_train_batch_end(self, batch, logs=None):
            self.snaps.append([np.array(v) for v in self.model.trainable_variables])

    def noise_rms(make, distributed, steps, **kwargs):
        """Run `steps` real steps with zero learning signal; rms of the update per variable."""
        with scope(distributed):
            model = make(**kwargs)
            for v in model.trainable_variables:
                v.constraint = None  # the update is then exactly −noise
            snap = Snapshots()
            model.fit(x, y, sample_weight=np.zeros(N), epochs=1, steps_per_epoch=steps, verbose=0,
                      callbacks=[snap])
            eps = model.privacy_spent()[0]
            replicas = kdp.distribute.num_replicas(model)
        s = snap.snaps
        rms = [float(np.sqrt(np.mean(np.stack([s[t][i] - s[t + 1][i] for t in range(steps)]) ** 2,
                                     dtype="float64")))
               for i in range(len(s[0]))]
        return {"rms": rms, "sizes": [int(np.size(w)) for w in s[0]], "spec": model.privacy_spec(),
                "stds": list(model.noise_stds().values()), "epsilon": eps, "sampling": sampling(),
                "replicas": replicas}

    def train(make, distributed, initial, starts=None, keras_train_on_batch=False, **kwargs):
        """EXACT_STEPS `train_on_batch` steps (weights 1, projections on) from `initial`
        weights on the same Poisson batches, step ``t`` from the trainable weights
        ``starts[t]`` if given, then 4 `fit` steps (replicas checked after). Returns
        the trainable weights before and after each step."""
        batches = PoissonBatches(x, y, BATCH, seed=21, multiple_of=R)
        before, after = [], []
        with scope(distributed):
            model = make(**kwargs)
            model.set_weights(initial)
            for t in range(EXACT_STEPS):
                if starts is not None:
                    for v, w in zip(model.trainable_variables, starts[t]):
                        v.assign(w)
                before.append([np.array(v) for v in model.trainable_variables])
                bx, by, bw = batches[t]
                step = keras.Model.train_on_batch if keras_train_on_batch else type(model).train_on_batch
                step(model, bx, by, sample_weight=bw)
                after.append([np.array(v) for v in model.trainable_variables])
            model.fit(x, y, epochs=1, steps_per_epoch=4, verbose=0)
        copies = [kdp.distribute.replica_values(v) for v in model.variables]  # seed state included
        return {
            "before": before, "after": after,
            "replicas": len(copies[0]),
            "replicas_identical": all(np.array_equal(c[0], other) for c in copies for other in c[1:]),
        }

    def compare(a, b, key="after"):
        """The largest relative difference of a variable, over the steps."""
        return max(float(np.max(np.abs(u - v)) / (np.max(np.abs(u)) + 1e-12))
                   for step_a, step_b in zip(a["after"], b[key]) for u, v in zip(step_a, step_b))

    out = {"backend": backend}
    # noise: independent seeds for the two runs
    out["noise_single"] = noise_rms(lipschitz_model, False, STEPS, seed=11)
    out["noise_dp"] = noise_rms(lipschitz_model, True, STEPS, seed=12)
    # negative control: per-replica sampling rate (b/R given as the batch size)
    out["control_per_replica_rate"] = noise_rms(lipschitz_model, True, CONTROL_STEPS, seed=13,
                                                batch=BATCH // R)
    # negative control: noise at full std on every replica (TensorFlow: no replica-0 share)
    initial = lipschitz_model(5).get_weights()
    single = train(lipschitz_model, False, initial, seed=5, lr=0.05)
    share = kdp.distribute.noise_share
    kdp.distribute.noise_share = lambda: 1.0
    try:
        out["control_full_noise_every_replica"] = noise_rms(lipschitz_model, True, CONTROL_STEPS, seed=14)
        wrong = train(lipschitz_model, True, initial, single["before"], seed=5, lr=0.05)
    finally:
        kdp.distribute.noise_share = share

    dp = train(lipschitz_model, True, initial, single["before"], seed=5, lr=0.05)
    out["exact"] = {
        "single_replicas": single["replicas"], "dp_replicas": dp["replicas"],
        "replicas_identical": dp["replicas_identical"],
        "max_rel_diff": compare(single, dp), "max_rel_diff_full_noise": compare(single, wrong),
        "moved": compare(single, single, key="before"),
    }
    if backend == "tensorflow":  # negative control: Keras' own train_on_batch, whole batch per replica
        plain = train(lipschitz_model, True, initial, single["before"], keras_train_on_batch=True,
                      seed=5, lr=0.05)
        out["exact"]["max_rel_diff_whole_batch_per_replica"] = compare(single, plain)
    # per-example clipping path
    initial = clipping_model(6).get_weights()
    single = train(clipping_model, False, initial, seed=6, lr=0.05)
    dp = train(clipping_model, True, initial, single["before"], seed=6, lr=0.05)
    out["clipping_exact"] = {"replicas_identical": dp["replicas_identical"], "dp_replicas": dp["replicas"],
                             "max_rel_diff": compare(single, dp), "moved": compare(single, single, key="before")}
    out["clipping_noise_dp"] = noise_rms(clipping_model, True, 40, seed=15)
    # the default, unpredictable noise seed (re-drawn from the OS by `fit`) stays in sync
    with scope(True):
        model = lipschitz_model(None)
        model.fit(x, y, epochs=1, steps_per_epoch=2, verbose=0)
        copies = [kdp.distribute.replica_values(v) for v in model.variables]
    out["os_seed_replicas_identical"] = (len(copies[0]) == R and all(
        np.array_equal(c[0], other) for c in copies for other in c[1:]))
    # shuffled batches of b records must split evenly over the replicas
    with scope(True):
        model = DP_Sequential([layers.DP_BoundedInput((D_IN,), X0), layers.DP_QuickSpectralDense(8)],
                              dp_parameters=DPParameters(delta=1e-3, sampling="shuffle"),
                              dataset_metadata=DatasetMetadata((D_IN,), 8, N, 30))
        model.compile(optimizer="sgd", loss=losses.DP_TauCategoricalCrossentropy(2.0))
        try:
            model.fit(x, y, epochs=1, verbose=0)
            out["shuffle_error"] = None
        except ValueError as e:
            out["shuffle_error"] = str(e)
    print("KDP_RESULT " + json.dumps(out))


# --- the tests (pytest process) --------------------------------------------------------


@functools.cache  # once per process, even if the fixture is set up again
def _run_worker(forks, backend, tmp_path):
    env = dict(forks.env, KERAS_BACKEND=backend)
    if backend == "jax":
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={R}").strip()
    code, output = forks.run([os.path.abspath(__file__), "--worker"], tmp_path, tmp_path / "worker.log",
                             env=env, timeout=600)
    assert code == 0, output[-6000:]
    line = [t for t in output.splitlines() if t.startswith("KDP_RESULT ")][-1]
    return json.loads(line[len("KDP_RESULT "):])


@pytest.fixture(scope="module")
def result(forks, tmp_path_factory):
    """The worker's measurements on the current backend."""
    import keras

    folder = tmp_path_factory.getbasetemp() / "distributed"
    folder.mkdir(exist_ok=True)
    return _run_worker(forks, keras.backend.backend(), folder)


def _within(measured, expected, tol=0.03):
    return abs(measured / expected - 1.0) <= tol


def test_noise_std_matches_single_device(result):
    single, dp = result["noise_single"], result["noise_dp"]
    assert single["replicas"] == 1 and dp["replicas"] == R
    expected = expected_stds()
    assert dp["stds"] == pytest.approx(expected, rel=1e-6)  # calibrated to the global b
    print(f"\n{result['backend']}: noise std / single-device formula, 1 device "
          f"{[round(m / e, 4) for m, e in zip(single['rms'], expected)]}, {R} replicas "
          f"{[round(m / e, 4) for m, e in zip(dp['rms'], expected)]}")
    for m1, m4, e in zip(single["rms"], dp["rms"], expected):
        assert _within(m1, e) and _within(m4, e), (m1, m4, e)
        assert _within(m4, m1)


def test_negative_control_full_noise_on_every_replica(result):
    # A naive data-parallel step: every replica adds its own full-std draw and the
    # engine sums the gradients. Under MirroredStrategy the seeds are mirrored, so
    # the draws are identical: std × R. Under JAX the step is one SPMD program and
    # the noise is drawn once whatever the share: the mistake cannot happen.
    measured = result["control_full_noise_every_replica"]["rms"]
    factor = R if result["backend"] == "tensorflow" else 1
    ratios = [m / e for m, e in zip(measured, expected_stds())]
    print(f"\n{result['backend']}: full noise on every replica, std ratio {[round(r, 3) for r in ratios]}")
    for r in ratios:
        assert abs(r / factor - 1) < 0.05
        if factor != 1:
            assert not _within(r, 1.0)  # the noise test flags it
    if factor != 1:  # and the trained weights leave the single-device trajectory
        assert result["exact"]["max_rel_diff_full_noise"] > 100 * max(result["exact"]["max_rel_diff"], 1e-7)


def test_negative_control_per_replica_sampling_rate(result):
    # b/R given as the batch size (tf.distribute's "per-replica batch"): the
    # sampling rate is R times too small, the noise R times too large, ε differs.
    control = result["control_per_replica_rate"]
    ratios = [m / e for m, e in zip(control["rms"], expected_stds())]
    print(f"\n{result['backend']}: per-replica sampling rate, std ratio {[round(r, 3) for r in ratios]}")
    for r in ratios:
        assert not _within(r, 1.0)
        assert abs(r / R - 1) < 0.05
    assert not math.isclose(control["epsilon"], result["noise_single"]["epsilon"], rel_tol=0.03)
    assert control["sampling"]["rate"] == BATCH / R / N
    assert abs(control["sampling"]["mean_records"] * R / BATCH - 1) < 0.25  # the global batch is b/R


def test_replicas_identical_and_equal_to_single_device(result):
    exact = result["exact"]
    assert exact["single_replicas"] == 1 and exact["dp_replicas"] == R
    assert exact["replicas_identical"]
    assert exact["moved"] > 1e-3  # the steps did change the weights
    print(f"\n{result['backend']}: max relative weight difference, {R} replicas vs 1 device: "
          f"{exact['max_rel_diff']:.2e} (controls: full noise per replica "
          f"{exact['max_rel_diff_full_noise']:.2e}, whole batch per replica "
          f"{exact.get('max_rel_diff_whole_batch_per_replica', float('nan')):.2e})")
    assert exact["max_rel_diff"] < 1e-4, exact["max_rel_diff"]
    if "max_rel_diff_whole_batch_per_replica" in exact:  # Keras' TF train_on_batch: R× the data
        assert exact["max_rel_diff_whole_batch_per_replica"] > 1e-2


def test_epsilon_and_sampling_rate_same_as_single_device(result):
    single, dp = result["noise_single"], result["noise_dp"]
    assert dp["spec"] == single["spec"] and dp["spec"]["sampling_rate"] == BATCH / N
    assert dp["epsilon"] == single["epsilon"]
    from kdp import accounting

    sigma_eff = sum((SIGMA * c) ** -2 for c in (NM_COEF, 1.0, 1.0)) ** -0.5  # by hand
    assert dp["spec"]["noise_multiplier"] == pytest.approx(sigma_eff, rel=1e-9)
    assert dp["epsilon"] == pytest.approx(accounting.compute_epsilon(sigma_eff, BATCH / N, STEPS, 1e-3),
                                          rel=1e-6)
    # the batches `fit` drew: global rate b/N, padded to a multiple of R, mean size b
    sampled = dp["sampling"]
    assert sampled["rate"] == BATCH / N and all(rows % R == 0 for rows in sampled["rows"])
    assert abs(sampled["mean_records"] - BATCH) < 5 * math.sqrt(BATCH / sampled["draws"])
    print(f"\n{result['backend']}: ε after {STEPS} steps, 1 device {single['epsilon']:.4f}, "
          f"{R} replicas {dp['epsilon']:.4f}; mean global batch {sampled['mean_records']:.2f} (b = {BATCH})")


def test_clipping_path(result):
    exact = result["clipping_exact"]
    assert exact["dp_replicas"] == R and exact["replicas_identical"]
    assert exact["moved"] > 1e-3
    assert exact["max_rel_diff"] < 1e-4, exact["max_rel_diff"]
    noise = result["clipping_noise_dp"]
    expected = SIGMA * 0.7 / BATCH
    assert noise["stds"] == pytest.approx([expected] * len(noise["rms"]), rel=1e-6)
    pooled = math.sqrt(sum(m * m * n for m, n in zip(noise["rms"], noise["sizes"])) / sum(noise["sizes"]))
    assert _within(pooled, expected), (pooled, expected)  # 536 × 40 draws: s.e. 0.5 %
    print(f"\n{result['backend']}: clipping noise std / σC/b on {R} replicas: {pooled / expected:.4f}")


def test_os_entropy_seed_stays_replicated(result):
    assert result["os_seed_replicas_identical"]


def test_shuffled_batches_must_split_evenly(result):
    assert result["shuffle_error"] and "divisible by 4" in result["shuffle_error"]


def test_poisson_batches_shard_evenly_at_the_global_rate():
    from kdp.pipeline import PoissonBatches

    x = np.arange(N, dtype="float32")[:, None]
    plain = PoissonBatches(x, np.zeros(N), BATCH, seed=3)
    sharded = PoissonBatches(x, np.zeros(N), BATCH, seed=3, multiple_of=R)
    assert sharded.capacity % R == 0 and plain.capacity <= sharded.capacity < plain.capacity + R
    sizes = []
    for i in range(400):
        (a, _, wa), (b, _, wb) = plain[i], sharded[i]
        assert len(b) % R == 0
        assert np.array_equal(a[wa > 0], b[wb > 0])  # the same records: the global rate
        sizes.append(wb.sum())
    assert abs(np.mean(sizes) - BATCH) < 5 * math.sqrt(BATCH / 400)


if __name__ == "__main__" and "--worker" in sys.argv:
    _worker()
