"""Several processes training one model: shards, one noise, one ledger.

Poisson sampling splits over processes: if process ``p`` holds a disjoint shard
of ``n_p`` records (``Σ n_p = N``) and includes each of them independently with
the **global** rate ``q = b/N``, the union of the processes' batches is exactly
a Poisson sample of the whole dataset (Abadi et al. 2016's sampling, unchanged).
The engine (JAX's SPMD program over a global batch, or TensorFlow's all-reduce
of the replicas' gradients) then computes ``Σ_all w_i ∇ℓ_i / b`` plus **one**
calibrated noise draw (`kdp.distribute`), and every process applies the same
update. The accounting is that of one process training on ``N`` records.

What `fit` does when `kdp.distribute.process_layout` counts several processes
(`ProcessGroup`):

* `ProcessGroup.join`: two exchanges before anything is spent. Every process
  reports its shard size, its local refusals (an invalid batch), its
  configuration and its ledger, then a keyed digest of each of its records;
  all of them then raise the same error, or none: the configurations must be
  identical (the error names each differing setting, the process and both
  values), no record may be held by two processes, the shards must sum to
  ``dataset_metadata.nb_samples_train``, and the ledgers are merged into one
  (`PrivacyLedger.merge`, nothing lost), so every process decides budgets the
  same way. The run name is process 0's (and so is the noise seed on JAX,
  whose replicated state must be identical: `seeds.shared_os_seed`; under
  TensorFlow only replica 0's draw is kept, `kdp.distribute.noise_share`).
* each step (JAX, `ProcessGroup.agree_rows`): the processes agree on the padded
  size of their local batches (one shared shape) and check that their ledgers
  and budgets are still identical; `ProcessGroup.verify` checks the same at the
  first step and at every epoch's end on both engines.
* process 0 writes the journal, before every step as on one process. A global
  step needs a collective with every process, process 0 included, which wrote
  the step ahead before entering it: the journal holds every step that may
  have run, whichever process dies. A failed step is never taken back, and the
  survivors raise `DistributedTrainingError`.
"""

import hashlib
import json
import secrets

import keras
import numpy as np

from kdp import distribute
from kdp.training.ledger import PrivacyLedger, new_run_id
from kdp.training.plan import noise_coefficients

#: exchanged records are padded to a multiple of this many bytes (fewer shapes to trace)
_BLOCK = 4096
#: the bytes of a record's digest (`record_digests`)
_DIGEST = 8
#: the most differing settings a configuration mismatch lists
_MOST_DIFFERENCES = 6
#: the most characters of an engine's error kept in `ProcessGroup.failure`
_CAUSE = 1200


class DistributedTrainingError(RuntimeError):
    """A multi-process run failed or its processes disagree; see the message."""


class ProcessGroup:
    """The processes that train one model together during one `fit`.

    Args:
        model: the DP model (its engine answers `kdp.distribute.allgather`).
        count, index: the number of processes and this one's rank.
    """

    def __init__(self, model, count, index):
        self.model, self.count, self.index = model, int(count), int(index)
        self.rows = None
        self.run = None

    @classmethod
    def of(cls, model):
        """A `ProcessGroup` when several processes train ``model``, else ``None``."""
        count, index = distribute.process_layout(model)
        return cls(model, count, index) if count > 1 else None

    # -- collectives ---------------------------------------------------------------------
    def allgather(self, array):
        """Every process's ``array``, stacked (a collective)."""
        return distribute.allgather(self.model, array)

    def exchange(self, record):
        """Every process's JSON-serialisable ``record``, in rank order (a collective)."""
        data = json.dumps(record, sort_keys=True).encode()
        lengths = self.allgather(np.array([len(data)], dtype="int64"))[:, 0]
        size = -(-int(lengths.max()) // _BLOCK) * _BLOCK
        buffer = np.zeros(size, dtype="int32")  # TensorFlow gathers no 8-bit integers
        buffer[:len(data)] = np.frombuffer(data, dtype="uint8")
        gathered = self.allgather(buffer)
        return [json.loads(row[:n].astype("uint8").tobytes().decode()) for row, n in zip(gathered, lengths)]

    # -- the handshake -------------------------------------------------------------------
    def join(self, rows, error=None, shard=None, source=None):
        """Agree before anything is spent (see the module's docstring).

        Args:
            rows: the number of records this process holds.
            error: this process's refusal of its own data (a message), if any.
            shard: ``(x, y, weights)``, this process's validated records (then
                ``rows`` is their number), for the overlap check
                (`record_digests`); ``None`` skips it on this process (it then
                reports no records to compare).

        Overlap: each process digests each of its records (inputs and label)
        with a keyed hash whose key process 0 draws for this handshake only; the
        processes exchange the digests, never the records. Identical
        records held by two processes count as shared, even when they are two
        distinct individuals' identical rows: deduplicate them, or give all the
        copies to one process (identical rows within one shard are allowed).
        What the digests tell the other processes: which of their own records
        this process also holds.

        Raises:
            ValueError: on every process, if any process refused its data, the
                configurations differ, two processes share records, or the
                shards do not sum to ``N``.
        """
        model = self.model
        gate = model.privacy_gate
        record = {
            "error": error, "rows": int(rows if shard is None else len(shard[1])),
            "config": self._configuration(),
            "ledger": gate.ledger.get_config(),
            "run": new_run_id(),
            "key": secrets.token_hex(16) if self.index == 0 else None,
            "digests": shard is not None,
            "source": None if source is None else {
                "name": str(source.name), "total": int(source.total),
                "start": int(source.start), "stop": int(source.stop)},
        }
        records = self.exchange(record)
        errors = [(p, r["error"]) for p, r in enumerate(records) if r["error"]]
        if errors:
            raise ValueError(f"{model.name}: process {errors[0][0]} of {self.count} refused its "
                             f"data: {errors[0][1]} Nothing was spent on any process.")
        differences = [(p, path, mine, first) for p, r in enumerate(records[1:], 1)
                       for path, mine, first in _differences(r["config"], records[0]["config"])]
        if differences:
            listed = "; ".join(
                "process {} has {}={}, process 0 has {}".format(p, path, *_shown(mine, first))
                for p, path, mine, first in differences[:_MOST_DIFFERENCES])
            more = len(differences) - _MOST_DIFFERENCES
            raise ValueError(
                f"{model.name}: the processes' configurations differ: {listed}"
                f"{f' (and {more} more)' if more > 0 else ''}. Every process must build and "
                "compile the same model with the same DPParameters, DatasetMetadata and budgets. "
                "Nothing was spent.")
        self.rows = [r["rows"] for r in records]
        self._check_ranges([r["source"] for r in records])
        self._check_disjoint(records, shard)
        total, n = sum(self.rows), model.dataset_metadata.nb_samples_train
        if total != n:
            raise ValueError(
                f"{model.name}: the {self.count} processes hold {self.rows} records, {total} in "
                f"all, but dataset_metadata.nb_samples_train = {n}: each process must pass its own "
                "disjoint shard, and the shards together the whole dataset (the sampling rate "
                "b/N would be wrong). Nothing was spent.")
        ledger = PrivacyLedger()
        for r in records:
            ledger = ledger.merge(PrivacyLedger.from_config(r["ledger"]))
        gate.ledger = ledger
        self.run = records[0]["run"]

    def _check_ranges(self, sources):
        """Raise on every process unless the processes' `RecordSource` ranges
        partition one shared source (or no process passes a source)."""
        if all(s is None for s in sources):
            return
        name = self.model.name
        if any(s is None for s in sources):
            p, q = sources.index(None), next(i for i, s in enumerate(sources) if s is not None)
            raise ValueError(f"{name}: process {p} passes arrays and process {q} a RecordSource: "
                             "every process must pass its range of the same source. Nothing was spent.")
        for p, s in enumerate(sources[1:], 1):
            for key in ("name", "total"):
                if s[key] != sources[0][key]:
                    raise ValueError(
                        f"{name}: process {p} reads a source with {key}={s[key]!r}, process 0 "
                        f"one with {key}={sources[0][key]!r}: every process must read its range "
                        "of the same source. Nothing was spent.")
        end, order = 0, sorted(range(len(sources)), key=lambda p: (sources[p]["start"], p))
        for before, p in zip([None] + order, order):
            start, stop = sources[p]["start"], sources[p]["stop"]
            if start != end:
                what = (f"records [{end}, {start}) are in no process's range" if start > end else
                        f"processes {before} and {p} both read records [{start}, {min(end, stop)})")
                raise ValueError(f"{name}: the processes' ranges do not partition the source: "
                                 f"{what}. Nothing was spent.")
            end = max(end, stop)
        if end != sources[0]["total"]:
            raise ValueError(f"{name}: the processes' ranges do not partition the source: records "
                             f"[{end}, {sources[0]['total']}) are in no process's range. "
                             "Nothing was spent.")

    def _check_disjoint(self, records, shard):
        """Raise on every process if two processes hold the same record (a collective)."""
        counts = [r["rows"] if r["digests"] else 0 for r in records]
        if sum(c > 0 for c in counts) < 2:  # nothing to compare (TensorFlow crashes gathering nothing)
            return
        key = bytes.fromhex(records[0]["key"])
        mine = (np.zeros(0, "uint64") if shard is None
                else record_digests(shard[0], shard[1], key=key))
        size = -(-max(counts) // (_BLOCK // _DIGEST)) * (_BLOCK // _DIGEST)
        buffer = np.zeros(2 * size, "int32")  # 32-bit halves: JAX gathers no 64-bit integers by default
        buffer[:2 * len(mine)] = mine.view("int32")
        gathered = self.allgather(buffer)
        digests = [np.unique(np.ascontiguousarray(row[:2 * n], dtype="int32").view("uint64"))
                   for row, n in zip(gathered, counts)]
        shared = _first_overlap(digests)
        if shared is not None:
            p, q, count = shared
            raise ValueError(
                f"{self.model.name}: processes {p} and {q} of {self.count} hold {count} identical "
                "records (same inputs and label): each process must pass its own disjoint "
                "shard, or the sampling rate b/N and ε would be wrong. Identical rows count as "
                "shared even when they are distinct records: deduplicate them, or give every copy "
                "to one process. Nothing was spent.")

    def _configuration(self):
        model = self.model
        return {
            "dp_parameters": model.dp_parameters.get_config(),
            "dataset_metadata": model.dataset_metadata.get_config(),
            "noise_coefficients": noise_coefficients(model),
            "variables": [[v.path, list(v.shape)] for v in model.trainable_variables],
            "local_replicas": distribute.local_replicas(model),
            "budgets": sorted(model.privacy_gate.budgets()),
        }

    # -- during training -----------------------------------------------------------------
    def digest(self):
        """A 62-bit digest of the ledger, the budgets and the plans in force."""
        gate = self.model.privacy_gate
        text = json.dumps([gate.ledger.get_config(), sorted(gate.budgets()), sorted(map(str, gate.plans))],
                          sort_keys=True)
        return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 2

    def agree_rows(self, records):
        """The largest local batch of this step over all processes (every process
        pads to the size that holds it), after checking that the ledgers agree."""
        gathered = self.allgather(np.array([records, self.digest()], dtype="int64"))
        self._check_digests(gathered[:, 1])
        return int(gathered[:, 0].max())

    def verify(self):
        """Raise `DistributedTrainingError` on every process unless all ledgers,
        budgets and plans are identical (a collective)."""
        gate = self.model.privacy_gate
        if gate.plans:
            raise NotImplementedError(
                f"{self.model.name}: releases planned alongside training (adaptive clipping) are "
                "not supported on several processes")
        self._check_digests(self.allgather(np.array([self.digest()], dtype="int64"))[:, 0])

    def _check_digests(self, digests):
        if np.any(digests != digests[0]):
            raise DistributedTrainingError(
                f"{self.model.name}: the processes' privacy ledgers or budgets differ "
                f"(digests {digests.tolist()}): give every process the same callbacks and budgets. "
                "Training stopped on every process.")

    def failure(self, error, journal):
        """The `DistributedTrainingError` that replaces ``error`` raised by a step."""
        gate = self.model.privacy_gate
        where = (f" Process 0's journal {journal.path} holds them too." if journal is not None
                 else " Process 0 wrote no journal (pass kdp.callbacks.PrivacyJournal(path)).")
        engine = ("" if keras.backend.backend() != "jax" else
                  " On JAX, end this process with os._exit(1) after this error: JAX's orderly exit "
                  "would wait for the dead process until its heartbeat times out (100 s by "
                  "default), then abort.")
        return DistributedTrainingError(
            f"{self.model.name}: training stopped on process {self.index} of {self.count}: "
            f"{type(error).__name__}: {_cause(error)}. Another process probably died or stopped; "
            f"a step needs every process. The ledger counts every step that may have run "
            f"({gate.ledger.training_steps()} steps, ε={gate.privacy_spent()[0]:.4g}): failed "
            f"steps are never taken back.{where}{engine}")


def record_digests(x, y, key):
    """One keyed 8-byte digest per record of a shard (`ProcessGroup.join`).

    A record is its inputs (every array of ``x``) and its label (not its weight:
    the same record twice counts twice whatever its weights), each as float64 (so
    that the same values digest alike whatever the dtype);
    the hash is BLAKE2b keyed with ``key``, which only the processes of one
    handshake know. Returns a ``uint64`` array of ``len(y)`` digests.
    """
    y = np.asarray(y)
    rows = len(y)
    parts = [np.asarray(leaf) for leaf in keras.tree.flatten(x)] + [y]
    digests = np.empty(rows, "uint64")
    view = digests.view(f"V{_DIGEST}")
    chunk = 4096
    for start in range(0, rows, chunk):
        block = np.concatenate([np.ascontiguousarray(part[start:start + chunk], dtype="<f8")
                                .reshape(min(chunk, rows - start), -1) for part in parts], axis=1)
        for i, row in enumerate(block):
            view[start + i] = hashlib.blake2b(row.tobytes(), digest_size=_DIGEST, key=key).digest()
    return digests


def _first_overlap(digests):
    """``(p, q, count)``: the first pair of processes (in rank order) whose sets of
    digests intersect, and how many they share; ``None`` if they are disjoint."""
    owners = np.concatenate([np.full(len(d), p) for p, d in enumerate(digests)]).astype("int64")
    values = np.concatenate(digests) if digests else np.zeros(0, "uint64")
    order = np.lexsort((owners, values))
    values, owners = values[order], owners[order]
    same = np.flatnonzero(values[1:] == values[:-1])  # each process's digests are unique
    if not len(same):
        return None
    p, q = min(zip(owners[same].tolist(), owners[same + 1].tolist()))
    return p, q, len(np.intersect1d(digests[p], digests[q], assume_unique=True))


_ABSENT = object()


def _differences(mine, first, path=""):
    """``(key path, this value, process 0's value)`` of every leaf where two
    JSON-like configurations differ."""
    if isinstance(mine, dict) and isinstance(first, dict):
        for k in sorted(set(mine) | set(first), key=str):
            yield from _differences(mine.get(k, _ABSENT), first.get(k, _ABSENT),
                                    f"{path}.{k}" if path else str(k))
    elif isinstance(mine, list) and isinstance(first, list) and len(mine) == len(first):
        for i, (a, b) in enumerate(zip(mine, first)):
            yield from _differences(a, b, f"{path}[{i}]")
    elif mine != first:
        yield path, mine, first


def _shown(mine, first, most=100):
    """Two differing JSON values as text; of two long strings, the part around
    their first difference."""
    texts = ["(absent)" if v is _ABSENT else v if isinstance(v, str) else json.dumps(v)
             for v in (mine, first)]
    if max(map(len, texts)) <= most:
        return texts
    start = 0
    if isinstance(mine, str) and isinstance(first, str):
        start = next((i for i, (a, b) in enumerate(zip(*texts)) if a != b), min(map(len, texts)))
        start = max(0, start - most // 3)
    return [("…" if start else "") + t[start:start + most] + ("…" if len(t) > start + most else "")
            for t in texts]


def _cause(error):
    """The engine's error as one line: every line of its text but the traceback
    that TensorFlow prints inside it, trimmed to `_CAUSE` characters."""
    lines = [line.strip() for line in str(error).splitlines()]
    kept = [line for line in lines if line and not line.startswith('File "')
            and not line.startswith("Detected at node")]
    text = " ".join(kept).rstrip(".")
    return text if len(text) <= _CAUSE else text[:_CAUSE - 1] + "…"


__all__ = ["DistributedTrainingError", "ProcessGroup"]
