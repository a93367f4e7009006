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
#: tests whose module-scoped fixtures or cached runs train models (some in child
#: processes): a module, or tests of a module (``module::function``). With ``--dist
#: loadgroup`` a listed module runs on one pytest-xdist worker, and so do the listed
#: tests of one module, so each fixture or run is made once (`pytest_xdist_make_scheduler`)
ONE_WORKER = {"test_certificates.py", "test_contrastive_encoders.py", "test_distributed.py",
              "test_multiprocess.py", "test_training.py",
              "test_layers.py::test_gradient_bounds_are_sound",
              "test_layers.py::test_bounds_are_not_vacuous", "test_layers.py::test_model_save_load"}


def one_worker_group(nodeid):
    """The `ONE_WORKER` group of a test's node id (its module's name), or None."""
    path, _, name = nodeid.partition("::")
    module = os.path.basename(path)
    if module in ONE_WORKER or f"{module}::{name.split('[')[0]}" in ONE_WORKER:
        return module
    return None


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """``--dist loadgroup`` that also sends each `ONE_WORKER` group to one worker.

    pytest-xdist's own groups (``xdist_group`` markers) rename the tests' node ids,
    which pytest 9.2 no longer reads (pytest-xdist issue 1386): they would be spread
    over the workers, each setting the shared fixtures up again. These groups are
    read from the node ids alone."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadGroupScheduling

    class OneWorkerGroups(LoadGroupScheduling):
        def _split_scope(self, nodeid):
            return one_worker_group(nodeid) or super()._split_scope(nodeid)

    return OneWorkerGroups(config, log)


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
