"""Time and peak memory of one training step: plain Keras vs kdp's Clipless DP-SGD.

The MLP 784→512→512→10 is trained (a) with plain Keras (`Dense` + ReLU, SGD,
sparse categorical cross-entropy, shuffled fixed-size batches) and (b) with kdp
(`DP_BoundedInput`, `DP_QuickSpectralDense`, a `DP_Sequential` with per-layer
noise, Poisson batches, SGD, τ-cross-entropy) at batch sizes 256, 1024 and
4096, on the backend of ``KERAS_BACKEND`` (run the script once per backend).
kdp is timed three ways:

* ``kdp relu``: the same architecture as (a) (`DP_ReLU`), so the ratio is the
  price of privacy: projections, noise, Poisson padding, bookkeeping;
* ``kdp gs``: with `DP_GroupSort(2)` (what the tutorials use for accuracy), so
  the activation's own cost shows as the difference with ``kdp relu``;
* ``kdp relu 1-shape``: ``DPParameters(batch_shapes=1)``, every Poisson batch
  padded to the capacity ``b + 6√b + 8`` (kdp ≤ 0.1's only mode).

Each configuration runs in its **own subprocess**, so that its peak memory is
that process's peak RSS (`_common.peak_rss_mb`, which also sees XLA/TensorFlow's
C++ allocators); the baseline RSS after the imports (kdp included, for both
kinds) is subtracted.

Time (`_common.fit_step_time`): a ``fit`` of ``--warmup`` steps and one
`train_on_batch` per padded Poisson size compile everything, then the wall time
of one ``fit`` of ``--steps`` steps (plain Keras: whole epochs, at least
``--steps`` steps) divided by its number of steps. That is the throughput a
user sees, with drawing and padding the Poisson batches, the noise and the
projections. Neither kind passes a callback with a batch-end hook: kdp's own
callbacks are ``async_safe``, so on JAX Keras dispatches batch ends
asynchronously for both, as in a user's ``fit``. A per-step callback timer
would turn that off (the host would wait for every step) and would miss the
host's work between two steps. Ratios are kdp / Keras measured in the same
run; ``--json PATH`` also writes the numbers.

    KERAS_BACKEND=jax python benchmarks/bench_clipless_step.py [--batches 256 1024 4096]
"""

import argparse
import json
import os
import subprocess
import sys

KINDS = {  # name -> kdp options (None: plain Keras)
    "keras": None,
    "kdp relu": dict(activation="relu"),
    "kdp gs": dict(activation="groupsort"),
    "kdp relu 1-shape": dict(activation="relu", batch_shapes=1),
}


def child(kind, batch, steps, warmup):
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import keras
    import numpy as np
    from _common import clipless_mlp, fit_step_time, peak_rss_mb

    import kdp  # noqa: F401  (imported by both kinds, so that the base RSS counts it)

    base = peak_rss_mb()
    n = max(4 * batch, 8192)
    rng = np.random.default_rng(0)
    x = rng.random((n, 784), dtype="float32")
    y = rng.integers(0, 10, n).astype("int32")
    options = KINDS[kind]
    if options is None:
        model = keras.Sequential([
            keras.Input((784,)), keras.layers.Dense(512, activation="relu"),
            keras.layers.Dense(512, activation="relu"), keras.layers.Dense(10),
        ])
        model.compile(optimizer=keras.optimizers.SGD(0.01),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    else:
        model = clipless_mlp(n, batch, **options)
    elapsed = fit_step_time(model, x, y, batch, steps, warmup)
    print(json.dumps({"time": elapsed, "peak_mb": peak_rss_mb(), "base_mb": base}))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=12)
    parser.add_argument("--batches", type=int, nargs="+", default=[256, 1024, 4096])
    parser.add_argument("--kinds", nargs="+", default=list(KINDS)[1:], help="kdp variants to time")
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--child", nargs=2)
    args = parser.parse_args()
    if args.child:
        child(args.child[0], int(args.child[1]), args.steps, args.warmup)
        return
    import keras

    devices = {"jax": lambda: __import__("jax").devices()[0].device_kind}.get(keras.backend.backend(), lambda: "")
    print(f"backend={keras.backend.backend()} {devices()}  MLP 784-512-512-10, wall time of one fit / its steps "
          f"(kdp {args.steps} steps after {args.warmup} warm-up steps)")
    names = [k for k in args.kinds if k != "keras"]
    print(f"{'batch':>6} {'keras ms':>9} " + " ".join(f"{n + ' ms':>18}" for n in names)
          + "  " + " ".join(f"{'x ' + n:>16}" for n in names)
          + f" {'keras MB':>9} {names[0] + ' MB':>12} (peak RSS - base)")
    rows = []
    for batch in args.batches:
        res = {}
        for kind in ["keras"] + names:
            out = subprocess.run([sys.executable, __file__, "--child", kind, str(batch), "--steps",
                                  str(args.steps), "--warmup", str(args.warmup)],
                                 capture_output=True, text=True)
            if out.returncode:
                sys.exit(f"{kind} at b={batch} failed:\n{out.stderr[-3000:]}")
            res[kind] = json.loads(out.stdout.strip().splitlines()[-1])
        k = res["keras"]
        print(f"{batch:6d} {1e3 * k['time']:9.2f} "
              + " ".join(f"{1e3 * res[n]['time']:18.2f}" for n in names) + "  "
              + " ".join(f"{res[n]['time'] / k['time']:16.2f}" for n in names)
              + f" {k['peak_mb'] - k['base_mb']:9.0f} {res[names[0]]['peak_mb'] - res[names[0]]['base_mb']:12.0f}",
              flush=True)
        rows.append({"batch": batch, **res})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"backend": keras.backend.backend(), "device": devices(), "steps": args.steps,
                       "warmup": args.warmup, "unit": "seconds per step; MB", "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
