"""Every Python block of README.md runs as pasted.

Each ```python block is one test (its id: the section heading and the block's
first line). It runs alone in a fresh Python process (this file run as a
script, ``--block LINE``), in an empty working directory, with only its own
imports and data, as a user pasting it would: no state leaks between blocks
(backend, `keras.distribution`, the seed), and the device count can be set
before the backend starts. The price is the import of kdp in every block
(about 10 s). Blocks in other languages (bash, text diagrams) are not run.

Small runs: the runner wraps `keras.Model.fit` (which kdp's models call for
their training loop) so that a call trains at most `MAX_EPOCHS` epochs past
``initial_epoch``; the README keeps its real numbers and no kdp code knows
about the docs.

Devices: the runner shows the backend `DEVICES` virtual CPU devices (JAX:
``--xla_force_host_platform_device_count``; TensorFlow: logical devices), so
the data-parallel block really runs on several replicas; a block that does
not ask for a distribution engine uses one device, as it would on a laptop.

Tracebacks give README.md's own line numbers.
"""

import functools
import inspect
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
MAX_EPOCHS = 2
DEVICES = 2
TIMEOUT_S = 900
_FENCE = re.compile(r"^```\s*(\S*)")
_PYTHON = {"python", "py", "python3"}


class Block(NamedTuple):
    line: int      # README line of the block's first code line
    section: str   # the "## " heading above it
    source: str

    @property
    def id(self):
        first = self.source.strip().splitlines()[0].strip()
        return f"{self.section}: {first}"


def python_blocks(text):
    """The fenced Python blocks of a Markdown text, in order."""
    blocks, section, language, start, lines = [], "", None, 0, []
    for number, line in enumerate(text.splitlines(), start=1):
        fence = _FENCE.match(line)
        if language is None:
            if line.startswith("## "):
                section = line[3:].strip()
            elif fence:
                language, start, lines = fence.group(1).lower(), number + 1, []
        elif fence:
            if language in _PYTHON:
                blocks.append(Block(start, section, "\n".join(lines) + "\n"))
            language = None
        else:
            lines.append(line)
    return blocks


def readme_blocks():
    return python_blocks(README.read_text(encoding="utf-8"))


# --- the runner (one block, in a fresh process) --------------------------------------


def capped_fit(fit, max_epochs=MAX_EPOCHS):
    """``fit`` that trains at most ``max_epochs`` epochs past ``initial_epoch``."""
    signature = inspect.signature(fit)

    @functools.wraps(fit)
    def capped(*args, **kwargs):
        call = signature.bind(*args, **kwargs)
        first = call.arguments.get("initial_epoch", 0)
        call.arguments["epochs"] = min(call.arguments.get("epochs", 1), first + max_epochs)
        return fit(*call.args, **call.kwargs)

    return capped


def _virtual_devices():
    if os.environ.get("KERAS_BACKEND", "tensorflow") == "tensorflow":
        import tensorflow as tf

        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration()] * DEVICES)


def _run(line):
    block = next(b for b in readme_blocks() if b.line == line)
    _virtual_devices()
    import keras

    keras.Model.fit = capped_fit(keras.Model.fit)
    code = compile("\n" * (block.line - 1) + block.source, str(README), "exec")
    exec(code, {"__name__": "__main__"})


# --- the tests ------------------------------------------------------------------------

BLOCKS = readme_blocks()


@pytest.mark.parametrize("block", BLOCKS, ids=[b.id for b in BLOCKS])
def test_block_runs(block, tmp_path):
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={DEVICES}"
    env = {**os.environ, "XLA_FLAGS": flags.strip(), "MPLBACKEND": "Agg",
           "TF_CPP_MIN_LOG_LEVEL": os.environ.get("TF_CPP_MIN_LOG_LEVEL", "3")}
    run = subprocess.run([sys.executable, __file__, "--block", str(block.line)], cwd=tmp_path,
                         env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    tail = f"{run.stdout[-2000:]}\n{run.stderr[-6000:]}"
    assert run.returncode == 0, f"README.md line {block.line}:\n{tail}"


def test_blocks_found():
    """The fences are read: Python blocks are found, other languages are not."""
    text = "## A\n```python\nx = 1\n```\n```bash\nls\n```\n## B\n```text\ny\n```\n```py\nz = 2\n```\n"
    assert python_blocks(text) == [Block(3, "A", "x = 1\n"), Block(13, "B", "z = 2\n")]
    assert len(BLOCKS) >= 4 and len({b.id for b in BLOCKS}) == len(BLOCKS)


def test_capped_fit():
    def fit(self, x=None, epochs=1, initial_epoch=0, **kwargs):
        return epochs, initial_epoch

    capped = capped_fit(fit, max_epochs=2)
    assert capped(None, epochs=40) == (2, 0)
    assert capped(None, None, 40, 5) == (7, 5)
    assert capped(None, epochs=1) == (1, 0)
    assert capped(None) == (1, 0)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--block"]:
        _run(int(sys.argv[2]))
