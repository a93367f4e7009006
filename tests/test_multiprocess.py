"""Several processes training one model on localhost.

JAX: ``keras.distribution.initialize`` (CPU collectives over Gloo) and
`keras.distribution.DataParallel`; TensorFlow: `MultiWorkerMirroredStrategy`
with a ``TF_CONFIG`` naming 127.0.0.1 ports. This file, run as a script with
``--worker``, is one process; each test starts 2 or 3 of them (forks of a process
that has imported Keras and kdp: `tests/_forks.py`) and reads the JSON each one
writes. Only the current ``KERAS_BACKEND``'s engine is run.

Each process holds its own, uneven shard of N = 256 records. Measured, through
the real `fit` path:

* the processes end with identical weights, ledgers and ε, and ε equals a
  single-process run of the same plan (same model, steps, N, b);
* noise: every sample weight 0 and SGD(1) with the projections detached, so a
  step moves each variable by minus the noise: its std is the single-process
  calibration ``σ c_v Δ_v / b`` within 3 %;
* sampling: the processes' draws add up to Poisson batches of mean b (the
  global rate b/N on every shard);
* negative controls, run by the same processes and caught by the same checks:
  a per-process sampling rate (``b/n_p``: P times the records); on TensorFlow
  every worker's noise kept (std × √P); on JAX unshared noise seeds (the
  processes' "replicated" state differs: refused by JAX or diverging weights);
* a process killed mid-training: the survivors stop with
  `DistributedTrainingError`, and process 0's journal holds at least every
  step any process completed (also when the dead process is process 0, which
  writes the journal);
* the docs' "Training on several machines" script, launched on 2 processes.

The handshake (`ProcessGroup.join`) and its refusals are tested in this
process, against a stand-in for the collective: threads that gather each
other's arrays (`_simulate`), or one process whose peers echo its own record.
"""

import functools
import json
import math
import os
import re
import socket
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from test_distributed import BATCH, D_IN, N, expected_stds, lipschitz_model

STEPS = 30           # 384 × 30 bias draws: relative s.e. of the std 0.66 % (3 % = 4.5 s.e.)
CONTROL_STEPS = 30
KILL_AT = 5          # the doomed process dies after this many completed steps


def shard_bounds(processes):
    """Uneven shards: process p holds a share proportional to p + 2 (each above b,
    so that the control's per-process rate b/n_p stays a probability)."""
    shares = [p + 2 for p in range(processes)]
    cuts = np.cumsum([0] + shares) / sum(shares)
    return [int(round(c * N)) for c in cuts]


def data():
    rng = np.random.default_rng(0)
    return rng.normal(size=(N, D_IN)).astype("float32"), rng.integers(0, 8, N)


def build(seed=None, lr=1.0):
    """tests/test_distributed.py's model (its noise std is written out by hand there)."""
    return lipschitz_model(seed, lr=lr)


# --- one process (this file run with --worker) -----------------------------------------


def _worker():
    rank, count = int(os.environ["KDP_RANK"]), int(os.environ["KDP_PROCESSES"])
    scenarios, out = os.environ["KDP_SCENARIO"].split("+"), os.environ["KDP_OUT"]
    backend = os.environ["KERAS_BACKEND"]
    if backend == "jax":
        import jax

        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        import keras

        keras.distribution.initialize(f"127.0.0.1:{os.environ['KDP_PORT']}", count, rank)
        keras.distribution.set_distribution(keras.distribution.DataParallel())
        scope = _null
    else:
        import keras
        import tensorflow as tf

        strategy = tf.distribute.MultiWorkerMirroredStrategy()
        scope = strategy.scope

    import kdp
    import kdp.training.sampling
    import kdp.training.seeds
    from kdp.training.processes import DistributedTrainingError

    x, y = data()
    bounds = shard_bounds(count)
    x, y = x[bounds[rank]:bounds[rank + 1]], y[bounds[rank]:bounds[rank + 1]]
    draws = []  # (records, padded rows, rate) of every draw of this process

    class RecordingBatches(kdp.training.sampling.PoissonBatches):
        def sample_indices(self):
            self._idx = super().sample_indices()
            return self._idx

        def __getitem__(self, index):
            bx, by, bw = super().__getitem__(index)
            draws.append((len(self._idx), len(bw), self.sampling_rate))
            return bx, by, bw

    kdp.training.sampling.PoissonBatches = RecordingBatches

    class Snapshots(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.snaps = []

        def on_train_begin(self, logs=None):
            self.snaps.append(self._weights())

        def on_train_batch_end(self, batch, logs=None):
            self.snaps.append(self._weights())

        def _weights(self):
            return [np.array(kdp.distribute.replica_values(v)[0]) for v in self.model.trainable_variables]

    def noise_run(steps):
        with scope():
            model = build()
            for v in model.trainable_variables:
                v.constraint = None  # the update is then exactly −noise
        snap = Snapshots()
        draws.clear()
        model.fit(x, y, sample_weight=np.zeros(len(y)), epochs=1, steps_per_epoch=steps, verbose=0,
                  callbacks=[snap])
        s = snap.snaps
        rms = [float(np.sqrt(np.mean(np.stack([s[t][i] - s[t + 1][i] for t in range(steps)]) ** 2,
                                     dtype="float64"))) for i in range(len(s[0]))]
        records, rows, rates = zip(*draws[-steps:])
        return {"rms": rms, "epsilon": model.privacy_spent()[0],
                "steps": model.privacy_ledger.training_steps(),
                "ledger": model.privacy_ledger.to_json(),
                "weights": [w.ravel().tolist() for w in s[-1]],
                "mean_records": float(np.mean(records)), "rows": sorted(set(rows)), "rate": rates[0],
                "stds": list(model.noise_stds().values())}

    result = {"rank": rank, "rows": len(y)}
    if "source" in scenarios:  # each process reads its range of one memmap every process opens
        full_x, full_y = data()
        shared = np.memmap(os.environ["KDP_SOURCE"], "float32", "r", shape=full_x.shape)
        lo, hi = bounds[rank], bounds[rank + 1]
        with scope():
            model = build(lr=0.01)
        try:  # overlapping ranges: process 1 also reads process 0's last 5 records
            model.fit(kdp.RecordSource(shared, labels=full_y, start=lo - 5 * (rank == 1), stop=hi),
                      epochs=1, steps_per_epoch=2, verbose=0)
            overlap = None
        except ValueError as e:
            overlap = str(e)
        overlap_steps = model.privacy_ledger.training_steps()
        draws.clear()
        model.fit(kdp.RecordSource(shared, labels=full_y, start=lo, stop=hi), epochs=1,
                  steps_per_epoch=12, verbose=0)
        result["source"] = dict(
            overlap=overlap, overlap_steps=overlap_steps, epsilon=model.privacy_spent()[0],
            ledger=model.privacy_ledger.to_json(),
            weights=[np.array(kdp.distribute.replica_values(v)[0]).ravel().tolist()
                     for v in model.trainable_variables],
            rate=draws[0][2], mean_records=float(np.mean([d[0] for d in draws])))
    if "train" in scenarios:  # after "source": its JAX part ends the distribution
        result["noise"] = noise_run(STEPS)
        # negative control: each process samples its shard at its own rate b/n_p
        patched = kdp.training.sampling.PoissonBatches

        class OwnRate(patched):
            def __init__(self, *args, population=None, **kwargs):
                super().__init__(*args, **kwargs)

        kdp.training.sampling.PoissonBatches = OwnRate
        result["control_own_rate"] = noise_run(CONTROL_STEPS)
        kdp.training.sampling.PoissonBatches = patched
        if backend == "tensorflow":  # negative control: every worker's noise kept
            share = kdp.distribute.noise_share
            kdp.distribute.noise_share = lambda: 1.0
            result["control_noise_everywhere"] = noise_run(CONTROL_STEPS)
            kdp.distribute.noise_share = share
        else:  # negative control: every process keeps its own noise seed
            kdp.training.seeds.shared_os_seed = kdp.training.seeds.os_seed
            try:
                result["control_own_seed"] = noise_run(CONTROL_STEPS)
            except Exception as e:  # noqa: BLE001 (JAX may refuse the inconsistent state)
                result["control_own_seed"] = {"error": f"{type(e).__name__}: {e}"[:500]}
            # a model built without a distribution spanning the processes: refused
            keras.distribution.set_distribution(None)
            try:
                build().fit(x, y, epochs=1, steps_per_epoch=1, verbose=0)
                result["no_distribution"] = None
            except ValueError as e:
                result["no_distribution"] = str(e)
    if "kill" in scenarios:
        doomed = int(os.environ["KDP_DOOMED"])
        done_path = os.path.join(out, f"done-{rank}.txt")

        class Die(keras.callbacks.Callback):
            def on_train_batch_end(self, batch, logs=None):
                with open(done_path, "w") as f:
                    f.write(str(batch + 1))
                if rank == doomed and batch + 1 == KILL_AT:
                    os._exit(3)

        with scope():
            model = build(lr=0.01)
        try:
            model.fit(x, y, epochs=1, steps_per_epoch=200, verbose=0,
                      callbacks=[kdp.callbacks.PrivacyJournal(os.path.join(out, "journal.json")),
                                 Die()])
            result["error"] = None
        except DistributedTrainingError as e:
            result["error"] = str(e)
        result["ledger_steps"] = model.privacy_ledger.training_steps()
    with open(os.path.join(out, f".result-{rank}.tmp"), "w") as f:
        json.dump(result, f)
    os.replace(os.path.join(out, f".result-{rank}.tmp"), os.path.join(out, f"result-{rank}.json"))
    if rank == 0:  # JAX's coordination service lives in process 0: the others abort without it
        doomed = int(os.environ["KDP_DOOMED"])
        others = [os.path.join(out, f"result-{r}.json") for r in range(count) if r != doomed]
        deadline = time.time() + 120
        while time.time() < deadline and not all(map(os.path.exists, others)):
            time.sleep(0.1)
    sys.stdout.flush()
    os._exit(0)  # the survivors of a kill must not wait for the dead process at exit


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


# --- the tests (pytest process) --------------------------------------------------------

ENGINE = os.environ.get("KERAS_BACKEND", "tensorflow")


def _free_ports(count):
    sockets = [socket.socket() for _ in range(count)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def launch(forks, processes, scenario, tmp_path, doomed=-1, timeout=420, script=None, source=""):
    """Start ``processes`` workers (this file, or ``script`` run in ``tmp_path``), as
    forks (`tests/_forks.py`); ``{rank: result}`` of those that wrote one, and the
    return codes."""
    ports = _free_ports(processes)
    argv = [os.path.abspath(__file__), "--worker"] if script is None else [str(script)]
    pids = []
    for rank in range(processes):
        env = dict(forks.env, KDP_RANK=str(rank), KDP_PROCESSES=str(processes),
                   KDP_SCENARIO=scenario, KDP_OUT=str(tmp_path), KDP_PORT=str(ports[0]),
                   KDP_COORDINATOR=f"127.0.0.1:{ports[0]}",
                   KDP_DOOMED=str(doomed), KDP_SOURCE=str(source), TF_CPP_MIN_LOG_LEVEL="3",
                   CUDA_VISIBLE_DEVICES="")
        env.pop("XLA_FLAGS", None)
        env["TF_CONFIG"] = json.dumps({"cluster": {"worker": [f"127.0.0.1:{p}" for p in ports]},
                                       "task": {"type": "worker", "index": rank}})
        pids.append(forks.start(argv, tmp_path, tmp_path / f"log-{rank}.txt", env=env))
    deadline = time.monotonic() + timeout
    codes = []
    for pid in pids:
        code = forks.wait(pid, max(1, deadline - time.monotonic()))
        if code is None:
            forks.kill(pid)
        codes.append("timeout" if code is None else code)
    results = {}
    for rank in range(processes):
        path = tmp_path / f"result-{rank}.json"
        if path.exists():
            results[rank] = json.loads(path.read_text())
    return results, codes


def _tail(tmp_path, processes):
    return "\n".join(f"--- log {r}:\n" + (tmp_path / f"log-{r}.txt").read_text()[-3000:]
                     for r in range(processes))


@functools.cache  # once per process, even if the fixture is set up again
def _trained(forks, processes, tmp_root):
    """The "train" scenario on ``processes`` processes; on 2, the same processes run
    the "source" scenario first (one launch fewer)."""
    tmp = tmp_root / f"train{processes}"
    tmp.mkdir()
    if processes != 2:
        results, codes = launch(forks, processes, "train", tmp)
    else:
        x = data()[0]
        np.memmap(tmp / "x.f32", "float32", "w+", shape=x.shape)[:] = x
        results, codes = launch(forks, processes, "source+train", tmp, source=tmp / "x.f32")
    assert codes == [0] * processes and len(results) == processes, _tail(tmp, processes)
    return processes, [results[r] for r in range(processes)]


@pytest.fixture(scope="module", params=[2, 3], ids=lambda p: f"{p}proc")
def trained(request, tmp_path_factory, forks):
    return _trained(forks, request.param, tmp_path_factory.getbasetemp())


def _within(measured, expected, tol=0.03):
    return abs(measured / expected - 1.0) < tol


def test_shards_are_uneven_and_cover_the_dataset(trained):
    processes, results = trained
    rows = [r["rows"] for r in results]
    assert sum(rows) == N and len(set(rows)) == processes


def test_identical_weights_and_ledgers_on_every_process(trained):
    _, results = trained
    first = results[0]["noise"]
    for r in results[1:]:
        assert r["noise"]["ledger"] == first["ledger"]
        for a, b in zip(r["noise"]["weights"], first["weights"]):
            assert np.array_equal(a, b)
    assert first["steps"] == STEPS


def test_epsilon_equals_a_single_process_run_of_the_same_plan(trained):
    _, results = trained
    model = build()
    x, y = data()
    model.fit(x, y, epochs=1, steps_per_epoch=STEPS, verbose=0)
    single = model.privacy_spent()[0]
    for r in results:
        assert r["noise"]["epsilon"] == pytest.approx(single, rel=1e-9)
        assert r["noise"]["rate"] == BATCH / N


def test_noise_std_matches_single_process_calibration(trained):
    processes, results = trained
    expected = expected_stds()
    noise = results[0]["noise"]
    assert noise["stds"] == pytest.approx(expected, rel=1e-6)
    ratios = [m / e for m, e in zip(noise["rms"], expected)]
    print(f"\n{ENGINE}, {processes} processes: noise std / single-process calibration "
          f"{[round(r, 4) for r in ratios]}")
    for m, e in zip(noise["rms"], expected):
        assert _within(m, e), (m, e)


def _global_batch(results, key):
    return sum(r[key]["mean_records"] for r in results)


def test_the_processes_draws_add_up_to_poisson_batches_of_mean_b(trained):
    processes, results = trained
    total = _global_batch(results, "noise")
    assert abs(total - BATCH) < 5 * math.sqrt(BATCH / STEPS), total
    # per process: mean q·n_p
    for r in results:
        assert abs(r["noise"]["mean_records"] - BATCH * r["rows"] / N) < 5 * math.sqrt(BATCH / STEPS)
    if ENGINE == "jax":  # one shared padded size per step
        assert all(r["noise"]["rows"] == results[0]["noise"]["rows"] for r in results)


def test_negative_control_per_process_sampling_rate_is_caught(trained):
    processes, results = trained
    total = _global_batch(results, "control_own_rate")
    print(f"\n{ENGINE}, {processes} processes: records per global step with b/n_p per process: "
          f"{total:.1f} (b = {BATCH})")
    assert abs(total - BATCH) > 5 * math.sqrt(BATCH / CONTROL_STEPS)
    assert total == pytest.approx(processes * BATCH, rel=0.25)


def test_negative_control_uncoordinated_noise_is_caught(trained):
    processes, results = trained
    if ENGINE == "tensorflow":
        rms = results[0]["control_noise_everywhere"]["rms"]
        ratios = [m / e for m, e in zip(rms, expected_stds())]
        print(f"\ntensorflow, {processes} processes: every worker's noise kept, std ratio "
              f"{[round(r, 3) for r in ratios]} (√P = {math.sqrt(processes):.3f})")
        for r in ratios:
            assert not _within(r, 1.0) and abs(r / math.sqrt(processes) - 1) < 0.1
    else:
        runs = [r["control_own_seed"] for r in results]
        refused = all("error" in run for run in runs)
        diverged = not refused and any(
            not np.array_equal(a, b) for run in runs[1:] for a, b in zip(run["weights"], runs[0]["weights"]))
        print(f"\njax, {processes} processes: own noise seeds: refused={refused} diverged={diverged}")
        assert refused or diverged


def test_jax_processes_without_a_spanning_distribution_are_refused(trained):
    if ENGINE != "jax":
        pytest.skip("JAX's multi-process runtime only")
    _, results = trained
    for r in results:
        assert r["no_distribution"] and "spans all" in r["no_distribution"], r["no_distribution"]


@pytest.mark.parametrize("processes,doomed", [(2, 1), (3, 0)], ids=["2proc-last-dies", "3proc-writer-dies"])
def test_a_dead_process_leaves_no_step_unaccounted(processes, doomed, tmp_path, forks):
    from kdp.training.ledger import LedgerJournal

    results, codes = launch(forks, processes, "kill", tmp_path, doomed=doomed)
    assert codes[doomed] == 3, _tail(tmp_path, processes)
    survivors = [r for r in range(processes) if r != doomed]
    for r in survivors:
        if r in results:  # kdp's error
            assert "training stopped on process" in results[r]["error"], results[r]
            if ENGINE == "tensorflow":  # the engine's cause past its first line: which task failed
                assert "task:" in results[r]["error"], results[r]
        else:  # process 0 hosted JAX's coordination service: JAX itself may end the others
            log = (tmp_path / f"log-{r}.txt").read_text()
            assert ENGINE == "jax" and doomed == 0, _tail(tmp_path, processes)
            assert "distributed service detected fatal errors" in log, log[-3000:]
    done = [int((tmp_path / f"done-{r}.txt").read_text()) for r in range(processes)]
    journal = LedgerJournal(tmp_path / "journal.json").read().training_steps()
    print(f"\n{ENGINE}, {processes} processes, process {doomed} killed: steps completed "
          f"{done}, journal {journal}")
    assert done[doomed] == KILL_AT
    assert journal >= max(done)
    assert all(results[r]["ledger_steps"] >= max(done) for r in survivors if r in results)


# --- the handshake and the refusals, in this process (a stand-in for the collective) ----


def _group_with(others):
    """A `ProcessGroup` of 1 + len(others) processes whose exchange returns this
    process's record followed by ``others(record)``, and whose other gathers
    return this process's array on every process (its peers hold what it holds)."""
    from kdp.training.processes import ProcessGroup

    model = build(seed=1)
    group = ProcessGroup(model, 1 + len(others), 0)
    group.exchange = lambda record: [record] + [edit(json.loads(json.dumps(record))) for edit in others]
    group.allgather = lambda array: np.stack([array] * group.count)
    return model, group


def _rows(n):
    def edit(record):
        record["rows"] = n
        return record
    return edit


def _simulate(shards, configure=None):
    """``ProcessGroup.join`` run by ``len(shards)`` processes at once, as threads
    gathering each other's arrays (the real exchange, keys and digests); process
    ``p`` holds the records ``shards[p]`` (indices into `data`), all the same
    model. ``configure(p, group)`` may change a process before it joins.
    Returns each process's outcome: the error it raised, or its group."""
    from kdp.training.processes import ProcessGroup

    model = build(seed=1)
    x, y = data()
    count = len(shards)
    slots, barrier = [None] * count, threading.Barrier(count, timeout=60)
    outcomes = [None] * count

    def allgather(p, array):
        slots[p] = np.asarray(array)
        barrier.wait()
        gathered = np.stack(slots)
        barrier.wait()
        return gathered

    def run(p):
        group = ProcessGroup(model, count, p)
        group.allgather = lambda array: allgather(p, array)
        if configure is not None:
            configure(p, group)
        rows = np.asarray(shards[p])
        try:
            group.join(len(rows), shard=(x[rows], y[rows], np.ones(len(rows), "float32")))
            outcomes[p] = group
        except Exception as e:  # noqa: BLE001 (compared below)
            outcomes[p] = e

    threads = [threading.Thread(target=run, args=(p,)) for p in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return model, outcomes


def _same_refusal(outcomes):
    """The one error every process raised (they must all raise it)."""
    assert all(isinstance(o, ValueError) for o in outcomes), outcomes
    assert len({str(o) for o in outcomes}) == 1, outcomes
    return str(outcomes[0])


def test_handshake_accepts_shards_that_cover_the_dataset_and_merges_ledgers():
    from kdp.training.ledger import PrivacyLedger, training_mechanism

    other = PrivacyLedger()
    other.record(training_mechanism(1.0, 0.1), 7, "feedc0de")  # a run only process 1 saw

    def with_ledger(record):
        record["rows"], record["ledger"], record["run"] = 100, other.get_config(), "ignored"
        return record

    model, group = _group_with([with_ledger])
    group.join(N - 100)
    assert group.rows == [N - 100, 100]
    assert model.privacy_ledger.training_steps() == 7  # merged: nothing lost
    assert group.run != "ignored"  # process 0 names the run


@pytest.mark.parametrize("rows", [100, 157])
def test_handshake_refuses_shards_that_do_not_sum_to_n(rows):
    model, group = _group_with([_rows(rows)])
    with pytest.raises(ValueError, match=r"hold \[100, %d\] records" % rows):
        group.join(100)
    assert model.privacy_ledger.training_steps() == 0


def test_handshake_reports_another_process_refusal_on_every_process():
    def refused(record):
        record["error"] = "DataValidationError: labels out of range"
        return record

    _, group = _group_with([refused])
    with pytest.raises(ValueError, match="process 1 of 2 refused its data: DataValidationError"):
        group.join(N // 2)


def test_handshake_refuses_different_configurations_naming_process_and_values():
    def other_noise(record):
        record["rows"] = N // 2
        record["config"]["dp_parameters"]["noise_multiplier"] = 9.0
        return record

    model, group = _group_with([other_noise])
    mine = model.dp_parameters.get_config()["noise_multiplier"]
    with pytest.raises(ValueError, match=re.escape(
            f"process 1 has dp_parameters.noise_multiplier=9.0, process 0 has {json.dumps(mine)}")):
        group.join(N // 2)
    assert model.privacy_ledger.training_steps() == 0


def test_every_process_names_the_same_configuration_difference():
    def configure(p, group):
        if p == 2:
            config = group._configuration()
            group._configuration = lambda: dict(config, local_replicas=2)

    _, outcomes = _simulate([range(0, 80), range(80, 160), range(160, N)], configure)
    message = _same_refusal(outcomes)
    assert "the processes' configurations differ: process 2 has local_replicas=2, process 0 has 1" \
        in message, message


@pytest.mark.parametrize("shards,pair,shared", [
    ([range(0, 128), range(0, 128)], (0, 1), 128),               # N rows in all, twice the same
    ([range(0, 160), range(96, N)], (0, 1), 64),                 # overlapping ranges
    ([range(0, 80), range(80, 170), range(160, N)], (1, 2), 10),  # 3 processes, the last two
], ids=["same-shard", "overlap", "3proc"])
def test_handshake_refuses_overlapping_shards_on_every_process(shards, pair, shared):
    model, outcomes = _simulate(shards)
    message = _same_refusal(outcomes)
    assert f"processes {pair[0]} and {pair[1]} of {len(shards)} hold {shared} identical records" \
        in message, message
    assert model.privacy_ledger.training_steps() == 0


def test_handshake_accepts_disjoint_shards_and_duplicates_within_one():
    """The negative control: disjoint shards pass, also when one shard holds the
    same row twice (identical rows within a dataset can be distinct records)."""
    order = np.random.default_rng(1).permutation(N)
    shards = [order[:100].copy(), order[100:]]
    shards[0][1] = shards[0][0]  # record order[0] twice on process 0, order[1] nowhere
    model, outcomes = _simulate(shards)
    assert not any(isinstance(o, Exception) for o in outcomes), outcomes
    assert all(o.rows == [100, N - 100] for o in outcomes)
    assert len({o.run for o in outcomes}) == 1


def test_overlapping_shards_are_refused_by_fit_before_any_step(monkeypatch):
    """Through `fit`: process 1 (a stand-in) holds this process's records; the
    handshake refuses them, nothing is spent and the weights do not move. (`fit`
    must pass its validated shard to `ProcessGroup.join`.)"""
    from kdp.training.processes import ProcessGroup

    model = build(seed=1)
    x, y = data()
    group = ProcessGroup(model, 2, 0)
    group.allgather = lambda array: np.stack([array, array])
    monkeypatch.setattr(ProcessGroup, "of", classmethod(lambda cls, m: group if m is model else None))
    before = [np.array(v) for v in model.trainable_variables]
    with pytest.raises(ValueError, match="processes 0 and 1 of 2 hold 128 identical records"):
        model.fit(x[:N // 2], y[:N // 2], epochs=1, verbose=0)
    assert model.privacy_ledger.training_steps() == 0
    assert all(np.array_equal(a, np.array(v)) for a, v in zip(before, model.trainable_variables))


def test_processes_reading_ranges_of_one_source_train_one_model(tmp_path_factory, forks):
    """Two processes, each reading only its range of one memmap: overlapping
    ranges are refused on both before any step; the partition trains one model
    (identical weights and ledgers) at the global rate b/N, with the ε of a
    single process on N records."""
    x, _ = data()
    first, second = (r["source"] for r in _trained(forks, 2, tmp_path_factory.getbasetemp())[1])
    bounds = shard_bounds(2)
    assert first["overlap"] == second["overlap"]
    assert f"processes 0 and 1 both read records [{bounds[1] - 5}, {bounds[1]})" in first["overlap"]
    assert first["overlap_steps"] == second["overlap_steps"] == 0
    assert first["ledger"] == second["ledger"] and first["weights"] == second["weights"]
    assert first["rate"] == second["rate"] == pytest.approx(BATCH / N)
    from kdp.training.ledger import PrivacyLedger

    assert PrivacyLedger.from_json(first["ledger"]).training_steps() == 12
    reference = build(seed=1)
    reference.fit(x, data()[1], epochs=1, steps_per_epoch=12, verbose=0)
    assert first["epsilon"] == pytest.approx(reference.privacy_spent()[0], rel=1e-9)


@pytest.mark.parametrize("edit, message", [
    ({"start": 90}, r"processes 0 and 1 both read records \[90, 100\)"),
    ({"start": 110}, r"records \[100, 110\) are in no process's range"),
    ({"stop": N - 1}, r"records \[%d, %d\) are in no process's range" % (N - 1, N)),
    ({"name": "other.f32"}, "process 1 reads a source with name='other.f32'"),
    (None, "process 1 passes arrays and process 0 a RecordSource"),
])
def test_handshake_refuses_ranges_that_do_not_partition_one_source(edit, message):
    import kdp

    x, y = data()

    def peer(record):
        record["rows"] = N - 100
        record["source"] = None if edit is None else {**record["source"], "start": 100, "stop": N,
                                                      **edit}
        return record

    model, group = _group_with([peer])
    with pytest.raises(ValueError, match=message):
        group.join(100, source=kdp.RecordSource(x, labels=y, stop=100))
    assert model.privacy_ledger.training_steps() == 0


def test_handshake_accepts_ranges_that_partition_one_source():
    import kdp

    x, y = data()

    def peer(record):
        record["rows"], record["source"] = N - 100, {**record["source"], "start": 100, "stop": N}
        return record

    _, group = _group_with([peer])
    group.join(100, source=kdp.RecordSource(x, labels=y, stop=100))
    assert group.rows == [100, N - 100]


def test_a_failed_step_keeps_the_engine_cause():
    """TensorFlow's error: every line of its cause, not its traceback."""
    model, group = _group_with([_rows(N // 2)])
    group.join(N // 2)
    cause = ("Graph execution error:\n\nDetected at node CollectiveReduceV2 defined at (most recent "
             "call last):\n  File \"train.py\", line 39, in <module>\n\nCollective ops is aborted "
             "by: Error reported from /job:worker/task:1: The following tasks are unhealthy (stopped "
             "sending heartbeats):\n/job:worker/replica:0/task:1\nThe tasks have crashed.\n"
             "\t [[{{node CollectiveReduceV2}}]] [Op:__inference_multi_step_on_iterator_1346]")
    message = str(group.failure(RuntimeError(cause), None))
    assert ("RuntimeError: Graph execution error: Collective ops is aborted by: Error reported from "
            "/job:worker/task:1: The following tasks are unhealthy (stopped sending heartbeats): "
            "/job:worker/replica:0/task:1 The tasks have crashed. [[{{node CollectiveReduceV2}}]]"
            ) in message, message
    assert "train.py" not in message
    assert len(str(group.failure(RuntimeError("x" * 10_000), None))) < 2000


def test_diverging_ledgers_stop_training():
    from kdp.training.processes import DistributedTrainingError

    _, group = _group_with([_rows(N // 2)])
    group.join(N // 2)
    group.allgather = lambda array: np.stack([array, array + 1])  # process 1's digest differs
    with pytest.raises(DistributedTrainingError, match="ledgers or budgets differ"):
        group.verify()
    with pytest.raises(DistributedTrainingError, match="ledgers or budgets differ"):
        group.agree_rows(10)
    group.allgather = lambda array: np.stack([array, array])
    group.verify()  # the control: identical digests pass
    assert group.agree_rows(10) == 10


def test_releases_on_several_processes_outside_fit_are_refused(monkeypatch):
    import kdp.distribute
    from kdp.training.gate import PrivacyGateError

    model = build(seed=1)
    x, y = data()
    model.train_on_batch(x[:8], y[:8])  # one process: allowed, recorded
    before = model.privacy_ledger.to_json()
    monkeypatch.setattr(kdp.distribute, "process_count", lambda model=None: 2)
    with pytest.raises(ValueError, match="train_on_batch is not supported on several processes"):
        model.train_on_batch(x[:8], y[:8])
    with pytest.raises(PrivacyGateError, match="several processes"):
        with model.privacy_gate.spend({"kind": "quantile", "noise_multiplier": 1.0, "sampling_rate": 0.1}):
            pass
    assert model.privacy_ledger.to_json() == before


def _readme_script():
    """The script of the docs' "Training on several machines" (docs/guide/multi-process.md)."""
    page = Path(__file__).resolve().parent.parent / "docs" / "guide" / "multi-process.md"
    section = page.read_text().split("## Training on several machines", 1)[1]
    script = section.split("```python\n", 1)[1].split("```", 1)[0]
    assert script.startswith("# train.py")
    return script


def test_readme_script_refuses_a_missing_or_wrong_rank(monkeypatch):
    """README's script, run in this process: without KDP_RANK (and on TensorFlow
    with a rank other than TF_CONFIG's task index) it stops before joining."""
    import keras

    def must_not_start(*args, **kwargs):
        raise AssertionError("the script went on to start a multi-process run")

    monkeypatch.setattr(keras.distribution, "initialize", must_not_start)
    if ENGINE == "tensorflow":
        import tensorflow as tf

        monkeypatch.setattr(tf.distribute, "MultiWorkerMirroredStrategy", must_not_start)
    script = compile(_readme_script(), "train.py", "exec")
    monkeypatch.setenv("KDP_PROCESSES", "2")
    monkeypatch.delenv("KDP_RANK", raising=False)
    with pytest.raises(SystemExit, match="set KDP_RANK"):
        exec(script, {"__name__": "__main__"})
    if ENGINE == "tensorflow":
        monkeypatch.setenv("KDP_RANK", "1")
        monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": {"worker": ["127.0.0.1:1", "127.0.0.1:2"]},
                                                    "task": {"type": "worker", "index": 0}}))
        with pytest.raises(SystemExit, match="KDP_RANK=1 but TF_CONFIG's task index is 0"):
            exec(script, {"__name__": "__main__"})


def test_readme_script_on_two_processes(tmp_path, forks):
    """README, "Training on several machines": its script, launched as the
    README says, trains on 2 processes with the same ε, within the target."""
    from kdp.training.ledger import LedgerJournal

    (tmp_path / "train.py").write_text(_readme_script())
    _, codes = launch(forks, 2, "readme", tmp_path, script=tmp_path / "train.py")
    assert codes == [0, 0], _tail(tmp_path, 2)
    lines = [re.search(r"process (\d) of 2: epsilon ([0-9.]+)", (tmp_path / f"log-{r}.txt").read_text())
             for r in range(2)]
    assert all(lines), _tail(tmp_path, 2)
    epsilons = {float(m.group(2)) for m in lines}
    assert len(epsilons) == 1 and 0 < epsilons.pop() <= 3.0
    steps = LedgerJournal(tmp_path / "journal.json").read().training_steps()
    assert steps == 10 * math.ceil(1797 / 128)


if __name__ == "__main__" and "--worker" in sys.argv:
    _worker()
