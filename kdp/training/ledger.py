"""The privacy ledger: every private release made with a dataset.

One ledger type serves every mechanism in kdp (Clipless and clipping DP-SGD,
adaptive clipping, the trainers of `kdp.contrastive`, `kdp.dpcl`, `kdp.adamix`, `kdp.helmet`). It is treated like committed
data in a database:

* every entry belongs to a **run** (one `fit`, one trainer run, one release),
  named by 64 random bits, and has a sequence number inside its run. Two
  ledgers are combined with `PrivacyLedger.merge`, which takes the union of
  their entries: an entry seen in both (the same run, the same position) is the
  same history seen twice and counts once, with the larger count (a checkpoint
  and the journal written after it); entries of different runs (independent
  trainings on the same data, such as the trials of a hyper-parameter search)
  are composed. Merging never loses a release;
* it travels with the model: in the ``.keras`` config **and** in every weights
  file, written in the same file as the weights it covers;
* during training it is **written ahead** to a durable journal (`LedgerJournal`)
  *before* each step runs (`kdp.training.gate`).

An entry is a plain dict (JSON): ``{"run", "seq", "kind", ..., "count"}``, the
kinds being ``"training"`` (noisy gradient steps, `kdp.privacy.training_event`),
``"quantile"`` (private quantiles, `kdp.privacy.quantile_event`) and ``"event"``
(any `dp_accounting.DpEvent`, stored in dp-accounting's own named-tuple form).
"""

import copy
import hashlib
import json
import os
import tempfile

from kdp.privacy import event_from_config, event_to_config, quantile_event, training_event
from kdp.training.seeds import os_seed

LEDGER_FORMAT = 2
KINDS = ("training", "quantile", "event")


def new_run_id():
    """A fresh run name: 64 bits of OS entropy in hex."""
    return f"{os_seed():016x}"


def training_mechanism(noise_multiplier, sampling_rate, sampling="poisson", steps_per_epoch=None):
    """The ledger key of one noisy gradient step (see `kdp.privacy.training_event`)."""
    return {"kind": "training", "noise_multiplier": float(noise_multiplier),
            "sampling_rate": float(sampling_rate), "sampling": sampling,
            "steps_per_epoch": None if steps_per_epoch is None else int(steps_per_epoch)}


def quantile_mechanism(noise_multiplier, sampling_rate):
    """The ledger key of one private quantile release (`kdp.privacy.quantile_event`)."""
    return {"kind": "quantile", "noise_multiplier": float(noise_multiplier),
            "sampling_rate": float(sampling_rate)}


def event_mechanism(event):
    """The ledger key of one release described by any `dp_accounting.DpEvent`."""
    return {"kind": "event", "event": event_to_config(event)}


class PrivacyLedger:
    """An append-only, run-length list of private releases.

    Use `record` (through `kdp.training.PrivacyGate`, which also enforces the
    budget), `events` for the accountant and `merge` to combine ledgers.
    """

    def __init__(self, entries=None):
        self.entries = [dict(e) for e in entries or []]
        self.version = 0  # bumped by every record/retract (lets the gate cache budgets)
        for e in self.entries:
            if e.get("kind") not in KINDS or "run" not in e or "seq" not in e:
                raise ValueError(f"malformed privacy ledger entry: {e}")

    # -- recording -------------------------------------------------------------------
    def record(self, mechanism, count, run):
        """Append ``count`` releases of ``mechanism`` (a dict from `training_mechanism`,
        `quantile_mechanism` or `event_mechanism`) made by ``run``: merged into
        the last entry when that entry is the same run and mechanism."""
        count = int(count)
        if count < 0:
            raise ValueError(f"count must be >= 0, got {count}")
        if count == 0:
            return
        self.version += 1
        last = self.entries[-1] if self.entries else None
        if last is not None and last["run"] == run and entry_mechanism(last) == mechanism:
            last["count"] += count
            return
        seq = sum(1 for e in self.entries if e["run"] == run)
        self.entries.append({**copy.deepcopy(mechanism), "run": run, "seq": seq, "count": count})

    def retract(self, count, run):
        """Take back ``count`` releases recorded ahead by ``run`` that provably
        never ran (only the run's last entry, when it is the ledger's last)."""
        if count <= 0:
            return
        last = self.entries[-1] if self.entries else None
        if last is None or last["run"] != run or last["count"] < count:
            raise ValueError(f"cannot retract {count} releases of run {run} from {self.entries}")
        self.version += 1
        last["count"] -= int(count)
        if last["count"] == 0:
            self.entries.pop()

    # Names kept from the first ledger (used by adaptive clipping and users).
    def record_training_steps(self, steps, noise_multiplier, sampling_rate, sampling="poisson",
                              steps_per_epoch=None, run=None):
        """``record(training_mechanism(...), steps, run)`` (a new run when ``run`` is None)."""
        self.record(training_mechanism(noise_multiplier, sampling_rate, sampling, steps_per_epoch),
                    steps, run or new_run_id())

    def record_quantile_releases(self, count, noise_multiplier, sampling_rate, run=None):
        """``record(quantile_mechanism(...), count, run)`` (a new run when ``run`` is None)."""
        self.record(quantile_mechanism(noise_multiplier, sampling_rate), count, run or new_run_id())

    # -- reading ---------------------------------------------------------------------
    def training_steps(self, run=None):
        """The number of noisy gradient steps in the ledger (of ``run`` only, if given)."""
        return self.releases("training", run)

    def releases(self, kind, run=None):
        """The number of releases of ``kind`` (``"training"``, ``"quantile"``, ``"event"``),
        of ``run`` only if given."""
        return sum(e["count"] for e in self.entries
                   if e["kind"] == kind and run in (None, e["run"]))

    def runs(self):
        """The run names, in order of first appearance."""
        return list(dict.fromkeys(e["run"] for e in self.entries))

    def events(self):
        """The ledger as a list of `dp_accounting.DpEvent` (one per entry)."""
        return [_entry_event(e) for e in self.entries]

    # -- combining ledgers -----------------------------------------------------------
    def merge(self, other):
        """The union of both ledgers (a new ledger): entries are identified by
        ``(run, seq)``; one present in both counts once with the larger count,
        the others are all kept (composed). Raises if one ``(run, seq)`` names
        two different mechanisms (corrupted ledgers)."""
        merged = [dict(e) for e in self.entries]
        index = {(e["run"], e["seq"]): i for i, e in enumerate(merged)}
        for e in other.entries:
            key = (e["run"], e["seq"])
            if key not in index:
                index[key] = len(merged)
                merged.append(dict(e))
                continue
            mine = merged[index[key]]
            if entry_mechanism(mine) != entry_mechanism(e):
                raise ValueError(f"privacy ledgers disagree on run {key}: {mine} vs {e}")
            mine["count"] = max(mine["count"], e["count"])
        return PrivacyLedger(merged)

    # -- serialisation ---------------------------------------------------------------
    def get_config(self):
        return {"entries": copy.deepcopy(self.entries)}

    @classmethod
    def from_config(cls, config):
        entries = config.get("entries") or []
        if entries and "run" not in entries[0]:
            entries = _upgrade_format_1(entries)
        return cls(entries)

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


def entry_mechanism(entry):
    """The mechanism (ledger key) of a ledger entry."""
    return {k: v for k, v in entry.items() if k not in ("run", "seq", "count")}


def _upgrade_format_1(entries):
    """Format-1 entries had no run: the whole list becomes one run named by its
    content, so the same old ledger seen twice counts once and two different
    ones add up (conservative)."""
    name = "v1-" + hashlib.sha256(json.dumps(entries, sort_keys=True).encode()).hexdigest()[:16]
    upgraded = []
    for seq, e in enumerate(entries):
        e = dict(e)
        e["count"] = e.pop("steps", e.get("count"))
        upgraded.append({**e, "run": name, "seq": seq})
    return upgraded


def mechanism_event(mechanism, count):
    """The `dp_accounting.DpEvent` of ``count`` releases of ``mechanism``."""
    return _entry_event({**mechanism, "count": int(count)})


def _entry_event(e):
    if e["kind"] == "training":
        return training_event(e["noise_multiplier"], e["sampling_rate"], e["count"],
                              e["sampling"], e["steps_per_epoch"])
    if e["kind"] == "quantile":
        return quantile_event(e["noise_multiplier"], e["sampling_rate"], e["count"])
    if e["kind"] == "event":
        import dp_accounting

        if e["count"] == 0:
            return dp_accounting.NoOpDpEvent()
        return dp_accounting.SelfComposedDpEvent(event_from_config(e["event"]), e["count"])
    raise ValueError(f"privacy ledger entry of unknown kind {e['kind']!r}: {e}")


class LedgerJournal:
    """A durable copy of a ledger in a JSON file: the write-ahead log of training.

    `write` replaces the file atomically (temporary file, ``fsync``, ``os.replace``,
    ``fsync`` of the folder), so a reader sees either the old or the new ledger,
    never a torn one. The gate writes the ledger here *before* every step and
    merges the journal into the model's ledger when training starts.

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
