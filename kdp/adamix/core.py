"""Closed-form per-example gradients of a linear softmax head, clipping, projection, noise.

Model: logits ``x W`` with ``W ∈ R^{D×C}`` (a bias-free `keras.layers.Dense` kernel),
loss ``ℓ_i(W) = CE(softmax(x_i W), y_i)`` summed over examples (AdaMix §3.1). With
``r_i = softmax(x_i W) − y_i``:

    g_i = ∇_W ℓ_i = x_i r_iᵀ  (D×C, rank one),   ‖g_i‖_F = ‖x_i‖ · ‖r_i‖ ≤ √2 ‖x_i‖.

Because every ``g_i`` is rank one, sums of clipped, projected gradients never
materialise the N×D×C tensor:

    Σ_i s_i Uᵀ g_i = (X U)ᵀ diag(s) R,   s_i = min(1, τ / ‖g_i‖).

Everything here is `keras.ops` (TensorFlow and JAX backends).
"""

import keras
import numpy as np
from keras import ops

RANK_POLICIES = ("truncate", "features", "complete", "raise")
_TINY = 1e-12


def residuals(w, x, y_onehot):
    """``R = softmax(X W) − Y`` (N×C): the per-example gradient is ``x_i r_iᵀ``."""
    return ops.softmax(ops.matmul(x, w), axis=-1) - y_onehot


def per_example_gradients(w, x, y_onehot):
    """All ``g_i = x_i r_iᵀ`` as an N×D×C tensor (for tests and small diagnostics only)."""
    r = residuals(w, x, y_onehot)
    return ops.einsum("nd,nc->ndc", x, r)


def per_example_norms(x, r):
    """``‖g_i‖_F = ‖x_i‖ ‖r_i‖`` (exact for rank-one gradients)."""
    return ops.norm(x, axis=1) * ops.norm(r, axis=1)


def clip_factors(norms, tau):
    """``s_i = min(1, τ/‖g_i‖)`` so that ``‖s_i g_i‖ = min(‖g_i‖, τ)``."""
    return ops.minimum(1.0, tau / ops.maximum(norms, _TINY))


def gradient_sum(x, r, scale=None, basis=None):
    """``Σ_i s_i Bᵀ g_i = (X B)ᵀ diag(s) R`` (``B = I`` when ``basis`` is None)."""
    if scale is not None:
        r = r * scale[:, None]
    if basis is not None:
        x = ops.matmul(x, basis)
    return ops.matmul(ops.transpose(x), r)


def public_clip_threshold(norms_pub, quantile=0.9):
    """τ = the ``quantile`` of the public per-example gradient norms (AdaMix §3.2)."""
    if not 0 < quantile <= 1:
        raise ValueError(f"clip quantile must be in (0, 1], got {quantile}")
    return ops.quantile(norms_pub, quantile)


def public_subspace(g_pub, dim=None, policy="truncate", rtol=1e-5, x_pub=None):
    """Top left singular vectors ``U`` (D×P, orthonormal columns) of the public gradient.

    ``G^pub = Σ_j x̃_j r̃_jᵀ`` is D×C and its rows times ``1_C`` vanish (each ``r̃_j``
    sums to 0), so ``rank(G^pub) ≤ min(D, C − 1, N_pub)``. The numerical rank ``k``
    counts singular values ``> rtol · s_1``. When the requested ``dim`` (None: ``k``)
    exceeds ``k``, ``policy`` decides (the paper, with P = 2000 ≫ C, is silent):

    * ``"truncate"`` (default): keep only the ``k`` informative directions, P = k;
    * ``"features"``: complete with the top principal directions of the public
      features ``x_pub`` orthogonalised against the first ``k`` (public data only);
    * ``"complete"``: the arbitrary orthonormal completion of a full SVD (what the
      paper's P = 2000 amounts to);
    * ``"raise"``: a ValueError.

    Any orthonormal U that depends on public data and the current weights only
    keeps the sensitivity at τ, so the policy affects utility, never privacy.

    Returns:
        ``(U, rank)``: U is a D×P tensor (P may be 0), rank the numerical rank k.
    """
    if policy not in RANK_POLICIES:
        raise ValueError(f"rank policy must be one of {RANK_POLICIES}, got {policy!r}")
    d = int(g_pub.shape[0])
    u_full, s, _ = ops.svd(g_pub, full_matrices=True)
    s = ops.convert_to_numpy(s)
    rank = int(np.sum(s > rtol * s[0])) if s.size and s[0] > 0 else 0
    dim = rank if dim is None else int(dim)
    if dim < 0:
        raise ValueError(f"subspace dim must be >= 0, got {dim}")
    dim = min(dim, d)
    if dim <= rank or policy == "truncate":
        return u_full[:, : min(dim, rank)], rank
    if policy == "raise":
        raise ValueError(
            f"subspace dim {dim} exceeds the rank {rank} of the public gradient "
            "(at most num_classes - 1); use dim <= rank or another rank policy"
        )
    if policy == "complete":
        return u_full[:, :dim], rank
    # "features": principal directions of the public features outside span(U_k)
    if x_pub is None:
        raise ValueError("rank policy 'features' needs the public features")
    u_k = u_full[:, :rank]
    xt = ops.transpose(x_pub)  # D×N_pub
    rest = xt - ops.matmul(u_k, ops.matmul(ops.transpose(u_k), xt))
    u_rest, s_rest, _ = ops.svd(rest, full_matrices=False)
    s_rest = ops.convert_to_numpy(s_rest)
    extra = int(np.sum(s_rest > rtol * max(float(s_rest[0]) if s_rest.size else 0.0, _TINY)))
    extra = min(extra, dim - rank)
    return ops.concatenate([u_k, u_rest[:, :extra]], axis=1), rank


def gaussian_noise(shape, std, seed_generator):
    """iid ``N(0, std²)`` of the given shape (for AdaMix: a P×C matrix, std = στ).

    ``seed_generator``: a `keras.random.SeedGenerator`, normally from
    `kdp.training.seeds.seed_generator` (OS entropy); never ``None`` or an int,
    which would follow Keras' global seed or replay the same noise.
    """
    if not isinstance(seed_generator, keras.random.SeedGenerator):
        raise TypeError("the noise needs a keras.random.SeedGenerator "
                        "(kdp.training.seeds.seed_generator()), got "
                        f"{type(seed_generator).__name__}")
    return keras.random.normal(shape, stddev=1.0, seed=seed_generator) * std


def private_release(w, x_pri, y_pri, tau, noise_multiplier, seed_generator, basis=None):
    """One private release: ``Σ_i Uᵀ clip_τ(g_i) + N(0, σ²τ² I_{P×C})``.

    Adding or removing one private example changes the sum by ``‖Uᵀ g̃_i‖ ≤ ‖g̃_i‖ ≤ τ``
    (``UᵀU = I`` makes Uᵀ non-expansive), so the release is a Gaussian mechanism with
    noise multiplier σ, provided τ and U do not depend on the private data.

    Returns:
        ``(noisy, clean, contrib)``: the release, its noise-free value and the
        per-example ``‖Uᵀ g̃_i‖²`` (for the per-instance ledger, not for release).
    """
    r = residuals(w, x_pri, y_pri)
    scale = clip_factors(per_example_norms(x_pri, r), tau)
    clean = gradient_sum(x_pri, r, scale, basis)
    xb = x_pri if basis is None else ops.matmul(x_pri, basis)
    contrib = ops.sum(xb * xb, axis=1) * ops.sum(r * r, axis=1) * scale * scale
    noisy = clean + gaussian_noise(ops.shape(clean), noise_multiplier * tau, seed_generator)
    return noisy, clean, contrib
