"""External baselines of the recipe suite, on `suite_data`'s datasets.

For every dataset, ε ∈ {1, 3, 8} and seeds {0, 1, 2}, with the suite's split and
its one scoring function (`suite_data.scores`: accuracy and AUROC):

* ``logreg`` / ``mlp`` (non-private, ε = null; this python): scikit-learn
  ``LogisticRegression(max_iter=1000)`` and ``MLPClassifier((128,), max_iter=300)``,
  ``random_state=seed``, on the same [0, 1]-mapped, flattened features.
* ``diffprivlib_logreg`` (``--dplib-python``): IBM diffprivlib's
  ``LogisticRegression(epsilon=ε, data_norm=max_norm, random_state=seed)``, other
  arguments at their defaults. Pure ε-DP (δ = 0): a *stricter* guarantee than the
  (ε, δ) of the others. Multiclass is one-vs-rest with ε / nb_classes each.
* ``jaxprivacy_mlp`` / ``jaxprivacy_mlp_lr10`` (``--jaxprivacy-python``): Google
  DeepMind's jax-privacy 2.x Keras API (``jax_privacy.keras_api.make_private``), one
  untuned config at two learning rates: flatten
  → Dense(128, relu) → Dense(nb_classes) logits, per-example clipping C = 1
  (``rescale_to_unit_norm`` at its default, True), expected batch size
  b = min(256, N_train // 4) with its Poisson sampling (``poisson_sampling_in_fit``),
  20 epochs of ⌊N_train / b⌋ steps, Adam(1e-3) (Keras' default) or Adam(1e-2) (the
  rate of kdp's image recipes), σ calibrated by its own PLD
  accountant for (ε, δ = `suite_data.delta_for(N_train)`).

diffprivlib needs scikit-learn < 1.7 and jax-privacy needs its own jax / keras, so
each runs in its own venv; the child runs this same file with ``--worker`` and
prints one JSON object a line on stdout. All records go to
``benchmarks/results/suite_baselines.json``: a list of ``{dataset, method,
epsilon, seed, accuracy, auroc, seconds, note}`` (``seconds``: fit + predict of
that run; a run that could not be done has null scores and says why in ``note``).

Set up the venvs once (Python 3.11; jax-privacy 2.0.0 does not pull keras, and
`suite_data` needs scikit-learn in both)::

    python -m venv /tmp/dplenv && /tmp/dplenv/bin/pip install "scikit-learn<1.7" diffprivlib numpy
    python -m venv /tmp/jpenv && /tmp/jpenv/bin/pip install "jax-privacy>=2" keras scikit-learn

Run (from the repository root; 13.5 min wall on 2 CPU cores shared with other
jobs: 3.5 min non-private, whose MLP on gen_50k_3c is most of it, 6 s
diffprivlib, 10 min jax-privacy at 1e-3; its 1e-2 config on all 20 datasets
took 51 min more, 100-160 s a run on the 28×28 sets: each rate compiles its
own step)::

    python benchmarks/suite_baselines.py --dplib-python /tmp/dplenv/bin/python \\
        --jaxprivacy-python /tmp/jpenv/bin/python
    # options: --datasets ... --epsilons 1 3 8 --seeds 0 1 2 --parts nonprivate dplib
    #   jaxprivacy --jaxprivacy-datasets ... --merge (update the existing JSON: a new
    #   record replaces the old one of its dataset, method, ε and seed)

Without ``--dplib-python`` / ``--jaxprivacy-python`` that part is skipped (and
recorded as such). jax-privacy leaves gen_50k_3c out by default (time budget);
the committed JSON adds it with ``--parts jaxprivacy --jaxprivacy-datasets
gen_50k_3c --merge`` (4.4 min more). A jax-privacy run's ``seconds`` is mostly
XLA compilation on CPU (each new model re-traces its step, once per padded
Poisson batch shape): the first seed of a dataset × ε pays it, later seeds hit
a persistent compilation cache (``$SUITE_JAX_CACHE``, default
``$TMPDIR/suite_jax_cache``); steady state is ~5-10 ms a step. The scikit-learn
runs use one BLAS thread (``--threads``).
"""

import argparse
import dataclasses
import itertools
import json
import math
import os
import subprocess
import sys
import tempfile
import time
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import numpy as np  # noqa: E402

import suite_data  # noqa: E402

DEFAULT_OUT = os.path.join(HERE, "results", "suite_baselines.json")
EPSILONS = (1.0, 3.0, 8.0)
SEEDS = (0, 1, 2)
#: jax-privacy's config, run at two Adam learning rates (method name -> rate): Keras'
#: default 1e-3 (the "untuned" config) and 1e-2, the rate of kdp's image recipes, because
#: 1e-3 under-trains in 20 epochs (digits 0.36 at ε = 1; 1e-2 gave 0.86 in one probe run,
#: made before the other runs)
JP_EPOCHS = 20
JP_CLIP = 1.0
JP_LEARNING_RATES = {"jaxprivacy_mlp": 1e-3, "jaxprivacy_mlp_lr10": 1e-2}
#: left out of jax-privacy by default (time budget; ``--jaxprivacy-datasets`` adds it)
JP_DEFAULT_EXCLUDED = ("gen_50k_3c",)
PARTS = ("nonprivate", "dplib", "jaxprivacy")
METHODS = {"nonprivate": ("logreg", "mlp"), "dplib": ("diffprivlib_logreg",),
           "jaxprivacy": tuple(JP_LEARNING_RATES)}


def record(dataset, method, epsilon, seed, score=None, seconds=None, note=""):
    score = score or {}
    return {"dataset": dataset, "method": method,
            "epsilon": None if epsilon is None else float(epsilon), "seed": int(seed),
            "accuracy": score.get("accuracy"), "auroc": score.get("auroc"),
            "seconds": None if seconds is None else round(float(seconds), 3), "note": note}


def emit(rec):
    print(json.dumps(rec), flush=True)


# --- workers (each imports only what its venv has) ---------------------------------

def worker_nonprivate(datasets, epsilons, seeds):
    import sklearn
    from sklearn.exceptions import ConvergenceWarning
    from sklearn.linear_model import LogisticRegression
    from sklearn.neural_network import MLPClassifier

    warnings.filterwarnings("ignore", category=ConvergenceWarning)
    note = f"non-private; scikit-learn {sklearn.__version__}"
    for name in datasets:
        d = suite_data.load(name)
        x, x_test = d.flat_train(), d.flat_test()
        for method, make in (
                ("logreg", lambda s: LogisticRegression(max_iter=1000, random_state=s)),
                ("mlp", lambda s: MLPClassifier(hidden_layer_sizes=(128,), max_iter=300,
                                                random_state=s))):
            for seed in seeds:
                start = time.perf_counter()
                clf = make(seed).fit(x, d.y_train)
                proba = clf.predict_proba(x_test)
                seconds = time.perf_counter() - start
                emit(record(name, method, None, seed, suite_data.scores(d.y_test, proba, d.nb_classes),
                            seconds, note))


def worker_dplib(datasets, epsilons, seeds):
    import diffprivlib
    import sklearn
    from diffprivlib.models import LogisticRegression

    warnings.filterwarnings("ignore")
    for name in datasets:
        d = suite_data.load(name)
        x, x_test = d.flat_train(), d.flat_test()
        note = (f"pure eps-DP (delta=0, stricter); data_norm={d.max_norm:.4f}; diffprivlib "
                f"{diffprivlib.__version__}, scikit-learn {sklearn.__version__}")
        for epsilon in epsilons:
            for seed in seeds:
                start = time.perf_counter()
                clf = LogisticRegression(epsilon=epsilon, data_norm=d.max_norm, random_state=seed)
                clf.fit(x, d.y_train)
                proba = clf.predict_proba(x_test)
                seconds = time.perf_counter() - start
                emit(record(name, "diffprivlib_logreg", epsilon, seed,
                            suite_data.scores(d.y_test, proba, d.nb_classes), seconds, note))


def jp_config(nb_train):
    """(batch size, steps per epoch, train steps) of jax-privacy's one config."""
    batch_size = min(256, nb_train // 4)
    steps_per_epoch = max(1, math.floor(nb_train / batch_size))
    return batch_size, steps_per_epoch, JP_EPOCHS * steps_per_epoch


def worker_jaxprivacy(datasets, epsilons, seeds, methods=tuple(JP_LEARNING_RATES)):
    os.environ["KERAS_BACKEND"] = "jax"
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import contextlib
    import io
    from importlib.metadata import version

    import jax
    import keras
    from jax_privacy import keras_api

    # Each run builds a new model, so Keras re-traces its train step; the HLO is the
    # same across seeds (the state is an argument), so a persistent compilation
    # cache turns the repeated XLA compiles (most of a small run's time on CPU)
    # into look-ups. Speed only: the computation is unchanged.
    cache = os.environ.get("SUITE_JAX_CACHE", os.path.join(tempfile.gettempdir(), "suite_jax_cache"))
    jax.config.update("jax_compilation_cache_dir", cache)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

    versions = (f"jax-privacy {version('jax-privacy')}, jax {jax.__version__}, "
                f"keras {keras.__version__}")
    for name in datasets:
        d = suite_data.load(name)
        x, x_test = d.flat_train(), d.flat_test()
        n = d.nb_train
        delta = suite_data.delta_for(n)
        batch_size, _, train_steps = jp_config(n)
        for epsilon in epsilons:  # σ depends on the config but not on the learning rate
            base = keras_api.DPKerasConfig(
                epsilon=epsilon, delta=delta, clipping_norm=JP_CLIP, batch_size=batch_size,
                gradient_accumulation_steps=1, train_steps=train_steps, train_size=n,
                poisson_sampling_in_fit=True)
            start = time.perf_counter()
            with contextlib.redirect_stdout(io.StringIO()):  # it prints its progress
                sigma = base.update_with_calibrated_noise_multiplier().noise_multiplier
            calibration = time.perf_counter() - start
            for method, seed in itertools.product(methods, seeds):
                learning_rate = JP_LEARNING_RATES[method]
                note = (f"delta={delta:g}; b={batch_size} (Poisson, expected), {JP_EPOCHS} "
                        f"epochs = {train_steps} steps, C={JP_CLIP}, Adam({learning_rate:g}), "
                        f"sigma={sigma:.4f} (its PLD calibration, {calibration:.1f}s once per "
                        f"dataset x eps, not in seconds); {versions}")
                try:
                    start = time.perf_counter()
                    keras.utils.set_random_seed(seed)
                    model = keras.Sequential([
                        keras.Input(shape=(d.nb_features,)),
                        keras.layers.Dense(128, activation="relu"),
                        keras.layers.Dense(d.nb_classes),
                    ])
                    params = dataclasses.replace(base, noise_multiplier=sigma, seed=seed)
                    model = keras_api.make_private(model, params)
                    model.compile(optimizer=keras.optimizers.Adam(learning_rate),
                                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
                    model.fit(x, d.y_train, epochs=JP_EPOCHS, batch_size=batch_size, verbose=0)
                    logits = model.predict(x_test, batch_size=1024, verbose=0)
                    seconds = time.perf_counter() - start
                    emit(record(name, method, epsilon, seed,
                                suite_data.scores(d.y_test, logits, d.nb_classes), seconds, note))
                except Exception as exc:  # record why, go on
                    emit(record(name, method, epsilon, seed, None, None,
                                f"failed: {type(exc).__name__}: {exc}"[:500]))


WORKERS = {"nonprivate": worker_nonprivate, "dplib": worker_dplib, "jaxprivacy": worker_jaxprivacy}


# --- driver ----------------------------------------------------------------------------

def run_child(python, part, datasets, epsilons, seeds, log, threads=1, methods=None):
    """Run ``part`` (its ``methods``, default all) in ``python``; return its records
    (or failure records)."""
    methods = methods or METHODS[part]
    cmd = [python, os.path.abspath(__file__), "--worker", part, "--datasets", *datasets,
           "--epsilons", *map(str, epsilons), "--seeds", *map(str, seeds)]
    if part == "jaxprivacy":
        cmd += ["--jaxprivacy-methods", *methods]
    env = dict(os.environ, PYTHONWARNINGS="ignore", TF_CPP_MIN_LOG_LEVEL="3")
    if part != "jaxprivacy":
        # scikit-learn's BLAS / OpenMP threads: one each (on a small shared CPU the
        # default oversubscribes: LogisticRegression on digits went from 0.1 s to 6 s)
        env.update({k: str(threads) for k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS",
                                               "MKL_NUM_THREADS")})
    records = []
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    for line in proc.stdout:
        line = line.strip()
        if line.startswith("{"):
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            records.append(rec)
            log(f"  {rec['dataset']:>13} {rec['method']:>18} eps={rec['epsilon']} seed={rec['seed']} "
                f"acc={rec['accuracy']} auroc={rec['auroc']} {rec['seconds']}s")
    stderr = proc.stderr.read()
    proc.wait()
    log(f"  [{part}] exit {proc.returncode} after {time.perf_counter() - start:.0f}s")
    if proc.returncode != 0:
        tail = stderr.strip().splitlines()[-3:]
        reason = f"{part} worker failed (exit {proc.returncode}): " + " | ".join(tail)
        log("  " + reason)
        done = {(r["method"], r["dataset"], r["epsilon"], r["seed"]) for r in records}
        for method in methods:
            for name in datasets:
                for eps in ([None] if part == "nonprivate" else epsilons):
                    for seed in seeds:
                        if (method, name, None if eps is None else float(eps), seed) not in done:
                            records.append(record(name, method, eps, seed, note=reason[:500]))
    return records


def skipped(part, datasets, epsilons, seeds, reason, methods=None):
    return [record(name, method, eps, seed, note=reason)
            for method in methods or METHODS[part] for name in datasets
            for eps in ([None] if part == "nonprivate" else epsilons) for seed in seeds]


def merge(path, records):
    """The records of ``path`` updated with ``records`` (same dataset, method, ε and
    seed: the new one wins, unless it is a skip and the old one has scores)."""
    def key(r):
        return r["dataset"], r["method"], r["epsilon"], r["seed"]

    with open(path) as f:
        merged = {key(r): r for r in json.load(f)}
    for r in records:
        old = merged.get(key(r))
        if r["accuracy"] is not None or old is None or old["accuracy"] is None:
            merged[key(r)] = r
    return list(merged.values())


def summary(records):
    """Mean ± sd over seeds per dataset × method × ε (a printable table)."""
    groups = {}
    for r in records:
        groups.setdefault((r["dataset"], r["method"], r["epsilon"]), []).append(r)
    order = {name: i for i, name in enumerate(suite_data.DATASETS)}
    methods = [m for part in PARTS for m in METHODS[part]]
    lines = [f"{'dataset':>13} {'method':>18} {'eps':>4} {'n':>2} {'accuracy':>15} "
             f"{'auroc':>15} {'s/run':>7}"]
    for key in sorted(groups, key=lambda k: (order.get(k[0], 99), methods.index(k[1])
                                             if k[1] in methods else 99, k[2] or 0)):
        rs = groups[key]
        ok = [r for r in rs if r["accuracy"] is not None]
        eps = "-" if key[2] is None else f"{key[2]:g}"
        if not ok:
            lines.append(f"{key[0]:>13} {key[1]:>18} {eps:>4} {0:>2}   {rs[0]['note'][:70]}")
            continue
        acc = np.array([r["accuracy"] for r in ok])
        auc = np.array([r["auroc"] for r in ok])
        sec = np.mean([r["seconds"] for r in ok])
        lines.append(f"{key[0]:>13} {key[1]:>18} {eps:>4} {len(ok):>2} "
                     f"{acc.mean():.3f} ± {acc.std(ddof=1) if len(ok) > 1 else 0:.3f}   "
                     f"{auc.mean():.3f} ± {auc.std(ddof=1) if len(ok) > 1 else 0:.3f} {sec:>7.2f}")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--datasets", nargs="+", default=list(suite_data.DATASETS),
                        choices=sorted(suite_data.DATASETS))
    parser.add_argument("--jaxprivacy-datasets", nargs="+", default=None,
                        choices=sorted(suite_data.DATASETS),
                        help="datasets for jax-privacy (default: --datasets less gen_50k_3c)")
    parser.add_argument("--jaxprivacy-methods", nargs="+", default=list(JP_LEARNING_RATES),
                        choices=list(JP_LEARNING_RATES),
                        help="jax-privacy's configs to run (default: both learning rates)")
    parser.add_argument("--epsilons", nargs="+", type=float, default=list(EPSILONS))
    parser.add_argument("--seeds", nargs="+", type=int, default=list(SEEDS))
    parser.add_argument("--parts", nargs="+", default=list(PARTS), choices=PARTS)
    parser.add_argument("--dplib-python", help="python of a venv with diffprivlib, scikit-learn<1.7")
    parser.add_argument("--jaxprivacy-python", help="python of a venv with jax-privacy>=2, keras")
    parser.add_argument("--threads", type=int, default=1,
                        help="BLAS / OpenMP threads of the scikit-learn and diffprivlib runs")
    parser.add_argument("--out", default=DEFAULT_OUT)
    parser.add_argument("--merge", action="store_true",
                        help="update the existing JSON instead of replacing it")
    parser.add_argument("--worker", choices=PARTS, help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.worker:
        extra = {"methods": args.jaxprivacy_methods} if args.worker == "jaxprivacy" else {}
        WORKERS[args.worker](args.datasets, args.epsilons, args.seeds, **extra)
        return

    def log(msg):
        print(msg, flush=True)

    start = time.perf_counter()
    records = []
    jp_datasets = args.jaxprivacy_datasets or [n for n in args.datasets
                                                if n not in JP_DEFAULT_EXCLUDED]
    not_in_jp = [n for n in args.datasets if n not in jp_datasets]
    for part in args.parts:
        log(f"[{part}]")
        datasets = jp_datasets if part == "jaxprivacy" else args.datasets
        python = {"nonprivate": sys.executable, "dplib": args.dplib_python,
                  "jaxprivacy": args.jaxprivacy_python}[part]
        methods = args.jaxprivacy_methods if part == "jaxprivacy" else METHODS[part]
        if python is None:
            records += skipped(part, datasets, args.epsilons, args.seeds,
                               f"skipped: no --{part}-python given", methods)
            continue
        records += run_child(python, part, datasets, args.epsilons, args.seeds, log, args.threads,
                             methods)
        if part == "jaxprivacy" and not_in_jp:
            records += skipped(part, not_in_jp, args.epsilons, args.seeds,
                               "not run: over the suite's CPU time budget (2,920 steps a run, "
                               "~30 s each on 2 shared cores); add it with --jaxprivacy-datasets",
                               args.jaxprivacy_methods)
    if args.merge and os.path.exists(args.out):
        records = merge(args.out, records)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(records, f, indent=1)
        f.write("\n")
    log("")
    log(summary(records))
    log(f"\n{len(records)} records -> {args.out}; wall {time.perf_counter() - start:.0f}s")


if __name__ == "__main__":
    main()
