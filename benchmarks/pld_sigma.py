"""σ calibrated by the RDP and the PLD accountant (README, "Accounting: PLD by default").

For each setting and target ε: the σ each accountant calibrates for one
Poisson-subsampled Gaussian per step (`kdp.privacy.calibrate_noise_multiplier`),
the noise PLD saves, and the ε each accountant reports for the other's σ. First,
the time of ``make_private`` (ε = 3) and of ε of the ledger (one epoch, the
full run, and one step more: what every step's logs cost) for a small DP model
of the same N, b and epochs, measured before the table and with kdp's caches of
composed PLDs and of ε emptied before each ε (the PLD of one step stays cached,
as it does during training).

    python benchmarks/pld_sigma.py
"""

import math
import time

import keras

import kdp
from kdp import layers, losses, privacy
from kdp.privacy import accountants
from kdp.training.ledger import new_run_id

#: (name, N, b, epochs, δ)
SETTINGS = (("digits-like", 1437, 128, 30, 1e-5), ("large", 50_000, 2048, 30, 1e-7))
TARGETS = (1.0, 3.0, 8.0)


def _model(n, b, delta):
    model = kdp.DP_Sequential(
        [layers.DP_BoundedInput((8,), 1.0), layers.DP_QuickSpectralDense(4)],
        dp_parameters=kdp.DPParameters("global", 1.0, delta),
        dataset_metadata=kdp.DatasetMetadata((8,), 4, n, b))
    model.compile(optimizer="sgd", loss=losses.DP_TauCategoricalCrossentropy(1.0))
    return model


def _timed(fn):
    """``(fn(), its CPU seconds)``: this process's time, which other processes on a
    shared machine do not inflate (kdp's accounting runs on one thread)."""
    accountants._poisson_gaussian_pld.cache_clear()
    accountants._pld_epsilon_of_config.cache_clear()
    start = time.process_time()
    value = fn()
    return value, time.process_time() - start


def timings(n, b, epochs, delta, accountant):
    """CPU seconds of make_private(3, epochs) and of ε after 1 epoch, `epochs` epochs
    and one step more, for a fresh model (steps recorded in its ledger by hand)."""
    model = _model(n, b, delta)
    _, calibrate = _timed(lambda: model.make_private(3.0, epochs, accountant=accountant))
    mechanism, run = model.step_plan().fit_mechanism, new_run_id()
    spe = model.step_plan().steps_per_epoch
    model.privacy_ledger.record(mechanism, spe, run)
    _, one_epoch = _timed(model.privacy_spent)
    model.privacy_ledger.record(mechanism, (epochs - 1) * spe, run)
    (eps, _), all_epochs = _timed(model.privacy_spent)
    model.privacy_ledger.record(mechanism, 1, run)
    _, one_more = _timed(model.privacy_spent)
    return calibrate, one_epoch, all_epochs, one_more, eps


def main():
    print(f"kdp {kdp.__version__}, Keras {keras.__version__} ({keras.backend.backend()}), "
          f"PLD discretization {privacy.PLD_DISCRETIZATION:g}\n")
    print("CPU time of one call:\n")
    print("| setting | accountant | make_private (ε = 3) | ε, 1 epoch | ε, all epochs | "
          "ε, one step more | ε after all epochs |")
    print("|---|---|---|---|---|---|---|")
    for name, n, b, epochs, delta in SETTINGS:
        for accountant in ("pld", "rdp"):
            cal, one, full, more, eps = timings(n, b, epochs, delta, accountant)
            print(f"| {name} | {accountant.upper()} | {cal:.2f} s | {one * 1e3:.0f} ms | "
                  f"{full * 1e3:.0f} ms | {more * 1e3:.0f} ms | {eps:.4f} |")

    print("\n| setting | ε | σ RDP | σ PLD | noise saved | ε_PLD(σ RDP) | ε_RDP(σ PLD) |")
    print("|---|---|---|---|---|---|---|")
    for name, n, b, epochs, delta in SETTINGS:
        q, steps = b / n, math.ceil(n / b) * epochs
        for target in TARGETS:
            sigma = {acc: float(privacy.calibrate_noise_multiplier(target, q, steps, delta, acc))
                     for acc in privacy.ACCOUNTANTS}
            cross = {acc: privacy.compute_epsilon(sigma[other], q, steps, delta, acc)
                     for acc, other in (("pld", "rdp"), ("rdp", "pld"))}
            saved = 1 - sigma["pld"] / sigma["rdp"]
            print(f"| {name}: N={n}, b={b}, {epochs} epochs ({steps} steps), δ={delta:g} | "
                  f"{target:g} | {sigma['rdp']:.4f} | {sigma['pld']:.4f} | {saved:.1%} | "
                  f"{cross['pld']:.3f} | {cross['rdp']:.3f} |")


if __name__ == "__main__":
    main()
