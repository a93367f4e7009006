"""The privacy state inside every weights file a DP model writes.

Keras saves a model's variables through ``save_own_variables(store)``; kdp adds
three keys: the privacy ledger, the accountant of the persistent budget
(`PrivacyGate.accountant`) and the release plans that belong to the model
(`PrivacyGate.plans` whose class sets ``saved_with_model = True``, e.g. a
calibration reserved by `kdp.calibration.reserve`), so every weights file
(``.keras``, ``.weights.h5``, `ModelCheckpoint`, `BackupAndRestore`) carries the
ledger that covers its weights, the accountant its budget was set with and the
releases its noise was calibrated to leave room for. Loading merges the file's
ledger into the model's (`PrivacyLedger.merge`: a model that loads an older
checkpoint keeps the steps it ran since), restores the accountant (a file
written before kdp saved it leaves the model's, RDP for a new one) and
registers the file's plans that the model does not have yet.
"""

import importlib
import json

import numpy as np

from kdp.training.ledger import PrivacyLedger

LEDGER_KEY = "kdp_privacy_ledger"
ACCOUNTANT_KEY = "kdp_budget_accountant"
PLANS_KEY = "kdp_release_plans"


def save_privacy(store, gate):
    """Write ``gate``'s ledger, accountant and saved plans into a Keras weights ``store``."""
    store[LEDGER_KEY] = _encode(gate.ledger.to_json())
    store[ACCOUNTANT_KEY] = _encode(gate.accountant)
    store[PLANS_KEY] = _encode(json.dumps([_plan_config(plan) for plan in gate.plans.values()
                                           if getattr(plan, "saved_with_model", False)]))


def load_privacy(store, gate):
    """Merge the ledger of a Keras weights ``store`` into ``gate``'s, restore its
    accountant and register its plans (each if the file has it); return the
    store without kdp's keys."""
    keys = store.keys()
    if LEDGER_KEY in keys:
        gate.merge(PrivacyLedger.from_json(_decode(store[LEDGER_KEY])))
    if ACCOUNTANT_KEY in keys:
        gate.accountant = _decode(store[ACCOUNTANT_KEY])
    if PLANS_KEY in keys:
        present = [_plan_config(plan) for plan in gate.plans.values()]
        for config in json.loads(_decode(store[PLANS_KEY])):
            if config not in present:
                plan = _plan_from_config(config)
                gate.plans[id(plan)] = plan
    return _WithoutKeys(store, (LEDGER_KEY, ACCOUNTANT_KEY, PLANS_KEY))


def _plan_config(plan):
    kind = type(plan)
    return {"module": kind.__module__, "class": kind.__qualname__, "config": plan.get_config()}


def _plan_from_config(config):
    """The plan a `_plan_config` describes (a class of a kdp module only)."""
    module = config["module"]
    if module != "kdp" and not module.startswith("kdp."):
        raise ValueError(f"a saved release plan of {module!r}: kdp restores its own plans only")
    return getattr(importlib.import_module(module), config["class"]).from_config(config["config"])


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
