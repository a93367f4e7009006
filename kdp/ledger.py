"""The privacy ledger: every private release made with a model's data.

The ledger is kdp's record of privacy already spent. It is treated like
committed data in a database:

* it travels with the model: in the ``.keras`` config **and** in every weights
  file (``.weights.h5``, hence `keras.callbacks.ModelCheckpoint` and
  `keras.callbacks.BackupAndRestore`), written in the same file as the weights it
  covers, so a checkpoint never holds weights newer than its ledger;
* during `fit` it is **written ahead** to a durable journal (`LedgerJournal`, a
  JSON file replaced atomically and fsync'ed) *before* each step runs, so a
  process killed at any instant has already recorded every step whose noisy
  update could have been observed;
* two ledgers are combined with `PrivacyLedger.merge`, which never loses a
  release: when one is a continuation of the other it keeps the longer one,
  otherwise (two different trainings on the same data) it adds them up.
"""

import copy
import json
import os
import tempfile

from kdp.accounting import quantile_event, training_event

LEDGER_FORMAT = 1


class PrivacyLedger:
    """An append-only list of private releases, each turned into a `DpEvent`.

    Entries are plain dicts (JSON-serialisable, saved with the model). A training
    entry is ``{"kind": "training", "noise_multiplier": σ_eff, "sampling_rate": q,
    "steps": n, "sampling": ..., "steps_per_epoch": ...}``; consecutive steps
    with the same mechanism are merged into one entry (a run-length ledger).
    Shuffled-batch steps (``sampling="shuffle"``) are merged only within one run
    of ``fit`` (``new_run=True`` starts a new entry): their accounting counts the
    passes over the data, and a new run starts a new pass. A quantile entry
    ``{"kind": "quantile", "noise_multiplier": σ_q, "sampling_rate": q, "count": n}``
    records ``n`` private quantile releases of adaptive clipping
    (`record_quantile_releases`).
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

    def retract_training_steps(self, steps):
        """Take back ``steps`` steps recorded ahead (by `fit`, before a multi-step
        execution) that provably never ran. Only the last entry can shrink."""
        if steps <= 0:
            return
        last = self.entries[-1] if self.entries else None
        if last is None or last["kind"] != "training" or last["steps"] < steps:
            raise ValueError(f"cannot retract {steps} steps from the ledger {self.entries}")
        last["steps"] -= int(steps)
        if last["steps"] == 0:
            self.entries.pop()

    def training_steps(self):
        return sum(e["steps"] for e in self.entries if e["kind"] == "training")

    def record_quantile_releases(self, count, noise_multiplier, sampling_rate):
        """Append ``count`` private quantile releases (adaptive clipping): entry
        ``{"kind": "quantile", "noise_multiplier": σ_q, "sampling_rate": q,
        "count": n}``, i.e. ``n`` × ``PoissonSampledDpEvent(q, GaussianDpEvent(σ_q))``.
        Always a new entry, so earlier entries never change."""
        if count <= 0:
            return
        self.entries.append(dict(kind="quantile", noise_multiplier=float(noise_multiplier),
                                 sampling_rate=float(sampling_rate), count=int(count)))

    def releases(self, kind):
        """The number of releases of ``kind`` (``"quantile"``) in the ledger."""
        return sum(e["count"] for e in self.entries if e["kind"] == kind)

    def events(self):
        """The ledger as a list of `dp_accounting.DpEvent` (every entry; an entry of
        an unknown kind is an error, never silently free)."""
        return [_entry_event(e) for e in self.entries]

    # -- combining ledgers -----------------------------------------------------------
    def extends(self, other):
        """True if this ledger is ``other`` followed by more releases: every entry of
        ``other`` is here, in order, the last one possibly with more steps."""
        mine, theirs = self.entries, other.entries
        if len(theirs) > len(mine):
            return False
        if not theirs:
            return True
        if mine[:len(theirs) - 1] != theirs[:-1]:
            return False
        a, b = mine[len(theirs) - 1], theirs[-1]
        if a == b:
            return True
        rest = lambda e: {k: v for k, v in e.items() if k != "steps"}  # noqa: E731
        return "steps" in a and "steps" in b and rest(a) == rest(b) and a["steps"] >= b["steps"]

    def merge(self, other):
        """The ledger covering both: the longer one if one continues the other (the
        same history seen at two times), else the common prefix followed by both
        tails (two different trainings on the same data add up). Never less than
        either; returns a new ledger."""
        if self.extends(other):
            return PrivacyLedger(self.entries)
        if other.extends(self):
            return PrivacyLedger(other.entries)
        k = 0
        while k < min(len(self.entries), len(other.entries)) and self.entries[k] == other.entries[k]:
            k += 1
        return PrivacyLedger(self.entries + other.entries[k:])

    # -- serialisation -----------------------------------------------------------------
    def get_config(self):
        return {"entries": copy.deepcopy(self.entries)}

    @classmethod
    def from_config(cls, config):
        return cls(config.get("entries"))

    def to_json(self):
        return json.dumps({"format": LEDGER_FORMAT, **self.get_config()}, sort_keys=True)

    @classmethod
    def from_json(cls, text):
        config = json.loads(text)
        if config.get("format", LEDGER_FORMAT) > LEDGER_FORMAT:
            raise ValueError(f"privacy ledger format {config['format']} is newer than this kdp")
        return cls.from_config(config)

    def __eq__(self, other):
        return isinstance(other, PrivacyLedger) and self.entries == other.entries

    def __repr__(self):
        return f"PrivacyLedger({self.entries!r})"


def _entry_event(e):
    if e["kind"] == "training":
        return training_event(e["noise_multiplier"], e["sampling_rate"], e["steps"],
                              e["sampling"], e["steps_per_epoch"])
    if e["kind"] == "quantile":
        return quantile_event(e["noise_multiplier"], e["sampling_rate"], e["count"])
    raise ValueError(f"privacy ledger entry of unknown kind {e['kind']!r}: {e}")


class LedgerJournal:
    """A durable copy of a ledger in a JSON file: the write-ahead log of `fit`.

    `write` replaces the file atomically (temporary file, ``fsync``, ``os.replace``,
    ``fsync`` of the folder), so a reader sees either the old or the new ledger,
    never a torn one, even after a power loss. `fit` writes the ledger here
    *before* every step (or every ``steps_per_execution`` block) and merges the
    journal into the model's ledger when training starts, so the steps of a run
    killed in the middle of an epoch are counted.

    Args:
        path: the JSON file (its folder is created when needed).
    """

    def __init__(self, path):
        self.path = os.fspath(path)

    def exists(self):
        return os.path.exists(self.path)

    def read(self):
        """The journal's ledger (an empty ledger if there is no journal yet)."""
        if not self.exists():
            return PrivacyLedger()
        with open(self.path, encoding="utf-8") as f:
            return PrivacyLedger.from_json(f.read())

    def write(self, ledger):
        folder = os.path.dirname(os.path.abspath(self.path))
        os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".ledger-", suffix=".tmp", dir=folder)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(ledger.to_json())
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            if os.path.exists(tmp):
                os.remove(tmp)
            raise
        try:  # make the rename itself durable
            dir_fd = os.open(folder, os.O_RDONLY)
        except OSError:
            return
        try:
            os.fsync(dir_fd)
        except OSError:
            pass
        finally:
            os.close(dir_fd)

    def __repr__(self):
        return f"LedgerJournal({self.path!r})"
