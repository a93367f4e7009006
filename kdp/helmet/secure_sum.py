"""Secure summation emulated by additive secret sharing (paper §3.5, after Bogetoft et al.).

Each user encodes its vector in fixed point, ``e = round(v · 2^F) mod B``
(``B = 2^modulus_bits``), and sends share ``r_j`` to server ``j``: ``r_1..r_{J−1}``
uniform on ``Z_B``, ``r_J = e − Σ_{j<J} r_j mod B``.  Any ``J − 1`` shares are
uniform and independent of ``e``; every server adds what it received mod B,
and the sum of the J server totals is ``Σ_i e_i mod B``: the exact sum of the
encoded inputs, decoded as a signed number.

An emulation of the honest-but-curious, non-interactive J-server variant: no
dropouts, no active security, no cryptographic channels.
"""

import numpy as np

from kdp.training import seeds


class SecureSum:
    """Additive secret sharing over ``Z_{2^modulus_bits}`` with ``num_servers`` servers.

    Args:
        num_servers: J ≥ 2.
        frac_bits: fixed-point precision F (resolution ``2^-F``).
        modulus_bits: B = 2^modulus_bits, at most 64 (uint64 arithmetic).
    """

    def __init__(self, num_servers=2, frac_bits=32, modulus_bits=64):
        if num_servers < 2:
            raise ValueError("secret sharing needs at least 2 servers")
        if not 1 <= modulus_bits <= 64 or not 0 <= frac_bits < modulus_bits:
            raise ValueError("need 0 <= frac_bits < modulus_bits <= 64")
        self.num_servers, self.frac_bits, self.modulus_bits = num_servers, frac_bits, modulus_bits
        self._mask = np.uint64((1 << modulus_bits) - 1)

    def encode(self, values):
        """Fixed point mod B; ``|v|·2^F`` must stay below ``2^(modulus_bits−1)``."""
        scaled = np.round(np.asarray(values, dtype="float64") * 2.0**self.frac_bits)
        if np.any(np.abs(scaled) >= 2.0 ** (self.modulus_bits - 1)) or not np.all(np.isfinite(scaled)):
            raise OverflowError("value out of the fixed-point range")
        return scaled.astype(np.int64).view(np.uint64) & self._mask

    def decode(self, encoded):
        """Signed fixed-point value of ``encoded mod B``."""
        e = np.asarray(encoded, dtype=np.uint64) & self._mask
        if self.modulus_bits == 64:
            signed = e.view(np.int64).astype(np.float64)
        else:
            half = np.uint64(1 << (self.modulus_bits - 1))
            signed = e.astype(np.float64) - np.where(e >= half, 2.0**self.modulus_bits, 0.0)
        return signed / 2.0**self.frac_bits

    def random_elements(self, shape, rng):
        return rng.integers(0, int(self._mask), size=shape, dtype=np.uint64, endpoint=True)

    def share(self, values, rng):
        """The J shares of one user's vector (a list of uint64 arrays)."""
        encoded = self.encode(values)
        shares = [self.random_elements(encoded.shape, rng) for _ in range(self.num_servers - 1)]
        last = encoded
        for r in shares:
            last = (last - r) & self._mask
        return shares + [last]

    def server_totals(self, user_shares):
        """What each server computes: the sum mod B of the shares it received."""
        totals = []
        for j in range(self.num_servers):
            total = np.zeros_like(user_shares[0][j])
            for shares in user_shares:
                total = (total + shares[j]) & self._mask
            totals.append(total)
        return totals

    def reconstruct(self, totals):
        """``Σ_j total_j mod B``, the encoded sum (exact)."""
        out = np.zeros_like(totals[0])
        for t in totals:
            out = (out + t) & self._mask
        return out

    def sum(self, vectors, seed=None):
        """The whole protocol: share every vector, sum per server, reconstruct, decode.

        The shares come from 64 bits of OS entropy (`kdp.training.seeds`), or
        from ``seed`` (reproducible shares, tests only).
        """
        rng = seeds.numpy_generator(seed is not None, seed)
        vectors = [np.asarray(v, dtype="float64") for v in vectors]
        bound = max(float(np.max(np.abs(v))) for v in vectors) * len(vectors)
        if bound * 2.0**self.frac_bits >= 2.0 ** (self.modulus_bits - 1):
            raise OverflowError("the sum may leave the fixed-point range: lower frac_bits")
        user_shares = [self.share(v, rng) for v in vectors]
        return self.decode(self.reconstruct(self.server_totals(user_shares)))
