"""Opacus on the BERT encoder of `bench_transformer.py`: time and peak memory of one
training step in PyTorch, plain and with Opacus' per-example clipping, for the
comparison with kdp's rows.

The model mirrors ``bench_transformer.py``'s: token, position and segment
embeddings and a layer norm; ``--layers`` post-norm encoder blocks of width
``--width`` (2 heads, feed-forward 4·width with GELU, residuals, layer norms,
dropout 0); the first token's tanh pooler; a linear head of 2 classes; SGD at
0.01 and cross-entropy, on random token ids (vocabulary 1000). Three kinds,
each in its own subprocess:

* ``torch``: the model in plain PyTorch (``nn.MultiheadAttention``);
* ``hooks``: Opacus' ``PrivacyEngine.make_private`` with per-example gradients
  from hooks (``grad_sample_mode="hooks"``; ``ModuleValidator.fix`` replaces
  the attention by Opacus' ``DPMultiheadAttention``), C = 1, σ = 1;
* ``ghost``: the same with ghost clipping (``grad_sample_mode="ghost"``: norms
  without per-example gradients where Opacus has a norm sampler, then a second
  backward pass).

Batches have exactly ``--batch`` rows (kdp's Poisson batches vary and are
padded: this favours Opacus a little). Time: the wall time of ``--steps``
steps after ``--warmup`` warm-up steps, divided by the steps (the median of
``--repeats`` such runs); memory: peak RSS
minus the RSS after the imports (`_runs.peak_rss_mb`). PyTorch uses its
default threads.

It needs PyTorch and Opacus, which kdp does not depend on: run it in an
environment of its own, e.g. ``python -m venv opacus-env && opacus-env/bin/pip
install torch opacus numpy``:

    opacus-env/bin/python benchmarks/bench_transformer_opacus.py [--batch 32] [--length 64]
        [--width 128] [--layers 2] [--steps 10]
"""

import json
import os
import statistics
import time

import torch
from _runs import encoder_parser, print_table, run_children, use_cores
from torch import nn

KINDS = ("torch", "hooks", "ghost")
VOCABULARY = 1000


class Block(nn.Module):
    """A post-norm encoder block: attention and feed-forward, each with a residual and a layer norm."""

    def __init__(self, width):
        super().__init__()
        self.attention = nn.MultiheadAttention(width, 2, batch_first=True)
        self.attention_norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)
        self.output_norm = nn.LayerNorm(width)

    def forward(self, x):
        x = self.attention_norm(x + self.attention(x, x, x, need_weights=False)[0])
        return self.output_norm(x + self.down(nn.functional.gelu(self.up(x))))


class Classifier(nn.Module):
    """The BERT-like classifier of the module docstring."""

    def __init__(self, layers, width, length):
        super().__init__()
        self.tokens = nn.Embedding(VOCABULARY, width)
        self.positions = nn.Embedding(length, width)
        self.segments = nn.Embedding(2, width)
        self.embedding_norm = nn.LayerNorm(width)
        self.blocks = nn.ModuleList([Block(width) for _ in range(layers)])
        self.pooler = nn.Linear(width, width)
        self.head = nn.Linear(width, 2)

    def forward(self, ids):
        positions = torch.arange(ids.shape[1]).expand_as(ids).contiguous()  # Opacus views it
        x = self.tokens(ids) + self.positions(positions) + self.segments(torch.zeros_like(ids))
        x = self.embedding_norm(x)
        for block in self.blocks:
            x = block(x)
        return self.head(torch.tanh(self.pooler(x[:, 0])))


def child(kind, args):
    import numpy as np
    from _runs import peak_rss_mb

    base = peak_rss_mb()
    torch.manual_seed(0)
    model = Classifier(args.layers, args.width, args.length)
    n = 8 * args.batch
    rng = np.random.default_rng(0)
    ids = torch.tensor(rng.integers(0, VOCABULARY, (n, args.length)))
    labels = torch.tensor(rng.integers(0, 2, n))
    data = torch.utils.data.TensorDataset(ids, labels)
    loader = torch.utils.data.DataLoader(data, batch_size=args.batch, shuffle=True, drop_last=True)
    criterion = torch.nn.CrossEntropyLoss()
    if kind != "torch":
        from opacus import PrivacyEngine
        from opacus.validators import ModuleValidator

        model = ModuleValidator.fix(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        made = PrivacyEngine().make_private(
            module=model, optimizer=optimizer, data_loader=loader, noise_multiplier=1.0,
            max_grad_norm=1.0, poisson_sampling=False, grad_sample_mode=kind, criterion=criterion)
        model, optimizer = made[0], made[1]
        if kind == "ghost":
            criterion = made[2]
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    batches = [batch for batch in loader]

    def step(i):
        x, y = batches[i % len(batches)]
        optimizer.zero_grad()
        criterion(model(x), y).backward()
        optimizer.step()

    for i in range(args.warmup):
        step(i)
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        for i in range(args.steps):
            step(i)
        times.append((time.perf_counter() - start) / args.steps)
    elapsed = statistics.median(times)
    print(json.dumps({"time": elapsed, "peak_mb": peak_rss_mb() - base}))


def main():
    args = encoder_parser(__doc__.split("\n")[0], KINDS).parse_args()
    if args.child:
        use_cores(args.cores)
        if args.cores:
            torch.set_num_threads(args.cores)  # imported above, before OMP_NUM_THREADS was set
        return child(args.child, args)
    import opacus

    print(f"torch {torch.__version__}, opacus {opacus.__version__}, {args.cores or torch.get_num_threads()} threads; "
          f"BERT encoder: {args.layers} layers, width {args.width}, T={args.length}, b={args.batch}; "
          f"wall time of {args.steps} steps after {args.warmup} warm-up steps / steps, "
          f"median of {args.repeats} repeats; "
          "memory = peak RSS - RSS after imports")
    names = ("batch", "length", "width", "layers", "steps", "warmup", "repeats")
    print_table(run_children(os.path.abspath(__file__), args, names), "torch")


if __name__ == "__main__":
    main()
