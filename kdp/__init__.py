"""kdp: differentially private deep learning for Keras 3 (Clipless DP-SGD and more).

The public names and the submodules are imported on first use (PEP 562), so
that ``import kdp`` and ``python -m kdp --help`` do not import Keras. kdp's Keras
objects (layers, losses, models) register themselves for
`keras.models.load_model` when their modules are imported: kdp imports them all
as soon as Keras is imported, or at once if it already was.
"""

import importlib
import importlib.util
import sys

__version__ = "0.1.0"

#: public name -> the module that defines it (a submodule maps to itself)
_SOURCES = {
    "accounting": "kdp.accounting", "layers": "kdp.layers", "losses": "kdp.losses",
    "compute_gradient_bounds": "kdp.bounds", "lipschitz_constant": "kdp.bounds",
    "DP_Accountant": "kdp.callbacks",
    "DP_Model": "kdp.model", "DP_Sequential": "kdp.model", "DPParameters": "kdp.model",
    "DatasetMetadata": "kdp.pipeline", "bound_clip_value": "kdp.pipeline",
    "bound_normalize": "kdp.pipeline", "RecordSource": "kdp.training.sources",
}
__all__ = list(_SOURCES)
_registered = False


def __getattr__(name):
    """A public name, or a submodule (``kdp.datasets``), imported on first use."""
    if name in _SOURCES:
        module = _import(_SOURCES[name])
        value = module if module.__name__ == f"kdp.{name}" else getattr(module, name)
    elif _is_submodule(name):
        value = _import(f"kdp.{name}")
    else:
        raise AttributeError(f"module 'kdp' has no attribute {name!r}")
    globals()[name] = value
    return value


def _import(module):
    """``importlib.import_module``, naming kdp's extra to install when the package of
    Keras' backend is missing (Keras' own error points deep into Keras)."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        backend, chosen_by = _configured_backend()
        if backend not in ("jax", "tensorflow") or (e.name or "").partition(".")[0] != backend:
            raise
        raise ModuleNotFoundError(
            f"No module named {backend!r}, the Keras backend {chosen_by}: install it with "
            f"pip install 'kdp[{backend}]', or choose an installed backend "
            f"(KERAS_BACKEND=jax or tensorflow).", name=backend) from e


def _configured_backend():
    """``(backend, how it was chosen)`` as Keras chooses it at import."""
    import json
    import os

    if os.environ.get("KERAS_BACKEND"):
        return os.environ["KERAS_BACKEND"], "set by KERAS_BACKEND"
    home = os.environ.get("KERAS_HOME") or os.path.join(os.path.expanduser("~"), ".keras")
    try:
        with open(os.path.join(home, "keras.json")) as f:
            return json.load(f)["backend"], "named by keras.json"
    except (OSError, ValueError, KeyError, TypeError):
        return "tensorflow", "Keras uses by default"


def __dir__():
    return sorted(set(globals()) | set(__all__))


def _is_submodule(name):
    return (name.isidentifier() and not name.startswith("_")
            and importlib.util.find_spec(f"kdp.{name}") is not None)


def _register(finishing=None):
    """Import every public module, which registers kdp's Keras objects, once Keras
    is imported and neither Keras nor a kdp module (but ``finishing``, whose
    code has run) is half imported: importing a half-imported module is circular."""
    global _registered
    if _registered or "keras" not in sys.modules:
        return
    watched = [m for n, m in list(sys.modules.items()) if n == "keras" or n.startswith("kdp.")]
    if any(m is not finishing and getattr(getattr(m, "__spec__", None), "_initializing", False)
           for m in watched):
        return
    _registered = True
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _RegisterHook)]
    for module in dict.fromkeys(_SOURCES.values()):
        importlib.import_module(module)


class _RegisterHook:
    """Import hook: tries `_register` after the import of Keras or of a kdp module."""

    def find_spec(self, name, path=None, target=None):
        if name != "keras" and not name.startswith("kdp."):
            return None
        finders = (f for f in sys.meta_path if f is not self and hasattr(f, "find_spec"))
        spec = next(filter(None, (f.find_spec(name, path, target) for f in finders)), None)
        if spec is not None and hasattr(spec.loader, "exec_module"):
            exec_module = spec.loader.exec_module

            def exec_then_register(module):
                exec_module(module)
                _register(finishing=module)

            spec.loader.exec_module = exec_then_register
        return spec


sys.meta_path.insert(0, _RegisterHook())
_register()
