"""DP contrastive training on pair data: Logit-DP, naive and clipless strategies.

**Records and adjacency.** A record is one positive pair ``(x_i, x'_i)``;
neighbouring datasets differ by adding or removing one pair (Dwork and Roth 2014, §2.3).

**One step.** Every record is included independently with probability
``q = b/N`` (Poisson sampling, `kdp.pipeline.PoissonBatches`); the batch is
padded with zero rows to a static size (the padding capacity, or a multiple of
it, never truncated) and a mask removes the padding from every row *and*
column of the similarity matrix. The strategy computes a summed-loss gradient
``ḡ`` of sensitivity ``Δ``; the released gradient is
``(ḡ + 𝒩(0, σ²Δ² I)) / b`` with ``b`` the **expected** batch size (never the
realised one), fed to the optimizer; kernel constraints project the weights.

Strategies (``Δ`` for add/remove of one pair):

* ``"logit-dp"``: clip every per-pair similarity gradient to ``B = clip_norm``
  and recombine with the exact coefficients (`PairGradients.logit_dp_gradient`):
  ``Δ = loss.sensitivity(n_cal, B)``;
* ``"naive"``: clip the whole summed-loss gradient to ``B``: both ``ḡ(X)`` and
  ``ḡ(X°)`` lie in the ball of radius B, ``Δ = 2B``;
* ``"clipless"``: no clipping and no per-pair norm: every per-pair gradient is
  bounded by ``B_pair`` from the bound pass (`clipless_pair_bound`; needs an
  encoder of kdp DP layers), ``Δ = loss.sensitivity(n_cal, B_pair)``;
* ``"non-private"``: plain gradient, no noise (a baseline; recorded as a
  ``NonPrivateDpEvent``, so its ε is ∞).

**Which n calibrates the noise (``sensitivity_size``).** ``K_n`` of InfoNCE grows
with the size ``n`` of the larger of the two batches compared. The noise scale
must be one public number for every step: a scale that changes with the batch
(for example re-evaluated at the padded static size ``⌈n/C⌉·C``, which is a
function of the private ``n``) makes the two worlds' Gaussians differ in
variance, which no Gaussian accountant covers, and it releases ``⌈n/C⌉``.
Poisson batches are not truncated, so the padding capacity
``C = b + 6√b + 8`` is **not** a size no batch can exceed (a batch above it has
probability < 1e-9 but is possible). The sizes no batch can exceed are:

* ``"dataset"`` (default): ``n_cal = N + 1``: a Poisson batch of the larger
  neighbour (``N + 1`` pairs at most) cannot be larger; public because ``N`` is
  (it already sets ``q = b/N``);
* ``"supremum"``: ``n_cal = ∞``, ``sup_n K_n = (2/τ)(1 + e^{2c/τ})``, valid whatever
  the dataset size.

Both are valid for every realised batch. For τ ≥ 0.5 with cosine similarity they
are close to ``K_C`` (within 1.1× for τ = 1); at small τ, ``K_n ≈ 2n/τ`` and the
price of Poisson sampling without truncation is a noise of order ``N/b`` times
that of ``K_C``: use a larger τ (the paper's code uses τ = 0.2 and calibrates
at its fixed micro-batch size, which is only valid for fixed-size batches). The
cost vanishes with the logit range ``a = c/τ``: ``K_{N+1}/K_b`` is 1.09 at
``a = 1`` and 1.009 at ``a = 1/16`` (N = 716, b = 64), which is why the clipless
configuration of notebook 06 uses the dot product with a small radius
(``r = 0.25, τ = 1``; see `clipless_pair_bound`).

**Accounting.** The trainer owns a `kdp.training.PrivacyGate` (``privacy_gate``):
each step runs inside ``privacy_gate.spend``, which checks ``epsilon_max`` and
records it in ``privacy_ledger`` *before* it runs, as
``training_mechanism(σ, q, "poisson")`` (``PoissonSampledDpEvent(q,
GaussianDpEvent(σ))``, the same event as `DP_Model.fit`); `privacy_spent`
composes the ledger. The noise and the Poisson sampling are seeded from 64 bits
of OS entropy (`kdp.training.seeds`, fresh at every `fit`) unless
``reproducible=True`` with an explicit ``seed``. The loss values in the history
are computed from the private batch without noise: they are for monitoring and
are **not** covered by the guarantee.
"""

import math

import dp_accounting
import keras
import numpy as np
from keras import ops

from kdp import privacy
from kdp.autodiff import compile_function
from kdp.bounds import uses_input_bound
from kdp.contrastive import _backend
from kdp.contrastive.gradients import PairGradients, check_encoder, clipless_pair_bound
from kdp.pipeline import PoissonBatches
from kdp.training import seeds
from kdp.training.gate import PrivacyGate
from kdp.training.validation import check_input_norms, is_structure
from kdp.training.ledger import event_mechanism, training_mechanism

STRATEGIES = ("logit-dp", "naive", "clipless", "non-private")
SENSITIVITY_SIZES = ("dataset", "supremum")


class ContrastiveTrainer:
    """Trains an encoder on positive pairs with a DP contrastive strategy.

    Args:
        encoder: a built Keras model ``(n, ...) -> (n, d)`` that processes each
            example independently (checked: `kdp.contrastive.check_encoder`), called with
            ``training=False`` (dropout is not applied). Its inputs may be a
            structure (a dict or list of arrays, e.g. a keras_hub text encoder's
            ``token_ids``, ``segment_ids``, ``padding_mask``). For
            ``"clipless"`` it must be made of kdp DP layers with an input bound.
        loss: `DP_InfoNCE` or `DP_Spreadout`.
        strategy: one of ``"logit-dp"``, ``"naive"``, ``"clipless"``, ``"non-private"``.
        batch_size: the expected batch size ``b`` (pairs per step on average).
        clip_norm: ``B``: the per-pair clip norm (``"logit-dp"``) or the batch
            gradient clip norm (``"naive"``); unused otherwise.
        noise_multiplier: ``σ``; or give ``target_epsilon`` and let `fit`
            calibrate it for the number of epochs it is asked to run.
        target_epsilon: the ε to reach at the end of the first `fit`.
        delta: ``δ``, must be ``< 1/N``.
        optimizer: a Keras optimizer (default Adam(1e-3)).
        sensitivity_size: ``"dataset"`` or ``"supremum"`` (see the module docstring).
        input_bound: input norm bound if the encoder has no `DP_BoundedInput`
            (``"clipless"`` only); when it enters the bounds (no cap, or a cap
            above it) `fit` refuses pairs whose norms exceed it.
        epsilon_max: a budget (RDP) over every release of this trainer: `fit`
            refuses to start if its steps would exceed it.
        reproducible, seed: fix the sampling and noise seeds (tests only; both
            are needed). By default both come from 64 bits of OS entropy.
        jit_compile: compile the gradient computation (default True).
        block_rows, norm_method: how the exact per-pair norms are computed (see
            `PairGradients.pair_norms`).
    """

    def __init__(self, encoder, loss, strategy="logit-dp", batch_size=64, clip_norm=1.0,
                 noise_multiplier=None, target_epsilon=None, delta=1e-5, optimizer=None,
                 sensitivity_size="dataset", input_bound=None, reproducible=False, seed=None,
                 jit_compile=True, block_rows=None, norm_method="gram", epsilon_max=None):
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
        if sensitivity_size not in SENSITIVITY_SIZES:
            raise ValueError(
                f"sensitivity_size must be one of {SENSITIVITY_SIZES}, got {sensitivity_size!r}"
            )
        if not 0 < delta < 1:
            raise ValueError(f"delta must be in (0, 1), got {delta}")
        if strategy in ("logit-dp", "naive") and not clip_norm > 0:
            raise ValueError(f"clip_norm must be > 0, got {clip_norm}")
        if strategy == "naive" and not math.isfinite(clip_norm):
            raise ValueError("naive needs a finite clip_norm")
        private = strategy != "non-private"
        if private and noise_multiplier is None and target_epsilon is None:
            raise ValueError("give noise_multiplier= or target_epsilon=")
        if noise_multiplier is not None and not noise_multiplier > 0:
            raise ValueError(f"noise_multiplier must be > 0, got {noise_multiplier}")
        seeds.check_seed(reproducible, seed)
        self.engine = PairGradients(encoder, loss, block_rows=block_rows, method=norm_method)
        self.encoder, self.loss, self.strategy = encoder, loss, strategy
        self.batch_size = int(batch_size)
        self.clip_norm = float(clip_norm)
        self.noise_multiplier = None if noise_multiplier is None else float(noise_multiplier)
        self.target_epsilon = target_epsilon
        self.delta = float(delta)
        self.sensitivity_size = sensitivity_size
        self.optimizer = optimizer or keras.optimizers.Adam(1e-3)
        self.reproducible = bool(reproducible)
        self.seed = int(seed) if reproducible else None
        self.privacy_gate = PrivacyGate(self.delta, epsilon_max=epsilon_max,
                                        name=f"ContrastiveTrainer({strategy})")
        self.nb_pairs = None
        self.pair_bound = None
        self.input_bound = None if input_bound is None else float(input_bound)
        if strategy == "clipless":
            self.pair_bound, self.pair_bounds = clipless_pair_bound(encoder, loss, input_bound)
        self._noise_seed = seeds.seed_generator(self.reproducible, self.seed)
        compile_fn = compile_function if jit_compile else (lambda f: f)
        self._gradient_fn = compile_fn(self._raw_gradient)
        self._apply = _backend.compiled_apply(self.optimizer, jit_compile)

    @property
    def privacy_ledger(self):
        """The `PrivacyLedger` of every release made by this trainer."""
        return self.privacy_gate.ledger

    ledger = privacy_ledger  # the name of earlier versions

    # -- the mechanism -----------------------------------------------------------------
    def _draw_seed(self, offset):
        return seeds.draw_seed(self.reproducible, self.seed, offset)

    def step_mechanism(self, sampling_rate=None):
        """The ledger key of one step at ``sampling_rate`` (default ``q = b/N``)."""
        if self.strategy == "non-private":
            return event_mechanism(dp_accounting.NonPrivateDpEvent())
        q = self.sampling_rate if sampling_rate is None else sampling_rate
        return training_mechanism(self.noise_multiplier, q, "poisson", None)

    def calibration_size(self):
        """``n_cal``: ``N + 1`` (``"dataset"``) or ``math.inf`` (``"supremum"``)."""
        if self.sensitivity_size == "supremum":
            return math.inf
        if self.nb_pairs is None:
            raise ValueError("the calibration size needs N: call fit (or set nb_pairs) first")
        return self.nb_pairs + 1

    def sensitivity(self):
        """``Δ``: the L2 sensitivity of the summed gradient ``ḡ`` to one pair."""
        if self.strategy == "non-private":
            return 0.0
        if self.strategy == "naive":
            return 2.0 * self.clip_norm
        clip = self.clip_norm if self.strategy == "logit-dp" else self.pair_bound
        return self.loss.sensitivity(self.calibration_size(), clip)

    def noise_std(self):
        """Per-coordinate std of the noise on the released gradient: ``σ Δ / b``."""
        if self.strategy == "non-private":
            return 0.0
        return self.noise_multiplier * self.sensitivity() / self.batch_size

    def _raw_gradient(self, params, others, x, xp, mask):
        """``(ḡ, summed loss)`` of one padded batch, before noise and division by b."""
        e = self.engine
        if self.strategy == "logit-dp":
            grads, value, _ = e.logit_dp_gradient(params, others, x, xp, mask, self.clip_norm)
            return grads, value
        grads, value = e.loss_gradient(params, others, x, xp, mask)
        if self.strategy == "naive":
            norm = ops.sqrt(sum(ops.sum(ops.square(g)) for g in grads))
            scale = ops.minimum(1.0, self.clip_norm / ops.maximum(norm, 1e-30))
            grads = [g * scale for g in grads]
        return grads, value

    def batch_gradient(self, x, xp, mask=None):
        """``ḡ`` (before noise, not divided by b) on one batch; for tests and audits."""
        x, xp = _tensors(x), _tensors(xp)
        mask = ops.ones((_rows(x),)) if mask is None else ops.convert_to_tensor(
            np.asarray(mask, "float32"))
        params, others = self.engine.variables()
        grads, value = self._gradient_fn(params, others, x, xp, mask)
        return list(grads), value

    def noisy_gradient(self, x, xp, mask=None):
        """The released gradient ``(ḡ + 𝒩(0, σ²Δ²)) / b`` on one batch chosen by the
        caller, recorded as one Gaussian release without amplification (``q = 1``);
        `fit` samples the batches itself (``q = b/N``)."""
        self.noise_std()  # raises before anything is recorded if σ or N is missing
        with self.privacy_gate.spend(self.step_mechanism(1.0)):
            return self._noisy_gradient(x, xp, mask)

    def _noisy_gradient(self, x, xp, mask=None):
        grads, value = self.batch_gradient(x, xp, mask)
        std = self.noise_std()
        out = []
        for g in grads:
            g = g / self.batch_size
            if std > 0:
                g = g + keras.random.normal(ops.shape(g), stddev=std, dtype=g.dtype,
                                            seed=self._noise_seed)
            out.append(g)
        return out, value

    # -- training --------------------------------------------------------------------------
    def _prepare(self, x, xp, epochs, steps_per_epoch):
        x, xp = _arrays(x), _arrays(xp)
        shapes = [keras.tree.map_structure(lambda a: a.shape, z) for z in (x, xp)]
        if shapes[0] != shapes[1]:
            raise ValueError(f"anchors {shapes[0]} and positives {shapes[1]} must have the same shape")
        leaves = keras.tree.flatten(x) + keras.tree.flatten(xp)
        if any(len(a) != len(leaves[0]) for a in leaves):
            raise ValueError("every input array must have one row per pair")
        if not all((np.issubdtype(a.dtype, np.number) or a.dtype == bool) and np.all(np.isfinite(a))
                   for a in leaves):
            raise ValueError("the training pairs contain NaN, infinite or non-numeric values")
        if (self.strategy == "clipless" and self.input_bound is not None
                and uses_input_bound(self.encoder, self.input_bound)):
            check_input_norms([x, xp], self.input_bound, "input_bound={:g}",
                              "or start the encoder with DP_BoundedInput and leave input_bound out")
        n = _rows(x)
        if self.nb_pairs is not None and n != self.nb_pairs:
            raise ValueError(f"this trainer was started on {self.nb_pairs} pairs, got {n}")
        if not 1 <= self.batch_size <= n:
            raise ValueError(f"batch_size must be in [1, N={n}], got {self.batch_size}")
        if self.strategy != "non-private" and self.delta >= 1.0 / n:
            raise ValueError(f"delta={self.delta} >= 1/N = {1.0 / n:.3g}: lower it")
        self.nb_pairs = n
        steps = steps_per_epoch or math.ceil(n / self.batch_size)
        if self.strategy != "non-private" and self.noise_multiplier is None:
            self.noise_multiplier = privacy.calibrate_noise_multiplier(
                self.target_epsilon, self.sampling_rate, epochs * steps, self.delta,
                "rdp")  # the accountant `privacy_spent` reports
        check_encoder(self.encoder, data=x)  # the probe on training rows, before anything is spent
        return x, xp, steps

    @property
    def sampling_rate(self):
        return self.batch_size / self.nb_pairs

    def fit(self, x, xp, epochs=1, steps_per_epoch=None, callbacks=None, verbose=0):
        """Train on the pairs ``(x[k], xp[k])`` with Poisson sampling (``x``, ``xp``
        arrays, or structures of arrays with one row per pair).

        Returns a `keras.callbacks.History`-like dict: ``{"loss": [...],
        "epsilon": [...]}`` per epoch (the mean over the epoch's steps of the
        summed batch loss divided by b; ε after the epoch), and
        ``"step_loss"``: every step's value.
        """
        x, xp, steps = self._prepare(x, xp, epochs, steps_per_epoch)
        mechanism = self.step_mechanism()
        self.privacy_gate.begin_run(mechanism, epochs * steps, self._noise_seed, self.reproducible)
        # (anchors, positives) as one structure: every array is sampled and padded alike
        sampler = PoissonBatches((x, xp), np.zeros(self.nb_pairs, "float32"), self.batch_size,
                                 steps_per_epoch=steps,
                                 seed=self._draw_seed(1) if self.reproducible else None)
        history = {"loss": [], "epsilon": [], "step_loss": []}
        variables = self.encoder.trainable_variables
        for epoch in range(epochs):
            losses = []
            for step in range(steps):
                with self.privacy_gate.spend(mechanism):  # recorded before the step runs
                    (xb, xpb), _, wb = sampler[step]
                    grads, value = self._noisy_gradient(xb, xpb, (wb > 0).astype("float32"))
                    self._apply(grads, variables)
                losses.append(float(value) / self.batch_size)
            history["step_loss"].extend(losses)
            history["loss"].append(float(np.mean(losses)))
            history["epsilon"].append(self.privacy_spent()[0])
            if verbose:
                print(f"epoch {epoch + 1}/{epochs}: loss {history['loss'][-1]:.4f}, "
                      f"epsilon {history['epsilon'][-1]:.3f}")
            for cb in callbacks or []:
                cb(epoch, history)
        return history

    def privacy_spent(self, accountant="rdp"):
        """``(ε, δ)`` of every release in the ledger (``ε = ∞`` once a non-private
        step was taken)."""
        return self.privacy_gate.privacy_spent(accountant)

    def report(self):
        """The parameters of the mechanism, for the record."""
        return {
            "strategy": self.strategy, "loss": type(self.loss).__name__,
            "temperature": getattr(self.loss, "temperature", None),
            "similarity": self.loss.similarity, "clip_norm": self.clip_norm,
            "pair_bound": self.pair_bound, "nb_pairs": self.nb_pairs,
            "batch_size": self.batch_size, "sampling_rate": self.sampling_rate if self.nb_pairs else None,
            "noise_multiplier": self.noise_multiplier, "sensitivity_size": self.sensitivity_size,
            "sensitivity": self.sensitivity() if self.nb_pairs or self.sensitivity_size == "supremum" else None,
            "delta": self.delta, "steps": sum(e["count"] for e in self.privacy_ledger.entries),
            "accountant": "rdp, Poisson sampling, add/remove one pair",
        }


def _arrays(x):
    """``x`` as NumPy: float32 if one array, each array's own dtype in a structure
    (token ids stay integers)."""
    return keras.tree.map_structure(np.asarray, x) if is_structure(x) else np.asarray(x, "float32")


def _tensors(x):
    return keras.tree.map_structure(ops.convert_to_tensor, _arrays(x))


def _rows(x):
    return keras.tree.flatten(x)[0].shape[0]


__all__ = ["ContrastiveTrainer", "STRATEGIES", "SENSITIVITY_SIZES"]
