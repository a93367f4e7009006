"""The one source of randomness for every private release in kdp.

Noise and sampling are seeded from the operating system's entropy
(``os.urandom``, 64 bits) unless the user explicitly asks for
``reproducible=True`` (tests only). Never from a default seed, from Python's
`random` or from Keras' global seed (`keras.utils.set_random_seed`): anyone who
can replay the noise can subtract it, and a re-run on a neighbouring dataset
would then reveal membership.
"""

import os

import keras
import numpy as np

SEED_BITS = 64


def os_seed(bits=SEED_BITS):
    """A fresh integer of ``bits`` bits from the operating system's entropy."""
    return int.from_bytes(os.urandom((bits + 7) // 8), "little") >> (-bits % 8)


def shared_os_seed(bits=SEED_BITS):
    """`os_seed` of process 0, on every process that trains with JAX's
    multi-process runtime (a collective: every process calls it in the same
    order); `os_seed` everywhere else. A replicated JAX state must hold the
    same value on every process (JAX refuses it otherwise)."""
    from kdp import distribute

    if keras.backend.backend() != "jax" or distribute.process_count() == 1:
        return os_seed(bits)
    words = [(os_seed(bits) >> (32 * i)) & 0xFFFFFFFF for i in range(-(-bits // 32))]
    first = distribute.allgather(None, np.array(words, dtype="uint32"))[0]
    return sum(int(w) << (32 * i) for i, w in enumerate(first))


def draw_seed(reproducible, seed, offset=0):
    """``seed + offset`` if ``reproducible`` (tests only), else 64 bits of OS entropy."""
    if reproducible:
        if seed is None:
            raise ValueError("reproducible=True needs an explicit seed")
        return int(seed) + offset
    return os_seed()


def check_seed(reproducible, seed):
    """Refuse a noise seed without ``reproducible=True`` (a fixed seed lets anyone
    replay the noise and subtract it), and ``reproducible=True`` without a seed.
    The one seed check of every model, trainer and release in kdp."""
    if seed is not None and not reproducible:
        raise ValueError("seed fixes the noise: pass reproducible=True as well (tests only)")
    if reproducible and seed is None:
        raise ValueError("reproducible=True needs an explicit seed (tests only): no seed is a default")


def numpy_generator(reproducible=False, seed=None, offset=0):
    """A NumPy `Generator` seeded by `draw_seed` (64 bits of OS entropy by default)."""
    return np.random.default_rng(draw_seed(reproducible, seed, offset))


def seed_generator(reproducible=False, seed=None, offset=0):
    """A `keras.random.SeedGenerator` whose whole state comes from `draw_seed`.

    Keras derives a generator's state from a 32-bit seed (and `SeedGenerator(None)`
    from Python's global `random`), so the state is overwritten here with two
    words of OS entropy (`reseed`) unless ``reproducible``.
    """
    generator = keras.random.SeedGenerator(
        draw_seed(reproducible, seed, offset) % (2**31 - 2) if reproducible else 0)
    if not reproducible:
        reseed(generator)
    return generator


def reseed(generator):
    """Give ``generator`` a fresh state from the OS entropy: 64 bits on JAX (two
    uint32 words), two words of 31 bits on TensorFlow (which folds int64 seeds
    modulo ``2^31 - 2``)."""
    state = generator.state
    dtype = keras.backend.standardize_dtype(state.dtype)
    modulus = 2**32 if dtype == "uint32" else 2**31 - 2
    entropy = shared_os_seed(2 * SEED_BITS)  # one read: each word from its own 64 bits
    words = [((entropy >> (SEED_BITS * i)) & (2**SEED_BITS - 1)) % modulus for i in range(2)]
    state.assign(np.array(words, dtype=dtype))
    return generator
