"""kdp's modules import only downwards: an AST check of every import statement.

The layers, lowest first; a module may import its own layer and those below:

0. `kdp._quiet`, `kdp.compat`, `kdp._reader_processes`, `kdp.domain_ranges`:
   leaves (a logging filter, lip-dp's refused names, what a reader process
   imports, constants);
1. `kdp.privacy`: pure privacy maths on dp-accounting events (no model, no Keras);
2. the building blocks of a DP model: `kdp.distribute`, `kdp.lipschitz`,
   `kdp.metadata`, `kdp.datasets`, `kdp.tabular`, `kdp._tf_vectorize`, `kdp.autodiff`,
   `kdp.layers`, `kdp.bounds`, `kdp.losses`, `kdp.admission`, `kdp.clipping`;
3. `kdp.training`: the training core (ledger, gate, budget, `fit`'s session);
4. what users train with: `kdp.model`, `kdp.pipeline` (its batches come from
   `kdp.training.sampling`), `kdp.callbacks`, `kdp.adaptive_clipping`,
   `kdp.audit`, `kdp.certificates`, `kdp.calibration`;
5. the methods: `kdp.contrastive`, `kdp.dpcl`, `kdp.adamix`, `kdp.helmet`,
   `kdp.tuning`, `kdp.recipes`, `kdp.finetuning`;
6. the public faces, which no module of kdp imports: `kdp.accounting`
   (lip-dp's namespace over `kdp.privacy` and `kdp.training.budget`),
   `kdp.ledger`, `kdp.cli`, `kdp.__main__` and `kdp` itself.

Every import counts for the order, one inside a function too. Cycles are those
of the import-time graph: module-level imports, where importing ``kdp.a.b`` from
outside ``kdp.a`` also runs ``kdp/a/__init__.py`` (which imports its
submodules). An import inside a function runs when it is called, once the
modules are loaded: it makes no import cycle (`kdp.layers.residual` imports the
bound pass that calls it that way).
"""

import ast
import pathlib

import kdp

LAYERS = (
    ("kdp._quiet", "kdp.compat", "kdp._reader_processes", "kdp.domain_ranges"),
    ("kdp.privacy",),
    ("kdp.distribute", "kdp.lipschitz", "kdp.metadata", "kdp.datasets", "kdp.tabular",
     "kdp._tf_vectorize", "kdp.autodiff",
     "kdp.layers", "kdp.bounds", "kdp.losses", "kdp.admission", "kdp.clipping"),
    ("kdp.training",),
    ("kdp.model", "kdp.pipeline", "kdp.callbacks", "kdp.adaptive_clipping", "kdp.audit",
     "kdp.certificates", "kdp.calibration"),
    ("kdp.contrastive", "kdp.dpcl", "kdp.adamix", "kdp.helmet", "kdp.tuning", "kdp.recipes",
     "kdp.finetuning"),
    ("kdp.accounting", "kdp.ledger", "kdp.cli", "kdp.__main__", "kdp"),
)

#: known upward imports still to be removed, each mapped to the change that removes it
ALLOWED = {}

#: what `kdp.privacy` never imports
FRAMEWORKS = ("keras", "tensorflow", "jax", "torch")


def kdp_sources(root=pathlib.Path(kdp.__file__).parent):
    """``{module name: source}`` of every module of the package at ``root``."""
    sources = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        sources[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path.read_text()
    return sources


def _import_statements(source):
    """``(statement, at import time)`` for every import statement of ``source``."""
    def walk(node, top):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                yield child, top
            yield from walk(child, top and not isinstance(
                child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    return walk(ast.parse(source), True)


def _imported(statement, module, sources):
    """The modules of ``sources`` that ``statement`` (in ``module``) imports."""
    if isinstance(statement, ast.ImportFrom) and statement.level:
        raise ValueError(f"{module}: relative import (kdp imports absolutely)")
    if isinstance(statement, ast.Import):
        names = [alias.name for alias in statement.names]
    else:  # `from package import submodule` imports the submodule
        base = statement.module
        names = [f"{base}.{a.name}" if f"{base}.{a.name}" in sources else base
                 for a in statement.names]
    found = set()
    for name in names:
        while name and name not in sources:
            name = name.rpartition(".")[0]
        if name and name != module:
            found.add(name)
    return found


def import_edges(sources):
    """``{(importer, imported): at import time}`` between the modules of ``sources``."""
    edges = {}
    for module, source in sources.items():
        for statement, top in _import_statements(source):
            for target in _imported(statement, module, sources):
                edges[module, target] = edges.get((module, target), False) or top
    return edges


def layer_of(module, layers=LAYERS):
    """The index in ``layers`` of the innermost declared package holding ``module``
    (``kdp`` holds only itself), or None."""
    index = {name: i for i, layer in enumerate(layers) for name in layer}
    parts = module.split(".")
    candidates = [".".join(parts[:n]) for n in range(len(parts), 1, -1)] or [module]
    return next((index[c] for c in candidates if c in index), None)


def upward_imports(sources, layers=LAYERS):
    """``[(importer, imported)]`` where a module imports a higher layer."""
    return sorted((a, b) for a, b in import_edges(sources) if layer_of(b, layers) > layer_of(a, layers))


def import_cycles(sources):
    """The import cycles (sorted lists of modules) of the import-time graph."""
    graph = {module: set() for module in sources}
    for (a, b), top in import_edges(sources).items():
        if top:  # importing b also runs the __init__ of b's packages that do not hold a
            parts = b.split(".")
            graph[a] |= {".".join(parts[:n]) for n in range(2, len(parts) + 1)
                         if not (a + ".").startswith(".".join(parts[:n]) + ".")}

    def reachable(start):
        seen, todo = set(), list(graph[start])
        while todo:
            node = todo.pop()
            if node not in seen:
                seen.add(node)
                todo.extend(graph[node])
        return seen

    reach = {module: reachable(module) for module in graph}
    cycles = {frozenset(n for n in reach[m] if m in reach[n]) for m in graph if m in reach[m]}
    return sorted(sorted(cycle) for cycle in cycles)


# --- kdp -------------------------------------------------------------------------------------

SOURCES = kdp_sources()


def test_every_module_is_in_a_layer():
    assert [m for m in SOURCES if layer_of(m) is None] == []


def test_no_module_imports_a_higher_layer():
    found = upward_imports(SOURCES)
    new = [f"{a} (layer {layer_of(a)}) imports {b} (layer {layer_of(b)})"
           for a, b in found if (a, b) not in ALLOWED]
    assert new == [], "\n".join(new)
    assert [pair for pair in ALLOWED if pair not in found] == [], "fixed: remove from ALLOWED"


def test_no_import_cycle():
    assert import_cycles(SOURCES) == []


def test_privacy_imports_no_deep_learning_framework():
    imported = {(a.name if isinstance(s, ast.Import) else s.module).split(".")[0]
                for m, source in SOURCES.items() if layer_of(m) <= layer_of("kdp.privacy")
                for s, _ in _import_statements(source) for a in s.names}
    assert not imported & set(FRAMEWORKS)


# --- negative controls: the checker on synthetic sources ---------------------------------------

SYNTHETIC = {
    "kdp": "",
    "kdp.privacy": "def f():\n    from kdp.training import gate\n",  # upward, in a function
    "kdp.training": "",
    "kdp.training.gate": "from kdp import privacy\n",
    "kdp.layers": "from kdp.layers import base\n",
    "kdp.layers.base": "import kdp.bounds\n",
    "kdp.bounds": "from kdp.layers.base import DPLayer\n",  # runs kdp/layers/__init__.py too
}


def test_the_checker_reports_an_upward_import():
    assert upward_imports(SYNTHETIC) == [("kdp.privacy", "kdp.training.gate")]


def test_the_checker_reports_an_import_cycle_through_a_package_init():
    # privacy <-> training.gate is no cycle: privacy's import runs only when f is called
    assert import_cycles(SYNTHETIC) == [["kdp.bounds", "kdp.layers", "kdp.layers.base"]]
