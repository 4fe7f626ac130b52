"""The claims ledger: every checked claim of the two source articles, with what this book measured.

The page is generated at build time from `_build/results/*.json` (and `results/gpu/*.json` when a
GPU reference exists), so each "measured" cell is a number from the current run, and each verdict
is computed from it, never typed.
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from labutils.rl_analysis import DIFFERENCE, NO_DIFFERENCE, conclusion, power
from labutils.results import load_all
from .status import table

CONFIRMED, CONTRADICTED = "confirmed", "contradicted"  # decided beyond the measurement's noise
INCONCLUSIVE = "inconclusive"  # within the noise: the measured column gives the power to see the claimed effect
NOT_MEASURED = "not measured here"  # nothing run here can decide it; the measured column says what it needs
NOT_COMPARABLE = "not comparable here"  # a figure of the paper's GPUs and model, beside the nearest measurement here
REDUNDANT = "redundant"  # a recipe that is harmless and changes nothing
SOURCES = {"crash": "QLoRA GRPO crash article", "fp16": "FP16 RL mismatch article", "paper": "Qi et al. 2025",
           "is": "TIS and MIS articles (Yao et al.; Liu et al. 2025)"}


@dataclass(frozen=True)
class Claim:
    source: str  # key of SOURCES
    says: str  # the source's statement, paraphrased in English
    paper: str  # what Qi et al. 2025 say, where relevant
    chapter: str  # the chapter whose results decide it
    keys: tuple[str, ...]  # the metrics it reads
    judge: Callable[..., tuple[str, str]]  # metric values -> (what was measured, verdict)
    device: str = "cpu"  # "gpu": a claim about GPUs, judged only on committed GPU reference results


def _pct(x):
    """A share, with enough digits that a small one is not shown as 0.0%."""
    return f"{x:.1%}" if x == 0 or x >= 0.01 else f"{100 * x:.2g}%"


def _comparison(gap, noise, dof, better_if_positive=True, effect=None):
    """A chapter's comparison in the ledger's vocabulary (`rl_analysis.conclusion` decides, its t interval on `dof`
    degrees of freedom): a difference confirms or contradicts; no difference, with 80% power to see `effect` (the
    smallest effect that matters) and an interval that excludes it, contradicts; otherwise inconclusive, with the
    power for the observed gap."""
    kind, p = conclusion(gap, noise, effect or 0.0, dof)
    if kind == DIFFERENCE:
        return CONFIRMED if (gap > 0) == better_if_positive else CONTRADICTED
    if kind == NO_DIFFERENCE:
        return f"{CONTRADICTED} (no difference, with {p:.0%} power to see an effect of {effect:.3g})"
    return f"{INCONCLUSIVE} (power {p:.0%} for the observed gap)"


PAPER_SEQ_KL = 7.64  # Qi et al.'s BF16 sequence KL[μ‖π], nats: the mismatch their collapses happened at


def _in_regime(verdict, seq_kl):
    """A null at a mismatch far below the paper's says nothing against the paper: such a verdict is inconclusive,
    and says why. `seq_kl`: the runs' own KL per completion."""
    if verdict.startswith(CONTRADICTED) and "no difference" in verdict and seq_kl < PAPER_SEQ_KL / 10:
        return (f"{INCONCLUSIVE} ({verdict.removeprefix(CONTRADICTED + ' (').rstrip(')')}, but at {seq_kl:.2g} nats "
                f"per completion against the paper's {PAPER_SEQ_KL}: its regime was not reached)")
    return verdict


def _long_run_only(basis):
    return None if basis == "long run" else NOT_MEASURED + " (needs the long run, `make long`)"


def _bf16_degrades(basis, seeds, steps, gap, noise, effect, seq_kl):
    """BF16 RL degrades: the bf16 sampler's score against the fp32 sampler's, on the long run's fresh seeds."""
    measured = (f"bf16 sampler (7 mantissa bits) vs fp32 sampler, fp32 trainer ({basis}, {seeds} paired seeds, "
                f"{steps} steps): score {gap:+.3f} (95% interval ±{noise:.3f}); smallest effect that matters "
                f"{effect:.2g}; bf16's mismatch {seq_kl:.2g} nats per completion; the comparison is fp32, stricter "
                "than the paper's FP16")
    return measured, _long_run_only(basis) or _in_regime(
        _comparison(gap, noise, seeds - 1, better_if_positive=False, effect=effect), seq_kl)


def _coarse_degrades(basis, bits, slope, low, high, runs, settings, effect_slope, gap, noise, effect, seq_kl):
    """The mechanism: the score falls with the run's own mismatch, across the dial (the dose–response)."""
    measured = (f"{basis}: score {slope:+.3f} per tenfold rise in the run's token KL (95% {low:+.3f} to {high:+.3f}, "
                f"{runs} runs clustered by {settings} settings; smallest slope that matters {-effect_slope:+.3f}); "
                f"at {bits} emulated mantissa bits ({seq_kl:.2g} nats per completion) the matched sampler ends "
                f"{gap:+.3f} (±{noise:.3f}) above the uncorrected one")
    return measured, _long_run_only(basis) or _in_regime(
        _comparison(-slope, (high - low) / 2, settings - 1, effect=effect_slope), seq_kl)


def _share(x) -> str:
    """A power or share recorded as a number, or 'unknown' where the run could not compute it."""
    try:
        return f"{float(x):.0%}" if math.isfinite(float(x)) else "unknown"
    except (TypeError, ValueError):
        return "unknown"


def _update_biased(sampler, dose, rho, rho_se, achieved, verdict, needed):
    """The mechanism at the update (chapter 5c): the uncorrected GRPO update on μ's samples, at bf16's dose at 1K
    tokens, keeps a share ρ of the on-policy update; the chapter's own verdict, with its power."""
    measured = (f"at fixed weights on the real 135M model, on the {sampler} sampler's completions ({dose:.2g} nats "
                f"per completion, the dose nearest above bf16's at 1K tokens in chapter 4b), the uncorrected GRPO "
                f"update of the last two decoder blocks keeps ρ = {rho:.2f} ± {rho_se:.2f} of the on-policy update; power "
                f"{_share(achieved)} to see a drop of 0.05")
    if verdict == "shown":
        return measured, CONFIRMED
    if verdict == "contradicted":
        return measured, CONTRADICTED + " (ρ and the whole change within the margin)"
    decide = (f"; about {float(f'{needed:.2g}'):,.0f} completions per sampler would give 80% power" if needed
              else "")
    return measured, INCONCLUSIVE + f" (power {_share(achieved)}{decide})"


def _update_restored(verdict, sampler, default_change, default_se, tis_change, tis_se, first_lost):
    """Corrections restore the update's direction (chapter 5c): the chapter's own verdict."""
    measured = (f"on the same completions at bf16's dose at 1K tokens ({sampler}), trl's default correction "
                f"changes ρ by {default_change:+.2f} ± {default_se:.2f} and token TIS by {tis_change:+.2f} ± "
                f"{tis_se:.2f}; the first sampler whose update lost direction (Holm-corrected): {first_lost}")
    if verdict == "not tested":
        return measured, NOT_MEASURED + " (no sampler's update lost direction: nothing to restore)"
    return measured, {"shown": CONFIRMED, "contradicted": CONTRADICTED}.get(
        verdict, INCONCLUSIVE + " (the corrected ρ neither returns within the margin nor stays below it)")


def _run_label(name: str) -> str:
    """A long-run arm's name as a reader reads it: `m2_tis` is token TIS on the 2-bit sampler."""
    sampler, _, fix = name.partition("_")
    bits = f"the {sampler[1:]}-bit sampler" if sampler.startswith("m") and sampler[1:].isdigit() else sampler
    return f"token TIS on {bits}" if fix == "tis" else bits


def _restores(basis, fix, bits, seeds, gap_m, noise_m, gap_f, noise_f, gap_fm, noise_fm):
    """The correction restores training: it beats the uncorrected run and reaches the matched one."""
    fix = _run_label(fix)
    measured = (f"{basis}, {seeds} paired seeds: matched vs uncorrected sampler with {bits} emulated mantissa bits "
                f"{gap_m:+.3f} (±{noise_m:.3f}); {fix} vs uncorrected {gap_f:+.3f} (±{noise_f:.3f}); {fix} vs matched "
                f"{gap_fm:+.3f} (±{noise_fm:.3f}) score")
    if basis != "long run":
        return measured, _long_run_only(basis)
    if gap_m <= noise_m:  # nothing to restore has been shown
        return measured, (f"{INCONCLUSIVE} (the uncorrected run's loss is within noise, power "
                          f"{power(gap_m, noise_m, seeds - 1):.0%}: nothing shown to restore)")
    if gap_f > noise_f and gap_fm >= -noise_fm:
        return measured, CONFIRMED
    if gap_fm < -noise_fm:  # the corrected run stays below the matched one beyond noise: not restored
        return measured, CONTRADICTED
    return measured, f"{INCONCLUSIVE} (power {power(gap_f, noise_f, seeds - 1):.0%} for the fix's gain)"


def _crash_flag(bf16_builds, fp16_builds, bf16_error, real_bf16_error):
    """Which flag builds the GradScaler whose unscale step raises the error: read from accelerate's installed source."""
    raised = lambda error: "no error" if error == "none" else repr(error)
    measured = (f"accelerate's installed source builds a GradScaler under fp16 mixed precision: "
                f"{'yes' if fp16_builds else 'no'}; under bf16: {'yes' if bf16_builds else 'no'}; this build's "
                f"bf16=True trainer raised {raised(bf16_error)} on the toy and {raised(real_bf16_error)} on the real model")
    if "BFloat16" in bf16_error or "BFloat16" in real_bf16_error:
        return measured, CONFIRMED
    if fp16_builds and not bf16_builds:
        return measured, CONTRADICTED + " (only fp16=True builds the scaler whose unscale step raises it)"
    return measured, INCONCLUSIVE


def _scaler_forced(bf16_scaler, bf16_builds):
    """Whether a bf16=True QLoRA trainer gets a GradScaler: as built here, and as accelerate's source allows."""
    measured = (f"QLoRA trainer with bf16=True as built: {'no GradScaler' if bf16_scaler == 'none' else bf16_scaler}; "
                f"accelerate's source builds one for bf16: {'yes' if bf16_builds else 'no'}")
    if bf16_scaler != "none":
        return measured, CONFIRMED
    return measured, CONTRADICTED if not bf16_builds else INCONCLUSIVE


def _about_24(ratio, low, high):
    """"About 24×" is a ratio of *sequence* KLs of a 1.5B reasoning model on GPU kernels: a ratio of token KLs of a
    135M model on this CPU's kernels is the nearest measurement here, shown beside it, and cannot decide it."""
    direction = ("fp16 cuts the mismatch here too" if low > 1 else
                 "fp16 does not cut the mismatch here" if high < 1 else "no direction beyond the interval here")
    measured = (f"SmolLM2-135M on this build's kernels, both engines in one precision: token KL bf16 / fp16 {ratio:.0f}× "
                f"(95% interval over paired prompts {low:.0f}–{high:.0f}); a first-order argument gives 8² = 64× per "
                "token, and the paper's own two figures give 14× (slopes) and 24× (sequence KLs)")
    return measured, (f"{NOT_COMPARABLE} ({direction}; the factor depends on the model, the kernels and the text's "
                      "entropy, and the paper's is a ratio of sequence KLs on GPUs)")


def _two_programs(cross, low, high, off, off_low, off_high, same):
    """fp16 between a serving engine and a trainer that are different programs (vLLM and FSDP in the paper): the
    nearest measurement here is llama.cpp sampling against the torch trainer on a CPU, which cannot decide it."""
    direction = ("fp16 cuts it between two programs here too" if low > 1 else
                 "fp16 does not cut it between two programs here" if high < 1 else
                 "no direction beyond the interval here")
    measured = (f"SmolLM2-135M on this CPU, llama.cpp sampling against the torch trainer, both in one dtype: "
                f"token KL bf16 / fp16 {cross:.1f}× (95% over paired prompts {low:.1f}–{high:.1f}) at llama.cpp's "
                f"defaults, whose flash attention computes in F16; {off:.0f}× ({off_low:.0f}–{off_high:.0f}) without "
                f"it; {same:.0f}× within one program")
    return measured, (f"{NOT_COMPARABLE} ({direction}; the paper's programs are vLLM and FSDP on GPUs, with "
                      "other kernels)")


def _mixed_engines(mixed, mixed_se, same, same_se):
    """"bf16 training, fp32 inference is stable": stability needs RL runs of that pairing, which the book has not
    run; the mismatch it starts from is measured on the real model, against both engines in bf16."""
    if abs(mixed - same) <= 1.96 * math.hypot(mixed_se, same_se):
        order = "about the same as"
    else:
        order = "larger than" if mixed > same else "smaller than"
    measured = (f"SmolLM2-135M: token KL of a bf16 trainer against an fp32 sampler {mixed:.2g} ± {mixed_se:.1g}, "
                f"{order} both engines in bf16 ({same:.2g} ± {same_se:.1g}; per-sequence standard errors)")
    return measured, NOT_MEASURED + " (stability needs RL runs with a bf16 trainer and an fp32 sampler)"


def _fp16_during_rl(ratio_start, ratio_end, below):
    """"FP16 removes most of the mismatch during RL", read from chapter 5's committed run on the real model:
    'most' as fp16's probe KL below half of bf16's, at the run's start and end, as the chapter decided it."""
    measured = (f"SmolLM2-135M trained by trl GRPO, a fixed probe's exact token KL: bf16/bf16 over fp16/fp16 "
                f"{ratio_start:.0f}× at the start and {ratio_end:.0f}× at the end (chapter 5's committed run; "
                "'most' read as fp16's below half of bf16's beyond the probe's standard errors); an autocast "
                "trainer, as trl with accelerate, not the paper's FSDP bf16")
    if below:
        return measured, CONFIRMED
    return measured, CONTRADICTED if ratio_start < 1 and ratio_end < 1 else INCONCLUSIVE


def _scaler_recipe(skipped, steps, growths, default_skipped, default_growths, default_interval):
    """A scaler setting "to use": it works where it skips few steps and grows; it is better only against an
    alternative, and no outcome (loss, accuracy) is compared with PyTorch's default here."""
    measured = (f"on synthetic gradients over {steps} steps: {skipped} steps skipped and {growths} growths with the "
                f"source's setting, {default_skipped} skipped and {default_growths} growths with PyTorch's default "
                f"(growth interval {default_interval}); no loss or accuracy compared")
    if skipped > 0.05 * steps or growths == 0:
        return measured, CONTRADICTED + " (it skips more than 5% of the steps, or never grows)"
    return measured, f"{INCONCLUSIVE} (it works; nothing here says it trains better than PyTorch's default)"


def _fp8_formats(act_e4, act_e5, grad_e4, grad_e5):
    """"E5M2 for inference, E4M3 for training": the inference half reads the forward activations' error, the
    training half the gradients' (both per-tensor scaling)."""
    measured = (f"per-tensor scaling: forward activations E4M3 error {act_e4:.3f}, E5M2 {act_e5:.3f}; gradients "
                f"E4M3 {grad_e4:.3f}, E5M2 {grad_e5:.3f}; delayed (amax-history) scaling, the usual reason for "
                "E5M2 gradients, is not measured")
    inference_wrong, training_fits = act_e4 < act_e5, grad_e4 <= grad_e5
    if inference_wrong:
        return measured, CONTRADICTED + (" (for inference E4M3 is the more accurate; E4M3 for training agrees with "
                                         "the gradients' errors)" if training_fits else
                                         " (for inference E4M3 is the more accurate)")
    return measured, INCONCLUSIVE


def _slope_is_variance(slope, se, drift, accumulates):
    """The slope of log π/μ against length: a mean drift (−sequence KL per 1K), or a growing variance? E[Σ log π/μ]
    = −Σ KL is an identity, so the slope's expectation is the drift wherever the token KL stays above zero; the fit
    only has to agree with it. Whether the fit alone could tell the drift from zero depends on the draw of 8
    sequences, so it does not decide."""
    measured = (f"SmolLM2-135M, bf16: slope of the prefix log π/μ {slope:+.2f} ± {se:.2f} per 1K tokens against "
                f"the mean drift −KL per 1K {-drift:+.2f} ({abs(slope + drift) / se:.1f} SE apart); the token KL "
                f"{'stays' if accumulates else 'is not shown to stay'} above zero at every position band")
    if accumulates and abs(slope + drift) <= 3 * se:
        return measured, CONTRADICTED + " (the slope is the mean drift, linear in length; the weight π/μ's variance is what grows)"
    return measured, INCONCLUSIVE


CLAIMS = [
    Claim("crash", "The `_amp_foreach_non_finite_check_and_unscale_cuda` … 'BFloat16' error comes from `bf16=True`.",
          "", "02_qlora_crash", ("source.bf16_builds_scaler", "source.fp16_builds_scaler", "fix.bf16.error",
                                "real.fix.bf16.error"), _crash_flag),
    Claim("crash", "trl casts the trainable parameters of a quantized (QLoRA) model to bf16.", "",
          "02_qlora_crash", ("audit.trainable_dtypes",),
          lambda dtypes: (f"trainable dtypes after building the trainer: {dtypes}",
                          CONFIRMED if dtypes == "bfloat16" else CONTRADICTED)),
    Claim("crash", "With QLoRA, trl forces an fp16 GradScaler on even when `bf16=True`.", "", "02_qlora_crash",
          ("fix.bf16.scaler_class", "source.bf16_builds_scaler"), _scaler_forced),
    Claim("crash", "Training everything in fp32 uses the least memory.", "", "02_qlora_crash",
          ("real.fix.fp32.peak_mem_mb", "real.fix.bf16.peak_mem_mb", "real.fix.fp16_fp32_trainables.peak_mem_mb",
           "fix.mem_tolerance_mb"),
          lambda f32, b16, f16, tol: (
              f"peak memory per fix on the real model (CUDA's peak allocation on a GPU, process RSS on a CPU): fp32 "
              f"{f32:.0f} MB, bf16 {b16:.0f} MB, fp16+fp32 trainables {f16:.0f} MB (differences under {tol:.1f} MB, "
              "the toy's run-to-run spread, not claimed)",
              CONFIRMED if f32 < min(b16, f16) - tol else CONTRADICTED if f32 > min(b16, f16) + tol else INCONCLUSIVE),
          device="gpu"),
    Claim("crash", "fp32 training is about 40% slower.", "", "02_qlora_crash",
          ("real.fix.fp32.it_per_s", "real.fix.fp16_fp32_trainables.it_per_s"),
          lambda f32, f16: (f"real model, it/s fp32 {f32:.2f} vs fp16=True {f16:.2f}",
                            CONFIRMED if 0.25 <= 1 - f32 / f16 <= 0.55 else CONTRADICTED), device="gpu"),
    Claim("fp16", "BF16 has 7 mantissa bits (spacing ~0.0078 at 1), FP16 10 (~0.00098).", "", "01_number_formats",
          ("eps.bfloat16", "eps.float16"),
          lambda b, f: (f"eps bf16 {b:.5f}, fp16 {f:.6f}", CONFIRMED if (b, f) == (2**-7, 2**-10) else CONTRADICTED)),
    Claim("fp16", "FP16 spans ~6e-5 to ~6e4.", "", "01_number_formats", ("tiny.float16", "max.float16"),
          lambda tiny, top: (f"smallest normal {tiny:.3g}, max {top:g}",
                             CONFIRMED if abs(tiny - 6.1e-5) < 1e-6 and top == 65504 else CONTRADICTED)),
    Claim("fp16", "`tensor(1.0009765625, fp16) == tensor(1.001, fp16)` prints False.", "", "01_number_formats",
          ("demo.fp16_1p001_equal",),
          lambda eq: (f"prints {eq}", CONTRADICTED if eq is True else CONFIRMED)),
    Claim("fp16", "FP16 cuts the sequence-level KL[μ‖π] from 7.64 (BF16) to 0.32, about 24×.",
          "Offline figure: 7.64 vs 0.32 on its model.", "04b_real_mismatch",
          ("real.ratio.bf16_over_fp16", "real.ratio.bf16_over_fp16_low", "real.ratio.bf16_over_fp16_high"), _about_24),
    Claim("paper", "FP16 removes the mismatch between a separate inference engine and trainer (vLLM and FSDP), "
          "not only within one program.", "Its FP16 runs pair vLLM with FSDP, both in FP16.", "04c_two_programs",
          ("ratio.cross_program.value", "ratio.cross_program.low", "ratio.cross_program.high",
           "ratio.cross_program_fa_off.value", "ratio.cross_program_fa_off.low", "ratio.cross_program_fa_off.high",
           "ratio.same_program.value"), _two_programs),
    Claim("fp16", "The log-ratio slope (−1.01 BF16, −0.07 FP16 per 1K tokens) is a variance that grows "
          "exponentially with length.", "Slopes −1.01 and −0.07 per 1K tokens of log(π/μ) against length.",
          "04b_real_mismatch", ("real.slope_per_1k.bf16", "real.slope_stderr_per_1k.bf16", "real.seq_kl_1k.bf16",
                                "real.accumulation.bf16.shown"), _slope_is_variance),
    Claim("fp16", "BF16 training with FP32 inference is stable ('excellent').", "", "04b_real_mismatch",
          ("real.token_kl.bf16_train_fp32_infer", "real.token_kl_stderr.bf16_train_fp32_infer", "real.token_kl.bf16",
           "real.token_kl_stderr.bf16"), _mixed_engines),
    Claim("fp16", "Precision table: AIME24 22.6 / 25.1 / 28.3 / 30.9 and 1250 / 1320 / 480 / 1450 tokens/s.",
          "Not in the paper.", "05_grpo_precision",
          ("combo.bf16_bf16.final_reward", "combo.fp16_fp16.final_reward"),
          lambda bf16, fp16: (f"final reward fp16/fp16 {fp16:.3f}, bf16/bf16 {bf16:.3f} on the lab's task; AIME scores "
                              "and A100 throughput need a reasoning model and a GPU",
                              NOT_MEASURED + " (needs AIME evaluation of a reasoning model, on a GPU)")),
    Claim("fp16", "FP16 on both engines removes most of the mismatch during RL training.", "Its central claim.",
          "05_grpo_precision", ("real.rl.long.ratio_start", "real.rl.long.ratio_end", "real.rl.long.fp16_below_bf16"),
          _fp16_during_rl),
    Claim("fp16", "BF16 MoE RL collapses after 1200 steps; FP16 reaches a 37% higher reward.",
          "MoE runs are short; FP16 modestly ahead.", "06_moe", ("grpo.steps",),
          lambda steps: (f"GRPO ran {steps} steps per precision, short of the 1200 steps claimed",
                         NOT_MEASURED + " (needs 1200+ GRPO steps of an MoE model, a GPU run)")),
    Claim("fp16", "MoE routing is more fragile in BF16.", "", "06_moe",
          ("flip_rate.bf16", "flip_rate.fp16", "flip_order_bf16_vs_fp16"),
          lambda b, f, order: (f"expert-choice flips bf16 {_pct(b)}, fp16 {_pct(f)} (compared beyond 2 Poisson standard "
                               "errors of the counts)",
                               CONFIRMED if order > 0 else CONTRADICTED if order < 0 else INCONCLUSIVE)),
    Claim("fp16", "`expert_choice_precision='fp16'` is the key parameter for MoE.", "", "06_moe",
          ("source.expert_choice_precision",),
          lambda outcome: (f"a forward call with it: {outcome}",
                           CONFIRMED if outcome == "changed the output" else CONTRADICTED)),
    Claim("fp16", "Load the MoE policy with `MixtralModel.from_pretrained(...)`.", "", "06_moe",
          ("source.mixtral_model_has_lm_head",),
          lambda head: ("MixtralModel has an LM head" if head else "MixtralModel has no LM head: it returns hidden "
                        "states, not logits", CONTRADICTED if head is False else CONFIRMED)),
    Claim("fp16", "`LoraConfig(..., precision='fp16')` selects FP16 LoRA.", "", "11_troubleshooting",
          ("row.8.reproduced",),
          lambda seen: (seen, CONTRADICTED if "TypeError" in str(seen) else INCONCLUSIVE)),
    Claim("fp16", "BF16 LoRA explodes after 600 steps; FP16 LoRA ends 15% more accurate.",
          "LoRA GRPO in BF16 degrades after several hundred steps; FP16 holds.", "07_lora",
          ("grpo.steps", "real.serving.ratio.bf16_unmerged_over_matched"),
          lambda steps, merged: (
              f"the paper's mechanism under LoRA, on SmolLM2-135M: adapters merged into a bf16 sampler give "
              f"{merged:.2f}× the matched engines' mismatch; the GRPO runs here are {steps} steps",
              NOT_MEASURED + " (needs 600+ LoRA GRPO steps, a GPU run)")),
    Claim("fp16", "FP16 needs dynamic loss scaling against gradient underflow.", "", "03_loss_scaling",
          ("underflow_fraction.unscaled",),
          lambda u: (f"activation gradients flushed to zero in fp16 without scaling: {_pct(u)}; a fixed scale "
                     "is not compared with a dynamic one here",
                     INCONCLUSIVE + " (underflow shown; that the scale must be dynamic is not tested)")),
    Claim("fp16", "Use `GradScaler(init_scale=2.**16, growth_factor=2, backoff_factor=0.5, growth_interval=200)`.", "",
          "03_loss_scaling", ("scaler.source.skipped_steps", "scaler.source.steps", "scaler.source.growths",
                              "scaler.torch_default.skipped_steps", "scaler.torch_default.growths",
                              "scaler.torch_default.growth_interval"), _scaler_recipe),
    Claim("fp16", "Compute softmax as `F.softmax(logits.float()).half()`.", "", "08_sensitive_ops",
          ("err.softmax.fp16", "err.softmax.fp16_upcast"),
          lambda direct, upcast: (f"max error in fp16 {direct:.2g}, with the recipe {upcast:.2g} (same within 5%)",
                                  REDUNDANT + " (no gain: the fp16 kernel already accumulates in fp32)"
                                  if abs(direct - upcast) <= 0.05 * direct else
                                  CONFIRMED if upcast < direct else CONTRADICTED)),
    Claim("fp16", "Adam `eps=1e-8` is more stable than the default 1e-6.", "", "08_sensitive_ops",
          ("adam.default_eps", "adam.eps_in_fp16"),
          lambda default, in16: (f"PyTorch's default is {default:g}; in fp16 it is {in16:g}",
                                 CONTRADICTED if default == 1e-8 else CONFIRMED)),
    Claim("fp16", "FP8: E5M2 for inference, E4M3 for training.", "", "09_fp8",
          ("qerr.activations.e4m3fn.tensor", "qerr.activations.e5m2.tensor", "qerr.gradients.e4m3fn.tensor",
           "qerr.gradients.e5m2.tensor"), _fp8_formats),
    Claim("fp16", "Gradient norm should stay in 0.5–5.0 and the loss scale in 2^14–2^16.", "", "03_loss_scaling",
          ("scaler.fast_growth.final_scale", "scaler.fast_growth.skipped_steps", "scaler.fast_growth.steps"),
          lambda scale, skipped, steps: (
              f"the lab model's fp16 run (dynamic scale from 2^16) ends at 2^{math.log2(scale):.0f} with {skipped} of "
              f"{steps} steps skipped; the scale settles where the largest gradient allows, a property of the model, "
              "not of fp16 (the gradient norm is not measured here)",
              INCONCLUSIVE + " (one model inside the band says nothing general)" if 14 <= math.log2(scale) <= 16
              else CONTRADICTED + " (a healthy run outside the band)" if skipped <= 0.05 * steps
              else INCONCLUSIVE + " (outside the band, but with more than 5% of its steps skipped)")),
    Claim("paper", "BF16 RL training degrades or collapses where FP16 does not.",
          "Its BF16 runs degrade or collapse; its FP16 runs do not.", "05b_sampler_precision",
          tuple(f"decisive.bf16_{k}" for k in ("basis", "seeds", "steps", "gap", "noise")) + ("decisive.effect",
                                                                                             "decisive.bf16_seq_kl"),
          _bf16_degrades),
    Claim("paper", "The mechanism: the larger the mismatch between sampler and trainer, the worse the policy "
          "RL trains on the sampler's samples (a dose–response over emulated and real formats).",
          "Attributes BF16's collapses to the mismatch between sampler and trainer.", "05b_sampler_precision",
          tuple(f"decisive.{k}" for k in ("basis", "bits", "dose_slope", "dose_slope_low", "dose_slope_high", "dose_runs",
                                          "dose_settings", "dose_effect", "gap_matched", "noise_matched", "effect",
                                          "coarse_seq_kl")),
          _coarse_degrades),
    Claim("is", "Importance-sampling corrections (token TIS) restore training under the mismatch.",
          "Its BF16 runs with these corrections train slower or less stably than FP16.", "05b_sampler_precision",
          tuple(f"decisive.{k}" for k in ("basis", "fix", "bits", "seeds", "gap_matched", "noise_matched", "gap_fix", "noise_fix",
                                          "gap_fix_vs_matched", "noise_fix_vs_matched")), _restores),
    Claim("paper", "The mechanism at the update: GRPO on the sampler's mismatched samples computes a biased update, "
          "one that loses the on-policy direction.",
          "Attributes BF16's collapses to the mismatch between sampler and trainer.", "05c_update_direction",
          tuple(f"direction.at_paper.{k}" for k in ("label", "dose", "rho", "rho_se", "power"))
          + ("direction.verdict.biased", "direction.completions_for_80"), _update_biased),
    Claim("is", "Importance-sampling corrections restore the on-policy direction of the update.",
          "Its BF16 runs with these corrections train slower or less stably than FP16.", "05c_update_direction",
          ("direction.verdict.restored", "direction.at_paper.label")
          + tuple(f"direction.at_paper.{k}" for k in ("default_change", "default_change_se", "tis_change",
                                                       "tis_change_se")) + ("direction.first_lost.label",),
          _update_restored),
    Claim("fp16", "FP16 trains faster than BF16 on A100/H100.", "", "05_grpo_precision",
          ("combo.fp16_fp16.tokens_per_s", "combo.bf16_bf16.tokens_per_s"),
          lambda f16, b16: (f"GRPO tokens/s fp16 {f16:.0f} vs bf16 {b16:.0f}",
                            CONFIRMED if f16 > 1.05 * b16 else CONTRADICTED if f16 < 0.95 * b16
                            else INCONCLUSIVE + " (within 5%)"), device="gpu"),
]


def _evaluate(claim: Claim, runs: dict) -> tuple[str, str]:
    data = runs.get(claim.chapter)
    if data is None or any(k not in data["metrics"] for k in claim.keys):
        return "not measured in this build", "–"
    return claim.judge(*(data["metrics"][k] for k in claim.keys))


def entries(root: Path) -> list[dict]:
    """Each claim with this build's measurement and verdict, and the GPU reference's measurement."""
    cpu, gpu = load_all(root / "_build" / "results"), load_all(root / "results" / "gpu")
    found = []
    for i, claim in enumerate(CLAIMS, 1):
        measured, verdict = _evaluate(claim, cpu)
        on_gpu = None
        if claim.chapter in gpu:
            env = gpu[claim.chapter]["env"]
            on_gpu = f"{_evaluate(claim, gpu)[0]} ({env.get('device_name')}, torch {env.get('torch')})"
        if claim.device == "gpu":
            run = gpu.get(claim.chapter)
            capability = (run or {}).get("provenance", {}).get("capability", "0.0")
            if run is None:
                verdict = NOT_MEASURED + " (a claim about GPUs; no GPU reference run is committed)"
            elif tuple(int(part) for part in capability.split(".")) < (8, 0):  # a T4 or V100 says nothing of A100s
                verdict = NOT_MEASURED + (f" (a claim about bf16-capable GPUs; the committed run is on "
                                          f"{run['env'].get('device_name')}, compute capability {capability})")
            else:
                verdict = _evaluate(claim, gpu)[1]
        found.append({"number": i, "claim": claim, "measured": measured, "on_gpu": on_gpu, "verdict": verdict})
    return found


# sphinx-design badge colours: the verdict is the first thing a reader looks for
BADGES = {CONFIRMED: "success", CONTRADICTED: "danger", INCONCLUSIVE: "warning", REDUNDANT: "info",
          NOT_MEASURED: "secondary", NOT_COMPARABLE: "secondary"}


def verdict_markup(verdict: str) -> str:
    """The verdict as a coloured badge, with its qualifier (the part in brackets) after it."""
    head, bracket, rest = verdict.partition(" (")
    if head not in BADGES:
        return verdict
    return f"{{bdg-{BADGES[head]}}}`{head}`" + (f" ({rest}" if bracket else "")


def page(root: Path) -> str:
    """The ledger as a MyST Markdown page: one row per claim, the verdict right after its number."""
    found, rows = entries(root), []
    for entry in found:
        claim = entry["claim"]
        said = f"{claim.says} *({SOURCES[claim.source]}{'; the paper: ' + claim.paper if claim.paper else ''})*"
        measured = entry["measured"] + (f"; **on a GPU:** {entry['on_gpu']}" if entry["on_gpu"] else "")
        link = f"[{claim.chapter.split('_')[0]}](../chapters/{claim.chapter}.ipynb)"
        rows.append([entry["number"], verdict_markup(entry["verdict"]), said, measured, link])
    counts = Counter(entry["verdict"].split(" (")[0].replace("–", "without results in this build")
                     for entry in found)
    built = load_all(root / "_build" / "results")
    versions = next(iter(built.values()))["env"] if built else {}
    profiles = sorted({r.get("profile", "?") for r in built.values()}) or ["no"]
    return "\n".join([
        "# Claims ledger", "",
        "Every quantitative or technical claim of the two source articles, and of the papers behind them, "
        "that this book checks. The *measured* column is read from this build's results files "
        f"({' and '.join(f'`{p}`' for p in profiles)} profile, "
        f"{versions.get('device_name', 'unknown device')}, torch {versions.get('torch', '?')}, trl "
        f"{versions.get('trl', '?')}); GPU measurements, where shown, from committed reference runs in `results/gpu/`. "
        "Each verdict is computed from the chapter's own measurement and its noise: *confirmed* or *contradicted* "
        "(a difference beyond the measurement's noise), *contradicted* also where there is no difference and the "
        "measurement had at least 80% power to see the smallest effect that matters (the cell says which) and "
        "the mismatch reached at least a tenth of the paper's, "
        "*inconclusive* (within the noise, without that power or below that mismatch; the cell says which), "
        "*not measured here* (nothing this book runs here can decide it; the verdict says what it needs), "
        "*not comparable here* (a figure of the paper's own model and GPUs, shown beside the nearest measurement "
        "here, which cannot decide it), "
        "or *redundant* (a recipe that is harmless and changes nothing). Each measured cell names the threshold "
        "its verdict uses.", "",
        "Claims about GPUs (speed on an A100 or H100) are judged only on committed GPU reference results, "
        "and read *not measured here* until one exists. Every other verdict is judged on this build's "
        "results; a GPU result, where one exists, is shown beside it and does not change it.", "",
        "In this build: " + ", ".join(f"{n} {verdict}" for verdict, n in counts.most_common()) + ".", "",
        "```{table}", ":class: claims-ledger", "",  # book.css lays it out for the screen, a phone and print
        table(["#", "verdict", "the claim (source)", "measured", "chapter"], rows), "```", ""])
