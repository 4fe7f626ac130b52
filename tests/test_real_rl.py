"""RL on the real model (labutils.real_rl): its task, its reward, the long run's file (chapter 5 runs it)."""
import json

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


def test_a_long_run_file_from_other_code_is_refused_in_one_sentence(tmp_path):
    missing, why = real_rl.load(tmp_path / "absent.json")
    assert missing is None and "make long-real" in why
    (tmp_path / "old.json").write_text(json.dumps({"provenance": {"code": "0" * 16}}))
    payload, why = real_rl.load(tmp_path / "old.json")
    assert payload is not None and why.count(". ") == 0 and why.endswith(".") and "make long-real" in why


def test_the_fingerprint_covers_the_trainer_and_the_engines():
    from labutils.long_run import modules_run

    assert {"real_rl", "grpo", "rollout", "decoding", "mismatch"} <= set(modules_run("real_rl"))
