"""The privacy ledger inside every weights file a DP model writes.

Keras saves a model's variables through ``save_own_variables(store)``; kdp adds
the ledger under one extra key, so every weights file (``.keras``,
``.weights.h5``, `ModelCheckpoint`, `BackupAndRestore`) carries the ledger
that covers its weights. Loading merges the file's ledger into the model's
(`PrivacyLedger.merge`: a model that loads an older checkpoint keeps the steps
it ran since).
"""

import numpy as np

from kdp.training.ledger import PrivacyLedger

LEDGER_KEY = "kdp_privacy_ledger"


def save_ledger(store, ledger):
    """Write ``ledger`` into a Keras weights ``store``."""
    store[LEDGER_KEY] = np.frombuffer(ledger.to_json().encode("utf-8"), dtype="uint8")


def load_ledger(store):
    """``(ledger or None, store without the ledger key)`` from a Keras weights store."""
    if LEDGER_KEY not in store.keys():
        return None, store
    text = bytes(np.asarray(store[LEDGER_KEY], dtype="uint8")).decode("utf-8")
    return PrivacyLedger.from_json(text), _WithoutKey(store, LEDGER_KEY)


class _WithoutKey:
    """A read-only view of a Keras weights store without one key."""

    def __init__(self, store, key):
        self._store, self._key = store, key

    def keys(self):
        return [k for k in self._store.keys() if k != self._key]

    def __len__(self):
        return len(self.keys())

    def __contains__(self, key):
        return key != self._key and key in self._store

    def __getitem__(self, key):
        if key == self._key:
            raise KeyError(key)
        return self._store[key]
