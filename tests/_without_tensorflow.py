"""The test suite without TensorFlow, real or simulated.

`install` makes this process behave as if TensorFlow were not installed:
``import tensorflow`` (or a submodule) raises `ModuleNotFoundError` and
``importlib.util.find_spec("tensorflow")`` returns None. ``tests/conftest.py``
installs it when ``KDP_TEST_WITHOUT_TENSORFLOW=1``, before Keras is imported, so
that one environment with both backends can check what a JAX-only installation
(``pip install kdp[jax]``) would do. Subprocesses started by a test do not inherit
it: `PRELUDE` installs it in a ``python -c`` script.

`pytest_runtest_makereport` (imported by the conftest) reports as skipped, with the
reason, a test that fails because *its own code* (a file under ``tests/``) imports
TensorFlow while it is absent (e.g. to build a `tf.data` pipeline). A TensorFlow
import from kdp or elsewhere stays a failure: kdp must not need TensorFlow on JAX.
"""

import importlib.util
import os
import sys

import pytest

#: the packages made absent (TensorFlow and its submodules)
BLOCKED = ("tensorflow",)
#: the environment variable that asks the conftest for the simulation
VARIABLE = "KDP_TEST_WITHOUT_TENSORFLOW"
HERE = os.path.dirname(os.path.abspath(__file__))
#: the first lines of a ``python -c`` script that must run without TensorFlow too
PRELUDE = (f"import sys; sys.path.insert(0, {HERE!r}); "
           "import _without_tensorflow; _without_tensorflow.install()\n")


def blocked(name):
    return name.partition(".")[0] in BLOCKED


class _Blocker:
    """A `sys.meta_path` finder, first in line, that finds the blocked packages missing."""

    def find_spec(self, name, path=None, target=None):
        if blocked(name):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


_find_spec = importlib.util.find_spec


def _find_spec_without(name, package=None):
    if blocked(importlib.util.resolve_name(name, package) if name.startswith(".") else name):
        return None
    return _find_spec(name, package)


def install():
    """Make TensorFlow absent from this process; refused if it was already imported."""
    if any(blocked(name) for name in sys.modules):
        raise RuntimeError("TensorFlow is already imported: install the blocker before Keras")
    if not any(isinstance(f, _Blocker) for f in sys.meta_path):
        sys.meta_path.insert(0, _Blocker())
        importlib.util.find_spec = _find_spec_without


def active():
    """Whether TensorFlow is absent from this process (blocked or not installed)."""
    return importlib.util.find_spec("tensorflow") is None


def _raised_by_a_test(excinfo):
    """The file whose code ran the failed import of TensorFlow is under ``tests/``."""
    frames = [entry for entry in excinfo.traceback
              if not str(entry.path).startswith("<") and str(entry.path) != __file__]
    return bool(frames) and os.path.dirname(os.path.abspath(str(frames[-1].path))) == HERE


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    excinfo = call.excinfo
    if (report.failed and excinfo is not None and excinfo.errisinstance(ModuleNotFoundError)
            and blocked(excinfo.value.name or "") and _raised_by_a_test(excinfo)):
        report.outcome = "skipped"
        report.longrepr = (str(item.path), item.location[1] + 1,
                           "Skipped: the test imports TensorFlow, which is not installed")
