"""Steps per second of data-parallel Clipless DP-SGD on 1, 2 and 4 devices.

The MLP 784→512→512→10 of `bench_clipless_step.py` (`DP_QuickSpectralDense` +
`DP_GroupSort`, per-layer noise, Poisson batches of expected size ``--batch``)
is trained with ``fit`` on ``R`` devices:

* JAX: ``R`` virtual CPU devices (``XLA_FLAGS=--xla_force_host_platform_device_count=R``)
  and `keras.distribution.DataParallel`; on a GPU machine, the real devices;
* TensorFlow: ``R`` logical CPU devices (`tf.config.set_logical_device_configuration`)
  and `tf.distribute.MirroredStrategy`;
* ``R = 1``: no distribution at all (the plain single-device path).

Device counts are fixed when the backend starts, so each configuration runs in
its own subprocess. Time: ``fit`` over 3 warm-up steps (compilation), then the
median per-step wall time over ``--steps`` steps (a callback; it includes the
Poisson draw, the sharding, the noise, the all-reduce and the projections).

Virtual CPU devices share the machine's cores: on a CPU they measure the
overhead of the data-parallel machinery, not a speed-up (``nproc`` is printed).

    python benchmarks/bench_distributed.py                    # both backends
    python benchmarks/bench_distributed.py --backend jax --devices 1 2 4 --batch 1024
"""

import argparse
import json
import os
import subprocess
import sys


def child(backend, devices, batch, steps):
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
    if backend == "tensorflow" and devices > 1:
        import tensorflow as tf

        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * devices)
    import contextlib

    import keras
    from _common import StepTimer, clipless_mlp
    import numpy as np

    import kdp

    if devices == 1:
        scope, kind = contextlib.nullcontext(), "none"
    elif backend == "jax":
        import jax

        gpus = [d for d in jax.devices() if d.platform != "cpu"]
        pool = gpus if len(gpus) >= devices else jax.devices("cpu")
        scope = keras.distribution.DataParallel(devices=pool[:devices]).scope()
        kind = f"DataParallel ({pool[0].platform})"
    else:
        names = [d.name for d in tf.config.list_logical_devices("GPU")][:devices]
        if len(names) < devices:
            names = [d.name for d in tf.config.list_logical_devices("CPU")][:devices]
        scope = tf.distribute.MirroredStrategy(names).scope()
        kind = f"MirroredStrategy ({'GPU' if 'GPU' in names[0] else 'CPU'})"

    n = max(8 * batch, 8192)
    rng = np.random.default_rng(0)
    x = rng.random((n, 784), dtype="float32")
    y = rng.integers(0, 10, n).astype("int32")
    with scope:
        model = clipless_mlp(n, batch)
        model.fit(x, y, epochs=1, steps_per_epoch=3, verbose=0)  # compile
        timer = StepTimer()
        model.fit(x, y, epochs=1, steps_per_epoch=steps, verbose=0, callbacks=[timer])
        replicas = kdp.distribute.num_replicas(model)
    step = timer.median()
    print("RESULT " + json.dumps({"backend": backend, "devices": devices, "replicas": replicas,
                                  "engine": kind, "batch": batch, "step_ms": 1e3 * step,
                                  "steps_per_s": 1.0 / step}))


def run(backend, devices, batch, steps):
    env = dict(os.environ, KERAS_BACKEND=backend, TF_CPP_MIN_LOG_LEVEL="3")
    if backend == "jax":
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={devices}").strip()
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", backend, str(devices),
                           str(batch), str(steps)], env=env, capture_output=True, text=True)
    lines = [t for t in proc.stdout.splitlines() if t.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise RuntimeError(f"{backend} on {devices} devices failed:\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=["jax", "tensorflow", "both"], default="both")
    parser.add_argument("--devices", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--batch", type=int, default=256, help="expected (global) batch size b")
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    backends = ["jax", "tensorflow"] if args.backend == "both" else [args.backend]
    print(f"MLP 784-512-512-10, Poisson batches of expected size {args.batch}, "
          f"median of {args.steps} steps, {os.cpu_count()} CPU cores")
    print(f"{'backend':<11} {'devices':>7} {'engine':<26} {'ms/step':>9} {'steps/s':>8} {'vs 1':>6}")
    for backend in backends:
        base = None
        for devices in args.devices:
            r = run(backend, devices, args.batch, args.steps)
            assert r["replicas"] == devices, r
            base = base or r["steps_per_s"]
            print(f"{backend:<11} {devices:>7} {r['engine']:<26} {r['step_ms']:>9.2f} "
                  f"{r['steps_per_s']:>8.1f} {r['steps_per_s'] / base:>5.2f}x", flush=True)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))
    else:
        main()
