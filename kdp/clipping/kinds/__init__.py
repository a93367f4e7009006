"""Layer kinds with per-example gradient norms but no per-example gradients.

A registry in the shape of Opacus' ``grad_sample``: one module per layer kind,
each a `Kind` subclass registered by `register`. `clipped_gradient_sum` asks
the registry which layers of a model it covers (`ghost_layers`), runs every
example's pass once with their ``call`` replaced by their kind's (`Probes`:
it records what the norm needs and probes one output, whose cotangent comes
back), and takes each covered layer's per-example squared norm and reweighted
gradient sum from its kind. Every other trainable variable gets per-example
gradients. Covered (exact type, every weight trainable, not quantized, no
LoRA):

* `dense` / `einsum_dense`: ``Dense``; ``EinsumDense`` whose equation is a
  matmul over rows (`linear.parse`). Kernel: materialised per example,
  or the Gram form where that takes much less memory (`linear.materialise`);
  bias: materialised.
* `embedding`: ``Embedding`` (Gram form over equal token ids, or materialised).
* `normalization`: ``LayerNormalization``, ``RMSNormalization`` (materialised).
* `conv`: ``Conv1D``, ``Conv2D`` (channels last, ``groups=1``, ``"valid"`` or
  ``"same"`` padding), as a matmul of the input's patches with the kernel.
* `depthwise_conv`: ``DepthwiseConv1D`` / ``DepthwiseConv2D`` (kernel materialised
  tap by tap), ``SeparableConv1D`` / ``SeparableConv2D`` (the depthwise kernel so,
  the pointwise one by the linear layers' rule); channels last, ``"valid"`` or
  ``"same"`` padding.
* `reversible_embedding`: ``ReversibleEmbedding`` (keras', keras_hub's;
  ``mask_zero=False``): lookups and the ``reverse=True`` projection, tied or not.
* `position_embedding`: keras_hub's ``PositionEmbedding`` (materialised rows).
  keras_hub is never imported: its classes are looked up once it is.

A covered layer's variables must enter the forward pass through its own
``call`` only (a weight tied to another layer's computation is not seen).
Adding a kind: a module defining a registered `Kind`, imported below.
"""

from kdp.clipping.kinds.base import KINDS, Kind, Probes, ghost_layers, kind_of, register
from kdp.clipping.kinds import (conv, dense, depthwise_conv, einsum_dense, embedding,  # noqa: F401, E402
                                normalization, position_embedding, reversible_embedding)  # registers them

__all__ = ["KINDS", "Kind", "Probes", "ghost_layers", "kind_of", "register"]
