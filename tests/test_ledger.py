"""Every verdict of the claims ledger is a function of measurements that can come out more than one way."""
import itertools
import random

import pytest

from labutils import ledger

CANDIDATES = [0, 1, 2, 3, 8, 16, 600, 1200, 3000, 1e-9, 1e-8, 1e-6, 1e-3, 0.05, 0.1, 0.3, 0.5, 0.9, 13.0, 14.0, 17.0,
              65504.0, 6.1e-5, 2**-7, 2**-10, 10.0, 100.0, -0.3, -0.05, -1.0, True, False, "no", "ignored",
              "changed the output", "rejected: TypeError", "TypeError: unexpected keyword", "returned None",
              "bfloat16", "float32", "long run", "this run", "m3_tis", "cpu: no scaler", "n/a", "none", "GradScaler",
              "fp16", "bf16", "cpu", "cuda", "_amp_foreach_non_finite_check_and_unscale_cuda not implemented for 'BFloat16'"]


def _verdicts(claim, draws=4000):
    """Verdicts over every combination of candidate values (two inputs or fewer), else a seeded sample."""
    rng = random.Random(0)
    seen = set()
    combos = (itertools.product(CANDIDATES, repeat=len(claim.keys)) if len(claim.keys) <= 2 else
              ([rng.choice(CANDIDATES) for _ in claim.keys] for _ in range(draws)))
    for values in combos:
        try:
            seen.add(claim.judge(*values)[1].split(" (")[0])
        except (TypeError, ValueError, ZeroDivisionError, KeyError, AttributeError):
            continue
    return seen


@pytest.mark.parametrize("index", range(len(ledger.CLAIMS)))
def test_every_verdict_can_change_with_the_measurements(index):
    claim = ledger.CLAIMS[index]
    seen = _verdicts(claim)
    assert len(seen) >= 2, f"claim {index + 1} ({claim.says[:60]}…) always judges {seen}"


def test_a_claim_without_its_measurements_says_so_and_gives_no_verdict():
    claim = ledger.CLAIMS[0]
    measured, verdict = ledger._evaluate(claim, {})
    assert measured == "not measured in this build" and verdict == "–"


def test_number_format_verdicts_on_both_sides():
    eps = next(c for c in ledger.CLAIMS if "mantissa bits" in c.says)
    assert eps.judge(2**-7, 2**-10)[1] == ledger.CONFIRMED
    assert eps.judge(2**-8, 2**-10)[1] == ledger.CONTRADICTED
    flag = next(c for c in ledger.CLAIMS if "expert_choice_precision" in c.says)
    assert flag.judge("ignored")[1] == ledger.CONTRADICTED
    assert flag.judge("changed the output")[1] == ledger.CONFIRMED



def test_a_gpu_claim_is_judged_only_on_a_gpu_reference(tmp_path):
    import json

    def write(folder, fp16, bf16, capability="9.0"):
        folder.mkdir(parents=True, exist_ok=True)
        metrics = {"combo.fp16_fp16.tokens_per_s": fp16, "combo.bf16_bf16.tokens_per_s": bf16}
        (folder / "05_grpo_precision.json").write_text(json.dumps(
            {"chapter": "05_grpo_precision", "env": {"device_name": "x", "torch": "y"}, "metrics": metrics,
             "provenance": {"capability": capability}}))

    def row():
        index = next(i for i, c in enumerate(ledger.CLAIMS, 1) if c.device == "gpu" and "faster" in c.says)
        return next(line for line in ledger.page(tmp_path).splitlines() if line.startswith(f"| {index} |"))

    write(tmp_path / "_build" / "results", 900.0, 1000.0)  # the CPU says fp16 is slower: it must not decide
    assert ledger.NOT_MEASURED in row()
    write(tmp_path / "results" / "gpu", 1500.0, 1000.0)
    assert row().split(" | ")[1] == "{bdg-success}`confirmed`"
    write(tmp_path / "results" / "gpu", 800.0, 1000.0)
    assert row().split(" | ")[1] == "{bdg-danger}`contradicted`"
    write(tmp_path / "results" / "gpu", 1500.0, 1000.0, capability="7.5")  # a T4 says nothing of A100s
    assert ledger.NOT_MEASURED in row() and "compute capability 7.5" in row()


def test_the_verdict_comes_right_after_the_claims_number_as_a_badge():
    """The page puts each verdict where the eye lands first; its qualifier follows the badge."""
    assert ledger.verdict_markup(ledger.CONTRADICTED) == "{bdg-danger}`contradicted`"
    qualified = ledger.verdict_markup(ledger.NOT_AT_SCALE + " (no scaler on this device)")
    assert qualified == "{bdg-info}`not reproducible at this scale` (no scaler on this device)"
    assert ledger.verdict_markup("–") == "–"
    assert set(ledger.BADGES) == {ledger.CONFIRMED, ledger.CONTRADICTED, ledger.NOT_SUPPORTED,
                                  ledger.NOT_AT_SCALE, ledger.NOT_MEASURED}


def test_a_cell_with_a_pipe_does_not_split_the_row():
    from labutils.status import table

    text = table(["a", "b"], [["x | y", "z"]])
    assert text.splitlines()[2] == "| x \\| y | z |"
