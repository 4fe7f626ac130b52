"""The ledger's verdicts on chapter 2's and chapter 5's claims turn on the measurements, both ways."""
import pytest

from labutils import ledger


def _claim(chapter, words):
    return next(c for c in ledger.CLAIMS if c.chapter == chapter and words in c.says)


def test_bf16_error_claim_reads_the_scalers_and_the_errors_raised():
    judge = _claim("02_qlora_crash", "error comes from `bf16=True`").judge
    bfloat16 = "\"_amp_foreach_non_finite_check_and_unscale_cuda\" not implemented for 'BFloat16'"
    assert judge("cuda", bfloat16, "GradScaler", "none", "none")[1] == ledger.CONTRADICTED
    assert judge("cuda", "none", "GradScaler", "GradScaler", bfloat16)[1] == ledger.CONFIRMED
    assert judge("cpu", "none", "none", "none", "none")[1].startswith(ledger.NOT_AT_SCALE)
    assert judge("cuda", "none", "GradScaler", "none", "none")[1] == ledger.NOT_SUPPORTED


def test_forced_scaler_claim_needs_a_device_that_builds_scalers():
    judge = _claim("02_qlora_crash", "forces an fp16 GradScaler").judge
    assert judge("GradScaler", "none", "bf16")[1] == ledger.CONTRADICTED
    assert judge("GradScaler", "GradScaler", "bf16")[1] == ledger.CONFIRMED
    assert judge("none", "none", "bf16")[1].startswith(ledger.NOT_AT_SCALE)


@pytest.mark.parametrize("fp32, bf16, fp16, autocast, verdict", [
    (600.0, 850.0, 604.0, False, ledger.CONFIRMED),  # the fp16 fix ran in fp32 here: only bf16 is compared
    (600.0, 850.0, 604.0, True, ledger.NOT_SUPPORTED),  # within the 8 MB tolerance of the fp16 fix
    (700.0, 650.0, 720.0, True, ledger.CONTRADICTED),
])
def test_memory_claim_claims_only_beyond_the_tolerance(fp32, bf16, fp16, autocast, verdict):
    judge = _claim("02_qlora_crash", "least memory").judge
    assert judge(fp32, bf16, fp16, autocast, 8.0, "process peak RSS")[1].startswith(verdict)


def test_speed_claim_is_judged_only_where_fp16_computes_in_fp16():
    judge = _claim("02_qlora_crash", "40% slower").judge
    assert judge(1.4, 1.3, False)[1].startswith(ledger.NOT_AT_SCALE)
    assert judge(1.2, 2.0, True)[1] == ledger.CONFIRMED  # 40% fewer it/s
    assert judge(2.0, 2.1, True)[1] == ledger.CONTRADICTED


def test_precision_table_claim_uses_the_seed_spread():
    judge = _claim("05_grpo_precision", "AIME24").judge
    assert judge(0.03, 0.1, 0.81, 0.83)[1].startswith(ledger.NOT_SUPPORTED)
    assert judge(0.3, 0.1, 0.5, 0.8)[1].startswith(ledger.CONFIRMED)
    assert judge(0.3, 0.1, 0.8, 0.5)[1] == ledger.CONTRADICTED
