"""Start the tests' Python processes as forks of one that has imported Keras and kdp.

Tests that run code as a user would (the docs' blocks, multi-process training, a
training process killed and restarted) start ``python SCRIPT ARGS...`` processes:
each then imports Keras and kdp (9 s on JAX, 14 s on TensorFlow, 2 cores) and,
at its end, tears its modules down (2-3 s), more than most of them take to run.
`Forks` starts them instead as children of one parent process per pytest worker
(this file run as a script) that has imported Keras and kdp and nothing more:

* the parent starts no backend (neither JAX's client nor TensorFlow's runtime
  exists before a fork), so a child configures and starts it as a fresh process
  does (devices, ``XLA_FLAGS``, a distribution across processes);
* a child gets the environment, working directory, ``sys.argv`` and
  ``sys.path[0]`` of ``python SCRIPT ARGS...``, its output goes to a log file,
  and it runs the script as ``__main__``;
* it exits with the code the interpreter would give (1 after an exception; the
  signal's negative number if killed), once the threads it would wait for have
  ended; the interpreter's teardown of its modules, which cannot change the exit
  code, is skipped.

What a fork cannot change: the variables read when Keras and kdp were imported
(``KERAS_BACKEND``: a child asking for another backend is refused with exit code
2; TensorFlow's C++ log level; JAX's ``JAX_*`` settings), which are the parent's.

Off Linux (macOS forbids much of what a forked TensorFlow or JAX process does),
or with ``KDP_TEST_FRESH_PROCESSES=1`` (to check that a failure is not the
fork's), the parent imports nothing and each child replaces itself with a fresh
``python SCRIPT ARGS`` (`FRESH`): the same interface, at the old cost.

The parent reads JSON lines ``{"start": argv, "cwd": ..., "env": ..., "log": ...}``
on its standard input and writes ``{"started": pid}`` and, when that child ends,
``{"ended": pid, "code": ...}``; it is single-threaded (no lock can be held by
another thread at a fork) and ends when its input closes and its children have.
"""

import json
import os
import runpy
import select
import signal
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: how long the parent may take to start (importing Keras and kdp on a loaded machine)
START_S = 300
#: each child runs a fresh interpreter instead of the forked one
FRESH = sys.platform != "linux" or os.environ.get("KDP_TEST_FRESH_PROCESSES") == "1"


class Forks:
    """The forking parent, seen from the tests (one per pytest worker: `forks`)."""

    def __init__(self):
        path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
        self.env = {**os.environ, "PYTHONPATH": path, "MPLBACKEND": "Agg",
                    "TF_CPP_MIN_LOG_LEVEL": os.environ.get("TF_CPP_MIN_LOG_LEVEL", "3")}
        self.parent = subprocess.Popen([sys.executable, __file__], cwd=ROOT, env=self.env,
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.pending, self.codes = b"", {}

    def start(self, argv, cwd, log, env=None):
        """Start ``python *argv`` in ``cwd`` with ``env`` (default: the parent's),
        its output written to ``log``; return its pid."""
        request = {"start": [str(a) for a in argv], "cwd": str(cwd), "log": str(log),
                   "env": self.env if env is None else dict(env)}
        self.parent.stdin.write(json.dumps(request).encode() + b"\n")
        self.parent.stdin.flush()
        while True:
            reply = self._reply(time.monotonic() + START_S)
            if reply is None:
                raise TimeoutError(f"the forking parent did not start a child in {START_S} s")
            if "started" in reply:
                return reply["started"]

    def wait(self, pid, timeout):
        """The exit code of child ``pid``, or None if it is still running after
        ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while pid not in self.codes:
            if self._reply(deadline) is None:
                return None
        return self.codes.pop(pid)

    def run(self, argv, cwd, log, env=None, timeout=900):
        """Run ``python *argv`` to its end (killed after ``timeout`` seconds); return
        its exit code (None if it was killed for its time) and its output."""
        pid = self.start(argv, cwd, log, env)
        code = self.wait(pid, timeout)
        if code is None:
            self.kill(pid)
        return code, Path(log).read_text(errors="replace")

    def kill(self, pid):
        """Kill child ``pid`` and wait for its end."""
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.wait(pid, START_S)

    def _reply(self, deadline):
        """Read the parent's next reply (recording an ended child's code), or None at
        ``deadline``."""
        while b"\n" not in self.pending:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.parent.stdout], [], [], left)[0]:
                return None
            chunk = os.read(self.parent.stdout.fileno(), 65536)
            if not chunk:
                raise RuntimeError(f"the forking parent ended (exit code {self.parent.wait()})")
            self.pending += chunk
        line, _, self.pending = self.pending.partition(b"\n")
        reply = json.loads(line)
        if "ended" in reply:
            self.codes[reply["ended"]] = reply["code"]
        return reply

    def close(self):
        self.parent.stdin.close()
        self.parent.wait(timeout=START_S)


# --- the parent (this file run as a script) and its children --------------------------


def _serve():
    backend = None
    if not FRESH:
        import keras  # the imports every child starts with, paid once

        import kdp  # noqa: F401

        backend = keras.backend.backend()
    children, pending, reading = set(), b"", True
    while reading or children:
        if reading and select.select([sys.stdin], [], [], 0.05)[0]:
            chunk = os.read(sys.stdin.fileno(), 65536)
            reading = bool(chunk)
            pending += chunk
        elif not reading:
            time.sleep(0.05)
        while b"\n" in pending:
            line, _, pending = pending.partition(b"\n")
            request = json.loads(line)
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                _child(backend, **request)  # never returns
            children.add(pid)
            _say({"started": pid})
        for pid in list(children):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                children.discard(pid)
                _say({"ended": pid, "code": os.waitstatus_to_exitcode(status)})


def _say(reply):
    sys.stdout.write(json.dumps(reply) + "\n")
    sys.stdout.flush()


def _child(backend, start, cwd, log, env):
    """In a forked child: become ``python *start`` (`FRESH`: a new interpreter) and
    exit as it would."""
    output = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(output, 1)
    os.dup2(output, 2)
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    os.close(output)
    os.chdir(cwd)
    if FRESH:
        os.execve(sys.executable, [sys.executable, *start], env)
    code = 0
    try:
        if env.get("KERAS_BACKEND", backend) != backend:
            print(f"this process has imported Keras on {backend}, not {env['KERAS_BACKEND']}",
                  file=sys.stderr)
            code = 2
        else:
            os.environ.clear()
            os.environ.update(env)
            sys.argv = list(start)
            sys.path[0] = os.path.dirname(os.path.abspath(start[0]))
            runpy.run_path(start[0], run_name="__main__")
    except SystemExit as exit:
        code = exit.code if isinstance(exit.code, int) else int(exit.code is not None)
        if exit.code is not None and not isinstance(exit.code, int):
            print(exit.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
        code = 1
    for thread in threading.enumerate():
        if not thread.daemon and thread is not threading.main_thread():
            thread.join()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    _serve()
