"""Time and peak memory of one training step of a small BERT encoder: plain Keras
against kdp per-example clipping.

The model: keras_hub's ``BertBackbone`` (random weights, nothing downloaded,
dropout ``--dropout``, 0 by default; ``--layers`` encoder layers of width ``--width``, 2 heads,
feed-forward 4·width, sequences of ``--length`` tokens, vocabulary 1000)
on token ids alone (no segments, no padding), its pooled output into a
``Dense(2)`` head, SGD and sparse cross-entropy, trained three ways:

* ``keras``: the model as a plain ``keras.Model``;
* ``clipping``: kdp per-example clipping DP-SGD (``DPParameters(clipping_norm=1)``)
  on the same model, Poisson batches: every layer is of a registered kind
  (`kdp.clipping.kinds`: the encoder's ``EinsumDense`` projections, ``Dense``
  feed-forward and pooler, ``LayerNormalization``, the segment ``Embedding``,
  the token ``ReversibleEmbedding`` and the ``PositionEmbedding``), so no
  variable needs per-example gradients;
* ``passes``: as ``clipping`` with every Poisson batch padded to one size (the
  capacity, the default with ``physical_batch_size``) and its clipped sum run in passes of at most
  ``--pass-rows`` rows (``physical_batch_size``), only over the passes that hold
  drawn rows: one compiled step, and the padding at most a pass;
* ``vmap``: as ``clipping`` with the registry emptied: every variable gets
  per-example gradients (the engine's fallback), for comparison.

Each runs in its own subprocess; time and memory are measured as in
`bench_clipping_step.py` (`_common.fit_step_time`: the wall time of one ``fit``
of ``--steps`` steps after a warm-up, divided by its steps, the median of
``--repeats`` fits; memory: peak RSS
minus the RSS after the imports). On JAX, ``--buffers`` runs each kind again to
print the buffers XLA assigns to each compiled shape of the step (`_runs.xla_step_buffers`):
the step's own memory, without compilation and the runtime, which peak RSS counts.

    KERAS_BACKEND=jax python benchmarks/bench_transformer.py [--batch 32] [--length 64] [--width 128]
        [--steps 10] [--dropout 0.1] [--buffers] [--cores 1] [--kinds keras clipping passes] [--pass-rows 8]
"""

import json
import os

from _runs import encoder_parser, print_buffers, print_table, run_children, use_cores, xla_step_buffers

KINDS = ("keras", "clipping", "passes", "vmap")
VOCABULARY = 1000


def build(kind, n, args):
    import keras
    import keras_hub

    import kdp

    backbone = keras_hub.models.BertBackbone(
        vocabulary_size=VOCABULARY, num_layers=args.layers, num_heads=2, hidden_dim=args.width,
        intermediate_dim=4 * args.width, max_sequence_length=args.length, dropout=args.dropout)
    ids = keras.Input((args.length,), dtype="int32")
    out = backbone({"token_ids": ids, "segment_ids": keras.ops.zeros_like(ids),
                    "padding_mask": keras.ops.ones_like(ids)})
    logits = keras.layers.Dense(2)(out["pooled_output"])
    if kind == "keras":
        model = keras.Model(ids, logits)
    else:
        if kind == "vmap":
            from kdp.clipping.kinds import KINDS as REGISTRY

            REGISTRY.clear()
        passes = {"physical_batch_size": args.pass_rows} if kind == "passes" else {}
        model = kdp.DP_Model(ids, logits, dp_parameters=kdp.DPParameters(noise_multiplier=1.0, delta=1e-5,
                                                                          clipping_norm=1.0, **passes),
                             dataset_metadata=kdp.DatasetMetadata((args.length,), 2, n, args.batch))
    model.compile(optimizer=keras.optimizers.SGD(0.01),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def child(kind, args):
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import keras_hub  # noqa: F401  (imported by every kind, so that the base RSS counts it)
    import numpy as np
    from _common import fit_step_time, peak_rss_mb

    import kdp  # noqa: F401

    base = peak_rss_mb()
    n = 8 * args.batch
    model = build(kind, n, args)
    rng = np.random.default_rng(0)
    x = rng.integers(0, VOCABULARY, (n, args.length)).astype("int32")
    y = rng.integers(0, 2, n).astype("int32")
    elapsed = fit_step_time(model, x, y, args.batch, args.steps, args.warmup, args.repeats)
    print(json.dumps({"time": elapsed, "peak_mb": peak_rss_mb() - base}))


def main():
    parser = encoder_parser(__doc__.split("\n")[0], KINDS)
    parser.add_argument("--dropout", type=float, default=0.0,
                        help="the encoder's dropout rate: random layers draw per-example values")
    parser.add_argument("--pass-rows", "--pass_rows", type=int, default=8,
                        help="the rows of one per-example pass of the passes kind")
    parser.add_argument("--buffers", action="store_true",
                        help="JAX: also the buffer memory XLA assigns to each compiled step shape")
    args = parser.parse_args()
    if args.child:
        use_cores(args.cores)
        return child(args.child, args)
    import keras

    print(f"backend={keras.backend.backend()} BERT encoder: {args.layers} layers, width {args.width}, "
          f"T={args.length}, b={args.batch}, dropout {args.dropout}; wall time of one fit / its steps "
          f"({args.steps} steps after {args.warmup} warm-up steps), median of {args.repeats} fits; "
          f"memory = peak RSS - RSS after imports" + (f"; on {args.cores} CPU(s)" if args.cores else ""))
    names = ("batch", "length", "width", "layers", "steps", "warmup", "repeats", "dropout", "pass_rows")
    print_table(run_children(os.path.abspath(__file__), args, names), "keras")
    if keras.backend.backend() == "jax" and args.buffers:
        print_buffers(xla_step_buffers(os.path.abspath(__file__), args, names), "keras", args.batch)


if __name__ == "__main__":
    main()
