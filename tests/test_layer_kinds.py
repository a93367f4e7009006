"""Per-example norms of the registered layer kinds (`kdp.clipping.kinds`).

For every kind, and for models mixing them, the clipped sum equals the
brute-force one of `test_clipping` (one ordinary gradient per example, clipped
by hand), each example's contribution has norm at most ``C``, and the covered
layers' variables get no per-example gradients. Runs on whichever
``KERAS_BACKEND`` is set.
"""

import math

import keras
import numpy as np
import pytest
from test_clipping import SCCE, _brute_force, _clip_by_hand, _median_norm, clipped_sum

from kdp import autodiff, clipping
from kdp.clipping.kinds import (conv, dense, depthwise_conv, einsum_dense, embedding, linear,
                                normalization, position_embedding, reversible_embedding)
from kdp.model import DP_Model, DPParameters
from kdp.pipeline import DatasetMetadata

N, BATCH, T, VOCAB = 100, 5, 6, 12
layers = keras.layers


def _tokens(vocabulary=VOCAB, length=T):
    ids = np.random.default_rng(1).integers(0, vocabulary, (BATCH, length)).astype("int32")
    ids[1, :3] = ids[1, 3:]  # repeated ids: the embedding's per-example norm has cross terms
    return keras.Input((length,), dtype="int32"), ids


def _features(shape):
    return keras.Input(shape), np.random.default_rng(1).normal(size=(BATCH, *shape)).astype("float32")


def _head(h):
    if len(h.shape) > 2:
        h = layers.Flatten()(h)
    return layers.Dense(3, name="head")(h)


def _dense():
    inputs, x = _features((T, 4))
    h = layers.Dense(5, activation="tanh", name="rows")(inputs)      # formed (4·5 ≤ 2·T·(4 + 5))
    shared = layers.Dense(8, use_bias=False, name="shared")          # called twice: 2T rows
    return inputs, _head(shared(h) + shared(h * h)), x


def _einsum_dense():
    inputs, x = _features((T, 4))
    q = layers.EinsumDense("abc,cde->abde", (None, 2, 3), bias_axes="de", name="q")(inputs)
    o = layers.EinsumDense("abcd,cde->abe", (None, 5), bias_axes="e", activation="relu", name="o")(q)
    e = layers.EinsumDense("...b,bc->...c", (4,), name="ellipsis")(o)
    r = layers.EinsumDense("abc,cd->abd", (T, 3), bias_axes="b", name="row_bias")(inputs)
    return inputs, _head(layers.GlobalAveragePooling1D()(layers.Concatenate()([e, r]))), x


def _not_a_matmul():
    """``b`` is in all three operands: left to per-example gradients."""
    inputs, x = _features((3, 4))
    h = layers.EinsumDense("abc,bcd->abd", (3, 2), name="per_row")(inputs)
    return inputs, _head(h), x


def _embedding():
    inputs, x = _tokens()
    gram = layers.Embedding(VOCAB, 4, name="gram")(inputs)                  # T² = 36 <= 12·4
    table = layers.Embedding(3, 2, name="table")(keras.ops.mod(inputs, 3))  # T² > 3·2: materialised
    shared = layers.Embedding(VOCAB, 3, name="shared")
    h = layers.Concatenate()([gram, table, shared(inputs), shared(keras.ops.flip(inputs, axis=1))])
    return inputs, _head(layers.GlobalAveragePooling1D()(h)), x


def _reversible_embedding():
    """Tied tables read by lookups and by the reverse projection (Gram form and
    materialised), untied ones (Gram form and formed), keras_hub's subclass."""
    keras_hub = pytest.importorskip("keras_hub")
    inputs, x = _tokens()
    unit = keras.initializers.RandomNormal(stddev=0.5)  # lookup and projection gradients of one size
    tied = layers.ReversibleEmbedding(64, 64, embeddings_initializer=unit, logit_soft_cap=3.0,
                                      name="tied")  # 2T rows: 64·64 > 2·2T·(64 + 64), Gram
    small = keras_hub.layers.ReversibleEmbedding(3, 2, name="small")  # 3·2 ≤ 2·2T·(3 + 2): formed
    untied = layers.ReversibleEmbedding(64, 64, tie_weights=False, name="untied")  # lookups and kernel: Gram
    small_untied = layers.ReversibleEmbedding(3, 2, tie_weights=False, name="small_untied")  # kernel: formed
    logits = [tied(tied(inputs), reverse=True), small(small(keras.ops.mod(inputs, 3)), reverse=True),
              untied(untied(keras.ops.flip(inputs, axis=1)), reverse=True),
              small_untied(small_untied(keras.ops.mod(inputs + 1, 3)), reverse=True)]
    return inputs, _head(layers.GlobalAveragePooling1D()(layers.Concatenate()(logits))), x


def _position_embedding():
    """One table called once, one called twice on overlapping rows (cross terms)."""
    keras_hub = pytest.importorskip("keras_hub")
    inputs, x = _features((T, 4))
    once = keras_hub.layers.PositionEmbedding(T, name="once")
    twice = keras_hub.layers.PositionEmbedding(T + 2, name="twice")
    h = inputs * once(inputs) + twice(inputs)  # rows 0..5
    shifted = twice(h[:, 2:], start_index=3)   # rows 3..6
    return inputs, _head(layers.Concatenate(axis=1)([h * h, shifted])), x


def _normalization():
    inputs, x = _features((T, 4))
    h = layers.Dense(4, name="mix")(inputs)
    h = layers.LayerNormalization(name="last")(h)
    h = layers.LayerNormalization(axis=[1, 2], name="two_axes")(h)
    h = layers.LayerNormalization(center=False, name="scale_only")(h)
    h = layers.RMSNormalization(name="rms")(h)
    return inputs, _head(h), x


def _conv():
    inputs, x = _features((6, 6, 2))
    valid = layers.Conv2D(3, 3, activation="relu", name="valid")(inputs)  # formed
    gram = layers.Conv2D(16, 3, name="gram")(valid)  # Gram: T = 4 positions, 27·16 > 2·T·(27 + 16)
    h = layers.Conv2D(2, (2, 3), strides=(1, 2), padding="same", name="same")(valid)  # padded after only
    seq = layers.Reshape((h.shape[1] * h.shape[2], 2))(h)
    seq = layers.Conv1D(2, 2, dilation_rate=2, padding="same", use_bias=False, name="dilated")(seq)
    causal = layers.Conv1D(2, 2, padding="causal", name="causal")(seq)  # not covered: per-example
    return inputs, _head(layers.Concatenate()([layers.Flatten()(causal), layers.Flatten()(gram)])), x


def _depthwise():
    """Depthwise convolutions (valid, strided and padded, dilated, 1-D) and separable ones,
    one called twice, one whose pointwise kernel takes the Gram form."""
    inputs, x = _features((7, 7, 2))
    h = layers.DepthwiseConv2D(3, depth_multiplier=2, activation="tanh", name="depthwise")(inputs)
    h = layers.DepthwiseConv2D((2, 3), strides=2, padding="same", use_bias=False, name="strided")(h)
    shared = layers.SeparableConv2D(4, 2, padding="same", depth_multiplier=2, name="shared")
    h = shared(h) + shared(h * h)
    gram = layers.SeparableConv2D(32, 2, depth_multiplier=4, name="gram")(h)  # 4 rows: 16·32 > 2·4·(16 + 32)
    seq = layers.Reshape((h.shape[1] * h.shape[2], 4))(h)
    seq = layers.DepthwiseConv1D(2, dilation_rate=2, padding="same", name="dilated")(seq)
    seq = layers.SeparableConv1D(3, 2, name="separable_1d")(seq)
    return inputs, _head(layers.Concatenate()([layers.Flatten()(seq), layers.Flatten()(gram)])), x


def _mixed():
    """Embedding → LayerNorm → one attention head of EinsumDense → Dense head."""
    inputs, x = _tokens()
    h = layers.LayerNormalization(name="norm")(layers.Embedding(VOCAB, 8, name="embed")(inputs))
    q, k, v = (layers.EinsumDense("abc,cde->abde", (None, 2, 4), bias_axes=b, name=n)(h)
               for n, b in (("query", "de"), ("key", None), ("value", "de")))  # a key bias's gradient is 0
    scores = keras.ops.softmax(keras.ops.einsum("aqhd,akhd->ahqk", q, k) / 2.0, axis=-1)
    h = keras.ops.einsum("ahqk,akhd->aqhd", scores, v)
    h = layers.EinsumDense("abcd,cde->abe", (None, 8), bias_axes="e", name="attention_output")(h)
    return inputs, _head(layers.GlobalAveragePooling1D()(h)), x


def _bert():
    """keras_hub's BERT encoder on token ids (no segments, no padding)."""
    keras_hub = pytest.importorskip("keras_hub")
    backbone = keras_hub.models.BertBackbone(vocabulary_size=VOCAB, num_layers=1, num_heads=2, hidden_dim=8,
                                             intermediate_dim=8, max_sequence_length=T, dropout=0)
    inputs, x = _tokens()
    out = backbone({"token_ids": inputs, "segment_ids": keras.ops.zeros_like(inputs),
                    "padding_mask": keras.ops.ones_like(inputs)})
    return inputs, _head(out["pooled_output"]), x


# case -> (builder, names of the layers the registry covers)
CASES = {
    "dense": (_dense, ["head", "rows", "shared"]),
    "conv": (_conv, ["dilated", "gram", "head", "same", "valid"]),
    "depthwise": (_depthwise, ["depthwise", "dilated", "gram", "head", "separable_1d", "shared", "strided"]),
    "einsum_dense": (_einsum_dense, ["ellipsis", "head", "o", "q", "row_bias"]),
    "not_a_matmul": (_not_a_matmul, ["head"]),
    "embedding": (_embedding, ["gram", "head", "shared", "table"]),
    "reversible_embedding": (_reversible_embedding, ["head", "small", "small_untied", "tied", "untied"]),
    "position_embedding": (_position_embedding, ["head", "once", "twice"]),
    "normalization": (_normalization, ["head", "last", "mix", "rms", "scale_only", "two_axes"]),
    "mixed": (_mixed, ["attention_output", "embed", "head", "key", "norm", "query", "value"]),
    "bert": (_bert, ["attention_output", "embeddings_layer_norm", "feedforward_intermediate_dense",
                     "feedforward_layer_norm", "feedforward_output_dense", "head", "key",
                     "pooled_dense", "position_embedding", "query", "segment_embedding",
                     "self_attention_layer_norm", "token_embedding", "value"]),
}


def _build(case, mode="flat"):
    keras.utils.set_random_seed(0)
    inputs, outputs, x = CASES[case][0]()
    params = DPParameters(noise_multiplier=1.0, delta=1e-3, clipping_norm=1.0, clipping=mode)
    model = DP_Model(inputs, outputs, dp_parameters=params,
                     dataset_metadata=DatasetMetadata(x.shape[1:], 3, N, BATCH))
    model.compile(optimizer="sgd", loss=SCCE)
    y = np.random.default_rng(2).integers(0, 3, BATCH)
    w = np.ones(BATCH, "float32")
    w[-1] = 0.0  # a padding row
    w[0] = 0.5   # a fractional weight
    return model, x, y, w


def _differentiated(monkeypatch):
    """For each vectorized pass, the paths of the variables given per-example gradients."""
    seen = []
    original = autodiff.weighted_per_example_gradients

    def spy(model, forward, x, y, weights, variables, *args, **kwargs):
        seen.append({v.path for v in variables})
        return original(model, forward, x, y, weights, variables, *args, **kwargs)

    monkeypatch.setattr(autodiff, "weighted_per_example_gradients", spy)
    return seen


def _max_error(model, x, y, w, per_example, mode, c):
    model.dp_parameters = model.dp_parameters.replace(clipping_norm=c)
    expected = _clip_by_hand(model, per_example, mode, c)
    got = clipped_sum(model)(x, y, w)
    assert set(got) == set(expected)
    # A gradient zero in exact arithmetic (a key bias, under the softmax) is float noise:
    # each variable's error is relative to at least 1e-4 of the whole gradient's norm.
    floor = 1e-4 * math.sqrt(sum(float(np.sum(g ** 2)) for g in expected.values()))
    return max(float(np.linalg.norm(np.asarray(got[p], "float64") - expected[p]))
               / max(float(np.linalg.norm(expected[p])), floor) for p in expected)


def _check(case, mode, monkeypatch, scale=1.0):
    """Max relative error of the clipped sum against brute force, with about half of
    the examples clipped (``scale=1``) or all of them (small ``scale``)."""
    model, x, y, w = _build(case, mode)
    covered = clipping.ghost_layers(model)
    assert sorted(layer.name for layer in covered) == CASES[case][1]
    per_example = _brute_force(model, x, y, w)
    differentiated = _differentiated(monkeypatch)
    error = _max_error(model, x, y, w, per_example, mode, scale * _median_norm(per_example))
    covered_paths = {v.path for layer in covered for v in layer.trainable_variables}
    assert len(differentiated) == 1 and not covered_paths & differentiated[0]  # no silent fallback
    assert differentiated[0] | covered_paths == {v.path for v in model.trainable_variables}
    return error


@pytest.mark.parametrize("case", sorted(CASES))
def test_clipped_sum_matches_brute_force(case, monkeypatch):
    assert _check(case, "flat", monkeypatch) < 1e-5


def test_einsum_dense_in_the_gram_form_matches_brute_force(monkeypatch):
    """Every linear layer of more than one row in the Gram form, which the form rule
    (`linear.materialise`) leaves to wide layers over few rows (the cases above have
    a `Dense` and a convolution in that form, no `EinsumDense`)."""
    monkeypatch.setattr(linear, "materialise", lambda rows, d, u: False)
    assert _check("einsum_dense", "flat", monkeypatch) < 1e-5


@pytest.mark.parametrize("case", ["conv", "depthwise", "mixed", "normalization"])
def test_per_layer_clipping_matches_brute_force(case, monkeypatch):
    assert _check(case, "per-layer", monkeypatch, scale=1e-2) < 1e-5  # every layer of every example clipped


@pytest.mark.parametrize("kind, case", [(dense.DenseKind, "mixed"), (einsum_dense.EinsumDenseKind, "mixed"),
                                        (embedding.EmbeddingKind, "mixed"),
                                        (normalization.LayerNormalizationKind, "mixed"), (conv.ConvKind, "conv"),
                                        (reversible_embedding.ReversibleEmbeddingKind, "reversible_embedding"),
                                        (position_embedding.PositionEmbeddingKind, "position_embedding"),
                                        (depthwise_conv.DepthwiseConvKind, "depthwise"),
                                        (depthwise_conv.SeparableConvKind, "depthwise")])
def test_an_under_reported_norm_is_caught(kind, case, monkeypatch):
    """Negative control: a kind reporting half its norms fails the comparison."""
    sq_norms = kind.sq_norms
    monkeypatch.setattr(kind, "sq_norms", lambda self, layer, state: 0.25 * sq_norms(self, layer, state))
    assert _check(case, "per-layer", monkeypatch, scale=1e-2) > 0.1


@pytest.mark.parametrize("case", ["mixed", "bert"])
def test_each_contribution_is_at_most_c(case):
    model, x, y, _ = _build(case)
    c = 0.5 * _median_norm(_brute_force(model, x, y, np.ones(BATCH, "float32")))
    model.dp_parameters = model.dp_parameters.replace(clipping_norm=c)
    norms, clipped = [], clipped_sum(model)
    for k in range(BATCH):
        alone = clipped(x, y, np.eye(BATCH, dtype="float32")[k])
        norms.append(math.sqrt(sum(float(np.sum(np.asarray(g, "float64") ** 2)) for g in alone.values())))
    assert max(norms) <= c * (1 + 1e-5), norms
    assert sum(n > c * (1 - 1e-4) for n in norms) >= BATCH // 2  # clipped examples attain C


def test_training_step_runs_the_kinds():
    """`fit` traces the clipped sum inside the training step (static shapes on TensorFlow too)."""
    model, x, y, _ = _build("mixed")
    x, y = np.resize(x, (N, T)), np.resize(y, N)
    before = [np.array(v) for v in model.trainable_variables]
    model.fit(x, y, epochs=1, steps_per_epoch=2, verbose=0)
    assert all(np.all(np.isfinite(v)) for v in model.trainable_variables)
    assert any(not np.allclose(a, np.array(v)) for a, v in zip(before, model.trainable_variables))
