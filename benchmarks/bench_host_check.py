"""What the gate's run-time check costs a step: kdp's `fit` against the same `fit`
with the step's host check (`kdp.autodiff.host_check`) replaced by a constant 1.

The check is one host callback per executed step (JAX `io_callback`, TensorFlow
`tf.numpy_function`) that spends a credit of the step's plan in the gate. Both
variants run alternated in one process on the benchmark MLP (784→512→512→10,
per-layer noise), one epoch each per round, ``--rounds`` rounds; the table gives
the median over rounds of each epoch's median step time, and their ratio. Run it once per backend::

    KERAS_BACKEND=jax python benchmarks/bench_host_check.py
    KERAS_BACKEND=tensorflow python benchmarks/bench_host_check.py
"""

import argparse
import keras
import numpy as np

from _common import StepTimer, clipless_mlp


def step_times(model, x, y):
    """The median wall time of a step over one epoch of ``model.fit`` (`StepTimer`)."""
    timer = StepTimer()
    model.fit(x, y, epochs=1, verbose=0, callbacks=[timer])
    keras.ops.convert_to_numpy(model.trainable_variables[0])  # wait for the last step
    return timer.median()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--steps", type=int, default=40, help="steps per epoch")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    from kdp import autodiff

    checked = autodiff.host_check
    unchecked = lambda check, after: keras.ops.ones((), "float32")  # noqa: E731 (no gate check)
    rng = np.random.default_rng(0)
    print(f"backend {keras.backend.backend()}, {args.rounds} alternated rounds, median ms/step")
    print(f"{'b':>6} {'without check':>14} {'with check':>11} {'ratio':>6}")
    for b in args.batch:
        n = b * args.steps
        x = rng.uniform(0, 10 / 28, size=(n, 784)).astype("float32")
        y = rng.integers(0, 10, n)
        times = {"without": [], "with": []}
        models = {}
        for kind, fn in (("without", unchecked), ("with", checked)):
            autodiff.host_check = fn  # read when the step is traced
            models[kind] = clipless_mlp(n, b)
            models[kind].fit(x, y, epochs=1, verbose=0)  # traced with this variant
        autodiff.host_check = checked
        for round_ in range(args.rounds):  # alternated, each first in every other round
            for kind in (("without", "with") if round_ % 2 else ("with", "without")):
                times[kind].append(step_times(models[kind], x, y))
        without, with_ = (1e3 * float(np.median(times[k])) for k in ("without", "with"))
        print(f"{b:>6} {without:>14.2f} {with_:>11.2f} {with_ / without:>6.3f}")


if __name__ == "__main__":
    main()
