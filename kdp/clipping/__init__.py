"""Per-example clipping DP-SGD for any Keras 3 model (the non-Lipschitz fallback).

Enabled by ``DPParameters(clipping_norm=C, clipping="flat"|"per-layer")`` on a
`DP_Model` / `DP_Sequential` made of **ordinary** Keras layers, compiled with any
Keras loss whose ``call`` returns per-example values (e.g.
``keras.losses.SparseCategoricalCrossentropy(from_logits=True)``).

The training objective keeps the shape of the clipless one, so Keras' own
``train_step`` runs it on every backend::

    stop_gradient(Σ_i w_i ℓ_i / b) + Σ_v ⟨v − stop_gradient(v), stop_gradient(ḡ_v) / b⟩ + noise term

where ``ḡ = Σ_i clip_C(∇(w_i ℓ_i))`` is the clipped per-example gradient sum,
computed inside the traced step, and the noise term (`DPModelMixin._noise_term`)
adds ``ξ_v`` of std ``σ·C / b``: the optimizer receives ``(ḡ + ξ)/b``, exactly
DP-SGD (Abadi et al. 2016). Padding rows (weight 0) contribute nothing.

How ḡ is computed (no Python loop over examples): one vectorized pass
(`jax.vmap` / `tf.vectorized_map` in `kdp.autodiff`) runs every example alone,
as a batch of one, so example ``i``'s gradient depends on ``x_i`` and the
weights only: padding rows, repeated rows or a layer mixing the batch axis
cannot carry one example into another's clipped gradient (a layer that smuggles
a tensor of the batch's forward pass into the per-example one through a Python
attribute, rather than a Keras variable, would). Inside that pass:

* **Registered layer kinds: ghost / book-keeping norms** (`kdp.clipping.kinds`,
  a registry with one module per kind; `ghost_layers` lists a model's covered
  layers, wherever they are called, also from inside another layer's
  ``call``). The ``call`` of a covered layer is replaced by its kind's, which
  keeps what the norm needs (``Dense`` / ``EinsumDense``: the input ``a``;
  ``Embedding``: the token ids; normalisation layers: the normalised input) and
  adds a zero probe to one output ``z``; the backward pass gives the cotangents
  ``G = ∂(w_i ℓ_i)/∂z``. Example ``i``'s kernel-gradient norm of a linear layer
  with rows ``A_i (T, d)``, ``G_i (T, u)`` is ``√⟨A_iA_iᵀ, G_iG_iᵀ⟩`` (Gram
  form) or the norm of the materialised ``A_iᵀG_i``, which takes fewer
  operations: the Gram form only where ``A_iᵀG_i`` would take more than twice
  the memory of ``A_i`` and ``G_i`` (`kinds.linear.materialise`; Bu et al.
  2023); an embedding's is
  ``√Σ_{s,t: id_s=id_t} g_s·g_t``; biases and normalisation scales are
  materialised per example (they are small). The clipped sum is then
  ``Σ_i c_i A_iᵀG_i`` (a scatter-add for an embedding) with
  ``c_i = min(1, C/‖g_i‖)``. Covered: exact ``Dense``, ``EinsumDense`` (an
  equation that is a matmul over rows), ``Conv1D`` / ``Conv2D`` (as a matmul
  of the input's patches; channels last, ``groups=1``, ``"valid"`` or
  ``"same"``), ``Embedding``, ``ReversibleEmbedding`` (lookups and the
  reverse projection, tied or not), keras_hub's ``PositionEmbedding``,
  ``LayerNormalization``, ``RMSNormalization``, with every weight trainable,
  not quantized, no LoRA (`kdp.clipping.kinds`).
* **Every other trainable variable** (LoRA factors, custom layers):
  per-example gradients.
* Norms of both are summed per example (``"flat"``) or per layer
  (``"per-layer"``: layer ``l`` clipped at ``C_l``, ``Σ_l C_l² = C²``).

Memory: ``physical_batch_size=k`` computes ḡ over chunks of at most ``k`` rows
of the Poisson batch, padded to one size, in a loop inside the step ("virtual
batches") that skips the chunks of padding: one logical step, one noise draw,
one optimizer update, one accounted step. Without
it, a batch padded above the ladder's size below the capacity runs in virtual
batches of that size (`kdp.training.objective.virtual_batch_rows`; on TensorFlow,
whose step is traced for every batch size, the passes take ``min(rows, size)``
rows), which caps the step's memory.

Random layers (Dropout, GaussianNoise, augmentation layers) draw per-example
values in that pass (`kdp.autodiff.ExampleSeeds`), and the loss reported is
that of the same pass. ``augmentation_multiplicity=K`` runs each example as
``K`` copies (``K`` augmented views, De et al. 2022): its gradient is their
mean, clipped once.

Accounting: sensitivity of ḡ is ``C`` (add/remove one example; per-layer:
``√Σ C_l² = C``), noise ``σ·C``: one Poisson-subsampled Gaussian with
multiplier ``σ``, recorded in the same ledger as the clipless path. It holds
for what the training step really computes because a model whose training
forward pass writes a variable or adds a loss term is refused
(`kdp.admission`); random values drawn independently of the data leave each
example's contribution clipped to ``C`` (one example, with all its views, is
one record).
"""

from kdp.clipping.checks import check_model
from kdp.clipping.config import (CLIPPING_MODES, ClippingError, check_clipping_parameters,  # noqa: F401
                                 total_clipping_norm)
from kdp.clipping.engine import clipped_gradient_sum, clipped_objective
from kdp.clipping.groups import clipping_groups, group_clipping_norms
from kdp.clipping.kinds import ghost_layers

__all__ = [
    "CLIPPING_MODES", "ClippingError", "check_model", "clipped_gradient_sum", "clipped_objective",
    "clipping_groups", "ghost_layers", "group_clipping_norms", "total_clipping_norm",
]
