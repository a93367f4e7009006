"""The privacy state inside every weights file a DP model writes.

Keras saves a model's variables through ``save_own_variables(store)``; kdp adds
two keys: the privacy ledger and the accountant of the persistent budget
(`PrivacyGate.accountant`), so every weights file (``.keras``, ``.weights.h5``,
`ModelCheckpoint`, `BackupAndRestore`) carries the ledger that covers its
weights and the accountant its budget was set with. Loading merges the file's
ledger into the model's (`PrivacyLedger.merge`: a model that loads an older
checkpoint keeps the steps it ran since) and restores the accountant (a file
written before kdp saved it leaves the model's, RDP for a new one).
"""

import numpy as np

from kdp.training.ledger import PrivacyLedger

LEDGER_KEY = "kdp_privacy_ledger"
ACCOUNTANT_KEY = "kdp_budget_accountant"


def save_privacy(store, gate):
    """Write ``gate``'s ledger and accountant into a Keras weights ``store``."""
    store[LEDGER_KEY] = _encode(gate.ledger.to_json())
    store[ACCOUNTANT_KEY] = _encode(gate.accountant)


def load_privacy(store, gate):
    """Merge the ledger of a Keras weights ``store`` into ``gate``'s and restore
    its accountant (each if the file has it); return the store without kdp's keys."""
    keys = store.keys()
    if LEDGER_KEY in keys:
        gate.merge(PrivacyLedger.from_json(_decode(store[LEDGER_KEY])))
    if ACCOUNTANT_KEY in keys:
        gate.accountant = _decode(store[ACCOUNTANT_KEY])
    return _WithoutKeys(store, (LEDGER_KEY, ACCOUNTANT_KEY))


def _encode(text):
    return np.frombuffer(text.encode("utf-8"), dtype="uint8")


def _decode(value):
    return bytes(np.asarray(value, dtype="uint8")).decode("utf-8")


class _WithoutKeys:
    """A read-only view of a Keras weights store without kdp's keys."""

    def __init__(self, store, hidden):
        self._store, self._hidden = store, hidden

    def keys(self):
        return [k for k in self._store.keys() if k not in self._hidden]

    def __len__(self):
        return len(self.keys())

    def __contains__(self, key):
        return key not in self._hidden and key in self._store

    def __getitem__(self, key):
        if key in self._hidden:
            raise KeyError(key)
        return self._store[key]
