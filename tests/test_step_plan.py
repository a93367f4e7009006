"""The step plan: the gate holds when a compiled step **runs**, not only when it is traced.

One test per way a step could escape its plan, on the backend the suite runs on
(CI runs it on TensorFlow and on JAX). Each reproduces the attack and measures
what ran against what the ledger recorded, or the noise a step added against
its plan; each has a negative control showing the check would catch the
broken behaviour.
"""

import keras
import numpy as np
import pytest

import kdp
from kdp import layers, losses
from kdp.model import DP_Sequential, DPParameters
from kdp.pipeline import DatasetMetadata
from kdp.training import BudgetExceededError, DataValidationError, PrivacyGateError

D, K, N, B = 8, 4, 64, 16
SCCE = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _data(n=N, seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, D)).astype("float32") * 0.3, rng.integers(0, K, n)


def _clipping_model(sigma=1.0, clip=1.0, lr=1.0, **compile_kwargs):
    """Per-example clipping on plain Dense layers: no projection, so with zero
    sample weights one SGD step (lr = 1) moves the weights by minus the noise."""
    model = DP_Sequential([keras.Input((D,)), keras.layers.Dense(32), keras.layers.Dense(K)],
                          dp_parameters=DPParameters(noise_multiplier=sigma, delta=1e-3,
                                                     clipping_norm=clip),
                          dataset_metadata=DatasetMetadata((D,), K, N, B))
    model.compile(optimizer=keras.optimizers.SGD(lr), loss=SCCE, **compile_kwargs)
    return model


def _clipless_model(**compile_kwargs):
    model = DP_Sequential(
        [layers.DP_BoundedInput((D,), 2.0), layers.DP_QuickSpectralDense(16), layers.DP_GroupSort(2),
         layers.DP_QuickSpectralDense(K)],
        dp_parameters=DPParameters("global", 2.0, 1e-3), dataset_metadata=DatasetMetadata((D,), K, N, B))
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss=losses.DP_TauCategoricalCrossentropy(2.0),
                  **compile_kwargs)
    return model


def _user_step(model):
    """The user's own compiled step (``jax.jit`` / ``tf.function`` of ``model.train_step``),
    returned as ``run(x, y, w)``: one execution, waited for."""
    if keras.backend.backend() == "jax":
        import jax

        step = jax.jit(model.train_step)

        def run(x, y, w):
            state = model._get_jax_state(trainable_variables=True, non_trainable_variables=True,
                                         optimizer_variables=True, metrics_variables=True)
            jax.block_until_ready(step(state, (x, y, w)))
        return run
    import tensorflow as tf

    step = tf.function(model.train_step)
    return lambda x, y, w: step((tf.constant(x), tf.constant(y), tf.constant(w)))


def _refused_at_run_time():
    """The error a refused execution raises: kdp's host check fails the engine's
    execution (JAX: JaxRuntimeError; TensorFlow: an OpError), naming PrivacyGateError."""
    return pytest.raises(Exception, match="PrivacyGateError")


# -- a compiled step re-used outside the gate is refused -------------------------------------------

def test_a_step_compiled_inside_the_gate_cannot_run_outside_it():
    x, y = _data()
    w = np.ones(B, "float32")
    model = _clipping_model()
    model.train_on_batch(x[:B], y[:B])
    run = _user_step(model)
    gate, mechanism = model.privacy_gate, model.step_plan().batch_mechanism
    with gate.spend(mechanism, 1):  # traced and run once inside the gate: allowed
        run(x[:B], y[:B], w)
        assert gate.executed_steps() == 1
    recorded = model.privacy_ledger.training_steps()
    assert recorded == 2
    ran_outside = 0
    for _ in range(5):  # the trace exists; unchecked, each call is an unrecorded release
        with _refused_at_run_time():
            run(x[:B], y[:B], w)
            ran_outside += 1
    assert ran_outside == 0 and model.privacy_ledger.training_steps() == recorded
    # Negative control: one recorded release admits one execution, not two.
    with gate.spend(mechanism, 1):
        run(x[:B], y[:B], w)
        with _refused_at_run_time():
            run(x[:B], y[:B], w)


# -- after σ changes, a stale trace cannot add the old noise ---------------------------------------

def _update_std(model, x, y, steps=16):
    """The std of the weight updates of ``steps`` noise-only steps (zero weights, lr 1).
    16 steps of the 420 weights: the estimate's sd is 0.9 % of the std (4 steps: 1.8 %,
    measured, which failed the tests' 5 % tolerance about once in 70 calls)."""
    zeros = np.zeros(B, "float32")
    moves = []
    for _ in range(steps):
        before = [np.array(v) for v in model.trainable_variables]
        model.train_on_batch(x[:B], y[:B], sample_weight=zeros)
        moves += [np.array(v) - b for v, b in zip(model.trainable_variables, before)]
    return float(np.std(np.concatenate([m.ravel() for m in moves])))


def test_changing_sigma_retraces_the_step_and_stale_traces_are_refused():
    x, y = _data()
    model = _clipping_model(sigma=1.0)
    old_plan = model.step_plan()
    assert _update_std(model, x, y) == pytest.approx(old_plan.noise_std(None, None), rel=0.05)
    stale = _user_step(model)  # an earlier trace of the σ = 1 step stays alive
    with model.privacy_gate.spend(old_plan.batch_mechanism, 1):
        stale(x[:B], y[:B], np.ones(B, "float32"))
    model.dp_parameters = model.dp_parameters.replace(noise_multiplier=50.0)
    plan = model.step_plan()
    assert plan != old_plan
    # Measured: the update std is the new plan's σ·C/b (a stale trace on JAX: 0.018× of it).
    measured = _update_std(model, x, y)
    assert measured == pytest.approx(plan.noise_std(None, None), rel=0.05)
    assert measured / old_plan.noise_std(None, None) > 40
    # Negative control: the stale trace, run in a gate open for the new plan, is refused.
    with model.privacy_gate.spend(plan.batch_mechanism, 1):
        with _refused_at_run_time():
            stale(x[:B], y[:B], np.ones(B, "float32"))
        assert model.privacy_gate.executed_steps() == 0
    with pytest.raises(PrivacyGateError, match="compiled for"):  # and refused before it runs
        with model.privacy_gate.spend(plan.batch_mechanism, 1, plan=old_plan):
            pass


# -- an interrupt never takes back steps that ran --------------------------------------------------

class _Interrupt(keras.callbacks.Callback):
    """Ctrl-C after ``after_calls`` calls of the train function returned."""

    def __init__(self, after_calls):
        super().__init__()
        self.after_calls, self.calls = after_calls, 0

    def on_train_batch_end(self, batch, logs=None):
        self.calls += 1
        if self.calls == self.after_calls:
            raise KeyboardInterrupt


@pytest.mark.parametrize("spe", [1, 4])
def test_an_interrupt_never_takes_back_steps_that_ran(spe):
    x, y = _data()
    model = _clipless_model(steps_per_execution=spe)
    with pytest.raises(KeyboardInterrupt):
        model.fit(x, y, epochs=5, verbose=0, callbacks=[_Interrupt(3)])
    ran = int(keras.ops.convert_to_numpy(model.optimizer.iterations))
    assert ran == 3 * spe  # 3 calls of the train function ran
    # every step that ran is recorded (taking the interrupted block back recorded
    # 4 of 16 at spe = 4, 5 of 13)
    assert model.privacy_ledger.training_steps() == ran
    # The model stays usable (an interrupt can leave JAX's variables purged).
    assert np.all(np.isfinite(model.predict(x[:4], verbose=0)))
    model.train_on_batch(x[:B], y[:B])
    assert model.privacy_ledger.training_steps() == ran + 1


@pytest.mark.parametrize("spe", [1, 4])
def test_ctrl_c_during_the_compiled_call_keeps_the_steps_that_ran(monkeypatch, spe):
    """SIGINT delivered while the compiled call runs: Python raises it right after
    the call returns, which must not be taken as "before the step"."""
    import signal

    from kdp.training import stepping

    original = stepping.gated

    def interrupted_on_third_call(model, function, plan):
        calls = []

        def function_then_ctrl_c(*args, **kwargs):
            result = function(*args, **kwargs)
            calls.append(1)
            if len(calls) == 3:
                signal.raise_signal(signal.SIGINT)  # Ctrl-C, as the call returns
            return result
        return original(model, function_then_ctrl_c, plan)

    monkeypatch.setattr(stepping, "gated", interrupted_on_third_call)
    # Ctrl-C as a terminal delivers it: Python's own handler, SIGINT not blocked. The
    # interrupt was once lost under CI (DID NOT RAISE, both spe; not reproducible), so
    # both are set here and reported if the interrupt is lost.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    x, y = _data()
    model = _clipless_model(steps_per_execution=spe)
    try:
        model.fit(x, y, epochs=5, verbose=0)
    except KeyboardInterrupt:
        pass
    else:
        blocked = signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, set())
        pytest.fail(f"Ctrl-C lost: {int(model.optimizer.iterations)} steps ran; SIGINT's "
                    f"handler {signal.getsignal(signal.SIGINT)!r} (before the test "
                    f"{previous!r}), blocked: {blocked}")
    finally:
        signal.signal(signal.SIGINT, previous)
    ran = int(keras.ops.convert_to_numpy(model.optimizer.iterations))
    assert ran == 3 * spe
    assert model.privacy_ledger.training_steps() == ran  # not 4 of 16 (TF, spe = 4)
    assert np.all(np.isfinite(model.predict(x[:4], verbose=0)))  # JAX's variables are not left purged


def test_a_failure_before_the_step_ran_is_refunded_and_after_it_is_not():
    x, y = _data()
    model = _clipless_model()
    model.train_on_batch(x[:B], y[:B])
    gate, mechanism = model.privacy_gate, model.step_plan().batch_mechanism
    with pytest.raises(ValueError):
        with gate.spend(mechanism, 3, refundable=True):
            raise ValueError("before any execution")
    assert model.privacy_ledger.training_steps() == 1  # refunded: no host check ran
    with pytest.raises(KeyboardInterrupt):  # the same, interrupted: no proof, charged
        with gate.spend(mechanism, 3, refundable=True):
            raise KeyboardInterrupt
    assert model.privacy_ledger.training_steps() == 4
    run = _user_step(model)
    with pytest.raises(ValueError):
        with gate.spend(mechanism, 3, refundable=True):
            run(x[:B], y[:B], np.ones(B, "float32"))
            raise ValueError("after one execution")
    assert model.privacy_ledger.training_steps() == 5  # the executed step is kept


# -- the same record twice in a batch is refused ---------------------------------------------------

def test_a_batch_with_the_same_record_twice_is_refused():
    x, y = _data()
    model = _clipping_model()
    model.train_on_batch(x[:B], y[:B])
    before = [np.array(v) for v in model.trainable_variables]
    idx = np.r_[np.arange(B - 1), 3]  # record 3 twice
    with pytest.raises(DataValidationError, match="group privacy"):
        model.train_on_batch(x[idx], y[idx])
    assert model.privacy_ledger.training_steps() == 1
    assert all(np.array_equal(b, np.array(v)) for b, v in zip(before, model.trainable_variables))
    # Negative controls: distinct records, or a repeat of weight 0 (padding), are trained.
    model.train_on_batch(x[B:2 * B], y[B:2 * B])
    weights = np.ones(B, "float32")
    weights[-1] = 0.0
    model.train_on_batch(x[idx], y[idx], sample_weight=weights)
    assert model.privacy_ledger.training_steps() == 3


def test_a_repeated_record_doubles_its_gradient():
    """What the refusal prevents, measured: a record present twice moves the clipped
    sum by 2·C, twice the sensitivity a step is accounted for."""
    from kdp import clipping

    x, y = _data()
    model = _clipping_model(clip=0.05)
    model(x[:1])
    one = clipping.clipped_gradient_sum(model, x[:1], y[:1], np.ones(1, "float32"))
    two = clipping.clipped_gradient_sum(model, x[[0, 0]], y[[0, 0]], np.ones(2, "float32"))
    norm = lambda g: np.sqrt(sum(float(np.sum(np.square(v))) for v in g.values()))  # noqa: E731
    assert norm(one) == pytest.approx(0.05, rel=1e-3)
    assert norm(two) / norm(one) == pytest.approx(2.0, rel=1e-4)


# -- refusals touch nothing ------------------------------------------------------------------------

def test_a_spent_accountant_budget_refuses_fit_before_projecting_weights():
    x, y = _data()
    model = _clipless_model()
    model.fit(x, y, epochs=1, verbose=0)
    weights = [w * 3.0 for w in model.get_weights()]  # kernels no longer 1-Lipschitz
    model.set_weights(weights)
    steps = model.privacy_ledger.training_steps()
    with pytest.raises(BudgetExceededError):
        model.fit(x, y, epochs=1, verbose=0, callbacks=[kdp.DP_Accountant(epsilon_max=1e-3)])
    # untouched (projecting them before the refusal moves them by 0.04)
    assert all(np.array_equal(a, b) for a, b in zip(weights, model.get_weights()))
    assert model.privacy_ledger.training_steps() == steps
    # Negative control: an allowed fit projects them first.
    model.fit(x, y, epochs=1, verbose=0)
    assert not all(np.allclose(a, b) for a, b in zip(weights, model.get_weights()))


def test_a_shuffled_dataset_batch_above_b_raises_kdps_own_error():
    import tensorflow as tf

    x, y = _data()
    model = DP_Sequential(
        [layers.DP_BoundedInput((D,), 2.0), layers.DP_QuickSpectralDense(K)],
        dp_parameters=DPParameters("global", 2.0, 1e-3, sampling="shuffle"),
        dataset_metadata=DatasetMetadata((D,), K, N, B))
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss=losses.DP_TauCategoricalCrossentropy(2.0))
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(2 * B)
    with pytest.raises(DataValidationError, match="rows"):  # not TensorFlow's InvalidArgumentError
        model.fit(data, epochs=1, verbose=0)
    assert model.privacy_ledger.training_steps() == 0
    model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(B), epochs=1, verbose=0)
    assert model.privacy_ledger.training_steps() == N // B
