"""Shared test set-up: quiet TensorFlow, one fixed seed per test."""

import os

# Skips a test that imports TensorFlow where it is absent; KDP_TEST_WITHOUT_TENSORFLOW=1
# makes it absent (a JAX-only installation, simulated): see tests/_without_tensorflow.py.
from _without_tensorflow import VARIABLE, install, pytest_runtest_makereport  # noqa: E402, F401

if os.environ.get(VARIABLE) == "1":
    install()
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# Notebooks executed by nbmake inherit this: their small, fast configuration.
os.environ.setdefault("KDP_NOTEBOOK_SMALL", "1")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _seed():
    keras.utils.set_random_seed(0)
    np.random.seed(0)
    yield


@pytest.fixture
def rng():
    return np.random.default_rng(0)


#: test modules whose results do not depend on the Keras backend (pure accounting,
#: static checks of files): `tests/run_suite.py` runs them once
BACKEND_INDEPENDENT = {"test_docs_site.py", "test_layering.py", "test_notebooks_stored.py",
                       "test_packaging.py", "test_quiet.py"}
#: test modules run again in a simulated JAX-only installation (`tests/run_suite.py`)
WITHOUT_TENSORFLOW = {"test_cli.py", "test_packaging.py"}


def pytest_configure(config):
    config.addinivalue_line("markers", "backend_independent: run once, not on each backend")
    config.addinivalue_line("markers", "without_tensorflow: run again without TensorFlow")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.name in BACKEND_INDEPENDENT:
            item.add_marker(pytest.mark.backend_independent)
        if item.path.name in WITHOUT_TENSORFLOW:
            item.add_marker(pytest.mark.without_tensorflow)
