"""The tutorial notebooks are committed with the outputs of a full run
(``python notebooks/execute_notebooks.py``), so GitHub shows their results and
plots. Fast checks on the stored files (nothing is executed here: nbmake runs
the notebooks themselves, in their small configuration):

* every code cell was executed (has an ``execution_count``) and the notebook
  has outputs;
* a notebook that plots has at least one PNG figure;
* the stored cells are those of the notebook's builder (a builder edited but
  not re-run and re-executed leaves stale outputs);
* no stored output is an error;
* the outputs come from the full configuration on the TensorFlow backend (what
  the notebooks print about it);
* each file stays small.
"""

import glob
import importlib.util
import os
import re

import nbformat
import pytest

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "notebooks")
NOTEBOOKS = sorted(glob.glob(os.path.join(HERE, "*.ipynb")))
#: notebook -> (builder script, its list of cells); 04–06 are edited directly.
BUILDERS = {
    "01_basics.ipynb": ("build_notebooks.py", "BASICS"),
    "02_convnet_certified.ipynb": ("build_notebooks.py", "CONVNET"),
    "03_accounting.ipynb": ("build_notebooks.py", "ACCOUNTING"),
    "07_adaptive_clipping.ipynb": ("build_07_adaptive_clipping.py", "CELLS"),
    "08_dpcl.ipynb": ("build_08_dpcl.py", "CELLS"),
    "09_audit.ipynb": ("build_09_audit.py", "CELLS"),
    "10_data_from_disk.ipynb": ("build_10_data_from_disk.py", "CELLS"),
    "11_tables.ipynb": ("build_11_tables.py", "CELLS"),
}
MAX_KB = 300  # execute_notebooks.py aims at < 200 KB: small figures, verbose=0/2 fits


def _code_cells(nb):
    return [c for c in nb.cells if c.cell_type == "code"]


def _outputs(nb):
    return [out for c in _code_cells(nb) for out in c.get("outputs", [])]


def test_there_are_notebooks():
    assert len(NOTEBOOKS) >= 9


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_stored_cells_are_the_builders(name):
    script, attribute = BUILDERS[name]
    spec = importlib.util.spec_from_file_location(script[:-3], os.path.join(HERE, script))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # defines the cells; writes nothing (no __main__)
    built = [(c.cell_type, c.source) for c in getattr(module, attribute)]
    stored = [(c.cell_type, c.source) for c in nbformat.read(os.path.join(HERE, name), as_version=4).cells]
    assert stored == built, (f"{name} differs from {script}: run it, then "
                             f"python notebooks/execute_notebooks.py {name[:2]}")


@pytest.fixture(params=NOTEBOOKS, ids=os.path.basename)
def notebook(request):
    return request.param, nbformat.read(request.param, as_version=4)


def test_every_code_cell_was_executed(notebook):
    path, nb = notebook
    missing = [i for i, c in enumerate(nb.cells)
               if c.cell_type == "code" and c.source.strip() and c.get("execution_count") is None]
    assert not missing, (f"{os.path.basename(path)}: code cells {missing} have no execution_count: "
                         "store it with its outputs (python notebooks/execute_notebooks.py)")
    assert _outputs(nb), f"{os.path.basename(path)} is stored without outputs"


def test_execution_counts_are_in_order(notebook):
    # One run from top to bottom (not cells re-run by hand in another order).
    path, nb = notebook
    counts = [c.execution_count for c in _code_cells(nb) if c.source.strip()]
    assert counts == list(range(1, len(counts) + 1)), f"{os.path.basename(path)}: {counts}"


def test_plots_are_stored_as_png(notebook):
    path, nb = notebook
    source = "\n".join(c.source for c in _code_cells(nb))
    if "plt." not in source and "matplotlib" not in source:
        pytest.skip("no plot")
    pngs = [out for out in _outputs(nb) if "image/png" in out.get("data", {})]
    assert pngs, f"{os.path.basename(path)} plots but stores no image/png output"


def test_no_stored_error(notebook):
    path, nb = notebook
    for i, cell in enumerate(nb.cells):
        for out in cell.get("outputs", []):
            assert out.get("output_type") != "error", (
                f"{os.path.basename(path)} cell {i}: {out.get('ename')}: {out.get('evalue')}")
            text = out.get("text", "") if out.get("output_type") == "stream" else ""
            assert "Traceback (most recent call last)" not in text, f"{os.path.basename(path)} cell {i}"


def test_no_ansi_escape_codes(notebook):
    path, nb = notebook
    for out in _outputs(nb):
        if out.get("output_type") == "stream":
            assert "\x1b[" not in out["text"], f"{os.path.basename(path)}: ANSI codes in a stream output"


def test_full_configuration_on_tensorflow(notebook):
    path, nb = notebook
    text = "".join(out["text"] for out in _outputs(nb) if out.get("output_type") == "stream")
    assert not re.search(r"small( mode| run)?: True", text), (
        f"{os.path.basename(path)} stores a small run (KDP_NOTEBOOK_SMALL=1)")
    for backend in re.findall(r"backend: (\w+)", text):
        assert backend == "tensorflow", f"{os.path.basename(path)} was run on {backend}"


def test_size(notebook):
    path, _ = notebook
    kb = os.path.getsize(path) / 1024
    assert kb < MAX_KB, f"{os.path.basename(path)} is {kb:.0f} KB (limit {MAX_KB} KB)"
