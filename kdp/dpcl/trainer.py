"""DPCL training: per-view gradients clipped to C, noisy connection points, noisy sum.

One step (Li et al. §3.1–3.3), records = positive
pairs ``(x_k, x'_k)`` (two views each):

1. a batch of ``B`` records sampled **without replacement, fresh every step**
   (the paper's sampling; replace-one adjacency, dp-accounting's
   ``SampledWithoutReplacementDpEvent`` under ``REPLACE_ONE``);
2. ``Z`` = unit-normalised encoder outputs of the ``2B`` views; the mode's
   connection points are released (`kdp.dpcl.objectives.Spec.release`);
3. per-view gradients ``g_i = J_iᵀ ∂L/∂z_i`` (``J_i`` from
   `kdp.contrastive._backend.per_example_jacobians`), each clipped to ``C``;
4. ``G̃ = (Σ_i clip_C(g_i) + 𝒩(0, (Δ_g σ_g)²)) / B`` to the optimizer.

Every step runs inside the trainer's privacy gate (``privacy_gate``, a
`kdp.training.PrivacyGate` under replace-one adjacency), which checks
``epsilon_max`` and records the step in ``privacy_ledger`` *before* it runs, as
the sound joint `kdp.dpcl.accounting.step_event` of all its Gaussians;
`privacy_spent` composes the ledger. ``composition="separate"`` (the paper's
accounting, which **under-counts**) only changes the σ calibration and
`composition_epsilon`.
Mode ``"as-published"`` relies on the paper's unproven ``Δ_g = 4C``
(`kdp.dpcl.objectives`): its ε is **not** a proven guarantee, and the trainer
warns. Noise and batches are drawn from 64 bits of OS entropy
(`kdp.training.seeds`) unless ``reproducible=True`` with an explicit ``seed``.
Poisson sampling is not implemented here.
"""

import math
import warnings

import keras
import numpy as np
from keras import ops

from kdp.autodiff import compile_function
from kdp.contrastive import _backend
from kdp.contrastive.gradients import check_encoder
from kdp.dpcl import accounting as A
from kdp.dpcl.mechanisms import unit_rows
from kdp.dpcl.objectives import Spec, gradient_sensitivity
from kdp.privacy import REPLACE_ONE
from kdp.training import seeds
from kdp.training.gate import PrivacyGate
from kdp.training.ledger import event_mechanism

AS_PUBLISHED_WARNING = (
    "DPCL mode 'as-published' uses the paper's gradient sensitivity 4C, which relies on "
    "an unproven claim (Li et al. 2022 §3.2.2): the backward pass still uses every view's raw "
    "embedding, so replacing one record can change every per-view gradient. The reported "
    "epsilon is NOT a proven guarantee; use mode='rigorous' (or 'full')."
)


class DPCLTrainer:
    """DP-SimCLR / DP-Barlow-Twins with per-view clipping (Li et al. 2022).

    Args:
        encoder: a built Keras model ``(n, ...) -> (n, d)``, per-example in inference
            (checked: `kdp.contrastive.check_encoder`).
        objective: ``"simclr"`` or ``"barlow-twins"``.
        mode: ``"rigorous"`` (proven), ``"as-published"`` (the paper's unproven 4C),
            ``"full"`` (the paper's original DPSGD, ``Δ_g = 4|B|C``).
        batch_size: ``B`` records per step (fixed).
        clip_norm: ``C``, per-view clip norm.
        noise_multiplier: ``σ_g`` (gradient); ``connection_noise_multiplier``: σ of every
            connection-point release (default: ``σ_g``, the paper's equal split for SimCLR).
        target_epsilon: calibrate one common σ (both above equal) for `fit`'s steps instead.
        composition: ``"joint"`` (sound) or ``"separate"`` (the paper's accounting,
            used to calibrate σ; the ledger always holds the joint event).
        epsilon_max: a budget (replace-one RDP) over every step of this trainer:
            `fit` refuses to start if its steps would exceed it.
        reproducible, seed: fix the sampling and noise seeds (tests only; both
            are needed). By default both come from 64 bits of OS entropy.
        **spec_kwargs: `kdp.dpcl.objectives.Spec` options (temperature, lambda_offdiag, ...).
    """

    def __init__(self, encoder, objective="simclr", mode="rigorous", batch_size=64, clip_norm=1.0,
                 noise_multiplier=None, connection_noise_multiplier=None, target_epsilon=None,
                 delta=1e-5, optimizer=None, composition="joint", reproducible=False, seed=None,
                 jit_compile=True, epsilon_max=None, **spec_kwargs):
        check_encoder(encoder)
        seeds.check_seed(reproducible, seed)
        if noise_multiplier is None and target_epsilon is None:
            raise ValueError("give noise_multiplier= or target_epsilon=")
        if not clip_norm > 0 or not math.isfinite(clip_norm):
            raise ValueError(f"clip_norm must be a finite number > 0, got {clip_norm}")
        if composition not in A.COMPOSITIONS:
            raise ValueError(f"composition must be one of {A.COMPOSITIONS}, got {composition!r}")
        if mode == "as-published":
            warnings.warn(AS_PUBLISHED_WARNING, stacklevel=2)
        self.encoder, self.objective, self.mode = encoder, objective, mode
        self.batch_size, self.clip_norm, self.delta = int(batch_size), float(clip_norm), float(delta)
        self.noise_multiplier = noise_multiplier
        self.connection_noise_multiplier = connection_noise_multiplier
        self.target_epsilon, self.composition = target_epsilon, composition
        self.dim = int(encoder.output_shape[-1])
        self._spec_kwargs = spec_kwargs
        self.spec = None
        self.optimizer = optimizer or keras.optimizers.SGD(0.1, momentum=0.9)
        self.reproducible = bool(reproducible)
        self.seed = int(seed) if reproducible else None
        self._noise_seed = seeds.seed_generator(self.reproducible, self.seed)
        self.privacy_gate = PrivacyGate(self.delta, epsilon_max=epsilon_max,
                                        name=f"DPCLTrainer({objective}, {mode})",
                                        neighboring=REPLACE_ONE)  # sampling without replacement
        self.steps_taken, self.dataset_size = 0, None
        if noise_multiplier is not None:
            self._build_spec()
        wrap = compile_function if jit_compile else (lambda f: f)
        self._release_fn = wrap(self._release)
        self._clipped_fn = wrap(self._clipped_sum)
        self._apply = _backend.compiled_apply(self.optimizer, jit_compile)

    @property
    def privacy_ledger(self):
        """The `PrivacyLedger` of every release made by this trainer."""
        return self.privacy_gate.ledger

    def _build_spec(self):
        sigma_c = self.connection_noise_multiplier or self.noise_multiplier
        self.connection_noise_multiplier = sigma_c
        self.spec = Spec(self.objective, self.mode, self.batch_size, self.dim, sigma_c,
                         **self._spec_kwargs)

    # -- sensitivities and accounting ----------------------------------------------------------
    def gradient_sensitivity(self):
        """``Δ_g``: 4C (rigorous; as-published *claimed*), 4|B|C (full); replace-one."""
        return gradient_sensitivity(self.mode, self.clip_norm, 2 * self.batch_size)

    def noise_multipliers(self, sigma_g=None, sigma_c=None):
        """σ of every Gaussian of one step: the gradient's, then each connection point's."""
        sigma_g = self.noise_multiplier if sigma_g is None else sigma_g
        sigma_c = self.connection_noise_multiplier if sigma_c is None else sigma_c
        spec = self.spec or Spec(self.objective, self.mode, self.batch_size, self.dim, 1.0,
                                 **self._spec_kwargs)
        return [sigma_g] + [sigma_c] * len(spec.releases())

    def step_event(self, sigma_g=None, sigma_c=None, composition=None):
        """The `DpEvent` of one step (``composition``: default the trainer's)."""
        return A.step_event(self.noise_multipliers(sigma_g, sigma_c), self.dataset_size,
                            self.batch_size, "without-replacement",
                            composition or self.composition)

    def step_mechanism(self):
        """The ledger key of one step: the joint (sound) `step_event`."""
        return event_mechanism(self.step_event(composition="joint"))

    def privacy_spent(self, accountant="rdp"):
        """``(ε, δ)`` of every step in the ledger (joint events, sampling without
        replacement, replace-one adjacency, RDP). For ``"as-published"`` it rests
        on the unproven 4C (see `AS_PUBLISHED_WARNING`)."""
        return self.privacy_gate.privacy_spent(accountant)

    def composition_epsilon(self, steps=None):
        """``(ε, δ)`` after ``steps`` (default: the steps taken) with the trainer's
        ``composition``: ``"separate"`` reproduces the paper's accounting, which
        under-counts (a report, not a guarantee)."""
        steps = self.steps_taken if steps is None else steps
        if steps == 0:
            return 0.0, self.delta
        return A.epsilon(self.step_event(), steps, self.delta)[0], self.delta

    # -- the pure pieces ---------------------------------------------------------------------
    def _embed(self, params, others, x):
        out, _ = self.encoder.stateless_call(params, others, x, training=False)
        return unit_rows(out)

    def _release(self, params, others, views, noise):
        return self.spec.release(self._embed(params, others, views), noise)

    def _per_view(self, params, others, views, released):
        """Unclipped per-view gradients, a list of ``(2B, *shape)``, and the loss."""
        Z = self._embed(params, others, views)
        (cot,) = _backend.grad(lambda zs: self.spec.loss(zs[0], released), [Z])
        jac = _backend.per_example_jacobians(lambda p, xb: self._embed(p, others, xb), params,
                                             views)
        grads = [ops.einsum("nd...,nd->n...", j, cot) for j in jac]
        return grads, self.spec.loss(Z, released)

    def _clipped_sum(self, params, others, views, released):
        grads, value = self._per_view(params, others, views, released)
        n = views.shape[0]
        sq = sum(ops.sum(ops.reshape(ops.square(g), (n, -1)), axis=1) for g in grads)
        norms = ops.sqrt(sq)
        scale = ops.minimum(1.0, self.clip_norm / ops.maximum(norms, 1e-30))
        summed = [ops.einsum("n...,n->...", g, scale) for g in grads]
        return summed, value, norms

    # -- public API for tests and audits --------------------------------------------------------
    def views(self, x, xp):
        """The ``2B`` views of a batch of records: anchors, then positives."""
        return ops.convert_to_tensor(np.concatenate([np.asarray(x, "float32"),
                                                     np.asarray(xp, "float32")]))

    def draw_noise(self):
        """Unit-normal draws for the connection points of one step."""
        return {k: keras.random.normal(s, seed=self._noise_seed)
                for k, s in self.spec.noise_shapes().items()}

    def release(self, x, xp, noise=None):
        """The connection points released on one batch chosen by the caller.

        With ``noise=None`` the noise is drawn here and the release is recorded
        (one Gaussian per connection point, without amplification). A given
        ``noise`` (unit normals, e.g. the same in two neighbouring worlds) makes
        it an audit tool: the caller knows the noise, nothing is recorded.
        """
        params, others = self._variables()
        if noise is not None:
            return self._release_fn(params, others, self.views(x, xp), noise)
        sigmas = self.noise_multipliers()[1:]
        if not sigmas:
            return {}
        with self.privacy_gate.spend(event_mechanism(A._inner(sigmas))):
            return self._release_fn(params, others, self.views(x, xp), self.draw_noise())

    def per_view_gradients(self, x, xp, released):
        """Flattened per-view gradients ``(2B, p)`` (NumPy) with the released values fixed."""
        params, others = self._variables()
        grads, _ = self._per_view(params, others, self.views(x, xp), released)
        n = 2 * len(x)
        return np.concatenate([np.asarray(g, "float64").reshape(n, -1) for g in grads], axis=1)

    def clipped_sum(self, x, xp, released):
        """``Σ_i clip_C(g_i)`` flattened (NumPy), before noise."""
        params, others = self._variables()
        summed, _, _ = self._clipped_fn(params, others, self.views(x, xp), released)
        return np.concatenate([np.ravel(np.asarray(g, "float64")) for g in summed])

    def _variables(self):
        return ([v.value for v in self.encoder.trainable_variables],
                [v.value for v in self.encoder.non_trainable_variables])

    # -- training -------------------------------------------------------------------------------
    def _calibrate(self, steps):
        sigma = A.calibrate(self.target_epsilon, steps, self.delta,
                            lambda s: self.step_event(s, s), lower=0.05, upper=200.0)
        self.noise_multiplier = self.connection_noise_multiplier = sigma
        self._build_spec()

    def fit(self, x, xp, epochs=1, steps_per_epoch=None, verbose=0):
        """Train on records ``(x[k], xp[k])``; returns ``{"loss", "true_loss", "epsilon"}``
        per epoch (losses are monitoring values, not private)."""
        x, xp = np.asarray(x, "float32"), np.asarray(xp, "float32")
        n = len(x)
        if x.shape != xp.shape:
            raise ValueError(f"anchors {x.shape} and positives {xp.shape} differ in shape")
        if not (np.all(np.isfinite(x)) and np.all(np.isfinite(xp))):
            raise ValueError("the training pairs contain NaN or infinite values")
        if not 2 <= self.batch_size <= n:
            raise ValueError(f"batch_size must be in [2, N={n}], got {self.batch_size}")
        if self.delta >= 1.0 / n:
            raise ValueError(f"delta={self.delta} >= 1/N = {1.0 / n:.3g}: lower it")
        if self.dataset_size not in (None, n):
            raise ValueError(f"this trainer was started on {self.dataset_size} records, got {n}")
        self.dataset_size = n
        steps = steps_per_epoch or max(1, n // self.batch_size)
        if self.spec is None:
            self._calibrate(epochs * steps)
        mechanism = self.step_mechanism()
        self.privacy_gate.begin_run(mechanism, epochs * steps, self._noise_seed, self.reproducible)
        rng = seeds.numpy_generator(self.reproducible, self.seed, 1)
        variables = self.encoder.trainable_variables
        history = {"loss": [], "true_loss": [], "epsilon": []}
        std = self.gradient_sensitivity() * self.noise_multiplier
        for epoch in range(epochs):
            losses, true = [], []
            for _ in range(steps):
                with self.privacy_gate.spend(mechanism):  # recorded before the step runs
                    idx = rng.choice(n, self.batch_size, replace=False)  # fresh each step
                    views = self.views(x[idx], xp[idx])
                    params, others = self._variables()
                    released = self._release_fn(params, others, views, self.draw_noise())
                    summed, value, _ = self._clipped_fn(params, others, views, released)
                    grads = [(g + keras.random.normal(ops.shape(g), stddev=std,
                                                      seed=self._noise_seed)) / self.batch_size
                             for g in summed]
                    self._apply(grads, variables)
                self.steps_taken += 1
                losses.append(float(value))
                true.append(float(self.spec.true_loss(self._embed(params, others, views))))
            history["loss"].append(float(np.mean(losses)))
            history["true_loss"].append(float(np.mean(true)))
            history["epsilon"].append(self.privacy_spent()[0])
            if verbose:
                print(f"epoch {epoch + 1}: loss {history['loss'][-1]:.4f} (true "
                      f"{history['true_loss'][-1]:.4f}), epsilon {history['epsilon'][-1]:.3f}")
        return history

    def report(self):
        return {
            "objective": self.objective, "mode": self.mode, "clip_norm": self.clip_norm,
            "batch_size": self.batch_size, "dataset_size": self.dataset_size,
            "noise_multiplier": self.noise_multiplier,
            "connection_noise_multiplier": self.connection_noise_multiplier,
            "gradient_sensitivity": self.gradient_sensitivity(),
            "releases": self.spec.releases() if self.spec else None,
            "composition": self.composition, "steps": self.steps_taken, "delta": self.delta,
            "accountant": "rdp, sampling without replacement, replace-one adjacency"
                          + (" (ASSUMES the paper's unproven 4C)" if self.mode == "as-published"
                             else ""),
        }


__all__ = ["AS_PUBLISHED_WARNING", "DPCLTrainer"]
