"""The command line: `python -m kdp demo`, its flags, its report and its plot."""

import json
import os
import subprocess
import sys

import keras
import numpy as np
import pytest

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
    picked = [cli.pick_epochs(eps, q, spe, delta, 4.3, 3, 60) for eps in (1.0, 3.0, 8.0)]
    assert picked == sorted(picked) and picked[0] < picked[2]
    epochs = picked[1]
    assert accounting.compute_epsilon(4.3, q, epochs * spe, delta) <= 3.0
    assert accounting.compute_epsilon(4.3, q, (epochs + 1) * spe, delta) > 3.0
    # with a given σ, never more epochs than the budget allows (0 if none)
    assert cli.pick_epochs(3.0, q, spe, delta, 4.3, 3, 60, noise_multiplier=0.3) == 0


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
    so that --backend must take effect (re-executing the process), from a folder
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
    assert 0 < report["epsilon"] <= 2.0 + 1e-9
    assert report["delta"] == 1e-5 and report["steps"] == 2 * 6 and report["epochs"] == 2
    # ε recomputed independently of the callback from (σ, q, steps)
    eps = accounting.compute_epsilon(report["noise_multiplier"], 256 / 1437, 12, 1e-5)
    assert report["epsilon"] == pytest.approx(eps, rel=1e-6)
    assert 0 <= report["certified_accuracy"] <= report["test_accuracy"] <= 1
    assert len(report["history"]["epsilon"]) == 2
    png = tmp_path / "demo_digits.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
