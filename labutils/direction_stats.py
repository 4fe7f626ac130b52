"""Reading the committed update-direction run (chapter 5c) back from its inner products.

The run keeps every sketched update's inner product with every other, batch by batch (`gram`). From it,
any ratio of cross-batch products and its jackknife error can be computed after the run: ρ of one update
against a reference, and the difference of two ρ measured on the same batches (a correction against no
correction), whose error is far smaller than either's because the batches' noise is shared.
"""
from __future__ import annotations

import math
from statistics import NormalDist

import torch


class Gram:
    """The committed matrix of inner products, indexed by (sampler, correction)."""

    def __init__(self, gram: dict):
        self.matrix = torch.tensor(gram["matrix"], dtype=torch.float64)
        self.rows: dict[tuple[str, str], list[int]] = {}
        for i, label in enumerate(gram["labels"]):
            name, correction, _batch = label.split("/")
            self.rows.setdefault((name, correction), []).append(i)

    def cross(self, a: tuple[str, str], b: tuple[str, str]) -> tuple[float, torch.Tensor]:
        """The mean of ⟨a_i, b_j⟩ over batches i ≠ j, and its leave-one-batch-out values."""
        m = self.matrix[self.rows[a]][:, self.rows[b]]
        n = len(m)
        off = m.sum() - m.trace()
        loo = (off - m.sum(0) - m.sum(1) + 2 * m.diagonal()) / ((n - 1) * (n - 2))
        return float(off / (n * (n - 1))), loo

    def rho(self, update: tuple[str, str], reference: tuple[str, str] = ("fp32", "none")) -> tuple[float, torch.Tensor]:
        """ρ = ⟨ḡ, ḡ_ref⟩ / ‖ḡ_ref‖² and its leave-one-batch-out values."""
        top, top_loo = self.cross(update, reference)
        bottom, bottom_loo = self.cross(reference, reference)
        return top / bottom, top_loo / bottom_loo

    def bias(self, update: tuple[str, str], reference: tuple[str, str] = ("fp32", "none")) -> tuple[float, torch.Tensor]:
        """B² = ‖ḡ − ḡ_ref‖² / ‖ḡ_ref‖², the whole change of the update (its lost share and the part pointing
        elsewhere: (1 − ρ)² plus the orthogonal share), and its leave-one-batch-out values."""
        uu, uu_loo = self.cross(update, update)
        ur, ur_loo = self.cross(update, reference)
        rr, rr_loo = self.cross(reference, reference)
        return (uu - 2 * ur + rr) / rr, (uu_loo - 2 * ur_loo + rr_loo) / rr_loo

    def loss(self, update: tuple[str, str], reference: tuple[str, str] = ("fp32", "none")) -> tuple[float, torch.Tensor]:
        """⟨ḡ_ref − ḡ, ḡ_ref⟩, the numerator of 1 − ρ, and its leave-one-batch-out values: a test of ρ = 1 that
        does not divide by the noisy ‖ḡ_ref‖²."""
        rr, rr_loo = self.cross(reference, reference)
        ur, ur_loo = self.cross(update, reference)
        return rr - ur, rr_loo - ur_loo

    def denominator_cv(self, reference: tuple[str, str] = ("fp32", "none")) -> float:
        """The jackknife coefficient of variation of ‖ḡ_ref‖²: above about 0.3 a ratio's interval is approximate."""
        rr, loo = self.cross(reference, reference)
        return jackknife(loo) / abs(rr)

    def rho_difference(self, a: tuple[str, str], b: tuple[str, str]) -> tuple[float, float]:
        """ρ(a) − ρ(b) on the same batches, with its jackknife standard error."""
        rho_a, loo_a = self.rho(a)
        rho_b, loo_b = self.rho(b)
        return rho_a - rho_b, jackknife(loo_a - loo_b)


def jackknife(loo: torch.Tensor) -> float:
    """The jackknife standard error from leave-one-out values."""
    n = len(loo)
    return float(math.sqrt((n - 1) / n * float(((loo - loo.mean()) ** 2).sum())))


def critical(alpha: float, dof: int | None) -> float:
    """The two-sided critical value: Student's t on `dof` degrees of freedom (a jackknife over few batches), or
    the normal's when `dof` is None."""
    if dof is None:
        return NormalDist().inv_cdf(1 - alpha / 2)
    from scipy import stats

    return float(stats.t.ppf(1 - alpha / 2, dof))


def beyond(value: float, se: float, alpha: float = 0.05, dof: int | None = None) -> bool:
    """`value` differs from zero at two-sided level `alpha`."""
    return abs(value) > critical(alpha, dof) * se


def within(value: float, se: float, margin: float, alpha: float = 0.05, dof: int | None = None) -> bool:
    """`value`'s two-sided 1 − alpha interval lies inside ± `margin` (an equivalence test)."""
    return abs(value) + critical(alpha, dof) * se < margin


def power(se: float, effect: float, alpha: float = 0.05, dof: int | None = None) -> float:
    """The chance the two-sided test sees a true change of `effect` given its standard error (a shifted t)."""
    from scipy import stats

    if not math.isfinite(se) or se <= 0:
        return float("nan")
    crit, shift = critical(alpha, dof), effect / se
    dist = stats.t(dof) if dof is not None else stats.norm()
    return float(dist.sf(crit - shift) + dist.cdf(-crit - shift))


def p_value(value: float, se: float, dof: int | None = None) -> float:
    """The two-sided p-value of `value` against zero (Student's t on `dof`, or normal)."""
    from scipy import stats

    dist = stats.t(dof) if dof is not None else stats.norm()
    return float(2 * dist.sf(abs(value) / se)) if se > 0 else float("nan")


def holm(p_values: dict[str, float], alpha: float = 0.05) -> set[str]:
    """The names whose tests Holm's step-down procedure rejects at family-wise level `alpha`."""
    rejected = set()
    for i, (name, p) in enumerate(sorted(p_values.items(), key=lambda item: item[1])):
        if not p <= alpha / (len(p_values) - i):
            break
        rejected.add(name)
    return rejected


def verdict(drop: float, se: float, smallest: float, alpha: float = 0.05, dof: int | None = None,
            change: tuple[float, float] | None = None) -> str:
    """'shown' when the drop of ρ below 1 is beyond its interval; 'contradicted' when its 1 − 2α interval lies
    within ± the smallest drop that matters (two one-sided tests at α) and, given `change` (B² and its standard
    error), the whole change's upper bound lies below that drop squared; else 'unresolved'."""
    if drop > 0 and beyond(drop, se, alpha, dof):
        return "shown"
    equivalent = within(drop, se, smallest, 2 * alpha, dof) and (
        change is None or change[0] + critical(2 * alpha, dof) * change[1] < smallest ** 2)
    return "contradicted" if equivalent else "unresolved"
