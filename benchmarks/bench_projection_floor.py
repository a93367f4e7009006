"""kdp's Clipless step against plain Keras and the projection floor, in time and memory.

Three ways to train the same network, on the backend of ``KERAS_BACKEND`` (run
the script once per backend):

* ``keras``: plain Keras (ReLU, SGD, cross-entropy, shuffled batches of exactly b);
* ``floor``: the same, with one Björck step ``W ← W (3/2 I − 1/2 WᵀW)`` applied
  to every kernel after every update (a kernel constraint, on the smaller Gram
  matrix): what any method that projects after each step pays, with no noise,
  no sampling and no bookkeeping;
* ``kdp proj``: the same, with kdp's certified one-step projection
  (`kdp.layers.OrthogonalProjection(1)`: prescale, Björck step, float margin)
  as the constraint: the floor kdp itself pays;
* ``kdp``: `DP_Sequential` with `DP_QuickSpectralDense` / `DP_QuickSpectralConv2D`
  and `DP_ReLU`, per-layer noise, Poisson batches (three padded sizes),
  τ-cross-entropy: the whole private step, as ``fit`` runs it.

``noise`` is the time of the Gaussian draw alone (one draw of the kdp model's
coordinates, a compiled function): the part of ``kdp − floor``
that no step adding calibrated noise can avoid.

Networks: the MLP 784→512→512→10 and the small convnet
conv32-pool-conv64-pool-dense10 on 28×28×1 inputs (3×3 'same' convolutions;
Keras pools by averaging, kdp by `DP_ScaledL2NormPooling2D`: max pooling's
backward pass alone is slower than the whole kdp step on XLA's CPU backend).

Time: every model is built and compiled first (kdp: every padded size), then
the kinds are timed **in alternation in one process**, ``--rounds`` times: one
``fit`` of ``--steps`` steps each, wall time divided by the steps (what a user
sees, host work included). The table gives the medians over the rounds and the
ratios of the medians.

Memory (``--memory``): each (kind, batch) in its own subprocess, whose peak RSS
(``VmHWM``, which sees XLA's and TensorFlow's allocators) minus its peak after
the imports; the data (the same arrays for every kind) count in it.
The subprocess compiles, then runs ``--memory-fits`` fits (default 5): the RSS
of every kind grows over the first fits (allocator arenas) and then levels off,
so a single fit would compare the kinds at different points of that growth.

    KERAS_BACKEND=jax python benchmarks/bench_projection_floor.py [--memory]
"""

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402
from keras import ops  # noqa: E402

KINDS = ("keras", "floor", "kdp proj", "kdp")
SHAPES = {"mlp": (784,), "conv": (28, 28, 1)}


class BjorckStep(keras.constraints.Constraint):
    """One Björck step ``W (3/2 I − 1/2 WᵀW)`` on the kernel reshaped to ``(-1, units)``."""

    def __call__(self, w):
        shape = w.shape
        w2 = ops.reshape(w, (-1, shape[-1]))
        tall = w2.shape[0] >= w2.shape[1]
        g = ops.matmul(ops.transpose(w2), w2) if tall else ops.matmul(w2, ops.transpose(w2))
        p = 1.5 * ops.eye(g.shape[0], dtype=w.dtype) - 0.5 * g
        return ops.reshape(ops.matmul(w2, p) if tall else ops.matmul(p, w2), shape)


def keras_model(net, constraint):
    layers = keras.layers
    dense = dict(kernel_constraint=constraint)
    if net == "mlp":
        body = [layers.Dense(512, activation="relu", **dense), layers.Dense(512, activation="relu", **dense),
                layers.Dense(10, **dense)]
    else:
        body = [layers.Conv2D(32, 3, padding="same", activation="relu", **dense), layers.AveragePooling2D(2),
                layers.Conv2D(64, 3, padding="same", activation="relu", **dense), layers.AveragePooling2D(2),
                layers.Flatten(), layers.Dense(10, **dense)]
    model = keras.Sequential([keras.Input(SHAPES[net])] + body)
    model.compile(optimizer=keras.optimizers.SGD(0.01),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def kdp_model(net, nb_samples, batch):
    import kdp
    from kdp import layers

    if net == "mlp":
        body = [layers.DP_QuickSpectralDense(512), layers.DP_ReLU(), layers.DP_QuickSpectralDense(512),
                layers.DP_ReLU(), layers.DP_QuickSpectralDense(10)]
    else:
        body = [layers.DP_QuickSpectralConv2D(32, 3), layers.DP_ReLU(), layers.DP_ScaledL2NormPooling2D(2),
                layers.DP_QuickSpectralConv2D(64, 3), layers.DP_ReLU(), layers.DP_ScaledL2NormPooling2D(2),
                layers.DP_Flatten(), layers.DP_QuickSpectralDense(10)]
    model = kdp.DP_Sequential(
        [layers.DP_BoundedInput(SHAPES[net], 10.0)] + body,
        dp_parameters=kdp.DPParameters("per-layer", 1.0, 1e-5),
        dataset_metadata=kdp.DatasetMetadata(SHAPES[net], 10, nb_samples, batch))
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss=kdp.losses.DP_TauCategoricalCrossentropy(1.0))
    return model


class Trainer:
    """One kind of training on fixed data: ``run(steps)`` is one timed ``fit``."""

    def __init__(self, kind, net, batch, x, y):
        self.kind, self.batch, self.x, self.y = kind, batch, x, y
        if kind == "kdp":
            self.model = kdp_model(net, len(x), batch)
        else:
            from kdp.layers import OrthogonalProjection

            constraint = {"keras": None, "floor": BjorckStep(), "kdp proj": OrthogonalProjection(1)}[kind]
            self.model = keras_model(net, constraint)

    def warm_up(self, steps):
        self.run(steps)
        if self.kind == "kdp":  # compile every padded size (weights 0: nothing learnt)
            from kdp.pipeline import poisson_batch_shapes

            md = self.model.dataset_metadata
            for size in poisson_batch_shapes(md.batch_size, md.nb_samples_train,
                                             self.model.dp_parameters.batch_shapes):
                self.model.train_on_batch(self.x[:size], self.y[:size],
                                          sample_weight=np.zeros(size, "float32"))

    def run(self, steps):
        """Seconds per step of one ``fit`` of ``steps`` steps."""
        start = time.perf_counter()
        if self.kind == "kdp":
            self.model.fit(self.x, self.y, epochs=1, steps_per_epoch=steps, verbose=0)
        else:  # exactly `steps` batches of b shuffled records
            n = steps * self.batch
            self.model.fit(self.x[:n], self.y[:n], batch_size=self.batch, shuffle=True, verbose=0)
        return (time.perf_counter() - start) / steps


def noise_draw(shapes):
    """A compiled function drawing one standard Gaussian per coordinate of
    ``shapes``, in one draw as kdp does (`kdp.training.objective.noise_term`)."""
    size = sum(math.prod(s) for s in shapes)
    if keras.backend.backend() == "jax":
        import jax

        draw = jax.jit(lambda key: jax.random.normal(key, (size,)))
        key = jax.random.PRNGKey(0)
        return lambda: jax.block_until_ready(draw(key))
    import tensorflow as tf

    draw = tf.function(lambda seed: tf.random.stateless_normal((size,), seed))
    seed = tf.constant([1, 2], "int32")
    return lambda: draw(seed).numpy()


def time_noise(trainer, rounds, repeats=20):
    """Median seconds of `noise_draw` for the variables of ``trainer``'s model."""
    draw = noise_draw([tuple(v.shape) for v in trainer.model.trainable_variables])
    draw()
    times = []
    for _ in range(rounds * repeats):
        start = time.perf_counter()
        draw()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def data(net, batch, steps):
    rng = np.random.default_rng(0)
    n = max(steps * batch, 8 * batch)
    x = rng.random((n,) + SHAPES[net], dtype="float32")  # no float64 temporary
    return x, rng.integers(0, 10, n).astype("int32")


def time_kinds(net, batch, steps, rounds, kinds):
    """``{kind: [seconds per step, one per round]}``, the kinds alternated."""
    x, y = data(net, batch, steps)
    trainers = [Trainer(kind, net, batch, x, y) for kind in kinds]
    for trainer in trainers:
        trainer.warm_up(steps)
    times = {kind: [] for kind in kinds}
    for _ in range(rounds):
        for trainer in trainers:
            times[trainer.kind].append(trainer.run(steps))
    return times, time_noise(trainers[kinds.index("kdp")], rounds)


def memory_child(kind, net, batch, steps, fits):
    from _common import peak_rss_mb

    base = peak_rss_mb()
    x, y = data(net, batch, steps)
    trainer = Trainer(kind, net, batch, x, y)
    trainer.warm_up(steps)
    for _ in range(fits):
        trainer.run(steps)
    print(json.dumps({"mb": peak_rss_mb() - base}))


def memory(kind, net, batch, steps, fits):
    out = subprocess.run([sys.executable, __file__, "--memory-child", kind, net, str(batch),
                          "--steps", str(steps), "--memory-fits", str(fits)],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])["mb"]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nets", nargs="+", default=["mlp", "conv"], choices=list(SHAPES))
    parser.add_argument("--batches", type=int, nargs="+", default=[256, 1024, 4096])
    parser.add_argument("--conv-batches", type=int, nargs="+", default=[256])
    parser.add_argument("--steps", type=int, default=None,
                        help="steps per timed fit (default: 40960/b for the MLP, 2560/b for the "
                        "convnet, at least 10)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--memory", action="store_true", help="also the peak RSS of each kind")
    parser.add_argument("--memory-fits", type=int, default=5,
                        help="fits of --steps steps after compiling, for the peak RSS")
    parser.add_argument("--memory-child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.memory_child:
        kind, net, batch = args.memory_child
        memory_child(kind, net, int(batch), args.steps or 10, args.memory_fits)
        return
    print(f"backend={keras.backend.backend()}, {os.cpu_count()} CPUs; ms per step, median of "
          f"{args.rounds} alternated rounds of one fit of {args.steps or 'max(10, 40960/b or 2560/b)'} steps")
    header = (f"{'net':>4} {'batch':>5} " + " ".join(f"{k + ' ms':>11}" for k in KINDS)
              + f" {'noise ms':>8} {'floor/keras':>11} {'proj/floor':>10} {'kdp/floor':>9}"
              + f" {'kdp-noise/floor':>15}")
    if args.memory:
        header += " " + " ".join(f"{k + ' MB':>11}" for k in KINDS)
    print(header)
    for net in args.nets:
        for batch in args.batches if net == "mlp" else args.conv_batches:
            steps = args.steps or max(10, (40960 if net == "mlp" else 2560) // batch)
            times, noise = time_kinds(net, batch, steps, args.rounds, KINDS)
            med = {k: statistics.median(v) for k, v in times.items()}
            floor = med["floor"]
            line = (f"{net:>4} {batch:5d} " + " ".join(f"{1e3 * med[k]:11.2f}" for k in KINDS)
                    + f" {1e3 * noise:8.2f} {floor / med['keras']:11.2f}"
                    f" {med['kdp proj'] / floor:10.2f} {med['kdp'] / floor:9.2f}"
                    f" {(med['kdp'] - noise) / floor:15.2f}")
            if args.memory:
                line += " " + " ".join(f"{memory(k, net, batch, steps, args.memory_fits):11.0f}" for k in KINDS)
            print(line, flush=True)


if __name__ == "__main__":
    main()
