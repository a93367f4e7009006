"""Contrastive DP losses: InfoNCE and spreadout, with **batch-level** sensitivities.

Contrastive losses mix the examples of a batch by design, so they have no
per-example Lipschitz constant (``get_L()`` raises). What they have
is a sensitivity of the whole batch gradient when one record (one positive pair)
is added or removed, provided every per-pair similarity gradient is bounded by B
(Kong et al., "Differentially private optimization for non-decomposable
objective functions", Thm 4.2; its constants are re-derived below, with the
temperature factor, and checked numerically in ``tests/test_contrastive.py``).

Notation (one batch of ``n`` positive pairs ``(x_i, x'_i)``, encoder ``f``):

* ``u_i = h(f(x_i))``, ``v_j = h(f(x'_j))``, with ``h`` the embedding map of the
  loss (see `ContrastiveLoss`); ``S_ij = ⟨u_i, v_j⟩`` the ``n × n`` similarity
  matrix (rows: anchors, columns: positives, the diagonal holds the pairs);
* ``|S_ij| ≤ c``: ``c = 1`` for cosine similarity, ``c = r²`` for the
  bounded-norm dot product with radius ``r``;
* the **summed** loss ``𝓛_X = Σ_i ℓ^{(i,n)}(S_i·)``; its coefficients
  ``T_ij = ∂𝓛_X/∂S_ij`` are given in closed form by `coefficients`;
* ``g_ij = ∇_w S_ij`` (depends only on ``x_i, x'_j, w``), ``ĝ_ij`` the same
  clipped to norm B, and ``ḡ(X) = Σ_ij T_ij ĝ_ij`` (Eq. (5) of the paper).

General bound (the paper's proof, Thm 4.2): with ``X° = X`` minus pair ``n``,
``ḡ(X) − ḡ(X°) = T1 + T2 + T3`` with
``T1 = Σ_j T_nj ĝ_nj`` (the removed row), ``T2 = Σ_{i<n} T_in ĝ_in`` (the removed
column) and ``T3 = Σ_{i,j<n} (T^X_ij − T^{X°}_ij) ĝ_ij`` (changed coefficients;
``ĝ_ij`` itself is unchanged because the encoder processes examples
independently), so ``‖ḡ(X) − ḡ(X°)‖ ≤ B (G1 + G2 + (n−1) L)`` with
``G1 = Σ_j |T_nj|``, ``G2 = Σ_{i<n} |T_in|`` and
``(n−1) L = Σ_{i<n} Σ_{j<n} |T^X_ij − T^{X°}_ij|``.
"""

import math

from keras import ops

from kdp.bounds import BoundError
from kdp.losses.base import DPLoss, serializable

SIMILARITIES = ("cosine", "dot")
#: logits of masked (padding) columns: exp(-1e9) is exactly 0 in float32/64.
_MASKED_LOGIT = -1e9


class ContrastiveLoss(DPLoss):
    """Base of the contrastive losses: the embedding map and the similarity matrix.

    The embedding map ``h`` applied to the encoder output ``f`` is

    * ``similarity="cosine"``: ``h(f) = f / max(‖f‖, κ)`` (``κ = norm_floor``; with
      ``κ = 0`` this is the exact cosine similarity). ``‖h(f)‖ ≤ 1`` so
      ``|S| ≤ c = 1``; ``‖∂h/∂f‖₂ ≤ 1/κ`` (``(I − f̂f̂ᵀ)/‖f‖`` above the floor,
      ``I/κ`` below), which the clipless strategy needs (``κ > 0``);
    * ``similarity="dot"``: ``h(f) = r f / max(‖f‖, r)``, the projection onto the
      ball of radius ``r = radius`` (bounded-norm dot product). ``‖h(f)‖ ≤ r`` so
      ``|S| ≤ c = r²``; ``‖∂h/∂f‖₂ ≤ 1``.

    Keras' ``call(y_true, y_pred)`` takes ``y_pred`` = the anchors' encoder
    outputs ``f(x_i)`` and ``y_true`` = the positives' ``f(x'_j)`` (both ``(n, d)``,
    no padding) and returns the ``n`` per-anchor values ``ℓ^{(i,n)}``; they are
    **not** per-example losses. Train with `kdp.contrastive.ContrastiveTrainer`.
    """

    def __init__(self, similarity="cosine", radius=1.0, norm_floor=0.0, name=None, **kwargs):
        super().__init__(name=name, **kwargs)
        if similarity not in SIMILARITIES:
            raise ValueError(f"similarity must be one of {SIMILARITIES}, got {similarity!r}")
        if not radius > 0:
            raise ValueError(f"radius must be > 0, got {radius}")
        if not norm_floor >= 0:
            raise ValueError(f"norm_floor must be >= 0, got {norm_floor}")
        self.similarity = similarity
        self.radius = float(radius)
        self.norm_floor = float(norm_floor)

    # -- embeddings and similarities ---------------------------------------------
    def embed(self, f):
        """``h(f)`` row-wise (see the class docstring)."""
        squared = ops.sum(ops.square(f), axis=-1, keepdims=True)
        if self.similarity == "cosine":
            # √max(‖f‖², κ²): no 0/0 in the gradient at f = 0 (jax).
            return f / ops.sqrt(ops.maximum(squared, max(self.norm_floor, 1e-12) ** 2))
        return self.radius * f / ops.sqrt(ops.maximum(squared, self.radius ** 2))

    def similarity_bound(self):
        """``c ≥ |S_ij|``: 1 (cosine) or ``r²`` (dot)."""
        return 1.0 if self.similarity == "cosine" else self.radius ** 2

    def embedding_norm_bound(self):
        """``ρ ≥ ‖h(f)‖``: 1 (cosine) or ``r`` (dot)."""
        return 1.0 if self.similarity == "cosine" else self.radius

    def embedding_jacobian_bound(self):
        """``‖∂h/∂f‖₂``: ``1/κ`` (cosine; infinite without a floor) or 1 (dot)."""
        if self.similarity == "cosine":
            return math.inf if self.norm_floor == 0 else 1.0 / self.norm_floor
        return 1.0

    def output_cotangent_bound(self):
        """Bound on ``‖∂S_ij/∂f(x_i)‖ = ‖(∂h/∂f)ᵀ v_j‖ ≤ ‖∂h/∂f‖ · ρ``: the
        cotangent that one similarity sends back into the encoder output."""
        return self.embedding_jacobian_bound() * self.embedding_norm_bound()

    def similarities(self, f_anchor, f_positive):
        """``S = h(f_anchor) h(f_positive)ᵀ``, shape ``(n, n)``."""
        return ops.matmul(self.embed(f_anchor), ops.transpose(self.embed(f_positive)))

    # -- to be defined by the losses ----------------------------------------------
    def batch_loss(self, S, mask=None):
        """The summed loss ``𝓛_X`` of the real pairs (``mask``: 1 real, 0 padding)."""
        raise NotImplementedError

    def coefficients(self, S, mask=None):
        """``T_ij = ∂𝓛_X/∂S_ij`` in closed form (0 on padding rows and columns)."""
        raise NotImplementedError

    def sensitivity(self, n, clip_norm=1.0):
        """Bound on ``‖ḡ(X) − ḡ(X°)‖`` for batches of at most ``n`` pairs when every
        ``‖ĝ_ij‖ ≤ clip_norm`` (``n = math.inf``: the supremum over all sizes)."""
        raise NotImplementedError

    def get_L(self):
        raise BoundError(
            f"{type(self).__name__} compares every anchor with every positive of the batch: "
            "it has no per-example Lipschitz constant, so DP_Model.fit cannot calibrate its "
            "noise. Train with kdp.contrastive.ContrastiveTrainer, which uses the batch "
            "sensitivity `sensitivity(n, clip_norm)`."
        )

    def call(self, y_true, y_pred):
        S = self.similarities(y_pred, y_true)
        return self.row_losses(S)

    def row_losses(self, S, mask=None):
        raise NotImplementedError

    def get_config(self):
        return {**super().get_config(), "similarity": self.similarity, "radius": self.radius,
                "norm_floor": self.norm_floor}


def _mask_or_ones(S, mask):
    if mask is None:
        return ops.ones((ops.shape(S)[0],), dtype=S.dtype)
    return ops.cast(ops.reshape(mask, (-1,)), S.dtype)


@serializable
class DP_InfoNCE(ContrastiveLoss):
    """One-directional InfoNCE: anchor ``x_i`` against the positives ``x'_j`` of the batch.

    ``ℓ^{(i,n)} = −log softmax_j(S_ij / τ)_i = logsumexp_j(S_ij/τ) − S_ii/τ`` and
    ``𝓛_X = Σ_i ℓ^{(i,n)}`` (sum, never a mean over the realised batch); the
    coefficients are ``T_ij = (P_ij − δ_ij)/τ`` with ``P = softmax(S/τ)`` row-wise.

    **Sensitivity (safe form, with temperature).** Logits ``z = S/τ`` satisfy
    ``|z| ≤ a = c/τ`` (``c = 1`` cosine, ``r²`` dot). Let
    ``q_n = e^{2a} / (e^{2a} + n − 1)``, the largest softmax probability one entry
    of a row of ``n`` logits in ``[−a, a]`` can take. With the notation of the
    module docstring and ``P`` the softmax of the larger batch X:

    * ``G1 = Σ_j |P_nj − δ_nj| / τ = 2(1 − P_nn)/τ ≤ 2/τ`` (the removed row);
    * ``G2 = Σ_{i<n} P_in / τ ≤ (n−1) q_n / τ`` (the removed column);
    * for ``j < n``, ``P^X_ij = P^{X°}_ij (1 − P_in)``, so row i's coefficients
      change by ``Σ_{j<n} |P^X_ij − P^{X°}_ij| = P_in`` and
      ``(n−1) L = Σ_{i<n} P_in / τ ≤ (n−1) q_n / τ``.

    Hence ``‖ḡ(X) − ḡ(X°)‖ ≤ B · K_{n,τ}`` with

        ``K_{n,τ} = (2/τ) · (1 + (n−1) e^{2a} / (e^{2a} + n − 1))``,

    increasing in ``n`` with supremum ``(2/τ)(1 + e^{2a})``. For τ = 1 and cosine
    this is ``2(1 + (n−1)e²/(e²+n−1)) < 2(1+e²) = 16.78``. The paper's Lemma 4.5
    prints ``2(1 + (n−2)e²/(e²+n−1))``: it uses the same ``p_n`` for the removed
    row's positive and for the removed column, which can differ; its worst case
    (row n: ``z_nn = −a``, ``z_nj = +a``; rows ``i<n``: ``z_in = +a``, the rest
    ``−a``) exceeds it (n = 3: 5.02 > 3.57; n = 10: 10.09 > 9.21) and it has no
    1/τ. At small τ, ``e^{2a}`` is huge and ``K_{n,τ} ≈ 2n/τ`` for any practical n:
    the sum's sensitivity is then linear in n.

    Args:
        temperature: ``τ > 0``.
        similarity: ``"cosine"`` (default) or ``"dot"`` (bounded norm ``radius``).
        radius: ``r`` for ``"dot"``.
        norm_floor: ``κ`` of the cosine embedding map (needed > 0 by the
            clipless strategy only).
    """

    def __init__(self, temperature=1.0, similarity="cosine", radius=1.0, norm_floor=0.0,
                 name="dp_info_nce", **kwargs):
        super().__init__(similarity, radius, norm_floor, name=name, **kwargs)
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        self.temperature = float(temperature)

    def _logits(self, S, mask):
        m = _mask_or_ones(S, mask)
        z = S / self.temperature
        return ops.where(ops.reshape(m, (1, -1)) > 0, z, _MASKED_LOGIT), m

    def row_losses(self, S, mask=None):
        z, m = self._logits(S, mask)
        diag = ops.diagonal(S) / self.temperature
        return (ops.logsumexp(z, axis=1) - diag) * m

    def batch_loss(self, S, mask=None):
        return ops.sum(self.row_losses(S, mask))

    def coefficients(self, S, mask=None):
        z, m = self._logits(S, mask)
        P = ops.softmax(z, axis=1)
        eye = ops.eye(ops.shape(S)[0], dtype=S.dtype)
        return (P - eye) / self.temperature * ops.reshape(m, (-1, 1)) * ops.reshape(m, (1, -1))

    def sensitivity(self, n, clip_norm=1.0):
        return clip_norm * infonce_constant(n, self.temperature, self.similarity_bound())

    def get_config(self):
        return {**super().get_config(), "temperature": self.temperature}


@serializable
class DP_Spreadout(ContrastiveLoss):
    """Spreadout regulariser (Zhang et al. 2017): ``ℓ^{(i,n)} = Σ_{j≠i} S_ij² / (n−1)``.

    Pushes the embeddings of non-matching pairs towards orthogonality; ``n`` is
    the number of real pairs of the batch (a batch of one pair has loss 0).
    Coefficients ``T_ij = 2 S_ij / (n−1)`` for ``i ≠ j``, 0 on the diagonal.

    **Sensitivity.** With ``|S| ≤ c``: ``G1 = Σ_{j≠n} 2|S_nj|/(n−1) ≤ 2c``;
    ``G2 = Σ_{i<n} 2|S_in|/(n−1) ≤ 2c``; for ``i ≠ j < n`` the coefficient changes
    by ``2|S_ij| (1/(n−2) − 1/(n−1)) = 2|S_ij| / ((n−1)(n−2))``, over ``n−2``
    entries of each of the ``n−1`` rows: ``(n−1) L ≤ 2c`` (0 when ``n = 2``). Hence
    ``‖ḡ(X) − ḡ(X°)‖ ≤ 6 c B`` for every ``n`` (Kong et al., Lemma 4.6; ``6B`` for
    cosine). No temperature.

    Args: as `ContrastiveLoss`.
    """

    def __init__(self, similarity="cosine", radius=1.0, norm_floor=0.0, name="dp_spreadout",
                 **kwargs):
        super().__init__(similarity, radius, norm_floor, name=name, **kwargs)

    def _weights(self, S, mask):
        m = _mask_or_ones(S, mask)
        n = ops.sum(m)
        off = 1.0 - ops.eye(ops.shape(S)[0], dtype=S.dtype)
        pair_mask = ops.reshape(m, (-1, 1)) * ops.reshape(m, (1, -1)) * off
        return pair_mask / ops.maximum(n - 1.0, 1.0)

    def row_losses(self, S, mask=None):
        return ops.sum(self._weights(S, mask) * ops.square(S), axis=1)

    def batch_loss(self, S, mask=None):
        return ops.sum(self.row_losses(S, mask))

    def coefficients(self, S, mask=None):
        return 2.0 * self._weights(S, mask) * S

    def sensitivity(self, n, clip_norm=1.0):
        return clip_norm * 6.0 * self.similarity_bound()


def infonce_constant(n, temperature=1.0, similarity_bound=1.0):
    """``K_{n,τ}`` of `DP_InfoNCE` (per unit clip norm); ``n = math.inf`` gives the
    supremum ``(2/τ)(1 + e^{2a})``, ``a = similarity_bound/τ``."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    a = similarity_bound / temperature
    if n == math.inf:
        return (2.0 / temperature) * (1.0 + math.exp(2 * a))
    # (n−1) e^{2a}/(e^{2a}+n−1) = (n−1)/(1 + (n−1)e^{-2a}), stable for large a.
    mass = (n - 1) / (1.0 + (n - 1) * math.exp(-2 * a))
    return (2.0 / temperature) * (1.0 + mass)


def paper_infonce_constant(n):
    """Kong et al.'s Lemma 4.5 constant ``2(1 + (n−2)e²/(e²+n−1))`` (cosine, τ = 1).

    **Not a valid bound** (see `DP_InfoNCE`): kept for the negative-control test.
    """
    e2 = math.exp(2.0)
    return 2.0 * (1.0 + (n - 2) * e2 / (e2 + n - 1))


__all__ = ["ContrastiveLoss", "DP_InfoNCE", "DP_Spreadout", "infonce_constant",
           "paper_infonce_constant"]
