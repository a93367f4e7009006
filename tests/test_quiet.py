"""dp-accounting's harmless `absl` warnings stay out of the user's console, and only those."""

import logging
import subprocess
import sys

import pytest
from absl import logging as absl_logging

from kdp._quiet import HARMLESS, quiet_dp_accounting

CONVERGE = HARMLESS[0]

# q ≈ 0.18 and σ = 1.1: the README's digits set-up with a small σ, where dp-accounting's
# series for the fractional orders 1.1 ... 1.7 do not converge.
SCRIPT = """
import logging
import sys
from kdp import accounting
filters = list(logging.getLogger("absl").filters)
accounting.compute_epsilon(1.1, 256 / 1437, 1000, 1e-5, "rdp")  # the warnings are RDP's
accounting.calibrate_noise_multiplier(50.0, 256 / 1437, 1000, 1e-5, "rdp")  # probes small σ
accounting.max_steps(50.0, 1.05, 0.2, 1e-5, "rdp")
print("--- kdp done ---", file=sys.stderr, flush=True)
assert logging.getLogger("absl").filters == filters, "a filter was left behind"
import dp_accounting
acc = dp_accounting.rdp.RdpAccountant()
acc.compose(dp_accounting.PoissonSampledDpEvent(256 / 1437, dp_accounting.GaussianDpEvent(1.1)))
"""


def test_kdp_accounting_prints_no_convergence_warning_and_restores_logging():
    """In a fresh process (no cached ε): kdp's calls print nothing; dp-accounting called
    directly afterwards still warns, so the logging configuration was restored."""
    result = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    during, after = result.stderr.split("--- kdp done ---")
    assert CONVERGE not in during
    assert CONVERGE in after  # the configuration does trigger the warning


def _absl_warnings(caplog):
    return [r.getMessage() for r in caplog.records if r.name == "absl"]


def test_only_the_harmless_messages_are_dropped(caplog):
    caplog.set_level(logging.WARNING, logger="absl")
    with quiet_dp_accounting():
        absl_logging.warning(CONVERGE + " after %d iterations", 1000)
        absl_logging.warning("Negative Renyi divergence of %s", -1.0)  # a real numerical problem
        absl_logging.error("something failed")
    assert _absl_warnings(caplog) == ["Negative Renyi divergence of -1.0", "something failed"]


def test_nested_uses_keep_the_filter_until_the_outermost_ends_even_on_error(caplog):
    caplog.set_level(logging.WARNING, logger="absl")
    logger = logging.getLogger("absl")
    filters = list(logger.filters)
    with pytest.raises(RuntimeError):
        with quiet_dp_accounting():
            with quiet_dp_accounting():
                pass
            absl_logging.warning(CONVERGE)  # still filtered after the inner use ended
            raise RuntimeError
    assert logger.filters == filters
    absl_logging.warning(CONVERGE)
    assert _absl_warnings(caplog) == [CONVERGE]


# --- C++ log lines on the process's standard error -----------------------------------------

CPP_SCRIPT = r"""
import os, sys
from kdp._quiet import quiet_cpp_logs
lines = [
    "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR",
    "I0000 00:00:1795909291.955635    5035 cudart_stub.cc:31] Could not find cuda drivers",
    "kept 1",
    "2024-03-01 12:17:26.572682: W tensorflow/compiler/tf2tensorrt/utils/py_utils.cc:38] TensorRT",
    "E0000 00:00:1795909309.984841    5035 cuda_platform.cc:52] failed call to cuInit",
    "F0000 00:00:1795909309.984841    5035 some.cc:1] a fatal error",
]
with quiet_cpp_logs():
    for line in lines[:3]:
        os.write(2, (line + "\n").encode())  # as C++ code writes: to the descriptor
    print("kept 2", file=sys.stderr)
    for line in lines[3:]:
        os.write(2, (line + "\n").encode())
print("after", file=sys.stderr)
"""


@pytest.mark.parametrize("level,kept", [
    ("2", ["kept 1", "kept 2", "E0000", "F0000", "after"]),
    ("3", ["kept 1", "kept 2", "F0000", "after"]),
    ("0", ["WARNING: All log", "I0000", "kept 1", "kept 2", "2024-03-01", "E0000", "F0000", "after"]),
])
def test_cpp_log_lines_below_the_level_are_dropped_from_stderr(level, kept):
    """What TensorFlow writes whatever TF_CPP_MIN_LOG_LEVEL says is dropped below that
    level; everything else passes, in order (level 0: the control, nothing dropped)."""
    import os

    result = subprocess.run([sys.executable, "-c", CPP_SCRIPT], capture_output=True, text=True,
                            timeout=60, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL=level))
    assert result.returncode == 0, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == len(kept) and all(line.startswith(k) for line, k in zip(lines, kept)), lines
