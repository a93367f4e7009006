"""Run the whole test suite, in tiers, and print how long each took.

    python tests/run_suite.py [--workers N] [pytest options...]

Tiers (each a pytest run; the suite fails if one fails):

1. ``tensorflow``: every test not marked ``backend_independent``, on TensorFlow;
2. ``jax``: every test on JAX, those marked ``backend_independent`` (pure
   accounting, the docs site, the stored notebooks' figures, packaging, the
   import layering) included, so they run once (a tier of their own would pay
   pytest's start-up, some 25 s, again);

   in both, the docs pages' blocks and the notebooks alternate between the two
   backends, and the CLI's tests run on TensorFlow and, for JAX, in tier 3
   (``KDP_TEST_SPLIT=1``, `tests/_one_backend.py`);
3. ``jax without tensorflow``: the tests marked ``without_tensorflow`` (packaging,
   import, the CLI and its demo) in a simulated JAX-only installation
   (``KDP_TEST_WITHOUT_TENSORFLOW=1``, `tests/_without_tensorflow.py`).

JAX compiles every program with XLA, and compiling is most of a JAX test's time
(`JAX_SETTINGS`): the tiers run with XLA's cheaper optimisation (tests check
values, not speed) and share one persistent compilation cache, so the program a
test compiles again (a model of the same shape fitted anew, the same step in
another worker, a notebook or a launched process) is read back, not rebuilt.
Accounting (ε, σ's calibration) is a fifth of a training test's time on either
backend, the same in both tiers: they share kdp's store of accounting results
(``KDP_ACCOUNTING_CACHE_DIR``, `kdp.privacy.stored`). Both live in a temporary
folder removed at the end, or in the folder that variable names if set (then
kept).

``--workers`` (default 2, or 1 on a one-core machine) runs each tier on that
many pytest-xdist processes (``--dist loadgroup``: a module whose shared
fixtures train models stays on one worker, so they train once). Each tier
prints its `SLOWEST` tests. ``--tier NAME`` runs only that tier. Extra arguments
go to every pytest run.
"""

import argparse
import os
import subprocess
import sys
import tempfile
import time

#: each tier lists its slowest tests (setup and call), where its time goes
SLOWEST = 20
SPLIT = {"KDP_TEST_SPLIT": "1"}  # docs pages and notebooks on one backend each
TIERS = (
    ("tensorflow", {"KERAS_BACKEND": "tensorflow", **SPLIT}, ["-m", "not backend_independent"]),
    ("jax", {"KERAS_BACKEND": "jax", **SPLIT}, []),
    ("jax without tensorflow", {"KERAS_BACKEND": "jax", "KDP_TEST_WITHOUT_TENSORFLOW": "1", **SPLIT},
     ["-m", "without_tensorflow", "tests"]),
)

#: how the tiers run JAX (environment variables read by `jax.config`)
JAX_SETTINGS = {"JAX_DISABLE_MOST_OPTIMIZATIONS": "1",
                "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}
#: the caches every process of the run shares: variable -> its folder's name
CACHES = {"JAX_COMPILATION_CACHE_DIR": "jax", "KDP_ACCOUNTING_CACHE_DIR": "accounting"}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=min(2, os.cpu_count() or 1))
    parser.add_argument("--tier", action="append", choices=[name for name, _, _ in TIERS],
                        help="run only this tier (repeatable; default: all)")
    args, extra = parser.parse_known_args(argv)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    results = []
    with tempfile.TemporaryDirectory(prefix="kdp-test-caches-") as caches:
        shared = {**JAX_SETTINGS, **{variable: os.environ.get(variable) or os.path.join(caches, name)
                                     for variable, name in CACHES.items()}}
        for name, env, options in TIERS:
            if args.tier and name not in args.tier:
                continue
            results.append(_run_tier(name, {**shared, **env}, options, args.workers, extra, root))
    print("\ntier                       result   minutes")
    for name, code, seconds in results:
        print(f"{name:<26} {'passed' if code == 0 else 'FAILED':<8} {seconds / 60:7.1f}")
    print(f"{'total':<26} {'':<8} {sum(s for _, _, s in results) / 60:7.1f}")
    return 0 if all(code == 0 for _, code, _ in results) else 1


def _run_tier(name, env, options, workers, extra, root):
    """Run one tier's pytest; return ``(name, exit code, seconds)``."""
    parallel = ["-n", str(workers), "--dist", "loadgroup"] if workers > 1 else []
    command = [sys.executable, "-m", "pytest", "-q", f"--durations={SLOWEST}", *parallel, *options,
               *extra]
    print(f"\n=== {name}: {' '.join(f'{k}={v}' for k, v in env.items())} "
          f"{' '.join(command[1:])}", flush=True)
    start = time.perf_counter()
    code = subprocess.call(command, cwd=root, env={**os.environ, **env})
    return name, code, time.perf_counter() - start


if __name__ == "__main__":
    sys.exit(main())
