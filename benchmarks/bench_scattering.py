"""`DP_Scattering2D` against kymatio: exactness, speed, and what the features buy on digits.

    python benchmarks/bench_scattering.py [--batch 256] [--repeats 5] [--kymatio-python PATH]

Inputs: sklearn's 8×8 digits (pixels/16, in [0, 1]) and uniform random 28×28
images in [0, 1]; J = 2, L = 8, order 2 (K = 81 paths).

* **Exactness.** (1) kymatio's own periodic algorithm (its ``scattering2d`` core
  with its filter bank on the input grid, no padding) against the layer: the
  layer's path ``k`` divided by ``path_gains[k]`` (its normalisation constants,
  and kymatio's 3.1415 for π) must equal kymatio's. (2) kymatio's numpy
  frontend (reflection padding, cropped output) against the layer applied to
  the same reflection-padded input, cropped the same way. (3) The layer as
  shipped (periodic on the unpadded grid: reflection padding would expand
  norms) against the frontend: the correlation of coefficients and the
  relative error of per-path energies (border effects only).
* **Speed.** Images per second for one batch, median of ``--repeats`` calls
  after a warm-up: the layer under ``jax.jit`` and ``tf.function`` (with and
  without XLA), kymatio's numpy frontend. Every column runs in its own
  subprocess, one after the other, in this one run.
* **Digits.** Non-private logistic regression (scikit-learn, lbfgs, max_iter
  5000) on raw pixels and on scattering features, 1437 / 360 split
  (``train_test_split(test_size=0.2, random_state=0)``): C = 1 and C = 100 on
  the features as they are (data-independent: what a DP model sees), and C = 1
  after a StandardScaler (fitted on the training set: not free under DP); and
  ``‖S x‖ / ‖x‖`` on digits (the share of the input norm the features keep,
  while the bound pass assumes the worst case ``X_out = X``).

kymatio is not a kdp dependency. Install it in its own environment (kymatio
0.3 needs SciPy < 1.15, which still has ``sph_harm``)::

    python -m venv /tmp/kymenv && /tmp/kymenv/bin/pip install kymatio "scipy<1.15" "numpy<2.1"

The script uses ``--kymatio-python`` (default ``/tmp/kymenv/bin/python`` when it
exists); without it the kymatio columns are skipped with a note.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
J, L = 2, 8
KYMATIO_PI = 3.1415  # kymatio's gabor_2d normalisation constant


def kymatio_padding(M, N):
    """kymatio's ``compute_padding`` and the reflection-pad widths of its frontend."""
    Mp, Np = ((M + 2 ** J) // 2 ** J + 1) * 2 ** J, ((N + 2 ** J) // 2 ** J + 1) * 2 ** J
    return ((Mp - M) // 2, (Mp - M + 1) // 2), ((Np - N) // 2, (Np - N + 1) // 2)


def path_orders():
    return np.array([0] + [1] * (J * L) + [2] * (L * L * J * (J - 1) // 2))


# --- workers (each in its own process) ---------------------------------------------

def _median_rate(fn, x, repeats):
    fn(x)  # warm-up (compilation)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn(x)
        times.append(time.perf_counter() - t)
    return len(x) / float(np.median(times))


def worker_keras(data, out, repeats):
    """The layer on the backend of KERAS_BACKEND: coefficients and images/s."""
    sys.path.insert(0, os.path.dirname(HERE))
    import keras

    from kdp.layers import DP_Scattering2D

    backend = keras.backend.backend()
    inputs = dict(np.load(data))
    result, rates = {}, {}
    for name in ("digits", "random28"):
        x = inputs[name]
        layer = DP_Scattering2D(J=J, L=L)
        result[f"{name}/ours"] = np.asarray(layer(x)).transpose(0, 3, 1, 2)
        result[f"{name}/gains"] = layer.path_gains
        (a, b), (c, d) = kymatio_padding(*x.shape[1:])
        padded = np.pad(x, ((0, 0), (a, b), (c, d)), mode="reflect")
        on_padded = DP_Scattering2D(J=J, L=L)
        result[f"{name}/ours_reflect"] = np.asarray(on_padded(padded)).transpose(0, 3, 1, 2)[..., 1:-1, 1:-1]
        result[f"{name}/gains_reflect"] = on_padded.path_gains
        batch = inputs[f"{name}_batch"]
        if backend == "jax":
            import jax

            f = jax.jit(lambda v: layer(v))
            rates["jax.jit"] = rates.get("jax.jit", {})
            rates["jax.jit"][name] = _median_rate(lambda v: jax.block_until_ready(f(v)), batch, repeats)
        else:
            import tensorflow as tf

            for label, kwargs in (("tf.function", {}), ("tf.function(jit_compile=True)", {"jit_compile": True})):
                f = tf.function(lambda v: layer(v), **kwargs)
                try:
                    rate = _median_rate(lambda v: f(v).numpy(), batch, repeats)
                except Exception as error:  # noqa: BLE001 (reported, not hidden)
                    rate = f"failed: {type(error).__name__}"
                rates.setdefault(label, {})[name] = rate
    for label, kwargs in (("J2", {"J": 2}), ("J1", {"J": 1}), ("J2_pad4", {"J": 2, "padding": 4})):
        result[f"digits_all/{label}"] = np.asarray(DP_Scattering2D(L=L, **kwargs)(inputs["digits_all"]))
    np.savez(out, **result)
    with open(out + ".json", "w") as f:
        json.dump(rates, f)


def worker_kymatio(data, out, repeats):
    """kymatio's numpy frontend and its periodic core on the same inputs."""
    from kymatio.numpy import Scattering2D
    from kymatio.scattering2d.backend.numpy_backend import backend
    from kymatio.scattering2d.core.scattering2d import scattering2d
    from kymatio.scattering2d.filter_bank import filter_bank

    import kymatio

    inputs = dict(np.load(data))
    result, rates = {}, {}
    for name in ("digits", "random28"):
        x = inputs[name]
        M, N = x.shape[1:]
        frontend = Scattering2D(J=J, shape=(M, N), L=L)
        result[f"{name}/frontend"] = frontend(x)
        f = filter_bank(M, N, J, L)
        result[f"{name}/core"] = scattering2d(x.astype("float64"), lambda t: t, lambda t: t, backend,
                                              J, L, f["phi"], f["psi"], 2)
        rates[name] = _median_rate(frontend, inputs[f"{name}_batch"], repeats)
    np.savez(out, **result)
    with open(out + ".json", "w") as f:
        json.dump({"kymatio (numpy) " + kymatio.__version__: rates}, f)


# --- the report -------------------------------------------------------------------

def per_order_error(ours, gains, reference):
    """Max over paths of ``max|ours/gain − ref| / max|ref|``, per order."""
    orders = path_orders()
    scaled = ours / gains[None, :, None, None] * (np.pi / KYMATIO_PI) ** (orders + 1)[None, :, None, None]
    err = np.abs(scaled - reference).max(axis=(0, 2, 3)) / np.abs(reference).max(axis=(0, 2, 3))
    return [float(err[orders == o].max()) for o in range(3)]


def shipped_vs_frontend(ours, gains, frontend):
    """Coefficient correlation per order and median relative error of per-path energies."""
    orders = path_orders()
    scaled = ours / gains[None, :, None, None] * (np.pi / KYMATIO_PI) ** (orders + 1)[None, :, None, None]
    corr = [float(np.corrcoef(scaled[:, orders == o].ravel(), frontend[:, orders == o].ravel())[0, 1])
            for o in range(3)]
    e_ours, e_ref = (np.square(t).sum(axis=(0, 2, 3)) for t in (scaled, frontend))
    return corr, float(np.median(np.abs(e_ours - e_ref) / e_ref))


def digits_accuracy(images, labels, features):
    from sklearn.linear_model import LogisticRegression
    from sklearn.model_selection import train_test_split
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    rows = []
    for name, feats in features.items():
        f = feats.reshape(len(feats), -1)
        tr, te, ytr, yte = train_test_split(f, labels, test_size=0.2, random_state=0)
        accs = []
        for C, scaler in ((1.0, False), (100.0, False), (1.0, True)):
            clf = LogisticRegression(C=C, max_iter=5000)
            clf = make_pipeline(StandardScaler(), clf) if scaler else clf
            accs.append(clf.fit(tr, ytr).score(te, yte))
        rows.append((name, f.shape[1], len(tr), len(te), *accs))
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--kymatio-python", default="/tmp/kymenv/bin/python")
    parser.add_argument("--worker", choices=("keras", "kymatio"), help=argparse.SUPPRESS)
    parser.add_argument("--data", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        {"keras": worker_keras, "kymatio": worker_kymatio}[args.worker](args.data, args.out, args.repeats)
        return

    from sklearn.datasets import load_digits

    digits = load_digits()
    images = (digits.images / 16.0).astype("float32")
    rng = np.random.default_rng(0)
    idx = rng.choice(len(images), size=args.batch, replace=len(images) < args.batch)
    random28 = rng.uniform(size=(args.batch, 28, 28)).astype("float32")
    tmp = tempfile.mkdtemp(prefix="bench_scattering_")
    data = os.path.join(tmp, "inputs.npz")
    np.savez(data, digits=images[:64], random28=random28[:64], digits_batch=images[idx],
             random28_batch=random28, digits_all=images)

    def run(python, worker, env, out):
        subprocess.run([python, os.path.abspath(__file__), "--worker", worker, "--data", data,
                        "--out", out, "--repeats", str(args.repeats)], env=env, check=True)
        with open(out + ".json") as f:
            return dict(np.load(out)), json.load(f)

    results, rates = {}, {}
    for backend in ("jax", "tensorflow"):
        env = {**os.environ, "KERAS_BACKEND": backend, "TF_CPP_MIN_LOG_LEVEL": "2"}
        results[backend], rate = run(sys.executable, "keras", env, os.path.join(tmp, f"{backend}.npz"))
        rates.update(rate)
    kym = None
    if args.kymatio_python and os.path.exists(args.kymatio_python):
        try:
            kym, rate = run(args.kymatio_python, "kymatio", dict(os.environ), os.path.join(tmp, "kymatio.npz"))
            rates.update(rate)
        except subprocess.CalledProcessError as error:
            print(f"note: the kymatio worker failed ({error}); its columns are skipped")
    else:
        print(f"note: no kymatio interpreter at {args.kymatio_python!r}: kymatio columns skipped "
              "(see the module docstring to install it in its own venv)")

    print(f"\nSpeed, images/s (batch {args.batch}, median of {args.repeats}; J={J}, L={L}, order 2, "
          f"{os.cpu_count()} CPU cores as seen by Python)")
    print(f"{'implementation':34s} {'digits 8x8':>12s} {'random 28x28':>14s}")
    for label, r in rates.items():
        cells = [f"{r[k]:.0f}" if isinstance(r[k], float) else r[k] for k in ("digits", "random28")]
        print(f"{label:34s} {cells[0]:>12s} {cells[1]:>14s}")

    print("\nExactness (max relative error per path, worst path, orders 0 / 1 / 2)")
    for name in ("digits", "random28"):
        ours = results["jax"]
        tf_vs_jax = float(np.abs(results["tensorflow"][f"{name}/ours"] - ours[f"{name}/ours"]).max()
                          / np.abs(ours[f"{name}/ours"]).max())
        print(f"  {name}: TensorFlow vs JAX layer output {tf_vs_jax:.1e}")
        if kym is None:
            continue
        core = per_order_error(ours[f"{name}/ours"], ours[f"{name}/gains"], kym[f"{name}/core"])
        front = per_order_error(ours[f"{name}/ours_reflect"], ours[f"{name}/gains_reflect"],
                                kym[f"{name}/frontend"])
        corr, energy = shipped_vs_frontend(ours[f"{name}/ours"], ours[f"{name}/gains"], kym[f"{name}/frontend"])
        print(f"  {name}: vs kymatio periodic core, same grid:      " + " / ".join(f"{e:.1e}" for e in core))
        print(f"  {name}: vs kymatio frontend, same reflected input: " + " / ".join(f"{e:.1e}" for e in front))
        print(f"  {name}: shipped (periodic, no reflection) vs frontend: coefficient correlation "
              + " / ".join(f"{c:.4f}" for c in corr) + f"; per-path energy median rel. error {energy:.3f}")

    feats = {"raw pixels": images}
    labels = {"J1": "scattering J=1", "J2": "scattering J=2", "J2_pad4": "scattering J=2, padding=4"}
    for key, label in labels.items():
        feats[label] = results["jax"][f"digits_all/{key}"]
    print("\nDigits, non-private logistic regression (test accuracy; 1437 train / 360 test)")
    print(f"{'features':30s} {'dim':>5s} {'C=1':>7s} {'C=100':>7s} {'scaled':>7s} {'‖Sx‖/‖x‖ mean (min)':>20s}")
    norms = np.linalg.norm(images.reshape(len(images), -1), axis=1)
    for (name, dim, _, _, *accs), f in zip(digits_accuracy(images, digits.target, feats), feats.values()):
        r = np.linalg.norm(f.reshape(len(f), -1), axis=1) / norms
        print(f"{name:30s} {dim:5d} " + " ".join(f"{a:7.4f}" for a in accs) + f" {r.mean():13.3f} ({r.min():.3f})")


if __name__ == "__main__":
    main()
