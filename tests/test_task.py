import random

import pytest

from labutils import task


def test_problem_text_and_answer():
    p = task.Problem(3, 7, 4)
    assert p.prompt == "3+7*4="
    assert p.completion == "4:3+7=0;3:0+7=7;2:7+7=4;1:4+7=1;1"
    assert p.answer == "1" == str((3 + 7 * 4) % 10)


def test_completion_length_matches_text():
    for steps in (1, 9, 10, 99, 100, 120):
        assert task.completion_length(steps) == len(task.Problem(5, 3, steps).completion)


def test_length_dial_reaches_a_thousand_tokens():
    steps = task.steps_for_length(1000)
    assert task.completion_length(steps) >= 1000 > task.completion_length(steps - 1)
    assert task.completion_length(1) == 9


def test_exact_match_reads_the_final_answer():
    assert task.exact_match("1:4+7=1;1", "1") == 1.0
    assert task.exact_match("1:4+7=1;2", "1") == 0.0
    assert task.exact_match("garbage", "1") == 0.0
    assert task.final_answer("2:1+1=2;1:2+1=3;3 ") == "3"


def test_sampling_is_seeded_and_checked():
    a = task.sample_problems(random.Random(1), 5, 1, 3)
    assert a == task.sample_problems(random.Random(1), 5, 1, 3)
    assert all(1 <= p.steps <= 3 for p in a)
    with pytest.raises(ValueError):
        task.sample_problems(random.Random(1), 5, 0, 3)


def test_excluded_problems_are_never_drawn_and_distinct_draws_do_not_repeat():
    import random

    held_out = set(task.sample_problems(random.Random(1), 150, 2, 3, distinct=True))
    assert len(held_out) == 150
    drawn = task.sample_problems(random.Random(2), 500, 2, 3, exclude=frozenset(held_out))
    assert not held_out & set(drawn) and len(drawn) == 500
    with pytest.raises(ValueError, match="only 50 problems"):
        task.sample_problems(random.Random(3), 60, 2, 3, exclude=frozenset(held_out), distinct=True)
