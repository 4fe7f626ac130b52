"""labutils.readings: both branches of a written reading, and a check that fails when the numbers turn."""
import pytest

from labutils import readings


@pytest.fixture
def glued(monkeypatch):
    seen = {}
    monkeypatch.setattr(readings, "glue", lambda name, value: seen.__setitem__(name, value))
    return seen


def test_pick_glues_the_reading_the_numbers_support(glued):
    assert readings.pick("r", 3.0 > 2.0, "larger", "not larger") is None  # a cell ending with it prints nothing
    assert glued["r"] == "larger"
    readings.pick("r", 1.0 > 2.0, "larger", "not larger")
    assert glued["r"] == "not larger"


def test_support_stops_the_chapter_naming_the_sentence(monkeypatch):
    monkeypatch.delenv(readings.profiles.GPU_PATHS_ON_CPU, raising=False)
    readings.support("bf16 is larger", True)
    with pytest.raises(readings.Unsupported, match="bf16 is larger.*1.0 vs 2.0"):
        readings.support("bf16 is larger", False, "1.0 vs 2.0")
    monkeypatch.setenv(readings.profiles.GPU_PATHS_ON_CPU, "1")  # the code-path run at minimum sizes
    readings.support("bf16 is larger", False, "1.0 vs 2.0")


def test_differs_is_judged_on_the_standard_error_of_the_difference():
    assert readings.differs(1.0, 0.1, 0.0, 0.1)  # 1.0 apart, SE of the difference 0.14
    assert not readings.differs(0.25, 0.1, 0.0, 0.1)  # 1.8 SE apart
    assert readings.differs(0.25, 0.1, 0.0, 0.1, z=1.5)


def test_glue_all_glues_every_value(glued):
    readings.glue_all(a=1, b="two")
    assert glued == {"a": 1, "b": "two"}

