"""Every verdict of the claims ledger is a function of measurements that can come out more than one way."""
import pytest

from bookbuild import ledger

def _claim(words):
    return next(c for c in ledger.CLAIMS if words in c.says)


def test_about_24x_is_a_gpu_sequence_figure_that_cpu_token_kls_cannot_decide():
    judge = _claim("about 24×").judge
    assert _claim("about 24×").chapter == "04b_real_mismatch"
    for ratio, low, high in ((25.0, 18.0, 34.0), (66.0, 48.8, 89.7), (0.5, 0.3, 0.9)):
        measured, verdict = judge(ratio, low, high)
        assert verdict.startswith(ledger.NOT_COMPARABLE) and f"{ratio:.0f}×" in measured
    assert "cuts the mismatch here too" in judge(66.0, 48.8, 89.7)[1]
    assert "does not cut" in judge(0.5, 0.3, 0.9)[1]
    assert "no direction" in judge(1.2, 0.8, 1.9)[1]


def test_mixed_engines_read_the_real_model_and_leave_stability_unmeasured():
    claim = _claim("BF16 training with FP32 inference")
    assert claim.chapter == "04b_real_mismatch" and all(k.startswith("real.") for k in claim.keys)
    measured, verdict = claim.judge(1.2e-3, 1e-4, 1.7e-3, 1e-4)
    assert verdict.startswith(ledger.NOT_MEASURED) and "smaller than" in measured
    assert "about the same as" in claim.judge(1.6e-3, 1e-4, 1.7e-3, 1e-4)[0]
    assert "larger than" in claim.judge(2e-3, 1e-4, 1.2e-3, 1e-4)[0]


def test_fp16_during_rl_reads_chapter_5s_real_model_conclusion():
    claim = _claim("removes most of the mismatch during RL")
    assert all(k.startswith("real.") for k in claim.keys)
    assert claim.judge(76.0, 52.0, True)[1] == ledger.CONFIRMED
    assert claim.judge(1.5, 1.2, False)[1] == ledger.INCONCLUSIVE
    assert claim.judge(0.5, 0.6, False)[1] == ledger.CONTRADICTED


def test_scaler_recipe_works_but_is_not_shown_better_than_the_default():
    judge = _claim("growth_interval=200").judge
    assert judge(3, 4000, 12, 1, 2, 2000)[1].startswith(ledger.INCONCLUSIVE)
    assert judge(400, 4000, 12, 1, 2, 2000)[1].startswith(ledger.CONTRADICTED)
    assert judge(3, 4000, 0, 1, 2, 2000)[1].startswith(ledger.CONTRADICTED)


def test_fp8_formats_judge_each_half_on_its_own_tensors():
    judge = _claim("E5M2 for inference").judge
    verdict = judge(0.02, 0.05, 0.026, 0.053)[1]
    assert verdict.startswith(ledger.CONTRADICTED) and "agrees with the gradients" in verdict
    assert "agrees" not in judge(0.02, 0.05, 0.06, 0.05)[1]
    assert judge(0.05, 0.02, 0.02, 0.05)[1] == ledger.INCONCLUSIVE


def test_slope_claim_reads_the_slope_against_its_own_drift():
    """E[Σ log π/μ] = −Σ KL: with the token KL above zero at every band, a fit that agrees with the drift contradicts
    the variance reading however wide its error came out (the last two: one chapter under two kernel sets)."""
    judge = _claim("is a variance").judge
    for slope, se, drift in ((-1.3, 0.4, 1.6), (-1.07, 0.33, 1.81), (-1.87, 0.84, 1.68)):
        assert judge(slope, se, drift, True)[1].startswith(ledger.CONTRADICTED)  # the slope is the mean drift
    assert judge(-3.0, 0.3, 1.0, True)[1] == ledger.INCONCLUSIVE  # not the drift: something else is going on
    assert judge(-1.3, 0.4, 1.6, False)[1] == ledger.INCONCLUSIVE  # no accumulation shown, no drift to agree with


def test_claims_that_need_more_than_any_profile_runs_say_what_they_need():
    for words in ("1200 steps", "600 steps", "AIME24"):
        claim = _claim(words)
        values = {"grpo.steps": 4, "real.serving.ratio.bf16_unmerged_over_matched": 1.2, "combo.bf16_bf16.final_reward": 1.0,
                  "combo.fp16_fp16.final_reward": 1.0}
        verdict = claim.judge(*(values[k] for k in claim.keys))[1]
        assert verdict.startswith(ledger.NOT_MEASURED) and "needs" in verdict


def test_redundant_recipe_and_routing_counts():
    softmax = _claim("softmax").judge
    assert softmax(1e-3, 1e-3)[1].startswith(ledger.REDUNDANT)
    assert softmax(1e-2, 1e-3)[1] == ledger.CONFIRMED
    routing = _claim("routing is more fragile").judge
    assert routing(0.01, 0.001, 1)[1] == ledger.CONFIRMED
    assert routing(0.01, 0.009, 0)[1] == ledger.INCONCLUSIVE  # within counting noise
    assert routing(0.001, 0.01, -1)[1] == ledger.CONTRADICTED


def test_loss_scale_band_claim():
    judge = _claim("2^14–2^16").judge
    assert judge(2.0**19, 0, 30)[1].startswith(ledger.CONTRADICTED)  # a healthy run outside the band
    assert judge(2.0**15, 0, 30)[1].startswith(ledger.INCONCLUSIVE)
    assert judge(2.0**19, 10, 30)[1].startswith(ledger.INCONCLUSIVE)  # a third of the steps skipped: not healthy


def test_inconclusive_verdicts_give_the_power():
    verdict = ledger._comparison(0.05, 0.1, 4)
    assert verdict.startswith(ledger.INCONCLUSIVE) and "power" in verdict
    assert ledger.power(0.0, 0.1, 4) == pytest.approx(0.05, abs=1e-4)  # no effect: the test's own false-positive rate
    assert ledger.power(0.1 * 2.8 / 1.96, 0.1, 1000) == pytest.approx(0.80, abs=0.01)  # 2.8 SE: 80% power (large dof)


def test_a_null_with_power_contradicts_and_one_without_is_inconclusive():
    assert ledger._comparison(0.01, 0.02, 9, effect=0.05).startswith(ledger.CONTRADICTED)  # narrow: 0.05 would show
    assert ledger._comparison(0.01, 0.08, 9, effect=0.05).startswith(ledger.INCONCLUSIVE)  # wide: it might not
    assert ledger._comparison(-0.1, 0.02, 9, effect=0.05) == ledger.CONTRADICTED
    assert ledger._comparison(0.1, 0.02, 9, effect=0.05) == ledger.CONFIRMED


def test_the_rl_consequence_claims_read_the_long_run_and_name_its_bits():
    degrades = _claim("The mechanism: the larger").judge
    measured, verdict = degrades("long run", 2, -0.04, -0.06, -0.02, 40, 8, 0.02, 0.1, 0.03, 0.05, 8.0)
    assert verdict == ledger.CONFIRMED and "2 emulated mantissa bits" in measured and "-0.020" in measured
    assert degrades("long run", 2, -0.001, -0.01, 0.008, 40, 8, 0.02, 0.0, 0.03, 0.05, 8.0)[1].startswith(
        ledger.CONTRADICTED)
    # the same null far below the paper's mismatch says nothing against the paper
    below = degrades("long run", 2, -0.001, -0.01, 0.008, 40, 8, 0.02, 0.0, 0.03, 0.05, 0.13)[1]
    assert below.startswith(ledger.INCONCLUSIVE) and "regime was not reached" in below
    assert degrades("this run", 2, -0.04, -0.06, -0.02, 40, 8, 0.02, 0.1, 0.03, 0.05, 8.0)[1].startswith(
        ledger.NOT_MEASURED)
    bf16 = _claim("BF16 RL training degrades").judge
    assert bf16("long run", 10, 80, 0.005, 0.02, 0.05, 8.0)[1].startswith(ledger.CONTRADICTED)  # no difference, with power
    assert bf16("long run", 10, 80, 0.005, 0.02, 0.05, 0.001)[1].startswith(ledger.INCONCLUSIVE)  # not its regime
    assert bf16("long run", 3, 80, 0.005, 0.09, 0.05, 8.0)[1].startswith(ledger.INCONCLUSIVE)


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
    qualified = ledger.verdict_markup(ledger.INCONCLUSIVE + " (power 30% for the observed gap)")
    assert qualified == "{bdg-warning}`inconclusive` (power 30% for the observed gap)"
    assert ledger.verdict_markup("–") == "–"
    assert set(ledger.BADGES) == {ledger.CONFIRMED, ledger.CONTRADICTED, ledger.INCONCLUSIVE,
                                  ledger.REDUNDANT, ledger.NOT_MEASURED, ledger.NOT_COMPARABLE}


def test_a_cell_with_a_pipe_does_not_split_the_row():
    from bookbuild.status import table

    text = table(["a", "b"], [["x | y", "z"]])
    assert text.splitlines()[2] == "| x \\| y | z |"


def test_a_toy_metric_read_where_the_real_models_is_recorded_is_flagged():
    from bookbuild import quantities

    runs = {"04_mismatch": {"metrics": {"grid.bf16_fp32.token_kl": 2e-3}},
            "04b_real_mismatch": {"metrics": {"real.token_kl.bf16_train_fp32_infer": 1.2e-3}},
            "07_lora": {"metrics": {"serving.ratio.x": 2000.0, "real.serving.ratio.x": 1.24, "grpo.steps": 4}}}
    assert quantities.toy_in_place_of_real({"04_mismatch:grid.bf16_fp32.token_kl"}, runs)
    assert quantities.toy_in_place_of_real({"07_lora:serving.ratio.x"}, runs)  # the same name with real. in front
    assert not quantities.toy_in_place_of_real({"07_lora:serving.ratio.x", "07_lora:real.serving.ratio.x"}, runs)
    assert not quantities.toy_in_place_of_real({"07_lora:grpo.steps"}, runs)  # no real-model counterpart recorded
    del runs["04b_real_mismatch"]
    assert not quantities.toy_in_place_of_real({"04_mismatch:grid.bf16_fp32.token_kl"}, runs)

