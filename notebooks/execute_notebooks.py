"""Execute the tutorial notebooks in place, in their full configuration, and
store them **with their outputs** (what GitHub shows).

    python notebooks/execute_notebooks.py                      # every notebook
    python notebooks/execute_notebooks.py 01_basics 07         # some of them (name prefixes)

The stored outputs come from this script: the full configuration
(``KDP_NOTEBOOK_SMALL`` is removed from the kernel's environment) on the
**TensorFlow** backend (``KERAS_BACKEND=tensorflow``), on CPU. DP training draws
its noise from the OS, so a re-run gives slightly different numbers.

The notebooks keep themselves small (figures at 72 dpi, PNG; ``fit`` with
``verbose=0`` or ``2``); this script also merges each cell's consecutive stream
outputs, drops ANSI escape codes (stream outputs, plain-text displays,
tracebacks) and TensorFlow's C++ start-up log lines (stderr), does not record
per-cell timings, and refuses to store a notebook whose execution raised. It prints each notebook's execution time and
stored size; ``tests/test_notebooks_stored.py`` checks the stored outputs.

The test suite does not use this script: nbmake executes a copy of every
notebook in the small configuration (``KDP_NOTEBOOK_SMALL=1``, set by
``notebooks/conftest.py``) and never writes the outputs back.
"""

import argparse
import glob
import os
import re
import sys
import time

import nbformat
from nbclient import NotebookClient

HERE = os.path.dirname(os.path.abspath(__file__))
ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]")
#: TensorFlow's C++ start-up log lines (oneDNN notices, absl's "before
#: InitializeLog" line): they reach the kernel's stderr whatever
#: TF_CPP_MIN_LOG_LEVEL says and tell nothing about the notebook.
TF_NOISE = re.compile(r"^(?:[IWEF]\d{4} \d\d:\d\d:\d+\.\d+ +\d+ [\w.]+:\d+\] .*"
                      r"|WARNING: All log messages before absl::InitializeLog\(\) is called.*)\n?",
                      re.MULTILINE)
#: A stored notebook above this size is reported (the test's limit is larger).
TARGET_KB = 200


def clean_outputs(nb):
    """Strip ANSI escape codes from stream outputs, plain-text displays and
    tracebacks, and TensorFlow's C++ start-up lines from stderr (dropping
    streams left empty)."""
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        kept = []
        for out in cell.outputs:
            if out.get("output_type") == "stream":
                out["text"] = ANSI.sub("", out["text"])
                if out.get("name") == "stderr":
                    out["text"] = TF_NOISE.sub("", out["text"])
                if not out["text"]:
                    continue
            elif out.get("output_type") == "error":
                out["traceback"] = [ANSI.sub("", line) for line in out["traceback"]]
            elif "text/plain" in out.get("data", {}):  # e.g. Keras' rich model summary
                out["data"]["text/plain"] = ANSI.sub("", out["data"]["text/plain"])
            kept.append(out)
        cell.outputs = kept


def execute(path, timeout):
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, timeout=timeout, kernel_name="python3", record_timing=False,
                            coalesce_streams=True,  # one stdout output per cell, not one per line
                            resources={"metadata": {"path": os.path.dirname(path)}})
    start = time.time()
    client.execute()
    seconds = time.time() - start
    clean_outputs(nb)
    nbformat.validate(nb)
    with open(path, "w", encoding="utf-8") as f:
        nbformat.write(nb, f)
    return seconds, os.path.getsize(path) / 1024


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help="notebook name prefixes (default: all)")
    parser.add_argument("--timeout", type=int, default=1800, help="seconds per cell")
    args = parser.parse_args(argv)

    # The kernel inherits this environment: the full configuration, on TensorFlow.
    os.environ.pop("KDP_NOTEBOOK_SMALL", None)
    os.environ["KERAS_BACKEND"] = "tensorflow"
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

    paths = sorted(glob.glob(os.path.join(HERE, "*.ipynb")))
    if args.names:
        paths = [p for p in paths if any(os.path.basename(p).startswith(n) for n in args.names)]
    if not paths:
        parser.error("no notebook matches")
    failed = []
    for path in paths:
        name = os.path.basename(path)
        print(f"executing {name} ...", flush=True)
        try:
            seconds, kb = execute(path, args.timeout)
        except Exception as error:  # noqa: BLE001 (report, go on, exit non-zero)
            failed.append(name)
            print(f"  FAILED ({type(error).__name__}); {name} left unchanged:\n"
                  f"{ANSI.sub('', str(error))[-3000:]}", flush=True)
            continue
        note = "" if kb < TARGET_KB else f"  (above {TARGET_KB} KB)"
        print(f"  {name}: {seconds:.0f} s, {kb:.0f} KB{note}", flush=True)
    if failed:
        sys.exit(f"failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
