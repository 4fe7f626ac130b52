"""Optimizer updates that a parameter's dtype cannot represent, counted as they happen.

Adding an update u to a weight w stores round(w + u). When |u| is below half the spacing of
the dtype at w (half an ulp), the sum rounds back to w and the update is lost. bf16 spaces its
values 8× wider than fp16, so small learning rates lose far more updates in bf16.
"""
from __future__ import annotations

import math

import torch


def adam_direction(optimizer, param: torch.Tensor) -> torch.Tensor | None:
    """Adam's normalised step m̂ / (√v̂ + eps) for `param` (float64), read from its state; None without state.

    The update is the learning rate times this, so it shows what any learning rate would do.
    """
    inner = getattr(optimizer, "optimizer", optimizer)  # accelerate wraps the torch optimizer
    state = inner.state.get(param)
    if not state or "exp_avg" not in state:
        return None
    group = _group(inner, param)
    beta1, beta2 = group["betas"]
    step = float(state["step"])
    m_hat = state["exp_avg"].double() / (1 - beta1 ** step)
    v_hat = state["exp_avg_sq"].double() / (1 - beta2 ** step)
    return m_hat / (v_hat.sqrt() + group["eps"])


def adam_update(optimizer, param: torch.Tensor, before: torch.Tensor | None = None) -> torch.Tensor | None:
    """The step AdamW meant to take for `param` (float64): lr · m̂/(√v̂+eps) + lr · weight_decay · w.

    Read after the step; w is the weight before it (`before`), or the current weight if not given.
    """
    direction = adam_direction(optimizer, param)
    if direction is None:
        return None
    group = _group(getattr(optimizer, "optimizer", optimizer), param)
    weight = param if before is None else before
    return group["lr"] * direction + group["lr"] * group["weight_decay"] * weight.double()


def smallest_subnormal(dtype: torch.dtype) -> float:
    """The smallest positive number `dtype` stores: its smallest normal times its eps."""
    info = torch.finfo(dtype)
    return info.smallest_normal * info.eps


def v_flush_bound(beta2: float, dtype: torch.dtype = torch.float16) -> float:
    """Largest |gradient| whose Adam second-moment increment (1−β₂)·g² rounds to zero in `dtype`.

    A value at or below half the smallest subnormal rounds to zero (round to nearest, ties to even).
    """
    return math.sqrt(smallest_subnormal(dtype) / 2 / (1 - beta2))


def min_adam_eps(beta2: float, dtype: torch.dtype = torch.float16, max_step_over_lr: float = 1.0) -> float:
    """Smallest Adam eps that keeps a weight whose v flushed to zero from moving more than max_step_over_lr · lr.

    With v = 0 the step is lr·|m̂|/eps, and |m̂| is at most the flush bound (larger gradients do not flush).
    """
    return v_flush_bound(beta2, dtype) / max_step_over_lr


def _group(optimizer, param: torch.Tensor) -> dict:
    return next(g for g in optimizer.param_groups if any(p is param for p in g["params"]))


def half_ulp(values: torch.Tensor) -> torch.Tensor:
    """Half the spacing of `values`' dtype at each value (float64)."""
    up = torch.nextafter(values, torch.full_like(values, float("inf")))
    return (up.double() - values.double()).abs() / 2


def lost_update_counter():
    """A TrainerCallback counting, at every optimizer step, trainable entries whose nonzero update vanished.

    Beside the totals it counts, entry by entry, where the half-ulp rule and the measurement disagree:
    `lost_not_predicted` (unchanged although |update| was at least half an ulp) and `predicted_not_lost`
    (changed although |update| was below half an ulp).
    """
    from transformers import TrainerCallback

    class LostUpdates(TrainerCallback):
        def __init__(self):
            self.meant = self.lost = self.below_half_ulp = 0
            self.lost_not_predicted = self.predicted_not_lost = 0
            self.per_step: list[float] = []
            self._before: dict = {}

        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            self._before = {p: p.detach().clone() for p in model.parameters() if p.requires_grad}

        def on_optimizer_step(self, args, state, control, model=None, optimizer=None, **kwargs):
            meant = lost = small = lost_only = small_only = 0
            for param, before in self._before.items():
                update = adam_update(optimizer, param, before)
                if update is None:
                    continue
                moving = update != 0
                unchanged = moving & (param.detach() == before)
                below = moving & (update.abs() < half_ulp(before))
                meant += int(moving.sum())
                lost += int(unchanged.sum())
                small += int(below.sum())
                lost_only += int((unchanged & ~below).sum())
                small_only += int((below & ~unchanged).sum())
            self.meant, self.lost, self.below_half_ulp = self.meant + meant, self.lost + lost, self.below_half_ulp + small
            self.lost_not_predicted += lost_only
            self.predicted_not_lost += small_only
            self.per_step.append(lost / meant if meant else 0.0)
            self._before = {}

        @property
        def fraction(self) -> float:
            return self.lost / self.meant if self.meant else 0.0

    return LostUpdates()


def predicted_loss(weights: torch.Tensor, steps_per_lr: torch.Tensor, lrs: list[float], dtype: torch.dtype) -> list[float]:
    """Share of updates lr·s that would vanish on weights stored in `dtype`, for each learning rate.

    `steps_per_lr` is the optimizer's step divided by its learning rate (for Adam, m̂/(√v̂+eps)):
    the direction and size of an update, independent of the rate it is multiplied by.
    """
    stored = weights.to(dtype)
    limit = half_ulp(stored)
    moving = steps_per_lr != 0
    return [float(((lr * steps_per_lr.abs() < limit) & moving).sum() / moving.sum()) for lr in lrs]
