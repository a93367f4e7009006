"""An opt-in store on disk of what accounting computes, shared between processes.

A PLD ε, an RDP curve and a calibrated σ are pure functions of their arguments,
and each costs 0.05–5 s (a σ found at a small target ε: tens of seconds). kdp
keeps them in memory for the life of a process; with
``KDP_ACCOUNTING_CACHE_DIR`` set to a folder, kdp also keeps them there, so a
script run again, a notebook restarted, or the other processes of a launch read
them back instead of computing them. Unset (the default), nothing is written.

An entry is found by a SHA-256 of what it was computed from: the function's
name, its arguments, and a fingerprint of the code that computes it (kdp's
`kdp.privacy` sources and the dp-accounting, NumPy and SciPy versions), so a change to
any of them computes afresh. The entry repeats that key, and one whose key
differs or that cannot be read is computed again and rewritten. The values are
stored as JSON, exactly (a float's shortest repr round-trips). The folder is
trusted as the code is: whoever can write to it can change the ε that kdp
reports, as whoever can edit kdp can.
"""

import functools
import hashlib
import importlib.metadata
import json
import os
import warnings
from enum import Enum
from pathlib import Path

#: the environment variable naming the folder
VARIABLE = "KDP_ACCOUNTING_CACHE_DIR"


def stored(function):
    """``function`` (of positional arguments, to a JSON-serialisable value), whose
    results are also kept under the folder of `VARIABLE` when it is set and its
    arguments are JSON-serialisable (`Enum` members by name); others are
    computed each time."""
    name = f"{function.__module__}.{function.__qualname__}"

    @functools.wraps(function)
    def wrapper(*args):
        folder = os.environ.get(VARIABLE)
        try:
            key = folder and json.dumps([fingerprint(), name, args], default=_plain, sort_keys=True)
        except TypeError:  # an argument JSON cannot hold exactly: computed, not stored
            key = None
        if not key:
            return function(*args)
        path = Path(folder) / f"{hashlib.sha256(key.encode()).hexdigest()}.json"
        found = _read(path, key)
        if found is not None:
            return found["value"]
        value = function(*args)
        _write(path, key, value)
        return value

    return wrapper


@functools.cache
def fingerprint():
    """What the stored values depend on besides their arguments: the source of
    every module of `kdp.privacy` and the dp-accounting, NumPy and SciPy (which
    dp-accounting computes with) versions."""
    digest = hashlib.sha256()
    for source in sorted(Path(__file__).parent.glob("*.py")):
        digest.update(source.name.encode() + b"\0" + source.read_bytes() + b"\0")
    for package in ("dp-accounting", "numpy", "scipy"):
        digest.update(f"{package}=={importlib.metadata.version(package)}\0".encode())
    return digest.hexdigest()


def _plain(value):
    if isinstance(value, Enum):
        return f"{type(value).__qualname__}.{value.name}"
    raise TypeError(f"cannot key a stored computation on {type(value).__name__}")


def _read(path, key):
    try:
        entry = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return entry if isinstance(entry, dict) and entry.get("key") == key and "value" in entry else None


def _write(path, key, value):
    """Write the entry whole or not at all (a temporary file renamed), so that a
    process reading it at the same time sees the old one, or none."""
    temporary = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary.write_text(json.dumps({"key": key, "value": value}), encoding="utf-8")
        os.replace(temporary, path)
    except OSError as error:
        warnings.warn(f"kdp could not store an accounting result in {path.parent} ({VARIABLE}): "
                      f"{error}", RuntimeWarning, stacklevel=3)
