"""How close a model's activations come to fp16's largest finite value, 65504, and at what scale they pass it.

Three places per decoder layer are watched: the residual stream (each layer's output), the attention
scores q·k as the eager kernel computes them (before the 1/√d scaling, which it applies afterwards),
and the MLP's hidden activation (the input of down_proj). Attention scores are read through a
registered attention function that records them and then runs transformers' own eager attention.
"""
from __future__ import annotations

import contextlib

import torch

FP16_MAX = torch.finfo(torch.float16).max
PROBE = "lab_score_probe"  # the attention implementation name models are loaded or switched to
PLACES = ("residual", "attention_scores", "mlp_hidden")
_recorders: list["Maxima"] = []


def _probe_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    from transformers.models.qwen2.modeling_qwen2 import eager_attention_forward, repeat_kv

    if not _recorders:
        return eager_attention_forward(module, query, key, value, attention_mask, scaling, dropout, **kwargs)
    # eager_attention_forward's maths, step for step (tests hold the two equal), with q·k recorded on the way
    key_states = repeat_kv(key, module.num_key_value_groups)
    value_states = repeat_kv(value, module.num_key_value_groups)
    scores = torch.matmul(query, key_states.transpose(2, 3))
    for recorder in _recorders:
        recorder.note(module.layer_idx, "attention_scores", scores)
    weights = scores * scaling
    if attention_mask is not None:
        weights = weights + attention_mask
    weights = torch.nn.functional.softmax(weights, dim=-1, dtype=torch.float32).to(query.dtype)
    weights = torch.nn.functional.dropout(weights, p=dropout, training=module.training)
    return torch.matmul(weights, value_states).transpose(1, 2).contiguous(), weights


def register_probe() -> str:
    """Register the score-recording attention (eager maths, eager masks) with transformers; returns its name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    AttentionInterface.register(PROBE, _probe_attention)
    AttentionMaskInterface.register(PROBE, eager_mask)  # without a mask function transformers builds no mask at all
    return PROBE


class Maxima(contextlib.AbstractContextManager):
    """Inside `with Maxima(model) as m:`, every forward records per layer the largest |value| at each place,
    and whether any value there was inf or NaN. The model must run the probe attention (`register_probe`)."""

    def __init__(self, model):
        if getattr(model.config, "_attn_implementation", None) != PROBE:
            raise ValueError(f"the model must run attn_implementation={PROBE!r}; call "
                             "labutils.overflow.register_probe() and model.set_attn_implementation(...) first.")
        self.layers = list(model.model.layers)
        self.max = {place: [0.0] * len(self.layers) for place in PLACES}
        self.nonfinite = {place: [False] * len(self.layers) for place in PLACES}
        self._hooks = []

    def note(self, layer: int, place: str, values: torch.Tensor) -> None:
        largest = values.abs().amax()  # inf or NaN (amax propagates NaN) exactly when some value is not finite
        if not bool(torch.isfinite(largest)):
            finite = torch.isfinite(values)
            self.nonfinite[place][layer] = True
            if not finite.any():
                return
            largest = values[finite].abs().max()
        self.max[place][layer] = max(self.max[place][layer], float(largest))

    def __enter__(self):
        for i, layer in enumerate(self.layers):
            self._hooks.append(layer.register_forward_hook(
                lambda m, args, out, i=i: self.note(i, "residual", out[0] if isinstance(out, tuple) else out)))
            self._hooks.append(layer.mlp.down_proj.register_forward_pre_hook(
                lambda m, args, i=i: self.note(i, "mlp_hidden", args[0])))
        _recorders.append(self)
        return self

    def __exit__(self, *exc):
        for hook in self._hooks:
            hook.remove()
        _recorders.remove(self)
        return False

    def first_nonfinite(self) -> str | None:
        """'place, layer i' of the first inf/NaN in forward order (scores, MLP, residual per layer), else None."""
        for i in range(len(self.layers)):
            for place in ("attention_scores", "mlp_hidden", "residual"):
                if self.nonfinite[place][i]:
                    return f"{place}, layer {i}"
        return None


@contextlib.contextmanager
def scaled(module: torch.nn.Module, factor: float, side: str = "output"):
    """Multiply `module`'s tensor output (side="output") or first input ("input") by `factor` while inside.

    A forward hook, registered before any hook added inside the block, so those see the scaled tensor.
    """
    if side == "output":
        hook = module.register_forward_hook(lambda m, args, out: out * factor)
    elif side == "input":
        hook = module.register_forward_pre_hook(lambda m, args: (args[0] * factor, *args[1:]))
    else:
        raise ValueError(f"side={side!r}; choose 'output' or 'input'.")
    try:
        yield
    finally:
        hook.remove()


@torch.no_grad()
def overflow_scan(model, inputs: dict, module: torch.nn.Module, side: str = "output", max_log2: int = 24) -> dict:
    """Scale `module`'s output (or input) by 2^0, 2^1, … and run `model` until the forward holds inf or NaN.

    Returns the first such factor and its log2, where the first inf/NaN appeared (a watched place
    in forward order, else "scaled tensor", else "logits"), and whether the scaled tensor itself overflowed.
    """
    for k in range(max_log2 + 1):
        scaled_finite = []

        def check(*hook_args):
            tensor = hook_args[-1] if side == "output" else hook_args[1][0]
            scaled_finite.append(bool(torch.isfinite(tensor).all()))

        with scaled(module, 2.0 ** k, side), Maxima(model) as seen:
            register = module.register_forward_hook if side == "output" else module.register_forward_pre_hook
            watcher = register(check)
            try:
                logits = model(**inputs).logits
            finally:
                watcher.remove()
        tensor_overflowed = not all(scaled_finite)
        where = (seen.first_nonfinite() or ("scaled tensor" if tensor_overflowed else None)
                 or (None if bool(torch.isfinite(logits).all()) else "logits"))
        if where is not None:
            return {"first_factor": 2.0 ** k, "first_log2": k, "where": where,
                    "scaled_tensor_overflowed": tensor_overflowed}
    return {"first_factor": None, "first_log2": None, "where": None, "scaled_tensor_overflowed": False}


def headroom(maximum: float, limit: float = FP16_MAX) -> float:
    """How many times larger a value of size `maximum` can grow before it passes `limit`."""
    return limit / maximum if maximum > 0 else float("inf")


def predicted_first_log2(maximum: float, limit: float = FP16_MAX) -> int:
    """Smallest k with 2^k · maximum > limit: the first power-of-two factor that overflows a value this large."""
    k = 0
    while 2.0 ** k * maximum <= limit:
        k += 1
    return k
