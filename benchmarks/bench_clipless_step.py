"""Time and peak memory of one training step: plain Keras vs kdp's Clipless DP-SGD.

The MLP 784→512→512→10 is trained (a) with plain Keras (`Dense` + ReLU, SGD,
sparse categorical cross-entropy) and (b) with kdp (`DP_BoundedInput`,
`DP_QuickSpectralDense` + `DP_GroupSort`, a `DP_Sequential` with per-layer noise,
Poisson batches, SGD, τ-cross-entropy), at batch sizes 256, 1024 and 4096, on the
backend of ``KERAS_BACKEND`` (run the script once per backend).

Each configuration runs in its **own subprocess**, so that its peak memory is
that process's max RSS (`resource.getrusage(RUSAGE_SELF).ru_maxrss`, which also
sees the memory of XLA/TensorFlow's C++ allocators that `tracemalloc` misses);
the baseline RSS after imports is reported too, so the step's own footprint is
``peak − base``. Time: ``fit`` over 3 warm-up steps (compilation), then the
median of per-step wall times over ``--steps`` steps measured by a callback
(includes kdp's Poisson batch drawing, the noise and the projections).

    KERAS_BACKEND=jax python benchmarks/bench_clipless_step.py
"""

import argparse
import json
import os
import subprocess
import sys

BATCHES = (256, 1024, 4096)


def child(kind, batch, steps):
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import resource

    import keras
    from _common import StepTimer, clipless_mlp
    import numpy as np


    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    n = max(4 * batch, 8192)
    rng = np.random.default_rng(0)
    x = rng.random((n, 784), dtype="float32")
    y = rng.integers(0, 10, n).astype("int32")
    if kind == "keras":
        model = keras.Sequential([
            keras.Input((784,)), keras.layers.Dense(512, activation="relu"),
            keras.layers.Dense(512, activation="relu"), keras.layers.Dense(10),
        ])
        model.compile(optimizer=keras.optimizers.SGD(0.01),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        fit = dict(batch_size=batch, shuffle=True)
    else:
        model = clipless_mlp(n, batch)
        fit = {}
    model.fit(x, y, epochs=1, steps_per_epoch=3, verbose=0, **fit)  # compile
    timer = StepTimer()
    model.fit(x, y, epochs=1, steps_per_epoch=steps, verbose=0, callbacks=[timer], **fit)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"time": timer.median(), "peak_mb": peak / 1024, "base_mb": base / 1024}))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--child", nargs=2)
    args = parser.parse_args()
    if args.child:
        child(args.child[0], int(args.child[1]), args.steps)
        return
    import keras

    print(f"backend={keras.backend.backend()}  MLP 784-512-512-10, median of {args.steps} steps")
    print(f"{'batch':>6} {'keras ms':>9} {'kdp ms':>9} {'ratio':>6} {'keras MB':>9} {'kdp MB':>9} (peak RSS - base)")
    for batch in BATCHES:
        res = {}
        for kind in ("keras", "kdp"):
            out = subprocess.run([sys.executable, __file__, "--child", kind, str(batch), "--steps", str(args.steps)],
                                 capture_output=True, text=True, check=True)
            res[kind] = json.loads(out.stdout.strip().splitlines()[-1])
        k, d = res["keras"], res["kdp"]
        print(f"{batch:6d} {1e3 * k['time']:9.2f} {1e3 * d['time']:9.2f} {d['time'] / k['time']:6.2f} "
              f"{k['peak_mb'] - k['base_mb']:9.0f} {d['peak_mb'] - d['base_mb']:9.0f}", flush=True)


if __name__ == "__main__":
    main()
