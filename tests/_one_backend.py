"""Pages of the documentation and notebooks: each on one Keras backend.

A docs page's blocks and a notebook are a user's view of the library: they call
public functions whose backend-specific work (the compiled step, its noise, the
gradient bounds) the rest of the suite tests on both backends. In the suite's
backend tiers (`tests/run_suite.py` sets ``KDP_TEST_SPLIT=1``) each runs in one
of them, the pages and the notebooks alternating in sorted order, so both
backends run half of them at half the cost; README.md's blocks run on both. The
CLI's tests run on TensorFlow there, and on JAX in the JAX-only tier. A plain
``pytest`` run (no ``KDP_TEST_SPLIT``) runs everything on the current backend.
"""

import os

BACKENDS = ("tensorflow", "jax")
#: the environment variable with which `tests/run_suite.py` asks for the split
VARIABLE = "KDP_TEST_SPLIT"


def assigned_backend(name, names):
    """The backend that runs ``name``: by its position in ``sorted(names)``."""
    return BACKENDS[sorted(names).index(name) % len(BACKENDS)]


def elsewhere(path, block_page, backend, without_tensorflow, notebooks, pages):
    """Whether a test another tier runs: a notebook or a docs page's block
    (``block_page``) assigned to the other backend, or a CLI test outside the
    JAX-only tier on JAX. Always False unless ``KDP_TEST_SPLIT=1``."""
    if os.environ.get(VARIABLE) != "1":
        return False
    if path.suffix == ".ipynb":
        return assigned_backend(path.name, notebooks) != backend
    if path.name == "test_readme.py" and block_page not in (None, "README.md"):
        return assigned_backend(block_page, pages) != backend
    return path.name == "test_cli.py" and backend == "jax" and not without_tensorflow
