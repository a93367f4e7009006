"""Writes ``notebooks/10_data_from_disk.ipynb`` (without outputs): ``python notebooks/build_10_data_from_disk.py``;
then ``python notebooks/execute_notebooks.py 10`` stores it with the outputs of a full run."""

import os
import sys

import nbformat as nbf

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # this folder's helpers
from build_notebooks import STORED_OUTPUTS, setup_cell, write  # noqa: E402

md = nbf.v4.new_markdown_cell
code = nbf.v4.new_code_cell
CELLS = [
md("""# Training on data that does not fit in memory: `kdp.RecordSource`

Poisson sampling needs random access, not memory: each step draws the indices of
its records (each record independently, with probability q = b/N) and needs
those records only. `kdp.RecordSource(records, labels=..., transform=...)` wraps
anything with `len()` and `[i]` (a list of file names, an `np.memmap`, an HDF5
dataset, a Hugging Face `datasets.Dataset`, a grain source), and `fit` reads
only the records each step draws. This notebook

1. writes scikit-learn's bundled digits (no download) as PNG files and trains
   on the files, decoded by a `transform`;
2. checks that ε is the same as for the same model trained on in-memory arrays;
3. trains on an `np.memmap`;
4. shows a bad record refused before its step, with nothing charged;
5. notes several processes and streams (`tf.data`).

""" + STORED_OUTPUTS),
setup_cell("""import tempfile

import keras
import numpy as np
from PIL import Image
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import kdp
from kdp import layers as L, losses
from kdp.training import DataValidationError"""),
md("""## 1. Images on disk

Each of the 1,797 digits (8×8, pixels 0..16) becomes one grayscale PNG in a
temporary folder; the labels stay in an array. 80 % of the files are the
training records, the rest the test set."""),
code("""folder = tempfile.mkdtemp(prefix="kdp_digits_")
digits = load_digits()
paths = []
for i, image in enumerate(digits.images):
    paths.append(os.path.join(folder, f"digit_{i:04d}.png"))
    Image.fromarray(np.round(image * 255 / 16).astype("uint8")).save(paths[-1])
train_paths, test_paths, y_train, y_test = train_test_split(
    paths, digits.target, test_size=0.2, stratify=digits.target, random_state=0)
print(len(train_paths), "training files,", len(test_paths), "test files in", folder)"""),
md("""`decode` turns one file into one input: a `(64,)` vector in [0, 1]. It is a
fixed map of the record alone (no statistic of the data), so it costs no
privacy, and it is deterministic: record `i` is the same at every read, which
the accounting assumes (a random augmentation here would break that promise).

The test set is decoded into arrays once: evaluating the model is not a
training release."""),
code("""reads = []  # the files decode opened (list.append is safe across reader threads)

def decode(path):
    reads.append(path)
    with Image.open(path) as image:
        return np.asarray(image, dtype="float32").reshape(64) / 255.0

x_test = np.stack([decode(p) for p in test_paths])
reads.clear()"""),
md("""The model is notebook 1's MLP with a fixed noise multiplier and no budget
(notebook 1 shows `make_private`), so that section 4 can train it further, and
with `batch_shapes=1`: every batch is padded to one size, so each model
compiles its step once (quicker for these short runs; the default, three
sizes, pads less on long ones).
`DatasetMetadata` gives N, the number of training records, and b, the expected
batch size: the source must hold exactly N records.

`fit(kdp.RecordSource(train_paths, labels=y_train, transform=decode))` draws
each step's indices, opens those files only, validates the batch and pads it
(on an accelerator it prepares up to two batches ahead of the step;
`readers=` and `processes=True` decode a batch's files in parallel)."""),
code("""EPOCHS = 5 if SMALL else 40
WIDTH = 64 if SMALL else 256
SIGMA = 4.0
metadata = kdp.DatasetMetadata((64,), 10, nb_samples_train=len(train_paths), batch_size=256)


def make_model():
    model = kdp.DP_Sequential(
        [L.DP_BoundedInput((64,), upper_bound=5.0), L.DP_QuickSpectralDense(WIDTH), L.DP_GroupSort(2),
         L.DP_QuickSpectralDense(10)],
        dp_parameters=kdp.DPParameters(noise_multiplier=SIGMA, delta=1e-5, batch_shapes=1),
        dataset_metadata=metadata)
    model.compile(optimizer=keras.optimizers.Adam(3e-3),
                  loss=losses.DP_TauCategoricalCrossentropy(8.0), metrics=["accuracy"])
    return model


source = kdp.RecordSource(train_paths, labels=y_train, transform=decode)
model = make_model()
model.fit(source, epochs=EPOCHS, verbose=2)
steps = model.privacy_ledger.training_steps()
print(source, "| steps:", steps)
print(f"files opened: {len(reads)} in {steps} steps, about b = {metadata.batch_size} per step "
      f"(reading every file at every step would be {steps * len(train_paths)})")
eps_files = model.privacy_spent()[0]
print(f"files:  epsilon = {eps_files:.4f}, test accuracy = {model.evaluate(x_test, y_test, verbose=0)[1]:.3f}")"""),
md("""## 2. The same ε as in-memory arrays

A source is sampled and accounted exactly like arrays: the same sampling rate
b/N, the same ledger entry per step. The same model trained on the decoded
arrays for the same number of steps has the same ε."""),
code("""x_train = np.stack([decode(p) for p in train_paths])  # the same records, in memory
in_memory = make_model()
in_memory.fit(x_train, y_train, epochs=EPOCHS, verbose=0)
eps_arrays = in_memory.privacy_spent()[0]
print(f"files:  {model.privacy_ledger.training_steps()} steps, epsilon = {eps_files:.6f}")
print(f"arrays: {in_memory.privacy_ledger.training_steps()} steps, epsilon = {eps_arrays:.6f}")
assert eps_files == eps_arrays"""),
md("""## 3. A memmap (or an HDF5 dataset)

`fit(x=memmap, y=labels)` takes the same path by itself: the memmap is never
read whole; each step reads its drawn rows (one fancy-indexing call, sorted
indices) and validates them. An HDF5 dataset, a Hugging Face dataset or a
grain source is wrapped the same way:

```python
h5 = h5py.File("digits.h5", "r")
model.fit(kdp.RecordSource(h5["x"], labels=h5["y"][:]), epochs=EPOCHS)
hf = datasets.load_from_disk("digits")   # records {"image": a PIL image, "label": an int}
to_xy = lambda r: (np.asarray(r["image"], "float32").reshape(64) / 255.0, r["label"])
model.fit(kdp.RecordSource(hf, transform=to_xy), epochs=EPOCHS)
```

Without `labels`, each record (after `transform`) is `(x, y)` or `(x, y, sample_weight)`."""),
code("""memmap_path = os.path.join(folder, "x_train.float32")
stored = np.memmap(memmap_path, dtype="float32", mode="w+", shape=x_train.shape)
stored[:] = x_train
stored.flush()
del stored
x_disk = np.memmap(memmap_path, dtype="float32", mode="r", shape=x_train.shape)
from_memmap = make_model()
from_memmap.fit(x_disk, y_train, epochs=EPOCHS, verbose=0)
print(f"memmap: {from_memmap.privacy_ledger.training_steps()} steps, "
      f"epsilon = {from_memmap.privacy_spent()[0]:.6f}, "
      f"test accuracy = {from_memmap.evaluate(x_test, y_test, verbose=0)[1]:.3f}")"""),
md("""## 4. A bad record is refused before its step

Each drawn batch is read and validated before the step that uses it. A file
that cannot be decoded, a record of the wrong shape, a NaN or a label the loss
cannot take refuses the step with `DataValidationError`, naming the record's
index; that step does not run and nothing is charged for it. The first batch
is read before the first step, and with prefetch (on an accelerator) batches
are read up to two steps ahead, so `fit` may stop a step or more before the one
that drew the record (possibly before the first step): a step that did not run
is not charged. The steps that ran before it are in the ledger.

Here one training file is replaced by an empty file, and the model of section 1
trains on until a step draws it (each step draws it with probability
b/N = 256/1437 ≈ 18 %)."""),
code("""bad = 7
with open(train_paths[bad], "wb"):
    pass  # an empty file: not a PNG any more


class CountSteps(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.ran = 0  # steps that ran in this fit

    def on_train_batch_end(self, batch, logs=None):
        self.ran += 1


counter = CountSteps()
before = model.privacy_ledger.training_steps()
try:
    model.fit(source, epochs=100, verbose=0, callbacks=[counter])
except DataValidationError as error:
    print("refused:", error)
after = model.privacy_ledger.training_steps()
print(f"ledger: {before} steps before, {counter.ran} steps ran in this fit, {after} steps after")
assert after == before + counter.ran"""),
md("""The same holds for values: a NaN row in the memmap is refused when a step
draws it, with its row named."""),
code("""with_nan = np.memmap(memmap_path, dtype="float32", mode="r+", shape=x_train.shape)
with_nan[11, 5] = np.nan
with_nan.flush()
counter = CountSteps()
before = from_memmap.privacy_ledger.training_steps()
try:
    from_memmap.fit(x_disk, y_train, epochs=100, verbose=0, callbacks=[counter])
except DataValidationError as error:
    print("refused:", error)
after = from_memmap.privacy_ledger.training_steps()
print(f"ledger: {before} steps before, {counter.ran} steps ran in this fit, {after} steps after")
assert after == before + counter.ran"""),
md("""## 5. Several processes; streams

**Several processes.** Every process passes its own range of one shared source
(`start`, `stop`) and samples it at the global rate b/N; `DatasetMetadata`
describes the whole dataset. Before any step, `fit`'s handshake checks that the
ranges partition one source of exactly N records (the same `name`, the same
size), so no record is sampled twice. By default a memmap is named by its file name,
an HDF5 dataset by its file and path; pass `name=` otherwise. The rest is as in
"Training on several machines" in the README:

```python
n = len(records)
start, stop = rank * n // processes, (rank + 1) * n // processes
model.fit(kdp.RecordSource(records, labels=labels, start=start, stop=stop), epochs=EPOCHS)
```

**Streams.** A `tf.data` pipeline or a generator has no random access, so it
cannot be Poisson-sampled: `fit` refuses it and points to `RecordSource`. It can
be trained with `DPParameters(sampling="shuffle")`, on batches of at most b
records that the pipeline shuffles itself (a record twice in a batch is refused).
kdp does not draw those batches, so it cannot prove that a record is used once
per epoch: each step is accounted as one Gaussian release without amplification,
a much larger ε than kdp's own shuffled passes over arrays or a `RecordSource`:

```python
model = kdp.DP_Sequential(layers, dataset_metadata=metadata,
                          dp_parameters=kdp.DPParameters(noise_multiplier=SIGMA, delta=1e-5, sampling="shuffle"))
model.fit(dataset.shuffle(n).batch(b, drop_remainder=True), epochs=EPOCHS)   # dataset: a tf.data.Dataset of (x, y)
```"""),
]


def main():
    write("10_data_from_disk.ipynb", CELLS)


if __name__ == "__main__":
    main()
