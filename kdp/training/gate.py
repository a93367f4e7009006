"""The privacy gate: the one mechanism through which every noisy release runs.

A `PrivacyGate` owns a `PrivacyLedger`, the budgets that bound it and, during a
training run, a write-ahead `LedgerJournal`. Every path that can release
something computed from private data (`fit`, `train_on_batch` and custom loops
around it, the trainers of `kdp.contrastive`, `kdp.dpcl`, `kdp.adamix`, `kdp.helmet`, adaptive clipping's quantiles) goes
through `PrivacyGate.spend`, which

1. refuses the release, before anything runs, if any budget would be exceeded
   (`BudgetExceededError`);
2. records it in the ledger and writes the journal **before** it runs, so a
   process killed at any instant has every release it made on file;
3. keeps the gate open while it runs: the noisy objective of a DP model refuses
   to be built anywhere else (`require_open`);
4. takes the release back only when the caller proves that it did not run
   (never on several processes: another process may have run it);
5. refuses any release on one of several processes (`kdp.distribute.process_count`)
   outside a multi-process `fit`, which samples, noises and accounts them together.

Budgets use the RDP accountant of `kdp.accounting` unless a budget names PLD.
"""

import contextlib
import json
import math

from kdp import accounting, distribute
from kdp.training.ledger import PrivacyLedger, mechanism_event, new_run_id


class PrivacyGateError(RuntimeError):
    """A noisy release was attempted outside the privacy gate."""


class BudgetExceededError(RuntimeError):
    """A release would exceed a privacy budget; nothing was run or recorded."""


class PrivacyGate:
    """Records, budgets and opens the way for every noisy release of one owner.

    Args:
        delta: the δ at which ε is reported and budgets are enforced.
        ledger: the `PrivacyLedger` already spent (a fresh one by default).
        epsilon_max: a persistent budget (``None``: none).
        name: the owner's name, for error messages.
    """

    def __init__(self, delta, ledger=None, epsilon_max=None, name="model"):
        self.delta = float(delta)
        self.ledger = ledger if ledger is not None else PrivacyLedger()
        self.epsilon_max = epsilon_max
        self.name = name
        self.journal = None
        self.processes = None  # the ProcessGroup of a multi-process fit, while it runs
        self.run = None
        self.plans = {}
        self._budgets = {}
        self._allowance = {}
        self._depth = 0  # not thread-local: tf.distribute traces the step in replica threads

    # -- runs and budgets ----------------------------------------------------------------
    def start_run(self):
        """Name a new run: releases recorded from now on form a new history
        (composed with every other run when ledgers are merged)."""
        self.run = new_run_id()
        return self.run

    def add_budget(self, key, epsilon_max, accountant="rdp"):
        """A temporary budget (e.g. a callback's) enforced with the persistent one."""
        if not (epsilon_max > 0 and math.isfinite(epsilon_max)):
            raise ValueError(f"epsilon_max must be a finite number > 0, got {epsilon_max}")
        if accountant not in accounting.ACCOUNTANTS:
            raise ValueError(f"accountant must be one of {accounting.ACCOUNTANTS}, got {accountant!r}")
        self._budgets[key] = (float(epsilon_max), accountant)
        self._allowance.clear()

    def remove_budget(self, key):
        self._budgets.pop(key, None)
        self._allowance.clear()

    def budgets(self):
        """``[(epsilon_max, accountant)]`` in force."""
        found = list(self._budgets.values())
        if self.epsilon_max is not None:
            found.append((float(self.epsilon_max), "rdp"))
        return found

    def planned_events(self, count):
        """The releases that registered plans make alongside ``count`` more steps
        (e.g. adaptive clipping's quantiles; see `kdp.training.budget`)."""
        events = []
        for plan in self.plans.values():
            events.extend(plan.planned_events(int(count)))
        return events

    def remaining(self, mechanism):
        """How many more releases of ``mechanism`` every budget allows (``inf``
        without a budget). Cached while the ledger does not change otherwise."""
        budgets = self.budgets()
        if not budgets:
            return math.inf
        key = json.dumps(mechanism, sort_keys=True)
        fingerprint = self._fingerprint()
        cached = self._allowance.get(key)
        if cached is not None and cached[0] == fingerprint:
            return cached[1]
        spent = self.ledger.events()
        # Plans accompany training steps: n more steps bring their releases along.
        planned = self.planned_events if self.plans and mechanism["kind"] == "training" else None
        allowed = min(
            accounting.max_count(
                eps_max, self.delta, lambda n: [mechanism_event(mechanism, n)], spent, accountant,
                planned=planned)
            for eps_max, accountant in budgets)
        self._allowance[key] = (fingerprint, allowed)
        return allowed

    def _fingerprint(self):
        """Changes whenever the ledger or the plans may have changed (O(1))."""
        return id(self.ledger), self.ledger.version, len(self.ledger.entries), tuple(self.plans)

    def check(self, mechanism, count=1):
        """Raise `BudgetExceededError` unless ``count`` more releases fit every budget."""
        allowed = self.remaining(mechanism)
        if count > allowed:
            eps, _ = self.privacy_spent()
            limits = ", ".join(f"epsilon_max={e:g} ({a})" for e, a in self.budgets())
            state = "exhausted" if allowed == 0 else "insufficient"
            raise BudgetExceededError(
                f"privacy budget {state}: {self.name} already spent ε={eps:.4g} (δ={self.delta:g}) "
                f"over {self.ledger.training_steps()} steps, and {count} more release(s) would "
                f"exceed {limits} ({allowed} allowed); nothing was run"
                + (". One release at this noise already costs more than the budget: add noise "
                   "(a DP model's make_private(target_epsilon, epochs) calibrates it) or raise "
                   "the budget" if allowed == 0 and not self.ledger.entries else ""))

    # -- the gate --------------------------------------------------------------------------
    @contextlib.contextmanager
    def spend(self, mechanism, count=1, refund=None):
        """Check, record (write-ahead) and open the gate for ``count`` releases.

        Args:
            mechanism: the ledger key of one release (`kdp.training.ledger`).
            count: the number of releases the block may make.
            refund: optional ``() -> int``, called if the block raises: the number
                of recorded releases that provably did not run (taken back).
        """
        if self.processes is None and distribute.process_count() > 1:
            raise PrivacyGateError(
                f"{self.name}: this release would run on one of several processes outside a "
                "multi-process DP model's fit, the only path on which kdp samples, noises and "
                "accounts the processes together; nothing was run")
        self.check(mechanism, count)
        if self.run is None:
            self.start_run()
        self._record(mechanism, count)
        self._depth += 1
        try:
            yield
        except BaseException:
            # A failed multi-process step may have run on the other processes: kept.
            if refund is not None and self.processes is None:
                self.settle(min(count, max(0, int(refund()))))
            raise
        finally:
            self._depth -= 1

    def settle(self, count):
        """Take back ``count`` releases recorded ahead that provably never ran."""
        if count > 0:
            self.ledger.retract(count, self.run)
            self._write_journal()

    def _record(self, mechanism, count):
        before = self._fingerprint()
        self.ledger.record(mechanism, count, self.run)
        key = json.dumps(mechanism, sort_keys=True)
        cached = self._allowance.get(key)
        if cached is not None and cached[0] == before:  # keep the allowance exact and cheap
            self._allowance[key] = (self._fingerprint(), cached[1] - count)
        self._write_journal()

    def _write_journal(self):
        if self.journal is not None:
            self.journal.write(self.ledger)

    @property
    def is_open(self):
        return self._depth > 0

    def require_open(self, what="a noisy training step"):
        """Raise `PrivacyGateError` unless called inside `spend`."""
        if not self.is_open:
            raise PrivacyGateError(
                f"{what} of {self.name} was built outside kdp's privacy gate, so it would not "
                "be recorded in the privacy ledger. Train with model.fit or "
                "model.train_on_batch (a custom loop can call train_on_batch on each batch), "
                "or open the gate explicitly with `with model.privacy_gate.spend(mechanism): ...`.")

    # -- reading -------------------------------------------------------------------------------
    def merge(self, ledger):
        """Merge ``ledger`` into this gate's (`PrivacyLedger.merge`: nothing is lost)."""
        self.ledger = self.ledger.merge(ledger)

    def privacy_spent(self, accountant="rdp"):
        """``(ε, δ)`` of every release in the ledger."""
        return accounting.epsilon_of_events(self.ledger.events(), self.delta, accountant), self.delta
