"""kdp's accounting for users, lip-dp compatible (``from kdp import accounting``):
the pure privacy maths of `kdp.privacy` (events, ε, calibration, budgets) and a
model's side from `kdp.training.budget` (``get_eps_delta``, ``get_max_epochs``,
``calibrate_model_noise``, release plans), in one namespace.

kdp's own modules import `kdp.privacy` and `kdp.training.budget` directly.
"""

from kdp.compat import DPGD_Mechanism  # noqa: F401 (lip-dp's name, refused with a pointer)
from kdp.privacy import (  # noqa: F401
    ACCOUNTANTS, ADD_OR_REMOVE_ONE, ASSUMPTIONS, RDP_ORDERS, REPLACE_ONE, REPLACE_ONE_ORDERS,
    SAMPLINGS, CalibratedNoiseMultiplier, calibrate_noise_multiplier, compute_epsilon, count_fits,
    effective_noise_multiplier, epsilon_of_events, event_from_config, event_to_config,
    largest_count, make_accountant, max_count, max_steps, quantile_event, rdp_curve, rdp_orders,
    training_event)
from kdp.training.budget import (  # noqa: F401
    calibrate_model_noise, fit_event, get_eps_delta, get_max_epochs, planned_events,
    register_release_plan, unregister_release_plan)
