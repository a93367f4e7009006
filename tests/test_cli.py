"""The command line: `python -m kdp demo`, its flags, its report and its plot."""

import importlib.util
import json
import os
import subprocess
import sys
import time

import keras
import numpy as np
import pytest

import _without_tensorflow as without_tensorflow
from kdp import accounting, cli

BACKEND = keras.backend.backend()
OTHER = {"tensorflow": "jax", "jax": "tensorflow"}.get(BACKEND, "tensorflow")


@pytest.mark.parametrize("argv", [
    ["demo", "--epsilon", "-1"],
    ["demo", "--epsilon", "abc"],
    ["demo", "--dataset", "imagenet"],
    ["demo", "--backend", "theano"],
    ["demo", "--epochs", "0"],
    ["demo", "--noise-multiplier", "0"],
    ["demo", "--delta", "1.5"],
    ["demo", "--no-such-flag"],
    ["frobnicate"],
])
def test_bad_flags_exit_non_zero_with_a_message(argv, capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "usage:" in err and "error:" in err


def test_no_command_prints_help():
    assert cli.main([]) == 2


def test_budget_violation_is_refused_before_training(capsys, tmp_path):
    with pytest.raises(SystemExit) as info:
        cli.main(["demo", "--epochs", "50", "--noise-multiplier", "0.5", "--out", str(tmp_path)])
    assert "target" in str(info.value.code)
    assert not list(tmp_path.iterdir())


def test_pick_epochs_respects_the_budget():
    q, spe, delta = 256 / 1437, 6, 1e-5
    picked = [cli.pick_epochs(eps, q, spe, delta, 4.3, 60) for eps in (1.0, 3.0, 8.0)]
    assert picked == sorted(picked) and picked[0] < picked[2]
    epochs = picked[1]
    assert accounting.compute_epsilon(4.3, q, epochs * spe, delta) <= 3.0
    assert accounting.compute_epsilon(4.3, q, (epochs + 1) * spe, delta) > 3.0
    assert cli.pick_epochs(8.0, q, spe, delta, 4.3, 5) == 5  # never more than asked
    assert cli.pick_epochs(3.0, q, spe, delta, 0.3, 60) == 0  # 0 if not one epoch fits


def test_certified_accuracy_matches_margins():
    import kdp
    from kdp import layers as L

    model = keras.Sequential([L.DP_BoundedInput((4,), upper_bound=10.0), L.DP_SpectralDense(3)])
    rng = np.random.default_rng(0)
    x = rng.normal(size=(50, 4)).astype("float32")
    logits = np.asarray(model.predict(x, verbose=0))
    y = logits.argmax(1)
    y[:10] = (y[:10] + 1) % 3  # ten wrong labels
    cert, lip = cli.certified_accuracy(model, x, y, [0.0, 0.05, 0.2, 100.0])
    assert lip == pytest.approx(float(kdp.lipschitz_constant(model)))
    assert cert[0.0] == pytest.approx(0.8)
    assert cert[0.0] >= cert[0.05] >= cert[0.2] >= cert[100.0] == 0.0
    top2 = np.sort(logits, 1)[:, -2:]
    radius = (top2[:, 1] - top2[:, 0]) / (lip * np.sqrt(2))
    assert cert[0.2] == pytest.approx(np.mean((radius > 0.2) & (logits.argmax(1) == y)), abs=0.021)


def test_backend_flag_re_executes_when_keras_runs_another_backend(monkeypatch):
    """`main` called where Keras is already imported (here, with BACKEND) re-executes
    ``python -m kdp`` once with the variable set; never a second time."""
    calls = []
    monkeypatch.setattr(os, "execve", lambda *args: calls.append(args))
    monkeypatch.delenv(cli._REEXEC_FLAG, raising=False)
    monkeypatch.setenv("KERAS_BACKEND", BACKEND)
    argv = ["demo", "--backend", OTHER]
    cli._ensure_backend(BACKEND, argv)
    assert not calls
    cli._ensure_backend(OTHER, argv)
    (path, args, env), = calls
    assert args == [sys.executable, "-m", "kdp", *argv]
    assert env["KERAS_BACKEND"] == OTHER and env[cli._REEXEC_FLAG] == "1"
    monkeypatch.setenv(cli._REEXEC_FLAG, "1")
    with pytest.raises(SystemExit, match="could not switch"):
        cli._ensure_backend(OTHER, argv)


def _run(args, env_backend, timeout=240, cwd=None):
    env = dict(os.environ, KERAS_BACKEND=env_backend, TF_CPP_MIN_LOG_LEVEL="3")
    return subprocess.run([sys.executable, "-m", "kdp", *args], env=env, capture_output=True,
                          text=True, timeout=timeout, cwd=cwd)


def test_bad_flag_in_a_subprocess():
    result = _run(["demo", "--epsilon", "zero"], BACKEND)
    assert result.returncode == 2
    assert "--epsilon" in result.stderr and "expected a number" in result.stderr


def test_demo_end_to_end(tmp_path):
    """A short demo on the current backend, started under the other backend's variable
    so that --backend must take effect (set before Keras is imported), from a folder
    that holds a clone named ``kdp`` (which shadowed the package as a namespace)."""
    work = tmp_path / "work"
    (work / "kdp").mkdir(parents=True)
    (work / "kdp" / "README.md").write_text("a clone of the repository")
    result = _run(["demo", "--epsilon", "2", "--epochs", "2", "--backend", BACKEND,
                   "--out", str(tmp_path)], OTHER, cwd=work)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = result.stdout
    assert "kdp demo report" in out and "test accuracy" in out and "certified accuracy" in out
    assert "epsilon" in out  # the progress bar shows ε
    report = json.loads((tmp_path / "report_digits.json").read_text())
    assert report["backend"] == BACKEND and f"backend = {BACKEND}" in out
    # the time of each phase, named: training is not the process's start-up
    times = report["time_s"]
    assert set(times) == {"imports", "setup", "training", "evaluation"}
    assert all(t > 0 for t in times.values())
    assert f"training {times['training']:.1f} s (2 epochs" in out
    assert f"imports {times['imports']:.1f} s (Keras, {BACKEND}, kdp)" in out
    if report["process_time_s"] is not None:  # Linux: the process's age, to about a second
        assert report["process_time_s"] >= sum(times.values()) - 1.5
        assert f"{report['process_time_s']:.0f} s in all since the process started" in out
    assert 0 < report["epsilon"] <= 2.0 + 1e-9
    assert report["method"] == "clipless" and report["batch_size"] == 256
    assert report["delta"] == 1e-5 and report["steps"] == 2 * 6 and report["epochs"] == 2
    # ε recomputed independently of the callback from (σ, q, steps), with the accountant
    # make_private chose (PLD by default)
    assert report["accountant"] == "tightest"
    eps = accounting.compute_epsilon(report["noise_multiplier"], 256 / 1437, 12, 1e-5, "pld")
    assert report["epsilon"] == pytest.approx(eps, rel=1e-6)
    assert 0 <= report["certified_accuracy"] <= report["test_accuracy"] <= 1
    assert len(report["history"]["epsilon"]) == 2
    png = tmp_path / "demo_digits.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


# --- a quiet console on either backend ------------------------------------------------

#: what TensorFlow's start-up writes to stderr (besides the C++ log lines of
#: `kdp._quiet.CPP_LOG_LINE`), the continuation of cpu_feature_guard's line included
TF_NOISE = ("oneDNN custom operations", "This TensorFlow binary is optimized",
            "To enable the following instructions", "cuda drivers", "cuInit", "TensorRT")


def tensorflow_noise(stderr):
    """The lines of ``stderr`` that TensorFlow's (or XLA's, absl's) C++ start-up wrote."""
    from kdp._quiet import ABSL_NOTICE, CPP_LOG_LINE

    return [line for line in stderr.splitlines()
            if CPP_LOG_LINE.match(line) or line.startswith(ABSL_NOTICE)
            or any(text in line for text in TF_NOISE)]


def test_the_noise_check_flags_tensorflow_start_up_lines():
    """Control for the check below: it flags what TensorFlow prints (both log formats),
    not an ordinary warning."""
    samples = [
        "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR",
        "I0000 00:00:1795909291.955635    5035 cudart_stub.cc:31] Could not find cuda drivers "
        "on your machine, GPU will not be used.",
        "E0000 00:00:1795909309.984841    5035 cuda_platform.cc:52] failed call to cuInit: INTERNAL",
        "I0000 00:00:1795908328.355398   23989 cpu_feature_guard.cc:227] This TensorFlow binary is "
        "optimized to use available CPU instructions in performance-critical operations.",
        "To enable the following instructions: AVX2 FMA, in other operations, rebuild TensorFlow "
        "with the appropriate compiler flags.",
        "2024-03-01 12:17:26.167599: I tensorflow/core/util/port.cc:113] oneDNN custom operations "
        "are on. You may see slightly different numerical results.",
    ]
    ordinary = "/work/kdp/model.py:12: UserWarning: dp__sequential: no noise multiplier was chosen"
    assert tensorflow_noise("\n".join(samples + [ordinary])) == samples


def _has(module):
    return importlib.util.find_spec(module) is not None


@pytest.mark.parametrize("backend", ["jax", "tensorflow"])
def test_the_demo_prints_no_tensorflow_start_up_lines(backend, tmp_path):
    """The demo's stderr holds none of TensorFlow's C++ start-up lines, whatever the
    user's TF_CPP_MIN_LOG_LEVEL was (here: unset); with --backend jax, TensorFlow is
    not even imported (Keras' set_random_seed would import it). Control: TensorFlow,
    imported at the log level a user may choose (0), does print such lines here."""
    if not _has(backend):
        pytest.skip(f"{backend} is not installed")
    env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    code = (without_tensorflow.PRELUDE if env.get(without_tensorflow.VARIABLE) == "1" else "") + f"""
import sys
from kdp.cli import main
code = main(["demo", "--backend", {backend!r}, "--epochs", "1", "--quiet", "--out", {str(tmp_path)!r}])
print("tensorflow imported:", "tensorflow" in sys.modules)
sys.exit(code)
"""
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert "kdp demo report" in result.stdout
    assert tensorflow_noise(result.stderr) == [], result.stderr[-3000:]
    assert f"tensorflow imported: {backend == 'tensorflow'}" in result.stdout
    if backend == "tensorflow":  # control: this TensorFlow has start-up lines to hide
        control = subprocess.run(
            [sys.executable, "-c", "import tensorflow as tf; tf.constant(1.0) + 1"],
            env=dict(env, TF_CPP_MIN_LOG_LEVEL="0"), capture_output=True, text=True, timeout=300)
        if control.stderr.strip():
            assert tensorflow_noise(control.stderr), control.stderr[-2000:]


def test_the_backend_defaults_to_jax_only_where_tensorflow_is_missing(monkeypatch, tmp_path):
    find_spec = importlib.util.find_spec
    monkeypatch.delenv("KERAS_BACKEND", raising=False)
    monkeypatch.setenv("KERAS_HOME", str(tmp_path))
    installed = {"tensorflow", "jax"}
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: find_spec("os") if name in installed else None)
    assert cli._default_backend() is None  # Keras' own default, TensorFlow
    installed.discard("tensorflow")
    assert cli._default_backend() == "jax"
    (tmp_path / "keras.json").write_text('{"backend": "torch"}')
    assert cli._default_backend() is None  # the user's configured backend
    (tmp_path / "keras.json").write_text('{"backend": "tensorflow"}')  # Keras writes its default
    assert cli._default_backend() == "jax"
    monkeypatch.setenv("KERAS_BACKEND", "tensorflow")
    assert cli._default_backend() is None


# --- the version ---------------------------------------------------------------------------

def test_version_flag(capsys):
    import kdp

    with pytest.raises(SystemExit) as info:
        cli.main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.strip() == f"kdp {kdp.__version__}"
    result = subprocess.run([sys.executable, "-m", "kdp", "--version"], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0 and result.stdout.strip() == f"kdp {kdp.__version__}"


# --- start-up: `--help` without Keras, a lazy package --------------------------------

HEAVY = {"keras", "tensorflow", "jax", "dp_accounting"}


def _imported(code_or_module_args):
    """Top-level packages a fresh interpreter imports for these arguments (``-X importtime``)."""
    start = time.perf_counter()
    result = subprocess.run([sys.executable, "-X", "importtime", *code_or_module_args],
                            capture_output=True, text=True, timeout=120)
    print(f"\n{' '.join(code_or_module_args)[:60]!r}: {time.perf_counter() - start:.2f} s")
    lines = [line for line in result.stderr.splitlines() if line.startswith("import time:")]
    return result, {line.rsplit("|", 1)[1].strip().split(".")[0] for line in lines[1:]}


@pytest.mark.parametrize("args", [
    ["-m", "kdp", "--help"],
    ["-m", "kdp", "demo", "--help"],
    ["-c", "import sys; from kdp.cli import main; sys.argv = ['kdp', '--help']; sys.exit(main())"],
])
def test_help_imports_neither_keras_nor_a_backend(args):
    """``python -m kdp --help`` and the console script ``kdp --help`` (whose script
    calls `kdp.cli.main`) answer without importing Keras, TensorFlow, JAX or dp-accounting."""
    result, imported = _imported(args)
    assert result.returncode == 0 and "usage: kdp" in result.stdout, result.stderr[-2000:]
    assert "kdp" in imported and not imported & HEAVY


def test_import_kdp_is_lazy_and_resolves_the_public_names():
    code = """
import sys
import kdp
assert not {"keras", "tensorflow", "jax"} & set(sys.modules), "import kdp imported Keras"
assert set(kdp.__all__) <= set(dir(kdp)) and kdp.__version__
namespace = {}
exec("from kdp import *", namespace)
from kdp.model import DP_Sequential
assert kdp.DP_Sequential is DP_Sequential and namespace["DP_Sequential"] is DP_Sequential
assert all(namespace[name] is getattr(kdp, name) for name in kdp.__all__)
assert kdp.datasets.load_digits and kdp.certificates.certified_accuracy  # submodules too
assert not hasattr(kdp, "no_such_name") and not hasattr(kdp, "_no_such_name")
"""
    result, _ = _imported(["-c", code])
    assert result.returncode == 0, result.stderr[-3000:]


def test_the_package_version_is_a_literal_setup_cfg_can_read():
    import ast

    import kdp

    tree = ast.parse(open(kdp.__file__).read())
    assigned = {t.id: n.value for n in tree.body if isinstance(n, ast.Assign) for t in n.targets}
    assert ast.literal_eval(assigned["__version__"]) == kdp.__version__


@pytest.mark.parametrize("imports", ["import kdp\nimport keras",
                                     "from kdp.layers import DP_GroupSort\nimport keras"])
def test_a_saved_model_loads_in_a_fresh_process_after_importing_kdp(tmp_path, imports):
    """Keras only finds kdp's classes once registered, at the import of their module:
    kdp registers them all when Keras is imported (after the kdp module that imported
    it, in the second case)."""
    import kdp
    from kdp import layers as L
    from kdp import losses

    model = kdp.DP_Sequential(
        [L.DP_BoundedInput((4,), upper_bound=1.0), L.DP_QuickSpectralDense(8), L.DP_GroupSort(2),
         L.DP_QuickSpectralDense(3)],
        dp_parameters=kdp.DPParameters("global", noise_multiplier=2.0, delta=1e-3),
        dataset_metadata=kdp.DatasetMetadata((4,), 3, 64, 16))
    model.compile(optimizer="sgd", loss=losses.DP_TauCategoricalCrossentropy(4.0))
    model.save(tmp_path / "m.keras")
    x = np.linspace(-1, 1, 8, dtype="float32").reshape(2, 4)
    code = f"""{imports}
import numpy as np
model = keras.models.load_model({str(tmp_path / "m.keras")!r})
print(type(model).__name__, type(model.loss).__name__)
print(np.asarray(model(np.linspace(-1, 1, 8, dtype="float32").reshape(2, 4))).tolist())
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=240, env=dict(os.environ, KERAS_BACKEND=BACKEND))
    assert result.returncode == 0, result.stderr[-3000:]
    names, outputs = result.stdout.strip().splitlines()[-2:]
    assert names == "DP_Sequential DP_TauCategoricalCrossentropy"
    np.testing.assert_allclose(json.loads(outputs), np.asarray(model(x)), rtol=1e-5, atol=1e-6)


def test_help_names_the_report_file_the_demo_writes(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["demo", "--help"])
    assert info.value.code == 0
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    assert "report_<dataset>.json" in out and "demo_<dataset>.png" in out
    assert "report.json" not in out


# --- the tensorboard extra --------------------------------------------------------------

def _tiny_model_and_data():
    import kdp
    from kdp import layers as L
    from kdp import losses

    model = kdp.DP_Sequential(
        [L.DP_BoundedInput((4,), upper_bound=1.0), L.DP_QuickSpectralDense(3)],
        dp_parameters=kdp.DPParameters("global", noise_multiplier=2.0, delta=1e-3),
        dataset_metadata=kdp.DatasetMetadata((4,), 3, 64, 16))
    model.compile(optimizer="sgd", loss=losses.DP_TauCategoricalCrossentropy(4.0))
    return model, np.random.default_rng(0).normal(size=(64, 4)).astype("float32"), np.arange(64) % 3


def test_epsilon_reaches_tensorboard(tmp_path):
    """With the ``tensorboard`` extra installed, Keras' TensorBoard callback shows ε and δ."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util.tensor_util import make_ndarray

    model, x, y = _tiny_model_and_data()
    history = model.fit(x, y, epochs=2, verbose=0,
                        callbacks=[keras.callbacks.TensorBoard(str(tmp_path))]).history
    events = EventAccumulator(str(tmp_path / "train"))
    events.Reload()
    for name in ("epsilon", "delta"):
        logged = [float(make_ndarray(e.tensor_proto)) for e in events.Tensors(f"epoch_{name}")]
        assert logged == pytest.approx(history[name], rel=1e-6)


@pytest.mark.skipif(importlib.util.find_spec("tensorboard") is not None,
                    reason="tensorboard is installed: the callback works")
def test_tensorboard_without_its_package_is_refused_before_any_step(tmp_path):
    model, x, y = _tiny_model_and_data()
    with pytest.raises(ImportError, match=r"kdp\[tensorboard\]"):
        model.fit(x, y, epochs=1, verbose=0, callbacks=[keras.callbacks.TensorBoard(str(tmp_path))])
    assert model.privacy_ledger.training_steps() == 0  # Keras alone fails after a step was spent


def test_the_demo_learns_a_bundled_table(tmp_path, capsys):
    """breast_cancer through the demo (its columns mapped by declared domain ranges,
    auto = per-example clipping): 10 epochs at ε = 3 reach 0.886-0.912 on JAX and
    0.886-0.895 on TensorFlow (4 runs each), against 0.627 for the majority class; the
    former loader (uncentred log1p, clipped to norm 20) gave 0.632 here (checked) and
    0.649 after 60."""
    assert cli.main(["demo", "--dataset", "breast_cancer", "--epochs", "10", "--quiet",
                     "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "report_breast_cancer.json").read_text())
    assert data["method"] == "clipping" and 0 < data["epsilon"] <= 3.0 + 1e-9
    assert data["test_accuracy"] >= 0.85


def test_the_clipping_method_reports_no_certificate(tmp_path, capsys):
    """Per-example clipping has no Lipschitz certificate to report."""
    report = cli.main(["demo", "--method", "clipping", "--epochs", "1", "--quiet",
                       "--out", str(tmp_path)])
    assert report == 0
    out = capsys.readouterr().out
    data = json.loads((tmp_path / "report_digits.json").read_text())
    assert data["method"] == "clipping" and data["certified_accuracy"] is None
    assert "no certificate" in out and "per-example clipping, C = 1" in out
    assert 0 < data["epsilon"] <= 3.0 + 1e-9 and data["steps"] == 6
