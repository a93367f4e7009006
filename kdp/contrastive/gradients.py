"""Per-pair similarity gradients: exact norms, clipping by reweighting, bounds.

For a batch of pairs ``(x_i, x'_j)``, an encoder ``f`` (parameters ``w``) and a
`ContrastiveLoss` with embedding map ``h``: ``u_i = h(f(x_i))``,
``v_j = h(f(x'_j))``, ``S_ij = ⟨u_i, v_j⟩`` and ``g_ij = ∇_w S_ij``.

**Exact per-pair norms without n² gradients.** With the per-example Jacobians
``J_i = ∂u_i/∂w`` and ``J'_j = ∂v_j/∂w`` (``d × p`` each; ``2n·d·p`` numbers),
``g_ij = J_iᵀ v_j + J'_jᵀ u_i``, and ``‖g_ij‖²`` expands into Jacobian Gram
terms (`PairGradients.pair_norms`): memory ``O(n·d·p + (n·d)²)`` instead of the
``O(n²·p)`` of materialising every pair gradient; time ``2·n·d`` backward
passes plus one ``(n·d) × p × (n·d)`` matrix product (brute force: ``n²``
backward passes of two examples each). For small MLPs, whose backward pass
costs about ``p``, brute force is as fast; the Jacobian form wins when one
example's backward pass costs much more than ``d·p`` (convolutions) and always
in memory.

**One reweighted backward pass** (Kong et al. §5.3). With
``λ_ij = T_ij · min(1, B/‖g_ij‖)`` held fixed,
``∇_w Σ_ij λ_ij S_ij(w) = Σ_ij T_ij Clip_B(g_ij) = ḡ``: the Logit-DP gradient
at the cost of one ordinary backward pass.

**Clipless bound** (new; for encoders of kdp Lipschitz layers, see
`clipless_pair_bound`).
"""

import math

import keras
from keras import ops

from kdp.bounds import BoundError, backpropagate, propagate
from kdp.clipping.checks import check_examples_independent, warn_fixed_statistics
from kdp.contrastive import _backend

#: number of floats of one block of pair gradients below which blocks are not split further.
_BLOCK_FLOATS = 1 << 22
#: why the contrastive trainers refuse an encoder that mixes its batch
_PAIRS_NEED = ("every per-pair gradient would change when a pair is removed, so the contrastive "
               "sensitivity bounds (Kong et al., Lemma 4.1) would not hold. Use a per-example "
               "normalisation (LayerNormalization, GroupNormalization, kdp.layers.DP_LayerCentering).")


def check_encoder(encoder, data=None):
    """Admit ``encoder`` for what its inference pass does (the contrastive trainers call
    it with ``training=False``, through ``stateless_call``: a variable it writes is
    discarded, a loss term it adds never enters the gradient).

    Raises `kdp.clipping.ClippingError` if one example's embedding changes when
    another example of its batch is perturbed or removed (the probe of
    `kdp.clipping.checks.check_examples_independent`: a few rows, a repeated one
    and an all-zero one). Warns for a ``BatchNormalization``: in inference it is a
    fixed per-example map, whose statistics must be public (without ``data``).

    Args:
        encoder: a built Keras model.
        data: training rows (a structure of arrays) to probe with; by default
            random rows shaped like the encoder's declared inputs, and nothing is
            probed for an encoder that declares none (a subclassed model: probe it
            again with its training rows).
    """
    if data is None:  # when the trainer is made: warn once
        warn_fixed_statistics(encoder, frozen_only=False)
        if getattr(encoder, "inputs", None) is None:
            return
    check_examples_independent(encoder, modes=(False,), why=_PAIRS_NEED, data=data)


class PairGradients:
    """The pure functions of one encoder and one contrastive loss.

    All methods take ``params`` (the values of ``encoder.trainable_variables``, in
    order) and ``others`` (those of ``encoder.non_trainable_variables``), so they
    can be differentiated and compiled on either backend. The encoder is always
    called with ``training=False`` (deterministic, per example: no dropout).
    Inputs ``x``, ``xp`` are arrays or structures (dict, list) of arrays with one
    row per example, e.g. the ``token_ids``, ``segment_ids`` and ``padding_mask``
    of a keras_hub text encoder.

    Args:
        encoder: a built Keras model mapping a batch of inputs to ``(n, d)``.
        loss: a `kdp.losses.contrastive.ContrastiveLoss`.
        block_rows: anchor rows per block of ``method="blocks"`` (default: from the sizes).
        method: how `pair_norms` computes the exact norms (``"gram"`` or ``"blocks"``).
    """

    def __init__(self, encoder, loss, block_rows=None, method="gram"):
        if method not in ("gram", "blocks"):
            raise ValueError(f"method must be 'gram' or 'blocks', got {method!r}")
        check_encoder(encoder)
        self.method = method
        self.encoder = encoder
        self.loss = loss
        self.block_rows = block_rows

    # -- values --------------------------------------------------------------------
    def variables(self):
        return ([v.value for v in self.encoder.trainable_variables],
                [v.value for v in self.encoder.non_trainable_variables])

    def features(self, params, others, x):
        out, _ = self.encoder.stateless_call(params, others, x, training=False)
        return out

    def embeddings(self, params, others, x):
        return self.loss.embed(self.features(params, others, x))

    def similarities(self, params, others, x, xp):
        return self.loss.similarities(self.features(params, others, x),
                                      self.features(params, others, xp))

    # -- gradients -------------------------------------------------------------------
    def loss_gradient(self, params, others, x, xp, mask=None):
        """``(∇_w 𝓛_X, 𝓛_X)``: autodiff of the summed loss (unclipped)."""
        def fn(p):
            return self.loss.batch_loss(self.similarities(p, others, x, xp), mask)

        return _backend.grad(fn, params), fn(params)

    def reweighted_gradient(self, params, others, x, xp, weights):
        """``∇_w Σ_ij λ_ij S_ij(w)`` with the ``(n, n)`` weights ``λ`` held fixed."""
        weights = ops.stop_gradient(weights)

        def fn(p):
            return ops.sum(weights * self.similarities(p, others, x, xp))

        return _backend.grad(fn, params)

    def jacobians(self, params, others, x):
        """Per-example Jacobians of the embeddings, each ``(n, d, p_v)``."""
        jac = _backend.per_example_jacobians(
            lambda p, xb: self.embeddings(p, others, xb), params, x
        )
        return [ops.reshape(j, (-1, j.shape[1], math.prod(j.shape[2:]))) for j in jac]

    def pair_norms(self, params, others, x, xp):
        """Exact ``‖g_ij‖`` for all pairs, ``(n, n)``, without materialising any ``g_ij``.

        ``method="gram"`` (default): with ``J_i``, ``J'_j`` the per-example
        Jacobians, ``‖g_ij‖² = v_jᵀ(J_iJ_iᵀ)v_j + u_iᵀ(J'_jJ'_jᵀ)u_i + 2 v_jᵀ(J_iJ'_jᵀ)u_i``:
        one ``(n·d) × p`` by ``p × (n·d)`` matrix product (``n²d²p`` multiply-adds
        at BLAS speed, ``(n·d)²`` memory). ``method="blocks"``: the pair gradients
        of ``c`` anchor rows at a time (``c·n·p`` memory, ``2n²dp`` multiply-adds,
        no cancellation in the sum of squares).
        """
        u = self.embeddings(params, others, x)
        v = self.embeddings(params, others, xp)
        ja = self.jacobians(params, others, x)
        jb = self.jacobians(params, others, xp)
        if self.method == "blocks":
            return self._block_norms(u, v, ja, jb)
        n, d = u.shape[0], u.shape[1]
        cross, self_a, self_b = 0.0, 0.0, 0.0
        for a, b in zip(ja, jb):
            cross = cross + ops.matmul(ops.reshape(a, (n * d, -1)),
                                       ops.transpose(ops.reshape(b, (n * d, -1))))
            self_a = self_a + ops.einsum("idp,iep->ide", a, a)
            self_b = self_b + ops.einsum("jdp,jep->jde", b, b)
        cross = ops.reshape(cross, (n, d, n, d))
        squared = (ops.einsum("ide,jd,je->ij", self_a, v, v)
                   + ops.einsum("jde,id,ie->ij", self_b, u, u)
                   + 2.0 * ops.einsum("idje,jd,ie->ij", cross, v, u))
        return ops.sqrt(ops.maximum(squared, 0.0))

    def _block_norms(self, u, v, ja, jb):
        n, d = u.shape[0], u.shape[1]
        p = sum(j.shape[-1] for j in ja)
        rows = self.block_rows or max(1, min(n, max(2 * d, _BLOCK_FLOATS // max(1, n * p))))
        blocks = []
        for start in range(0, n, rows):
            stop = min(n, start + rows)
            squared = 0.0
            for a, b in zip(ja, jb):
                # g_ij restricted to this variable: J_iᵀ v_j + J'_jᵀ u_i
                g = (ops.einsum("idp,jd->ijp", a[start:stop], v)
                     + ops.einsum("jdp,id->ijp", b, u[start:stop]))
                squared = squared + ops.sum(ops.square(g), axis=-1)
            blocks.append(squared)
        return ops.sqrt(ops.concatenate(blocks, axis=0))

    def pair_gradients(self, params, others, x, xp):
        """Brute force: every ``g_ij`` materialised, a list of ``(n, n, *shape)``."""
        def fn(p, a, b):
            a, b = (keras.tree.map_structure(lambda t: t[None], z) for z in (a, b))
            return ops.sum(self.similarities(p, others, a, b))

        return _backend.pair_gradients(fn, params, x, xp)

    def clipped_weights(self, coefficients, norms, clip_norm):
        """``λ_ij = T_ij · min(1, B/‖g_ij‖)`` (``B = inf``: ``λ = T``)."""
        if clip_norm == math.inf:
            return coefficients
        scale = ops.minimum(1.0, clip_norm / ops.maximum(norms, 1e-30))
        return coefficients * scale

    def logit_dp_gradient(self, params, others, x, xp, mask, clip_norm):
        """``(ḡ, 𝓛_X, norms)`` with ``ḡ = Σ_ij T_ij Clip_B(g_ij)`` (Logit-DP)."""
        S = self.similarities(params, others, x, xp)
        coefficients = self.loss.coefficients(S, mask)
        norms = self.pair_norms(params, others, x, xp)
        weights = self.clipped_weights(coefficients, norms, clip_norm)
        return self.reweighted_gradient(params, others, x, xp, weights), \
            self.loss.batch_loss(S, mask), norms


def encoder_input_bound(encoder, input_bound=None):
    """The input norm bound of ``encoder``: its `DP_BoundedInput` or ``input_bound``."""
    try:
        out = propagate(encoder, input_bound)
    except TypeError:
        out = None
    if out is None:
        raise BoundError(
            f"{encoder.name}: no input norm bound. Start the encoder with "
            "DP_BoundedInput(upper_bound=...) or pass input_bound=."
        )
    return input_bound


def clipless_pair_bound(encoder, loss, input_bound=None):
    """Analytic bound ``B_pair ≥ ‖∇_w S_ij‖`` for every pair, from the bound pass.

    Derivation. ``S_ij = ⟨h(f(x_i)), h(f(x'_j))⟩``, so by the chain rule
    ``∇_w S_ij = ∇_w ⟨f(x_i), a⟩ + ∇_w ⟨f(x'_j), a'⟩`` with the fixed cotangents
    ``a = (∂h/∂f)(f(x_i))ᵀ v_j`` and ``a' = (∂h/∂f)(f(x'_j))ᵀ u_i``, both of norm
    ``≤ G = ‖∂h/∂f‖·ρ`` (`ContrastiveLoss.output_cotangent_bound`: ``1/κ`` for
    cosine with norm floor κ, ``r`` for the dot product in the ball of radius r).
    Each term is one example's gradient of a "loss" ``⟨f(x), a⟩`` whose cotangent
    at the encoder output has norm ``≤ G``, so kdp's bound pass (run with input
    bound ``X₀`` and output cotangent bound ``G``) bounds it, per variable ``v``,
    by ``β_v(X₀, G)``, for every input with ``‖x‖ ≤ X₀`` and every weight the
    layers' projections allow. By the triangle inequality per variable and then
    over variables:

        ``‖∇_w S_ij‖ ≤ 2 · √(Σ_v β_v(X₀, G)²) = B_pair``.

    So ``Clip_{B_pair}`` is the identity, ``ḡ = ∇_w 𝓛_X`` (no per-pair norm is ever
    computed) and the loss's batch sensitivity applies with ``B = B_pair``.

    **The bound is attained** for encoders of orthogonal dense layers and GroupSort
    (no smaller constant is sound for the declared input ball). Take ``x_i = x'_j = x``
    with ``‖x‖ = X₀`` and ``‖f(x)‖ = t`` (``t = r`` for the dot product, ``κ`` for
    cosine, approached from below; such an ``x`` exists when the last kernel has a null
    space). There ``h`` is the identity (dot) or ``f ↦ f/κ`` (cosine), so
    ``∂h/∂f = ‖∂h/∂f‖·I`` at its largest and ``‖h(f(x))‖ = ρ``: both cotangents equal
    ``‖∂h/∂f‖·h(f(x))``, of norm ``G``; every orthogonal layer keeps
    ``‖x‖ = X₀`` and passes the cotangent back with its norm, so every kernel gradient
    ``x_ℓ ⊗ δ_ℓ`` has norm ``X₀·G = β_v``, and the two halves of ``g_xx`` coincide:
    ``‖g_xx‖ = 2·√(Σ_v β_v²)``. `tests/test_contrastive.py` finds such an input by
    bisection and measures ``‖g_xx‖ ≥ 0.9999·B_pair``. The slack on real data (the
    largest pair gradient measured on the digits at initialisation is 1/1.5 to
    1/1.05 of the bound, depending on r and the depth) is a property of the data, not of the bound.

    **Choosing the similarity.** Dot product with radius ``r`` and temperature ``τ``
    is cosine with floor ``κ = r`` and temperature ``τ/r²``. The clipless noise is
    ``σ·K_{n_cal}(τ, a)·B_pair`` with the logit range ``a = r²/τ``: ``B_pair ∝ r`` and
    ``τ·K → 4`` as ``a → 0`` (and ``K_{N+1} ≈ K_b`` then, so the calibration at
    ``N + 1`` costs nothing), while the gradient of outputs projected onto the sphere
    of radius ``r`` does not shrink with ``r``: prefer a small radius (below the typical
    output norm) and a small logit range (notebook 06: ``r = 0.25, τ = 1``).

    Returns:
        ``(B_pair, {variable.path: β_v})``.
    """
    g = loss.output_cotangent_bound()
    if not math.isfinite(g):
        raise BoundError(
            "the clipless strategy needs a bounded embedding Jacobian: with cosine "
            "similarity set norm_floor=κ > 0 in the loss (h(f) = f / max(‖f‖, κ)), or use "
            "similarity='dot' with a radius"
        )
    try:
        x0 = encoder_input_bound(encoder, input_bound)
        _, params = backpropagate(encoder, x0, g)
    except BoundError as error:
        if "no input norm bound" in str(error):
            raise
        raise BoundError(
            f"the clipless strategy bounds every per-pair gradient analytically, which needs an "
            f"encoder made of kdp Lipschitz layers; {encoder.name} is not "
            f"({str(error).split('. ')[0]}). Train it with strategy='logit-dp' (per-pair "
            "clipping) or 'naive' (batch gradient clipping) instead."
        ) from error
    betas = {}
    for v in encoder.trainable_variables:
        if v.path not in params:
            raise BoundError(f"no gradient bound for trainable variable {v.path!r}")
        betas[v.path] = float(params[v.path])
    return 2.0 * math.sqrt(sum(b * b for b in betas.values())), betas


__all__ = ["PairGradients", "check_encoder", "clipless_pair_bound", "encoder_input_bound"]
