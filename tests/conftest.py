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

import _one_backend  # noqa: E402
from _groups import pytest_xdist_make_scheduler  # noqa: E402, F401
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


@pytest.fixture(scope="session")
def forks():
    """This worker's forking parent (`tests/_forks.py`): started at first use."""
    from _forks import Forks

    forks = Forks()
    yield forks
    forks.close()


#: test modules whose results do not depend on the Keras backend (pure accounting,
#: static checks of files): `tests/run_suite.py` runs them once
BACKEND_INDEPENDENT = {"test_docs_site.py", "test_layering.py", "test_notebooks_stored.py",
                       "test_packaging.py", "test_quiet.py", "test_suite_groups.py"}
#: test modules run again in a simulated JAX-only installation (`tests/run_suite.py`)
WITHOUT_TENSORFLOW = {"test_cli.py", "test_packaging.py"}


def pytest_configure(config):
    config.addinivalue_line("markers", "backend_independent: run once, not on each backend")
    config.addinivalue_line("markers", "without_tensorflow: run again without TensorFlow")


# first: the markers added here select tests (``-m``) in pytest's own hook
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    backend, without_tensorflow = keras.backend.backend(), os.environ.get(VARIABLE) == "1"

    def page(item):  # the docs page of a test_readme block, else None
        block = getattr(item, "callspec", None) and item.callspec.params.get("block")
        return getattr(block, "path", None) if item.path.name == "test_readme.py" else None

    notebooks = {item.path.name for item in items if item.path.suffix == ".ipynb"}
    pages = {page(item) for item in items} - {None, "README.md"}
    kept = [item for item in items if not _one_backend.elsewhere(
        item.path, page(item), backend, without_tensorflow, notebooks, pages)]
    if len(kept) < len(items):
        config.hook.pytest_deselected(items=[item for item in items if item not in kept])
        items[:] = kept
    for item in items:
        if item.path.name in BACKEND_INDEPENDENT:
            item.add_marker(pytest.mark.backend_independent)
        if item.path.name in WITHOUT_TENSORFLOW:
            item.add_marker(pytest.mark.without_tensorflow)
