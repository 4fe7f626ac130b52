"""Every chapter executed by papermill in the cpu profile, and its results file checked."""
import json
import math
import os
import re
from pathlib import Path

import pytest

from labutils import mismatch_rl, profiles
from bookbuild import pipeline

# `make kernels-check` points the metric tests at chapters it executed under another kernel set
CHECKED = os.environ.get("LAB_CHECK_RESULTS")
RESULTS = Path(CHECKED) if CHECKED else pipeline.BUILD / "results"
if not CHECKED:
    pytestmark = pytest.mark.usefixtures("book_executed")  # every test here reads the executed book


def metrics_of(stem: str) -> dict:
    """This build's metrics of `stem`, refused unless they were written by the current source in the cpu profile."""
    data = json.loads((RESULTS / f"{stem}.json").read_text())
    assert data.get("fingerprint") == pipeline.fingerprint(stem, {"profile": "cpu"}), \
        f"{stem}: the results on disk do not belong to this source and profile; execute it again"
    return data["metrics"]


ENV_KEYS = {"python", "torch", "transformers", "trl", "peft", "bitsandbytes", "accelerate", "gguf",
            "device", "device_name", "cuda", "cpu", "kernels"}
REQUIRED_METRICS = {
    "00_lab": ["accuracy.dense", "accuracy.moe", "task.max_completion_tokens"],
    "01_number_formats": ["eps.bfloat16", "eps.float16", "eps.float32", "max.float16", "tiny.float16",
                          "demo.fp16_1p001_equal", "demo.bf16_1p008_equal"],
    "02_qlora_crash": ["audit.mixed_precision", "audit.trainable_dtypes", "audit.scaler", "audit.scaler_class",
                       "audit.base_input_dtype", "audit.lora_input_dtype", "audit.adam_state_dtypes", "crash.error",
                       "crash.device", "sibling.error", "preflight.crash_config_findings", "fix.mem_spread_mb",
                       "fix.mem_tolerance_mb", "fix.mem_label", "fix.lowest_memory", "fix.model_mb",
                       "fix.mem_gap_mb"]
    + [f"preflight.fix_findings.{fix}" for fix in ("fp32", "bf16", "fp16_fp32_trainables")]
    + [f"fix.{fix}.{m}" for fix in ("fp32", "bf16", "fp16_fp32_trainables")
       for m in ("peak_mem_mb", "peak_mem_spread_mb", "rss_before_train_mb", "it_per_s", "tokens_per_s",
                 "final_reward", "mixed_precision", "autocast", "scaler_class", "trainables_built", "trainables",
                 "base_input_dtype", "lora_input_dtype", "adam_state_dtypes", "error")]
    + ["real.fix_model"] + [f"real.fix.{fix}.{m}" for fix in ("fp32", "bf16", "fp16_fp32_trainables")
                            for m in ("peak_mem_mb", "it_per_s", "final_reward", "model_mb", "trainables_built")],
    "04_mismatch": ["max_len", "ratio.kl_bf16_over_fp16", "ratio.bf16_fp32_over_bf16_bf16", "grid.worst",
                    "grid.worst_token_kl", "weights.bf16_relative_rounding_bound", "weights.bf16_max_relative_rounding",
                    "exercise.drift_exceeds_spread_tokens", "exercise.sequences_to_resolve_slope",
                    "exercise.temperature_07.token_kl"]
    + [f"{m}.{p}" for m in ("kl", "k1", "k3", "k1_stderr", "k3_stderr", "token_chi2", "slope_per_1k",
                            "slope_stderr_per_1k", "token_kl") for p in ("fp32", "bf16", "fp16")]
    + [f"engine_weight_dtypes.{p}.{e}" for p in ("fp32", "bf16", "fp16") for e in ("inference", "training")]
    + [f"estimator.{p}.{k}.z" for p in ("fp32", "bf16", "fp16") for k in ("k1", "k3")]
    + [f"slope_ses.{p}.{k}" for p in ("fp32", "bf16", "fp16") for k in ("from_drift", "from_zero")]
    + [f"weight.{p}.len_q{q}.{m}" for p in ("bf16", "fp16") for q in (1, 2, 3, 4)
       for m in ("count", "mean_length", "mean", "mean_stderr", "variance", "predicted_variance", "median",
                 "predicted_median")]
    + [f"exercise.batching.{p}.max_abs_logprob_change" for p in ("fp32", "bf16")]
    + [f"grid.{t}_{i}.token_kl" for t in ("fp32", "bf16", "fp16") for i in ("fp32", "bf16", "fp16")],
    "04b_real_mismatch": ["real.model", "real.parameters", "real.vocab_size", "real.max_len",
                          "real.ratio.bf16_over_fp16", "perf.real.sample_over_forward.bf16",
                          "perf.real.sample_over_forward.fp16", "real.token_kl.bf16_train_fp32_infer",
                          "real.token_kl_stderr.bf16_train_fp32_infer", "real.bf16_train_fp32_infer_vs_bf16",
                          "real.trl_is.bf16_long_over_short", "real.trl_is.bf16_long_downweighted",
                          "real.accumulation.shown", "real.accumulation.contradicted",
                          "real.accumulation.sequences", "real.accumulation.bf16.last_band_z",
                          "real.accumulation.fp16.last_band_z"]
    + [f"real.accumulation.{p}.band_{i * n // 4}_{(i + 1) * n // 4}.{m}"
       for p, n in (("bf16", profiles.PROFILES["cpu"].real.length),
                    ("fp16", profiles.PROFILES["cpu"].real.short_length))
       for i in range(4) for m in ("kl", "se")]
    + [f"real.{m}.{p}" for m in ("token_kl", "token_kl_stderr", "k3", "k3_stderr", "seq_kl_1k", "slope_per_1k",
                                 "slope_stderr_per_1k") for p in ("fp32", "bf16", "fp16")],
    "05_grpo_precision": [f"combo.{c}.{m}" for c in ("bf16_bf16", "bf16_fp16", "fp16_fp16", "fp16_fp16_unscaled",
                                                      "fp32_fp32", "bf16_bf16_tis", "bf16_bf16_mis")
                          for m in ("final_reward", "mean_kl", "max_grad_norm", "tokens_per_s", "loss_scaler")]
    + ["combo.fp16_fp16.loss_scale_final", "combo.fp16_fp16.skipped_steps", "combo.bf16_bf16_tis.corrected_fraction",
       "flushed_fraction.fp16_without_scaler", "first_batch_identical", "reward_spread", "seed_spread.final_reward",
       "seed_spread.seeds", "seed_spread.mean_kl_min", "seed_spread.mean_kl_max", "ratio.kl_bf16_over_fp16",
       "ratio.kl_bf16_fp16_over_bf16_bf16", "autocast.linear.equals_rounded_inputs",
       "autocast.linear.equals_rounded_output", "autocast.residual_dtype", "autocast.linear_output_dtype"]
    + [f"real.rl.{pair}.{m}" for pair in ("fp32_fp32", "bf16_bf16", "fp16_fp16")
       for m in ("k3_first", "k3_last", "eval_start", "eval_end", "well_formed_start")]
    + ["real.rl.long.lr", "real.rl.long.steps"]
    + [f"real.rl.long.{pair}.{m}" for pair in ("fp32_fp32", "bf16_bf16", "fp16_fp16")
       for m in ("probe_kl_start", "probe_kl_end", "probe_kl_change", "probe_kl_change_se", "seeds", "seeds_agree",
                 "drift_end", "eval_start", "eval_end")],
    "04c_two_programs": ["live.kl.llamacpp_f32_fa_off.kl", "live.kl.llamacpp_f32.kl", "live.kl.torch_fp16.kl",
                         "ratio.same_program.value", "ratio.cross_program.value", "ratio.cross_program.low",
                         "ratio.cross_program_fa_off.value", "ratio.fp16_over_flash.value", "flash_share",
                         "growth.flash.change", "growth.flash.low", "cross.llamacpp_f32_fa_off.torch_fp32.token_kl",
                         "cross.llamacpp_bf16.torch_bf16.token_kl", "cross.llamacpp_f16.torch_fp16.token_kl",
                         "cross.llamacpp_f32.torch_fp32.token_kl", "cross.llamacpp_q8_0.torch_fp32.token_kl",
                         "cross.llamacpp_q4_0.torch_fp32.token_kl", "cross.torch_fp8.torch_fp32.token_kl",
                         "speed.llamacpp_f32", "speed.torch_fp32", "atlas.baseline.token_kl",
                         "atlas.top_p_0_9.ratio", "atlas.temperature_0_7_logprobs_raw.token_kl",
                         "atlas.fp32_head_both.ratio_low", "atlas.sampler_llama_cpp_bf16_flash_attention_off.ratio"],
    "05c_update_direction": ["coupling.mean_first_difference.bf16_same_seed", "live.bf16.dose",
                             "direction.verdict.biased", "direction.verdict.restored", "direction.at_paper.power",
                             "direction.at_paper.rho", "direction.at_paper.rho_se", "direction.bf16.dose",
                             "direction.bf16.none.rho", "direction.bf16.none.orth", "direction.completions",
                             "direction.per_token_dose.bf16"],
    "05b_sampler_precision": [f"dial.{m}.{k}" for m in (10, 7, 5, 4, 3, 2) for k in ("token_kl", "seq_kl_1k")]
    + ["dial.fp8_e4m3.token_kl"] + [f"bias.{m}.cosine" for m in (7, 4, 2)]
    + [f"rl.{run}.{m}" for run in mismatch_rl.runs_at(profiles.PROFILES["cpu"].sampler.bits)
       for m in ("final_reward", "score", "mean_kl", "max_grad_norm", "ess_mean", "collapsed_seeds", "seeds")]
    + [f"decisive.{k}" for k in ("gap_matched", "noise_matched", "gap_fix", "noise_fix", "bf16_gap", "bf16_noise",
                                 "effect", "bits", "dose_slope", "dose_slope_low", "dose_slope_high")]
    # the long run's figures, under the names its issue asked for
    + [f"long.lr_sweep.{lr:.0e}.{k}" for lr in profiles.PROFILES["cpu"].sampler.long.lrs
       for k in ("fp32_min_dip", "fp32_improved_seeds")]
    + ["long.chosen_lr", "long.eval_problems", "long.kl_rises_before_collapse", "long.collapses",
       "long.fp32.collapsed_seeds", "long.m2.collapsed_seeds", "long.m2_tis.collapsed_seeds", "long.bf16.collapsed_seeds"]
    + [f"long.dose.{k}" for k in ("slope", "slope_low", "slope_high", "runs")]
    + [f"long.power.{k}" for k in ("seeds_needed", "achieved")]
    + [f"real.dial.{m}.{k}" for m in ("bf16", "7", "fp8_e4m3") for k in ("token_kl", "seq_kl_1k", "seq_kl_1k_stderr")]
    + [f"real.dial.ratio.{r}.{k}" for r in ("bf16_over_m7", "fp8_over_bf16") for k in ("value", "low", "high", "toy")],
    "06_moe": [f"flip_rate.{p}" for p in ("fp32", "bf16", "fp16")] + [f"kl.{p}" for p in ("fp32", "bf16", "fp16")]
    + [f"flip_rate.router_fp32.{p}" for p in ("bf16", "fp16")]
    + [f"grpo.{p}.{m}" for p in ("bf16", "fp16") for m in ("final_reward", "mean_kl", "mean_flip_rate")],
    "03_loss_scaling": ["underflow_fraction.unscaled", "underflow_fraction.scaled", "scaler.skipped_steps",
                        "scaler.final_scale", "scaler.source.skipped_steps", "scaler.fast_growth.final_scale",
                        "clip.sgd.predicted_ratio", "clip.read_over_true"]
    + [f"scaler.{s}.{m}" for s in ("every_5", "source", "verl", "torch_default") for m in ("growths", "skipped_steps")]
    + [f"clip.{o}.{order}.{m}" for o in ("sgd", "adamw") for order in ("unscaled", "scaled")
       for m in ("norm_read", "true_norm", "update_norm", "steps_taken")]
    + [f"clip.{o}.update_ratio_right_over_wrong" for o in ("sgd", "adamw")],
    "08_sensitive_ops": [f"err.{op}.{d}" for op in ("softmax", "log_softmax", "layer_norm", "rms_norm",
                                                     "attention_logits", "sum") for d in ("bf16", "fp16")]
    + ["adam.eps_in_fp16", "adam.default_eps", "adam.eps_floor", "err.logsumexp.bf16"]
    + [f"adam.eps_rule.{e}.step_over_lr" for e in ("1e-7", "1e-4", "floor")]
    + [f"activation.{p}.{m}" for p in ("residual", "attention_scores", "mlp_hidden") for m in ("max", "headroom")]
    + [f"overflow.{p}.{m}" for p in ("residual", "attention_scores", "mlp_hidden")
       for m in ("first_log2", "predicted_log2", "where")]
    + ["overflow.matches", "activation.residual.max_over_median", "fp16_costs.flushed_gradients.weights",
       "fp16_costs.flushed_gradients.activations", "fp16_costs.adam_v_flushed"],
    "09_fp8": [f"qerr.{t}.{f}.{s}" for t in ("weights", "activations", "gradients") for f in ("e4m3fn", "e5m2")
               for s in ("none", "tensor", "block")] + ["matmul.outcome", "cast.torch", "cast.e4m3fn.behaviour"]
    + [f"real.qerr.weights.{f}.{s}" for f in ("e4m3fn", "e5m2") for s in ("none", "tensor", "block")],
    "10_scaling_out": ["ddp.world_size", "ddp.final_reward", "single.final_reward", "deepspeed.zero_stage",
                       "fsdp.with_policy.reduce_dtype", "fsdp.scaler_class"],
    "11_troubleshooting": ["rows", "reproduced", "predicted", "row.8.reproduced"]
    + [f"row.{i}.symptom_seen" for i in range(1, 11)],
    "07_lora": [f"lost_update_fraction.{d}" for d in ("bf16", "fp16", "fp16_compute", "fp32")]
    + [f"grpo.{d}.{m}" for d in ("bf16", "fp16", "fp16_compute", "fp32") for m in ("final_reward", "max_grad_norm")]
    + ["fp16.v_flush_bound", "fp16.adam_v_underflow_fraction", "serving.merge.relative_delta",
       "serving.merge.moved_share.bf16", "serving.ratio.bf16_unmerged_over_matched"]
    + [f"serving.token_kl.{s}.{t}" for s in ("bf16", "fp16", "fp32")
       for t in ("merged", "unmerged_bf16", "unmerged_bf16_fp32_adapters", "unmerged_fp16", "unmerged_fp32")]
    + ["real.serving.model", "real.serving.moved_share_bf16", "real.serving.token_kl.merged",
       "real.serving.token_kl.unmerged_bf16", "real.serving.ratio.bf16_unmerged_over_matched"],
}


@pytest.mark.chapter
@pytest.mark.parametrize("stem", pipeline.chapters())
def test_chapter_executes_and_writes_results(stem, book_executed):
    assert stem not in book_executed, book_executed
    data = json.loads((pipeline.BUILD / "results" / f"{stem}.json").read_text())
    assert data["chapter"] == stem and data["profile"] == "cpu"
    assert set(data["env"]) == ENV_KEYS and data["seconds"] > 0
    missing = [k for k in REQUIRED_METRICS.get(stem, []) if k not in data["metrics"]]
    assert not missing, f"{stem} did not record {missing}"


def test_lab_models_leave_room_for_rl():
    metrics = metrics_of("00_lab")
    for kind in ("dense", "moe"):
        assert 0.2 < metrics[f"accuracy.{kind}"] < 0.95, metrics[f"accuracy.{kind}"]


def test_number_format_demos_as_measured():
    metrics = metrics_of("01_number_formats")
    assert metrics["demo.fp16_1p001_equal"] is True  # the source claims False
    assert metrics["demo.fp16_separates_1_and_1p001"] and not metrics["demo.bf16_separates_1_and_1p001"]


def test_qlora_crash_audit_and_fixes():
    metrics = metrics_of("02_qlora_crash")
    fixes = ("fp32", "bf16", "fp16_fp32_trainables")
    assert metrics["audit.trainable_dtypes"] == "bfloat16"  # trl's cast, whatever fp16 says
    assert metrics["audit.lora_input_dtype"] == "bfloat16"  # peft computes the adapters in their own dtype
    assert metrics["sibling.error"] == "Attempting to unscale FP16 gradients."
    assert metrics["preflight.crash_config_findings"] >= 1
    for fix in fixes:
        assert metrics[f"fix.{fix}.error"] == "none"
        assert metrics[f"fix.{fix}.trainables_built"] == "bfloat16"  # trl casts in every fix, flags or not
        assert metrics[f"fix.{fix}.peak_mem_mb"] > metrics[f"fix.{fix}.rss_before_train_mb"] > 0
        assert metrics[f"fix.{fix}.repeat_same_rewards"] is True  # each fix's processes trained identically
    for fix in ("fp32", "fp16_fp32_trainables"):  # cast back: the adapters and their Adam state are fp32
        assert metrics[f"fix.{fix}.lora_input_dtype"] == metrics[f"fix.{fix}.adam_state_dtypes"] == "float32"
    assert metrics["fix.bf16.lora_input_dtype"] == "bfloat16" and metrics["fix.bf16.scaler_class"] == "none"
    assert metrics["fix.mem_spread_mb"] < 50  # one process per fix: its peak does not depend on what ran before
    if metrics["audit.scaler_class"] == "none":  # the CPU: nothing crashes, and fp16=True is not fp32
        assert metrics["crash.error"] == "none" and metrics["kernel.cpu.bfloat16"] is True
        assert metrics["audit.native_amp"] is False and metrics["audit.base_input_dtype"] == "float32"
        assert metrics["audit.adam_state_dtypes"] == "bfloat16"
        # fp16=True changed nothing there: the two fp32-adapter fixes ran the same computation
        assert metrics["fix.fp16_fp32_trainables.autocast"] is False
        assert metrics["fix.fp32_and_fp16_fp32_trainables_same_rewards"] is True
    else:
        assert "not implemented for 'BFloat16'" in metrics["crash.error"]
    for fix in fixes:  # the real model: trl's cast holds there too, and every fix trains
        assert metrics[f"real.fix.{fix}.error"] == "none"
        assert metrics[f"real.fix.{fix}.trainables_built"] == "bfloat16"
        assert metrics[f"real.fix.{fix}.peak_mem_mb"] > metrics[f"real.fix.{fix}.rss_before_train_mb"] > 0
    assert metrics["real.fix.bf16.trainables"] == "bfloat16" and metrics["real.fix.fp32.trainables"] == "float32"
    # fp32 compute loads the unquantized parts in fp32: more state than the bf16 fix's
    assert metrics["real.fix.fp32.model_mb"] > metrics["real.fix.bf16.model_mb"]


def test_mismatch_orders_the_precisions():
    metrics = metrics_of("04_mismatch")
    assert metrics["token_kl.fp32"] < 1e-8 < metrics["token_kl.fp16"] < metrics["token_kl.bf16"]
    assert metrics["ratio.kl_bf16_over_fp16"] > 4  # three more mantissa bits: errors ~8x smaller
    # both engines are pure-dtype copies: no fp32 master weights under autocast (that is chapter 5)
    for p, dtype in (("fp32", "float32"), ("bf16", "bfloat16"), ("fp16", "float16")):
        assert metrics[f"engine_weight_dtypes.{p}.inference"] == metrics[f"engine_weight_dtypes.{p}.training"] == dtype
    # k3 is the low-variance estimator; near the KL χ² ≈ 2·KL
    for p in ("bf16", "fp16"):
        assert 0 < metrics[f"k3_stderr.{p}"] < metrics[f"k1_stderr.{p}"]
        assert 1.5 < metrics[f"token_chi2.{p}"] / metrics[f"token_kl.{p}"] < 2.5
    # the importance weight: mean 1 within its noise, variance near (1+χ²)^n − 1 and growing with length
    for p in ("bf16", "fp16"):
        for q in (1, 2, 3, 4):
            w = {m: metrics[f"weight.{p}.len_q{q}.{m}"] for m in ("mean", "mean_stderr", "count")}
            assert w["count"] >= 5 and abs(w["mean"] - 1) < 4 * w["mean_stderr"]
    for q in (1, 2, 3, 4):  # bf16's weights spread more than fp16's at every length (chi² ~60× larger)
        assert metrics[f"weight.bf16.len_q{q}.variance"] > metrics[f"weight.fp16.len_q{q}.variance"]
    # the grid: the worst cell is a mixed pair; bf16 weights against fp32 ones
    # are far from the matched bf16 pair; no bf16 weight moved by more than half its spacing
    train, inference = metrics["grid.worst"].split("_")
    assert train != inference
    # weights rounded on one side only: beyond the matched pair's mismatch by 3 standard errors of the difference
    mixed, same = ("grid.bf16_fp32", "grid.bf16_bf16")
    assert metrics[f"{mixed}.token_kl"] - metrics[f"{same}.token_kl"] > 3 * math.hypot(
        metrics[f"{mixed}.token_kl_stderr"], metrics[f"{same}.token_kl_stderr"])
    assert 0 < metrics["weights.bf16_max_relative_rounding"] <= 2**-8  # round to nearest: half bf16's spacing at 1
    assert metrics["exercise.drift_exceeds_spread_tokens"] > metrics["max_len"]


def check_real_mismatch(metrics: dict) -> None:
    """The physics of chapter 4b's numbers, each against the standard errors the chapter records."""
    kl = {p: (metrics[f"real.token_kl.{p}"], metrics[f"real.token_kl_stderr.{p}"]) for p in ("fp32", "bf16", "fp16")}
    # fewer mantissa bits, more mismatch: each gap beyond 3 standard errors of the two values
    for low, high in (("fp32", "fp16"), ("fp16", "bf16")):
        assert kl[high][0] - kl[low][0] > 3 * math.hypot(kl[high][1], kl[low][1]), (low, high)
    for p in ("bf16", "fp16"):
        # k3 estimates the exact token KL from the sampled tokens alone, unbiased: within 3 of its standard errors
        k3, se = metrics[f"real.k3.{p}"], metrics[f"real.k3_stderr.{p}"]
        assert abs(k3 - kl[p][0]) < 3 * math.hypot(se, kl[p][1]), p
        assert metrics[f"real.seq_kl_1k.{p}"] == pytest.approx(1000 * kl[p][0])
    # the bf16 slope is the mean drift, minus the sequence KL per 1K tokens, within 3 of its standard errors
    slope, se = metrics["real.slope_per_1k.bf16"], metrics["real.slope_stderr_per_1k.bf16"]
    assert abs(slope + metrics["real.seq_kl_1k.bf16"]) < 3 * se
    ratio = metrics["real.ratio.bf16_over_fp16"]
    assert metrics["real.ratio.bf16_over_fp16_low"] < ratio < metrics["real.ratio.bf16_over_fp16_high"]


def test_real_model_mismatch_follows_the_mantissa():
    metrics = metrics_of("04b_real_mismatch")
    assert metrics["real.model"].startswith("SmolLM2-135M-Instruct") and metrics["real.vocab_size"] == 49152
    assert metrics["real.max_len"] >= 1000
    check_real_mismatch(metrics)


def test_the_physics_checks_fail_when_bf16_and_fp16_are_swapped():
    """A suite that passes with bf16's and fp16's results exchanged has stopped testing the physics."""
    metrics = metrics_of("04b_real_mismatch")
    swapped = dict(metrics)
    for key in metrics:
        for a, b in (("bf16", "fp16"), ("fp16", "bf16")):
            if key.endswith(f".{a}") and key[: -len(a)] + b in metrics:
                swapped[key] = metrics[key[: -len(a)] + b]
    with pytest.raises(AssertionError):
        check_real_mismatch(swapped)


def test_grpo_engines_run_in_their_precisions():
    metrics = metrics_of("05_grpo_precision")
    # on the real model too: fp32 engines agree to rounding noise (~1e-10), 16-bit ones (1e-5 and up) do not
    for step in ("k3_first", "k3_last"):
        assert metrics[f"real.rl.fp32_fp32.{step}"] < 1e-8 < min(metrics[f"real.rl.{p}.{step}"] for p in ("bf16_bf16", "fp16_fp16"))
    # the committed long run's probe, read as the run's own analysis reads it: an exact KL is rounding noise in
    # fp32 and the paper's order in 16 bits
    long_run = "real.rl.long.{}.probe_kl_{}"
    for when in ("start", "end"):
        fp32, fp16, bf16 = (metrics[long_run.format(p, when)] for p in ("fp32_fp32", "fp16_fp16", "bf16_bf16"))
        assert abs(fp32) < fp16 / 100 and fp16 < bf16
    for combo, dtype in [("bf16_bf16", "bfloat16"), ("fp16_fp16", "float16"), ("fp16_fp16_unscaled", "float16"),
                         ("fp32_fp32", "float32")]:
        assert metrics[f"combo.{combo}.logits_dtype"] == dtype  # the training engine is really that precision
    # fp32 engines differ by fp32 rounding only, far below any 16-bit pair (the 16-bit order is chapter 5's own test)
    assert metrics["combo.fp32_fp32.mean_kl"] < 1e-3 * min(metrics["combo.fp16_fp16.mean_kl"],
                                                           metrics["combo.bf16_bf16.mean_kl"])
    assert metrics["combo.bf16_bf16_mis.is_weight_mean"] > 0
    # autocast rounds the matmul's inputs, not its output, and leaves the residual stream in fp32
    assert metrics["autocast.linear.equals_rounded_inputs"] is True
    assert metrics["autocast.linear.equals_rounded_output"] is False
    assert metrics["autocast.residual_dtype"] == "float32" and metrics["autocast.linear_output_dtype"] == "bfloat16"
    # every fp16 engine but the labelled one trains with a loss scaler; bf16 and fp32 need none
    assert metrics["combo.fp16_fp16.loss_scaler"] == "GradScaler"
    assert metrics["combo.fp16_fp16_unscaled.loss_scaler"] == "none" == metrics["combo.bf16_bf16.loss_scaler"]
    assert metrics["combo.fp16_fp16.skipped_steps"] < 4 and metrics["combo.fp16_fp16.loss_scale_final"] >= 2.0**12
    assert metrics["first_batch_identical"] is True  # the flushed fraction compares gradients of one batch
    assert 0.0 <= metrics["flushed_fraction.fp16_without_scaler"] < 0.5
    # a run differs in reward only when its gap from bf16_bf16 exceeds bf16_bf16's own seed range
    gaps = {k: v for k, v in metrics.items() if k.startswith("reward_gap_from_bf16_bf16.")}
    assert len(gaps) == 6
    assert metrics["reward_beyond_seed_spread"] == sum(abs(g) > metrics["seed_spread.final_reward"] for g in gaps.values())
    # the KL order is called settled only when it holds and each gap exceeds the bf16_bf16 seeds' factor
    order = {k: metrics[f"kl_order.{k}"] for k in ("ordered", "settled")}
    order.update({k: float(metrics[f"kl_order.{k}"]) for k in ("seed_factor", "fp16_below_lowest_bf16_seed",
                                                               "fp16_over_fp32")})  # "inf" is stored as text
    assert order["settled"] == (order["ordered"] and order["fp16_below_lowest_bf16_seed"] > order["seed_factor"]
                                and order["fp16_over_fp32"] > order["seed_factor"])


def test_sampler_dial_orders_the_mismatch_and_the_runs_are_evaluated():
    metrics = metrics_of("05b_sampler_precision")
    assert metrics["emulation.m7_vs_bf16_differences"] == 0 and metrics["emulation.m10_vs_fp16_differences"] == 0
    kl = [metrics[f"dial.{m}.token_kl"] for m in (10, 5, 2)]  # 3 bits apart: ~64× each, far beyond the noise
    assert kl == sorted(kl) and kl[0] > metrics["dial.fp32.token_kl"]  # fewer mantissa bits, more mismatch
    assert 2 < metrics["dial.factor_per_bit"] < 8  # about 4 per bit: a KL is quadratic in the rounding error
    assert metrics["dial.fp16.token_kl_on_task"] < metrics["dial.bf16.token_kl_on_task"] < metrics["dial.fp8_e4m3.token_kl_on_task"]
    # on the real model: FP8's Linear layers (3 mantissa bits) against bf16's 7, beyond 3 combined standard errors
    real = {m: (metrics[f"real.dial.{m}.seq_kl_1k"], metrics[f"real.dial.{m}.seq_kl_1k_stderr"]) for m in ("bf16", "fp8_e4m3")}
    assert real["fp8_e4m3"][0] - real["bf16"][0] > 3 * math.hypot(real["fp8_e4m3"][1], real["bf16"][1])
    for r in ("bf16_over_m7", "fp8_over_bf16"):  # each ratio inside its own interval
        assert metrics[f"real.dial.ratio.{r}.low"] < metrics[f"real.dial.ratio.{r}.value"] < metrics[f"real.dial.ratio.{r}.high"]
    roles = mismatch_rl.roles(profiles.PROFILES["cpu"].sampler.bits)
    coarse, fix = roles["uncorrected"], roles["fix"]
    assert metrics["rl.fp32.ess_mean"] > metrics[f"rl.{coarse}.ess_mean"]  # the coarse sampler's weights spread out
    assert metrics["rl.fp32.mean_kl"] < 1e-9 < metrics[f"rl.{coarse}.mean_kl"]
    assert metrics[f"rl.{coarse}.corrected_mean"] == 0  # the uncorrected run corrects nothing
    beyond = [m for m in ("7", "4", "2")
              if float(metrics[f"bias.{m}.relative_bias_sq"])
              > metrics["bias.detection_z"] * float(metrics[f"bias.{m}.relative_bias_sq_stderr"])]
    assert metrics["bias.detected_at"] == (",".join(beyond) or "none")  # the sentence's claim is the measured one


def test_the_long_run_decides_at_the_largest_stable_rate_and_its_dose_reading_follows_its_interval():
    from labutils import rl_analysis

    metrics = metrics_of("05b_sampler_precision")
    assert metrics["decisive.basis"] == "long run"  # the committed file was made by this code
    stable = {float(k.split(".")[2]): v for k, v in metrics.items() if k.startswith("long.lr_sweep.") and k.endswith(".stable")}
    assert metrics["long.chosen_lr"] == pytest.approx(max(lr for lr, ok in stable.items() if ok))
    low, high = metrics["long.dose.slope_low"], metrics["long.dose.slope_high"]
    assert low <= metrics["long.dose.slope"] <= high
    excludes_zero = low > 0 or high < 0
    assert (metrics["long.dose.conclusion"] == rl_analysis.DIFFERENCE) == excludes_zero
    assert metrics["long.kl_rises_before_collapse"] <= metrics["long.collapses"]
    assert metrics["long.power.seeds_run"] <= max(metrics["long.power.seeds_needed"],
                                                   profiles.PROFILES["cpu"].sampler.long.max_fix_seeds)


def test_moe_routing_flips_follow_precision():
    metrics = metrics_of("06_moe")
    assert metrics["flip_rate.fp32"] == 0.0
    assert 0 <= metrics["flip_rate.fp16"] < 0.05 and 0 < metrics["flip_rate.bf16"] < 0.05
    assert metrics["source.expert_choice_precision"] == "ignored"  # what the chapter's prose reads
    assert metrics["bf16.abs_log_ratio_flipped"] > metrics["bf16.abs_log_ratio_unflipped"]
    assert 0 < metrics["kl_share_from_flips.bf16"] <= 1
    for p in ("bf16", "fp16"):  # routing in fp32 leaves the flips whose inputs already differ
        assert 0 <= metrics[f"flip_rate.router_fp32.{p}"] < 0.05
        assert metrics[f"replay.{p}.flip_rate"] == 0.0  # replayed routing cannot flip
    assert metrics["replay.bf16.kl_kept"] < 1  # removing the flips removes part of the mismatch


def test_lora_loses_updates_by_adapter_dtype():
    metrics = metrics_of("07_lora")
    assert metrics["lost_update_fraction.fp32"] < 1e-3 < metrics["lost_update_fraction.bf16"]
    assert metrics["lost_update_fraction.fp16_compute"] < 1e-3  # fp32 adapters under fp16 compute
    assert metrics["predicted_lost_at_1e_5.bfloat16"] > metrics["predicted_lost_at_1e_5.float16"]
    # the half-ulp rule against the measurement, entry by entry, over the runs that did not diverge
    rule = {k: metrics[f"rule.{k}"] for k in ("meant", "lost", "lost_not_predicted", "predicted_not_lost", "runs_checked")}
    assert 0 < rule["runs_checked"] <= 8 and rule["meant"] > 0
    assert 0 <= rule["lost_not_predicted"] <= rule["lost"] <= rule["meant"]
    assert (rule["lost_not_predicted"] + rule["predicted_not_lost"]) / rule["meant"] < 1e-3  # the rule holds, nearly
    # the flush bound the chapter computes is where torch's fp16 AdamW really starts keeping v
    below = "fp16_adam_step.largest_fp16_at_or_below_the_bound"
    above = "fp16_adam_step.smallest_fp16_above_the_bound"
    assert metrics[f"{below}.grad"] <= metrics["fp16.v_flush_bound"] < metrics[f"{above}.grad"]
    assert metrics[f"{below}.v"] == 0.0 and metrics[f"{below}.weight"] == "-inf"
    assert metrics[f"{above}.v"] > 0.0 and 0.99 < metrics[f"{above}.weight"] < 1.0
    assert metrics["fp16_adam_step.5e-3.weight"] == "-inf"
    # merging the adapters into a bf16 sampler adds a mismatch beyond the engines'; fp16 shrinks it,
    # and in fp32 the merged sampler and the unmerged trainer are the same policy
    kl = {(s, t): metrics[f"serving.token_kl.{s}.{t}"] for s in ("bf16", "fp16", "fp32")
          for t in ("merged", "unmerged_bf16", "unmerged_fp16", "unmerged_fp32")}
    assert metrics["serving.merge.moved_share.bf16"] > 0.01  # the trained adapters are large enough to matter
    assert kl[("bf16", "unmerged_bf16")] > 10 * kl[("bf16", "merged")]
    assert kl[("fp16", "unmerged_fp16")] < kl[("bf16", "unmerged_bf16")] / 4
    assert abs(kl[("fp32", "unmerged_fp32")]) < 1e-8 < kl[("bf16", "unmerged_fp32")]
    # on the real model the same merge moves as many bf16 values, and the ratio's interval brackets its centre
    real = "real.serving.ratio."
    assert metrics["real.serving.moved_share_bf16"] > 0.01
    assert metrics[f"{real}low"] <= metrics[f"{real}bf16_unmerged_over_matched"] <= metrics[f"{real}high"]


def test_toolkit_chapters_measure_what_they_claim():
    def load(stem, part="metrics"):
        metrics = metrics_of(stem)
        return metrics if part == "metrics" else json.loads((pipeline.BUILD / "results" / f"{stem}.json").read_text())[part]

    scaling = load("03_loss_scaling")
    # most activation gradients flush without scaling; 2^16 rescues nearly all of them
    assert scaling["underflow_fraction.unscaled"] > 0.5 and scaling["underflow_fraction.scaled"] < 0.01
    high = {k: scaling[f"scaler.high_init.{k}"] for k in ("leading_skips", "first_step_scale", "skipped_steps")}
    assert high["leading_skips"] > 0
    if high["first_step_scale"] is not None:  # None: every step was skipped, and the prose says so
        assert high["first_step_scale"] == 2.0 ** (40 - high["leading_skips"])
    # the long synthetic run is long enough for the 200 and 400 intervals to act, and they order the skips
    assert scaling["scaler.verl.growths"] >= 1 and scaling["scaler.source.growths"] > scaling["scaler.verl.growths"]
    skipped = [scaling[f"scaler.{s}.skipped_steps"] for s in ("every_5", "source", "verl", "torch_default")]
    assert skipped == sorted(skipped, reverse=True) and skipped[0] > skipped[1]
    # clipping before unscaling reads the scaled norm; SGD's step then shrinks as S·min(|g|, 1) predicts
    assert 0.5 < scaling["clip.sgd.update_ratio_right_over_wrong"] / scaling["clip.sgd.predicted_ratio"] < 2
    assert scaling["clip.sgd.update_ratio_right_over_wrong"] > 100
    # Adam's normalisation cancels most of the shrink that SGD suffers in full
    assert scaling["clip.adamw.update_ratio_right_over_wrong"] < scaling["clip.sgd.update_ratio_right_over_wrong"] / 100
    ops = load("08_sensitive_ops")
    assert ops["err.log_softmax.bf16"] > ops["err.log_softmax.fp16"] > ops["err.log_softmax.bf16_fp32_out"]
    # the logsumexp and the median log-probability share a binade, and its bf16 spacing bounds the rounding
    assert ops["place.logsumexp_of_a_row.binades"] == ops["place.log_softmax_median.binades"]
    assert ops["err.log_softmax.bf16_by_binade.larger_magnitude"] == ops["err.log_softmax.bf16"]
    # the eps rule: a representable eps is finite but huge, the floor keeps a flushed step within lr
    rule = {e: ops[f"adam.eps_rule.{e}.step_over_lr"] for e in ("1e-7", "1e-4", "floor")}
    assert all(ops[f"adam.eps_rule.{e}.v_flushed"] for e in rule)
    assert rule["1e-7"] > 1000 and rule["1e-4"] > 10 and 0 < rule["floor"] <= 1.0 + 0.5
    # fp16 overflow: the fp16 forward fails where the fp32 headroom says, and the lab's model has room
    for place in ("residual", "attention_scores", "mlp_hidden"):
        assert ops[f"activation.{place}.headroom"] > 10
        assert abs(ops[f"overflow.{place}.first_log2"] - ops[f"overflow.{place}.predicted_log2"]) <= 1
    assert ops["overflow.mlp_hidden.where"].startswith("mlp_hidden")
    assert ops["fp16_costs.flushed_gradients.activations"] > ops["fp16_costs.flushed_gradients.weights"]
    assert ops["fp16_costs.adam_v_flushed"] > 0
    fp8 = load("09_fp8")
    for tensor in ("weights", "activations", "gradients"):
        assert fp8[f"qerr.{tensor}.e4m3fn.block"] < fp8[f"qerr.{tensor}.e5m2.block"]  # one more mantissa bit
    for scaling in ("tensor", "block"):  # the real model's decoder weights, each matrix with its own scale
        assert fp8[f"real.qerr.weights.e4m3fn.{scaling}"] < fp8[f"real.qerr.weights.e5m2.{scaling}"]
    assert fp8["flushed.gradients.e4m3fn.none"] > fp8["flushed.gradients.e5m2.none"]  # less range
    if fp8["matmul.outcome"] == "ran":  # a scaled E4M3 matmul: a few per cent off fp32, not exact, not garbage
        assert 0.005 < fp8["matmul.rel_error_vs_fp32"] < 0.1
    saturated = fp8["cast.e4m3fn.values.1000"] == 448.0 and fp8["cast.e4m3fn.values.-10000"] == -448.0
    assert saturated == fp8["cast.e4m3fn.behaviour"].startswith("saturates")  # the prose follows the cast
    out = load("10_scaling_out")
    # the same experiment on 1 and 2 processes: the global batch is split, not doubled
    assert out["fsdp.from_file.reduce_dtype"] == "float16" and out["fsdp.with_policy.reduce_dtype"] == "float32"
    assert out["fsdp.scaler_class"] == "torch.amp.grad_scaler.GradScaler"  # FSDP2: not the ShardedGradScaler
    assert out["fsdp.fsdp1_scaler_class"].endswith("ShardedGradScaler")
    table = load("11_troubleshooting")
    on_cuda = load("11_troubleshooting", "env")["device"] == "cuda"
    assert table["row.1.symptom_seen"] is on_cuda  # the bf16 unscale kernel is missing on CUDA only
    assert table["row.5.symptom_seen"] and table["row.6.symptom_seen"] and table["row.8.symptom_seen"]
    assert table["row.10.symptom_seen"] is False
    assert "fp16_scaler_bf16_trainables" in table["row.1.preflight"] and "adam_eps_underflow" in table["row.6.preflight"]
    assert table["adam.preflight_at_floor"] == "—" and table["adam.weight_after_eps_floor"] == 1.0


def test_claims_ledger_judges_every_claim_from_this_builds_results():
    from bookbuild import ledger

    text = ledger.page(pipeline.ROOT)
    rows = [line for line in text.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert len(rows) == len(ledger.CLAIMS) >= 20
    assert "not measured in this build" not in text
    toc = set(pipeline.chapters())
    assert all(claim.chapter in toc for claim in ledger.CLAIMS)


def test_verdicts_and_findings_read_the_real_model_where_it_was_measured(tmp_path, monkeypatch):
    """A ledger verdict or a findings row that reads a toy metric must read the real model's beside it, where the
    chapter records one for the same quantity."""
    from bookbuild import findings, ledger, quantities
    from labutils.results import load_all

    runs = load_all(pipeline.ROOT / "_build" / "results")
    ledger_reads = {f"{claim.chapter}:{key}" for claim in ledger.CLAIMS for key in claim.keys}
    assert not quantities.toy_in_place_of_real(ledger_reads, runs)
    page_reads, metric = set(), findings._metric

    def recording(runs_):
        read = metric(runs_)
        return lambda ref: (page_reads.add(ref), read(ref))[1]

    monkeypatch.setattr(findings, "_metric", recording)
    findings.page(pipeline.ROOT, tmp_path)
    assert page_reads and not quantities.toy_in_place_of_real(page_reads, runs)


def test_the_findings_page_reads_every_number_it_quotes_from_this_build(tmp_path):
    """Every piece of evidence and every set-up on the findings page finds its metric in this build's results."""
    from bookbuild import findings

    text = findings.page(pipeline.ROOT, tmp_path)
    assert findings.MISSING not in text and "not in this build" not in text
    assert findings.NOT_TESTED != findings.chain(pipeline.ROOT)[0][1]  # chapter 4b decides the first link


TIMING = re.compile(r"seconds|per_s|_ms$|mem|rss|time", re.I)


@pytest.mark.chapter
def test_a_second_run_records_the_same_metrics_apart_from_timings(book_executed, tmp_path):
    stems = ["03_loss_scaling", "09_fp8"]  # training with a loss scaler, and FP8 casts: short, and not trivial
    pipeline.execute_all(stems, "cpu", jobs=2, force=True, build=tmp_path)
    for stem in stems:
        first = metrics_of(stem)
        second = json.loads((tmp_path / "results" / f"{stem}.json").read_text())["metrics"]
        kept = {k for k in first if not TIMING.search(k)}
        assert len(kept) > 10 and set(first) == set(second)
        assert {k: second[k] for k in kept} == {k: first[k] for k in kept}, stem
