"""The design of chapter 5b's long RL run: a run's score, the regime chosen on the fp32 control first,
and the seeds the fix comparison needs. Every threshold is a field of the profile's `LongPlan`, fixed
before any run; what the chapter reads from the runs afterwards is `rl_analysis`.
"""
from __future__ import annotations

import math

from scipy import stats

LEVEL = 0.05  # two-sided level of every test, and the family-wise level of the dip test


def score(evals: list[float], last: int = 3) -> float:
    """A run's score: the mean of its last `last` π-evals (less noisy than the final one alone)."""
    tail = evals[-last:]
    return sum(tail) / len(tail)


def binomial_se(accuracy: float, problems: int) -> float:
    """The standard error of an accuracy measured on `problems` problems."""
    return math.sqrt(max(accuracy * (1 - accuracy), 0.0) / problems)


def dip_limit(start: float, problems: int, evaluations: int, level: float = LEVEL) -> float:
    """How far below its start one π-eval may fall by chance alone.

    Both the start and the later evaluation carry binomial noise, so a dip's standard error is
    √2 × binomial_se. One-sided at `level`, Bonferroni-corrected over the `evaluations` looked at:
    without the correction, one of a few dozen evaluations dips past two standard errors by chance.
    """
    z = stats.norm.ppf(1 - level / evaluations)
    return float(z * math.sqrt(2) * binomial_se(start, problems))


def regime(curves: list[dict], problems: int, min_gain: float) -> dict:
    """Whether a setting is a stable regime for the control: every seed's score gains at least
    `min_gain` over its start, and no π-eval dips below the start by more than `dip_limit`."""
    evaluations = sum(len(c["eval"]) - 1 for c in curves)
    start = curves[0]["eval"][0]
    limit = dip_limit(start, problems, evaluations)
    dips = [min(c["eval"][1:]) - c["eval"][0] for c in curves]
    gains = [score(c["eval"]) - c["eval"][0] for c in curves]
    improved = sum(g >= min_gain for g in gains)
    return {"fp32_min_dip": min(dips), "dip_limit": limit, "fp32_improved_seeds": improved,
            "seeds": len(curves), "gains": gains, "stable": improved == len(curves) and min(dips) >= -limit}


def stable_rates(sweep: dict[float, dict]) -> list[float]:
    """The learning rates of a sweep whose `regime` is stable, largest first: the candidates, in the order
    in which fresh seeds check them. The largest rate that passes on a few seeds may sit at the edge of
    stability, where fresh seeds fail about as often as they pass; a second set of seeds is the margin."""
    return sorted((lr for lr, found in sweep.items() if found["stable"]), reverse=True)


def paired_power(effect: float, sd_diff: float, seeds: int, level: float = LEVEL) -> float:
    """Power of a two-sided paired t test over `seeds` seeds to see a mean difference `effect`."""
    if seeds < 2 or sd_diff <= 0:
        return float("nan") if seeds < 2 else 1.0
    dof = seeds - 1
    crit = stats.t.ppf(1 - level / 2, dof)
    shift = abs(effect) / (sd_diff / math.sqrt(seeds))
    found = float(stats.nct.sf(crit, dof, shift) + stats.nct.cdf(-crit, dof, shift))
    # scipy's noncentral t returns nan far in its tail, where the power is 1 to many digits
    return found if math.isfinite(found) else float(stats.norm.sf(crit - shift) + stats.norm.cdf(-crit - shift))


def planning_sd(sd: float, dof: int, confidence: float = 0.8) -> float:
    """A one-sided `confidence` upper bound on a standard deviation estimated with `dof` degrees of freedom:
    planning on the estimate itself gives less power than asked for about half the time."""
    return float(sd * math.sqrt(dof / stats.chi2.ppf(1 - confidence, dof)))


def seeds_needed(effect: float, sd_diff: float, power: float = 0.8, most: int = 1000) -> int:
    """The fewest seeds at which a paired t test has `power` to see `effect`, given per-seed differences of
    standard deviation `sd_diff`."""
    return next((n for n in range(2, most + 1) if paired_power(effect, sd_diff, n) >= power), most)
