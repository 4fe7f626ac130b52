"""Chapter 4b's speed measurement: its plumbing on the tiny model, and the committed 32 × 512 run."""
import pytest

from labutils import models, sampling_speed


def test_the_committed_speed_run_was_made_by_this_sampling_code_and_model():
    payload, why = sampling_speed.load()
    assert why is None, why
    for speed in payload["speeds"].values():
        assert (speed["batch"], speed["length"], speed["tokens"]) == (32, 512, 32 * 512)
        assert speed["sample_over_forward"] == pytest.approx(speed["sample_tokens_per_s"] / speed["forward_tokens_per_s"])


def test_a_file_from_other_code_is_refused_in_one_sentence():
    said = sampling_speed.RUN.stale({"provenance": {"code": "0" * 16}}, sampling_speed.PLAN, "model")
    assert said.count(". ") == 0 and said.endswith(".") and "make speed" in said


def test_the_fingerprint_covers_the_engines_code():
    from labutils.committed import modules_run

    assert {"sampling_speed", "rollout", "decoding"} <= set(modules_run("sampling_speed"))


def test_a_measurement_counts_generated_tokens_only(tiny_profile, lab_cache):
    model, _ = models.load(None, "dense", tiny_profile, seed=0)
    speed = sampling_speed.measure(model, "bf16", batch=3, length=5, micro_batches=(3, 1))
    assert speed["tokens"] == 15 and speed["best_micro_batch"] in (3, 1)
    assert abs(speed["sample_over_forward"] - speed["sample_tokens_per_s"] / speed["forward_tokens_per_s"]) < 1e-9
