"""The privacy ledger: every private release made with a model's data."""

import copy

from kdp.accounting import training_event


class PrivacyLedger:
    """An append-only list of private releases, each turned into a `DpEvent`.

    Entries are plain dicts (JSON-serialisable, saved with the model). A training
    entry is ``{"kind": "training", "noise_multiplier": σ_eff, "sampling_rate": q,
    "steps": n, "sampling": ..., "steps_per_epoch": ...}``; consecutive steps
    with the same mechanism are merged into one entry (a run-length ledger).
    Shuffled-batch steps (``sampling="shuffle"``) are merged only within one run
    of ``fit`` (``new_run=True`` starts a new entry): their accounting counts the
    passes over the data, and a new run starts a new pass.
    """

    def __init__(self, entries=None):
        self.entries = [dict(e) for e in entries or []]

    def record_training_steps(self, steps, noise_multiplier, sampling_rate, sampling,
                              steps_per_epoch, new_run=False):
        """Append ``steps`` noisy steps of one mechanism (merged with the last entry
        when it is the same mechanism and, for ``"shuffle"``, the same run)."""
        if steps <= 0:
            return
        key = dict(kind="training", noise_multiplier=float(noise_multiplier),
                   sampling_rate=float(sampling_rate), sampling=sampling,
                   steps_per_epoch=int(steps_per_epoch))
        last = self.entries[-1] if self.entries else None
        same = last is not None and all(last.get(k) == v for k, v in key.items())
        if same and (sampling == "poisson" or not new_run):
            last["steps"] += int(steps)
        else:
            self.entries.append({**key, "steps": int(steps)})

    def training_steps(self):
        return sum(e["steps"] for e in self.entries if e["kind"] == "training")

    def events(self):
        """The ledger as a list of `dp_accounting.DpEvent`."""
        return [
            training_event(e["noise_multiplier"], e["sampling_rate"], e["steps"],
                           e["sampling"], e["steps_per_epoch"])
            for e in self.entries if e["kind"] == "training"
        ]

    def get_config(self):
        return {"entries": copy.deepcopy(self.entries)}

    @classmethod
    def from_config(cls, config):
        return cls(config.get("entries"))
