"""kdp's command line: ``python -m kdp demo`` (or the console script ``kdp demo``).

The demo trains a differentially private model chosen by `kdp.recipes` from
public facts (Clipless DP-SGD or per-example clipping, ``--method``) on a
dataset bundled with scikit-learn (no download) to a target ε, then prints a
short report and saves a plot of accuracy and ε against epochs. It trains on
the digits' pixels (``features=None``), so that ``auto`` is Clipless and the
model carries a robustness certificate; the recipes' default for images
(scattering features, then per-example clipping) is shown in the README::

    python -m kdp demo                       # digits, ε = 3, δ = 1e-5, method auto
    python -m kdp demo --epsilon 1 --method clipless --backend jax --out /tmp/kdp

The Keras backend is fixed when Keras is first imported. ``--backend`` sets
``KERAS_BACKEND``; if Keras was already imported with another backend (`main`
called from a program that uses Keras), the command re-executes itself once with
the variable set, so the flag always takes effect. Keras and the heavy parts of
kdp are imported by the command that needs them, so ``--help`` answers at once.
"""

import argparse
import json
import math
import os
import sys
import time

BACKENDS = ("tensorflow", "jax")
DATASETS = ("digits", "breast_cancer", "wine", "iris")
_REEXEC_FLAG = "KDP_CLI_REEXEC"
#: the bundled datasets that are tables (the others are images)
TABLES = ("breast_cancer", "wine", "iris")
#: the files the demo writes in ``--out``, for each dataset
PLOT_FILE, REPORT_FILE = "demo_{}.png", "report_{}.json"

#: the demo's default certified-robustness radius (Clipless models only)
DEFAULT_RADIUS = 0.1
METHODS = ("auto", "clipless", "clipping")


# --- argument parsing ------------------------------------------------------------

def _positive_float(text):
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text!r}")
    return value


def _positive_int(text):
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


def _delta(text):
    value = _positive_float(text)
    if value >= 1:
        raise argparse.ArgumentTypeError(f"delta must be in (0, 1), got {text!r}")
    return value


def build_parser():
    from kdp import __version__

    parser = argparse.ArgumentParser(
        prog="kdp", description="kdp: differentially private deep learning for Keras 3."
    )
    parser.add_argument("--version", action="version", version=f"kdp {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    demo = sub.add_parser(
        "demo",
        help="train a DP model on bundled data to a target epsilon",
        description=(
            "Train a DP model chosen by kdp.recipes from public facts (Clipless or "
            "per-example clipping DP-SGD) on a scikit-learn bundled dataset to a target "
            "(epsilon, delta), print a report and save a plot."
        ),
    )
    demo.add_argument("--epsilon", type=_positive_float, default=3.0,
                      help="target epsilon (default: 3)")
    demo.add_argument("--delta", type=_delta, default=1e-5, help="delta (default: 1e-5)")
    demo.add_argument("--dataset", choices=DATASETS, default="digits",
                      help="bundled dataset (default: digits)")
    demo.add_argument("--method", choices=METHODS, default="auto",
                      help="clipless (Lipschitz layers, no per-example gradients), clipping "
                           "(per-example clipping DP-SGD) or auto (the recipe's choice, "
                           "kdp.recipes: Clipless for the digits' pixels); default: auto")
    demo.add_argument("--backend", choices=BACKENDS, default=None,
                      help="Keras backend (default: $KERAS_BACKEND, else Keras' own: tensorflow, "
                           "or jax where TensorFlow is not installed)")
    demo.add_argument("--epochs", type=_positive_int, default=None,
                      help="number of epochs (default: the recipe's, kdp.recipes)")
    demo.add_argument("--noise-multiplier", type=_positive_float, default=None,
                      help="noise multiplier sigma (default: calibrated to the target epsilon)")
    demo.add_argument("--radius", type=_positive_float, default=None,
                      help="L2 radius of the certified accuracy, Clipless models only (default: 0.1)")
    demo.add_argument("--out", default="kdp_out",
                      help=f"output folder for the plot {PLOT_FILE.format('<dataset>')} and the "
                           f"report {REPORT_FILE.format('<dataset>')} (default: kdp_out)")
    demo.add_argument("--quiet", action="store_true", help="no progress bar")
    return parser


# --- backend selection -------------------------------------------------------------

def _default_backend():
    """``"jax"`` where Keras would pick TensorFlow (no ``KERAS_BACKEND``, and
    tensorflow or nothing in its ``keras.json``) but only JAX is installed; else None."""
    import importlib.util

    if os.environ.get("KERAS_BACKEND"):
        return None
    home = os.environ.get("KERAS_HOME") or os.path.join(os.path.expanduser("~"), ".keras")
    try:
        with open(os.path.join(home, "keras.json")) as f:
            configured = json.load(f).get("backend", "tensorflow")
    except (OSError, ValueError, AttributeError):
        configured = "tensorflow"
    if (configured == "tensorflow" and importlib.util.find_spec("tensorflow") is None
            and importlib.util.find_spec("jax") is not None):
        return "jax"
    return None


def _ensure_backend(backend, argv):
    """Make sure Keras runs ``backend``: set the variable, or re-execute once."""
    if backend is None:
        return
    os.environ["KERAS_BACKEND"] = backend
    keras = sys.modules.get("keras")
    if keras is None:
        return  # Keras not imported yet: the variable takes effect on import
    if keras.backend.backend() == backend:
        return
    if os.environ.get(_REEXEC_FLAG):
        raise SystemExit(f"kdp: could not switch the Keras backend to {backend!r}")
    env = dict(os.environ, **{_REEXEC_FLAG: "1"})
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, "-m", "kdp", *argv], env)


# --- the demo ------------------------------------------------------------------------

def pick_epochs(target_epsilon, sampling_rate, steps_per_epoch, delta, noise_multiplier,
                max_epochs):
    """Epochs at a given σ: as many as the budget allows, at most ``max_epochs``
    (0 if not even one fits). Depends only on public quantities."""
    from kdp import privacy

    steps = privacy.max_steps(target_epsilon, noise_multiplier, sampling_rate, delta,
                              unit=steps_per_epoch)
    return min(steps // steps_per_epoch, max_epochs)


def certified_accuracy(model, x, y, radii, batch_size=512):
    """``({r: certified accuracy at r}, ℓ)`` for each radius in ``radii``.

    An example counts at radius ``r`` if it is classified correctly and its
    certified radius ``margin / (ℓ √2)`` exceeds ``r`` (margin = top logit minus
    runner-up, ℓ the network's Lipschitz constant; Anil et al. 2019). Uses
    `kdp.certificates` when it is available, else computes it here.
    """
    import numpy as np

    import kdp

    lip = float(kdp.lipschitz_constant(model))
    try:
        from kdp import certificates
    except ImportError:
        certificates = None
    if certificates is not None and hasattr(certificates, "certified_accuracy"):
        return {float(r): float(certificates.certified_accuracy(model, x, y, r, lipschitz=lip))
                for r in radii}, lip
    logits = np.asarray(model.predict(x, batch_size=batch_size, verbose=0))
    top2 = np.sort(logits, axis=1)[:, -2:]
    radius = (top2[:, 1] - top2[:, 0]) / (lip * math.sqrt(2.0))
    correct = logits.argmax(axis=1) == np.asarray(y).reshape(-1)
    return {float(r): float(np.mean(correct & (radius > r))) for r in radii}, lip


def save_plot(history, path, title):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    epochs = list(range(1, len(history["epsilon"]) + 1))
    fig, (ax_acc, ax_eps) = plt.subplots(1, 2, figsize=(10, 4))
    ax_acc.plot(epochs, history["accuracy"], marker=".", label="train (noisy model)")
    if "val_accuracy" in history:
        ax_acc.plot(epochs, history["val_accuracy"], marker=".", label="test")
    ax_acc.set_xlabel("epoch")
    ax_acc.set_ylabel("accuracy")
    ax_acc.set_ylim(0, 1)
    ax_acc.grid(alpha=0.3)
    ax_acc.legend(loc="lower right")
    ax_acc.set_title("accuracy")
    ax_eps.plot(epochs, history["epsilon"], marker=".", color="tab:red")
    ax_eps.set_xlabel("epoch")
    ax_eps.set_ylabel("ε (δ fixed)")
    ax_eps.grid(alpha=0.3)
    ax_eps.set_title("privacy spent ε")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _set_random_seed(seed):
    """`keras.utils.set_random_seed`, without importing TensorFlow on another backend:
    Keras also seeds TensorFlow whenever it is installed, which costs its import
    (seconds, and its C++ log lines) to a demo that feeds no `tf.data` pipeline."""
    import keras

    lazy_tf = getattr(sys.modules.get("keras.src.utils.module_utils"), "tensorflow", None)
    if (keras.backend.backend() == "tensorflow" or "tensorflow" in sys.modules
            or getattr(lazy_tf, "_available", False) is not None):
        keras.utils.set_random_seed(seed)
        return
    lazy_tf._available = False  # read by `available`, which imports TensorFlow to find out
    try:
        keras.utils.set_random_seed(seed)
    finally:
        lazy_tf._available = None


def _process_age():
    """Seconds since this process started (Linux; to about a second), or None."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime"))
        age = time.time() - (boot + start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError, StopIteration):
        return None
    return age if 0 <= age < 86400 else None


def run_demo(args):
    start = time.perf_counter()
    import keras

    from kdp import privacy, recipes
    from kdp.datasets import load_dataset

    imported = time.perf_counter()
    (x_train, y_train), (x_test, y_test), md = load_dataset(args.dataset, batch_size=1)
    n = md.nb_samples_train
    if not args.delta < 1.0 / n:
        raise SystemExit(f"kdp demo: error: --delta must be < 1/N = {1.0 / n:.3g}")
    kind = "table" if args.dataset in TABLES else "image"  # digits come flattened
    # on pixels (no scattering features): Clipless for auto on images, with its
    # certificate; auto trains a table with per-example clipping
    recipe = recipes.recipe(md.input_shape, md.nb_classes, n, args.epsilon, args.delta,
                            method=args.method, max_norm=md.max_norm, kind=kind, features=None)
    md = recipe.metadata()
    q, spe = md.sampling_rate, md.steps_per_epoch
    sigma = args.noise_multiplier
    epochs = recipe.epochs if args.epochs is None else args.epochs
    if sigma is not None:
        if args.epochs is None:
            epochs = pick_epochs(args.epsilon, q, spe, args.delta, sigma, recipe.epochs)
            if epochs < 1:
                raise SystemExit(
                    f"kdp demo: error: sigma={sigma} cannot train one epoch within "
                    f"epsilon={args.epsilon}; raise --noise-multiplier or --epsilon")
        planned = privacy.compute_epsilon(sigma, q, epochs * spe, args.delta)
        if planned > args.epsilon * (1 + 1e-6):
            raise SystemExit(
                f"kdp demo: error: {epochs} epochs at sigma={sigma:g} cost epsilon={planned:.3f} "
                f"> target {args.epsilon:g}; lower --epochs or raise --noise-multiplier")
    recipe.epochs = epochs

    _set_random_seed(0)  # for initialisation only (noise: OS entropy)
    model = recipe.build()
    if sigma is not None:  # a σ given by hand: the target stays the budget
        model.dp_parameters = model.dp_parameters.replace(noise_multiplier=sigma)
    sigma = model.step_plan().noise_multiplier
    print(
        f"kdp demo: {args.dataset} (N={n}, {md.nb_classes} classes), target epsilon={args.epsilon:g}, "
        f"delta={args.delta:g}: {recipe.method}, {epochs} epochs x {spe} steps, b={md.batch_size}, "
        f"q={q:.4f}, sigma={sigma:.4f}, backend {keras.backend.backend()}",
        flush=True,
    )
    fit_start = time.perf_counter()
    history = model.fit(
        x_train, y_train, epochs=epochs, validation_data=(x_test, y_test),
        verbose=0 if args.quiet else 1,
    ).history
    trained = time.perf_counter()
    eps, delta = model.privacy_spent()
    test_acc = float(model.evaluate(x_test, y_test, verbose=0, batch_size=512)[1])
    radius = DEFAULT_RADIUS if args.radius is None else args.radius
    cert, lip = (certified_accuracy(model, x_test, y_test, [radius]) if recipe.method == "clipless"
                 else ({float(radius): None}, None))
    # seconds: imports of Keras, its backend and kdp; data, recipe, calibration and
    # model; `fit` (its first epoch compiles the step); evaluation and certificate
    end = time.perf_counter()
    times = {"imports": imported - start, "setup": fit_start - imported,
             "training": trained - fit_start, "evaluation": end - trained}
    # since the process started: also the interpreter's start and what ran before
    process = _process_age()

    os.makedirs(args.out, exist_ok=True)
    plot_path = os.path.join(args.out, PLOT_FILE.format(args.dataset))
    save_plot(history, plot_path,
              f"kdp demo: {recipe.method} on {args.dataset}, ε={eps:.2f}, δ={delta:g}, σ={sigma:.2f}")
    report = {
        "dataset": args.dataset, "method": recipe.method, "epsilon": eps,
        "target_epsilon": args.epsilon, "delta": delta, "noise_multiplier": sigma,
        "mechanism": ("per-example clipping, C = {:g}".format(recipe.clipping_norm)
                      if recipe.method == "clipping" else "Clipless, global noise"),
        "batch_size": md.batch_size, "sampling_rate": q, "epochs": len(history["epsilon"]),
        "steps": model.privacy_ledger.training_steps(), "accountant": model.privacy_gate.accountant,
        "recipe": recipe.describe().splitlines(),
        "test_accuracy": test_acc, "certified_radius": radius,
        "certified_accuracy": cert[float(radius)], "lipschitz_constant": lip,
        "time_s": times, "process_time_s": process, "backend": keras.backend.backend(),
        "plot": plot_path,
        "history": {k: [float(v) for v in vals] for k, vals in history.items()},
    }
    with open(os.path.join(args.out, REPORT_FILE.format(args.dataset)), "w") as f:
        json.dump(report, f, indent=1)
    print(format_report(report), flush=True)
    return report


def format_report(r):
    from kdp import privacy

    t = r["time_s"]

    robustness = (
        f"certified accuracy at radius {r['certified_radius']:g} = "
        f"{r['certified_accuracy']:.4f} (Lipschitz constant {r['lipschitz_constant']:.3g})"
        if r["certified_accuracy"] is not None else
        "no certificate (per-example clipping does not bound the Lipschitz constant)")
    lines = [
        "",
        "kdp demo report",
        f"  privacy    epsilon = {r['epsilon']:.4f} (target {r['target_epsilon']:g}), "
        f"delta = {r['delta']:g}",
        f"  mechanism  {r['mechanism']}, sigma = {r['noise_multiplier']:.4f}, "
        f"steps = {r['steps']} ({r['epochs']} epochs), b = {r['batch_size']}, "
        f"q = {r['sampling_rate']:.4f}, Poisson sampling, add/remove-one, "
        f"{privacy.accountant_name(r['accountant'])}",
        f"  utility    test accuracy = {r['test_accuracy']:.4f}",
        f"  robustness {robustness}",
        f"  time       training {t['training']:.1f} s ({r['epochs']} epoch"
        f"{'s' * (r['epochs'] != 1)}, with compilation), "
        f"evaluation {t['evaluation']:.1f} s",
        f"             before training: imports {t['imports']:.1f} s (Keras, {r['backend']}, kdp), "
        f"data and model {t['setup']:.1f} s",
        "             " + ("" if r.get("process_time_s") is None else
                          f"{r['process_time_s']:.0f} s in all since the process started, ")
        + f"backend = {r['backend']}",
        f"  plot       {r['plot']}",
    ]
    return "\n".join(lines)


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    # before TensorFlow loads (imported by Keras, here or after a re-execution): none
    # of its C++ start-up lines (oneDNN, cpu_feature_guard, CUDA probes on a machine
    # without a GPU); `quiet_cpp_logs` drops those it writes whatever the level
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    _ensure_backend(args.backend or _default_backend(), argv)
    if args.command == "demo":
        from kdp._quiet import quiet_cpp_logs

        with quiet_cpp_logs():
            run_demo(args)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
