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
   to be built anywhere else (`require_open`), and grants one **credit** per
   recorded release of a model step. A compiled step spends a credit of its
   `StepPlan`'s mechanisms **each time it executes** (`consume`, a host callback
   inside the step): a step run outside the gate, run more often than recorded,
   or compiled for another plan (an older σ) raises `PrivacyGateError` and
   releases nothing;
4. takes the release back only when the caller proves that it did not run
   (never on `KeyboardInterrupt` or `SystemExit`, never for a step whose credit
   was spent, never on several processes: another process may have run it);
5. refuses any release on one of several processes (`kdp.distribute.process_count`)
   outside a multi-process `fit`, which samples, noises and accounts them together.

ε and budgets are computed by `kdp.privacy` under the gate's neighbouring relation
(add/remove-one unless the owner says otherwise: `kdp.dpcl` uses replace-one).
The persistent budget is enforced, and ε reported by default, with the gate's
`PrivacyGate.accountant` (the smaller of PLD and RDP unless the owner chose one);
a temporary budget names its accountant, or takes the gate's.
"""

import contextlib
import json
import math
import threading

from kdp import distribute, privacy
from kdp.training import seeds
from kdp.training.ledger import PrivacyLedger, entry_mechanism, mechanism_event, new_run_id
from kdp.training.plan import mechanism_key


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
        neighboring: the `dp_accounting.NeighboringRelation` under which the ledger
            is composed and budgets are enforced (`kdp.privacy.ADD_OR_REMOVE_ONE`
            by default; `kdp.privacy.REPLACE_ONE` for releases sampled without
            replacement).
        accountant: the `accountant` of ``epsilon_max`` and of ε reported by default.
    """

    def __init__(self, delta, ledger=None, epsilon_max=None, name="model",
                 neighboring=privacy.ADD_OR_REMOVE_ONE, accountant="tightest"):
        self.delta = float(delta)
        self.neighboring = neighboring
        self.ledger = ledger if ledger is not None else PrivacyLedger()
        self.epsilon_max = epsilon_max
        self.accountant = accountant
        self.name = name
        self.journal = None
        self.processes = None  # the ProcessGroup of a multi-process fit, while it runs
        self.run = None
        self.plans = {}
        self._budgets = {}
        self._allowance = {}
        self._depth = 0  # not thread-local: tf.distribute traces the step in replica threads
        self._open = []  # the mechanism keys of the open `spend` blocks, innermost last
        self._credits = {}  # mechanism key -> executions of a compiled step still allowed
        self._executed = 0  # host checks run during the current `spend` block
        self._lock = threading.Lock()  # `consume` runs on the engine's callback threads
        #: how many times one step runs its host check (the replicas of a TensorFlow strategy)
        self.executions_per_step = 1

    # -- runs and budgets ----------------------------------------------------------------
    def start_run(self):
        """Name a new run: releases recorded from now on form a new history
        (composed with every other run when ledgers are merged)."""
        self.run = new_run_id()
        return self.run

    def begin_run(self, mechanism=None, releases=1, noise_seed=None, reproducible=False):
        """The prologue every training run shares (a DP model's `fit`, each method's
        trainer): refuse now if the budgets do not allow ``releases`` releases of
        ``mechanism`` (nothing runs), name a new run, and give the run's noise
        generator ``noise_seed`` a fresh state from the OS (`seeds.reseed`) unless
        ``reproducible``, so that no run replays the noise of an earlier one.
        Returns the run's name."""
        if mechanism is not None:
            self.check(mechanism, releases)
        self.start_run()
        if noise_seed is not None and not reproducible:
            seeds.reseed(noise_seed)
        return self.run

    @property
    def accountant(self):
        """The accountant (`kdp.privacy.ACCOUNTANTS`) of the persistent budget
        ``epsilon_max``, with which ε is also reported by default (`accountant_for`).
        Saved with a DP model's weights (`kdp.training.saving`)."""
        return self._accountant

    @accountant.setter
    def accountant(self, accountant):
        privacy.check_accountant(accountant)
        self._accountant = accountant

    def accountant_for(self, events, accountant=None):
        """The accountant to compute ε of ``events`` with: ``accountant`` if given,
        else the gate's `accountant`, or RDP where that is PLD and some event is one
        PLD cannot account (`kdp.privacy.pld_unsupported`; RDP bounds ε too)."""
        if accountant is not None:
            return accountant
        if self.accountant == "pld" and privacy.pld_unsupported(events, self.neighboring):
            return "rdp"
        return self.accountant

    def add_budget(self, key, epsilon_max, accountant=None):
        """A temporary budget (e.g. a callback's) enforced with the persistent one,
        with ``accountant`` (``None``: the gate's, `accountant_for`)."""
        if not (epsilon_max > 0 and math.isfinite(epsilon_max)):
            raise ValueError(f"epsilon_max must be a finite number > 0, got {epsilon_max}")
        if accountant is not None:
            privacy.check_accountant(accountant)
        self._budgets[key] = (float(epsilon_max), accountant)
        self._allowance.clear()

    def remove_budget(self, key):
        self._budgets.pop(key, None)
        self._allowance.clear()

    def budgets(self, events=None):
        """``[(epsilon_max, accountant)]`` in force, each accountant as `accountant_for`
        gives it for ``events`` (default: the ledger's)."""
        found = list(self._budgets.values())
        if self.epsilon_max is not None:
            found.append((float(self.epsilon_max), None))
        events = self.ledger.events() if events is None else events
        return [(eps, self.accountant_for(events, accountant)) for eps, accountant in found]

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
        if not self._budgets and self.epsilon_max is None:
            return math.inf
        key = json.dumps(mechanism, sort_keys=True)
        fingerprint = self._fingerprint()
        cached = self._allowance.get(key)
        if cached is not None and cached[0] == fingerprint:
            return cached[1]
        allowed = min(privacy.max_count(eps_max, self.delta, events_of, spent, accountant,
                                        planned=planned, neighboring=self.neighboring)
                      for spent, events_of, planned, eps_max, accountant in self._limits(mechanism))
        self._allowance[key] = (fingerprint, allowed)
        return allowed

    def _fits(self, mechanism, count):
        """Whether ``count`` more releases of ``mechanism`` fit every budget: `remaining`'s
        test at ``count`` alone (one ε per budget, where `remaining` bisects), or its
        cached allowance."""
        cached = self._allowance.get(json.dumps(mechanism, sort_keys=True))
        if cached is not None and cached[0] == self._fingerprint():
            return count <= cached[1]
        return all(privacy.count_fits(eps_max, self.delta, events_of, count, spent, accountant,
                                      planned=planned, neighboring=self.neighboring)
                   for spent, events_of, planned, eps_max, accountant in self._limits(mechanism))

    def _limits(self, mechanism):
        """``(spent events, n -> events of n releases, planned, epsilon_max, accountant)``
        for each budget in force."""
        spent = self.ledger.events()
        # Plans accompany training steps: n more steps bring their releases along.
        planned = self.planned_events if self.plans and mechanism["kind"] == "training" else None
        ahead = [mechanism_event(mechanism, 1)] + (planned(1) if planned else [])

        def events_of(n):
            return [mechanism_event(mechanism, n)]

        return [(spent, events_of, planned, eps_max, accountant)
                for eps_max, accountant in self.budgets(spent + ahead)]

    def _fingerprint(self):
        """Changes whenever the ledger, the plans or the persistent budget may have
        changed (O(1))."""
        return (id(self.ledger), self.ledger.version, len(self.ledger.entries), tuple(self.plans),
                self.epsilon_max, self.accountant)

    def check(self, mechanism, count=1):
        """Raise `BudgetExceededError` unless ``count`` more releases fit every budget."""
        if self._fits(mechanism, count):
            return
        allowed = self.remaining(mechanism)  # for the message
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
    def spend(self, mechanism, count=1, refundable=False, plan=None):
        """Check, record (write-ahead) and open the gate for ``count`` releases.

        Args:
            mechanism: the ledger key of one release (`kdp.training.ledger`).
            count: the number of releases the block may make.
            refundable: the releases are steps of a compiled DP model step, whose
                host check (`consume`) runs before its noisy gradient exists: if the
                block raises an `Exception` (never a `KeyboardInterrupt` or
                `SystemExit`), the releases whose check did not run are taken back.
            plan: the `StepPlan` of the compiled step the block runs, if any: refused
                unless ``mechanism`` is one of its mechanisms.
        """
        if self.processes is None and distribute.process_count() > 1:
            raise PrivacyGateError(
                f"{self.name}: this release would run on one of several processes outside a "
                "multi-process DP model's fit, the only path on which kdp samples, noises and "
                "accounts the processes together; nothing was run")
        if plan is not None and mechanism_key(mechanism) not in plan.mechanism_keys:
            raise PrivacyGateError(
                f"{self.name}: a step compiled for {plan.describe()} cannot run as the release "
                f"{mechanism}: its noise is not that release's; nothing was run")
        self.check(mechanism, count)
        if self.run is None:
            self.start_run()
        self._record(mechanism, count)
        key = mechanism_key(mechanism)
        with self._lock:
            self._credits[key] = self._credits.get(key, 0) + count * self.executions_per_step
            self._executed = 0
        self._depth += 1
        self._open.append(key)
        try:
            yield
        except Exception:
            # A multi-process step may have run on another process: kept.
            if refundable and self.processes is None:
                self.settle(count - self.executed_steps())
            raise
        finally:
            self._open.pop()
            self._depth -= 1

    def settle(self, count):
        """Take back ``count`` releases recorded ahead that provably never ran
        (with their credits: they can no longer be executed)."""
        if count > 0:
            last = self.ledger.entries[-1] if self.ledger.entries else None
            key = None if last is None else mechanism_key(entry_mechanism(last))
            self.ledger.retract(count, self.run)
            with self._lock:
                if key in self._credits:
                    taken = count * self.executions_per_step
                    self._credits[key] = max(0, self._credits[key] - taken)
            self._write_journal()

    # -- executions of compiled steps ----------------------------------------------------------
    def consume(self, plan):
        """Spend one credit of ``plan``'s mechanisms for one execution of a compiled
        step; raise `PrivacyGateError` if none is left (the step runs outside the
        gate, more often than recorded, or for another plan). Called by the step
        itself, at run time, from the engine's host callback (`kdp.autodiff.host_check`)."""
        with self._lock:
            for key in plan.mechanism_keys:
                if self._credits.get(key, 0) > 0:
                    self._credits[key] -= 1
                    self._executed += 1
                    return
            open_for = [json.loads(k) for k in self._credits if self._credits[k] > 0]
        raise PrivacyGateError(
            f"a compiled noisy step of {self.name} ({plan.describe()}) ran without a release "
            "recorded for it in the privacy ledger ("
            + (f"the gate holds credits only for {open_for}: the step was compiled for another "
               "plan, e.g. before noise_multiplier changed" if open_for else
               "the gate is closed: the step was called outside model.fit / model.train_on_batch")
            + "); it released nothing. Train with model.fit or model.train_on_batch, or open "
            "the gate with `with model.privacy_gate.spend(mechanism, count): ...`.")

    def executed_steps(self):
        """The steps of the current `spend` block whose host check ran (they ran)."""
        with self._lock:
            return -(-self._executed // max(1, self.executions_per_step))

    def revoke_credits(self):
        """Forget every unspent credit (called once a training call has finished:
        its releases that did not run can no longer be executed later)."""
        with self._lock:
            self._credits.clear()

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

    def require_open(self, what="a noisy training step", plan=None):
        """Raise `PrivacyGateError` unless called inside `spend` (for a release that
        ``plan``, if given, realizes)."""
        if plan is not None and self.is_open and self._open[-1] not in plan.mechanism_keys:
            raise PrivacyGateError(
                f"{what} of {self.name} was built for {plan.describe()} while the gate is open "
                f"for the release {json.loads(self._open[-1])}; nothing was run")
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

    def privacy_spent(self, accountant=None, ahead=0, ledger=None):
        """``(ε, δ)`` of every release in the ledger, with ``accountant`` (``None``:
        the gate's, `accountant_for`). ``ahead > 0``: as if the ledger's last entry
        had ``ahead`` more releases, an upper bound on ε after any of them (ε
        grows with every release), for logs that need not be computed each step.
        ``ledger``: another ledger than the gate's (e.g. a copy taken before a step)."""
        ledger = self.ledger if ledger is None else ledger
        events = ledger.events()
        if ahead and events:
            last = ledger.entries[-1]
            events[-1] = mechanism_event(entry_mechanism(last), last["count"] + int(ahead))
        eps = privacy.epsilon_of_events(events, self.delta, self.accountant_for(events, accountant),
                                        self.neighboring)
        return eps, self.delta
