"""labutils.real_fixes: the speed after the first step, exact on a fake clock."""
from labutils import real_fixes


def test_speed_leaves_the_first_step_out():
    clock = real_fixes.StepClock()
    clock.started, clock.ends = 0.0, [10.0, 12.0, 14.0, 16.0]  # a slow first step, then 2 s each
    assert clock.rate_after_first() == 0.5
    assert clock.rate_after_first([999.0, 40.0, 40.0, 40.0]) == 20.0  # the first step's tokens left out


def test_one_step_has_no_speed():
    clock = real_fixes.StepClock()
    clock.ends = [10.0]
    assert clock.rate_after_first() != clock.rate_after_first()  # NaN
