"""The real model's plumbing and the mismatch statistics it is measured with, at tiny sizes."""
import importlib.util

import pytest
import torch

from labutils import mismatch, models, pretrained


def test_a_missing_model_file_is_one_sentence_on_how_to_install_it(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="make setup"):
        pretrained.gguf_path()
    assert not pretrained.installed()


def test_the_moe_chapter_refuses_the_dense_real_model(tiny_profile):
    with pytest.raises(ValueError, match="mixture-of-experts"):
        models.resolve_model(pretrained.NAME, "moe", tiny_profile)


def test_with_layers_keeps_the_first_blocks_and_their_weights(tiny_profile, lab_cache):
    deep = dict(tiny_profile.dense.__dict__, num_layers=3)
    profile = tiny_profile.__class__(**{**tiny_profile.__dict__, "dense": tiny_profile.dense.__class__(**deep)})
    model, _ = models.load(None, kind="dense", profile=profile)
    shallow = pretrained.with_layers(model, 1)
    assert shallow.config.num_hidden_layers == 1 and model.config.num_hidden_layers == 3
    assert torch.equal(shallow.model.layers[0].mlp.up_proj.weight, model.model.layers[0].mlp.up_proj.weight)
    with pytest.raises(ValueError, match="between 1 and"):
        pretrained.with_layers(model, 4)


def test_block_mean_takes_its_error_from_runs_of_tokens():
    values = torch.tensor([[1.0, 1.0, 3.0, 3.0], [5.0, 5.0, 7.0, 7.0]])
    mask = torch.ones_like(values)
    mean, se = mismatch.block_mean(values, mask, block=2)
    assert mean == pytest.approx(4.0)
    assert se == pytest.approx(float(torch.tensor([1.0, 3.0, 5.0, 7.0]).std() / 2))
    with pytest.raises(ValueError, match="two runs"):
        mismatch.block_mean(values[:1, :2], mask[:1, :2], block=2)


def test_prefix_slope_is_the_mean_per_token_drift():
    # every token of row 0 drifts by -0.002, of row 1 by -0.004: slopes of -2 and -4 per 1K tokens
    ratio = torch.tensor([[-0.002] * 256, [-0.004] * 256], dtype=torch.float64)
    slope, se = mismatch.prefix_slope(ratio, torch.ones_like(ratio), step=64, window=256)
    assert slope == pytest.approx(-3.0) and se == pytest.approx(1.0)
    # one sequence, two windows of 128 tokens: the same slopes, their spread from the windows
    one = torch.tensor([[-0.002] * 128 + [-0.004] * 128], dtype=torch.float64)
    assert mismatch.prefix_slope(one, torch.ones_like(one), step=32, window=128) == pytest.approx((-3.0, 1.0))
    with pytest.raises(ValueError, match="two runs"):
        mismatch.prefix_slope(one, torch.ones_like(one), step=32, window=256)


def test_by_probability_buckets_include_the_top_edge():
    rows = mismatch.by_probability(torch.tensor([[1.0, 2.0, 3.0]]), torch.tensor([[0.005, 0.5, 1.0]]),
                                   torch.ones(1, 3), [0.0, 0.01, 0.9, 1.0])
    assert [r["count"] for r in rows] == [1, 1, 1] and rows[2]["mean"] == 3.0


def test_paired_ratio_compares_each_prompt_with_itself():
    mask = torch.ones(3, 4)
    a = torch.tensor([[2.0] * 4, [20.0] * 4, [200.0] * 4])  # prompts of very different difficulty
    b = a / 10
    ratio, low, high = mismatch.paired_ratio(a, mask, b, mask)
    assert ratio == pytest.approx(10.0) and low == pytest.approx(10.0) and high == pytest.approx(10.0)
    b = b * torch.tensor([[1.0], [2.0], [0.5]])
    ratio, low, high = mismatch.paired_ratio(a, mask, b, mask)
    assert low < ratio < high and ratio == pytest.approx(10.0)
