"""Silence dp-accounting's harmless `absl` warnings while kdp calls it.

dp-accounting's RDP code warns through the ``absl`` logger when the series of a
fractional Rényi order does not converge; it then leaves that order out, and ε
stays a valid upper bound. `quiet_dp_accounting` drops these messages, and only
these, while kdp's accounting runs, and removes its filter afterwards.
"""

import contextlib
import logging
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
