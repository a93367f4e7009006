"""The training core of kdp, one concern a module.

* `config`: `DPParameters`, the immutable privacy configuration;
* `seeds`: the one source of randomness (OS entropy unless reproducible);
* `validation`: the one input validator, run before anything is spent;
* `objective`: the noisy objective (noise calibration, ``σ_eff``);
* `ledger`: `PrivacyLedger` (runs, merge) and `LedgerJournal`;
* `gate`: `PrivacyGate`, through which every noisy release is recorded and budgeted;
* `budget`: a model's per-step mechanism, planned releases, ε of more epochs,
  `make_private` (privacy in one call);
* `statement`: the privacy statement of a model;
* `callbacks`: the callbacks `fit` knows (`DP_Accountant`, `PrivacyJournal`);
* `sampling`: `fit`'s batches (Poisson, padded to static shapes; shuffled passes);
* `sources`: `RecordSource`, records read by index (data larger than memory);
* `saving`: the ledger inside every weights file;
* `processes`: several processes training one model (shards, one ledger).
"""

from kdp.training.config import DPParameters
from kdp.training.gate import BudgetExceededError, PrivacyGate, PrivacyGateError
from kdp.training.ledger import LedgerJournal, PrivacyLedger
from kdp.training.processes import DistributedTrainingError
from kdp.training.validation import DataValidationError

__all__ = ["BudgetExceededError", "DPParameters", "DataValidationError", "DistributedTrainingError",
           "LedgerJournal", "PrivacyGate", "PrivacyGateError", "PrivacyLedger"]
