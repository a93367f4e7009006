"""A DP model's compiled train function, behind the privacy gate.

* `make_train_function`: Keras' compiled step, rebuilt whenever the model's
  `StepPlan` changed. Each build binds a fresh ``train_step`` function to the
  model, so no engine cache (JAX keys its traces on the function object and the
  shapes, not on σ) can hand a step traced for an older plan to a newer one.
* `gated`: every call of the compiled function spends, through
  `PrivacyGate.spend`, the releases of the call (fit's mechanism per step, or
  one step without amplification) for the plan it was compiled for; the step's
  own host check (`PrivacyGate.consume`) then admits each execution.
* refunds only on proof: the releases whose host check did not run are taken
  back when the call raises an `Exception`; a `KeyboardInterrupt` or
  `SystemExit` takes nothing back, and a Ctrl-C during the call is raised only
  once the call's new state is stored. On JAX the model's variables are put back
  when the failed call did not consume them (Keras would leave them purged).
* `train_on_batch`: a user's batch, validated and refused if it holds the same
  record twice (`check_distinct_records`), then one gated step.
"""

import contextlib
import functools
import re
import signal
import threading

import keras

from kdp import distribute
from kdp.layers.clip import DP_ClipGradient
from kdp.training.gate import PrivacyGateError
from kdp.training.validation import DataValidationError, validate_batch

#: kdp's exceptions raised inside a compiled step or a tf.data pipeline, by name.
_KDP_ERRORS = {"PrivacyGateError": PrivacyGateError, "DataValidationError": DataValidationError}
_KDP_ERROR_TEXT = re.compile(r"\b(PrivacyGateError|DataValidationError): (.+)")
_JAX_STATE = ("trainable_variables", "non_trainable_variables", "optimizer_variables",
              "metrics_variables")


def make_train_function(model, keras_make, force=False):
    """Keras' compiled step for ``model``'s current `StepPlan`, behind the gate."""
    plan = model.step_plan()
    if model.train_function is not None and not force and plan == model._compiled_plan:
        return model.train_function
    model._check_dp_once()
    set_cotangent_scale(model)
    # TensorFlow replicas each run the step's host check once per step.
    model.privacy_gate.executions_per_step = (
        distribute.local_replicas(model) if keras.backend.backend() == "tensorflow" else 1)
    object.__setattr__(model, "train_step", functools.partial(type(model).train_step, model))
    keras_make(force=True)
    object.__setattr__(model, "_compiled_plan", plan)
    model.train_function = gated(model, model.train_function, plan)
    return model.train_function


def compile_options(kwargs):
    """``compile``'s keyword arguments for a DP model: on TensorFlow the step runs
    without XLA (its host check, `kdp.autodiff.host_check`, is a `tf.numpy_function`),
    so ``jit_compile=True`` is refused and ``"auto"`` means ``False``."""
    if keras.backend.backend() != "tensorflow":
        return kwargs
    if kwargs.get("jit_compile") is True:
        raise ValueError("jit_compile=True is not supported by DP models on TensorFlow: the "
                         "step's privacy check runs on the host (the JAX backend compiles it)")
    return {**kwargs, "jit_compile": False}


def build_compile_loss(model, y, y_pred):
    """Build Keras' own loss object of ``model`` if it is not built. A DP model never
    uses it (`kdp.training.objective` computes the loss), but left unbuilt it makes
    every ``fit`` and ``evaluate`` trace the model again to build it (Keras'
    symbolic build, which calls ``compute_loss`` first)."""
    if model._compile_loss is not None and not model._compile_loss.built:
        model._compile_loss.build(y, y_pred)


def set_cotangent_scale(model):
    """Scale the cotangents `DP_ClipGradient` layers clip by ``1/b`` (the objective
    divides the summed loss by the expected batch size)."""
    if model.dataset_metadata is None:
        return
    for layer in model._flatten_layers(include_self=False):
        if isinstance(layer, DP_ClipGradient):
            layer.cotangent_scale = 1.0 / model.dataset_metadata.batch_size


def gated(model, function, plan):
    """``function`` (Keras' train function compiled for ``plan``) behind the gate.

    A Ctrl-C (SIGINT) that arrives during the call is deferred until the call's
    new state is stored, then raised: the steps that ran are kept, in the ledger
    and in the model (JAX would otherwise lose the state it donated)."""
    def call(*args, **kwargs):
        mechanism, count = model._release_per_call or (plan.batch_mechanism, plan.block)
        with model.privacy_gate.spend(mechanism, count, refundable=True, plan=plan):
            with _interrupts_deferred() as interrupted:
                try:
                    result = function(*args, **kwargs)
                except BaseException as error:
                    _restore_jax_state(model, args)
                    translated = kdp_error(error)
                    if translated is not error:
                        raise translated from error
                    raise
                _keep_jax_state(model, result)
            if interrupted:
                raise KeyboardInterrupt  # no refund: the steps ran
            return result

    return call


@contextlib.contextmanager
def _interrupts_deferred():
    """Record SIGINT instead of raising it inside the block (main thread, Python
    handler only); yields the list of signals received."""
    received = []
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler):
        yield received
        return
    signal.signal(signal.SIGINT, lambda signum, frame: received.append(signum))
    try:
        yield received
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def kdp_error(error):
    """kdp's own exception for an engine error that carries one in its text
    (a refusal raised inside a compiled step or a tf.data pipeline), else ``error``."""
    if isinstance(error, tuple(_KDP_ERRORS.values())) or not isinstance(error, Exception):
        return error
    match = _KDP_ERROR_TEXT.search(str(error))
    if match is None:
        return error
    return _KDP_ERRORS[match.group(1)](match.group(2).strip())


def _keep_jax_state(model, result):
    """JAX: hold the new state at once, so an interrupt before Keras stores it loses nothing."""
    if keras.backend.backend() == "jax" and isinstance(result, tuple) and len(result) == 2:
        model._jax_state = dict(zip(_JAX_STATE, result[1]))


def _restore_jax_state(model, args):
    """JAX: after a failed call, give the model back the state it passed in when the
    call did not consume it (Keras purged the variables, or donated them)."""
    if keras.backend.backend() != "jax" or not args or not isinstance(args[0], (tuple, list)):
        return
    leaves = keras.tree.flatten(args[0])
    if any(getattr(a, "is_deleted", lambda: False)() for a in leaves):
        return  # consumed by an execution that failed: nothing to give back
    model._jax_state = dict(zip(_JAX_STATE, args[0]))
    model._jax_state_synced = False
    model.jax_state_sync()


def finish_releases(model):
    """After a training call: wait for the steps still running (JAX dispatches
    asynchronously; their host checks spend credits), then revoke every unspent
    credit, so no compiled step can execute later on a release of this call."""
    if keras.backend.backend() == "jax":
        import jax

        values = [getattr(v, "_value", None) for v in model.variables]
        try:
            jax.block_until_ready([a for a in values if a is not None and not a.is_deleted()])
        except Exception:  # noqa: BLE001 (a failed step already raised to the caller)
            pass
    model.privacy_gate.revoke_credits()


def train_on_batch(model, keras_train_on_batch, x, y, sample_weight, class_weight, return_dict):
    """`DP_Model.train_on_batch` (see its docstring)."""
    if distribute.process_count(model) > 1:
        raise ValueError(f"{model.name}: train_on_batch is not supported on several processes "
                         "(each would account its own batch): call fit on every process")
    x, y, weights = validate_batch(model, x, y, sample_weight, class_weight, distinct=True)
    plan = model.step_plan()
    model.privacy_gate.check(plan.batch_mechanism, 1)  # refused: nothing changes, not even weights
    model.project_weights()
    object.__setattr__(model, "_release_per_call", (plan.batch_mechanism, 1))  # untracked by Keras
    try:
        logs = distribute.sharded_train_on_batch(model, x, y, weights, return_dict)
        if logs is not None:
            return logs
        return keras_train_on_batch(x, y, sample_weight=weights, return_dict=return_dict)
    finally:
        object.__setattr__(model, "_release_per_call", None)  # untracked by Keras
        finish_releases(model)
