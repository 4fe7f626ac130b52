"""The ledger's verdicts on chapter 2's and chapter 5's claims, on inputs those chapters can produce."""
import pytest

from bookbuild import ledger

BFLOAT16 = "\"_amp_foreach_non_finite_check_and_unscale_cuda\" not implemented for 'BFloat16'"


def _claim(chapter, words):
    return next(c for c in ledger.CLAIMS if c.chapter == chapter and words in c.says)


def test_bf16_error_claim_reads_the_installed_source_on_any_device():
    judge = _claim("02_qlora_crash", "error comes from `bf16=True`").judge
    assert judge(False, True, "none", "none")[1].startswith(ledger.CONTRADICTED)  # this accelerate: CPU and CUDA alike
    assert judge(True, True, BFLOAT16, "none")[1] == ledger.CONFIRMED  # a bf16 trainer that raised it decides
    assert judge(True, True, "none", BFLOAT16)[1] == ledger.CONFIRMED  # on the real model as on the toy
    assert judge(True, True, "none", "none")[1] == ledger.INCONCLUSIVE  # a source where both flags build one


def test_forced_scaler_claim_reads_the_trainer_and_the_source():
    judge = _claim("02_qlora_crash", "forces an fp16 GradScaler").judge
    assert judge("none", False)[1] == ledger.CONTRADICTED
    assert judge("GradScaler", True)[1] == ledger.CONFIRMED
    assert judge("none", True)[1] == ledger.INCONCLUSIVE


@pytest.mark.parametrize("fp32, bf16, fp16, verdict", [
    (9000.0, 7000.0, 7100.0, ledger.CONTRADICTED),
    (6000.0, 7000.0, 6004.0, ledger.INCONCLUSIVE),  # within the 8 MB tolerance of the fp16 fix
    (5000.0, 7000.0, 7100.0, ledger.CONFIRMED),
])
def test_memory_claim_is_a_gpu_claim_decided_beyond_the_tolerance(fp32, bf16, fp16, verdict):
    claim = _claim("02_qlora_crash", "least memory")
    assert claim.device == "gpu"  # CPU process RSS of a toy decides nothing about an A100
    assert claim.judge(fp32, bf16, fp16, 8.0)[1] == verdict


def test_speed_claim_is_a_gpu_claim():
    claim = _claim("02_qlora_crash", "40% slower")
    assert claim.device == "gpu"  # on the CPU fp16=True computes in fp32: the two runs are the same computation
    assert claim.judge(1.2, 2.0)[1] == ledger.CONFIRMED  # 40% fewer it/s
    assert claim.judge(2.0, 2.1)[1] == ledger.CONTRADICTED


def test_rl_mismatch_claim_reads_chapter_5s_own_noise_test():
    judge = _claim("05_grpo_precision", "removes most").judge
    assert judge(76.0, 52.0, True)[1] == ledger.CONFIRMED  # the chapter decided fp16 below half of bf16, beyond SE
    assert judge(1.5, 1.2, False)[1] == ledger.INCONCLUSIVE  # not decided by the chapter
    assert judge(0.5, 0.4, False)[1] == ledger.CONTRADICTED  # fp16's mismatch above bf16's at both ends
