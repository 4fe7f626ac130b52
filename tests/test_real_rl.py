"""RL on the real model (labutils.real_rl): its task, its reward, the long run's file (chapter 5 runs it)."""

import pytest

from labutils import pretrained, profiles, real_rl


def test_the_task_draws_distinct_numbers_outside_the_held_out_ones():
    held_out = real_rl.problems(64, seed=0)
    drawn = real_rl.problems(512, seed=1, exclude=frozenset(held_out))
    assert len(set(drawn)) == 512 and not set(drawn) & set(held_out)
    assert all(real_rl.LOW <= n <= real_rl.HIGH for n in drawn)
    with pytest.raises(ValueError, match="ask for fewer"):
        real_rl.problems(real_rl.HIGH, seed=0)


def test_the_reward_reads_the_first_integer_of_the_answer():
    completions = ["417", "The number is 417.", "41 7", "four hundred seventeen", "417417"]
    assert real_rl.reward(completions, answer=[417] * 5) == [1.0, 1.0, 0.0, 0.0, 0.0]
    # a random well-formed answer: one number of the range, right about 0.1% of the time
    assert 1 / (real_rl.HIGH - real_rl.LOW + 1) < 0.2


def test_an_unknown_pair_is_refused_before_any_work():
    with pytest.raises(ValueError, match="fp32_fp32, bf16_bf16, fp16_fp16"):
        real_rl.run("bf16_fp32", profiles.PROFILES["cpu"], 1, 1, 2, 1e-5, 4, [10], 1, "/tmp", pretrained.NAME)


def test_a_long_run_file_from_other_code_is_refused_in_one_sentence():
    why = real_rl.RUN.stale({"provenance": {"code": "0" * 16}}, real_rl.PLAN, "model")
    assert why.count(". ") == 0 and why.endswith(".") and "make long-real" in why


def test_the_fingerprint_covers_the_trainer_and_the_engines():
    from labutils.committed import modules_run

    assert {"real_rl", "grpo", "rollout", "decoding", "mismatch"} <= set(modules_run("real_rl"))


def test_the_probe_sees_no_fp32_mismatch_no_drift_at_the_start_and_a_bf16_mismatch(tiny_profile):
    import torch

    from labutils import models, rollout

    model, _ = models.load(None, "dense", tiny_profile, seed=0)
    with torch.no_grad():  # an untrained model's next-token distributions are near uniform: sharpen them
        model.get_output_embeddings().weight.mul_(30)
    ids = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16], [7, 5], [11, 12, 13], [6, 9, 14]]
    start = rollout.TrainingEngine(model, torch.float32)
    fp32 = real_rl.probe(model, start, ids, torch.float32, 1.0, 6)
    bf16 = real_rl.probe(model, start, ids, torch.bfloat16, 1.0, 6)
    assert len(fp32["mismatch"]) == len(ids) == len(bf16["drift"])
    assert max(fp32["drift"] + bf16["drift"]) == 0.0  # the policy is still its start: the same fp32 forward
    # the sampler's cached decode against one teacher-forced forward: rounding in fp32, weights cast whole to
    # bf16 against an autocast trainer in bf16
    assert sum(abs(v) for v in fp32["mismatch"]) < sum(bf16["mismatch"]) / 100


def test_the_committed_long_run_is_this_checkouts_complete_and_read_as_its_code_reads_it():
    from labutils.rl_analysis import probe_change

    payload, why = real_rl.load()
    assert why is None, why
    assert payload["complete"] and {pair: len(runs) for pair, runs in payload["runs"].items()} == payload["seeds"]
    for pair, runs in payload["runs"].items():
        assert all(len(r["probe_mismatch"]) == len(r["eval_steps"]) for r in runs)
        assert probe_change(runs)["prompts"] == payload["chosen"]["probe_sequences"]


def test_the_control_holds_only_if_no_evaluation_falls_beyond_two_standard_errors():
    assert real_rl.held({"eval": [0.30, 0.25, 0.50]})  # 0.25 is within 2 SE (0.11 at 128 numbers) of 0.30
    assert not real_rl.held({"eval": [0.30, 0.60, 0.00]})  # a collapse at the end fails, whatever came before


def test_a_probe_change_needs_three_standard_errors_over_prompts_and_seeds_that_agree():
    from labutils.rl_analysis import probe_change

    up = {"probe_mismatch": [[1.0, 2.0, 3.0, 4.0], [1.2, 2.1, 3.3, 4.1]]}
    down = {"probe_mismatch": [[1.0, 2.0, 3.0, 4.0], [0.9, 1.9, 2.8, 3.9]]}
    grew = probe_change([up, up])
    assert grew["verdict"] == "grew" and grew["change"] == pytest.approx(0.175) and grew["rising_prompts"] == 4
    assert probe_change([up, down])["verdict"] == "seeds disagree"
    assert probe_change([down])["verdict"] == "shrank"
    noisy = {"probe_mismatch": [[1.0, 2.0, 3.0, 4.0], [1.5, 1.6, 3.4, 3.7]]}
    assert probe_change([noisy])["verdict"] == "no change beyond 3 SE"
