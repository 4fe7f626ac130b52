"""Gradient clipping under a loss scaler: the norm must be read from unscaled gradients.

With loss scale S the gradients after `backward` are S·g. `clip_grad_norm_` called on them reads the
norm S·|g| and, at max_norm c, rescales them to norm c; the scaler's step then divides by S, so the
optimizer receives a gradient of norm c/S instead of min(|g|, c). `scaler.unscale_(optimizer)` first
divides by S, and the clip then sees |g|.
"""
from __future__ import annotations

import torch


def scaled_clipped_step(params: list[torch.Tensor], optimizer, scaler, loss: torch.Tensor, max_norm: float,
                        unscale_first: bool) -> dict:
    """One scaler step with clipping, in the right order (`unscale_first`) or the wrong one.

    Returns the norm `clip_grad_norm_` read, the norm of the true (unscaled) gradient, the norm of
    the gradient the optimizer received, the norm of the parameter update, and the scale used.
    """
    scale = scaler.get_scale()
    scaler.scale(loss).backward()
    if unscale_first:
        scaler.unscale_(optimizer)
        true_norm = _norm(params)
    else:
        true_norm = _norm(params) / scale
    read = float(torch.nn.utils.clip_grad_norm_(params, max_norm))
    before = [p.detach().clone() for p in params]
    received = []  # the gradient norm as the optimizer sees it, after the scaler unscaled
    hook = optimizer.register_step_pre_hook(lambda opt, args, kwargs: received.append(_norm(params)))
    try:
        scaler.step(optimizer)  # skipped (no hook call) when a scaled gradient is inf or NaN
    finally:
        hook.remove()
    scaler.update()
    update = sum(float((p.detach() - b).double().square().sum()) for p, b in zip(params, before)) ** 0.5
    optimizer.zero_grad(set_to_none=True)
    return {"norm_read": read, "true_norm": true_norm, "received_norm": received[0] if received else 0.0,
            "update_norm": update, "scale": scale, "stepped": bool(received)}


def _norm(params: list[torch.Tensor]) -> float:
    grads = [p.grad.detach().double() for p in params if p.grad is not None]
    return float(sum(g.square().sum() for g in grads) ** 0.5) if grads else 0.0
