"""lip-dp names that kdp does not keep, each refused with its kdp replacement.

kdp keeps lip-dp's names (https://github.com/deel-ai/lipdp, Béthune et al.
2024) wherever the meaning is the same. The names below are lip-dp's that kdp
replaces or drops: each is a function that raises `LipDPNameError`, whose
message names what to use instead, so code pasted from lip-dp stops at the
first line to change. README, "Coming from lip-dp", has the whole table.
"""


class LipDPNameError(RuntimeError):
    """A lip-dp name that kdp does not provide; the message names the kdp replacement."""


def _refused(name, replacement):
    """A function named ``name`` that raises `LipDPNameError` pointing to ``replacement``."""

    def refused(*args, **kwargs):
        raise LipDPNameError(f"{name} is lip-dp's; kdp has no {name}: {replacement}")

    refused.__name__ = refused.__qualname__ = name
    refused.__doc__ = f"lip-dp's ``{name}``, refused: {replacement}."
    return refused


# deel.lipdp.pipeline
load_and_prepare_images_data = _refused(
    "load_and_prepare_images_data",
    "use kdp.pipeline.load_mnist, load_fashion_mnist or load_cifar10(path=None, batch_size=..., "
    "input_bound=...), which return NumPy arrays and a DatasetMetadata; model.fit draws the "
    "Poisson batches itself (colour spaces and augmult are not provided)")
prepare_tabular_data = _refused(
    "prepare_tabular_data",
    "bound your arrays with kdp.pipeline.bound_clip_value(C) and describe them with "
    "kdp.pipeline.DatasetMetadata(input_shape, nb_classes, nb_samples_train=len(x), batch_size=b, "
    "max_norm=C); model.fit draws the Poisson batches itself")
load_adbench_data = _refused(
    "load_adbench_data",
    "load the .npz with numpy.load and bound it with kdp.pipeline.bound_clip_value(C); "
    "its standardize=True used the data's own mean and std, a data-dependent preprocessing "
    "that no accountant counts")
default_delta_value = _refused(
    "default_delta_value",
    "pass kdp.DPParameters(delta=...) below 1/N yourself (kdp refuses delta >= 1/N, which "
    "lip-dp's 10**-ceil(log10 N) reaches when N is a power of ten)")

# deel.lipdp.layers
DP_QuickFrobeniusDense = _refused(
    "DP_QuickFrobeniusDense", "use kdp.layers.DP_QuickSpectralDense (spectral norm <= 1)")
DP_MaxPool2D = _refused(
    "DP_MaxPool2D", "use kdp.layers.DP_ScaledL2NormPooling2D(pool_size)")
DP_ScaledL2NormPooling1D = _refused(
    "DP_ScaledL2NormPooling1D",
    "the L2 norm over one axis is 1-Lipschitz and keeps the norm: write it as a "
    "kdp.layers.DPNormNonIncreasingLayer (over an image's spatial axes: "
    "kdp.layers.DP_ScaledGlobalL2NormPooling2D)")
DP_Lambda = _refused(
    "DP_Lambda",
    "a Lambda's bounds are unknown: write a layer with the bound protocol "
    "(kdp.layers.DPLayer, or kdp.layers.DPNormNonIncreasingLayer for a 1-Lipschitz map f "
    "with f(0) = 0)")
DP_Permute = _refused(
    "DP_Permute",
    "a permutation keeps the norm: class DP_Permute(kdp.layers.DPNormNonIncreasingLayer, "
    "keras.layers.Permute): pass")
DP_GNP_Factory = _refused(
    "DP_GNP_Factory",
    "for a 1-Lipschitz Keras layer f with f(0) = 0, subclass both, e.g. "
    "class DP_Permute(kdp.layers.DPNormNonIncreasingLayer, keras.layers.Permute): pass")
DP_InputLayer = _refused(
    "DP_InputLayer",
    "start with kdp.layers.DP_BoundedInput(input_shape, upper_bound), or keras.Input(shape) "
    "with DatasetMetadata(max_norm=...)")
_RESIDUAL = ("use kdp.layers.DP_Residual(layers, merge='1-lip-add') or "
             "*kdp.layers.make_residuals(merge_policy, layers)")
DP_SplitResidual = _refused("DP_SplitResidual", _RESIDUAL)
DP_WrappedResidual = _refused("DP_WrappedResidual", _RESIDUAL)
DP_MergeResidual = _refused("DP_MergeResidual", _RESIDUAL)

# deel.lipdp.accounting and deel.lipdp.dynamic
DPGD_Mechanism = _refused(
    "DPGD_Mechanism",
    "kdp accounts with dp-accounting events: kdp.accounting.training_event(noise_multiplier, "
    "sampling_rate, steps) and kdp.accounting.epsilon_of_events(events, delta)")
LaplaceAdaptiveLossGradientClipping = _refused(
    "LaplaceAdaptiveLossGradientClipping",
    "the sparse-vector variant is not implemented; use kdp.callbacks.AdaptiveQuantileClipping")

# deel.lipdp.utils
ScaledAUC = _refused(
    "ScaledAUC", "use keras.metrics.AUC(from_logits=True): a positive scale keeps the ranking")
CertifiableAUROC = _refused(
    "CertifiableAUROC",
    "kdp certifies accuracy, not AUROC: kdp.certificates.CertifiedAccuracy(radius) or "
    "certified_accuracy(model, x, y, radius)")
PrivacyMetrics = _refused(
    "PrivacyMetrics",
    "use kdp.audit.membership_audit(model, canary_x, canary_y) (an epsilon lower bound)")
_SIGNAL_TO_NOISE = (
    "use kdp.audit.gradient_norm_check(model, x, y) (per-example gradient norms against their "
    "bounds) and model.noise_stds() (the noise std of each variable)")
SignaltoNoiseAverage = _refused("SignaltoNoiseAverage", _SIGNAL_TO_NOISE)
SignaltoNoiseHistogram = _refused("SignaltoNoiseHistogram", _SIGNAL_TO_NOISE)

__all__ = [
    "LipDPNameError", "load_and_prepare_images_data", "prepare_tabular_data", "load_adbench_data",
    "default_delta_value", "DP_QuickFrobeniusDense", "DP_MaxPool2D", "DP_ScaledL2NormPooling1D",
    "DP_Lambda", "DP_Permute", "DP_GNP_Factory", "DP_InputLayer", "DP_SplitResidual",
    "DP_WrappedResidual", "DP_MergeResidual", "DPGD_Mechanism", "LaplaceAdaptiveLossGradientClipping",
    "ScaledAUC", "CertifiableAUROC", "PrivacyMetrics", "SignaltoNoiseAverage",
    "SignaltoNoiseHistogram",
]
