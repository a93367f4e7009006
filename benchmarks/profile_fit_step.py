"""Where the wall time of kdp's Clipless ``fit`` goes, per step (a diagnostic for accelerators).

Trains the MLP of `bench_clipless_step.py` (784→512→512→10, `DP_ReLU`, per-layer
noise) at one batch size and prints, per step of a ``fit`` of ``--steps`` steps
after warm-up: the wall time; the same with every kernel's constraint removed
(no certified projection: a timing experiment only, the bounds no longer hold);
and the host functions that take the most time in a `cProfile` of the first
``fit`` (cumulative and own time). A per-step cost that stays when the
projections are gone, and sits in a host function, is host overhead; one that
goes with them is the projection's kernels.

    KERAS_BACKEND=jax python benchmarks/profile_fit_step.py [--batch 1024] [--steps 40]
"""

import argparse
import cProfile
import io
import os
import pstats
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def _per_step(model, x, y, steps):
    start = time.perf_counter()
    model.fit(x, y, epochs=1, steps_per_epoch=steps, verbose=0)
    return (time.perf_counter() - start) / steps * 1000


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    import keras
    import numpy as np
    from _common import clipless_mlp

    n = max(4 * args.batch, 8192)
    rng = np.random.default_rng(0)
    x = rng.random((n, 784), dtype="float32")
    y = rng.integers(0, 10, n).astype("int32")
    model = clipless_mlp(n, args.batch, activation="relu")
    model.fit(x, y, epochs=1, steps_per_epoch=12, verbose=0)  # compile
    profile = cProfile.Profile()
    profile.enable()
    profiled = _per_step(model, x, y, args.steps)
    profile.disable()
    timed = _per_step(model, x, y, args.steps)
    print(f"backend={keras.backend.backend()} batch={args.batch}: kdp fit {timed:.2f} ms/step "
          f"({profiled:.2f} under cProfile)")
    constrained = [v for v in model.trainable_variables if v.constraint is not None]
    for v in constrained:
        v._constraint = None
    model.fit(x, y, epochs=1, steps_per_epoch=12, verbose=0)  # recompile without them
    print(f"without the {len(constrained)} constraints: {_per_step(model, x, y, args.steps):.2f} "
          "ms/step")
    for key in ("cumulative", "tottime"):
        out = io.StringIO()
        pstats.Stats(profile, stream=out).sort_stats(key).print_stats(args.top)
        print(f"\n-- cProfile of one fit of {args.steps} steps, by {key} --")
        print("\n".join(line[:160] for line in out.getvalue().splitlines()[4:]))


if __name__ == "__main__":
    main()
