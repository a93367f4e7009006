"""`DPParameters`: the immutable privacy configuration of a DP model."""

import math

from kdp import privacy
from kdp.clipping import check_clipping_parameters
from kdp.training.sampling import check_batch_shapes
from kdp.training.seeds import check_seed, draw_seed

NOISIFY_STRATEGIES = ("per-layer", "global")
#: σ when `DPParameters` is given none (`fit` then warns what it costs)
DEFAULT_NOISE_MULTIPLIER = 1.0


class DPParameters:
    """Privacy parameters of a DP model.

    Args:
        noisify_strategy: ``"per-layer"`` (std ``σ c_v Δ_v / b`` per variable) or
            ``"global"`` (std ``σ √(Σ Δ_v²) / b`` everywhere).
        noise_multiplier: ``σ > 0``; if not given, `DEFAULT_NOISE_MULTIPLIER`, and
            the first `fit` without a budget warns what its epochs cost at that σ
            (`make_private` sets σ for a target ε; ``noise_multiplier_is_default``).
        delta: the δ of the reported (ε, δ); must be ``< 1/N`` unless
            ``allow_large_delta=True``.
        sampling: ``"poisson"`` (default, what the accountant assumes) or
            ``"shuffle"`` (shuffled batches of at most ``b`` records: passes kdp
            draws from arrays or a `kdp.RecordSource` are accounted without
            amplification under replace-one, one Gaussian per pass; the steps
            of a `tf.data` pipeline or generator one Gaussian each, add/remove-one).
        reproducible: fix the noise and sampling seeds to ``seed`` (required).
            **For tests only**: by default every draw is seeded from the OS
            entropy, so nobody can predict the noise.
        seed: the seed used when ``reproducible=True``.
        allow_large_delta: accept ``delta >= 1/N`` (not recommended).
        clipping_norm: ``C`` enables **per-example clipping** DP-SGD for models of
            ordinary Keras layers (`kdp.clipping`): a float, or with
            ``clipping="per-layer"`` a dict ``{layer name: C_l}`` (``C² = Σ C_l²``).
            ``None`` (default): Clipless DP-SGD with the bound pass.
        clipping: ``"flat"`` (one norm per example) or ``"per-layer"`` (a float
            ``C`` is split equally, ``C_l = C/√L``).
        physical_batch_size: with clipping, compute the clipped sum over chunks
            of at most this many rows, as few as hold the batch (virtual batches:
            one logical, accounted step); the chunks after the batch's last row of
            positive weight (its padding) are skipped, so every batch is padded to
            one size (``batch_shapes``), one compiled step whose padding costs
            less than a chunk. On JAX on a CPU, ``physical_batch_size=8`` took
            1.15× plain Keras' step and 1.41× its peak memory on the BERT
            encoder of ``benchmarks/bench_transformer.py`` (against 1.60× and
            1.91× without it), 0.60× and 0.65× on the convnet of
            ``benchmarks/bench_clipping_step.py`` (1.09× and 1.36×), but 2.4-2.7×
            the time on an MLP, whose chunks of 8 rows are too small to compute
            efficiently (1.3-1.8×). ``None``: only a batch padded above the
            padding ladder's size below its capacity runs in chunks of at most
            that size (`kdp.training.objective.virtual_batch_rows`).
        epsilon_max: a privacy budget enforced over **every** `fit` of the model
            (it is saved with the model): `fit` stops before the step that would
            exceed it, and refuses to start on a model whose ledger already does.
        batch_shapes: how many static sizes Poisson batches are padded to
            (`kdp.training.sampling.poisson_batch_shapes`): 3 pads by about 3 %
            of the rows at b = 1024 for up to three compilations of the step; 1
            pads every batch to the capacity ``b + 6√b + 8`` (one compilation,
            +19 % rows at b = 1024, which virtual batches skip). ``None``
            (default): 1 with ``physical_batch_size``, else 3. Speed only: the
            guarantee is the same.
        augmentation_multiplicity: with clipping, ``K``: each example's gradient
            is the mean of the gradients of ``K`` copies of it run through the
            model together in training mode, so that the model's random
            augmentation layers draw ``K`` views, clipped once (De et al. 2022,
            "Unlocking high-accuracy differentially private image classification
            through scale"). One example is still one record: the sensitivity
            is ``C`` whatever ``K``; the step costs about ``K`` times more.
    """

    def __init__(self, noisify_strategy="per-layer", noise_multiplier=None, delta=1e-5,
                 sampling="poisson", reproducible=False, seed=None, allow_large_delta=False,
                 clipping_norm=None, clipping="flat", physical_batch_size=None, epsilon_max=None,
                 batch_shapes=None, augmentation_multiplicity=1):
        if noisify_strategy not in NOISIFY_STRATEGIES:
            raise ValueError(
                f"noisify_strategy must be one of {NOISIFY_STRATEGIES}, got {noisify_strategy!r}"
            )
        default = noise_multiplier is None
        if default:
            noise_multiplier = DEFAULT_NOISE_MULTIPLIER
        if not noise_multiplier > 0 or not math.isfinite(noise_multiplier):
            raise ValueError(f"noise_multiplier must be a finite number > 0, got {noise_multiplier}")
        if not 0 < delta < 1:
            raise ValueError(f"delta must be in (0, 1), got {delta}")
        if sampling not in privacy.SAMPLINGS:
            raise ValueError(f"sampling must be one of {privacy.SAMPLINGS}, got {sampling!r}")
        check_seed(reproducible, seed)
        self.noisify_strategy = noisify_strategy
        # A σ from `calibrate_noise_multiplier` keeps what it was calibrated for.
        self.noise_multiplier = (noise_multiplier if isinstance(
            noise_multiplier, privacy.CalibratedNoiseMultiplier) else float(noise_multiplier))
        #: σ was not given (the default): nobody chose the privacy level
        self.noise_multiplier_is_default = default
        self.delta = float(delta)
        self.sampling = sampling
        self.reproducible = bool(reproducible)
        self.seed = int(seed) if reproducible else None
        self.allow_large_delta = bool(allow_large_delta)
        if epsilon_max is not None and not (epsilon_max > 0 and math.isfinite(epsilon_max)):
            raise ValueError(f"epsilon_max must be a finite number > 0, got {epsilon_max}")
        self.epsilon_max = None if epsilon_max is None else float(epsilon_max)
        self.clipping_norm, self.clipping, self.physical_batch_size = check_clipping_parameters(
            clipping_norm, clipping, physical_batch_size)
        if batch_shapes is None:  # virtual batches skip the passes of padding: one size is enough
            batch_shapes = 1 if self.physical_batch_size else 3
        self.batch_shapes = check_batch_shapes(batch_shapes)
        k = augmentation_multiplicity
        if isinstance(k, bool) or not isinstance(k, (int, float)) or k != int(k) or k < 1:
            raise ValueError(f"augmentation_multiplicity must be an integer >= 1, got {augmentation_multiplicity!r}")
        if augmentation_multiplicity > 1 and self.clipping_norm is None:
            raise ValueError("augmentation_multiplicity > 1 needs per-example clipping (clipping_norm=C)")
        self.augmentation_multiplicity = int(augmentation_multiplicity)
        self._frozen = True

    def __setattr__(self, name, value):
        if getattr(self, "_frozen", False):
            raise AttributeError(
                f"DPParameters are immutable (a compiled step and the ledger rely on them): use "
                f"model.dp_parameters = model.dp_parameters.replace({name}=...)")
        super().__setattr__(name, value)

    def replace(self, **changes):
        """A copy with ``changes`` applied (validated like the constructor)."""
        return DPParameters(**{**self.get_config(), **changes})

    def draw_seed(self, offset=0):
        """The fixed seed (+ offset) if reproducible, else 64 bits of OS entropy."""
        return draw_seed(self.reproducible, self.seed, offset)

    def get_config(self):
        """The constructor's arguments; ``noise_multiplier`` is ``None`` when nobody
        chose it, so a saved and reloaded model still warns before training with it."""
        sigma = None if self.noise_multiplier_is_default else float(self.noise_multiplier)
        return {
            "noisify_strategy": self.noisify_strategy, "noise_multiplier": sigma,
            "delta": self.delta, "sampling": self.sampling, "reproducible": self.reproducible,
            "seed": self.seed, "allow_large_delta": self.allow_large_delta,
            "clipping_norm": self.clipping_norm, "clipping": self.clipping,
            "physical_batch_size": self.physical_batch_size, "epsilon_max": self.epsilon_max,
            "batch_shapes": self.batch_shapes, "augmentation_multiplicity": self.augmentation_multiplicity,
        }

    @classmethod
    def from_config(cls, config):
        return cls(**config)

    def __repr__(self):
        config = {**self.get_config(), "noise_multiplier": float(self.noise_multiplier)}
        return "DPParameters(" + ", ".join(f"{k}={v!r}" for k, v in config.items()) + ")"
