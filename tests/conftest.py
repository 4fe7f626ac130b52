import dataclasses

import pytest

from labutils import pipeline, profiles


@pytest.fixture
def tiny_profile():
    """A profile small enough to build a model in about a second."""
    cpu = profiles.PROFILES["cpu"]
    size = profiles.ModelSize(hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1,
                              intermediate_size=32, max_positions=256)
    return dataclasses.replace(
        cpu, name="tiny", dense=size,
        moe=dataclasses.replace(size, num_experts=4, experts_per_token=2),
        warmup=profiles.WarmupPlan(steps=3, batch_size=4, lr=1e-3, min_walk=1, max_walk=3),
        moe_warmup=profiles.WarmupPlan(steps=3, batch_size=4, lr=1e-3, min_walk=1, max_walk=3),
        task=profiles.TaskRange(min_walk=1, max_walk=4, eval_problems=8),
    )


@pytest.fixture
def lab_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LAB_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture(scope="session")
def book_executed():
    """Every chapter executed in the cpu profile (unless unchanged), two at a time; what failed, or ""."""
    try:
        pipeline.execute_all(pipeline.chapters(), "cpu", jobs=2)
    except pipeline.ChapterError as err:
        return str(err)
    return ""
