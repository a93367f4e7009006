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
