"""Every chapter executed by papermill in the cpu profile, and its results file checked."""
import json

import pytest

from labutils import pipeline

ENV_KEYS = {"python", "torch", "transformers", "trl", "peft", "bitsandbytes", "accelerate",
            "device", "device_name", "cuda"}
REQUIRED_METRICS = {
    "00_lab": ["accuracy.dense", "accuracy.moe", "task.max_completion_tokens"],
    "01_number_formats": ["eps.bfloat16", "eps.float16", "eps.float32", "max.float16", "tiny.float16",
                          "demo.fp16_1p001_equal", "demo.bf16_1p008_equal"],
    "02_qlora_crash": ["audit.mixed_precision", "audit.trainable_dtypes", "audit.scaler", "crash.error",
                       "sibling.error", "preflight.crash_config_findings"]
    + [f"preflight.fix_findings.{fix}" for fix in ("fp32", "bf16", "fp16_fp32_trainables")]
    + [f"fix.{fix}.{m}" for fix in ("fp32", "bf16", "fp16_fp32_trainables")
       for m in ("peak_mem_mb", "it_per_s", "tokens_per_s", "final_reward")],
}


@pytest.mark.chapter
@pytest.mark.parametrize("stem", pipeline.chapters())
def test_chapter_executes_and_writes_results(stem):
    pipeline.execute(stem, profile="cpu")
    data = json.loads((pipeline.BUILD / "results" / f"{stem}.json").read_text())
    assert data["chapter"] == stem and data["profile"] == "cpu"
    assert set(data["env"]) == ENV_KEYS and data["seconds"] > 0
    missing = [k for k in REQUIRED_METRICS.get(stem, []) if k not in data["metrics"]]
    assert not missing, f"{stem} did not record {missing}"


def test_lab_models_leave_room_for_rl():
    metrics = json.loads((pipeline.BUILD / "results" / "00_lab.json").read_text())["metrics"]
    for kind in ("dense", "moe"):
        assert 0.2 < metrics[f"accuracy.{kind}"] < 0.95, metrics[f"accuracy.{kind}"]
    assert metrics["task.max_completion_tokens"] >= 1000


def test_number_format_demos_as_measured():
    metrics = json.loads((pipeline.BUILD / "results" / "01_number_formats.json").read_text())["metrics"]
    assert metrics["eps.bfloat16"] == 2**-7 and metrics["eps.float16"] == 2**-10
    assert metrics["demo.fp16_1p001_equal"] is True  # the source claims False
    assert metrics["demo.fp16_separates_1_and_1p001"] and not metrics["demo.bf16_separates_1_and_1p001"]


def test_qlora_crash_audit_and_fixes():
    metrics = json.loads((pipeline.BUILD / "results" / "02_qlora_crash.json").read_text())["metrics"]
    assert metrics["audit.trainable_dtypes"] == "bfloat16"  # trl's cast, whatever fp16 says
    assert metrics["sibling.error"] == "Attempting to unscale FP16 gradients."
    assert metrics["preflight.crash_config_findings"] >= 1
    for fix in ("fp32", "bf16", "fp16_fp32_trainables"):
        assert metrics[f"preflight.fix_findings.{fix}"] == 0
        assert 0.0 <= metrics[f"fix.{fix}.final_reward"] <= 1.0 and metrics[f"fix.{fix}.it_per_s"] > 0
    if metrics["audit.scaler"] is False:
        assert metrics["crash.error"] == "cpu: no scaler" and metrics["kernel.cpu.bfloat16"] is True
    else:
        assert "not implemented for 'BFloat16'" in metrics["crash.error"]
