"""DP-SimCLR and DP-Barlow-Twins objectives in three modes (keras.ops, pure).

Views: ``Z`` is ``(2B, d)``, unit rows; rows ``k`` and ``B + k`` are the two
views of record ``k``. Each objective has two pure functions:

* ``release(Z, noise, spec)``: the connection points, from the unit-normal
  draws ``noise`` (a dict of arrays); every released value is computed from
  ``stop_gradient(Z)`` and is a Gaussian release of `kdp.dpcl.mechanisms`;
* ``loss(Z, released, spec)``: the scalar whose gradient w.r.t. ``Z`` gives the
  per-view cotangents ``c_i = ∂L/∂z_i`` (per-view gradient ``g_i = J_iᵀ c_i``).

Modes (``Δ_g``: sensitivity of ``Σ_i clip_C(g_i)``, replace-one):

* ``"as-published"`` (Li et al. §3.2.2, §3.3.2): SimCLR logits ``(ZZᵀ + E_S)/τ``,
  BT standardised with noisy mean/variance, gradients flowing through ``Z``
  everywhere. ``Δ_g = 4C`` **as claimed by the paper, unproven and false in
  general**: the backward pass of ``ZZᵀ`` (or of the batch sums in BT) uses
  every raw ``z_k``, so replacing one record changes every ``g_i`` (tests/test_dpcl.py).
* ``"full"``: the paper's "original DPSGD": exact ``S`` / statistics, no
  connection-point noise, ``Δ_g = 2nC = 4|B|C`` (proven, triangle inequality).
* ``"rigorous"``: each view's loss depends on the batch only through released
  values. SimCLR: release ``Z̃ = Z + 𝒩(0, (2√2σ)²)`` and use logits
  ``⟨z_i, z̃_k⟩/τ``, ``k ≠ i``. BT: release ``μ̃, ṽ`` per branch, then the
  standardised rows ``a_b, b_b`` clipped to norm ``R`` and
  ``C̃ = Σ_b a_b b_bᵀ/N + 𝒩(0, (2R²σ/N)²)`` (Δ = 2R²/N); the surrogate
  ``Σ_b ⟨∂L_BT/∂C (C̃), a_b b_bᵀ⟩/N`` has per-record terms. Given the released
  values, replacing record ``k`` changes only ``g_k, g_{B+k}``: ``Δ_g = 4C``
  (proven; add/remove ``2C``).
"""

import math

from keras import ops

from kdp.dpcl import mechanisms as M

OBJECTIVES = ("simclr", "barlow-twins")
MODES = ("as-published", "rigorous", "full")


def gradient_sensitivity(mode, clip_norm, n_views, relation="replace-one"):
    """``Δ_g`` of ``Σ_i clip_C(g_i)`` over ``n_views`` views (see the module docstring)."""
    M._check_relation(relation)
    if mode == "full":
        # replace-one: every g_i may change, ‖Σḡ − Σḡ'‖ ≤ 2nC; add/remove: + the new views' ≤ 2C
        return 2.0 * n_views * clip_norm + (0.0 if relation == "replace-one" else 2.0 * clip_norm)
    if mode in ("as-published", "rigorous"):
        return (4.0 if relation == "replace-one" else 2.0) * clip_norm
    raise ValueError(f"mode must be one of {MODES}, got {mode!r}")


def _nt_xent(logits, batch):
    """NT-Xent (Eq. 3–4) from ``(2B, 2B)`` logits: mean over the 2B rows of
    ``−log softmax_{k≠i}(logits_i)[pos(i)]``, ``pos(k) = k ± B``."""
    n = 2 * batch
    eye = ops.eye(n, dtype=logits.dtype)
    logits = logits - 1e9 * eye
    pos = ops.concatenate([ops.arange(batch, n), ops.arange(0, batch)])
    target = ops.take_along_axis(logits, ops.expand_dims(pos, 1), axis=1)[:, 0]
    return ops.mean(ops.logsumexp(logits, axis=1) - target)


def barlow_loss(C, lambda_offdiag):
    """``Σ_i (1 − C_ii)² + λ Σ_{i≠j} C_ij²`` (Eq. 5)."""
    diag = ops.diagonal(C)
    return ops.sum(ops.square(1.0 - diag)) + lambda_offdiag * (
        ops.sum(ops.square(C)) - ops.sum(ops.square(diag)))


def barlow_loss_grad(C, lambda_offdiag):
    """``∂L_BT/∂C``: ``−2(1 − C_ii)`` on the diagonal, ``2λC_ij`` off it."""
    eye = ops.eye(C.shape[0], dtype=C.dtype)
    return eye * (-2.0 * (1.0 - C)) + (1.0 - eye) * (2.0 * lambda_offdiag * C)


def _clip_rows(a, radius):
    norm = ops.sqrt(ops.sum(ops.square(a), axis=1, keepdims=True))
    return a * ops.minimum(1.0, radius / ops.maximum(norm, 1e-12))


class Spec:
    """Hyper-parameters of one objective and mode (public constants).

    Args:
        objective: ``"simclr"`` or ``"barlow-twins"``; mode: see `MODES`.
        batch_size: ``B`` records (``2B`` views).
        noise_multiplier: ``σ`` of every connection-point release.
        temperature: NT-Xent τ (the paper does not state it).
        lambda_offdiag: BT λ (not stated in the paper; 5e-3 as in Barlow Twins).
        radius: BT ``"rigorous"``: clip radius ``R`` of the standardised rows
            (default ``√d``, the norm of a typical standardised row).
        var_floor: floor added to the noisy variance before the square root
            (ṽ can be 0).
    """

    def __init__(self, objective, mode, batch_size, dim, noise_multiplier=None, temperature=0.5,
                 lambda_offdiag=5e-3, radius=None, var_floor=1e-2):
        if objective not in OBJECTIVES:
            raise ValueError(f"objective must be one of {OBJECTIVES}, got {objective!r}")
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if mode != "full" and not (noise_multiplier and noise_multiplier > 0):
            raise ValueError(f"mode {mode!r} needs a connection-point noise_multiplier > 0")
        self.objective, self.mode = objective, mode
        self.batch, self.dim = int(batch_size), int(dim)
        self.sigma = noise_multiplier
        self.temperature, self.lambda_offdiag = float(temperature), float(lambda_offdiag)
        self.radius = float(radius) if radius is not None else math.sqrt(dim)
        self.var_floor = float(var_floor)

    # -- the releases of one step ---------------------------------------------------------
    def noise_shapes(self):
        """``{name: shape}`` of the unit-normal draws one step needs."""
        n, d = 2 * self.batch, self.dim
        if self.mode == "full":
            return {}
        if self.objective == "simclr":
            return {"S": (n, n)} if self.mode == "as-published" else {"Z": (n, d)}
        shapes = {"mean_a": (d,), "mean_b": (d,), "sse_a": (d,), "sse_b": (d,)}
        if self.mode == "rigorous":
            shapes["C"] = (d, d)
        return shapes

    def releases(self):
        """``[(name, Δ)]``: the connection-point releases of one step (replace-one)."""
        n, N = 2 * self.batch, self.batch
        if self.mode == "full":
            return []
        if self.objective == "simclr":
            if self.mode == "as-published":
                return [("similarity", M.similarity_sensitivity(n))]
            return [("embeddings", M.embedding_sensitivity())]
        out = [("mean_a", M.mean_sensitivity(N)), ("mean_b", M.mean_sensitivity(N)),
               ("sse_a", M.sse_sensitivity()), ("sse_b", M.sse_sensitivity())]
        if self.mode == "rigorous":
            out.append(("C", 2.0 * self.radius**2 / N))
        return out

    def release(self, Z, noise):
        """The released values of one step (a dict), from ``stop_gradient(Z)``."""
        if self.mode == "full":
            return {}
        Z = ops.stop_gradient(Z)
        B, s = self.batch, self.sigma
        if self.objective == "simclr":
            if self.mode == "as-published":  # S̃ = ZZᵀ + E_S; the loss adds E_S to its own ZZᵀ
                std = M.similarity_sensitivity(2 * B) * s
                return {"S_noise": std * noise["S"]}
            return {"Z": M.dp_embeddings(Z, s, noise=noise["Z"]).value}
        za, zb = Z[:B], Z[B:]
        out = {}
        for tag, z in (("a", za), ("b", zb)):
            std_mu, std_sse = M.mean_sensitivity(B) * s, M.sse_sensitivity() * s
            if self.mode == "as-published":  # noises only: the loss keeps the gradient path
                out[f"mean_{tag}"] = std_mu * noise[f"mean_{tag}"]
                out[f"sse_{tag}"] = std_sse * noise[f"sse_{tag}"]
            else:
                out[f"mean_{tag}"] = M.dp_batch_mean(z, s, noise=noise[f"mean_{tag}"]).value
                out[f"var_{tag}"] = M.dp_batch_variance(z, s, noise=noise[f"sse_{tag}"]).value
        if self.mode == "rigorous":
            a, b = self._standardised(Z, out)
            C = ops.matmul(ops.transpose(a), b) / B
            out["C"] = C + (2.0 * self.radius**2 / B) * s * noise["C"]
        return out

    # -- the losses --------------------------------------------------------------------
    def _standardised(self, Z, rel):
        B = self.batch
        a = (Z[:B] - rel["mean_a"]) / ops.sqrt(rel["var_a"] + self.var_floor)
        b = (Z[B:] - rel["mean_b"]) / ops.sqrt(rel["var_b"] + self.var_floor)
        return _clip_rows(a, self.radius), _clip_rows(b, self.radius)

    def loss(self, Z, released):
        """The scalar whose ``∂/∂Z`` gives the per-view cotangents (see module doc)."""
        B, tau = self.batch, self.temperature
        if self.objective == "simclr":
            if self.mode == "rigorous":
                return _nt_xent(ops.matmul(Z, ops.transpose(released["Z"])) / tau, B)
            S = ops.matmul(Z, ops.transpose(Z))
            if self.mode == "as-published":
                S = S + released["S_noise"]
            return _nt_xent(S / tau, B)
        if self.mode == "rigorous":
            a, b = self._standardised(Z, released)
            G = ops.stop_gradient(barlow_loss_grad(released["C"], self.lambda_offdiag))
            return ops.sum(G * ops.matmul(ops.transpose(a), b)) / B
        za, zb = Z[:B], Z[B:]
        stats = {}
        for tag, z in (("a", za), ("b", zb)):
            mean, sse = ops.mean(z, axis=0), M.batch_sse(z)
            if self.mode == "as-published":
                mean, sse = mean + released[f"mean_{tag}"], sse + released[f"sse_{tag}"]
            stats[f"mean_{tag}"] = mean
            stats[f"var_{tag}"] = ops.maximum(sse, 0.0) / (B - 1)
        a = (za - stats["mean_a"]) / ops.sqrt(stats["var_a"] + self.var_floor)
        b = (zb - stats["mean_b"]) / ops.sqrt(stats["var_b"] + self.var_floor)
        return barlow_loss(ops.matmul(ops.transpose(a), b) / B, self.lambda_offdiag)

    def true_loss(self, Z):
        """The noise-free loss, for monitoring only (not covered by the guarantee)."""
        B = self.batch
        if self.objective == "simclr":
            return _nt_xent(ops.matmul(Z, ops.transpose(Z)) / self.temperature, B)
        za, zb = Z[:B], Z[B:]
        a = (za - ops.mean(za, axis=0)) / ops.sqrt(ops.var(za, axis=0) * B / (B - 1) + self.var_floor)
        b = (zb - ops.mean(zb, axis=0)) / ops.sqrt(ops.var(zb, axis=0) * B / (B - 1) + self.var_floor)
        return barlow_loss(ops.matmul(ops.transpose(a), b) / B, self.lambda_offdiag)


__all__ = ["MODES", "OBJECTIVES", "Spec", "barlow_loss", "barlow_loss_grad",
           "gradient_sensitivity"]
