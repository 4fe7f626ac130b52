"""The gradients of one backward pass, and which of them a 16-bit format would flush to zero."""
from __future__ import annotations

import torch


def one_backward(model, inputs: dict, labels: torch.Tensor) -> dict[str, torch.Tensor]:
    """Flat gradients of one language-model loss: every weight matrix's ("weights") and every linear
    layer's output ("activations", the gradients flowing backwards through the network). Leaves no .grad behind."""
    activation_grads = []
    hooks = [m.register_full_backward_hook(lambda m, gin, gout: activation_grads.append(gout[0].detach().flatten()))
             for m in model.modules() if isinstance(m, torch.nn.Linear)]
    was_training = model.training
    model.train()
    try:
        model(**inputs, labels=labels).loss.backward()
    finally:
        for hook in hooks:
            hook.remove()
        model.train(was_training)
    grads = {"weights": torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None and p.ndim == 2]),
             "activations": torch.cat(activation_grads)}
    model.zero_grad(set_to_none=True)
    return grads


def flushed_share(values: torch.Tensor, dtype: torch.dtype = torch.float16) -> float:
    """Share of the nonzero `values` that become exactly zero when cast to `dtype`."""
    nonzero = values[values != 0]
    if nonzero.numel() == 0:
        raise ValueError("no nonzero values: nothing can be flushed.")
    return float((nonzero.to(dtype) == 0).double().mean())
