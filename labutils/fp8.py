"""Scaled FP8 casts: a tensor divided by a scale, rounded to E4M3 or E5M2, multiplied back.

FP8 has so little range that real tensors are cast through a scale chosen from their largest
magnitude (amax): one scale per tensor, or one per block of consecutive values. The round trip
here is what an FP8 matmul's inputs go through; the error it leaves is the quantization error.
"""
from __future__ import annotations

import torch

SCALINGS = ("none", "tensor", "block")


def round_trip(x: torch.Tensor, dtype: torch.dtype, scaling: str = "tensor", block: int = 128) -> torch.Tensor:
    """`x` cast to the fp8 `dtype` and back to float32, with no scale, one per tensor, or one per block."""
    if scaling not in SCALINGS:
        raise ValueError(f"scaling={scaling!r} is not a scaling; choose one of {', '.join(SCALINGS)}.")
    if block < 1:
        raise ValueError(f"block={block} must be a positive number of values.")
    x = x.float()
    top = torch.finfo(dtype).max
    if scaling == "none":
        return x.clamp(-top, top).to(dtype).float()  # explicit saturation: converters differ on overflow
    flat = x.flatten()
    if scaling == "tensor":
        groups = flat[None]
    else:
        pad = (-flat.numel()) % block
        groups = torch.nn.functional.pad(flat, (0, pad)).view(-1, block)
    amax = groups.abs().amax(-1, keepdim=True)
    scale = torch.where(amax > 0, amax / top, torch.ones_like(amax))
    restored = (groups / scale).to(dtype).float() * scale
    return restored.flatten()[:flat.numel()].view_as(x)


def relative_error(x: torch.Tensor, approx: torch.Tensor) -> float:
    """‖approx - x‖ / ‖x‖ over the whole tensor."""
    x = x.double()
    norm = x.norm()
    return float((approx.double() - x).norm() / norm) if norm > 0 else 0.0


def flushed(x: torch.Tensor, approx: torch.Tensor) -> float:
    """Share of nonzero entries that became zero."""
    nonzero = x != 0
    return float((nonzero & (approx == 0)).sum() / nonzero.sum()) if nonzero.any() else 0.0
