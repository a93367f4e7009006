"""Keras callbacks for privacy accounting, budget enforcement and adaptive clipping."""

from kdp.adaptive_clipping import AdaptiveQuantileClipping
from kdp.compat import LaplaceAdaptiveLossGradientClipping  # noqa: F401 (lip-dp's name, refused)
from kdp.training.callbacks import DP_Accountant, PrivacyJournal

__all__ = ["DP_Accountant", "PrivacyJournal", "AdaptiveQuantileClipping"]
