"""Reading records in worker processes (`kdp.RecordSource(processes=True)`).

A decoder written in Python (Pillow's, for small images) holds the GIL, so
reader threads do not run it in parallel; worker processes do. This module is
what a worker imports: the standard library and NumPy only (no Keras, no
framework), so a worker starts in well under a second.
"""

import multiprocessing

_STATE = {}


def pool(readers, records, transform):
    """A pool of ``readers`` processes (started by ``spawn``: forking a process
    that runs JAX or TensorFlow threads can deadlock), each holding ``records``
    and ``transform`` (both must pickle: e.g. a list of paths and a function
    defined at a module's top level)."""
    import concurrent.futures

    return concurrent.futures.ProcessPoolExecutor(
        readers, mp_context=multiprocessing.get_context("spawn"), initializer=_hold,
        initargs=(records, transform))


def _hold(records, transform):
    _STATE["records"], _STATE["transform"] = records, transform


def load(ids):
    """``[(item, None) or (None, error text)]`` for the records at ``ids``: the
    record read and transformed, or why it could not be (an exception may not
    pickle, its text does)."""
    records, transform = _STATE["records"], _STATE["transform"]
    out = []
    for i in ids:
        try:
            item = records[i]
            out.append((item if transform is None else transform(item), None))
        except Exception as e:  # noqa: BLE001 (reported with the record's index by the caller)
            out.append((None, f"{type(e).__name__}: {e}"))
    return out
