"""Training from data that is not in memory: a memmap and a folder of PNG files
through `kdp.RecordSource`, against the same model on in-memory arrays.

What it measures. The script writes, once, into a temporary folder (``--dir``):

* a synthetic float32 memmap of ``10^6`` rows × 784 features (≈ 3.1 GB; a
  class-dependent block of features is brighter) and its labels;
* ``50,000`` 28×28 grayscale PNG files (noise plus a bright square whose
  position is the class) and their labels.

It then trains two models built by `kdp.recipes.recipe` for 784 inputs and 10
classes (``kind="image"``, ε = 3, width forced to 512 and batch size forced to
``b = 1024`` whatever N; σ calibrated by the recipe's ``make_private`` over
the fewest whole epochs that hold twice the run's steps, so that calibrating is
quick and the budget never stops the run): a **Clipless** one and a
**clipping** one (per-example clipping), on each of

* ``memmap_1e6``: ``fit(x=np.memmap, y=labels)`` (kdp reads only the
  Poisson-sampled rows; the source's defaults: one reader and, on a CPU, no
  prefetch: each batch is read when its step asks for it);
* ``memmap_1e6_prefetch``: the same through ``kdp.RecordSource(memmap,
  labels=y, prefetch=True)`` (2 threads read up to 2 batches ahead, as on an
  accelerator);
* ``array_1e6``: the same 10^6 rows loaded into RAM (``np.fromfile``);
* ``memmap_1e4``: the first 10^4 rows of the same memmap (another N: its ε
  differs, it is only there for the memory target);
* ``png``: ``kdp.RecordSource(paths, labels=y, transform=decode_png)`` (the
  defaults: each sampled file opened and decoded with PIL by one reader, in the
  training process, no prefetch on a CPU);
* ``png_prefetch``: the same with ``prefetch=True``;
* ``png_processes``: the same (no prefetch) with ``readers=os.cpu_count(), processes=True``
  (the batch's files decoded by that many spawned worker processes; no
  prefetch on a CPU);
* ``png_array``: all PNG files decoded into one in-memory array first (by
  ``os.cpu_count()`` spawned processes, chunks of 500 files: PIL's decoding
  holds the GIL, threads would not help).

Each configuration runs in its **own subprocess** (``--one CONFIG MODEL``),
which reports:

* **steps/s**: ``--steps`` steps after ``--warmup`` steps, from the
  ``on_train_batch_begin`` of the first measured step to the end of `fit`;
  intervals longer than ``max(0.5 s, 5 × median)`` are XLA compilations of a
  padded batch size seen for the first time (kdp pads Poisson batches to 3
  static sizes) and are left out (their number is reported);
* **peak RssAnon**: anonymous resident memory (``/proc/self/status``
  ``RssAnon``, not the page cache or the mapped file: ``VmHWM`` would count
  those) sampled every 5 ms by a thread over the whole process, in MB; the
  value after the imports and the model's build (before any data) is given too;
  and the peak of the training process's plus its child processes' RssAnon
  (the reader or decoding worker processes and multiprocessing's resource
  tracker; their list is refreshed every 0.1 s);
* **time to first step**: from the moment the data is handed over (after the
  imports and the model's build and calibration) to the first
  ``on_train_batch_begin``. It includes, for the in-memory baselines, loading
  the arrays (``np.fromfile`` of 3.1 GB from the page cache, or decoding every
  PNG in ``os.cpu_count()`` spawned processes, their start included) and
  `fit`'s validation of the whole arrays; for the sources, opening the memmap /
  listing the files and `fit` reading and validating the first batch (for
  ``png_processes``, starting the worker processes too). It excludes the
  imports, the model's build and calibration, and the first step's
  compilation;
* **ε**: ``model.privacy_spent()`` after training (PLD, the recipe's
  accountant). The source and in-memory runs of the same N take the same steps
  with the same σ, so their ε must be identical.

The source and in-memory runs of one comparison run back to back
(interleaved: another job may share the machine), ``--repeats`` times (the
order reversed on odd repeats); ratios are taken within a repeat and their
median reported.

Targets: peak RssAnon of the 10^6-row memmap run ≤ 1.2× the
10^4-row run; steps/s ≥ 0.9× the in-memory path for the memmap and ≥ 0.8× for
the decoded files (``png`` and ``png_processes`` each against ``png_array``),
at b = 1024; ε identical between source and in-memory.

The decode probe (``--probe-decode``, run first; the "one PNG batch" line):
the median ms to read one Poisson batch of ~b files outside training: the
transform in a plain loop, ``RecordSource.read`` with ``readers=1`` (the
default) and with ``readers=os.cpu_count(), processes=True`` (its worker
processes started, and timed, by a first small read before the timed ones).

Run::

    KERAS_BACKEND=jax python benchmarks/bench_sources.py            # full (~12 min, 2 cores)
    KERAS_BACKEND=jax python benchmarks/bench_sources.py --quick    # smoke run (~1.5-2.5 min)
    KERAS_BACKEND=tensorflow python benchmarks/bench_sources.py     # writes *_tensorflow.json

``--quick``: a 2·10^4-row memmap (the "1e6" runs), 2,000 files, 3 + 8 steps,
one repeat, the Clipless model only, 3 probe batches (each run is mostly its
process's imports and build). Options: ``--dir DIR`` (default: a new
temporary folder, deleted at the end; in a given folder only the files written
here are deleted), ``--keep`` (keep the data; a folder with matching data is
reused), ``--repeats``, ``--steps``, ``--warmup``, ``--models``, ``--rows``,
``--files``. The runs share an on-disk XLA cache (JAX) in the data folder:
compilation is never measured, only waited for. Results:
``benchmarks/results/bench_sources[_BACKEND].json`` and ``.png`` (``_BACKEND``:
none for JAX, ``_tensorflow``; the quick mode writes ``bench_sources_quick*``).
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
FEATURES = 784
CLASSES = 10
BATCH = 1024
EPSILON = 3.0
WIDTH = 512
MODELS = ("clipless", "clipping")
#: the measured configurations (the module docstring says what each reads)
CONFIGS = ("memmap_1e6", "memmap_1e6_prefetch", "array_1e6", "memmap_1e4", "png", "png_prefetch",
           "png_processes", "png_array")
#: comparisons: (source, in-memory baseline, throughput target)
PAIRS = (("memmap_1e6", "array_1e6", 0.9), ("memmap_1e6_prefetch", "array_1e6", 0.9),
         ("png", "png_array", 0.8), ("png_prefetch", "png_array", 0.8),
         ("png_processes", "png_array", 0.8))
#: the runs that are interleaved (back to back, the order reversed on odd repeats)
GROUPS = (("memmap_1e6", "memmap_1e6_prefetch", "array_1e6"), ("memmap_1e4",),
          ("png", "png_prefetch", "png_processes", "png_array"))
MEMORY_TARGET = 1.2
FULL = dict(rows=1_000_000, small_rows=10_000, files=50_000, warmup=10, steps=50, repeats=2,
            models=list(MODELS))
QUICK = dict(rows=20_000, small_rows=10_000, files=2_000, warmup=3, steps=8, repeats=1,
             models=["clipless"])


# -- the data -------------------------------------------------------------------------------

def decode_png(path):
    """One PNG file -> 784 float32 features in [0, 1] (the source's transform)."""
    from PIL import Image

    with Image.open(path) as image:
        return np.asarray(image, dtype=np.float32).reshape(FEATURES) / 255.0


def decode_many(paths):
    """Several PNG files -> one float32 array (the in-memory baseline's decoding, in a worker)."""
    return np.stack([decode_png(p) for p in paths])


def _paths(folder, files):
    return [os.path.join(folder, "png", f"{i:06d}.png") for i in range(files)]


def write_data(folder, rows, files):
    """Write the memmap (``rows`` × 784 float32) and ``files`` PNG files into
    ``folder`` unless a previous run left the same; returns the seconds each took
    (``None`` and ``reused``: the data was already there)."""
    meta_path = os.path.join(folder, "meta.json")
    meta = dict(rows=rows, files=files, features=FEATURES)
    if os.path.exists(meta_path):
        with open(meta_path) as f:
            if json.load(f) == meta:
                print(f"reusing the data in {folder}")
                return {"memmap_s": None, "png_s": None, "reused": True}
    rng = np.random.default_rng(0)
    times = {}
    start = time.perf_counter()
    labels = rng.integers(0, CLASSES, rows).astype("int32")
    block = FEATURES // CLASSES
    with open(os.path.join(folder, "rows.f32"), "wb") as f:
        for lo in range(0, rows, 50_000):
            y = labels[lo:lo + 50_000]
            x = rng.random((len(y), FEATURES), dtype=np.float32) * 0.5
            x[np.arange(len(y))[:, None], block * y[:, None] + np.arange(block)] += 0.5
            f.write(x.tobytes())
        f.flush()
        os.fsync(f.fileno())  # no write-back left to disturb the timed runs
    np.save(os.path.join(folder, "rows_labels.npy"), labels)
    times["memmap_s"] = time.perf_counter() - start

    from PIL import Image

    start = time.perf_counter()
    os.makedirs(os.path.join(folder, "png"), exist_ok=True)
    labels = rng.integers(0, CLASSES, files).astype("int32")
    paths = _paths(folder, files)
    for lo in range(0, files, 5_000):
        y = labels[lo:lo + 5_000]
        images = rng.integers(0, 96, (len(y), 28, 28), dtype=np.uint8)
        for k, c in enumerate(y):
            r, col = 2 + 12 * (c // 5), 1 + 5 * (c % 5)
            images[k, r:r + 6, col:col + 6] = 255
            Image.fromarray(images[k], mode="L").save(paths[lo + k])
    np.save(os.path.join(folder, "png_labels.npy"), labels)
    os.sync()
    times["png_s"] = time.perf_counter() - start
    with open(meta_path, "w") as f:
        json.dump(meta, f)
    return times


def remove_data(folder, whole):
    """Delete ``folder`` (``whole``: it was created here) or only what this script wrote in it."""
    if whole:
        shutil.rmtree(folder, ignore_errors=True)
        return
    for name in ("rows.f32", "rows_labels.npy", "png_labels.npy", "meta.json"):
        if os.path.exists(os.path.join(folder, name)):
            os.remove(os.path.join(folder, name))
    for name in ("png", "jax_cache"):
        shutil.rmtree(os.path.join(folder, name), ignore_errors=True)


# -- one run (child process) ---------------------------------------------------------------

class AnonSampler(threading.Thread):
    """Peak ``RssAnon`` of this process, and of this process plus its child
    processes, read every ``period`` seconds (the children's list every
    ``refresh`` seconds)."""

    def __init__(self, period=0.005, refresh=0.1):
        super().__init__(daemon=True)
        self.period, self.refresh, self.peak, self.peak_total = period, refresh, 0.0, 0.0
        self._children, self._listed = [], 0.0
        self._stop_event = threading.Event()
        self.sample()

    @staticmethod
    def now(pid="self"):
        try:
            with open(f"/proc/{pid}/status") as status:
                for line in status:
                    if line.startswith("RssAnon:"):
                        return int(line.split()[1]) / 1024
        except OSError:  # a child that has ended
            return 0.0
        return float("nan")

    @staticmethod
    def children():
        pids = []
        for task in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{task}/children") as f:
                    pids += f.read().split()
            except OSError:
                pass
        return pids

    def sample(self):
        value = self.now()
        self.peak = max(self.peak, value)
        if time.perf_counter() - self._listed > self.refresh:
            self._children, self._listed = self.children(), time.perf_counter()
        self.peak_total = max(self.peak_total, value + sum(self.now(p) for p in self._children))
        return value

    def run(self):
        while not self._stop_event.wait(self.period):
            self.sample()

    def stop(self):
        self._stop_event.set()
        self.join()
        self.sample()
        return self.peak


def build_model(method, nb_samples, steps):
    """The recipe's model for ``method``, with b = 1024 and width 512 whatever N,
    calibrated (``make_private``) for ε = 3 over the fewest whole epochs that hold
    twice the ``steps`` run (a quick calibration; the budget never stops the run)."""
    from kdp import recipes

    r = recipes.recipe((FEATURES,), CLASSES, nb_samples, EPSILON, method=method, kind="image",
                       features=None)  # the pixels' MLP: the model whose input pipeline is timed
    r.batch_size, r.width = BATCH, WIDTH  # one model for every N: b = 1024, one hidden layer
    r.epochs = -(-2 * steps // -(-nb_samples // BATCH))
    return r.build()  # (seed=: keras.utils.set_random_seed would import TensorFlow, 7 s)


def load(config, folder, rows, small_rows, files):
    """``(fit's x, fit's y)`` of ``config``: what is timed before the first step."""
    import kdp

    data = os.path.join(folder, "rows.f32")
    if config.startswith("memmap_"):
        n = small_rows if config == "memmap_1e4" else rows
        x = np.memmap(data, dtype="float32", mode="r", shape=(n, FEATURES))
        y = np.load(os.path.join(folder, "rows_labels.npy"))[:n]
        if config == "memmap_1e6_prefetch":  # read ahead in 2 threads, as on an accelerator
            return kdp.RecordSource(x, labels=y, prefetch=True), None
        return x, y
    if config == "array_1e6":
        x = np.fromfile(data, dtype="float32", count=rows * FEATURES).reshape(rows, FEATURES)
        return x, np.load(os.path.join(folder, "rows_labels.npy"))
    labels = np.load(os.path.join(folder, "png_labels.npy"))
    paths = _paths(folder, files)
    if config in ("png", "png_prefetch"):
        return kdp.RecordSource(paths, labels=labels, transform=decode_png,
                                prefetch=config == "png_prefetch"), None
    if config == "png_processes":
        return kdp.RecordSource(paths, labels=labels, transform=decode_png,
                                readers=os.cpu_count(), processes=True), None
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    # PIL's decoding holds the GIL: cpu_count processes (spawned: this process runs
    # the backend's threads), as many as png_processes' readers
    chunks = [paths[k:k + 500] for k in range(0, len(paths), 500)]
    with ProcessPoolExecutor(os.cpu_count(), mp_context=multiprocessing.get_context("spawn")) as pool:
        x = np.concatenate(list(pool.map(decode_many, chunks)))
    return x, labels


def nb_samples(config, rows, small_rows, files):
    return {"memmap_1e6": rows, "memmap_1e6_prefetch": rows, "array_1e6": rows,
            "memmap_1e4": small_rows}.get(config, files)


def one(config, method, args):
    started = time.perf_counter()
    sampler = AnonSampler()
    sampler.start()
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import keras

    import kdp  # noqa: F401

    imported = time.perf_counter()
    n = nb_samples(config, args.rows, args.small_rows, args.files)
    model = build_model(method, n, args.warmup + args.steps)
    base = sampler.sample()

    class Clock(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.begins, self.end = [], None

        def on_train_batch_begin(self, batch, logs=None):
            self.begins.append(time.perf_counter())

        def on_train_end(self, logs=None):
            self.end = time.perf_counter()

    t0 = time.perf_counter()
    x, y = load(config, args.dir, args.rows, args.small_rows, args.files)
    loaded = time.perf_counter()
    clock = Clock()
    model.fit(x, y, epochs=1, steps_per_epoch=args.warmup + args.steps, verbose=0, callbacks=[clock])
    fitted = time.perf_counter()
    peak = sampler.stop()
    marks = clock.begins[args.warmup:] + [clock.end]
    intervals = np.diff(marks)
    limit = max(0.5, 5 * float(np.median(intervals)))
    kept = intervals[intervals <= limit]
    eps, delta = model.privacy_spent()
    print(json.dumps({
        "config": config, "model": method, "N": n, "steps_per_s": len(kept) / float(kept.sum()),
        "measured_steps": len(kept), "compiles_excluded": int((intervals > limit).sum()),
        "peak_anon_mb": peak, "base_anon_mb": base, "peak_anon_total_mb": sampler.peak_total,
        "first_step_s": clock.begins[0] - t0, "load_s": loaded - t0,
        "epsilon": float(eps), "delta": float(delta),
        "sigma": float(model.dp_parameters.noise_multiplier),
        "ledger_steps": int(model.privacy_ledger.training_steps()),
        "backend": keras.backend.backend(), "import_s": imported - started,
        "build_s": t0 - imported, "fit_s": fitted - loaded,
    }))


def probe_decode(args):
    """What one batch of PNG records costs to read, outside training (no model):
    the transform in a plain loop, and `RecordSource.read` with the default
    ``readers=1`` and with ``readers=os.cpu_count(), processes=True`` (median ms
    per Poisson batch of ~b records; the worker processes are started by a
    first read of 2 records, timed apart: "... start")."""
    import kdp

    labels = np.load(os.path.join(args.dir, "png_labels.npy"))
    paths = _paths(args.dir, args.files)
    rng = np.random.default_rng(1)
    batches = 3 if args.quick else 6
    cpus = os.cpu_count()
    sources = {"readers=1 (default)": kdp.RecordSource(paths, labels=labels, transform=decode_png),
               f"readers={cpus} processes": kdp.RecordSource(
                   paths, labels=labels, transform=decode_png, readers=cpus, processes=True)}
    starts = {}
    for name, source in sources.items():
        start = time.perf_counter()
        source.read(np.arange(2))
        starts[f"{name} start"] = time.perf_counter() - start
    times = {"transform loop": []} | {name: [] for name in sources}
    for _ in range(batches):  # interleaved, so that each sees the same conditions
        ids = np.flatnonzero(rng.random(len(paths)) < BATCH / len(paths))
        for name in times:
            start = time.perf_counter()
            if name == "transform loop":
                np.stack([decode_png(paths[i]) for i in ids])
            else:
                sources[name].read(ids)
            times[name].append(time.perf_counter() - start)
    print(json.dumps({name: 1e3 * float(np.median(t)) for name, t in times.items()}
                     | {name: 1e3 * t for name, t in starts.items()}))


# -- the driver ----------------------------------------------------------------------------

def run_one(config, method, args):
    command = [sys.executable, os.path.abspath(__file__), "--one", config, method, "--dir", args.dir,
               "--rows", str(args.rows), "--small-rows", str(args.small_rows), "--files",
               str(args.files), "--steps", str(args.steps), "--warmup", str(args.warmup)]
    # XLA executables cached on disk across the runs: compilation is not measured, only waited for
    env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=os.path.join(args.dir, "jax_cache"),
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
               JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    start = time.perf_counter()
    out = subprocess.run(command, capture_output=True, text=True, env=env)
    if out.returncode:
        print(f"  {config} {method}: FAILED\n{out.stderr[-3000:]}", flush=True)
        return None
    result = json.loads(out.stdout.strip().splitlines()[-1])
    result["wall_s"] = time.perf_counter() - start
    print(f"  {method:9s} {config:11s} {result['steps_per_s']:6.2f} steps/s "
          f"({result['measured_steps']} steps, {result['compiles_excluded']} compile(s) left out)  "
          f"peak RssAnon {result['peak_anon_mb']:7.0f} MB (base {result['base_anon_mb']:.0f}, "
          f"with children {result['peak_anon_total_mb']:.0f})  "
          f"first step {result['first_step_s']:6.2f} s  eps {result['epsilon']:.6g}  "
          f"[{result['wall_s']:.0f} s]", flush=True)
    return result


def median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else float("nan")


def summarise(runs, repeats, models):
    """Medians per configuration and, per repeat, the ratios of each comparison."""
    table = {}
    for method in models:
        rows = {}
        for config in CONFIGS:
            got = [runs.get((r, method, config)) for r in range(repeats)]
            got = [g for g in got if g]
            if got:
                rows[config] = {k: median([g[k] for g in got]) for k in
                                ("steps_per_s", "peak_anon_mb", "base_anon_mb",
                                 "peak_anon_total_mb", "first_step_s", "load_s")}
                rows[config]["epsilon"] = [g["epsilon"] for g in got]
                rows[config]["ledger_steps"] = [g["ledger_steps"] for g in got]
                rows[config]["N"] = got[0]["N"]

        def ratio(a, b, key):
            values = []
            for r in range(repeats):
                ra, rb = runs.get((r, method, a)), runs.get((r, method, b))
                if ra and rb:
                    values.append(ra[key] / rb[key])
            return median(values), values

        targets = {}
        for source, base, target in PAIRS:
            value, each = ratio(source, base, "steps_per_s")
            targets[f"throughput {source}/{base}"] = dict(
                value=value, each=each, target=f">= {target}", met=bool(value >= target))
            eps = [(runs[(r, method, source)]["epsilon"], runs[(r, method, base)]["epsilon"])
                   for r in range(repeats) if runs.get((r, method, source)) and runs.get((r, method, base))]
            targets[f"epsilon {source} == {base}"] = dict(
                value=eps, target="identical", met=bool(eps) and all(a == b for a, b in eps))
        value, each = ratio("memmap_1e6", "memmap_1e4", "peak_anon_mb")
        targets["peak RssAnon memmap_1e6/memmap_1e4"] = dict(
            value=value, each=each, target=f"<= {MEMORY_TARGET}", met=bool(value <= MEMORY_TARGET))
        table[method] = {"configs": rows, "targets": targets}
    return table


def print_table(table, args, backend):
    print(f"\nbackend={backend}, b={BATCH}, {args.steps} measured steps after {args.warmup}, "
          f"median of {args.repeats} repeat(s); memmap N={args.rows}, small memmap N={args.small_rows}, "
          f"PNG files N={args.files}")
    cpus = os.cpu_count()
    print("sources (RecordSource defaults: readers=1, no prefetch on a CPU): memmap_* = fit(x=memmap, "
          f"y=labels); png = 1 reader in the training process; png_processes = readers={cpus}, "
          f"processes=True. png_array = every PNG decoded first by {cpus} spawned processes.")
    print("first step = s from handing the data over (in-memory: incl. loading the arrays / decoding "
          "every PNG, and fit's validation of all arrays; source: opening it, fit reading+validating "
          "the first batch, starting worker processes) to the first on_train_batch_begin; excl. "
          "imports, build+calibration, compile.")
    print("RssAnon = anonymous resident memory (no page cache, no mapped file), peak over the process; "
          "base = after imports and the model's build; +children = peak of the process's plus its "
          "child processes' (decoding workers).")
    header = (f"{'model':9s} {'config':13s} {'N':>8s} {'steps/s':>8s} {'peak RssAnon MB':>16s} "
              f"{'base MB':>8s} {'+children MB':>13s} {'first step s':>13s} {'(load s)':>9s} "
              f"{'epsilon':>12s}")
    for method, part in table.items():
        print("\n" + header)
        for config, row in part["configs"].items():
            eps = ", ".join(f"{e:.10g}" for e in row["epsilon"])
            print(f"{method:9s} {config:13s} {row['N']:8d} {row['steps_per_s']:8.2f} "
                  f"{row['peak_anon_mb']:16.0f} {row['base_anon_mb']:8.0f} "
                  f"{row['peak_anon_total_mb']:13.0f} "
                  f"{row['first_step_s']:13.2f} {row['load_s']:9.2f} {eps:>12s}")
        for name, t in part["targets"].items():
            if name.startswith("epsilon"):
                shown = "; ".join(f"{a:.10g} vs {b:.10g}" for a, b in t["value"])
            else:
                shown = f"{t['value']:.3f} (each repeat: " + ", ".join(f"{v:.3f}" for v in t["each"]) + ")"
            print(f"  {method:9s} {name:45s} {shown}  target {t['target']}: "
                  f"{'PASS' if t['met'] else 'MISS'}")
    print("  (memmap_1e4 has another N, so its epsilon differs from the 10^6-row runs' by design)")


def plot(table, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.35
    names = [f"{s}/{b}" for s, b, _ in PAIRS]
    for k, method in enumerate(table):
        targets = table[method]["targets"]
        values = [targets[f"throughput {s}/{b}"]["value"] for s, b, _ in PAIRS]
        left.bar(np.arange(len(names)) + (k - 0.5) * width, values, width, label=method)
    for i, (_, _, target) in enumerate(PAIRS):
        left.hlines(target, i - 0.45, i + 0.45, colors="k", linestyles="--")
    left.set_xticks(range(len(names)), names)
    left.set_ylabel("steps/s ratio, source / in-memory")
    left.set_title(f"Throughput at b = {BATCH} (dashed: targets)")
    left.legend()
    for k, method in enumerate(table):
        rows = table[method]["configs"]
        values = [rows.get(c, {}).get("peak_anon_mb", np.nan) for c in CONFIGS]
        right.bar(np.arange(len(CONFIGS)) + (k - 0.5) * width, values, width, label=method)
    right.set_xticks(range(len(CONFIGS)), CONFIGS, rotation=15)
    right.set_ylabel("peak RssAnon (MB)")
    right.set_title("Peak anonymous memory per run")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run (small data, few steps)")
    parser.add_argument("--dir", help="where the data is written (default: a new temporary folder)")
    parser.add_argument("--keep", action="store_true", help="keep the data folder")
    parser.add_argument("--one", nargs=2, metavar=("CONFIG", "MODEL"), help=argparse.SUPPRESS)
    parser.add_argument("--probe-decode", action="store_true", help=argparse.SUPPRESS)
    for name in ("rows", "small-rows", "files", "steps", "warmup", "repeats"):
        parser.add_argument(f"--{name}", type=int)
    parser.add_argument("--models", nargs="+", choices=MODELS)
    args = parser.parse_args()
    for key, value in (QUICK if args.quick else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.one:
        one(*args.one, args)
        return
    if args.probe_decode:
        probe_decode(args)
        return

    backend = os.environ.get("KERAS_BACKEND", "tensorflow")
    start = time.perf_counter()
    created = args.dir is None
    args.dir = args.dir or tempfile.mkdtemp(prefix="kdp_bench_sources_")
    os.makedirs(args.dir, exist_ok=True)
    print(f"data in {args.dir}: memmap {args.rows} x {FEATURES} float32 "
          f"({args.rows * FEATURES * 4 / 1e9:.2f} GB), {args.files} PNG files", flush=True)
    writing = write_data(args.dir, args.rows, args.files)
    if not writing.get("reused"):
        print(f"written: memmap {writing['memmap_s']:.1f} s, PNG files {writing['png_s']:.1f} s",
              flush=True)
    runs, decode = {}, {}
    try:
        out = subprocess.run([sys.executable, os.path.abspath(__file__), "--probe-decode", "--dir",
                              args.dir, "--files", str(args.files)] + ["--quick"] * args.quick,
                             capture_output=True, text=True)
        if out.returncode == 0:
            decode = json.loads(out.stdout.strip().splitlines()[-1])
            print("one PNG batch (~%d records) read outside training, median ms: " % BATCH
                  + ", ".join(f"{k} {v:.0f}" for k, v in decode.items() if not k.endswith("start"))
                  + " (first read of 2 records, once: "
                  + ", ".join(f"{k} {v:.0f}" for k, v in decode.items() if k.endswith("start"))
                  + ")", flush=True)
        else:
            print(f"decode probe FAILED\n{out.stderr[-3000:]}", flush=True)
        for r in range(args.repeats):
            for method in args.models:
                order = [c for group in GROUPS for c in (group if r % 2 == 0 else group[::-1])]
                for config in order:
                    runs[(r, method, config)] = run_one(config, method, args)
    finally:
        if not args.keep:
            remove_data(args.dir, whole=created)
    table = summarise(runs, args.repeats, args.models)
    print_table(table, args, backend)
    if decode:
        loop = decode["transform loop"]
        reads = {k: v for k, v in decode.items() if k != "transform loop" and not k.endswith("start")}
        print(f"\nPNG decoding alone: {loop:.0f} ms per batch in a plain loop ("
              + ", ".join(f"RecordSource.read {k}: {v:.0f} ms" for k, v in reads.items())
              + "; worker start: " + ", ".join(f"{k} {v:.0f} ms" for k, v in decode.items()
                                                if k.endswith("start"))
              + "). Without prefetch (a CPU) the read adds to each step: at most "
              + ", ".join(f"{1e3 / v:.1f} steps/s ({k})" for k, v in reads.items())
              + " from reading alone (PIL's decoding of a small file is mostly Python under the GIL).")
    wall = time.perf_counter() - start
    print(f"\nwall time {wall:.0f} s")
    os.makedirs(RESULTS, exist_ok=True)
    stem = "bench_sources" + ("_quick" if args.quick else "") + ("" if backend == "jax" else f"_{backend}")
    with open(os.path.join(RESULTS, stem + ".json"), "w") as f:
        json.dump({"backend": backend, "batch_size": BATCH, "epsilon_target": EPSILON,
                   "settings": {k: getattr(args, k) for k in ("rows", "small_rows", "files", "steps",
                                                              "warmup", "repeats", "models")},
                   "cpus": os.cpu_count(), "writing_s": writing, "wall_s": wall,
                   "png_batch_read_ms": decode,
                   "summary": table,
                   "runs": [v for v in runs.values() if v]}, f, indent=1)
    plot(table, os.path.join(RESULTS, stem + ".png"))
    print(f"saved {os.path.join(RESULTS, stem + '.json')} and .png")


if __name__ == "__main__":
    main()
