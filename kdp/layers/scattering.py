"""2-D scattering transform: free (data-independent), non-expansive image features.

``S x = {x⋆φ_J, |x⋆ψ_λ1|⋆φ_J, ||x⋆ψ_λ1|⋆ψ_λ2|⋆φ_J}`` (``j2 > j1``) subsampled by
``2^J`` (Mallat 2012, "Group invariant scattering"; Bruna & Mallat 2013), the
features of Tramèr & Boneh (ICLR 2021, "Differentially private learning needs
better features"). Filters and algorithm are kymatio's (Andreux et al. 2020):
Morlet ``ψ_{j,θ}`` (σ = 0.8·2^j, ξ = 3π/4·2^-j, slant 4/L), Gaussian ``φ``
(σ = 0.8·2^(J−1)), periodic convolutions by FFT, ``|x⋆ψ_j|`` kept at resolution
``2^-j`` and filters periodised to each resolution; on the same grid the layer
equals kymatio's periodic scattering up to one constant per path
(``path_gains``), measured in ``benchmarks/bench_scattering.py``.

Non-expansive by construction (Mallat 2012, Prop. 2.5): the cascade applies a
*level operator* ``W_r z = κ_r·{2^(J−r)·(z⋆φ)[2^(J−r)·], 2^(j−r)·(z⋆ψ_j,θ)[2^(j−r)·]}``
to ``x`` (``r = 0``), to each ``|x⋆ψ_j1|`` (``r = j1``, ``j > r``) and the
low-pass alone to each second-order modulus (``r = j2``). ``κ_r = 1/‖W_r‖``,
computed at build in float64 for the actual grid (`operator_norm_sq`: exact
block diagonalisation in Fourier over the alias classes of the subsampling, for
the real signals every level sees; without subsampling it reduces to the
Littlewood–Paley condition ``|φ̂(ω)|² + ½Σ_λ(|ψ̂_λ(ω)|² + |ψ̂_λ(−ω)|²) ≤ 1``).
The modulus is 1-Lipschitz pointwise, so ``z ↦ (low-pass part, {|wavelet
parts|})`` is non-expansive; summing the squared differences level by level
(dropping outputs only contracts) gives ``‖S x − S y‖ ≤ ‖x − y‖``, and ``S 0 = 0``.
"""

import math

import keras
import numpy as np
from keras import ops

from kdp.layers.base import DPNormNonIncreasingLayer, serializable

# sqrt(|z|² + EPS) - sqrt(EPS): 0 at 0, smooth, gradient norm < 1 (as in pooling);
# a bias of at most sqrt(EPS) = 1e-12 per modulus, a normal float32 number.
_EPS = 1e-24
# Every κ is shrunk by this relative margin: far above the float32 rounding of
# the filters (~6e-8), far below anything a user would notice.
_MARGIN = 1e-5


def scattering_channels(J, L, order=2):
    """Number ``K`` of scattering paths per input channel: ``1 + J·L (+ L²·J(J−1)/2)``."""
    return 1 + J * L + (L * L * J * (J - 1) // 2 if order >= 2 else 0)


def scattering_grid(H, W, J, padding=0):
    """``(M, N)``: the transform grid, ``H + 2·padding`` rounded up to a multiple of ``2^J``."""
    s = 2 ** J
    return (-(-(H + 2 * padding) // s) * s, -(-(W + 2 * padding) // s) * s)


def _gabor_2d(M, N, sigma, theta, xi, slant=1.0):
    """kymatio's ``gabor_2d`` in float64: a Gaussian envelope times ``e^{iξ·u}``,
    periodised over 5×5 copies of the ``M×N`` grid."""
    c, s = math.cos(theta), math.sin(theta)
    R = np.array([[c, -s], [s, c]])
    curv = R @ np.diag([1.0, slant * slant]) @ R.T / (2 * sigma * sigma)
    out = np.zeros((M, N), np.complex128)
    for ex in range(-2, 3):
        for ey in range(-2, 3):
            xx = (np.arange(M) + ex * M)[:, None].astype(np.float64)
            yy = (np.arange(N) + ey * N)[None, :].astype(np.float64)
            arg = -(curv[0, 0] * xx * xx + (curv[0, 1] + curv[1, 0]) * xx * yy
                    + curv[1, 1] * yy * yy) + 1j * xi * (xx * c + yy * s)
            out += np.exp(arg)
    return out / (2 * math.pi * sigma * sigma / slant)


def _gaussian_1d(M, sigma):
    """Periodised 1-D Gaussian, exactly symmetric (``g[-m] = g[m]``), so its DFT is real."""
    m = np.arange(M)
    m = np.where(m <= M // 2, m, m - M).astype(np.float64)
    g = sum(np.exp(-((m + k * M) ** 2) / (2 * sigma * sigma)) for k in range(-3, 4))
    return g / (math.sqrt(2 * math.pi) * sigma)


def morlet_filter_bank(M, N, J, L=8):
    """Unnormalised filters on an ``M×N`` periodic grid (kymatio's design, float64).

    Returns:
        ``(psi_hat, g_M, g_N)``: ``psi_hat`` of shape ``(J·L, M, N)``, the real
        DFTs of the Morlet wavelets ordered ``(j, θ)`` as in kymatio; ``g_M``,
        ``g_N`` the 1-D factors of the separable low-pass ``φ = g_M ⊗ g_N``.
    """
    psi = []
    for j in range(J):
        for t in range(L):
            sigma, theta, xi = 0.8 * 2 ** j, (int(L - L / 2 - 1) - t) * math.pi / L, 0.75 * math.pi / 2 ** j
            wave = _gabor_2d(M, N, sigma, theta, xi, 4.0 / L)
            envelope = _gabor_2d(M, N, sigma, theta, 0.0, 4.0 / L)
            morlet = wave - (wave.sum() / envelope.sum()) * envelope  # zero mean
            psi.append(np.real(np.fft.fft2(morlet)))  # as kymatio: imaginary part ~1e-17
    sigma_phi = 0.8 * 2 ** (J - 1)
    return np.stack(psi), _gaussian_1d(M, sigma_phi), _gaussian_1d(N, sigma_phi)


def littlewood_paley(filters):
    """``½·Σ_h (|ĥ(ω)|² + |ĥ(−ω)|²)`` on the grid, for filter spectra ``ĥ`` of one
    shape: the Littlewood–Paley sum for real signals (Mallat 2012), whose spectra
    (``ẑ(−ω) = conj ẑ(ω)``) weigh ``ω`` and ``−ω`` together."""
    M, N = filters[0].shape
    neg = (-np.arange(M)) % M, (-np.arange(N)) % N
    return 0.5 * sum(np.abs(h) ** 2 + np.abs(h[neg[0]][:, neg[1]]) ** 2 for h in filters)


def _keep(M, r):
    """kymatio's ``periodize_filter_fft`` mask: the ``M/2^r`` lowest frequencies of an axis."""
    mask = np.ones(M)
    start = int(M * 2.0 ** (-r - 1))
    mask[start:start + int(M * (1 - 2.0 ** -r))] = 0.0
    return mask


def periodize(h_hat, r):
    """A filter of the ``M×N`` grid moved to the ``M/2^r × N/2^r`` grid (kymatio's
    ``periodize_filter_fft``: keep the lowest frequencies, sum the aliases).
    1-D or 2-D."""
    if r == 0:
        return h_hat
    if h_hat.ndim == 1:
        return (h_hat * _keep(len(h_hat), r)).reshape(2 ** r, -1).sum(axis=0)
    M, N = h_hat.shape
    h = h_hat * np.outer(_keep(M, r), _keep(N, r))
    return h.reshape(2 ** r, M >> r, 2 ** r, N >> r).sum(axis=(0, 2))


def operator_norm_sq(components):
    """``‖W‖₂²`` over **real** inputs of the map ``W z = {g·(z⋆h)[s·]}``,
    ``components = [(h_hat, s, g), ...]`` (real filter spectra on one ``M×N``
    grid, ``s`` powers of 2). Every signal a level operator sees is real (the
    input, then moduli).

    ``WᴴW`` is block diagonal in Fourier over the alias classes ``ω + (M/S)ℤ ×
    (N/S)ℤ``, ``S = max s``: on a class, ``(h, s, g)`` adds ``(g²/s²)·h hᵀ`` on
    each of its own (finer) alias classes. A real ``z`` has ``ẑ(−ω) = conj ẑ(ω)``,
    so ``‖W z‖² = zᵀ Re(WᴴW) z`` and ``Re(WᴴW)`` has the block ``(B(ω) + B(−ω))/2``
    (class of ``ω``, indices matched by ``ω ↦ −ω``). Returns the largest
    eigenvalue over all blocks (float64 ``eigvalsh``)."""
    S = max(s for _, s, _ in components)
    M, N = components[0][0].shape
    m, n = M // S, N // S
    k = np.arange(S)
    neg = (-np.arange(M)) % M, (-np.arange(N)) % N
    total = np.zeros((m * n, S * S, S * S))
    for h, s, g in components:
        same = np.kron(*[(k[:, None] - k[None, :]) % (S // s) == 0] * 2)
        for spectrum in (h, h[neg[0]][:, neg[1]]):  # h(ω), h(−ω)
            blocks = spectrum.reshape(S, m, S, n).transpose(1, 3, 0, 2).reshape(m * n, S * S)
            total += (0.5 * g * g / (s * s)) * blocks[:, :, None] * blocks[:, None, :] * same
    chunks = np.array_split(total, max(1, len(total) // 64))
    return float(max(np.linalg.eigvalsh(chunk).max() for chunk in chunks))


def scattering_plan(M, N, J, L=8, order=2, kappa_scale=1.0):
    """Everything the layer computes with on an ``M×N`` grid (multiples of ``2^J``), float64.

    One *level operator* per resolution ``r`` at which it acts (``r = 0`` on
    ``x``; ``r = j1`` on ``|x⋆ψ_j1|``; ``r = j2`` on the second-order moduli):
    ``W_r z = κ_r·{2^(J−r)·(z⋆φ_r)[2^(J−r)·], 2^(j−r)·(z⋆ψ_j,θ,r)[2^(j−r)·] (j > r,
    or j ≥ 0 at the first level)}``, filters periodised to resolution ``r`` as in
    kymatio, and ``κ_r = (1 − margin)/‖W_r without κ‖`` (`operator_norm_sq`).

    Returns a dict: ``operators`` ``{name: (components, κ)}``; ``psi1[j]``
    ``(L, M, N)`` and ``psi2[(j1, j2)]`` ``(L, M/2^j1, N/2^j1)`` the wavelets to
    multiply in Fourier before summing the ``2^j`` (resp. ``2^(j2−j1)``) aliases
    (``κ``, gain and ``1/s²`` folded in); ``low0``, ``low1[j1]``, ``low2[j2]``
    pairs ``(A, B)`` with output ``A @ z @ Bᵀ``; ``path_gains`` ``(K,)``: the
    layer's path ``k`` is ``path_gains[k]`` times kymatio's periodic scattering
    with the same (``math.pi``-normalised) filters. ``kappa_scale`` multiplies
    every ``κ`` (1 for the layer; > 1 is expansive: the tests' negative control).
    """
    s_J = 2 ** J
    if M % s_J or N % s_J:
        raise ValueError(f"grid {M}x{N} is not a multiple of 2^J = {s_J}")
    psi, g_M, g_N = morlet_filter_bank(M, N, J, L)
    gh_M, gh_N = np.real(np.fft.fft(g_M)), np.real(np.fft.fft(g_N))

    def phi_hat(r):
        return np.outer(periodize(gh_M, r), periodize(gh_N, r))

    def low_rows(r, gain):  # A[p, i] = gain · g_r[(S·p − i) mod M_r], S = 2^(J−r)
        mats = []
        for gh in (gh_M, gh_N):
            g = np.real(np.fft.ifft(periodize(gh, r)))
            Mr, S = len(g), 2 ** (J - r)
            mats.append(g[(S * np.arange(Mr // S)[:, None] - np.arange(Mr)[None, :]) % Mr])
        return gain * mats[0], mats[1]

    def level(r, wavelet_scales):
        comps = [(phi_hat(r), 2 ** (J - r), 2 ** (J - r))]
        comps += [(periodize(psi[j * L + t], r), 2 ** (j - r), 2 ** (j - r))
                  for j in wavelet_scales for t in range(L)]
        return comps, kappa_scale * (1.0 - _MARGIN) / math.sqrt(operator_norm_sq(comps))

    plan = {"operators": {}, "psi1": {}, "psi2": {}, "low1": {}, "low2": {}}
    ops_ = plan["operators"]
    ops_["W0"] = level(0, range(J))
    k0 = ops_["W0"][1]
    plan["low0"] = low_rows(0, k0 * s_J)
    for j in range(J):
        plan["psi1"][j] = k0 * psi[j * L:(j + 1) * L] / 2 ** j
    gains = [k0 * s_J]
    for j1 in range(J):
        ops_[f"V{j1}"] = level(j1, range(j1 + 1, J) if order == 2 else ())
        k1 = ops_[f"V{j1}"][1]
        plan["low1"][j1] = low_rows(j1, k1 * 2 ** (J - j1))
        gains += [k0 * k1 * s_J] * L
        for j2 in range(j1 + 1, J if order == 2 else 0):
            plan["psi2"][(j1, j2)] = k1 * np.stack(
                [periodize(psi[j2 * L + t], j1) for t in range(L)]) / 2 ** (j2 - j1)
    if order == 2:
        for j2 in range(1, J):
            ops_[f"L{j2}"] = level(j2, ())
            plan["low2"][j2] = low_rows(j2, ops_[f"L{j2}"][1] * 2 ** (J - j2))
        for j1 in range(J):
            k1 = ops_[f"V{j1}"][1]
            for _theta1 in range(L):
                for j2 in range(j1 + 1, J):
                    gains += [k0 * k1 * ops_[f"L{j2}"][1] * s_J] * L
    plan["path_gains"] = np.array(gains)
    return plan


def _modulus(re, im):
    return ops.sqrt(re * re + im * im + _EPS) - math.sqrt(_EPS)


def _classes(t, s):
    """``(..., M, N) → (..., s², M/s · N/s)``: the ``s²`` aliases of each coarse frequency."""
    M, N = t.shape[-2], t.shape[-1]
    t = ops.reshape(t, (-1, s, M // s, s, N // s))
    return ops.reshape(ops.transpose(t, (0, 1, 3, 2, 4)), (-1, s * s, (M // s) * (N // s)))


def _layout(psi, s):
    """Wavelets ``(F, M, N)`` as `_classes` lays out spectra: ``(F, s², M/s·N/s)`` (float32)."""
    F, M, N = psi.shape
    if s > 1:
        psi = psi.reshape(F, s, M // s, s, N // s).transpose(0, 1, 3, 2, 4).reshape(F, s * s, -1)
    return np.asarray(psi, "float32"), s


@serializable
class DP_Scattering2D(DPNormNonIncreasingLayer, keras.layers.Layer):
    """2-D scattering transform of order 1 or 2: fixed, non-trainable, 1-Lipschitz, ``S(0) = 0``.

    ``(batch, H, W)`` or channels-last ``(batch, H, W, C)`` → ``(batch, M/2^J,
    N/2^J, C·K)``, ``K = 1 + J·L + L²·J(J−1)/2`` (order 2) or ``1 + J·L`` (order
    1), ``(M, N) = scattering_grid(H, W, J, padding)`` (= ``(H, W)`` when they
    are multiples of ``2^J`` and ``padding=0``). Channel ``c·K + k`` is path ``k``
    of input channel ``c``, paths in kymatio's order: ``φ``; ``(j1, θ1)``;
    ``(j1, θ1, j2 > j1, θ2)``. Each channel is transformed on its own.

    Filters are built with NumPy at ``build`` for the actual grid (no data) and
    normalised so that ``‖S x − S y‖ ≤ ‖x − y‖`` (module docstring): the bound
    pass keeps ``X_out = X`` and ``G_in = G``. No trainable variable, so it also
    sits in front of ordinary Keras layers trained with per-example clipping.

    Args:
        J: number of scales (subsampling ``2^J``).
        L: number of orientations.
        order: 1 or 2.
        padding: zeros added on each side before the (periodic) transform;
            extra zeros at the bottom/right round the grid up to a multiple of
            ``2^J``. Zero padding is an isometry, so the bound is unchanged.
    """

    def __init__(self, J=2, L=8, order=2, padding=0, **kwargs):
        kwargs["trainable"] = False
        super().__init__(**kwargs)
        if int(J) < 1 or int(L) < 1 or int(order) not in (1, 2) or int(padding) < 0:
            raise ValueError(f"need J >= 1, L >= 1, order in (1, 2), padding >= 0; got "
                             f"J={J}, L={L}, order={order}, padding={padding}")
        self.J, self.L, self.order, self.padding = int(J), int(L), int(order), int(padding)
        self.paths = scattering_channels(self.J, self.L, self.order)

    def build(self, input_shape):
        if len(input_shape) not in (3, 4) or input_shape[1] is None or input_shape[2] is None:
            raise ValueError(f"{self.name}: needs (batch, H, W) or (batch, H, W, C) with "
                             f"known H, W; got {input_shape}")
        M, N = scattering_grid(int(input_shape[1]), int(input_shape[2]), self.J, self.padding)
        self.grid = (M, N)  # multiples of 2^J, so 2^J ≤ min(M, N)
        plan = scattering_plan(M, N, self.J, self.L, self.order)
        self.path_gains = plan["path_gains"]
        self._psi = {("1", j): _layout(v, 2 ** j) for j, v in plan["psi1"].items()}
        self._psi.update({("2",) + k: _layout(v, 2 ** (k[1] - k[0])) for k, v in plan["psi2"].items()})
        low = [(("0", 0), plan["low0"])] + [(("1", j), v) for j, v in plan["low1"].items()]
        low += [(("2", j), v) for j, v in plan["low2"].items()]
        self._low = {key: tuple(np.asarray(a, "float32") for a in ab) for key, ab in low}

    def _lowpass(self, z, key):
        """``κ·2^(J−r)·(z⋆φ_r)`` subsampled to ``(M/2^J, N/2^J)`` on the last two axes."""
        a, b = self._low[key]
        z = ops.einsum("pm,...mn->...pn", a, z)
        return ops.einsum("...pn,qn->...pq", z, b)

    def _wavelets(self, re, im, key):
        """``|z⋆ψ|`` subsampled, from the spectra ``(B', M, N)`` of ``z``: ``(B', F, M/s, N/s)``.

        ``Σ_aliases ẑ·ψ̂`` is one contraction over the ``s²`` aliases (the product
        is never formed at full resolution), then an inverse FFT on the coarse grid."""
        psi, s = self._psi[key]
        M, N = re.shape[-2], re.shape[-1]
        if s == 1:
            re, im = re[:, None] * psi, im[:, None] * psi
        else:
            re = ops.einsum("bkp,fkp->bfp", _classes(re, s), psi)
            im = ops.einsum("bkp,fkp->bfp", _classes(im, s), psi)
            re = ops.reshape(re, (-1, psi.shape[0], M // s, N // s))
            im = ops.reshape(im, (-1, psi.shape[0], M // s, N // s))
        return _modulus(*ops.ifft2((re, im)))

    def call(self, inputs):
        x = ops.cast(inputs if len(inputs.shape) == 4 else inputs[..., None], "float32")
        H, W, C = x.shape[1], x.shape[2], x.shape[3]
        (M, N), J, L, p = self.grid, self.J, self.L, self.padding
        m, n = M >> J, N >> J
        x = ops.reshape(ops.transpose(x, (0, 3, 1, 2)), (-1, H, W))  # (B·C, H, W)
        if (M, N) != (H, W):
            x = ops.pad(x, [[0, 0], [p, M - H - p], [p, N - W - p]])
        out = [self._lowpass(x, ("0", 0))[:, None]]
        xr, xi = ops.fft2((x, ops.zeros_like(x)))
        u1 = [self._wavelets(xr, xi, ("1", j)) for j in range(J)]  # (B·C, L, M/2^j, N/2^j)
        out += [self._lowpass(u, ("1", j)) for j, u in enumerate(u1)]
        if self.order == 2:
            for j1 in range(J - 1):
                u = ops.reshape(u1[j1], (-1, M >> j1, N >> j1))  # (B·C·L, ...)
                ur, ui = ops.fft2((u, ops.zeros_like(u)))
                s2 = [self._lowpass(self._wavelets(ur, ui, ("2", j1, j2)), ("2", j2))
                      for j2 in range(j1 + 1, J)]  # each (B·C·L θ1, L θ2, m, n)
                s2 = ops.stack(s2, axis=1)  # (B·C·L, j2, L, m, n): order θ1, j2, θ2
                out.append(ops.reshape(s2, (-1, L * L * (J - 1 - j1), m, n)))
        s = ops.concatenate(out, axis=1)  # (B·C, K, m, n)
        s = ops.reshape(s, (-1, C, self.paths, m, n))
        return ops.reshape(ops.transpose(s, (0, 3, 4, 1, 2)), (-1, m, n, C * self.paths))

    def compute_output_shape(self, input_shape):
        M, N = scattering_grid(input_shape[1], input_shape[2], self.J, self.padding)
        C = input_shape[3] if len(input_shape) == 4 else 1
        return (input_shape[0], M >> self.J, N >> self.J, None if C is None else C * self.paths)

    def get_config(self):
        config = {**super().get_config(), "J": self.J, "L": self.L, "order": self.order,
                  "padding": self.padding}
        config.pop("trainable", None)
        return config
