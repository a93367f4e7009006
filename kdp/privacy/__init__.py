"""Pure privacy maths on `dp_accounting` events: never a model, never Keras.

* `events`: the `DpEvent`s of kdp's releases (DP-SGD steps, private quantiles)
  and ``σ_eff`` of per-layer noise;
* `serialization`: events to and from JSON-serialisable dicts;
* `accountants`: ε of a composition of events (RDP or PLD) under a neighbouring
  relation (add/remove-one by default, or replace-one), and the events PLD
  cannot account;
* `calibration`: the smallest σ for a target ε;
* `limits`: how many more releases fit a budget;
* `stored`: ε, RDP curves and calibrated σ kept on disk, shared between processes,
  where ``KDP_ACCOUNTING_CACHE_DIR`` names a folder.

A model's side (its mechanism, planned releases, epochs) is `kdp.training.budget`;
`kdp.accounting` is the public face of both.
"""

from kdp.privacy.accountants import (ACCOUNTANT_NAMES, ACCOUNTANTS, ADD_OR_REMOVE_ONE,
                                     PLD_DISCRETIZATION, PLD_FINEST, PLD_MIN_NOISE,
                                     PLD_RESOLUTION, RDP_ORDERS, REPLACE_ONE, REPLACE_ONE_ORDERS, accountant_name,
                                     check_accountant, compute_epsilon, epsilon_of_events,
                                     make_accountant, pld_interval, pld_unsupported, rdp_curve,
                                     rdp_orders, unsupported)
from kdp.privacy.calibration import CalibratedNoiseMultiplier, calibrate_noise_multiplier
from kdp.privacy.events import (ASSUMPTIONS, SAMPLINGS, effective_noise_multiplier,
                                quantile_event, training_event)
from kdp.privacy.limits import count_fits, largest_count, max_count, max_steps
from kdp.privacy.serialization import event_from_config, event_to_config

__all__ = [
    "ACCOUNTANT_NAMES", "ACCOUNTANTS", "ADD_OR_REMOVE_ONE", "ASSUMPTIONS",
    "CalibratedNoiseMultiplier", "PLD_DISCRETIZATION", "PLD_FINEST", "PLD_MIN_NOISE",
    "PLD_RESOLUTION",
    "RDP_ORDERS", "REPLACE_ONE", "REPLACE_ONE_ORDERS", "SAMPLINGS",
    "accountant_name", "calibrate_noise_multiplier", "check_accountant", "compute_epsilon", "count_fits",
    "effective_noise_multiplier", "epsilon_of_events", "event_from_config", "event_to_config",
    "largest_count", "make_accountant", "max_count", "max_steps", "pld_interval", "pld_unsupported",
    "quantile_event", "rdp_curve", "rdp_orders", "training_event", "unsupported",
]
