"""trl's importance-sampling correction of a separate sampler's completions, as trl computes it.

With `use_vllm=True`, trl's GRPOTrainer rescores each completion with the trainer and weighs the loss by
the ratio π/μ of the trainer's and the sampler's probabilities (`vllm_importance_sampling_correction`,
on by default). Its `vllm_importance_sampling_mode` takes the ratio per token or per sequence (the product
over the completion), and either clips it (`*_truncate`) or sets it to 0 outside [clip_min, clip_max]
(`*_mask`). trl computes it inline in `_generate_and_score_completions`; `weights` repeats those lines, and
a test runs trl's own lines on the same inputs.
"""
from __future__ import annotations

import dataclasses
import math

import torch

MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


def defaults() -> dict:
    """The installed trl's defaults: whether the correction is on, its mode and its bounds."""
    from trl import GRPOConfig

    fields = {f.name: f.default for f in dataclasses.fields(GRPOConfig)}
    return {"on": fields["vllm_importance_sampling_correction"], "mode": fields["vllm_importance_sampling_mode"],
            "clip_min": fields["vllm_importance_sampling_clip_min"],
            "clip_max": fields["vllm_importance_sampling_clip_max"]}


def weights(log_ratio: torch.Tensor, mask: torch.Tensor, mode: str, clip_min: float | None = None,
            clip_max: float | None = 3.0) -> torch.Tensor:
    """trl's weight for each token ([B, T]; token modes) or each completion ([B, 1]; sequence modes), from the
    per-token log π − log μ (`log_ratio`) of the completions' real tokens (`mask`)."""
    if mode not in MODES:
        raise ValueError(f"mode {mode!r} is not one of trl's importance-sampling modes: {', '.join(MODES)}.")
    diff = torch.nan_to_num(log_ratio * mask, nan=0.0)
    if mode.startswith("sequence"):
        diff = diff.sum(dim=-1, keepdim=True)
    ratio = torch.exp(diff)
    if mode.endswith("truncate"):
        return torch.clamp(ratio, min=clip_min, max=clip_max)
    low = clip_min if clip_min is not None else -math.inf
    high = clip_max if clip_max is not None else math.inf
    return ratio.masked_fill((ratio < low) | (ratio > high), 0.0)


def by_length(log_ratio: torch.Tensor, lengths: tuple[int, ...], mode: str, clip_min: float | None = None,
              clip_max: float | None = 3.0) -> dict[int, dict]:
    """For completions cut to each length n (the first n tokens of every row): the mean weight of a completion
    (a token mode's mean over its tokens), its standard error over the rows, and the share of completions (sequence
    modes) or tokens (token modes) masked to 0 or clipped at a bound."""
    found = {}
    for n in lengths:
        if n > log_ratio.shape[1]:
            raise ValueError(f"length {n} is past the {log_ratio.shape[1]} tokens each row has.")
        part = log_ratio[:, :n].double()
        w = weights(part, torch.ones_like(part), mode, clip_min, clip_max)
        # the ratio before the cut, per completion or per token as the mode takes it
        raw = torch.exp(part.sum(-1, keepdim=True) if mode.startswith("sequence") else part)
        at_bound = (w == 0) & (raw > 0) if mode.endswith("mask") else (w != raw)
        per_row = w.mean(-1)
        found[n] = {"mean": float(per_row.mean()),
                    "se": float(per_row.std(unbiased=True) / math.sqrt(len(per_row))) if len(per_row) > 1
                    else float("nan"), "cut_share": float(at_bound.double().mean()),
                    "mean_log_ratio": float(part.sum(-1).mean())}
    return found
