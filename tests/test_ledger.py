"""The privacy budget is never lost or under-counted.

The ledger survives saving (``.keras``, weights checkpoints), resuming, second
`fit` calls and crashes (a training process killed with SIGKILL and restarted
from its `BackupAndRestore` checkpoint); a budget set once is enforced over every
`fit`; the noise is unpredictable unless ``reproducible=True``.

Runs on whichever ``KERAS_BACKEND`` is set (the training process it kills inherits it).
"""

import json
import os

import h5py
import keras
import numpy as np
import pytest

import kdp
from kdp import accounting, layers, losses
from kdp.callbacks import PrivacyJournal
from kdp.ledger import LedgerJournal, PrivacyLedger
from kdp.model import DP_Model, DP_Sequential, DPParameters
from kdp.pipeline import DatasetMetadata

N, B, D, DELTA = 120, 30, 6, 1e-3
SPE = N // B  # steps per epoch
Q = B / N
SIGMA = 1.5  # "global" noise: σ_eff = σ
HERE = os.path.dirname(os.path.abspath(__file__))


def _stack():
    return [layers.DP_BoundedInput((D,), 1.0), layers.DP_QuickSpectralDense(8), layers.DP_GroupSort(2),
            layers.DP_QuickSpectralDense(3)]


def _model(kind="sequential", sigma=SIGMA, optimizer="adam", run_eagerly=False, **params):
    dp = dict(dp_parameters=DPParameters("global", sigma, DELTA, **params),
              dataset_metadata=DatasetMetadata((D,), 3, N, B))
    if kind == "sequential":
        model = DP_Sequential(_stack(), **dp)
    else:
        inputs = keras.Input((D,))
        h = inputs
        for layer in _stack():
            h = layer(h)
        model = DP_Model(inputs, h, **dp)
    model.compile(optimizer=optimizer, loss=losses.DP_TauCategoricalCrossentropy(1.0), run_eagerly=run_eagerly)
    model.build((None, D))
    return model


def _data(seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(N, D)).astype("float32"), rng.integers(0, 3, N)


def _eps(steps, sigma=SIGMA):
    return accounting.compute_epsilon(sigma, Q, steps, DELTA)


# --- crash safety ------------------------------------------------------------------------

def _run_script(forks, workdir, *args):
    """`ledger_fault_run.py` in a process of its own (`tests/_forks.py`): its exit
    code (-9 when it killed itself) and output."""
    workdir.mkdir(parents=True, exist_ok=True)
    return forks.run([os.path.join(HERE, "ledger_fault_run.py"), workdir, *args], workdir,
                     workdir.parent / f"{workdir.name}-{len(args)}.log", timeout=240)


def test_sigkill_at_a_random_step_then_restart_counts_every_step(tmp_path, forks):
    import ledger_fault_run as script  # tests/ is on sys.path under pytest

    epochs, spe = script.EPOCHS, script.STEPS_PER_EPOCH
    total = epochs * spe
    rng = np.random.default_rng()  # a random step (OS entropy), reported on failure
    kill_at = int(rng.integers(1, total - 1))
    when = str(rng.choice(["begin", "end"]))
    info = f"killed at the {when} of step {kill_at}"

    clean = script.run(str(tmp_path / "clean"))  # the same run, uninterrupted (in this process)
    assert clean["steps"] == total

    code, output = _run_script(forks, tmp_path / "crash", "--kill-at", kill_at, "--kill-when", when)
    assert code == -9, (info, code, output[-3000:])
    assert not (tmp_path / "crash" / "result.json").exists()
    journal = LedgerJournal(tmp_path / "crash" / "backup" / PrivacyJournal.FILENAME).read()
    # The gate records a step just before it runs (inside the train function): a
    # kill at the end of step g leaves g + 1 steps, one at its beginning g.
    ran = kill_at + 1 if when == "end" else kill_at
    assert journal.training_steps() == ran, info

    code, output = _run_script(forks, tmp_path / "crash")
    assert code == 0, output[-3000:]
    result = json.loads((tmp_path / "crash" / "result.json").read_text())
    saved_epochs = kill_at // spe  # BackupAndRestore saved these, then restarts the next epoch
    expected_steps = ran + (epochs - saved_epochs) * spe
    print(f"\n{info}: uninterrupted {total} steps, ε={clean['epsilon']:.4f}; "
          f"killed and restarted {result['steps']} steps, ε={result['epsilon']:.4f}")
    assert result["steps"] == expected_steps, info  # every step, the interrupted epoch's too
    # Equal when the kill falls on an epoch's first step (nothing repeated); the ledger
    # then composes the same steps in other groups, so compare up to rounding.
    assert result["epsilon"] >= clean["epsilon"] * (1 - 1e-12), info
    assert result["epsilon"] == pytest.approx(_eps(expected_steps, script.SIGMA), rel=1e-9)
    assert not (tmp_path / "crash" / "backup").exists()  # backup and journal removed at the end
    loaded = keras.models.load_model(tmp_path / "crash" / "final.keras")
    assert loaded.privacy_ledger.entries == result["entries"]


class _Crash(Exception):
    pass


class _CrashAt(keras.callbacks.Callback):
    def __init__(self, step):
        super().__init__()
        self.step, self.seen = step, 0

    def on_train_batch_end(self, batch, logs=None):
        if self.seen == self.step:
            raise _Crash()
        self.seen += 1


@pytest.mark.parametrize("keep_journal", [True, False])
def test_interrupted_epoch_is_counted_through_the_journal(tmp_path, keep_journal):
    x, y = _data()
    backup = str(tmp_path / "backup")
    crash_step = SPE + 1  # the second step of epoch 2: one epoch saved, 2 steps of epoch 2 ran
    with pytest.raises(_Crash):
        _model().fit(x, y, epochs=3, verbose=0,
                     callbacks=[keras.callbacks.BackupAndRestore(backup), _CrashAt(crash_step)])
    if not keep_journal:  # negative control: a ledger kept only in the checkpoints
        os.remove(os.path.join(backup, PrivacyJournal.FILENAME))
    model = _model()  # a fresh process would rebuild the model from code
    model.fit(x, y, epochs=3, verbose=0, callbacks=[keras.callbacks.BackupAndRestore(backup)])
    lost = 0 if keep_journal else crash_step + 1 - SPE
    assert model.privacy_ledger.training_steps() == 3 * SPE + (crash_step + 1 - SPE) - lost


def test_explicit_journal_with_model_checkpoint(tmp_path):
    x, y = _data()
    ckpt, journal = str(tmp_path / "ckpt.weights.h5"), str(tmp_path / "ledger.json")
    save = keras.callbacks.ModelCheckpoint(ckpt, save_weights_only=True)
    with pytest.raises(_Crash):
        _model().fit(x, y, epochs=3, verbose=0, callbacks=[save, PrivacyJournal(journal), _CrashAt(SPE + 2)])
    model = _model()
    model.load_weights(ckpt)
    assert model.privacy_ledger.training_steps() == SPE  # the checkpoint covers epoch 1
    model.fit(x, y, epochs=2, initial_epoch=1, verbose=0, callbacks=[PrivacyJournal(journal)])
    assert model.privacy_ledger.training_steps() == (SPE + 3) + SPE
    assert LedgerJournal(journal).read() == model.privacy_ledger  # the journal is kept


def test_ledger_merge_never_loses_a_release():
    a = PrivacyLedger()
    a.record_training_steps(8, 1.0, 0.25, "poisson", 4, run="r1")
    later = PrivacyLedger(a.entries)
    later.record_training_steps(3, 1.0, 0.25, "poisson", 4, run="r1")
    later.record_training_steps(2, 2.0, 0.25, "poisson", 4, run="r1")
    assert a.merge(later) == later and later.merge(a) == later  # the same history, seen twice
    other = PrivacyLedger()
    other.record_training_steps(5, 3.0, 0.5, "poisson", 2, run="r2")
    both = a.merge(other)
    assert both.entries == a.entries + other.entries  # two trainings on the same data add up
    assert PrivacyLedger.from_json(both.to_json()) == both
    assert PrivacyLedger().merge(a) == a
    with pytest.raises(ValueError):
        a.retract(9, "r1")


def test_format_1_ledgers_load_and_merge_conservatively():
    old = [{"kind": "training", "noise_multiplier": 1.0, "sampling_rate": 0.25, "steps": 8,
            "sampling": "poisson", "steps_per_epoch": 4}]
    a = PrivacyLedger.from_json('{"format": 1, "entries": %s}' % json.dumps(old))
    assert a.training_steps() == 8 and a.merge(a) == a  # the same old ledger counts once
    b = PrivacyLedger.from_config({"entries": [dict(old[0], steps=3)]})
    assert a.merge(b).training_steps() == 11  # two different old ledgers add up


# --- the ledger travels with the model ---------------------------------------------------------

@pytest.mark.parametrize("kind", ["sequential", "functional"])
def test_keras_round_trip_keeps_the_ledger_and_a_second_fit_adds_to_it(tmp_path, kind):
    x, y = _data()
    model = _model(kind)
    model.fit(x, y, epochs=2, verbose=0)
    path = tmp_path / "m.keras"
    model.save(path)
    loaded = keras.models.load_model(path)
    assert type(loaded) is type(model)
    assert loaded.privacy_ledger == model.privacy_ledger and loaded.privacy_ledger.training_steps() == 2 * SPE
    assert loaded.privacy_spent() == model.privacy_spent()
    np.testing.assert_allclose(np.asarray(loaded(x[:5])), np.asarray(model(x[:5])), rtol=1e-5, atol=1e-6)
    assert loaded.dp_parameters.get_config() == model.dp_parameters.get_config()
    assert loaded.optimizer is not None  # compiled from the file: it can resume at once
    loaded.fit(x, y, epochs=1, verbose=0)
    assert loaded.privacy_ledger.training_steps() == 3 * SPE
    assert loaded.privacy_spent()[0] == pytest.approx(_eps(3 * SPE), rel=1e-9)


def test_weights_checkpoint_carries_the_ledger_and_never_rolls_it_back(tmp_path):
    x, y = _data()
    model = _model()
    path = str(tmp_path / "epoch{epoch}.weights.h5")
    model.fit(x, y, epochs=3, verbose=0, callbacks=[keras.callbacks.ModelCheckpoint(path, save_weights_only=True)])
    for epoch in (1, 3):
        fresh = _model()
        fresh.load_weights(path.format(epoch=epoch))
        assert fresh.privacy_ledger.training_steps() == epoch * SPE
    # Going back to epoch 1's weights does not un-spend epochs 2 and 3.
    model.load_weights(path.format(epoch=1))
    assert model.privacy_ledger.training_steps() == 3 * SPE
    # The noise generator's state is not in the file (whoever holds it could replay the noise).
    state = np.asarray(model._noise_seed.state)
    with h5py.File(path.format(epoch=3)) as f:
        arrays = []
        f.visititems(lambda name, obj: arrays.append(np.asarray(obj)) if isinstance(obj, h5py.Dataset) else None)
    assert not any(a.shape == state.shape and np.array_equal(a, state) for a in arrays)


def test_resume_with_initial_epoch_and_composed_trainings():
    x, y = _data()
    model = _model()
    model.fit(x, y, epochs=2, verbose=0)
    history = model.fit(x, y, epochs=4, initial_epoch=2, verbose=0, callbacks=[kdp.DP_Accountant()])
    assert model.privacy_ledger.training_steps() == 4 * SPE
    assert history.history["epsilon"] == pytest.approx([_eps(3 * SPE), _eps(4 * SPE)], rel=1e-9)
    # Fine-tuning with another noise level on the same data: a second entry, composed.
    tuned = _model(sigma=3.0)
    tuned.set_weights(model.get_weights())
    tuned.merge_ledger(model.privacy_ledger)
    tuned.fit(x, y, epochs=1, verbose=0)
    # two fits of the first model (two runs) and the fine-tuning (a third)
    assert [e["count"] for e in tuned.privacy_ledger.entries] == [2 * SPE, 2 * SPE, SPE]
    expected = accounting.epsilon_of_events(
        [accounting.training_event(SIGMA, Q, 4 * SPE), accounting.training_event(3.0, Q, SPE)], DELTA)
    assert tuned.privacy_spent()[0] == pytest.approx(expected, rel=1e-9)
    assert tuned.privacy_spent()[0] > max(_eps(4 * SPE), _eps(SPE, 3.0))


# --- one budget over every call ----------------------------------------------------------------

def test_budget_is_enforced_across_fit_calls_and_after_loading(tmp_path):
    x, y = _data()
    eps_max = 0.5 * (_eps(7) + _eps(8))  # allows exactly 7 steps in all
    model = _model(epsilon_max=eps_max)
    model.fit(x, y, epochs=1, verbose=0)
    assert model.privacy_ledger.training_steps() == 4
    model.fit(x, y, epochs=5, verbose=0)
    assert model.privacy_ledger.training_steps() == 7  # the second call stopped at the budget
    assert model.privacy_spent()[0] <= eps_max
    with pytest.raises(RuntimeError, match="budget exhausted"):
        model.fit(x, y, epochs=1, verbose=0)
    assert model.privacy_ledger.training_steps() == 7
    model.save(tmp_path / "m.keras")
    loaded = keras.models.load_model(tmp_path / "m.keras")
    assert loaded.dp_parameters.epsilon_max == eps_max
    with pytest.raises(RuntimeError, match=r"budget exhausted.*7 steps.*epsilon_max"):
        loaded.fit(x, y, epochs=1, verbose=0)
    # A model given a ledger that already exceeds its budget is refused too.
    over = _model(epsilon_max=_eps(3))
    over.merge_ledger(model.privacy_ledger)
    with pytest.raises(RuntimeError, match="budget exhausted"):
        over.fit(x, y, epochs=1, verbose=0)
    assert over.privacy_ledger.training_steps() == 7


def test_epsilon_max_is_validated():
    with pytest.raises(ValueError, match="epsilon_max"):
        DPParameters(epsilon_max=0)
    assert DPParameters.from_config(DPParameters(epsilon_max=2.0).get_config()).epsilon_max == 2.0


# --- unpredictable noise -----------------------------------------------------------------------

def _one_step_noise(model, restore=None):
    """The noise of one real training step: zero sample weights (no data gradient),
    SGD with learning rate 1, projections detached, so the update is −noise."""
    for v in model.trainable_variables:
        v.constraint = None
    if restore is not None:
        model.set_weights(restore)
    before = [np.array(v) for v in model.trainable_variables]
    x, y = _data()
    model.fit(x, y, sample_weight=np.zeros(N), epochs=1, steps_per_epoch=1, verbose=0)
    return np.concatenate([(b - np.array(v)).ravel() for b, v in zip(before, model.trainable_variables)])


def _noise_model(**params):
    # One step each: eager is faster than compiling (the noise code is the same).
    return _model(optimizer=keras.optimizers.SGD(1.0), run_eagerly=True, **params)


def test_noise_comes_from_os_entropy_unless_reproducible(monkeypatch):
    draws = {}
    for name, params in (("a", dict(reproducible=True, seed=5)), ("b", dict(reproducible=True, seed=5)),
                         ("c", {}), ("d", {})):
        keras.utils.set_random_seed(3)  # same global seeds: only the DP seed can differ
        np.random.seed(3)
        draws[name] = _one_step_noise(_noise_model(**params))
    assert np.abs(draws["a"]).max() > 0
    assert np.array_equal(draws["a"], draws["b"])  # reproducible=True and a seed: the same noise
    assert not np.allclose(draws["c"], draws["d"])  # no seed: different noise
    assert not np.allclose(draws["a"], draws["c"])
    # The noise depends on os.urandom only (fix it and two unseeded models agree),
    # and on more than its first 4 bytes (a 31-bit seed could be brute-forced).
    fixed = []
    for tail in (7, 7, 8):
        keras.utils.set_random_seed(4)  # the same initial weights
        monkeypatch.setattr(os, "urandom", lambda n, t=tail: bytes([1, 2, 3, 4] + [t] * (n - 4)))
        fixed.append(_one_step_noise(_noise_model()))
        monkeypatch.undo()
    assert np.array_equal(fixed[0], fixed[1])
    assert not np.allclose(fixed[0], fixed[2])


def test_a_restored_model_never_replays_its_noise():
    model = _noise_model()
    start = model.get_weights()
    first = _one_step_noise(model)
    again = _one_step_noise(model, restore=start)  # same weights, as after a restart
    assert not np.allclose(first, again)
    seeded = _noise_model(reproducible=True, seed=1)  # tests only: replays on purpose
    seeded_start = seeded.get_weights()
    state = np.array(seeded._noise_seed.state)
    first = _one_step_noise(seeded)
    seeded._noise_seed.state.assign(state)
    assert np.array_equal(first, _one_step_noise(seeded, restore=seeded_start))
