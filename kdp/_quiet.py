"""Keep harmless library messages out of the user's console.

dp-accounting's RDP code warns through the ``absl`` logger when the series of a
fractional Rényi order does not converge; it then leaves that order out, and ε
stays a valid upper bound. `quiet_dp_accounting` drops these messages, and only
these, while kdp's accounting runs, and removes its filter afterwards.

TensorFlow's C++ code writes some start-up lines whatever ``TF_CPP_MIN_LOG_LEVEL``
says (the ``tensorflow`` wheel's "Could not find cuda drivers", once per library
that loads it, each after absl's "before InitializeLog" notice):
`quiet_cpp_logs` drops, from what the process writes to its standard error,
the lines of that format below the level that variable asks for.
"""

import contextlib
import logging
import os
import re
import sys
import threading

#: starts of dp-accounting messages that never signal an error
HARMLESS = ("_compute_log_a_frac failed to converge",)


class _DropHarmless(logging.Filter):
    def filter(self, record):
        return not str(record.msg).startswith(HARMLESS)


_FILTER = _DropHarmless()
_lock = threading.Lock()
_depth = 0


@contextlib.contextmanager
def quiet_dp_accounting():
    """Context manager (and decorator) that drops the `HARMLESS` messages of the
    ``absl`` logger; re-entrant, the filter goes when the outermost use ends."""
    global _depth
    logger = logging.getLogger("absl")
    with _lock:
        _depth += 1
        logger.addFilter(_FILTER)
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if not _depth:
                logger.removeFilter(_FILTER)


#: a line of the C++ logs of TensorFlow, XLA and absl: absl's format (severity, date,
#: time, thread, file:line]), or that of TensorFlow's own logging (date time: severity file:line])
CPP_LOG_LINE = re.compile(r"(?:(?P<absl>[IWEF])\d{4} \d\d:\d\d:\d+\.\d+ +\d+ [\w.-]+:\d+\]"
                          r"|\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+: (?P<tsl>[IWEF]) [\w/.-]+:\d+\]) ")
#: absl's notice before the first message it writes, when nothing configured its logging
ABSL_NOTICE = "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR"
_SEVERITIES = "IWEF"


def cpp_log_level():
    """The level ``TF_CPP_MIN_LOG_LEVEL`` asks for (0: everything, 1: no INFO, 2: no
    WARNING, 3: no ERROR); 0 if unset or not a number."""
    try:
        return int(os.environ.get("TF_CPP_MIN_LOG_LEVEL", "0"))
    except ValueError:
        return 0


def hidden_cpp_log_line(line, level=None):
    """Whether ``line`` is a C++ log line below ``level`` (default: `cpp_log_level`),
    or absl's notice when WARNING lines are hidden."""
    level = cpp_log_level() if level is None else level
    if line.startswith(ABSL_NOTICE):
        return level >= 1
    match = CPP_LOG_LINE.match(line)
    return bool(match) and _SEVERITIES.index(match.group("absl") or match.group("tsl")) < level


@contextlib.contextmanager
def quiet_cpp_logs():
    """Context manager: what the process writes to file descriptor 2 (Python's
    `sys.stderr` and C++ code) passes, line by line, through a thread that drops
    each `hidden_cpp_log_line`. Does nothing if there is nothing to hide (level 0)
    or descriptor 2 cannot be redirected."""
    level = cpp_log_level()
    if level < 1:
        yield
        return
    try:
        sys.stderr.flush()
        saved = os.dup(2)
        read, write = os.pipe()
        os.dup2(write, 2)
        os.close(write)
    except (OSError, ValueError):
        yield
        return

    def pump():
        with open(read, "rb", buffering=0, closefd=True) as pipe:
            for line in pipe:
                if not hidden_cpp_log_line(line.decode(errors="replace"), level):
                    os.write(saved, line)

    thread = threading.Thread(target=pump, name="kdp-quiet-cpp-logs", daemon=True)
    thread.start()
    try:
        yield
    finally:
        try:
            sys.stderr.flush()
        finally:
            os.dup2(saved, 2)  # closes the pipe's write end: the thread reads to its end
            thread.join(timeout=10)
            os.close(saved)
