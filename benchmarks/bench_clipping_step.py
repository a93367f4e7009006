"""Time and peak memory of one training step: plain Keras, kdp clipless, kdp per-example clipping.

Two models:

* ``mlp``: 784→512→512→10;
* ``cnn``: 28×28×1 → Conv 3×3 32 → pool 2 → Conv 3×3 64 → pool 2 → Flatten → Dense 10;
* ``sepcnn`` (``--models sepcnn``; per-example clipping and plain Keras only): 28×28×1 →
  Conv 3×3 16 → DepthwiseConv 3×3 → SeparableConv 3×3 32 → pool 2 → SeparableConv 3×3 64
  (depth multiplier 2) → pool 2 → Flatten → Dense 10, the blocks of MobileNet and Xception;

each trained three ways:

* (a) ``keras``: plain Keras (Dense/Conv2D + ReLU, max pooling, SGD, sparse CE, ``shuffle=True``);
* (b) ``clipless``: kdp Clipless DP-SGD on the Lipschitz version (`DP_QuickSpectralDense`,
  `DP_QuickSpectralConv2D`, `DP_GroupSort`, `DP_ScaledL2NormPooling2D`), Poisson batches;
* (c) ``clipping``: kdp per-example clipping DP-SGD (`DPParameters(clipping_norm=1)`) on the
  model of (a), Poisson batches: the Dense and Conv2D layers are of registered
  kinds (`kdp.clipping.kinds`), whose per-example norms come from their inputs
  and output cotangents, with no per-example gradient of a whole model;
* (d) ``passes``: as (c) with every Poisson batch padded to one size (the
  capacity, the default with ``physical_batch_size``) and its clipped sum run in passes of at most
  ``--pass-rows`` rows (``physical_batch_size``), only over the passes that hold
  drawn rows: one compiled step.

Each configuration runs in its own subprocess, so its peak memory is that
process's peak RSS (`_common.peak_rss_mb`, which sees XLA/TensorFlow's
allocators) minus the RSS after the imports (kdp included, for every kind).

Time, as `bench_clipless_step.py` measures it (`_common.fit_step_time`): a
``fit`` of ``--warmup`` steps and one `train_on_batch` per padded Poisson size
compile everything, then the wall time of one ``fit`` of ``--steps`` steps
(plain Keras: whole epochs of shuffled batches, at least ``--steps`` steps)
divided by its number of steps; the median of ``--repeats`` such fits. That
is what a user sees, kdp's Poisson sampling and padding and the noise
included. No kind passes a callback with a batch-end hook, so on JAX Keras dispatches batch ends asynchronously for all
three, as in a user's ``fit``; a per-step callback timer would make the host
wait for every step, and would miss the host's work between two steps. kdp pads
a Poisson batch to the smallest of its static sizes that holds it
(`kdp.pipeline.poisson_batch_shapes`), so (b) and (c) process a few % more
rows than (a). The ratios are measured in the same run; ``--json PATH`` also
writes the numbers.

    KERAS_BACKEND=jax python benchmarks/bench_clipping_step.py [--models mlp cnn] [--batches 256 1024 4096] [--steps 20] [--cores 1]
        [--kinds keras clipless clipping passes] [--pass-rows 32]
    KERAS_BACKEND=jax python benchmarks/bench_clipping_step.py --digits   # accuracy at ε = 1, 3, 8
"""

import argparse
import json
import os
import subprocess
import sys

from _runs import add_cores_argument, use_cores

BATCHES = (256, 1024, 4096)
KINDS = ("keras", "clipless", "clipping", "passes")


def build(model_name, kind, n, batch, pass_rows=32):
    import keras

    import kdp
    from kdp import layers, losses

    scce = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    if kind == "clipless":
        if model_name == "sepcnn":
            raise ValueError("sepcnn has no Lipschitz twin: run it with --kinds keras clipping passes")
        if model_name == "mlp":
            stack = [layers.DP_BoundedInput((784,), 10.0), layers.DP_QuickSpectralDense(512),
                     layers.DP_GroupSort(2), layers.DP_QuickSpectralDense(512), layers.DP_GroupSort(2),
                     layers.DP_QuickSpectralDense(10)]
            shape = (784,)
        else:
            stack = [layers.DP_BoundedInput((28, 28, 1), 28.0),
                     layers.DP_QuickSpectralConv2D(32, (3, 3)), layers.DP_GroupSort(2),
                     layers.DP_ScaledL2NormPooling2D((2, 2)),
                     layers.DP_QuickSpectralConv2D(64, (3, 3)), layers.DP_GroupSort(2),
                     layers.DP_ScaledL2NormPooling2D((2, 2)),
                     layers.DP_Flatten(), layers.DP_QuickSpectralDense(10)]
            shape = (28, 28, 1)
        model = kdp.DP_Sequential(stack, dp_parameters=kdp.DPParameters("per-layer", 1.0, 1e-5),
                                  dataset_metadata=kdp.DatasetMetadata(shape, 10, n, batch))
        model.compile(optimizer=keras.optimizers.SGD(0.01), loss=losses.DP_TauCategoricalCrossentropy(1.0))
        return model, shape
    if model_name == "mlp":
        stack = [keras.Input((784,)), keras.layers.Dense(512, activation="relu"),
                 keras.layers.Dense(512, activation="relu"), keras.layers.Dense(10)]
        shape = (784,)
    elif model_name == "sepcnn":
        stack = [keras.Input((28, 28, 1)), keras.layers.Conv2D(16, 3, activation="relu"),
                 keras.layers.DepthwiseConv2D(3, activation="relu"),
                 keras.layers.SeparableConv2D(32, 3, activation="relu"), keras.layers.MaxPooling2D(),
                 keras.layers.SeparableConv2D(64, 3, depth_multiplier=2, activation="relu"),
                 keras.layers.MaxPooling2D(), keras.layers.Flatten(), keras.layers.Dense(10)]
        shape = (28, 28, 1)
    else:
        stack = [keras.Input((28, 28, 1)), keras.layers.Conv2D(32, 3, activation="relu"),
                 keras.layers.MaxPooling2D(), keras.layers.Conv2D(64, 3, activation="relu"),
                 keras.layers.MaxPooling2D(), keras.layers.Flatten(), keras.layers.Dense(10)]
        shape = (28, 28, 1)
    if kind == "keras":
        model = keras.Sequential(stack)
    else:
        passes = {"physical_batch_size": pass_rows} if kind == "passes" else {}
        model = kdp.DP_Sequential(stack, dp_parameters=kdp.DPParameters(noise_multiplier=1.0, delta=1e-5,
                                                                         clipping_norm=1.0, **passes),
                                  dataset_metadata=kdp.DatasetMetadata(shape, 10, n, batch))
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss=scce)
    return model, shape


def child(model_name, kind, batch, steps, warmup, repeats, pass_rows):
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import numpy as np
    from _common import fit_step_time, peak_rss_mb

    import kdp  # noqa: F401  (imported by every kind, so that the base RSS counts it)

    base = peak_rss_mb()
    n = max(4 * batch, 8192)
    model, shape = build(model_name, kind, n, batch, pass_rows)
    rng = np.random.default_rng(0)
    x = rng.random((n,) + shape, dtype="float32")
    y = rng.integers(0, 10, n).astype("int32")
    elapsed = fit_step_time(model, x, y, batch, steps, warmup, repeats)
    print(json.dumps({"time": elapsed, "peak_mb": peak_rss_mb() - base}))


def speed(args):
    import keras

    device = {"jax": lambda: __import__("jax").devices()[0].device_kind}.get(keras.backend.backend(), str)()
    cores = f" on {args.cores} CPU(s)" if args.cores else ""
    print(f"backend={keras.backend.backend()} {device}{cores}  wall time of one fit / its steps (kdp {args.steps} "
          f"steps after {args.warmup} warm-up steps, median of {args.repeats} fits); memory = peak RSS - RSS after imports")
    kinds = ["keras"] + [k for k in args.kinds if k != "keras"]
    print(f"{'model':>5} {'batch':>6} | " + " ".join(f"{k + ' ms':>11}" for k in kinds) + " | "
          + " ".join(f"{k + '/keras':>15}" for k in kinds[1:]) + " | " + " ".join(f"{'MB ' + k:>11}" for k in kinds))
    rows = []
    for model_name in args.models:
        for batch in args.batches:
            res = {}
            for kind in kinds:
                cmd = [sys.executable, __file__, "--child", model_name, kind, str(batch),
                       "--steps", str(args.steps), "--warmup", str(args.warmup),
                       "--repeats", str(args.repeats), "--pass-rows", str(args.pass_rows)]
                try:
                    out = subprocess.run(cmd + ([f"--cores={args.cores}"] if args.cores else []),
                                         capture_output=True, text=True, timeout=args.timeout)
                except subprocess.TimeoutExpired:
                    sys.stderr.write(f"{model_name} {kind} b={batch}: over {args.timeout} s\n")
                    res[kind] = None
                    continue
                if out.returncode:
                    res[kind] = None
                    sys.stderr.write(out.stderr[-2000:])
                else:
                    res[kind] = json.loads(out.stdout.strip().splitlines()[-1])
            t = {k: (r["time"] * 1e3 if r else float("nan")) for k, r in res.items()}
            m = {k: (r["peak_mb"] if r else float("nan")) for k, r in res.items()}
            print(f"{model_name:>5} {batch:6d} | " + " ".join(f"{t[k]:11.1f}" for k in kinds) + " | "
                  + " ".join(f"{t[k] / t['keras']:7.2f}, {m[k] / m['keras']:5.2f}x" for k in kinds[1:]) + " | "
                  + " ".join(f"{m[k]:11.0f}" for k in kinds), flush=True)
            rows.append({"model": model_name, "batch": batch, **res})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"backend": keras.backend.backend(), "device": device, "steps": args.steps,
                       "warmup": args.warmup, "unit": "seconds per step; MB above the RSS after imports",
                       "rows": rows}, f, indent=1)


def digits(args):
    """Per-example clipping on an ordinary Dense+ReLU MLP, sklearn digits, ε = 1, 3, 8."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import keras
    import numpy as np
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    import kdp
    from kdp import accounting

    delta = 1e-5
    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype("float32")
    x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=0.2, stratify=y, random_state=0)
    n = len(x_tr)
    batch, epochs, lr, clip = args.digits_batch, args.digits_epochs, args.digits_lr, args.digits_clip
    steps = epochs * -(-n // batch)
    print(f"backend={keras.backend.backend()} digits N_train={n} N_test={len(x_te)} delta={delta} "
          f"MLP 64-256-10 ReLU, b={batch} epochs={epochs} SGD(lr={lr}, momentum 0.9) C={clip}")
    print(f"{'eps':>4} {'sigma':>7} {'final eps':>9} {'acc (mean of seeds)':>20}")
    for epsilon in (1.0, 3.0, 8.0):
        sigma = accounting.calibrate_noise_multiplier(epsilon, batch / n, steps, delta)
        accs = []
        for seed in args.seeds:
            keras.utils.set_random_seed(seed)
            model = kdp.DP_Sequential(
                [keras.Input((64,)), keras.layers.Dense(256, activation="relu"), keras.layers.Dense(10)],
                dp_parameters=kdp.DPParameters(noise_multiplier=sigma, delta=delta, clipping_norm=clip),
                dataset_metadata=kdp.DatasetMetadata((64,), 10, n, batch),
            )
            model.compile(optimizer=keras.optimizers.SGD(lr, momentum=0.9),
                          loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
            model.fit(x_tr, y_tr.astype("int32"), epochs=epochs, verbose=0)
            eps, _ = model.privacy_spent()
            assert eps <= epsilon + 1e-6, (eps, epsilon)
            accs.append(float(np.mean(np.argmax(model.predict(x_te, verbose=0), -1) == y_te)))
        print(f"{epsilon:4.0f} {sigma:7.3f} {eps:9.3f} {np.mean(accs):12.4f} ± {np.std(accs):.4f}", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3, help="timed fits per kind; their median time is reported")
    parser.add_argument("--models", nargs="+", default=["mlp", "cnn"])
    parser.add_argument("--batches", nargs="+", type=int, default=list(BATCHES))
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--json", help="also write the timing results to this file")
    parser.add_argument("--kinds", nargs="+", choices=KINDS, default=["keras", "clipless", "clipping"])
    parser.add_argument("--pass-rows", "--pass_rows", type=int, default=32,
                        help="the rows of one per-example pass of the passes kind")
    parser.add_argument("--child", nargs=3)
    add_cores_argument(parser)
    parser.add_argument("--digits", action="store_true")
    parser.add_argument("--digits-batch", type=int, default=256)
    parser.add_argument("--digits-epochs", type=int, default=30)
    parser.add_argument("--digits-lr", type=float, default=0.5)
    parser.add_argument("--digits-clip", type=float, default=1.0)
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    args = parser.parse_args()
    if args.child:
        use_cores(args.cores)
        child(args.child[0], args.child[1], int(args.child[2]), args.steps, args.warmup, args.repeats,
              args.pass_rows)
    elif args.digits:
        digits(args)
    else:
        speed(args)


if __name__ == "__main__":
    main()
