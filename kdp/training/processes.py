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

* `ProcessGroup.join`: one exchange before anything is spent. Every process
  reports its shard size, its local refusals (an invalid batch), its
  configuration and its ledger; all of them then raise the same error, or
  none: the shards must sum to ``dataset_metadata.nb_samples_train``, the
  configurations must be identical, and the ledgers are merged into one
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

import numpy as np

from kdp import distribute
from kdp.training.ledger import PrivacyLedger, new_run_id

#: exchanged records are padded to a multiple of this many bytes (fewer shapes to trace)
_BLOCK = 4096


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
    def join(self, rows, error=None):
        """Agree before anything is spent (see the module's docstring).

        Args:
            rows: the number of records this process holds.
            error: this process's refusal of its own data (a message), if any.

        Raises:
            ValueError: on every process, if any process refused its data, the
                shards do not sum to ``N``, or the configurations differ.
        """
        model = self.model
        gate = model.privacy_gate
        record = {
            "error": error, "rows": int(rows),
            "config": self._configuration(),
            "ledger": gate.ledger.get_config(),
            "run": new_run_id(),
        }
        records = self.exchange(record)
        errors = [(p, r["error"]) for p, r in enumerate(records) if r["error"]]
        if errors:
            raise ValueError(f"{model.name}: process {errors[0][0]} of {self.count} refused its "
                             f"data: {errors[0][1]} Nothing was spent on any process.")
        self.rows = [r["rows"] for r in records]
        total, n = sum(self.rows), model.dataset_metadata.nb_samples_train
        if total != n:
            raise ValueError(
                f"{model.name}: the {self.count} processes hold {self.rows} records, {total} in "
                f"all, but dataset_metadata.nb_samples_train = {n}: each process must pass its own "
                "disjoint shard, and the shards together the whole dataset (the sampling rate "
                "b/N would be wrong). Nothing was spent.")
        differ = sorted(k for k in record["config"]
                        if any(r["config"][k] != records[0]["config"][k] for r in records))
        if differ:
            raise ValueError(f"{model.name}: the processes disagree on {', '.join(differ)}: every "
                             "process must build and compile the same model with the same "
                             "DPParameters and DatasetMetadata. Nothing was spent.")
        ledger = PrivacyLedger()
        for r in records:
            ledger = ledger.merge(PrivacyLedger.from_config(r["ledger"]))
        gate.ledger = ledger
        self.run = records[0]["run"]

    def _configuration(self):
        model = self.model
        return {
            "dp_parameters": model.dp_parameters.get_config(),
            "dataset_metadata": model.dataset_metadata.get_config(),
            "noise": model._noise_signature(),
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
        first = (str(error).strip().splitlines() or [""])[0][:300].rstrip(".")
        return DistributedTrainingError(
            f"{self.model.name}: training stopped on process {self.index} of {self.count}: "
            f"{type(error).__name__}: {first}. Another process probably died or stopped; a step "
            f"needs every process. The ledger counts every step that may have run "
            f"({gate.ledger.training_steps()} steps, ε={gate.privacy_spent()[0]:.4g}): failed "
            f"steps are never taken back.{where}")


__all__ = ["DistributedTrainingError", "ProcessGroup"]
