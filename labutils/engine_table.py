"""Reading the cross-engine run: each sampler–trainer pair's mismatch with errors over sequences.

The run (`cross_engine`) keeps, per pair and sequence, block sums of the exact token KL and of log π/μ.
Every sequence has the same length, so a sequence's mean is its blocks' sum over its tokens, and each
quantity's standard error is taken over sequences (one cluster each), as chapter 4b takes them.
"""
from __future__ import annotations

import math

import torch

from . import clusters, mismatch

SPREAD_AT = (256, 512, 1024)


def pair_name(sampler: str, trainer: str) -> str:
    """The run's key of a pair: `llama.cpp:bf16|torch:fp32`."""
    return f"{sampler}|{trainer}"


def _mean(values: torch.Tensor) -> tuple[float, float]:
    return float(values.mean()), float(values.std() / math.sqrt(values.numel()))


def per_sequence_kl(pair: dict, plan: dict) -> torch.Tensor:
    """Each sequence's mean token KL (nats per token)."""
    return torch.tensor(pair["kl_blocks"], dtype=torch.float64).sum(-1) / plan["tokens"]


def summary(pair: dict, plan: dict) -> dict:
    """Token KL, KL by quarter of the sequence, log-weight drift per 1K tokens and its spread, with errors."""
    kl = torch.tensor(pair["kl_blocks"], dtype=torch.float64)
    ratio = torch.tensor(pair["log_ratio_blocks"], dtype=torch.float64)
    sequences, blocks = kl.shape
    block = plan["block"]
    value, se = _mean(kl.sum(-1) / plan["tokens"])
    low, high = clusters.interval(value, se, sequences)
    quarter = blocks // 4
    bands = [dict(zip(("mean", "stderr"), _mean(kl[:, i * quarter:(i + 1) * quarter].sum(-1) / (quarter * block))),
                  start=i * quarter * block, stop=(i + 1) * quarter * block) for i in range(4)]
    ends = torch.arange(1, blocks + 1, dtype=torch.float64) * block  # prefix lengths at the blocks' ends
    prefix = ratio.cumsum(-1)
    centred = ends - ends.mean()
    slopes = 1000 * (prefix * centred).sum(-1) / (centred ** 2).sum()  # one least-squares slope per sequence
    drift, drift_se = _mean(slopes)
    spread = {}
    for n in SPREAD_AT:
        if n % block == 0 and n // block <= blocks:
            sd = float(prefix[:, n // block - 1].std())
            spread[n] = {"sd": sd, **dict(zip(("low", "high"), clusters.sd_interval(sd, sequences))),
                         "independent_tokens": math.sqrt(max(0.0, 2 * value * n))}
    return {"token_kl": value, "stderr": se, "low": low, "high": high, "sequences": sequences, "bands": bands,
            "drift_per_1k": drift, "drift_stderr": drift_se, "expected_drift": -1000 * value, "spread": spread}


def band_change(pair: dict, plan: dict) -> dict:
    """How much the token KL grows from the first quarter of the positions to the last: each sequence's
    last-quarter mean minus its first-quarter mean, averaged, with a t interval over the sequences."""
    kl = torch.tensor(pair["kl_blocks"], dtype=torch.float64)
    quarter = kl.shape[1] // 4
    first = kl[:, :quarter].sum(-1) / (quarter * plan["block"])
    last = kl[:, -quarter:].sum(-1) / (quarter * plan["block"])
    value, se = _mean(last - first)
    low, high = clusters.interval(value, se, kl.shape[0])
    return {"change": value, "stderr": se, "low": low, "high": high, "first": float(first.mean()),
            "last": float(last.mean())}


def ratio(run: dict, numerator: str, denominator: str) -> tuple[float, float, float]:
    """KL of one pair over another's on the same prompts: the geometric mean of the per-prompt ratios, with its
    95% interval (t over the prompts)."""
    plan = run["plan"]
    a, b = (per_sequence_kl(run["pairs"][name], plan)[:, None] for name in (numerator, denominator))
    ones = torch.ones_like(a)
    return mismatch.paired_ratio(a, ones, b, ones)


def matrix(run: dict) -> dict[str, dict[str, dict]]:
    """sampler → trainer → summary, for every pair the run measured."""
    out: dict[str, dict[str, dict]] = {}
    for name, pair in run["pairs"].items():
        sampler, trainer = name.split("|")
        out.setdefault(sampler, {})[trainer] = summary(pair, run["plan"])
    return out


def speeds(run: dict) -> dict[str, float]:
    """Each sampler's tokens per second at the run's batch, without keeping the vocabulary."""
    return {name: s["tokens_per_second"] for name, s in run["samplers"].items()}
