"""Every Python block of README.md and of the documentation's pages runs as pasted.

The pages are README.md and every Markdown page under docs/ (the site's guide,
methods, results, ...). Each ```python block is one test (its id: the file, the
heading above the block and the block's first line). It runs alone in a fresh
process, in an empty working directory, with only its own imports and data, as
a user pasting it would: no state leaks between blocks (backend,
`keras.distribution`, the seed), and the device count can be set before the
backend starts: this file run as a script, ``--block FILE LINE``, in a process
forked from one that has imported Keras and kdp (`tests/_forks.py`: it saves
their import and teardown, more than most blocks take to run), which imports
this checkout's kdp (the repository root comes first on its ``PYTHONPATH``),
installed or not. Blocks in other languages (bash, text diagrams) are not run.

Fragments: a block that cannot run alone (its names stand for the reader's own
objects: a launcher's rank, a dataset, a compiled step) is marked by an HTML
comment on the line just before its fence, which neither GitHub nor mkdocs
shows::

    <!-- fragment: why it cannot run alone -->
    ```python
    ...
    ```

A fragment is compiled (its syntax is checked), not run. The reason is
required, and fragments stay rare: at most one block in four
(`test_blocks_found`); anything that can run on small generated data is
written to run.

Small runs: the runner wraps `keras.Model.fit` (which kdp's models call for
their training loop) so that a call trains at most `MAX_EPOCHS` epochs past
``initial_epoch``; the pages keep their real numbers and no kdp code knows
about the docs.

Devices: the runner shows the backend `DEVICES` virtual CPU devices (JAX:
``--xla_force_host_platform_device_count``; TensorFlow: logical devices), so
the data-parallel block really runs on several replicas; a block that does
not ask for a distribution engine uses one device, as it would on a laptop.

Tracebacks give the page's own line numbers.
"""

import functools
import inspect
import os
import re
import sys
from pathlib import Path
from typing import NamedTuple

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
MAX_EPOCHS = 2
DEVICES = 2
TIMEOUT_S = 900
_FENCE = re.compile(r"^(\s*)```\s*(\S*)")
_HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$")
_FRAGMENT = re.compile(r"^\s*<!--\s*fragment\b:?\s*(.*?)\s*-->\s*$")
_PYTHON = {"python", "py", "python3"}


class Block(NamedTuple):
    path: str      # the page, relative to the repository root
    line: int      # the page's line of the block's first code line
    section: str   # the nearest heading above it
    source: str
    fragment: str | None = None   # the reason given by a fragment marker, if any

    @property
    def id(self):
        first = self.source.strip().splitlines()[0].strip()
        return f"{self.path}: {self.section}: {first}"


def python_blocks(text, path="README.md"):
    """The fenced Python blocks of a Markdown text, in order (a fence may be
    indented, inside a list item: its indentation is removed from the block)."""
    blocks, section, language, start, lines, indent = [], "", None, 0, [], ""
    previous, marker = "", None
    for number, line in enumerate(text.splitlines(), start=1):
        fence = _FENCE.match(line)
        if language is None:
            heading = _HEADING.match(line)
            if heading:
                section = heading.group(1)
            elif fence:
                found = _FRAGMENT.match(previous)
                marker = found.group(1) if found else None
                indent, language, start, lines = fence.group(1), fence.group(2).lower(), number + 1, []
            if line.strip():
                previous = line
        elif fence and fence.group(1) == indent and not fence.group(2):
            if language in _PYTHON:
                blocks.append(Block(path, start, section, "\n".join(lines) + "\n", marker))
            language, previous = None, ""
        else:
            lines.append(line[len(indent):] if line.startswith(indent) else line.lstrip())
    return blocks


def pages():
    """README.md and every Markdown page under docs/."""
    return [README] + sorted(DOCS.rglob("*.md"))


def page_blocks(page):
    return python_blocks(page.read_text(encoding="utf-8"), page.relative_to(ROOT).as_posix())


def all_blocks():
    return [block for page in pages() for block in page_blocks(page)]


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


def _run(path, line):
    page = ROOT / path
    block = next(b for b in page_blocks(page) if b.line == line)
    _virtual_devices()
    import keras

    keras.Model.fit = capped_fit(keras.Model.fit)
    code = compile("\n" * (block.line - 1) + block.source, str(page), "exec")
    exec(code, {"__name__": "__main__"})


# --- the tests ------------------------------------------------------------------------

BLOCKS = all_blocks()
RUNNABLE = [b for b in BLOCKS if b.fragment is None]
FRAGMENTS = [b for b in BLOCKS if b.fragment is not None]


@pytest.mark.parametrize("block", RUNNABLE, ids=[b.id for b in RUNNABLE])
def test_block_runs(block, tmp_path, forks):
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={DEVICES}"
    env = {**forks.env, "XLA_FLAGS": flags.strip()}
    code, output = forks.run([__file__, "--block", block.path, block.line], tmp_path,
                             tmp_path / "output.log", env=env, timeout=TIMEOUT_S)
    tail = output[-8000:]
    assert code is not None, f"{block.path} line {block.line}: over {TIMEOUT_S} s\n{tail}"
    assert code == 0, f"{block.path} line {block.line} (exit code {code}):\n{tail}"


@pytest.mark.parametrize("block", FRAGMENTS, ids=[b.id for b in FRAGMENTS])
def test_fragment_compiles(block):
    """A fragment is not run, but it is Python: it compiles, and says why it cannot run."""
    assert block.fragment, f"{block.path} line {block.line}: a fragment marker gives its reason"
    compile("\n" * (block.line - 1) + block.source, block.path, "exec")


def test_blocks_found():
    """The fences are read: Python blocks are found, other languages are not; the
    heading is the nearest one of any level; an indented fence is dedented; a
    fragment marker applies to the next block only."""
    text = ("# T\n## A\n```python\nx = 1\n```\n```bash\nls\n```\n## B\n```text\ny\n```\n"
            "### C\n<!-- fragment: f is yours -->\n\n```py\nz = f()\n```\n"
            "* item\n\n    ```python\n    w = 3\n    ```\n")
    assert python_blocks(text, "p.md") == [
        Block("p.md", 4, "A", "x = 1\n"), Block("p.md", 17, "C", "z = f()\n", "f is yours"),
        Block("p.md", 22, "C", "w = 3\n")]
    assert len(BLOCKS) >= 20 and len({b.id for b in BLOCKS}) == len(BLOCKS)
    assert {b.path for b in RUNNABLE} >= {"README.md", "docs/getting-started.md"}
    assert 4 * len(FRAGMENTS) <= len(BLOCKS), "fragments are exemptions: keep them rare"


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
        _run(sys.argv[2], int(sys.argv[3]))
