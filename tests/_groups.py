"""Tests that share one worker of pytest-xdist (``--dist loadgroup``).

Some tests share a module-scoped fixture or a cached run that trains models (some
in child processes). pytest-xdist's own groups (``xdist_group`` markers) rename
the tests' node ids, which pytest 9.2 no longer reads (pytest-xdist issue 1386):
such tests would be spread over the workers, each making the run again. The
groups here are read from the node ids alone, by the scheduler `conftest.py`
hands to pytest-xdist.
"""

import os

import pytest

#: tests whose module-scoped fixtures or cached runs train models (some in child
#: processes) or build the docs site: a module, or tests of a module
#: (``module::function``). With ``--dist loadgroup`` a listed module runs on one
#: pytest-xdist worker, and so do the listed tests of one module, so each fixture or
#: run is made once (`pytest_xdist_make_scheduler`)
ONE_WORKER = {"test_certificates.py", "test_contrastive_encoders.py", "test_distributed.py",
              "test_docs_site.py", "test_multiprocess.py", "test_training.py",
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
    """pytest-xdist's hook: ``--dist loadgroup`` that also sends each `ONE_WORKER`
    group to one worker (None, pytest-xdist's own choice, for other distributions)."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadGroupScheduling

    class OneWorkerGroups(LoadGroupScheduling):
        def _split_scope(self, nodeid):
            return one_worker_group(nodeid) or super()._split_scope(nodeid)

    return OneWorkerGroups(config, log)
