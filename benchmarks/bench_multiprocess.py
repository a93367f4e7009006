"""Steps per second of Clipless DP-SGD trained by 1, 2 and 4 processes on this machine.

The MLP 784→512→512→10 of `bench_clipless_step.py` (per-layer noise, Poisson
batches of expected global size ``--batch``) is trained with ``fit`` by ``P``
processes on 127.0.0.1, each holding an equal shard of the N records and
sampling it at the global rate b/N:

* JAX: ``keras.distribution.initialize`` (CPU collectives over Gloo) and
  `keras.distribution.DataParallel` over one CPU device per process;
* TensorFlow: `tf.distribute.MultiWorkerMirroredStrategy`, one worker per process;
* ``P = 1``: one process, no distribution at all (the plain path).

Time: ``fit`` over 3 warm-up steps (compilation), then the median per-step wall
time of process 0 over ``--steps`` steps (a callback; it includes the Poisson
draw, on JAX the per-step agreement on the padded size, the noise, the
all-reduce and the projections).

All processes share this machine's cores: on a 2-core machine the numbers
measure the overhead of the multi-process machinery, not a speed-up (``nproc``
is printed). On several machines each process has its own cores.

    python benchmarks/bench_multiprocess.py                     # both backends
    python benchmarks/bench_multiprocess.py --backend jax --processes 1 2 --batch 1024
"""

import argparse
import json
import os
import socket
import subprocess
import sys


def child(backend, processes, rank, port, batch, steps):
    import contextlib

    if processes > 1 and backend == "jax":
        import jax

        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        import keras

        keras.distribution.initialize(f"127.0.0.1:{port}", processes, rank)
        keras.distribution.set_distribution(keras.distribution.DataParallel())
        scope, engine = contextlib.nullcontext(), "DataParallel + gloo"
    elif processes > 1:
        import tensorflow as tf

        scope, engine = tf.distribute.MultiWorkerMirroredStrategy().scope(), "MultiWorkerMirrored"
    else:
        scope, engine = contextlib.nullcontext(), "none"
    import numpy as np
    from _common import StepTimer, clipless_mlp

    n = max(8 * batch, 8192)
    rng = np.random.default_rng(0)
    x = rng.random((n, 784), dtype="float32")
    y = rng.integers(0, 10, n).astype("int32")
    shard = slice(rank * n // processes, (rank + 1) * n // processes)
    with scope:
        model = clipless_mlp(n, batch)
    model.fit(x[shard], y[shard], epochs=1, steps_per_epoch=3, verbose=0)  # compile
    timer = StepTimer()
    model.fit(x[shard], y[shard], epochs=1, steps_per_epoch=steps, verbose=0, callbacks=[timer])
    if rank == 0:
        step = timer.median()
        print("RESULT " + json.dumps({"engine": engine, "step_ms": 1e3 * step, "steps_per_s": 1.0 / step,
                                      "epsilon": model.privacy_spent()[0]}), flush=True)
    sys.stdout.flush()
    os._exit(0)


def run(backend, processes, batch, steps):
    sockets = [socket.socket() for _ in range(processes)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    procs = []
    for rank in range(processes):
        env = dict(os.environ, KERAS_BACKEND=backend, TF_CPP_MIN_LOG_LEVEL="3", CUDA_VISIBLE_DEVICES="")
        env["TF_CONFIG"] = json.dumps({"cluster": {"worker": [f"127.0.0.1:{p}" for p in ports]},
                                       "task": {"type": "worker", "index": rank}})
        procs.append(subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--child", backend, str(processes), str(rank),
             str(ports[0]), str(batch), str(steps)],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outputs = [p.communicate(timeout=900) for p in procs]
    lines = [t for t in outputs[0][0].splitlines() if t.startswith("RESULT ")]
    if any(p.returncode for p in procs) or not lines:
        raise RuntimeError(f"{backend} with {processes} processes failed:\n{outputs[0][1][-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=["jax", "tensorflow", "both"], default="both")
    parser.add_argument("--processes", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--batch", type=int, default=256, help="expected (global) batch size b")
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    backends = ["jax", "tensorflow"] if args.backend == "both" else [args.backend]
    print(f"MLP 784-512-512-10, Poisson batches of expected global size {args.batch}, median of "
          f"{args.steps} steps of process 0, {os.cpu_count()} CPU cores shared by all processes")
    print(f"{'backend':<11} {'processes':>9} {'engine':<20} {'ms/step':>9} {'steps/s':>8} "
          f"{'vs 1':>6} {'epsilon':>8}")
    for backend in backends:
        base = None
        for processes in args.processes:
            r = run(backend, processes, args.batch, args.steps)
            base = base or r["steps_per_s"]
            print(f"{backend:<11} {processes:>9} {r['engine']:<20} {r['step_ms']:>9.2f} "
                  f"{r['steps_per_s']:>8.1f} {r['steps_per_s'] / base:>5.2f}x {r['epsilon']:>8.4f}",
                  flush=True)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2], *map(int, sys.argv[3:8]))
    else:
        main()
