"""A LoRA policy as its sampler sees it (adapters merged into the weights, cast) and as its trainer sees it.

A trainer keeps the adapters apart and computes W·x + s·B(A·x) on the fly, with s = alpha/r. A sampler
that receives merged weights computes (W + s·B·A)·x, rounded to its own dtype. In exact arithmetic
the two are the same policy; in bf16 the merged weights round differently from the base weights,
so merging alone makes the two engines disagree.
"""
from __future__ import annotations

import copy

import torch

from . import rollout


def _adapter_parameters(peft_model):
    return [p for name, p in peft_model.named_parameters() if "lora_" in name]


def merged_copy(peft_model, dtype: torch.dtype, device: str = "cpu"):
    """A plain transformers model: the adapters merged in fp32, then cast to `dtype`; the peft model is untouched."""
    clone = copy.deepcopy(peft_model).to(dtype=torch.float32)
    return clone.merge_and_unload().to(device=device, dtype=dtype).eval()


def merge_moves(peft_model, dtype: torch.dtype) -> dict:
    """How much merging changes the weights the adapters wrap: relative size of s·B·A, and the share of
    entries whose `dtype` value differs from the base weight's `dtype` value once merged."""
    merged = dict(merged_copy(peft_model, torch.float32).named_parameters())
    delta_sq = weight_sq = moved = total = 0.0
    for name, p in peft_model.named_parameters():
        if not name.endswith(".base_layer.weight"):
            continue
        w = p.detach().float()
        plain_name = name.removeprefix("base_model.model.").replace(".base_layer.weight", ".weight")
        m = merged[plain_name].detach().float().to(w.device)
        delta_sq += float((m - w).double().square().sum())
        weight_sq += float(w.double().square().sum())
        moved += float((m.to(dtype) != w.to(dtype)).sum())
        total += w.numel()
    return {"relative_delta": (delta_sq / weight_sq) ** 0.5, "moved_share": moved / total, "entries": int(total)}


class UnmergedTrainingEngine(rollout.TrainingEngine):
    """The training engine over a peft model: base weights in `dtype`, adapters in `adapter_dtype`, applied unmerged."""

    def __init__(self, peft_model, dtype: torch.dtype, adapter_dtype: torch.dtype | None = None,
                 device: str = "cpu", micro_batch: int = 16):
        if micro_batch < 1:
            raise ValueError(f"micro_batch={micro_batch} must be a positive number of sequences.")
        self.model = copy.deepcopy(peft_model).to(device=device, dtype=dtype).eval()
        for p in _adapter_parameters(self.model):
            p.data = p.data.to(adapter_dtype or dtype)
        self.dtype, self.adapter_dtype = dtype, adapter_dtype or dtype
        self.device, self.micro_batch = device, micro_batch
        self.pad_id, self.eos_id = rollout.special_ids(self.model.config)


@torch.no_grad()
def size_adapters(peft_model, relative_delta: float, seed: int = 0) -> None:
    """Give a fresh LoRA model's adapters (B is zero at initialisation) a product s·B·A whose Frobenius norm is
    `relative_delta` times each wrapped weight's, in random directions: a trained adapter's size, untrained."""
    generator = torch.Generator().manual_seed(seed)
    for module in peft_model.modules():
        if not hasattr(module, "lora_B") or "default" not in module.lora_B:
            continue
        a, b = module.lora_A["default"].weight, module.lora_B["default"].weight
        b.copy_(torch.randn(b.shape, generator=generator, dtype=torch.float32))
        delta = module.scaling["default"] * (b.float() @ a.float())
        b.mul_(relative_delta * module.base_layer.weight.float().norm() / delta.norm())
