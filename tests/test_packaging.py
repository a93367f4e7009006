"""Packaging: the backend is an extra, the version and licence are declared, and kdp
imports and builds a model with JAX where TensorFlow is not installed."""

import configparser
import importlib.util
import os
import re
import subprocess
import sys

import pytest

import _without_tensorflow as without_tensorflow
import kdp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BACKENDS = {"tensorflow", "tensorflow-cpu", "tensorflow-gpu", "tf-nightly", "jax", "jaxlib",
            "torch"}


def _setup_cfg():
    config = configparser.ConfigParser(interpolation=None)
    config.read(os.path.join(ROOT, "setup.cfg"))
    return config


def _names(requirements):
    """The distribution names of a setup.cfg requirements list."""
    lines = [line.strip() for line in requirements.splitlines()]
    return {re.match(r"[A-Za-z0-9._-]+", line).group(0).lower().replace("_", "-")
            for line in lines if line and not line.startswith("#")}


def test_the_core_requirements_name_no_backend_and_each_backend_is_an_extra():
    config = _setup_cfg()
    core = _names(config["options"]["install_requires"])
    assert {"keras", "dp-accounting", "numpy", "scikit-learn"} <= core
    assert not core & BACKENDS, core & BACKENDS
    extras = config["options.extras_require"]
    assert _names(extras["jax"]) == {"jax"} and _names(extras["tensorflow"]) == {"tensorflow"}
    assert _names(extras["docs"]) <= _names(extras["test"])  # the test extra builds the docs too
    assert {"pytest", "nbmake"} <= _names(extras["test"])


def test_the_licence_is_declared_and_shipped():
    config = _setup_cfg()
    assert config["metadata"]["license"] == "MIT"
    assert config["metadata"]["license_files"].split() == ["LICENSE"]
    text = open(os.path.join(ROOT, "LICENSE")).read()
    assert text.startswith("MIT License") and "Copyright (c) 2026 the kdp authors" in text


def test_kdp_version():
    """``kdp --version`` (the console script calls the entry point setup.cfg declares)
    and ``python -m kdp --version`` print ``kdp <version>``."""
    scripts = _setup_cfg()["options.entry_points"]["console_scripts"]
    assert scripts.strip() == "kdp = kdp.cli:main"
    expected = f"kdp {kdp.__version__}"
    for args in (["-c", "import sys; from kdp.cli import main; sys.argv = ['kdp', '--version']; "
                        "sys.exit(main())"],
                 ["-m", "kdp", "--version"]):
        result = subprocess.run([sys.executable, *args], capture_output=True, text=True,
                                timeout=60)
        assert result.returncode == 0 and result.stdout.strip() == expected, result.stderr


WITHOUT_TENSORFLOW = without_tensorflow.PRELUDE + """
import importlib, pkgutil, sys
try:
    import tensorflow
except ModuleNotFoundError as e:
    assert e.name == "tensorflow"
else:
    raise AssertionError("the blocker let TensorFlow in")
import kdp
model = kdp.DP_Sequential(
    [kdp.layers.DP_BoundedInput((4,), 1.0), kdp.layers.DP_QuickSpectralDense(3)],
    dp_parameters=kdp.DPParameters("global", 2.0, 1e-3),
    dataset_metadata=kdp.DatasetMetadata((4,), 3, 64, 16))
import keras
assert keras.backend.backend() == "jax"
for module in pkgutil.walk_packages(kdp.__path__, "kdp."):  # none needs TensorFlow to import
    importlib.import_module(module.name)
print("ok", "tensorflow" in sys.modules)
"""


@pytest.mark.skipif(importlib.util.find_spec("jax") is None, reason="jax is not installed")
def test_kdp_imports_and_builds_a_model_with_jax_without_tensorflow():
    """With ``import tensorflow`` failing as in a JAX-only installation, ``import kdp``,
    a model and every kdp module import with the JAX backend."""
    env = dict(os.environ, KERAS_BACKEND="jax")
    result = subprocess.run([sys.executable, "-c", WITHOUT_TENSORFLOW], capture_output=True,
                            text=True, timeout=300, env=env, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split()[-2:] == ["ok", "False"]


def test_a_missing_backend_names_the_extra_to_install():
    """KERAS_BACKEND=tensorflow where TensorFlow is absent: kdp's first use says what to
    install, not Keras' error from deep inside Keras."""
    code = without_tensorflow.PRELUDE + """
import kdp
try:
    kdp.DP_Sequential
except ModuleNotFoundError as e:
    print(e.name, "|", e)
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=300, env=dict(os.environ, KERAS_BACKEND="tensorflow"), cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    name, message = result.stdout.strip().splitlines()[-1].split(" | ")
    assert name == "tensorflow" and "set by KERAS_BACKEND" in message
    assert "pip install 'kdp[tensorflow]'" in message and "KERAS_BACKEND=jax" in message


def _notebook_imports():
    """The top-level modules the notebooks' code cells import, beyond the standard library and kdp."""
    import ast
    import glob

    import nbformat

    modules = set()
    for path in glob.glob(os.path.join(ROOT, "notebooks", "*.ipynb")):
        for cell in nbformat.read(path, as_version=4).cells:
            if cell.cell_type != "code":
                continue
            for node in ast.walk(ast.parse(cell.source)):
                if isinstance(node, ast.Import):
                    modules.update(alias.name.split(".")[0] for alias in node.names)
                elif isinstance(node, ast.ImportFrom) and node.level == 0:
                    modules.add(node.module.split(".")[0])
    return modules - set(sys.stdlib_module_names) - {"kdp"}


def test_the_notebooks_extra_installs_what_the_notebooks_import():
    # `pip install -e ".[notebooks]"` (the notebooks index says so) must run every notebook
    # with a backend: each module they import comes from a declared requirement.
    import importlib.metadata

    config = _setup_cfg()
    declared = (_names(config["options"]["install_requires"])
                | _names(config["options.extras_require"]["notebooks"]) | BACKENDS)
    distributions = importlib.metadata.packages_distributions()
    modules = _notebook_imports()
    assert {"keras", "numpy", "sklearn"} <= modules, modules  # the parse found the imports
    missing = {module: distributions.get(module, [module]) for module in modules
               if not {d.lower().replace("_", "-") for d in distributions.get(module, [module])} & declared}
    assert not missing, f"imported by a notebook, not in the notebooks extra: {missing}"
