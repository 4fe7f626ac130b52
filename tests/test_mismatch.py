import math

import pytest
import torch

from labutils import mismatch


def test_estimators_on_hand_computed_ratios():
    # two tokens with r = 2 and r = 1/2, one masked-out token that must not count
    lr = torch.tensor([[math.log(2.0), math.log(0.5), 9.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    assert mismatch.k1(lr, mask) == pytest.approx(0.0, abs=1e-7)
    assert mismatch.k2(lr, mask) == pytest.approx(math.log(2) ** 2 / 2, rel=1e-6)
    # k3 = (r - 1) - log r: (1 - ln 2) and (-0.5 + ln 2), mean 0.25
    assert mismatch.k3(lr, mask) == pytest.approx(0.25, rel=1e-6)


def test_k3_keeps_tiny_ratios_that_float32_would_cancel():
    lr = torch.full((1, 4), 1e-6)
    assert mismatch.k3(lr, torch.ones(1, 4)) == pytest.approx(0.5e-12, rel=1e-3)


def test_exact_token_kl_matches_the_definition_and_skips_banned_entries():
    mu = torch.tensor([0.5, 0.5, 0.0])
    pi = torch.tensor([0.25, 0.25, 0.5])
    kl = mismatch.token_kl(mu.log(), pi.log())
    assert float(kl) == pytest.approx(math.log(2), rel=1e-6)
    assert float(mismatch.token_kl(pi.log(), pi.log())) == 0.0


def test_sequence_log_ratio_sums_only_real_tokens():
    lr = torch.tensor([[0.1, -0.3, 5.0], [0.2, 0.2, 0.2]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    assert mismatch.sequence_log_ratio(lr, mask).tolist() == pytest.approx([-0.2, 0.6])


def test_length_fit_recovers_a_known_line():
    lengths = torch.tensor([100, 200, 300, 400])
    values = -0.002 * lengths + 0.5  # -2 per 1K tokens
    fit = mismatch.length_fit(lengths, values)
    assert fit.slope_per_1k == pytest.approx(-2.0)
    assert fit.intercept == pytest.approx(0.5)
    assert fit.r2 == pytest.approx(1.0)
    assert fit.stderr_per_1k == pytest.approx(0.0, abs=1e-5)


def test_length_fit_refuses_a_single_length():
    with pytest.raises(ValueError, match="two different lengths"):
        mismatch.length_fit(torch.tensor([5, 5]), torch.tensor([1.0, 2.0]))


def test_by_length_buckets():
    rows = mismatch.by_length(torch.tensor([1, 2, 10, 11]), torch.tensor([1.0, 3.0, 5.0, 5.0]), [0, 5, 20])
    assert [r["count"] for r in rows] == [2, 2]
    assert rows[0]["mean"] == pytest.approx(2.0)
    assert rows[1]["std"] == pytest.approx(0.0)


def test_empty_mask_is_a_clear_error():
    with pytest.raises(ValueError, match="no tokens"):
        mismatch.k1(torch.zeros(1, 2), torch.zeros(1, 2))


def test_by_position_averages_real_tokens_per_span():
    values = torch.tensor([[1.0, 2.0, 3.0, 4.0], [3.0, 4.0, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    assert mismatch.by_position(values, mask, [0, 2, 4]) == pytest.approx([2.5, 3.5])


def test_standard_errors_of_the_estimators_count_only_real_tokens():
    # per-token k1 values 1, 2, 3 (log r = -1, -2, -3) and a masked-out token that must not count
    lr = torch.tensor([[-1.0, -2.0, -3.0, 50.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    assert mismatch.k1_stderr(lr, mask) == pytest.approx(1 / math.sqrt(3))  # sample std 1 over √3
    k3_values = [math.expm1(-x) + x for x in (1.0, 2.0, 3.0)]
    mean = sum(k3_values) / 3
    std = math.sqrt(sum((v - mean) ** 2 for v in k3_values) / 2)
    assert mismatch.k3_stderr(lr, mask) == pytest.approx(std / math.sqrt(3), rel=1e-9)
    with pytest.raises(ValueError, match="two real tokens"):
        mismatch.stderr(lr, torch.tensor([[1, 0, 0, 0]]))


def test_exact_token_chi2_matches_the_definition_and_skips_banned_entries():
    mu = torch.tensor([0.5, 0.5, 0.0])
    pi = torch.tensor([0.25, 0.75, 0.0])
    # Σ π²/μ - 1 = 0.125 + 1.125 - 1
    assert float(mismatch.token_chi2(mu.log(), pi.log())) == pytest.approx(0.25, rel=1e-6)
    assert float(mismatch.token_chi2(pi.log(), pi.log())) == 0.0


def test_importance_weights_by_length_measures_and_predicts():
    lengths = torch.tensor([10, 10, 20, 20])
    seq = torch.tensor([0.0, math.log(2.0), math.log(0.5), math.log(0.5)])  # weights 1, 2 | 0.5, 0.5
    rows = mismatch.importance_weights_by_length(lengths, seq, [0, 15, 25], token_kl=0.01, token_chi2=0.02)
    first, second = rows
    assert (first["count"], first["mean_length"]) == (2, 10.0)
    assert first["mean"] == pytest.approx(1.5) and first["variance"] == pytest.approx(0.5)
    assert first["mean_stderr"] == pytest.approx(0.5) and first["median"] == pytest.approx(1.5)
    assert second["variance"] == pytest.approx(0.0) and second["median"] == pytest.approx(0.5)
    assert first["predicted_median"] == pytest.approx(math.exp(-0.1))
    assert second["predicted_variance"] == pytest.approx(1.02 ** 20 - 1)


def test_summary_reports_standard_errors_and_chi2():
    from types import SimpleNamespace

    vocab_mu = torch.tensor([[[0.5, 0.5], [0.5, 0.5]], [[0.5, 0.5], [0.5, 0.5]]]).log()
    # the padded position [1, 1] differs a lot and must not count
    vocab_pi = torch.tensor([[[0.25, 0.75], [0.5, 0.5]], [[0.5, 0.5], [0.9, 0.1]]]).log()
    ids = torch.tensor([[0, 1], [1, 0]])
    rollout = SimpleNamespace(mask=torch.tensor([[1, 1], [1, 0]]), lengths=torch.tensor([2, 1]),
                              logprobs=vocab_mu.gather(-1, ids[..., None])[..., 0], vocab_logprobs=vocab_mu)
    out = mismatch.summary(rollout, vocab_pi.gather(-1, ids[..., None])[..., 0], vocab_pi)
    assert out["token_chi2"] == pytest.approx(0.25 / 3, rel=1e-6)  # one of the three real positions differs
    lr = torch.tensor([math.log(0.5), 0.0, 0.0])  # log π/μ of the three sampled tokens
    assert out["k1_stderr"] == pytest.approx(float((-lr).std() / math.sqrt(3)), rel=1e-6)
