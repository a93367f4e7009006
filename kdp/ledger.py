"""Compatibility name for `kdp.training.ledger` (the privacy ledger)."""

from kdp.training.ledger import LedgerJournal, PrivacyLedger, new_run_id  # noqa: F401

__all__ = ["LedgerJournal", "PrivacyLedger", "new_run_id"]
