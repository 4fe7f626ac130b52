"""labutils.clusters: means over tokens with standard errors over sequences."""
import math

import pytest
import torch

from labutils import clusters


def test_equal_sequences_give_the_spread_of_their_means():
    values = torch.tensor([[1.0, 3.0], [5.0, 7.0], [0.0, 2.0]])
    mask = torch.ones_like(values)
    mean, stderr = clusters.mean(values, mask)
    per_sequence = torch.tensor([2.0, 6.0, 1.0], dtype=torch.float64)
    assert mean == pytest.approx(3.0)
    assert stderr == pytest.approx(float(per_sequence.std() / 3 ** 0.5))


def test_unequal_sequences_weigh_tokens_and_ignore_padding():
    values = torch.tensor([[1.0, 1.0, 1.0, 99.0], [4.0, 99.0, 99.0, 99.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]])
    mean, stderr = clusters.mean(values, mask)
    assert mean == pytest.approx(7 / 4)  # (1 + 1 + 1 + 4) over four tokens
    # residuals 3 − 3·7/4 and 4 − 7/4, two clusters: variance 2·Σ e² / 4²
    residuals = (3 - 3 * 7 / 4, 4 - 7 / 4)
    assert stderr == pytest.approx(math.sqrt(2 * sum(e * e for e in residuals) / 16))


def test_a_ratio_of_sums_and_its_clusters():
    top = torch.tensor([[1.0, 1.0], [2.0, 2.0], [3.0, 3.0]])
    bottom = 2 * top  # every sequence has the same ratio: no spread at all
    value, stderr, sequences = clusters.ratio(top, bottom, torch.ones_like(top))
    assert (value, stderr, sequences) == (pytest.approx(0.5), pytest.approx(0.0), 3)
    with pytest.raises(ValueError, match="two sequences"):
        clusters.ratio(top[:1], bottom[:1], torch.ones_like(top[:1]))


def test_sequences_that_differ_widen_the_error_beyond_independent_tokens():
    generator = torch.Generator().manual_seed(0)
    offsets = torch.tensor([[0.0], [1.0], [2.0], [3.0]])  # each sequence sits at its own level
    values = offsets + 0.1 * torch.randn(4, 256, generator=generator)
    mask = torch.ones_like(values)
    _, per_sequence = clusters.mean(values, mask)
    per_token = float(values.double().std() / values.numel() ** 0.5)
    assert per_sequence > 10 * per_token


def test_interval_uses_the_sequences_degrees_of_freedom():
    low, high = clusters.interval(1.0, 0.1, 4)
    assert high - 1.0 == pytest.approx(1.0 - low)
    assert (high - 1.0) / 0.1 == pytest.approx(3.182, abs=1e-3)  # t(0.975, 3 df)


def test_buckets_count_tokens_and_sequences():
    values = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    probability = torch.tensor([[0.005, 0.5, 1.0], [0.05, 0.5, 0.95]])
    rows = clusters.by_bucket(values, probability, torch.ones_like(values), [0.0, 0.01, 0.1, 0.9, 1.0])
    assert [r["count"] for r in rows] == [1, 1, 2, 2]
    assert [r["sequences"] for r in rows] == [1, 1, 2, 2]
    assert rows[0]["mean"] == 1.0 and math.isnan(rows[0]["stderr"])
    assert rows[2]["mean"] == pytest.approx(3.5) and rows[3]["mean"] == pytest.approx(4.5)
    assert clusters.share_below(probability, torch.ones_like(values), 0.1) == pytest.approx(2 / 6)
    assert clusters.share_above(probability, torch.ones_like(values), 0.9) == pytest.approx(2 / 6)


def test_sd_interval_from_eight_draws():
    low, high = clusters.sd_interval(1.0, 8)
    assert low == pytest.approx(0.661, abs=1e-3) and high == pytest.approx(2.035, abs=1e-3)


def test_a_square_root_curve_through_intervals():
    lengths = [256, 512, 1024]
    exact = [0.1 * n ** 0.5 for n in lengths]
    assert clusters.power_law_fits(lengths, [0.9 * s for s in exact], [1.1 * s for s in exact])
    # linear growth, with tight intervals: no c·√n passes through all three
    linear = [0.01 * n for n in lengths]
    assert not clusters.power_law_fits(lengths, [0.95 * s for s in linear], [1.05 * s for s in linear])
    assert clusters.power_law_fits(lengths, [0.95 * s for s in linear], [1.05 * s for s in linear],
                                   exponent=1.0)


def test_the_prefix_slope_matches_the_pooled_fit_and_clusters_its_error():
    from labutils import mismatch

    generator = torch.Generator().manual_seed(1)
    log_ratio = -1e-3 + 0.05 * torch.randn(4, 512, generator=generator)
    mask = torch.ones_like(log_ratio)
    pooled, per_run = mismatch.prefix_slope(log_ratio, mask, 32, 128)
    slope, stderr = clusters.prefix_slope(log_ratio, 32, 128)
    assert slope == pytest.approx(pooled)
    assert stderr > 0
    # one run per sequence: the error over sequences is the error over runs
    assert clusters.prefix_slope(log_ratio, 32, 512) == pytest.approx(
        mismatch.prefix_slope(log_ratio, mask, 32, 512))


def test_bands_of_positions_take_their_errors_over_sequences():
    values = torch.tensor([[1.0, 3.0, 2.0, 2.0], [5.0, 7.0, 4.0, 8.0], [0.0, 2.0, 0.0, 99.0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 1, 0]])
    first, second = clusters.by_position(values, mask, [0, 2, 4])
    per_sequence = torch.tensor([2.0, 6.0, 1.0], dtype=torch.float64)  # each row's first band
    assert (first["from"], first["to"], first["sequences"]) == (0, 2, 3)
    assert first["mean"] == pytest.approx(3.0)
    assert first["stderr"] == pytest.approx(float(per_sequence.std() / 3 ** 0.5))
    assert second["mean"] == pytest.approx(16 / 5)  # padding left out, tokens weighed
    alone = clusters.by_position(values, torch.tensor([[1, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]]),
                                 [0, 2, 4])
    assert alone[0]["mean"] == 1.0 and math.isnan(alone[0]["stderr"]) and alone[0]["sequences"] == 1
    assert alone[1]["sequences"] == 0 and math.isnan(alone[1]["mean"])
