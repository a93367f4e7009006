"""Writes ``notebooks/09_audit.ipynb`` (without outputs): ``python notebooks/build_09_audit.py``;
then ``python notebooks/execute_notebooks.py 09`` stores it with the outputs of a full run."""

import nbformat as nbf

md = nbf.v4.new_markdown_cell
code = nbf.v4.new_code_cell
CELLS = [
md("""# Auditing a DP model: bounds, noise, and an empirical lower bound on ε

kdp's guarantee rests on three promises: every per-example gradient is below its
certified bound, the injected noise has the calibrated std, and the accountant's ε
is right. `kdp.audit` tests the first two directly on your model, and turns a
membership attack with a gradient canary into a statistically valid **lower
bound** on ε (Clopper–Pearson, 95 %) to compare with the accountant's ε.

Set `KDP_NOTEBOOK_SMALL=1` for a quick run (the test suite does)."""),
code("""import os
SMALL = os.environ.get("KDP_NOTEBOOK_SMALL") == "1"
TRIALS = 200 if SMALL else 1000

import keras
import numpy as np
import kdp
from kdp import accounting, audit, datasets, layers as L, losses

(x, y), (x_test, y_test), md = datasets.load_digits()
x = x / np.linalg.norm(x, axis=1, keepdims=True)
x_test = x_test / np.linalg.norm(x_test, axis=1, keepdims=True)

def make_model(sigma, dense=L.DP_QuickSpectralDense):
    model = kdp.DP_Sequential(
        [L.DP_BoundedInput((64,), upper_bound=1.0), dense(32), L.DP_GroupSort(2),
         L.DP_QuickSpectralDense(10)],
        dp_parameters=kdp.DPParameters("global", sigma, 1e-5),
        dataset_metadata=kdp.DatasetMetadata((64,), 10, len(x), 64))
    model.compile(optimizer=keras.optimizers.SGD(1.0), loss=losses.DP_TauCategoricalCrossentropy(1.0))
    return model"""),
md("""## 1. Bounds: true per-example gradient norms against the certified bounds

Run on a public batch (here the test split). A correct model stays below 1; a
deliberately broken layer (its kernel scaled ×3 and never projected) is caught."""),
code("""class BrokenDense(L.DP_QuickSpectralDense):
    def build(self, input_shape):
        super().build(input_shape)
        self.kernel.constraint = None
        self.kernel.assign(3.0 * self.kernel.value)

for name, model in [("correct", make_model(1.0)), ("broken", make_model(1.0, BrokenDense))]:
    report = audit.gradient_norm_check(model, x_test[:128], y_test[:128])
    print(f"{name:8s} ok={report['ok']}  largest norm/bound = {report['max_ratio']:.3f}  violations={report['violations']}")"""),
md("""`audit.GradientNormCheck(x_public, y_public, every=k)` runs the same check as a
callback during `fit` and logs `grad_bound_ratio`.

## 2. Noise: the injected std against the calibration"""),
code("""model = make_model(2.0)
report = audit.noise_check(model, x_test[:8], y_test[:8], trials=30 if SMALL else 100)
for path, r in report["variables"].items():
    print(f"{path:45s} expected {r['expected']:.4f}  measured {r['measured']:.4f}  ratio {r['ratio']:.3f}")
print("ok:", report["ok"])
# a noise multiplier 10 % below the claim is detected
under = make_model(1.8)
claim = {p: s / 0.9 for p, s in under.noise_stds().items()}
print("σ 10 % low detected:", not audit.noise_check(under, x_test[:8], y_test[:8], trials=30 if SMALL else 100, expected=claim)["ok"])"""),
md("""## 3. An empirical lower bound on ε

One noisy step on the canary alone (member) or on nothing (non-member): the two
add/remove neighbours. The claimed ε is the accountant's for that single step
(q = 1). An honest model's lower bound stays below its claim; a non-private
model and an under-noised one (σ twenty times below its claim) exceed it."""),
code("""# the canary: the example whose gradient comes closest to its bound
probe = make_model(1.0)
grads = audit.per_example_gradients(probe, probe.loss, x[:256], y[:256])
bounds = kdp.compute_gradient_bounds(probe)
ratio = np.max([np.linalg.norm(np.asarray(g).reshape(256, -1), axis=1) / bounds[p] for p, g in grads.items()], axis=0)
canary = slice(int(ratio.argmax()), int(ratio.argmax()) + 1)
rows = []
for eps in ([1.0, 8.0] if SMALL else [1.0, 4.0, 8.0]):
    rows.append((f"honest, ε={eps:g}", accounting.calibrate_noise_multiplier(eps, 1.0, 1, 1e-5), eps))
rows.append(("non-private", 1e-3, float("inf")))
rows.append(("under-noised (σ/20 of the ε=1 claim)", rows[0][1] / 20, 1.0))
results = []
for name, sigma, claim in rows:
    r = audit.membership_audit(make_model(sigma), x[canary], y[canary], trials=TRIALS)
    results.append((name, claim, r["epsilon_lower_bound"]))
    print(f"{name:40s} σ={sigma:7.3f}  claimed ε={claim:5.3g}  empirical lower bound={r['epsilon_lower_bound']:.3f}")"""),
code("""import matplotlib.pyplot as plt
plt.rcParams["figure.dpi"] = 72  # small stored figures
names = [r[0] for r in results]
fig, ax = plt.subplots(figsize=(7, 3))
ax.barh(names, [r[2] for r in results], label="empirical lower bound")
ax.scatter([min(r[1], 10) for r in results], names, color="red", zorder=3, label="claimed ε (capped at 10)")
ax.set_xlabel("ε"); ax.legend(); plt.tight_layout(); plt.show()"""),
md("""Cost: one training step per trial (a few seconds for 1000 trials on this model).
A lower bound far below the claim is expected: the accountant is a worst case and
one canary in a few hundred trials can only certify ε up to about log(trials/6)."""),
]


def main():
    from build_notebooks import write  # this folder is the script's: on sys.path

    write("09_audit.ipynb", CELLS)


if __name__ == "__main__":
    main()
