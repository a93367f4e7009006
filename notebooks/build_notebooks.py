"""Write the tutorial notebooks 01–03 of this folder with nbformat (without outputs).

Edit the cells here, then run ``python notebooks/build_notebooks.py``; never
edit the ``.ipynb`` JSON by hand. Then store them with their outputs:
``python notebooks/execute_notebooks.py 01 02 03`` executes them in place in the
full configuration on the TensorFlow backend (the notebooks are committed with
their outputs; ``tests/test_notebooks_stored.py`` checks that). The test suite
executes every notebook with nbmake in its small configuration
(``KDP_NOTEBOOK_SMALL=1``, set by the conftest files) without writing them back.
"""

import os

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

HERE = os.path.dirname(os.path.abspath(__file__))

SETUP = '''\
import os
SMALL = os.environ.get("KDP_NOTEBOOK_SMALL", "0") == "1"  # CI: a fast, small version
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import time

import keras
import matplotlib.pyplot as plt
import numpy as np

import kdp
from kdp import accounting, layers as L, losses
from kdp.pipeline import load_digits

plt.rcParams["figure.dpi"] = 72  # small stored figures
keras.utils.set_random_seed(0)  # initialisation only: the DP noise draws from the OS
T0 = time.time()
print("backend:", keras.backend.backend(), "| small mode:", SMALL)'''

FOOTER = 'print(f"notebook ran in {time.time() - T0:.0f} s")'

# --- 01: basics ---------------------------------------------------------------------

BASICS = [
    new_markdown_cell("""\
# 1. Basics: a differentially private MLP on digits

kdp trains **Lipschitz** networks with **Clipless DP-SGD** (Béthune et al. 2024):
every layer has a known bound on how much one example can move its gradient, so
kdp adds Gaussian noise calibrated to those bounds, with no per-example gradients
and no clipping. This notebook

1. loads scikit-learn's bundled 8×8 digits (no download),
2. builds a DP MLP, makes it private for a target ε in one call
   (`model.make_private`), trains it, watches ε grow and prints its privacy statement,
3. draws the privacy/utility trade-off over a few ε,
4. trains plain Keras layers with **per-example clipping** (DP-SGD), the same way.

The stored outputs come from the full configuration on the TensorFlow backend
(`python notebooks/execute_notebooks.py`). Set `KDP_NOTEBOOK_SMALL=1` for a fast,
smaller run (what the tests do)."""),
    new_code_cell(SETUP),
    new_markdown_cell("""\
## Data

`load_digits` returns arrays and a `DatasetMetadata`: the training-set size `N`,
the expected batch size `b` (the sampling rate is `q = b/N`), and `max_norm`, a
bound on every input's L2 norm. The pixels are divided by 16, a fixed map, so
the preprocessing costs no privacy."""),
    new_code_cell('''\
(x_train, y_train), (x_test, y_test), metadata = load_digits(batch_size=256)
print(x_train.shape, x_test.shape)
print(metadata)
print("sampling rate q =", round(metadata.sampling_rate, 4), "| steps per epoch:", metadata.steps_per_epoch)'''),
    new_markdown_cell("""\
## Model

Every layer is a kdp layer: `DP_BoundedInput` clips each input to norm ≤ 5 (the
input bound X₀), `DP_QuickSpectralDense` keeps its kernel orthogonal (1-Lipschitz),
`DP_GroupSort(2)` is a norm-preserving activation. The loss
`DP_TauCategoricalCrossentropy(τ)` is √2-Lipschitz for every τ.

We fix ε = 3 at δ = 1e-5 and a number of epochs, and let
`model.make_private(target_epsilon, epochs)` find the smallest noise multiplier σ
that fits: it calibrates σ for *this* model's mechanism (here the default
per-layer noise: one Gaussian of multiplier σ_eff per step, see notebook 3) and
makes ε = 3 the model's budget, so no later `fit` can exceed it."""),
    new_code_cell('''\
EPSILON, DELTA = 3.0, 1e-5
EPOCHS = 5 if SMALL else 40
WIDTH = 64 if SMALL else 256


def make_model(width=WIDTH, lr=3e-3):
    model = kdp.DP_Sequential(
        [
            L.DP_BoundedInput((64,), upper_bound=5.0),
            L.DP_QuickSpectralDense(width),
            L.DP_GroupSort(2),
            L.DP_QuickSpectralDense(10),
        ],
        dp_parameters=kdp.DPParameters(delta=DELTA),
        dataset_metadata=metadata,
    )
    model.compile(optimizer=keras.optimizers.Adam(lr),
                  loss=losses.DP_TauCategoricalCrossentropy(8.0), metrics=["accuracy"])
    return model


model = make_model()
sigma = model.make_private(target_epsilon=EPSILON, epochs=EPOCHS)
print(f"{EPOCHS} epochs = {EPOCHS * metadata.steps_per_epoch} steps -> noise multiplier "
      f"sigma = {sigma:.3f} (sigma_eff = {model.effective_noise_multiplier():.3f}), "
      f"budget epsilon_max = {model.dp_parameters.epsilon_max}")
model.summary()'''),
    new_markdown_cell("""\
The bound pass gives, for every trainable variable, a bound Δ on the norm of
one example's gradient. With the default `"per-layer"` strategy variable `v`
gets noise of std `σ·Δ_v/b` on each coordinate (`"global"` would give every
coordinate `σ·√(Σ Δ²)/b`)."""),
    new_code_cell('''\
for path, bound in kdp.compute_gradient_bounds(model).items():
    print(f"{path:45s} per-example gradient bound {bound:.3f}")
print({p: round(s, 5) for p, s in model.noise_stds().items()})'''),
    new_markdown_cell("""\
## Training

`fit` takes the arrays and samples Poisson batches itself (the accountant's
assumption). Every DP model writes ε into the progress bar after each step, and
`epsilon` and `delta` into each epoch's logs: the `History` has them, no callback
needed."""),
    new_code_cell('''\
history = model.fit(x_train, y_train, epochs=EPOCHS, validation_data=(x_test, y_test),
                    verbose=2).history
eps, delta = model.privacy_spent()
print(f"spent epsilon = {eps:.3f} at delta = {delta:g}; test accuracy = {history['val_accuracy'][-1]:.3f}")
assert eps <= EPSILON + 1e-6'''),
    new_code_cell('''\
epochs = np.arange(1, len(history["epsilon"]) + 1)
fig, (a, b) = plt.subplots(1, 2, figsize=(8, 3))
a.plot(epochs, history["accuracy"], ".-", label="train")
a.plot(epochs, history["val_accuracy"], ".-", label="test")
a.set(xlabel="epoch", ylabel="accuracy", ylim=(0, 1), title="accuracy")
a.legend()
b.plot(epochs, history["epsilon"], ".-", color="tab:red")
b.set(xlabel="epoch", ylabel="epsilon", title=f"privacy spent (delta={DELTA:g})")
plt.tight_layout()
plt.show()'''),
    new_markdown_cell("""\
## The privacy statement

`model.privacy_statement()` is a text for the model card: the mechanism, the
adjacency, the sampling, what the privacy ledger holds, ε at δ and at two smaller
δ (by default the smaller of dp-accounting's PLD and RDP bounds, each an upper
bound on ε; see notebook 3), and what the guarantee does not cover."""),
    new_code_cell('''\
print(model.privacy_statement())'''),
    new_markdown_cell("""\
## Privacy/utility trade-off

For each target ε we make a fresh model private for the same number of epochs
and train it. Smaller ε means more noise and lower accuracy. (Each point is one
run: DP training is noisy, so expect a few points of jitter.)"""),
    new_code_cell('''\
targets = [1.0, 8.0] if SMALL else [0.5, 1.0, 2.0, 4.0, 8.0]
results = []
for target in targets:
    m = make_model()
    s = m.make_private(target_epsilon=target, epochs=EPOCHS)
    m.fit(x_train, y_train, epochs=EPOCHS, verbose=0)
    acc = m.evaluate(x_test, y_test, verbose=0)[1]
    results.append((target, s, acc))
    print(f"epsilon={target:4.1f}  sigma={s:6.3f}  spent {m.privacy_spent()[0]:5.3f}  test accuracy={acc:.3f}")'''),
    new_code_cell('''\
t, s, acc = zip(*results)
plt.figure(figsize=(5, 3))
plt.semilogx(t, acc, "o-")
plt.xlabel("target epsilon (delta = 1e-5)")
plt.ylabel("test accuracy")
plt.title(f"digits, DP MLP, {EPOCHS} epochs")
plt.ylim(0, 1)
plt.grid(alpha=0.3)
plt.show()'''),
    new_markdown_cell("""\
## The other path: per-example clipping with plain Keras layers

Without Lipschitz layers, `DPParameters(clipping_norm=C)` turns on classic
DP-SGD (Abadi et al. 2016): every example's gradient is clipped to norm C and the
sum gets Gaussian noise of std σ·C. Any Keras layers and loss work; the call that
makes the model private is the same. Here: a ReLU MLP, Adam(1e-2), the same
b = 256, 20 epochs, ε = 3."""),
    new_code_cell('''\
CLIP_EPOCHS = 5 if SMALL else 20
clipped = kdp.DP_Sequential(
    [keras.Input((64,)), keras.layers.Dense(WIDTH, activation="relu"), keras.layers.Dense(10)],
    dp_parameters=kdp.DPParameters(delta=DELTA, clipping_norm=1.0),
    dataset_metadata=metadata,
)
clipped.compile(optimizer=keras.optimizers.Adam(1e-2),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                metrics=["accuracy"])
sigma = clipped.make_private(target_epsilon=EPSILON, epochs=CLIP_EPOCHS)
clip_history = clipped.fit(x_train, y_train, epochs=CLIP_EPOCHS, verbose=0).history
eps, _ = clipped.privacy_spent()
acc = clipped.evaluate(x_test, y_test, verbose=0)[1]
print(f"per-example clipping: sigma = {sigma:.3f}, epsilon per epoch: "
      + " ".join(f"{e:.2f}" for e in clip_history["epsilon"]))
print(f"spent epsilon = {eps:.3f}; test accuracy = {acc:.3f}")
assert eps <= EPSILON + 1e-6
''' + FOOTER),
]

# --- 02: convnet and certified robustness ---------------------------------------------

CONVNET = [
    new_markdown_cell("""\
# 2. A DP convnet and its certified robustness

A Lipschitz network comes with a free robustness certificate: if the network is
ℓ-Lipschitz in L2 and the top logit beats the runner-up by a margin `m`, no
perturbation of norm below `m / (ℓ√2)` can change the prediction (Anil et al. 2019).
Here we train a small convnet on the digits as 8×8×1 images, with a residual
block and L2-norm pooling, and plot the **certified accuracy** against the radius."""),
    new_code_cell(SETUP),
    new_code_cell('''\
(x_train, y_train), (x_test, y_test), metadata = load_digits(batch_size=256, flatten=False)
print(x_train.shape, metadata)'''),
    new_markdown_cell("""\
## Model

* `DP_QuickSpectralConv2D`: convolution whose reshaped kernel is kept orthogonal
  and scaled, so the layer is 1-Lipschitz for any stride and padding. Its
  gradient bound grows with √k, k the number of windows that cover one pixel:
  a 2×2 kernel with stride 2 (k = 1) is the cheapest in noise, a 3×3 kernel with
  stride 1 (k = 9) triples the bound;
* `DP_Residual([...])`: `y = (x + f(x)) / 2` (`merge="1-lip-add"`, 1-Lipschitz);
  the bound pass adds the two branches correctly;
* `DP_ScaledL2NormPooling2D(2)`: the L2 norm of each 2×2 window (1-Lipschitz,
  norm non-increasing);
* `DP_Flatten`, then a `DP_QuickSpectralDense` head.

We train at ε = 8: on 1 437 tiny images a convnet is hungrier for privacy budget
than the MLP of notebook 1 (more parameters, so more noise dimensions, and
pooling discards information). As in notebook 1, `model.make_private` calibrates
σ for the target ε and the number of epochs, and makes ε = 8 the model's budget."""),
    new_code_cell('''\
EPSILON, DELTA = 8.0, 1e-5
EPOCHS = 3 if SMALL else 40
WIDTH = 16 if SMALL else 128

model = kdp.DP_Sequential(
    [
        L.DP_BoundedInput((8, 8, 1), upper_bound=5.0),
        L.DP_QuickSpectralConv2D(WIDTH, 2, strides=2, padding="valid"),   # 8x8 -> 4x4, k = 1
        L.DP_GroupSort(2),
        L.DP_Residual([L.DP_QuickSpectralConv2D(WIDTH, 1), L.DP_GroupSort(2)]),
        L.DP_ScaledL2NormPooling2D(2),                                  # 4x4 -> 2x2
        L.DP_Flatten(),
        L.DP_QuickSpectralDense(10),
    ],
    dp_parameters=kdp.DPParameters("global", delta=DELTA),
    dataset_metadata=metadata,
)
model.compile(optimizer=keras.optimizers.Adam(3e-3),
              loss=losses.DP_TauCategoricalCrossentropy(16.0), metrics=["accuracy"])
sigma = model.make_private(target_epsilon=EPSILON, epochs=EPOCHS)
print(f"sigma = {sigma:.3f} for {EPOCHS} epochs at epsilon = {EPSILON}")
print("Lipschitz constant of the network:", kdp.lipschitz_constant(model))
for path, bound in kdp.compute_gradient_bounds(model).items():
    print(f"  {path:60s} {bound:.3f}")'''),
    new_code_cell('''\
history = model.fit(x_train, y_train, epochs=EPOCHS, validation_data=(x_test, y_test),
                    verbose=2).history
eps, _ = model.privacy_spent()
assert eps <= EPSILON + 1e-6
print(f"epsilon = {eps:.3f}, test accuracy = {history['val_accuracy'][-1]:.3f}")'''),
    new_markdown_cell("""\
## Certified accuracy against the radius

For each test image: the margin between the top two logits, divided by
`ℓ·√2` (ℓ from `kdp.lipschitz_constant`), is a radius within which the
prediction provably cannot change. An example counts at radius `r` if it is
classified correctly **and** its certified radius is at least `r`. For scale:
the images have pixels in [0, 1] and a typical norm of about 3 to 4."""),
    new_code_cell('''\
logits = model.predict(x_test, verbose=0)
lip = float(kdp.lipschitz_constant(model))
top2 = np.sort(logits, axis=1)[:, -2:]
certified_radius = (top2[:, 1] - top2[:, 0]) / (lip * np.sqrt(2))
correct = logits.argmax(axis=1) == y_test
radii = np.linspace(0, 0.5, 26)
certified_accuracy = [(correct & (certified_radius >= r)).mean() for r in radii]
for r in (0.0, 0.05, 0.1, 0.2):
    print(f"radius {r:.2f}: certified accuracy {(correct & (certified_radius >= r)).mean():.3f}")

plt.figure(figsize=(5, 3.5))
plt.plot(radii, certified_accuracy, ".-")
plt.xlabel("L2 radius (pixels in [0, 1])")
plt.ylabel("certified accuracy")
plt.title(f"DP convnet on digits, epsilon = {eps:.2f}")
plt.ylim(0, 1)
plt.grid(alpha=0.3)
plt.show()'''),
    new_markdown_cell("""\
A sanity check that can fail: no perturbation inside the certified radius may
change a prediction. We try random directions scaled to 99% of each example's
radius (a weak attack, but a wrong certificate would show up)."""),
    new_code_cell('''\
rng = np.random.default_rng(0)
direction = rng.normal(size=x_test.shape).astype("float32")
direction /= np.linalg.norm(direction.reshape(len(direction), -1), axis=1).reshape(-1, 1, 1, 1)
perturbed = x_test + 0.99 * certified_radius.reshape(-1, 1, 1, 1) * direction
changed = model.predict(perturbed, verbose=0).argmax(1) != logits.argmax(1)
print("predictions changed inside their certified radius:", int(changed.sum()))
assert not changed.any()
''' + FOOTER),
]

# --- 03: accounting ----------------------------------------------------------------------

ACCOUNTING = [
    new_markdown_cell("""\
# 3. Privacy accounting: per-layer vs global noise, RDP vs PLD, choosing σ

kdp accounts under **add/remove-one** adjacency with **Poisson sampling** at
rate `q = b/N`: every step is a Poisson-subsampled Gaussian mechanism, and the
steps compose in `dp-accounting`'s accountants. By default kdp reports the smaller
of the PLD and RDP bounds on ε (`accountant="tightest"`); `accountant="pld"` or
`"rdp"` asks for one of them.
This notebook needs almost no training: it is about the numbers."""),
    new_code_cell(SETUP),
    new_code_cell('''\
(x_train, y_train), (x_test, y_test), metadata = load_digits(batch_size=256)
q, spe, DELTA = metadata.sampling_rate, metadata.steps_per_epoch, 1e-5
print(f"N = {metadata.nb_samples_train}, b = {metadata.batch_size}, q = {q:.4f}, "
      f"{spe} steps per epoch, delta = {DELTA} (< 1/N = {1 / metadata.nb_samples_train:.1e})")


WIDTH = 32 if SMALL else 128


def make_model(strategy, sigma):
    model = kdp.DP_Sequential(
        [L.DP_BoundedInput((64,), upper_bound=5.0), L.DP_QuickSpectralDense(WIDTH),
         L.DP_GroupSort(2), L.DP_QuickSpectralDense(WIDTH), L.DP_GroupSort(2),
         L.DP_QuickSpectralDense(10)],
        dp_parameters=kdp.DPParameters(strategy, noise_multiplier=sigma, delta=DELTA),
        dataset_metadata=metadata,
    )
    model.compile(optimizer=keras.optimizers.Adam(3e-3),
                  loss=losses.DP_TauCategoricalCrossentropy(8.0), metrics=["accuracy"])
    return model'''),
    new_markdown_cell("""\
## Per-layer vs global noise

* `"global"`: one sensitivity for the whole gradient, `√(Σ_v Δ_v²)`; every
  coordinate gets noise of std `σ·√(Σ Δ_v²)/b`. The step is one Gaussian
  mechanism with multiplier σ.
* `"per-layer"`: variable `v` gets std `σ·c_v·Δ_v/b`. Each variable is its own
  Gaussian mechanism; together they are equivalent to one Gaussian with
  `σ_eff = (Σ_v (σ c_v)^-2)^(-1/2)`, i.e. `σ/√n` for `n` variables with `c_v = 1`.

So at the same σ, per-layer noise spends **more** ε; to compare them fairly,
give per-layer the σ whose σ_eff equals the global σ."""),
    new_code_cell('''\
SIGMA, EPOCHS = 4.0, 40
glob = make_model("global", SIGMA)
per_layer = make_model("per-layer", SIGMA)
n_vars = len(glob.trainable_variables)
matched = make_model("per-layer", SIGMA * np.sqrt(n_vars))  # same sigma_eff as global

for name, m in [("global", glob), ("per-layer, same sigma", per_layer),
                ("per-layer, sigma*sqrt(n)", matched)]:
    stds = m.noise_stds()
    eps, _ = accounting.get_eps_delta(m, EPOCHS)
    print(f"{name:26s} sigma_eff={m.effective_noise_multiplier():.3f}  "
          f"epsilon after {EPOCHS} epochs={eps:6.3f}")
    for path, std in stds.items():
        print(f"    {path:42s} noise std {std:.5f}")'''),
    new_markdown_cell("""\
With the same σ_eff both strategies cost the same ε; they differ in where the
noise goes. Per-layer noise is proportional to each variable's own bound, global
noise is the same everywhere, so per-layer helps when the bounds differ a lot
between layers (e.g. a bias with a small bound next to a large kernel)."""),
    new_markdown_cell("""\
## Calibrating σ for the model's own noise: `make_private`

`accounting.calibrate_noise_multiplier(ε, q, steps, δ)` returns the σ of **one
Gaussian of multiplier σ per step**: right for `"global"` noise (and for
per-example clipping), not for per-layer noise, whose steps are one Gaussian of
σ_eff < σ. A per-layer model given such a σ warns when `fit` starts, with the ε
those steps really cost. `model.make_private(target_epsilon, epochs)` calibrates
for the model's own mechanism (strategy, clipping, sampling, planned releases,
what the ledger already holds) and makes the target the model's budget."""),
    new_code_cell('''\
import warnings

TARGET = 3.0
plain_sigma = accounting.calibrate_noise_multiplier(TARGET, q, EPOCHS * spe, DELTA)
model = make_model("per-layer", plain_sigma)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    model.fit(x_train, y_train, epochs=1, verbose=0)
print("plain sigma on a per-layer model:",
      *[w.message for w in caught if "calibrated" in str(w.message)], sep="\\n")

for strategy in ("global", "per-layer"):
    m = make_model(strategy, 1.0)
    s = m.make_private(target_epsilon=TARGET, epochs=EPOCHS)
    eps, _ = accounting.get_eps_delta(m, EPOCHS)
    print(f"{strategy:9s} make_private: sigma={s:6.3f}  sigma_eff={m.effective_noise_multiplier():.3f}  "
          f"epsilon after {EPOCHS} epochs={eps:.3f}  epsilon_max={m.dp_parameters.epsilon_max}")
    assert eps <= TARGET + 1e-6'''),
    new_markdown_cell("""\
## RDP vs PLD

Both accountants are upper bounds on the true ε; the PLD (privacy loss
distribution) accountant is numerically tighter here (by about 10 %) and
slower. kdp's default takes the smaller of the two: every other ε and σ in
this notebook is the tighter one."""),
    new_code_cell('''\
epochs_grid = [1, 20] if SMALL else [1, 5, 10, 20, 40, 80]
rdp = [accounting.compute_epsilon(SIGMA, q, e * spe, DELTA, accountant="rdp") for e in epochs_grid]
pld = [accounting.compute_epsilon(SIGMA, q, e * spe, DELTA, accountant="pld") for e in epochs_grid]
for e, a, b in zip(epochs_grid, rdp, pld):
    print(f"{e:3d} epochs: RDP epsilon={a:6.3f}  PLD epsilon={b:6.3f}  ({100 * (1 - b / a):.0f}% lower)")
plt.figure(figsize=(5, 3.5))
plt.plot(epochs_grid, rdp, "o-", label="RDP")
plt.plot(epochs_grid, pld, "s-", label="PLD")
plt.xlabel("epochs")
plt.ylabel("epsilon")
plt.title(f"sigma = {SIGMA}, q = {q:.3f}, delta = {DELTA:g}")
plt.legend()
plt.grid(alpha=0.3)
plt.show()'''),
    new_markdown_cell("""\
## Poisson sampling vs shuffled batches

The amplification by subsampling that makes DP-SGD affordable holds for Poisson
sampling, which is what `fit` does with arrays. With `DPParameters(sampling="shuffle")`
(fixed-size shuffled batches, e.g. a `tf.data` pipeline) kdp does **not** claim
amplification: each epoch is one Gaussian release per record under replace-one
adjacency (sensitivity doubled). The price is large:"""),
    new_code_cell('''\
for e in (1, 10, 40):
    poisson = accounting.compute_epsilon(SIGMA, q, e * spe, DELTA)
    shuffle = accounting.compute_epsilon(SIGMA, q, e * spe, DELTA, sampling="shuffle", steps_per_epoch=spe)
    print(f"{e:3d} epochs: Poisson epsilon={poisson:6.3f}   shuffled (no amplification) epsilon={shuffle:8.3f}")'''),
    new_markdown_cell("""\
## Choosing σ for a target ε and a number of epochs

`calibrate_noise_multiplier(ε, q, steps, δ)` returns the smallest σ whose `steps`
steps cost at most ε (for one Gaussian per step; `make_private` does the same for
a model). More epochs need more noise per step; the best number of epochs is a
trade-off (see notebook 1). Conversely `get_max_epochs(ε, model)` tells how many
epochs a model's σ allows."""),
    new_code_cell('''\
targets = [1.0, 3.0, 8.0]
epochs_grid = [5, 20, 60] if SMALL else [2, 5, 10, 20, 40, 60, 100]
plt.figure(figsize=(5, 3.5))
for target in targets:
    sigmas = [accounting.calibrate_noise_multiplier(target, q, e * spe, DELTA) for e in epochs_grid]
    plt.plot(epochs_grid, sigmas, "o-", label=f"epsilon = {target:g}")
    print(f"epsilon={target:g}: " + ", ".join(f"{e} ep -> sigma {s:.2f}" for e, s in zip(epochs_grid, sigmas)))
plt.xlabel("epochs")
plt.ylabel("noise multiplier sigma")
plt.title(f"calibrated sigma (q = {q:.3f}, delta = {DELTA:g})")
plt.legend()
plt.grid(alpha=0.3)
plt.show()'''),
    new_code_cell('''\
model = make_model("per-layer", 1.0)
sigma = model.make_private(target_epsilon=3.0, epochs=40)
print(f"sigma = {sigma:.3f}: get_max_epochs(3.0) = {accounting.get_max_epochs(3.0, model)}")
print("epsilon after 40 epochs:", accounting.get_eps_delta(model, 40))
assert accounting.get_max_epochs(3.0, model) == 40'''),
    new_markdown_cell("""\
The budget is enforced during training too. `make_private` makes its target the
model's `epsilon_max`; `DP_Accountant(epsilon_max=...)` adds a budget for one
`fit` (with `accountant="pld"` or `"rdp"` for one accountant's ε instead of the
smaller of both, and `log_fn="logging"`, if you want them). `fit`
stops, with a warning, before the step that would exceed a budget."""),
    new_code_cell('''\
model = make_model("global", 2.5)  # too little noise for 50 epochs
history = model.fit(x_train, y_train, epochs=50, verbose=0,
                    callbacks=[kdp.DP_Accountant(epsilon_max=2.0)]).history
eps, _ = model.privacy_spent()
print(f"stopped after {model.privacy_ledger.training_steps()} steps "
      f"({len(history['epsilon'])} epochs started), epsilon = {eps:.3f} <= 2")
assert eps <= 2.0
''' + FOOTER),
]


#: the last paragraph of the introduction of notebooks 10 and later
STORED_OUTPUTS = """The stored outputs come from the full configuration on the TensorFlow backend
(`python notebooks/execute_notebooks.py`). Set `KDP_NOTEBOOK_SMALL=1` for a fast,
smaller run (what the tests do)."""


def setup_cell(imports, constants=""):
    """The first code cell of notebooks 10 and later: the small mode, ``imports``,
    the initialisation seed, ``constants`` (lines), and the backend printed."""
    return new_code_cell(f"""import os
SMALL = os.environ.get("KDP_NOTEBOOK_SMALL", "0") == "1"  # CI: a fast, small version
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

{imports}

keras.utils.set_random_seed(0)  # initialisation only: the DP noise draws from the OS
{constants}print("backend:", keras.backend.backend(), "| small mode:", SMALL)""")


def write(name, cells):
    nb = new_notebook(cells=cells)
    for i, cell in enumerate(nb.cells):
        cell.id = f"cell-{i:02d}"  # stable ids: regenerating gives the same file
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.metadata["language_info"] = {"name": "python"}
    nbformat.validate(nb)
    path = os.path.join(HERE, name)
    with open(path, "w", encoding="utf-8") as f:
        nbformat.write(nb, f)
    print("wrote", path)


if __name__ == "__main__":
    write("01_basics.ipynb", BASICS)
    write("02_convnet_certified.ipynb", CONVNET)
    write("03_accounting.ipynb", ACCOUNTING)
