"""What chapter 5b reads from its RL runs: per-arm summaries, paired comparisons in the ledger's
vocabulary, collapses (falls below a seed's own running maximum that never recover) and dips (that
may), whether the mismatch rose before a collapse (against runs that did not collapse, in the same
windows), and the dose–response of the trained policy's score on the mismatch.
"""
from __future__ import annotations

import math

import numpy as np
from scipy import stats

from .rl_design import LEVEL, binomial_se, score

DIFFERENCE, NO_DIFFERENCE, INCONCLUSIVE = "a difference", "no difference, with power", "inconclusive"


def dip_at(evals: list[float], margin: float, stay: int = 2) -> int | None:
    """The index of the π-eval where a seed dips, or None: it falls `margin` or more below its own
    running maximum and stays there for at least `stay` evaluations (it may recover later)."""
    best = evals[0]
    for i, value in enumerate(evals):
        window = evals[i:i + stay]
        if len(window) == stay and all(v <= best - margin for v in window):
            return i
        best = max(best, value)
    return None


def collapse_at(evals: list[float], margin: float, stay: int = 2) -> int | None:
    """The index of the π-eval where a seed collapses, or None: it falls `margin` or more below its
    running maximum and never returns above that maximum minus the margin (at least `stay` evaluations
    from the fall to the end). A dip that recovers is not a collapse."""
    best = evals[0]
    for i, value in enumerate(evals):
        rest = evals[i:]
        if len(rest) >= stay and all(v <= best - margin for v in rest):
            return i
        best = max(best, value)
    return None


def kl_rise_at(curve: dict, step: int) -> bool:
    """Whether a run's token KL over the `precursor_window` steps before `step` exceeds its KL over as
    many steps at the start: the precursor's comparison, for any run at any step."""
    width, kl = precursor_window(curve), curve["kl"]  # one KL per optimizer step, step 1 first
    before, first = kl[max(0, step - width):step], kl[:width]
    return sum(before) / len(before) > sum(first) / len(first)


def kl_rise_before(curve: dict, margin: float) -> bool | None:
    """For a collapsed run, whether its token KL rose in the steps just before the collapse (against as
    many steps at the start); None for a run that did not collapse."""
    at = collapse_at(curve["eval"], margin)
    return None if at is None else kl_rise_at(curve, curve["eval_steps"][at])


def collapse_step(curve: dict, margin: float) -> int | None:
    """The optimizer step of a run's collapse (the π-eval where it falls), or None."""
    at = collapse_at(curve["eval"], margin)
    return None if at is None else curve["eval_steps"][at]


def kl_rise_base_rate(steady: list[dict], steps: list[int]) -> float:
    """How often runs that did not collapse show the same rise, in the same windows as the collapses:
    each steady run compared at each collapse's step (nan where there is nothing to compare)."""
    rises = [kl_rise_at(c, step) for step in steps for c in steady]
    return sum(rises) / len(rises) if rises else float("nan")


def precursor_window(curve: dict) -> int:
    """The steps the precursor compares: half the interval between π-evals."""
    return max(1, (curve["eval_steps"][1] - curve["eval_steps"][0]) // 2)


def clustered_fit(x: list[float], y: list[float], clusters: list[str], level: float = 1 - LEVEL) -> dict:
    """Least squares of y on x, with the slope's interval robust to correlation within a cluster.

    The seeds of one arm share its sampler and so its errors; the cluster-robust (CR1) variance sums the
    score contributions per arm, and the interval uses a t with (arms − 1) degrees of freedom. With few
    clusters CR1 can come out below the plain least-squares error, which is then no protection at all:
    the interval takes the larger of the two (`slope_se`; both are returned).
    """
    X = np.column_stack([np.ones(len(x)), np.asarray(x, float)])
    Y = np.asarray(y, float)
    bread = np.linalg.inv(X.T @ X)
    beta = bread @ X.T @ Y
    resid = Y - X @ beta
    groups = sorted(set(clusters))
    meat = np.zeros((2, 2))
    for g in groups:
        rows = [i for i, c in enumerate(clusters) if c == g]
        u = X[rows].T @ resid[rows]
        meat += np.outer(u, u)
    n, k, G = len(Y), 2, len(groups)
    cov = bread @ meat @ bread * G / (G - 1) * (n - 1) / (n - k)
    clustered_se = float(math.sqrt(cov[1, 1]))
    plain_se = float(math.sqrt(resid @ resid / (n - k) * bread[1, 1]))
    se = max(clustered_se, plain_se)
    half = float(stats.t.ppf(0.5 + level / 2, G - 1)) * se
    return {"slope": float(beta[1]), "intercept": float(beta[0]), "slope_se": se, "clustered_se": clustered_se,
            "plain_se": plain_se, "slope_low": float(beta[1]) - half, "slope_high": float(beta[1]) + half,
            "runs": n, "clusters": G, "residual_sd": float(math.sqrt(resid @ resid / (n - k)))}


def summarize(curves: list[dict], margin: float) -> dict:
    """One arm over its seeds: scores (mean of each seed's last three π-evals), collapses, mismatch, health."""
    def mean(xs):
        return sum(xs) / len(xs)

    scores = [score(c["eval"]) for c in curves]
    spread = math.sqrt(sum((s - mean(scores)) ** 2 for s in scores) / (len(scores) - 1)) if len(scores) > 1 else float("nan")
    last = max(1, len(curves[0]["reward"]) // 4)
    return {"score": mean(scores), "score_sd": spread, "scores": scores, "seeds": len(curves),
            "start_eval_reward": mean([c["eval"][0] for c in curves]),
            "final_reward": mean([mean(c["reward"][-last:]) for c in curves]),
            "mean_kl": mean([mean(c["kl"]) for c in curves]),
            "max_grad_norm": max(max(c["grad_norm"]) for c in curves),
            "ess_mean": mean([mean(c["ess"]) for c in curves]),
            "seq_chi2_mean": mean([mean(c["seq_chi2"]) for c in curves]),
            "corrected_mean": mean([mean(c["corrected"]) for c in curves]) if curves[0]["corrected"] else 0.0,
            "collapsed_seeds": sum(collapse_at(c["eval"], margin) is not None for c in curves),
            "dipped_seeds": sum(dip_at(c["eval"], margin) is not None for c in curves),
            "eval_problems": curves[0].get("eval_problems", 0)}


def compare(a: dict, b: dict, level: float = 1 - LEVEL) -> tuple[float, float]:
    """(gap, half-width) of the score, b − a, over the seeds the two arms share.

    Each pair shares its seed (data order, initial weights, sampler stream), so the gap is the mean of the
    per-seed differences and the half-width that of its t interval. Its standard error is floored at the
    binomial noise of a three-evaluation score on a finite problem set, so tied seeds cannot make the noise
    vanish.
    """
    diffs = [y - x for x, y in zip(a["scores"], b["scores"])]
    n = len(diffs)
    gap = sum(diffs) / n
    if n < 2:
        return gap, float("inf")
    spread = math.sqrt(sum((d - gap) ** 2 for d in diffs) / (n - 1) / n)
    problems = max(1, min(a["eval_problems"], b["eval_problems"]))
    binomial = math.hypot(binomial_se(a["score"], 3 * problems), binomial_se(b["score"], 3 * problems)) / math.sqrt(n)
    return gap, float(stats.t.ppf(0.5 + level / 2, n - 1)) * max(spread, binomial)


def power(effect: float, half: float, dof: int, level: float = 1 - LEVEL) -> float:
    """Power of the two-sided t test behind a 95% interval of half-width `half` on `dof` degrees of freedom
    to see a true difference `effect` (noncentral t)."""
    if not math.isfinite(half) or dof < 1:
        return LEVEL if abs(effect) < math.inf else 1.0
    if half <= 0:
        return 1.0
    crit = float(stats.t.ppf(0.5 + level / 2, dof))
    shift = abs(effect) / (half / crit)
    found = float(stats.nct.sf(crit, dof, shift) + stats.nct.cdf(-crit, dof, shift))
    # scipy's noncentral t returns nan far in its tail, where the power is 1 to many digits
    return found if math.isfinite(found) else float(stats.norm.sf(crit - shift) + stats.norm.cdf(-crit - shift))


def conclusion(gap: float, half: float, effect: float, dof: int) -> tuple[str, float]:
    """A comparison in the book's vocabulary, with the power that qualifies it.

    Beyond its interval it is *a difference*. Within it, it is *no difference, with power* where a true
    difference of `effect` (the smallest one that matters, fixed in advance) would be seen with at least
    80% power and the interval excludes it; otherwise *inconclusive*, with the power for the gap observed.
    """
    if abs(gap) > half:
        return DIFFERENCE, power(gap, half, dof)
    if power(effect, half, dof) >= 0.8 and abs(gap) + half < abs(effect):
        return NO_DIFFERENCE, power(effect, half, dof)
    return INCONCLUSIVE, power(gap, half, dof)


def sentence(gap: float, half: float, effect: float, seeds: int, unit: str = "in score") -> str:
    """`conclusion` of a paired comparison over `seeds` seeds, written out for the chapter's prose."""
    kind, p = conclusion(gap, half, effect, seeds - 1)
    where = f"{gap:+.3f} {unit} (95% interval ±{half:.3f}, {seeds} paired seeds)"
    if kind == DIFFERENCE:
        return f"a difference: {where}."
    if kind == NO_DIFFERENCE:
        return f"no difference, with power: {where}, with {p:.0%} power to see an effect of {effect:.2g}."
    for_effect = power(effect, half, seeds - 1)
    reach = " (the interval still reaches it)" if for_effect >= 0.8 else ""
    return (f"inconclusive: {where}; power {p:.0%} for the observed gap, {for_effect:.0%} for an "
            f"effect of {effect:.2g}{reach}.")


def dose_points(curves: dict[str, list[dict]], floor: str = "fp32") -> list[tuple[str, float, float]]:
    """(arm, log10 of the run's own mean token KL, score) for every run but the `floor` arm's."""
    return [(name, math.log10(sum(c["kl"]) / len(c["kl"])), score(c["eval"]))
            for name, per_seed in curves.items() if name != floor for c in per_seed]


def took_off(curve: dict, min_gain: float) -> bool:
    """Whether a run's score rose at least `min_gain` above its start (runs here either take off or stall)."""
    return score(curve["eval"]) - curve["eval"][0] >= min_gain


def means_fit(x: list[float], y: list[float], clusters: list[str], level: float = 1 - LEVEL) -> dict:
    """Least squares through the clusters' means (one point per setting), with a t interval on
    (settings − 2) degrees of freedom: cruder than the clustered fit, and free of its few-cluster bias."""
    groups = sorted(set(clusters))
    mx = [np.mean([a for a, c in zip(x, clusters) if c == g]) for g in groups]
    my = [np.mean([b for b, c in zip(y, clusters) if c == g]) for g in groups]
    X = np.column_stack([np.ones(len(mx)), mx])
    beta, *_ = np.linalg.lstsq(X, np.asarray(my), rcond=None)
    resid = np.asarray(my) - X @ beta
    dof = len(groups) - 2
    se = float(math.sqrt(resid @ resid / dof * np.linalg.inv(X.T @ X)[1, 1]))
    half = float(stats.t.ppf(0.5 + level / 2, dof)) * se
    return {"slope": float(beta[1]), "slope_low": float(beta[1]) - half, "slope_high": float(beta[1]) + half,
            "runs": len(x), "clusters": len(groups)}


def score_text(score: float, spread: float) -> str:
    """A score with its spread over seeds, or alone where one seed gives no spread."""
    return f"{score:.3f}" if math.isnan(spread) else f"{score:.3f} ± {spread:.3f}"


def probe_change(runs: list[dict], key: str = "probe_mismatch") -> dict:
    """A pair's probe `key` (per-prompt lists, first and last evaluation) from its start to its end, over seeds.

    The seeds share their prompts, so each prompt's change is averaged over the seeds first and the standard
    error is taken over prompts. The completions are resampled at every probe, so a change includes changes
    in the policy's own samples (sharper distributions, other lengths), not only in rounding. The verdict
    needs 3 standard errors and every seed's change to have the same sign.
    """
    per_seed = [[b - a for a, b in zip(r[key][0], r[key][-1])] for r in runs]
    per_prompt = np.mean(per_seed, axis=0)
    seed_changes = [float(np.mean(c)) for c in per_seed]
    start = float(np.mean([np.mean(r[key][0]) for r in runs]))
    end = float(np.mean([np.mean(r[key][-1]) for r in runs]))
    change, se = float(per_prompt.mean()), float(per_prompt.std(ddof=1) / math.sqrt(len(per_prompt)))
    agree = len({c > 0 for c in seed_changes}) == 1
    verdict = ("seeds disagree" if not agree else "no change beyond 3 SE" if abs(change) <= 3 * se
               else "grew" if change > 0 else "shrank")
    return {"start": start, "end": end, "change": change, "change_se": se, "seed_changes": seed_changes,
            "seeds": len(runs), "seeds_agree": agree, "rising_prompts": int((per_prompt > 0).sum()),
            "prompts": len(per_prompt), "verdict": verdict}


def probe_gap(high: list[dict], low: list[dict], index: int, key: str = "probe_mismatch") -> dict:
    """One pair's probe `key` minus another's at evaluation `index`, paired by prompt.

    Both pairs probe the same prompts, so each prompt's value is averaged over its pair's seeds and the
    difference's standard error is taken over prompts; `ratio` is the ratio of the two means.
    """
    a = np.mean([r[key][index] for r in high], axis=0)
    b = np.mean([r[key][index] for r in low], axis=0)
    diff = a - b
    return {"gap": float(diff.mean()), "gap_se": float(diff.std(ddof=1) / math.sqrt(len(diff))),
            "ratio": float(a.mean() / b.mean()), "prompts": len(diff)}
