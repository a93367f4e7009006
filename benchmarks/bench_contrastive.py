"""Time and peak memory of one contrastive gradient step against the batch size n.

Strategies: ``logit-dp`` (exact per-pair norms from per-example Jacobians + one
reweighted backward pass), ``naive`` (batch-gradient clipping), ``clipless``
(analytic per-pair bound, plain gradient) and ``brute-force`` (every per-pair
gradient materialised, clipped and recombined: the reference of Kong et al.).

Each (strategy, n) runs in a fresh subprocess: the time is the median of
``--reps`` compiled calls after one warm-up call (which compiles), and the peak
memory is the growth of the process's peak RSS during those calls (the
framework's own footprint and the compilation are excluded). The encoder is the
digits notebook's: 64 → 32 → GroupSort → 8 (2 304 parameters).

Usage::

    KERAS_BACKEND=jax python benchmarks/bench_contrastive.py [--sizes 16 32 64 128 256] [--reps 5]
"""

import argparse
import json
import os
import subprocess
import sys
import time

STRATEGIES = ("logit-dp", "naive", "clipless", "brute-force")


def run_one(strategy, n, reps):

    import keras
    import numpy as np
    from keras import ops

    from _common import peak_rss_mb

    from kdp.contrastive import ContrastiveTrainer, PairGradients, _backend
    from kdp.layers import DP_BoundedInput, DP_GroupSort, DP_SpectralDense
    from kdp.losses.contrastive import DP_InfoNCE

    keras.utils.set_random_seed(0)
    enc = keras.Sequential([DP_BoundedInput((64,), upper_bound=1.0), DP_SpectralDense(32),
                            DP_GroupSort(2), DP_SpectralDense(8)])
    enc.build((None, 64))
    loss = DP_InfoNCE(1.0, norm_floor=0.3)
    rng = np.random.default_rng(0)
    x = rng.random((n, 64)).astype("float32")
    xp = rng.random((n, 64)).astype("float32")
    mask = np.ones(n, "float32")
    clip = 0.1
    if strategy == "brute-force":
        engine = PairGradients(enc, loss)

        def brute(p, o, x, xp, m):
            S = engine.similarities(p, o, x, xp)
            T = loss.coefficients(S, m)
            grads = engine.pair_gradients(p, o, x, xp)
            sq = sum(ops.sum(ops.square(ops.reshape(g, (n, n, -1))), axis=-1) for g in grads)
            w = T * ops.minimum(1.0, clip / ops.maximum(ops.sqrt(sq), 1e-30))
            return [ops.einsum("ij,ij...->...", w, g) for g in grads]

        fn = _backend.jit(brute)
        params, others = engine.variables()
        call = lambda: fn(params, others, x, xp, mask)  # noqa: E731
    else:
        trainer = ContrastiveTrainer(enc, loss, strategy, batch_size=n, clip_norm=clip,
                                     noise_multiplier=1.0)
        fn = trainer._gradient_fn
        params, others = trainer.engine.variables()
        call = lambda: trainer.batch_gradient(x, xp, mask)[0]  # noqa: E731
    xla_mb = float("nan")
    if keras.backend.backend() == "jax":  # XLA's own count of the step's temporary buffers
        compiled = fn.lower(params, others, x, xp, mask).compile()
        xla_mb = compiled.memory_analysis().temp_size_in_bytes / 2 ** 20

    def block(out):
        return [np.asarray(g) for g in out]

    block(call())  # compile
    before = peak_rss_mb()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        block(call())
        times.append(time.perf_counter() - start)
    return {"strategy": strategy, "n": n, "ms": 1e3 * float(np.median(times)),
            "peak_mb": max(0.0, peak_rss_mb() - before), "xla_mb": xla_mb}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[16, 32, 64, 128, 256])
    parser.add_argument("--strategies", nargs="+", default=list(STRATEGIES))
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--max-brute", type=int, default=256,
                        help="largest n for the brute-force reference (memory n²·p)")
    parser.add_argument("--one", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print("RESULT " + json.dumps(run_one(args.one[0], int(args.one[1]), args.reps)))
        return
    import keras

    rows = []
    for n in args.sizes:
        for strategy in args.strategies:
            if strategy == "brute-force" and n > args.max_brute:
                continue
            out = subprocess.run([sys.executable, __file__, "--one", strategy, str(n),
                                  "--reps", str(args.reps)], capture_output=True, text=True,
                                 env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"})
            lines = [l for l in out.stdout.splitlines() if l.startswith("RESULT ")]
            if not lines:
                print(f"{strategy} n={n} failed:\n{out.stderr[-2000:]}", file=sys.stderr)
                continue
            rows.append(json.loads(lines[-1][7:]))
            r = rows[-1]
            print(f"  {r['strategy']:12s} n={r['n']:4d}  {r['ms']:9.1f} ms  {r['peak_mb']:8.1f} MB"
                  f"  xla temp {r['xla_mb']:8.2f} MB", file=sys.stderr)
    print(f"\nbackend {keras.backend.backend()}: ms = median time of one gradient step; "
          "MB = peak memory of the step (XLA temporary buffers on jax, peak-RSS growth on TF)")
    print(f"{'n':>5s} " + " ".join(f"{s:>24s}" for s in args.strategies))
    for n in args.sizes:
        cells = []
        for s in args.strategies:
            r = next((r for r in rows if r["n"] == n and r["strategy"] == s), None)
            mb = None if r is None else (r["xla_mb"] if r["xla_mb"] == r["xla_mb"] else r["peak_mb"])
            cells.append(f"{'-':>24s}" if r is None else f"{r['ms']:10.1f} ms {mb:9.2f} MB")
        print(f"{n:5d} " + " ".join(cells))


if __name__ == "__main__":
    main()
