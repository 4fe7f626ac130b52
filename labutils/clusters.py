"""Means of per-token measurements with standard errors over sequences (clusters).

The tokens of one sequence share a prompt and a context, so their errors are not independent, and
a standard error that counts tokens (or blocks of one sequence) as independent draws is too small
when sequences differ. Sequences are independent draws: every standard error here comes from the
spread of the per-sequence sums (the cluster-robust linearisation of a ratio of sums), and has as
many degrees of freedom as there are sequences, less one.
"""
from __future__ import annotations

import math

import torch


def sequence_sums(values: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per sequence (row): the sum of `values` over its real tokens and their count; empty rows dropped."""
    real = mask.bool()
    sums = torch.where(real, values.double(), 0.0).sum(-1)
    counts = real.sum(-1).double()
    kept = counts > 0
    return sums[kept], counts[kept]


def ratio(numerator: torch.Tensor, denominator: torch.Tensor, mask: torch.Tensor
          ) -> tuple[float, float, int]:
    """Σ numerator / Σ denominator over the real tokens, its standard error over sequences, and the
    number of sequences. Needs two sequences with real tokens and a non-zero denominator."""
    real = mask.bool()
    top = torch.where(real, numerator.double(), 0.0).sum(-1)
    bottom = torch.where(real, denominator.double(), 0.0).sum(-1)
    kept = real.any(-1)
    top, bottom = top[kept], bottom[kept]
    clusters = int(top.numel())
    if clusters < 2:
        raise ValueError("a standard error over sequences needs at least two sequences.")
    if float(bottom.sum()) == 0:
        raise ValueError("the denominator sums to zero over the real tokens.")
    value = float(top.sum() / bottom.sum())
    residuals = top - value * bottom  # each sequence's departure from the pooled ratio
    variance = clusters / (clusters - 1) * float((residuals ** 2).sum()) / float(bottom.sum()) ** 2
    return value, math.sqrt(variance), clusters


def mean(values: torch.Tensor, mask: torch.Tensor) -> tuple[float, float]:
    """Mean of a per-token value over the real tokens, and its standard error over sequences."""
    value, stderr, _ = ratio(values, torch.ones_like(values, dtype=torch.float64), mask)
    return value, stderr


def interval(value: float, stderr: float, sequences: int, confidence: float = 0.95
             ) -> tuple[float, float]:
    """Two-sided t interval around `value` with `sequences` − 1 degrees of freedom."""
    from scipy import stats

    half = float(stats.t.ppf(0.5 + confidence / 2, sequences - 1)) * stderr
    return value - half, value + half


def by_bucket(values: torch.Tensor, probability: torch.Tensor, mask: torch.Tensor,
              edges: list[float]) -> list[dict]:
    """Tokens, mean and standard error over sequences of a per-token value, by the probability
    bucket [edges[i], edges[i+1]) (the last one closed); a bucket seen in one sequence has no error."""
    rows = []
    for low, high in zip(edges[:-1], edges[1:]):
        below = (probability < high) if high < 1 else (probability <= high)
        inside = mask.bool() & (probability >= low) & below
        count = int(inside.sum())
        seen = int(inside.any(-1).sum())
        centre, stderr = float("nan"), float("nan")
        if seen >= 2:
            centre, stderr = mean(values, inside)
        elif count:
            centre = float(values.double()[inside].mean())
        rows.append({"from": low, "to": high, "count": count, "sequences": seen,
                     "mean": centre, "stderr": stderr})
    return rows


def by_position(values: torch.Tensor, mask: torch.Tensor, edges: list[int]) -> list[dict]:
    """Mean of a per-token value over the real tokens at positions [edges[i], edges[i+1]) of each
    row, its standard error over sequences (a sequence's tokens in the band are one cluster) and the
    number of sequences with tokens there; a band seen in fewer than two sequences has no error."""
    rows = []
    for start, end in zip(edges[:-1], edges[1:]):
        inside = mask[:, start:end].bool()
        seen = int(inside.any(-1).sum())
        centre, stderr = float("nan"), float("nan")
        if seen >= 2:
            centre, stderr = mean(values[:, start:end], inside)
        elif seen:
            centre = float(values[:, start:end].double()[inside].mean())
        rows.append({"from": start, "to": end, "mean": centre, "stderr": stderr,
                     "sequences": seen})
    return rows


def share_below(probability: torch.Tensor, mask: torch.Tensor, cut: float) -> float:
    """Share of the real tokens whose probability is below `cut`."""
    real = mask.bool()
    return float((real & (probability < cut)).sum() / real.sum())


def share_above(probability: torch.Tensor, mask: torch.Tensor, cut: float) -> float:
    """Share of the real tokens whose probability is above `cut`."""
    real = mask.bool()
    return float((real & (probability > cut)).sum() / real.sum())


def sd_interval(sd: float, draws: int, confidence: float = 0.95) -> tuple[float, float]:
    """Chi-square interval for a standard deviation estimated from `draws` independent draws."""
    from scipy import stats

    df = draws - 1
    tail = (1 - confidence) / 2
    return (sd * math.sqrt(df / stats.chi2.ppf(1 - tail, df)),
            sd * math.sqrt(df / stats.chi2.ppf(tail, df)))


def power_law_fits(lengths: list[int], lows: list[float], highs: list[float],
                   exponent: float = 0.5) -> bool:
    """Whether one curve c·n^exponent passes through every interval [low, high] at its n."""
    floor = max(low / n ** exponent for n, low in zip(lengths, lows))
    ceiling = min(high / n ** exponent for n, high in zip(lengths, highs))
    return floor <= ceiling


def prefix_slope(log_ratio: torch.Tensor, step: int, window: int) -> tuple[float, float]:
    """Slope of the prefix log-ratio against n per 1K tokens, as `mismatch.prefix_slope` fits it
    (one least-squares line per `window`-token run, prefixes every `step` tokens), with its standard
    error over sequences: each sequence's runs are averaged first. Sequences of one length."""
    rows, length = log_ratio.shape
    window = min(window, length)
    grid = torch.arange(step, window + 1, step, dtype=torch.float64)
    runs = length // window
    if rows < 2 or grid.numel() < 2:
        raise ValueError("a slope over sequences needs two sequences and two prefixes per run.")
    centred = grid - grid.mean()
    weights = centred / centred.square().sum()  # the line's slope is Σ weight_k · prefix_k
    # prefix k sums the tokens before grid_k, so token t carries the weights of every later prefix
    positions = torch.arange(window, dtype=torch.float64)
    per_token = ((grid[None, :] > positions[:, None]) * weights).sum(-1)
    x = log_ratio.double()[:, : runs * window].reshape(rows, runs, window)
    per_sequence = 1000 * (x * per_token).sum(-1).mean(-1)
    return float(per_sequence.mean()), float(per_sequence.std() / rows ** 0.5)
