"""Keras-free helpers of the benchmarks that run each kind in a subprocess of its
own (the PyTorch comparison script, which runs in an environment of its own,
shares them): the peak memory, the encoder's command-line arguments, running
the children, the table of ratios and XLA's buffers of a JAX step."""

import argparse
import glob
import json
import os
import re
import subprocess
import sys
import tempfile


def peak_rss_mb():
    """This process's peak RSS in MB (it sees XLA's and TensorFlow's allocators):
    ``VmHWM`` on Linux, reset by ``exec``, unlike ``ru_maxrss``, which a child
    started by `subprocess` can inherit from its parent's peak; elsewhere
    `resource.getrusage`."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def add_cores_argument(parser):
    """``--cores N``: every kind runs on N of the CPUs (`use_cores`, called by the child)."""
    parser.add_argument("--cores", type=int, default=None,
                        help="run each kind on this many CPUs (1: one thread); default: all")


def use_cores(cores):
    """Run this process on the first ``cores`` CPUs it may use (``None``: all), before
    a backend is imported: XLA and TensorFlow size their thread pools by the CPUs a
    process may use, PyTorch by ``OMP_NUM_THREADS`` (set too), so ``cores=1``
    measures one thread."""
    if cores:
        os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:cores])
        os.environ["OMP_NUM_THREADS"] = str(cores)


def print_table(results, baseline):
    """Print ``{kind: {"time": seconds a step, "peak_mb": MB}}`` with each time's and
    memory's ratio to those of ``baseline``."""
    base = results.get(baseline)
    print(f"{'kind':>9} | {'ms/step':>8} {'/ ' + baseline:>8} | {'MB':>6} {'ratio':>6}")
    for kind, r in results.items():
        ratios = [r[key] / base[key] if base and base[key] > 0 else float("nan") for key in ("time", "peak_mb")]
        print(f"{kind:>9} | {r['time'] * 1e3:8.1f} {ratios[0]:8.2f} | {r['peak_mb']:6.0f} {ratios[1]:6.2f}",
              flush=True)


def print_buffers(buffers, baseline, batch):
    """Print ``{kind: {rows: MB}}`` (`xla_step_buffers`), each size's ratio to the
    ``baseline`` kind's at ``batch`` rows."""
    base = buffers.get(baseline, {}).get(batch, float("nan"))
    print(f"XLA buffers of each compiled step shape (rows: MB, ratio to {baseline} at {batch} rows)")
    for kind, sizes in buffers.items():
        print(f"{kind:>9} | " + ", ".join(f"{rows}: {mb:.1f} ({mb / base:.2f})" for rows, mb in sorted(sizes.items())),
              flush=True)


def encoder_parser(description, kinds):
    """The command line of the BERT-encoder benchmarks: the encoder's shape, the
    steps timed, the ``kinds`` to run, a timeout per child, ``--child`` and
    ``--cores``."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--length", type=int, default=64)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3,
                        help="timed fits per kind; their median time is reported")
    parser.add_argument("--kinds", nargs="+", default=list(kinds))
    parser.add_argument("--timeout", type=float, default=1200)
    parser.add_argument("--child")
    add_cores_argument(parser)
    return parser


def run_children(script, args, names, env=None):
    """``{kind: the JSON line its child printed last}`` for each of ``args.kinds``,
    each run as ``script --child kind`` with the arguments ``names`` of ``args``
    (and ``env``, a function of the kind returning extra environment variables);
    a child that fails or times out is reported on stderr and left out."""
    results = {}
    for kind in args.kinds:
        cmd = [sys.executable, script, "--child", kind] + [f"--{k}={getattr(args, k)}" for k in names]
        child_env = dict(os.environ, **env(kind)) if env else None
        try:
            out = subprocess.run(cmd + ([f"--cores={args.cores}"] if args.cores else []), capture_output=True,
                                 text=True, timeout=args.timeout, env=child_env)
        except subprocess.TimeoutExpired:
            sys.stderr.write(f"{kind}: over {args.timeout} s\n")
            continue
        if out.returncode:
            sys.stderr.write(out.stderr[-2000:])
            continue
        results[kind] = json.loads(out.stdout.strip().splitlines()[-1])
    return results


def xla_step_buffers(script, args, names, step="train_step"):
    """``{kind: {rows: MB}}``: the buffer memory XLA assigns to each compiled shape
    of the JAX training step (parameters, outputs and temporaries: the "Total bytes
    used" of its buffer assignment), for each of ``args.kinds``.

    The step's own working memory, without what peak RSS also counts (the
    runtime, compilation, every executable kept). Each kind runs again as a
    child that dumps its compiled modules named ``step``; ``rows`` is the first
    size of the step's integer input of shape ``(rows, args.length)``."""
    with tempfile.TemporaryDirectory() as root:
        def env(kind):
            return {"XLA_FLAGS": f"--xla_dump_to={root}/{kind} --xla_dump_hlo_as_text "
                                 f"--xla_dump_hlo_module_re=.*{step}.*"}

        run_children(script, args, names, env)
        found = {}
        for kind in args.kinds:
            for path in glob.glob(f"{root}/{kind}/*{step}*after_optimizations-buffer-assignment.txt"):
                with open(path) as dump, open(path.replace(".txt", "-values.txt")) as values:
                    text, total = dump.read(), re.search(r"Total bytes used: (\d+)", values.read())
                rows = re.search(r"parameter \d+, shape \|s32\[(\d+),%d\]\|" % args.length, text)
                if total and rows:
                    sizes = found.setdefault(kind, {})
                    sizes[int(rows.group(1))] = max(sizes.get(int(rows.group(1)), 0), int(total.group(1)) / 2**20)
        return found
