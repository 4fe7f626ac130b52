"""The long run's design: regime choice, collapse, the KL precursor, the clustered dose fit and the power."""
import math
import random

import pytest
from scipy import stats

from labutils import rl_analysis, rl_design


def _curve(evals, kl=None, every=10):
    steps = [i * every for i in range(len(evals))]
    return {"eval": evals, "eval_steps": steps, "kl": kl or [1e-3] * steps[-1]}


def test_a_dip_limit_widens_with_the_evaluations_it_is_corrected_for():
    one, many = rl_design.dip_limit(0.9, 512, 1), rl_design.dip_limit(0.9, 512, 24)
    assert many > one > 0
    # one-sided 5% over one evaluation: 1.645 standard errors of a difference of two binomial evaluations
    assert one == pytest.approx(1.645 * math.sqrt(2 * 0.9 * 0.1 / 512), rel=1e-3)


def test_the_regime_candidates_are_the_rates_whose_every_seed_gains_without_dipping_largest_first():
    steady = [_curve([0.9, 0.92, 0.95, 0.96, 0.97])] * 4
    dipping = [_curve([0.9, 0.6, 0.95, 0.96, 0.97])] + steady[1:]
    flat = [_curve([0.9, 0.9, 0.9, 0.9, 0.9])] * 4
    sweep = {3e-4: rl_design.regime(dipping, 512, 0.02), 1e-4: rl_design.regime(steady, 512, 0.02),
             3e-5: rl_design.regime(flat, 512, 0.02)}
    assert not sweep[3e-4]["stable"] and sweep[1e-4]["stable"] and not sweep[3e-5]["stable"]
    assert sweep[3e-4]["fp32_min_dip"] == pytest.approx(-0.3)
    assert sweep[3e-5]["fp32_improved_seeds"] == 0
    assert rl_design.stable_rates(sweep) == [1e-4]
    sweep[3e-5] = rl_design.regime(steady, 512, 0.02)
    assert rl_design.stable_rates(sweep) == [1e-4, 3e-5]  # largest first: the order fresh seeds check them in
    assert rl_design.stable_rates({3e-4: sweep[3e-4]}) == []


def test_a_dip_is_a_fall_below_the_running_maximum_that_stays_two_evaluations():
    assert rl_analysis.dip_at([0.8, 0.95, 0.8, 0.82, 0.9], 0.1) == 2  # below its maximum 0.95, twice
    assert rl_analysis.dip_at([0.8, 0.95, 0.8, 0.95, 0.8], 0.1) is None  # recovers at once each time
    assert rl_analysis.dip_at([0.8, 0.85, 0.9, 0.95, 0.8], 0.1) is None  # the last evaluation alone
    assert rl_analysis.dip_at([0.9, 0.7, 0.7], 0.1) == 1  # below the start counts too


def test_a_collapse_is_a_fall_that_never_recovers():
    recovers = [0.86, 0.54, 0.75, 0.85, 0.99]  # a dip of 0.32 that ends above its start
    assert rl_analysis.dip_at(recovers, 0.1) == 1
    assert rl_analysis.collapse_at(recovers, 0.1) is None
    assert rl_analysis.collapse_at([0.86, 0.70, 0.75, 0.89, 0.89], 0.1) is None
    assert rl_analysis.collapse_at([0.8, 0.95, 0.8, 0.82, 0.9], 0.1) is None  # 0.9 is back within 0.1 of 0.95
    assert rl_analysis.collapse_at([0.8, 0.95, 0.8, 0.82, 0.84], 0.1) == 2  # below 0.85 to the end
    assert rl_analysis.collapse_at([0.9, 0.7, 0.7], 0.1) == 1  # below the start counts too
    assert rl_analysis.collapse_at([0.8, 0.85, 0.9, 0.95, 0.8], 0.1) is None  # the last evaluation alone
    assert rl_analysis.collapse_at([0.9, 0.6, 0.5, 0.85, 0.7, 0.7], 0.1) == 4  # recovers, then falls for good


def test_the_precursor_compares_the_kl_before_the_collapse_with_the_kl_at_the_start():
    rising = _curve([0.9, 0.95, 0.7, 0.7], kl=[1e-3] * 15 + [5e-3] * 15)
    falling = _curve([0.9, 0.95, 0.7, 0.7], kl=[5e-3] * 15 + [1e-3] * 15)
    steady = _curve([0.9, 0.95, 0.96, 0.97])
    assert rl_analysis.kl_rise_before(rising, 0.1) is True
    assert rl_analysis.kl_rise_before(falling, 0.1) is False
    assert rl_analysis.kl_rise_before(steady, 0.1) is None
    assert rl_analysis.collapse_step(rising, 0.1) == 20 and rl_analysis.collapse_step(steady, 0.1) is None


def test_the_base_rate_compares_steady_runs_in_the_collapses_own_windows():
    # KL high over steps 11-20, then low: a rise just before step 20, none over the last steps
    early = [1e-3] * 10 + [5e-3] * 10 + [1e-4] * 20  # 40 steps, π-evals every 10: window 5
    steady = [_curve([0.9, 0.92, 0.93, 0.94, 0.95], kl=early, every=10)] * 3
    assert rl_analysis.precursor_window(steady[0]) == 5
    assert rl_analysis.kl_rise_at(steady[0], 20) is True  # steps 16-20 (5e-3) against 1-5 (1e-3)
    assert rl_analysis.kl_rise_at(steady[0], 40) is False  # the last steps against the first
    assert rl_analysis.kl_rise_base_rate(steady, [20]) == 1.0  # at the collapses' step, every run rose
    assert rl_analysis.kl_rise_base_rate(steady, [20, 40]) == 0.5
    assert math.isnan(rl_analysis.kl_rise_base_rate(steady, []))


def test_an_arm_counts_its_dips_and_its_collapses_apart():
    curves = [dict(_curve(e), reward=[0.5], grad_norm=[1.0], ess=[1.0], seq_chi2=[0.0], corrected=[])
              for e in ([0.86, 0.54, 0.75, 0.85, 0.99], [0.9, 0.6, 0.5, 0.5, 0.5], [0.9, 0.92, 0.95, 0.96, 0.97])]
    arm = rl_analysis.summarize(curves, 0.1)
    assert arm["dipped_seeds"] == 2 and arm["collapsed_seeds"] == 1


def test_the_clustered_interval_is_wider_than_the_naive_one_when_arms_share_an_error():
    rng = random.Random(0)
    x, y, arm = [], [], []
    for a in range(8):
        shared = rng.gauss(0, 0.05)  # one error for every seed of the arm
        for _ in range(4):
            x.append(-6 + a * 0.5)
            y.append(0.9 - 0.02 * x[-1] * 0 + shared + rng.gauss(0, 0.01))
            arm.append(str(a))
    fit = rl_analysis.clustered_fit(x, y, arm)
    naive = rl_analysis.clustered_fit(x, y, [str(i) for i in range(len(x))])
    assert fit["slope_high"] - fit["slope_low"] > naive["slope_high"] - naive["slope_low"]
    assert fit["runs"] == 32 and fit["clusters"] == 8
    assert fit["slope_se"] == max(fit["clustered_se"], fit["plain_se"])  # never below the plain error
    exact = rl_analysis.clustered_fit([0, 1, 2, 3], [1, 3, 5, 7], ["a", "a", "b", "b"])
    assert exact["slope"] == pytest.approx(2) and exact["intercept"] == pytest.approx(1)


def test_the_seeds_needed_give_the_power_asked_for_and_one_fewer_does_not():
    n = rl_design.seeds_needed(0.05, 0.05)
    assert rl_design.paired_power(0.05, 0.05, n) >= 0.8 > rl_design.paired_power(0.05, 0.05, n - 1)
    assert 9 <= n <= 11  # the normal approximation gives (1.96 + 0.84)² = 7.8, the t a little more
    assert rl_design.seeds_needed(0.05, 0.1) > n


def test_the_means_fit_is_exact_on_a_line_and_wider_than_the_clustered_one_on_few_settings():
    exact = rl_analysis.means_fit([0, 0, 1, 1, 2, 2], [1, 1, 3, 3, 5, 5.0], ["a", "a", "b", "b", "c", "c"])
    assert exact["slope"] == pytest.approx(2) and exact["slope_high"] - exact["slope_low"] == pytest.approx(0, abs=1e-9)
    rng = random.Random(1)
    x = [a * 0.5 for a in range(6) for _ in range(3)]
    y = [0.9 + rng.gauss(0, 0.02) for _ in x]
    arms = [str(a) for a in range(6) for _ in range(3)]
    assert rl_analysis.means_fit(x, y, arms)["clusters"] == 6


def test_a_run_takes_off_when_its_score_gains_the_minimum():
    assert rl_analysis.took_off(_curve([0.89, 0.9, 0.95, 0.99, 0.99]), 0.02)
    assert not rl_analysis.took_off(_curve([0.89, 0.88, 0.9, 0.9, 0.9]), 0.02)


def test_the_planning_sd_bounds_the_estimate_from_above_and_tightens_with_more_seeds():
    from scipy import stats

    assert rl_design.planning_sd(0.02, 18) == pytest.approx(0.02 * (18 / stats.chi2.ppf(0.2, 18)) ** 0.5)
    assert rl_design.planning_sd(0.02, 4) > rl_design.planning_sd(0.02, 18) > 0.02
    assert rl_design.planning_sd(0.02, 10_000) == pytest.approx(0.02, rel=0.02)


def test_power_is_the_t_tests_chance_to_see_a_gap_of_that_size():
    assert rl_analysis.power(0.0, 0.1, 4) == pytest.approx(0.05, abs=1e-3)  # no effect: only the test's 5%
    assert 0.5 < rl_analysis.power(0.1, 0.1, 4) < 0.6  # a gap at the half-width: a little over half (t skews)
    assert rl_analysis.power(1.0, 0.1, 4) == pytest.approx(1.0)
    assert rl_analysis.power(0.1, float("inf"), 4) == pytest.approx(0.05)
    # the paired design's power, computed from the seeds' spread, is the interval's power computed from its width
    sd, seeds = 0.07, 5
    half = stats.t.ppf(0.975, seeds - 1) * sd / math.sqrt(seeds)
    assert rl_analysis.power(0.05, half, seeds - 1) == pytest.approx(rl_design.paired_power(0.05, sd, seeds))


def test_a_probe_gap_pairs_the_prompts_and_averages_each_pairs_seeds_first():
    high = [{"probe_mismatch": [[4.0, 6.0, 8.0]]}, {"probe_mismatch": [[2.0, 4.0, 6.0]]}]  # per prompt 3, 5, 7
    low = [{"probe_mismatch": [[1.0, 1.0, 1.0]]}]
    gap = rl_analysis.probe_gap(high, low, 0)
    assert gap["gap"] == pytest.approx(4.0) and gap["prompts"] == 3
    assert gap["gap_se"] == pytest.approx(2.0 / math.sqrt(3))  # the differences 2, 4, 6 have SD 2
    assert gap["ratio"] == pytest.approx(5.0)
