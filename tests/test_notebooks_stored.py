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
* each file stays small;
* the key figures are current: every accountant a stored privacy statement
  names is the default one, and the σ, ε and step counts that pure accounting
  calls give for the notebook's full configuration (`KEY_FIGURES`; no
  training) are what the current code gives (outputs stored before a change
  of the accounting are stale).
"""

import functools
import glob
import importlib.util
import inspect
import math
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
    "12_fine_tuning.ipynb": ("build_12_fine_tuning.py", "CELLS"),
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


# --- the key figures ---------------------------------------------------------------

#: load_digits(batch_size=256): N = 1437 training images, b = 256, 6 steps per epoch
Q_DIGITS = 256 / 1437


@functools.lru_cache(maxsize=None)
def _sigma(epsilon, q=Q_DIGITS, steps=240, delta=1e-5, **kwargs):
    from kdp import accounting

    return float(accounting.calibrate_noise_multiplier(epsilon, q, steps, delta, **kwargs))


def _epsilon(sigma, steps, q=Q_DIGITS, delta=1e-5, **kwargs):
    from kdp import accounting

    return accounting.compute_epsilon(sigma, q, steps, delta, **kwargs)


def _max_steps(epsilon_max, sigma, q=Q_DIGITS, delta=1e-5):
    from kdp import accounting

    return accounting.max_steps(epsilon_max, sigma, q, delta)


def _default_accountant_name():
    from kdp.privacy import accountant_name
    from kdp.training import PrivacyGate

    return accountant_name(inspect.signature(PrivacyGate).parameters["accountant"].default)


def _helmet_sigma(epsilon):
    from kdp.helmet import calibrate_sigma

    return calibrate_sigma(epsilon, 1e-5, 1)


def _adamix(what, epsilon):
    from kdp import adamix as am

    steps = am.calibrate_steps(epsilon, 1e-5, 20.0)  # SIGMA, DELTA = 20, 1e-5
    return steps if what == "steps" else am.noisy_gd_epsilon(20.0, steps, 1e-5)


def _dpcl(what):
    from kdp.dpcl import accounting as A

    row = A.PAPER_TABLE["simclr-original"]
    if what == "sigma":
        return A.calibrate_paper_sigma(1000.0, 128 / 50000, row["steps"], 1e-5,
                                       row["n_mechanisms"], row["fixed"])
    sigmas = [row["sigma"]] * row["n_mechanisms"] + list(row["fixed"])
    return A.epsilon(A.step_event(sigmas, 50000, 128), row["steps"], 1e-5)[0]


def _fine_tuning_sigma(nb_samples, epsilon):
    from kdp.finetuning import fine_tuning_recipe

    return fine_tuning_recipe(nb_samples, epsilon, train="head").noise_multiplier


#: notebook -> [(a pattern whose group is a number in the stored outputs, what the
#: current code gives for it with the notebook's full configuration)]. A per-layer model
#: of n kernels adds one Gaussian of σ_eff = σ/√n per step (`make_private` calibrates σ_eff).
KEY_FIGURES = {
    "01_basics.ipynb": [
        (r"240 steps -> noise multiplier sigma = ([\d.]+)", lambda: _sigma(3.0) * math.sqrt(2)),
        (r"\(sigma_eff = ([\d.]+)\)", lambda: _sigma(3.0)),
        (r"epsilon= 8\.0  sigma= *([\d.]+)", lambda: _sigma(8.0) * math.sqrt(2)),
        (r"per-example clipping: sigma = ([\d.]+)", lambda: _sigma(3.0, steps=120)),
    ],
    "02_convnet_certified.ipynb": [(r"sigma = ([\d.]+) for 40 epochs", lambda: _sigma(8.0))],
    "03_accounting.ipynb": [
        (r"global +sigma_eff=4\.000  epsilon after 40 epochs= *([\d.]+)", lambda: _epsilon(4.0, 240)),
        (r"noise_multiplier=([\d.]+) was calibrated", lambda: _sigma(3.0)),
        (r"per-layer make_private: sigma= *([\d.]+)", lambda: _sigma(3.0) * math.sqrt(3)),
        (r"  1 epochs: RDP epsilon= *([\d.]+)", lambda: _epsilon(4.0, 6, accountant="rdp")),
        (r"  1 epochs: RDP epsilon= *[\d.]+  PLD epsilon= *([\d.]+)",
         lambda: _epsilon(4.0, 6, accountant="pld")),
        (r"  1 epochs: Poisson epsilon= *([\d.]+)", lambda: _epsilon(4.0, 6)),
        (r"  1 epochs: Poisson .* shuffled \(no amplification\) epsilon= *([\d.]+)",
         lambda: _epsilon(4.0, 6, sampling="shuffle", steps_per_epoch=6)),
        (r"epsilon=1: 2 ep -> sigma ([\d.]+)", lambda: _sigma(1.0, steps=12)),
        (r"stopped after (\d+) steps", lambda: _max_steps(2.0, 2.5)),
    ],
    "04_dp_helmet.ipynb": [(r"softmax   ε=    1: σ= *([\d.]+)", lambda: _helmet_sigma(1.0))],
    "05_adamix.ipynb": [(r"\n  3 +(\d+) ", lambda: _adamix("steps", 3.0)),
                        (r"\n  3 +\d+ +([\d.]+)", lambda: _adamix("epsilon", 3.0))],
    "06_contrastive.ipynb": [  # the trainer calibrates with RDP: 716 pairs, b = 64, 15 epochs
        (r"logit-dp .* sigma ([\d.]+)", lambda: _sigma(5.0, 64 / 716, 15 * 12, 1e-4,
                                                         accountant="rdp"))],
    "07_adaptive_clipping.ipynb": [(r"no clipping: training sigma ([\d.]+)",
                                    lambda: _sigma(3.0, steps=30 * 6))],
    "08_dpcl.ipynb": [(r"simclr-original +paper sigma [\d.]+  solved sigma ([\d.]+)",
                       lambda: _dpcl("sigma")),
                      (r"simclr-original .* joint-accounting epsilon ([\d,]+)",
                       lambda: _dpcl("epsilon"))],
    "09_audit.ipynb": [(r"honest, ε=1 +σ= *([\d.]+)", lambda: _sigma(1.0, 1.0, 1))],
    "10_data_from_disk.ipynb": [(r"arrays: 240 steps, epsilon = ([\d.]+)",
                                 lambda: _epsilon(4.0 / math.sqrt(2), 240))],
    "11_tables.ipynb": [  # the recipe: N = 6000, b = 512, 60 epochs of 12 steps
        (r"training sigma ([\d.]+) alone", lambda: _sigma(3.0, 512 / 6000, 720))],
    "12_fine_tuning.ipynb": [  # the recipe for the 1,144 private sentences at epsilon = 3
        (r"noise_multiplier = ([\d.]+): kdp's accountant", lambda: _fine_tuning_sigma(1144, 3.0))],
}


def check_key_figures(name, text):
    """``(stale, missing)``: the key figures of notebook ``name`` whose value in its
    stored output ``text`` is not what the current code gives (to half a unit of the
    printed last digit, and 1e-4 relative), and the patterns ``text`` does not match.
    An accountant named by a privacy statement in ``text`` must be the default's."""
    stale, missing = [], []
    expected_name = _default_accountant_name()
    for stored_name in re.findall(r"Privacy spent \(([^)]*)\)", text):
        if stored_name != expected_name:
            stale.append(f"Privacy spent ({stored_name}), the default is now the {expected_name}")
    for pattern, compute in KEY_FIGURES.get(name, []):
        match = re.search(pattern, text)
        if match is None:
            missing.append(pattern)
            continue
        stored = match.group(1).replace(",", "")
        decimals = len(stored.split(".")[1]) if "." in stored else 0
        value = float(compute())
        if abs(float(stored) - value) > 0.5 * 10.0 ** -decimals + 1e-4 * abs(value):
            stale.append(f"{match.group(0).strip()!r}: the current code gives "
                         f"{value:.{decimals}f}")
    return stale, missing


def _stream_text(nb):
    return "".join(out["text"] for out in _outputs(nb) if out.get("output_type") == "stream")


def test_every_notebook_has_key_figures():
    assert sorted(KEY_FIGURES) == sorted(map(os.path.basename, NOTEBOOKS))


@pytest.mark.parametrize("name", sorted(KEY_FIGURES))
def test_the_stored_key_figures_are_what_the_code_gives(name):
    nb = nbformat.read(os.path.join(HERE, name), as_version=4)
    stale, missing = check_key_figures(name, _stream_text(nb))
    assert not missing, f"{name}: no stored output matches {missing}: update KEY_FIGURES"
    assert not stale, (f"{name} stores outputs the current code no longer gives: {stale}; "
                       f"re-execute it: python notebooks/execute_notebooks.py {name[:2]}")


def test_the_key_figure_check_flags_outputs_of_the_former_rdp_default():
    """Control: 01_basics as stored when ε was RDP's by default is stale; the same
    lines with the current figures are not."""
    old = ("40 epochs = 240 steps -> noise multiplier sigma = 6.045 (sigma_eff = 4.275), "
           "budget epsilon_max = 3.0\nPrivacy spent (RDP accountant):\n")
    stale, _ = check_key_figures("01_basics.ipynb", old)
    assert len(stale) == 3
    assert any("RDP accountant" in s for s in stale)
    assert any("6.045" in s for s in stale) and any("4.275" in s for s in stale)
    sigma_eff = _sigma(3.0)
    current = (old.replace("6.045", f"{sigma_eff * math.sqrt(2):.3f}")
               .replace("4.275", f"{sigma_eff:.3f}")
               .replace("RDP accountant", _default_accountant_name()))
    assert check_key_figures("01_basics.ipynb", current)[0] == []
