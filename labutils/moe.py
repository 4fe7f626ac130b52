"""Mixture-of-experts routing: record which experts each token chose, compare engines, route in fp32.

A top-k router scores every expert with one small matmul and keeps the k best. When two
experts score almost the same, a rounding error can swap which one is kept: a discrete
change of the computation, not a small perturbation of it.
"""
from __future__ import annotations

import torch


def routers(model) -> list:
    """The model's top-k router modules, in layer order (transformers' `*TopKRouter`)."""
    found = [m for _, m in model.named_modules()
             if hasattr(m, "top_k") and hasattr(m, "num_experts") and isinstance(getattr(m, "weight", None), torch.Tensor)]
    if not found:
        raise ValueError(f"{type(model).__name__} has no top-k router; load a mixture-of-experts model "
                         "(the lab's kind='moe').")
    return found


class RouterRecorder:
    """While active, keeps the expert indices each router chose in the latest forward ([tokens, k] per layer)."""

    def __init__(self, model):
        self.modules = routers(model)
        self.latest: list[torch.Tensor | None] = [None] * len(self.modules)
        self._handles = []

    def __enter__(self):
        for layer, module in enumerate(self.modules):
            self._handles.append(module.register_forward_hook(self._keep(layer)))
        return self

    def _keep(self, layer):
        def hook(module, inputs, output):
            self.latest[layer] = output[2].detach()  # (router_logits, scores, indices)
        return hook

    def __exit__(self, *exc):
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


def router_in_fp32(model) -> int:
    """Route in fp32 whatever the model's dtype: router weights and inputs in fp32, scores back in the model's.

    The experts still run in the model's dtype; only the k-of-n decision is made in fp32.
    Returns how many routers were changed.
    """
    found = routers(model)
    for module in found:
        module.float()
        module.register_forward_pre_hook(_inputs_to_fp32)
        module.register_forward_hook(_scores_to_input_dtype)
    return len(found)


def _inputs_to_fp32(module, args):
    module.input_dtype = args[0].dtype
    return (args[0].float(), *args[1:])


def _scores_to_input_dtype(module, args, output):
    logits, scores, indices = output
    return logits, scores.to(module.input_dtype), indices


def flipped(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """True where two expert choices [..., k] differ as sets (order inside the top-k ignored)."""
    return (a.sort(-1).values != b.sort(-1).values).any(-1)


def flip_rate(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    """Share of routing decisions (token × layer) whose expert set differs between two engines.

    `a`, `b`: [batch, steps, layers, k] expert indices; `mask`: [batch, steps] real tokens.
    """
    flips, total = flip_count(a, b, mask)
    if total == 0:
        raise ValueError("the mask selects no tokens; there are no routing decisions to compare.")
    return flips / total


class RoutingReplay:
    """While active, each router keeps the experts another engine chose (rollout routing replay).

    `plan(indices)` sets, per layer, the experts to use for every token of the next forward
    ([tokens, k], -1 where the router should choose itself). The router still scores every expert;
    the replayed experts' weights are its own probabilities for them, renormalised, so gradients
    flow through the router as usual and only the discrete choice is taken from the sampler.
    """

    def __init__(self, model):
        self.modules = routers(model)
        self.indices: list[torch.Tensor | None] = [None] * len(self.modules)
        self._handles = []

    def plan(self, indices: list[torch.Tensor]) -> None:
        self.indices = list(indices)

    def __enter__(self):
        for layer, module in enumerate(self.modules):
            self._handles.append(module.register_forward_hook(self._replay(layer)))
        return self

    def _replay(self, layer):
        def hook(module, inputs, output):
            chosen = self.indices[layer]
            if chosen is None:
                return output
            logits, scores, indices = output
            chosen = chosen.to(indices.device)
            keep = (chosen >= 0).all(-1, keepdim=True)
            indices = torch.where(keep, chosen.clamp(min=0), indices)
            probs = torch.softmax(logits.float(), dim=-1).gather(-1, indices)
            return logits, (probs / probs.sum(-1, keepdim=True)).to(scores.dtype), indices
        return hook

    def __exit__(self, *exc):
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


def counts_differ(n1: int, d1: int, n2: int, d2: int) -> int:
    """+1 if n1 flips in d1 decisions is a higher rate than n2 in d2 beyond counting noise, -1 if lower, 0 if not.

    Rare events counted in many decisions vary by about the square root of their count (Poisson), so two
    rates differ beyond noise when their gap exceeds twice its standard error, sqrt(n1/d1² + n2/d2²);
    with d1 == d2 this is |n1 − n2| > 2·sqrt(n1 + n2).
    """
    if d1 <= 0 or d2 <= 0:
        raise ValueError("each count needs a positive number of decisions.")
    gap = n1 / d1 - n2 / d2
    noise = 2 * (n1 / d1**2 + n2 / d2**2) ** 0.5
    return 0 if abs(gap) <= noise else (1 if gap > 0 else -1)


def flip_count(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> tuple[int, int]:
    """(flipped routing decisions, all routing decisions) between two engines; see `flip_rate`."""
    return int((flipped(a, b) & mask[..., None].bool()).sum()), int(mask.sum()) * a.shape[2]
