"""DPCL's connection-point mechanisms: Gaussian releases of batch statistics.

Source: Li et al., "DPCL: Contrastive representation learning with differential
privacy" (Research Square 2022), §3.2.2 (Thm 1) and §3.3.2 (Thms 2–3).

Every function projects the rows of ``z`` (``(n, d)``, one view per row) onto
the unit sphere first, because every bound below needs ``‖z_k‖ = 1``, then adds
``𝒩(0, (Δ·σ)²)`` to each entry and returns a `Release` whose ``event`` is the
``dp_accounting.GaussianDpEvent(σ)`` of that one release (wrap a step's events
with `kdp.dpcl.accounting.step_event` for sampling).

L2 sensitivities ``Δ`` (``n`` rows; replace-one changes one row of a branch, or
two rows (the two views) of the similarity matrix / embedding matrix):

====================  ======================  =============================
release               replace-one (the paper)  add/remove (kdp's default)
====================  ======================  =============================
``S = ZZᵀ`` (n×n)      ``4√(n−1)`` (Thm 1)      ``2√(n−1)``, zero-padded to n
mean ``Σz/N``          ``2/N`` (Thm 2)          ``1/b`` (``Σz/b``, b public)
``SSE = Σz²−N z̄²``     ``6`` (Thm 3)            ``4``
``Z`` (noisy copy)     ``2√2``                  ``√2``, zero-padded
====================  ======================  =============================

Derivations of the columns the paper does not give. *S, add/remove:* two
zero rows become unit rows, the ``4n−4`` entries of their rows and columns move
by ``≤ 1``. *SSE, add/remove:* Welford's update ``SSE(Z∪{z}) − SSE(Z) =
N/(N+1)·(z − z̄)∘(z − z̄)`` has L2 norm ``≤ ‖z − z̄‖² ≤ 4``. *Z:* two unit rows
each move by ``≤ 2`` (replace) or ``≤ 1`` (add). The replace-one SSE constant 6
is the paper's; the largest change we know is ``4(N−1)/N``.
"""

import math
from typing import NamedTuple

import dp_accounting
import keras
from keras import ops

from kdp.training import seeds

RELATIONS = ("replace-one", "add-remove")


class Release(NamedTuple):
    """One Gaussian release: ``value = f(z) + 𝒩(0, noise_std²)`` per entry."""

    value: object
    event: dp_accounting.DpEvent
    sensitivity: float
    noise_std: float
    name: str


def _check_relation(relation):
    if relation not in RELATIONS:
        raise ValueError(f"relation must be one of {RELATIONS}, got {relation!r}")


def unit_rows(z, floor=1e-12):
    """``z_k / max(‖z_k‖, floor)`` row-wise (the bounds need unit rows)."""
    norm = ops.sqrt(ops.sum(ops.square(z), axis=-1, keepdims=True))
    return z / ops.maximum(norm, floor)


# -- sensitivities -------------------------------------------------------------------
def similarity_sensitivity(n, relation="replace-one"):
    """Frobenius sensitivity of ``S = ZZᵀ`` for ``n`` unit rows (Li et al. Thm 1).

    Replace-one: one example = two views, two rows and two columns change,
    ``4n−4`` entries, each by ``≤ 2``: ``Δ = 2√(4n−4) = 4√(n−1)``.
    """
    _check_relation(relation)
    if n < 2:
        raise ValueError(f"n must be >= 2, got {n}")
    return 4.0 * math.sqrt(n - 1) if relation == "replace-one" else 2.0 * math.sqrt(n - 1)


def mean_sensitivity(n, relation="replace-one"):
    """L2 sensitivity of the batch mean of unit rows: ``2/N`` (Thm 2); ``1/b`` add/remove."""
    _check_relation(relation)
    return 2.0 / n if relation == "replace-one" else 1.0 / n


def sse_sensitivity(relation="replace-one"):
    """L2 sensitivity of the per-feature ``SSE = Σ_b z_b² − N z̄²``: 6 (Thm 3); 4 add/remove."""
    _check_relation(relation)
    return 6.0 if relation == "replace-one" else 4.0


def embedding_sensitivity(relation="replace-one", views_per_record=2):
    """Frobenius sensitivity of the unit embedding matrix: ``2√v`` replace-one, ``√v``
    add/remove, for ``v`` views per record."""
    _check_relation(relation)
    return (2.0 if relation == "replace-one" else 1.0) * math.sqrt(views_per_record)


# -- releases --------------------------------------------------------------------------
def gaussian_release(value, sensitivity, noise_multiplier, name, seed=None, noise=None):
    """``value + Δσ·ξ``, ``ξ ~ 𝒩(0, I)``: ``noise`` = a given ``ξ``, else drawn from
    ``seed`` (a `keras.random.SeedGenerator` or, for tests, an int); ``seed=None``
    draws from 64 bits of OS entropy (`kdp.training.seeds`), never Keras' global seed.
    A primitive: nothing is recorded (`kdp.dpcl.DPCLTrainer` records its releases)."""
    if not noise_multiplier > 0:
        raise ValueError(f"noise_multiplier must be > 0, got {noise_multiplier}")
    std = float(sensitivity) * float(noise_multiplier)
    if noise is None:
        seed = seeds.seed_generator() if seed is None else seed
        noise = keras.random.normal(ops.shape(value), dtype=value.dtype, seed=seed)
    value = value + std * ops.cast(noise, value.dtype)
    return Release(value, dp_accounting.GaussianDpEvent(float(noise_multiplier)),
                   float(sensitivity), std, name)


def dp_similarity_matrix(z, noise_multiplier, seed=None, relation="replace-one", noise=None):
    """``S̃ = ZZᵀ + 𝒩(0, (4√(n−1)σ)²)`` on every entry (Li et al. §3.2.2, mechanism M_S).

    The noisy matrix is not symmetric (independent noise per entry, as published).
    """
    z = unit_rows(ops.convert_to_tensor(z))
    n = int(z.shape[0])
    return gaussian_release(ops.matmul(z, ops.transpose(z)), similarity_sensitivity(n, relation),
                            noise_multiplier, "similarity", seed, noise)


def dp_batch_mean(z, noise_multiplier, seed=None, relation="replace-one", denominator=None,
                  noise=None):
    """``μ̃ = Σ_b z_b / N + 𝒩(0, (2σ/N)²)`` per feature (Thm 2, Eq. 7).

    ``denominator``: the public ``N`` (default: the number of rows; with
    ``relation="add-remove"`` give the expected batch size ``b``).
    """
    z = unit_rows(ops.convert_to_tensor(z))
    n = int(z.shape[0]) if denominator is None else denominator
    return gaussian_release(ops.sum(z, axis=0) / n, mean_sensitivity(n, relation),
                            noise_multiplier, "mean", seed, noise)


def batch_sse(z):
    """``SSE(Z) = Σ_b z_b² − N z̄²`` per feature (Eq. 8–9), without noise."""
    n = z.shape[0]
    mean = ops.mean(z, axis=0)
    return ops.sum(ops.square(z), axis=0) - n * ops.square(mean)


def dp_batch_sse(z, noise_multiplier, seed=None, relation="replace-one", noise=None):
    """``SSE(Z) + 𝒩(0, (6σ)²)`` per feature (Thm 3), not clamped."""
    z = unit_rows(ops.convert_to_tensor(z))
    return gaussian_release(batch_sse(z), sse_sensitivity(relation), noise_multiplier, "sse",
                            seed, noise)


def dp_batch_variance(z, noise_multiplier, seed=None, relation="replace-one", noise=None):
    """``ṽ = max(0, SSE(Z) + 𝒩(0, (6σ)²)) / (N−1)`` (the paper's M_σ; post-processing of
    `dp_batch_sse`). The returned `Release` carries the SSE release's event."""
    r = dp_batch_sse(z, noise_multiplier, seed, relation, noise)
    n = int(ops.shape(z)[0])
    return r._replace(value=ops.maximum(r.value, 0.0) / (n - 1), name="variance")


def dp_embeddings(z, noise_multiplier, seed=None, relation="replace-one", noise=None):
    """``Z̃ = Z + 𝒩(0, (2√2σ)²)`` per entry: the noisy copy of the unit embeddings used by
    the ``"rigorous"`` DP-SimCLR (`kdp.dpcl.objectives`). Its Frobenius sensitivity does not grow
    with the batch, unlike that of ``ZZᵀ``."""
    z = unit_rows(ops.convert_to_tensor(z))
    return gaussian_release(z, embedding_sensitivity(relation), noise_multiplier, "embeddings",
                            seed, noise)


__all__ = [
    "RELATIONS", "Release", "batch_sse", "dp_batch_mean", "dp_batch_sse", "dp_batch_variance",
    "dp_embeddings", "dp_similarity_matrix", "embedding_sensitivity", "gaussian_release",
    "mean_sensitivity", "similarity_sensitivity", "sse_sensitivity", "unit_rows",
]
