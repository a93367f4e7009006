"""Public pretraining, then private fine-tuning with `kdp.finetuning`, against DP training
from scratch, on scikit-learn's bundled digits (no download).

Protocol: the "public" images pretrain an MLP ``Dense(128, relu) → Dense(128,
relu) → head`` (``--architecture convnet``: ``Conv2D(16, 3) → Conv2D(32, 3) →
MaxPool(2) → head`` on the 8×8 image; its parts are the head and everything,
Keras' LoRA covering no convolution) without privacy (Adam 1e-3, 30 epochs,
batch 64). Two kinds of public data (``--public``):

* ``other-digits`` (default): every image of the digits 0-4 (901); "private" =
  the digits 5-9, split 70/30 (stratified, seed 0): 627 training and 269 test
  images;
* ``letters``: 6,000 generated 8×8 images of the 26 lower-case letters in 21
  fonts (``suite_data``'s ``glyph_letters_8``, drawn from matplotlib's fonts, no
  download): a public corpus about five times the private data, of other
  classes and another kind of image (printed, not handwritten); "private" = all
  ten digits, split 70/30 (stratified, seed 0): 1,257 training and 540 test
  images.

The pretrained hidden layers get a new head ``Dense(classes)`` and are
fine-tuned privately with
`kdp.finetuning.fine_tuning_recipe` training the head, LoRA adapters (rank 4)
with the head, or everything. "scratch" trains the same architecture from a
random initialisation with the same batch size, epochs, δ and accountant, and
the clipping norm and learning rate `kdp.recipes` gives a model trained with
per-example clipping (C = 1, Adam 1e-2). Every σ is calibrated by
``make_private`` for its schedule, and the ε each run spent is checked against
the target. Test accuracy on the private test split, mean ± sd over seeds
(seeds of the initialisation, of the pretraining and of the DP noise).

    KERAS_BACKEND=jax python benchmarks/bench_finetune.py [--seeds 3] [--epsilons 1 3 8]
        [--architecture convnet] [--public letters]
        [--out benchmarks/results/bench_finetune_2026-11-29.md]
"""

import argparse
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402
from sklearn.model_selection import train_test_split  # noqa: E402

from kdp.finetuning import fine_tuning_recipe, parameter_counts  # noqa: E402

CONFIGS = ("head", "lora", "all", "scratch")
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _split(x, y):
    x_train, x_test, y_train, y_test = train_test_split(
        x, y, test_size=0.3, stratify=y, random_state=0)
    return (x_train, y_train), (x_test, y_test)


def other_digits():
    """Public: the digits 0-4; private: the digits 5-9 (labels 0-4)."""
    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype("float32")
    public = y < 5
    return ((x[public], y[public]), *_split(x[~public], y[~public] - 5),
            "901 images of 0-4", "5-9")


def letters():
    """Public: 6,000 generated 8×8 letters (26 classes); private: all ten digits."""
    import suite_data

    glyphs = suite_data.load("glyph_letters_8")
    xp = np.concatenate([glyphs.x_train, glyphs.x_test]).reshape(-1, 64).astype("float32")
    yp = np.concatenate([glyphs.y_train, glyphs.y_test])
    x, y = load_digits(return_X_y=True)
    return ((xp, yp), *_split((x / 16.0).astype("float32"), y),
            f"{len(xp)} generated images of 26 letters", "0-9")


#: ``--public`` → ``(public, train, test, public description, private classes)``
PUBLIC_DATA = {"other-digits": other_digits, "letters": letters}


def mlp(seed, classes):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((64,))
    hidden = keras.layers.Dense(128, activation="relu", name="h1")(inputs)
    hidden = keras.layers.Dense(128, activation="relu", name="h2")(hidden)
    return keras.Model(inputs, keras.layers.Dense(classes, name="head")(hidden))


def convnet(seed, classes):
    """``Conv2D(16, 3) → Conv2D(32, 3) → MaxPool(2) → Dense(classes)`` on the 8×8 image."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((64,))
    hidden = keras.layers.Reshape((8, 8, 1))(inputs)
    hidden = keras.layers.Conv2D(16, 3, padding="same", activation="relu", name="h1")(hidden)
    hidden = keras.layers.Conv2D(32, 3, padding="same", activation="relu", name="h2")(hidden)
    hidden = keras.layers.Flatten()(keras.layers.MaxPooling2D(2)(hidden))
    return keras.Model(inputs, keras.layers.Dense(classes, name="head")(hidden))


ARCHITECTURES = {"mlp": mlp, "convnet": convnet}
#: the parts each architecture can train (keras' LoRA covers Dense, not Conv2D)
ARCHITECTURE_CONFIGS = {"mlp": CONFIGS, "convnet": ("head", "all", "scratch")}


def pretrain(build, public, seed):
    model = build(seed, int(public[1].max()) + 1)
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss=LOSS)
    model.fit(*public, epochs=30, batch_size=64, verbose=0)
    return {name: model.get_layer(name).get_weights() for name in ("h1", "h2")}


def run(build, config, epsilon, seed, pretrained, train, test):
    classes = int(train[1].max()) + 1
    model = build(1000 + seed, classes)   # a new head; the hidden layers from the pretraining
    if config != "scratch":
        for name, weights in pretrained.items():
            model.get_layer(name).set_weights(weights)
    part = "all" if config == "scratch" else config
    recipe = fine_tuning_recipe(len(train[0]), epsilon, train=part,
                                parameters=parameter_counts(model))
    overrides = dict(reproducible=True, seed=seed)
    if config == "scratch":        # kdp.recipes' per-example clipping choices
        overrides["clipping_norm"] = 1.0
    optimizer = keras.optimizers.Adam(1e-2) if config == "scratch" else None
    dp = recipe.apply(model, LOSS, nb_classes=classes, metrics=["accuracy"], optimizer=optimizer,
                      **overrides)
    dp.fit(*train, epochs=recipe.epochs, verbose=0)
    spent = dp.privacy_spent()[0]
    assert spent <= epsilon * (1 + 1e-9), (spent, epsilon)
    return float(dp.evaluate(*test, verbose=0, batch_size=512)[1]), recipe, dp


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epsilons", nargs="+", type=float, default=[1.0, 3.0, 8.0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--out", default=None)
    parser.add_argument("--architecture", choices=sorted(ARCHITECTURES), default="mlp")
    parser.add_argument("--public", choices=sorted(PUBLIC_DATA), default="other-digits")
    args = parser.parse_args()
    build = ARCHITECTURES[args.architecture]
    start = time.time()
    public, train, test, public_text, private_classes = PUBLIC_DATA[args.public]()
    pretrained = [pretrain(build, public, s) for s in range(args.seeds)]
    rows, paired = [], []
    header = (f"backend={keras.backend.backend()}, public: {public_text}, "
              f"private: {len(train[0])} train / {len(test[0])} test images of "
              f"{private_classes}, seeds={args.seeds}, {args.architecture}")
    print(header)
    for epsilon in args.epsilons:
        auto = fine_tuning_recipe(len(train[0]), epsilon, parameters=parameter_counts(
            build(0, int(train[1].max()) + 1)))
        by_config = {}
        for config in ARCHITECTURE_CONFIGS[args.architecture]:
            t = time.time()
            results = [run(build, config, epsilon, s, pretrained[s], train, test) for s in range(args.seeds)]
            accs = by_config[config] = np.array([a for a, _, _ in results])
            recipe, dp = results[0][1], results[0][2]
            row = dict(eps=epsilon, config=config + (" (auto)" if config == auto.train else ""),
                       mean=accs.mean(), sd=accs.std(ddof=1) if len(accs) > 1 else 0.0,
                       sigma=dp.dp_parameters.noise_multiplier, b=recipe.batch_size,
                       epochs=recipe.epochs, C=dp.dp_parameters.clipping_norm,
                       params=sum(int(np.prod(v.shape)) for v in dp.trainable_variables),
                       seconds=(time.time() - t) / args.seeds)
            rows.append(row)
            print(f"eps={epsilon:g} {row['config']:>14} acc {row['mean']:.3f} ± {row['sd']:.3f} "
                  f"sigma={row['sigma']:.3f} b={row['b']} epochs={row['epochs']} C={row['C']:g} "
                  f"trained={row['params']} ({row['seconds']:.1f} s/run)", flush=True)
        paired.append((epsilon, auto.train, by_config[auto.train] - by_config["scratch"]))
    table = ["| ε | trained | test accuracy | σ | b | epochs | C | trained parameters |",
             "|---|---|---|---|---|---|---|---|"]
    table += [f"| {r['eps']:g} | {r['config']} | {r['mean']:.3f} ± {r['sd']:.3f} | "
              f"{r['sigma']:.3f} | {r['b']} | {r['epochs']} | {r['C']:g} | {r['params']} |"
              for r in rows]
    table += ["", "The recipe's choice against scratch, seed by seed (same seed: same head "
              "initialisation and noise):", "",
              "| ε | choice | accuracy − scratch's, mean ± sd | seeds ahead |", "|---|---|---|---|"]
    table += [f"| {e:g} | {part} | {d.mean():+.3f} ± {d.std(ddof=1) if len(d) > 1 else 0.0:.3f} | "
              f"{int((d > 0).sum())} of {len(d)} |" for e, part, d in paired]
    total = time.time() - start
    print("\n".join(table))
    print(f"total {total:.0f} s")
    if args.out:
        command = "KERAS_BACKEND=" + keras.backend.backend() + " python " + " ".join(
            ["benchmarks/bench_finetune.py", *sys.argv[1:]])
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(f"# Public pretraining, private fine-tuning (digits)\n\n{header}; "
                    f"{total:.0f} s on a 2-core CPU.\n\n    {command}\n\n"
                    + "\n".join(table) + "\n\n(auto): the part `fine_tuning_recipe(train=\"auto\")`"
                    " chooses at that ε.\n")


if __name__ == "__main__":
    main()
