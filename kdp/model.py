"""DP models: Clipless (or per-example clipping) DP-SGD inside the ordinary Keras `fit`.

`DP_Model` and `DP_Sequential` are thin Keras overrides over `kdp.training`:

* `step_plan` (`kdp.training.plan`): the frozen plan of a noisy step (σ, σ_eff,
  b, q, sampling, δ, adjacency), the only source of the noise a step adds and
  of the release the ledger records;
* `compute_loss` is the noisy objective (`kdp.training.objective`);
* `make_train_function` and `train_on_batch` (`kdp.training.stepping`): the
  compiled step, rebuilt whenever the plan changes, runs behind the privacy
  gate (`kdp.training.gate`), which records every call before it runs and
  admits each execution of the step at run time;
* `fit` (`kdp.training.session`): validation, sampling, the gate and Keras' loop.
"""

import keras

from kdp import distribute
from kdp.bounds import compute_gradient_bounds  # noqa: F401 (public name)
from kdp.layers.base import serializable
from kdp.layers.constraints import project
from kdp.losses.probabilities import output_probabilities
from kdp.metadata import DatasetMetadata
from kdp.privacy import ADD_OR_REMOVE_ONE
from kdp.training import budget, checks, objective, saving, seeds, session, statement, stepping
from kdp.training.config import NOISIFY_STRATEGIES, DPParameters  # noqa: F401 (public names)
from kdp.training.gate import PrivacyGate
from kdp.training.ledger import PrivacyLedger
from kdp.training.plan import step_plan


def _as(cls, value):
    return cls.from_config(value) if isinstance(value, dict) else value


class DPModelMixin:
    """DP training shared by `DP_Model` and `DP_Sequential`."""

    #: the neighbouring relation the model's steps are accounted under
    neighboring = ADD_OR_REMOVE_ONE
    _release_per_call = None  # (mechanism, count) a call of the train function spends
    _compiled_plan = None  # the StepPlan the current train function was compiled for

    def _init_dp(self, dp_parameters, dataset_metadata, ledger=None):
        self.privacy_gate = PrivacyGate(1e-5, _as(PrivacyLedger, ledger) or PrivacyLedger(),
                                        name=self.name, neighboring=self.neighboring)
        self.dp_parameters = dp_parameters
        self.dataset_metadata = _as(DatasetMetadata, dataset_metadata)
        params = self.dp_parameters
        if params is not None:
            self._noise_seed = seeds.seed_generator(params.reproducible, params.seed)

    @property
    def dp_parameters(self):
        """The model's immutable `DPParameters` (assign a new one to change them)."""
        return self._dp_parameters

    @dp_parameters.setter
    def dp_parameters(self, params):
        self._dp_parameters = params = _as(DPParameters, params)
        if params is not None:  # the gate reports at this δ and enforces this budget
            self.privacy_gate.delta = params.delta
            self.privacy_gate.epsilon_max = params.epsilon_max

    @property
    def privacy_ledger(self):
        """The `PrivacyLedger` of every private release made with this model."""
        return self.privacy_gate.ledger

    @privacy_ledger.setter
    def privacy_ledger(self, ledger):
        self.privacy_gate.ledger = ledger

    def step_plan(self):
        """The frozen `StepPlan` of this model's noisy step (`kdp.training.plan`)."""
        return step_plan(self, self.neighboring)

    def _reseed_noise(self):
        """A fresh noise state from the OS entropy (unless ``reproducible``), at
        every `fit` and load: the state is never saved, and a restarted or
        resumed run must not replay (nor let anyone predict) noise."""
        if self.dp_parameters is not None and not self.dp_parameters.reproducible:
            seeds.reseed(self._noise_seed)

    # -- checks (kdp.training.checks) ---------------------------------------------------
    def check_dp(self):
        """Raise a clear error if training this model would not be DP as claimed;
        return the per-example gradient bounds (Clipless) (`kdp.training.checks`)."""
        return checks.check_dp(self)

    def check_delta(self):
        """Refuse ``δ ≥ 1/N`` (unless ``allow_large_delta``)."""
        checks.check_delta(self)

    def _check_dp_once(self):
        checks.check_dp_once(self)

    def project_weights(self):
        """Apply every variable's constraint (the certified projections of the
        Lipschitz layers): weights set by `set_weights`, `assign` or a loaded
        file satisfy the bounds before they are trained. Run before the first
        step of every `fit` and before every `train_on_batch`."""
        for v in self.trainable_variables:
            if v.constraint is not None:
                v.assign(project(v.constraint, v.value))

    # -- noise and accounting --------------------------------------------------------
    def noise_stds(self):
        """``{variable.path: std}`` of the Gaussian noise added to the batch gradient."""
        return objective.noise_stds(self)

    def effective_noise_multiplier(self):
        """``σ_eff``: the noise multiplier of the one Gaussian a step is equivalent to."""
        return self.step_plan().effective_noise_multiplier

    def privacy_spec(self):
        """The per-step mechanism of `fit` as a dict (`kdp.training.budget.privacy_spec`)."""
        return budget.privacy_spec(self)

    def predict_proba(self, x, batch_size=None, verbose=0):
        """Probabilities of ``x`` by the link of the model's loss (softmax(τ·z) for
        τ-cross-entropy, sigmoid(τ·z) per output for τ-binary cross-entropy;
        `kdp.losses.probabilities.output_probabilities`); costs no privacy."""
        return output_probabilities(self.loss, self.predict(x, batch_size=batch_size,
                                                            verbose=verbose))

    def make_private(self, target_epsilon, epochs, delta=None, accountant="tightest"):
        """Privacy in one call: set σ so that ``epochs`` epochs of `fit` reach at most
        ``target_epsilon`` (at ``delta``, default ``dp_parameters.delta``) for this
        model's own noise with ``accountant`` (PLD, or RDP), and enforce that target
        as its budget with it; return σ. See `kdp.training.budget.make_private`."""
        return budget.make_private(self, target_epsilon, epochs, delta, accountant)

    def privacy_statement(self, accountant=None):
        """A text for a model card (`kdp.training.statement.privacy_statement`),
        ε by ``accountant`` (``None``: the model's, that of its budget)."""
        return statement.privacy_statement(self, accountant)

    def privacy_spent(self, accountant=None):
        """``(ε, δ)`` spent so far by every release in the ledger, with
        ``accountant`` (``None``: the model's, that of its budget:
        `kdp.training.PrivacyGate.accountant_for`)."""
        return self.privacy_gate.privacy_spent(accountant)

    def merge_ledger(self, ledger):
        """Combine ``ledger`` into the model's (`PrivacyLedger.merge`): the same
        history seen twice counts once, independent trainings are composed."""
        self.privacy_gate.merge(ledger)

    # -- Keras overrides ------------------------------------------------------------------
    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        checks.require_dp_config(self)
        stepping.build_compile_loss(self, y, y_pred)
        return objective.objective(self, x, y, y_pred, sample_weight, training, self._noise_seed)

    def compile(self, *args, **kwargs):
        """Keras ``compile`` (on TensorFlow without XLA: `kdp.training.stepping.compile_options`)."""
        super().compile(*args, **stepping.compile_options(kwargs))
        stepping.set_cotangent_scale(self)

    def train_step(self, *args):
        """Keras' step (the objective is `compute_loss`; with clipping, its predictions
        from the per-example computation, `kdp.training.objective.pass_outputs`);
        its logs reshaped where Keras 3 could not reduce them over several TensorFlow workers."""
        with objective.pass_outputs(self):
            return distribute.logs_for_reduction(self, super().train_step(*args))

    def compute_loss_and_updates(self, *args, **kwargs):
        """JAX's stateless loss (Keras), its predictions `objective.step_predictions`."""
        loss, aux = super().compute_loss_and_updates(*args, **kwargs)
        return loss, objective.with_step_predictions(self, aux)

    def compute_metrics(self, x, y, y_pred, sample_weight=None):
        """Keras' metrics on `objective.step_predictions` (TensorFlow's step)."""
        return super().compute_metrics(x, y, objective.step_predictions(self, y_pred), sample_weight)

    def _maybe_symbolic_build(self, iterator=None, data_batch=None):
        iterator, data_batch = distribute.build_inputs(self, iterator, data_batch)
        return super()._maybe_symbolic_build(iterator=iterator, data_batch=data_batch)

    def make_train_function(self, force=False):
        """Keras' compiled step behind the privacy gate, rebuilt whenever the
        `StepPlan` changed (`kdp.training.stepping.make_train_function`)."""
        return stepping.make_train_function(self, super().make_train_function, force)

    def compile_from_config(self, config):
        """Recompile a model loaded by `keras.models.load_model` (Keras skips it for
        a custom `compile`), so a loaded model resumes with its optimizer state."""
        self.compile(**keras.saving.deserialize_keras_object(config))
        if getattr(self, "optimizer", None) is not None and self.built:
            self.optimizer.build(self.trainable_variables)

    def save_own_variables(self, store):
        """Keras' weights saving, plus the ledger and the budget's accountant
        (`kdp.training.saving`). The noise generator's state is never saved."""
        super().save_own_variables(store)
        saving.save_privacy(store, self.privacy_gate)

    def load_own_variables(self, store):
        """Keras' weights loading; the file's ledger is merged into the model's
        and its budget's accountant restored."""
        super().load_own_variables(saving.load_privacy(store, self.privacy_gate))
        self._reseed_noise()

    def fit(self, x=None, y=None, batch_size=None, epochs=1, callbacks=None,
            validation_split=0.0, sample_weight=None, class_weight=None,
            steps_per_epoch=None, **kwargs):
        """Keras ``fit`` with DP-SGD (`kdp.training.session`).

        Arrays ``x, y`` or a `kdp.RecordSource` (``N`` =
        ``dataset_metadata.nb_samples_train`` records) are sampled with Poisson sampling, or, with
        ``DPParameters(sampling="shuffle")``, cut into shuffled batches of exactly
        ``b`` records per pass. Datasets and generators are only accepted with
        ``sampling="shuffle"`` (batches of at most ``b`` records, each step
        accounted as one Gaussian release without amplification: kdp does not
        draw them); each of their batches passes the validator, which refuses
        a record held twice. ``sample_weight`` must lie in [0, 1]; a ``class_weight``
        above 1 is divided by its largest value (the sensitivity scaled by it,
        `kdp.training.validation.normalized_class_weight`).
        Other arguments are those of `keras.Model.fit`. A refused `fit` changes
        no weight and records nothing.

        The logs hold ``epsilon`` (after every step, when anything reads the step
        logs) and ``delta`` (each epoch). Their ``loss`` is the value of the private
        objective, ``Σ_i w_i ℓ_i / b`` per batch (``b`` the expected batch size):
        an unbiased estimate of the mean training loss, not the batch mean.

        On several processes (JAX after ``keras.distribution.initialize`` with a
        `keras.distribution.DataParallel`; TensorFlow under
        `MultiWorkerMirroredStrategy`), every process calls `fit` with its own
        disjoint shard (or `kdp.RecordSource` range) (see `kdp.training.processes`).
        """
        return session.fit_session(
            self, super().fit, x, y, batch_size, epochs, callbacks, validation_split,
            sample_weight, class_weight, steps_per_epoch, **kwargs)

    def train_on_batch(self, x, y=None, sample_weight=None, class_weight=None, return_dict=False):
        """Keras ``train_on_batch`` behind the gate: the batch is validated (and
        refused if it holds the same record twice), the weights projected, and the
        step recorded before it runs as one Gaussian mechanism **without**
        sampling amplification (kdp did not sample the batch; use `fit` for
        Poisson sampling). Refused on several processes (use `fit`)."""
        return stepping.train_on_batch(self, super().train_on_batch, x, y, sample_weight,
                                       class_weight, return_dict)

    def _dp_config(self):
        return {
            "dp_parameters": None if self.dp_parameters is None else self.dp_parameters.get_config(),
            "dataset_metadata": None if self.dataset_metadata is None else self.dataset_metadata.get_config(),
            "privacy_ledger": self.privacy_ledger.get_config(),
        }


@serializable
class DP_Model(DPModelMixin, keras.Model):
    """A functional Keras model trained with Clipless DP-SGD.

    Args:
        inputs, outputs: as for `keras.Model`; every layer must be a DP layer.
        dp_parameters: `DPParameters`.
        dataset_metadata: `DatasetMetadata`.
        privacy_ledger: the `PrivacyLedger` of a model trained before (restored
            by `keras.models.load_model`).
    """

    # ``*args`` makes this a "functional-like constructor" in Keras' sense: its
    # `get_config` is then the full functional graph (layers, inputs, outputs)
    # and `from_config` rebuilds the graph and passes the DP arguments back.
    def __init__(self, inputs, outputs=None, *args, dp_parameters=None, dataset_metadata=None,
                 privacy_ledger=None, **kwargs):
        if outputs is None or (isinstance(inputs, (list, tuple))
                               and any(isinstance(x, keras.layers.Layer) for x in inputs)):
            raise TypeError(
                "DP_Model(inputs, outputs, ...) takes a functional graph; lip-dp's "
                "DP_Model(dp_layers, ...) is kdp.DP_Sequential(dp_layers, dp_parameters=..., "
                "dataset_metadata=...)")
        if args:
            raise TypeError("DP_Model(inputs, outputs, dp_parameters=..., dataset_metadata=...): "
                            "pass the other arguments by keyword")
        super().__init__(inputs=inputs, outputs=outputs, **kwargs)
        self._init_dp(dp_parameters, dataset_metadata, privacy_ledger)

    def get_config(self):
        return {**super().get_config(), **self._dp_config()}


@serializable
class DP_Sequential(DPModelMixin, keras.Sequential):
    """A `keras.Sequential` of DP layers trained with Clipless DP-SGD.

    Args:
        layers: the DP layers, usually starting with `DP_BoundedInput(input_shape, upper_bound)`.
        dp_parameters: `DPParameters`.
        dataset_metadata: `DatasetMetadata`.
        debug: lip-dp's; only ``False`` (``kdp.compute_gradient_bounds(model)``
            gives the bounds).
    """

    def __init__(self, layers=None, dp_parameters=None, dataset_metadata=None,
                 privacy_ledger=None, debug=False, **kwargs):
        if debug:
            raise ValueError("DP_Sequential has no debug mode (lip-dp's debug=True): inspect the "
                             "per-example gradient bounds with kdp.compute_gradient_bounds(model)")
        super().__init__(layers=layers, **kwargs)
        self._init_dp(dp_parameters, dataset_metadata, privacy_ledger)

    def get_config(self):
        return {**super().get_config(), **self._dp_config()}

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        dp = {k: config.pop(k, None) for k in ("dp_parameters", "dataset_metadata", "privacy_ledger")}
        model = super().from_config(config, custom_objects=custom_objects)
        model._init_dp(dp["dp_parameters"], dp["dataset_metadata"], dp["privacy_ledger"])
        return model


__all__ = [
    "DPParameters", "DP_Model", "DP_Sequential", "DatasetMetadata", "compute_gradient_bounds",
]
