"""The sampler precision dial: the arithmetic an inference engine samples in, the trainer untouched.

Three kinds of setting, named by one string:

* `fp32`, `bf16`, `fp16`: real formats; the whole engine holds and computes in that dtype.
* `fp8`, `fp8_channel`: real FP8 rollouts, W8A8 as serving stacks run them. The weight and the
  input of every Linear layer inside the decoder blocks (attention q/k/v/o, MLP gate/up/down) are
  cast to `torch.float8_e4m3fn` through a scale: per tensor for both (`fp8`), or per output
  channel for weights and per token for activations (`fp8_channel`). Products accumulate in
  fp32. Embeddings, norms, attention scores and softmax, the residual stream and the LM head stay
  fp32. The FP8 values are dequantized before the matmul, which computes the same products as an
  FP8 GEMM with an fp32 accumulator, up to the order of the additions: the casts are real, the
  GEMM is simulated. A per-tensor activation scale spans the whole batch, prefill padding included.
* `m2` … `m10`: an **emulated** format with that many mantissa bits, round-to-nearest-even, and
  fp32's exponent. Every weight and the input of every Linear layer (LM head included) is
  rounded; accumulation is fp32. No hardware has these formats: they are a dial between FP8's 3
  mantissa bits, bf16's 7 and fp16's 10, labelled as emulation wherever they appear.

`fp32_head=True` keeps the LM head (its weight and input) in fp32, trl's fp32-LM-head idea
applied to the sampler.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from . import fp8, rollout

REAL = ("fp32", "bf16", "fp16")
FP8 = {"fp8": ("tensor", "tensor"), "fp8_channel": ("channel", "token")}  # (weight scale, activation scale)
EMULATED_BITS = range(2, 11)
DECODER_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def round_mantissa(x: torch.Tensor, bits: int) -> torch.Tensor:
    """`x` rounded to `bits` mantissa bits, to nearest even, with fp32's exponent (returned as fp32).

    The classic bit trick: add half an ulp of the kept bits, minus one, plus the kept lowest bit
    (which breaks ties to even), then clear the dropped bits. A carry into the exponent is the
    correct rounding up to the next binade, and from the largest binade up to inf, as a real cast
    overflows.
    """
    if not 1 <= bits <= 23:
        raise ValueError(f"bits={bits} must be between 1 and 23 (fp32 has 23 mantissa bits).")
    x = x.float().contiguous()
    drop = 23 - bits
    if drop == 0:
        return x.clone()
    raw = x.view(torch.int32)
    lowest_kept = (raw >> drop) & 1
    rounded = (raw + ((1 << (drop - 1)) - 1) + lowest_kept) & ~((1 << drop) - 1)
    return rounded.view(torch.float32)


def fp8_cast(x: torch.Tensor, granularity: str) -> torch.Tensor:
    """`x` through `float8_e4m3fn` and back with an amax scale per tensor, per output channel (rows
    of a weight) or per token (the last dimension of an activation)."""
    if granularity == "tensor":
        return fp8.round_trip(x, torch.float8_e4m3fn, "tensor")
    if granularity in ("channel", "token"):
        return fp8.round_trip(x, torch.float8_e4m3fn, "block", block=x.shape[-1])
    raise ValueError(f"granularity={granularity!r} is not an FP8 scaling; choose tensor, channel or token.")


@dataclass(frozen=True)
class Dial:
    """One setting of the dial (see the module's docstring); build it with `parse`."""

    name: str
    fp32_head: bool = False

    @property
    def kind(self) -> str:
        return "real" if self.name in REAL else "fp8" if self.name in FP8 else "emulated"

    @property
    def bits(self) -> int | None:
        """Mantissa bits of an emulated setting."""
        return int(self.name[1:]) if self.kind == "emulated" else None

    @property
    def engine_dtype(self) -> str:
        """The dtype the engine holds its weights in: the real format, else fp32."""
        return self.name if self.kind == "real" else "fp32"

    @property
    def label(self) -> str:
        """How the book names this setting: emulation is always said."""
        head = ", fp32 LM head" if self.fp32_head else ""
        if self.kind == "emulated":
            return f"{self.bits}-bit mantissa (emulated){head}"
        if self.kind == "fp8":
            w, a = FP8[self.name]
            return f"FP8 E4M3 casts (per-{w} weights, per-{a} activations), matmul in fp32{head}"
        return f"{self.name}{head}"

    def quantize_weights(self, model) -> None:
        """Round the engine's weights in place (after every load: the weight sync)."""
        if self.kind == "real":
            return
        with torch.no_grad():
            if self.kind == "emulated":
                for name, param in model.named_parameters():
                    if not (self.fp32_head and name.startswith("lm_head.")):
                        param.copy_(round_mantissa(param, self.bits))
            else:
                weight_scale = FP8[self.name][0]
                for _, module in _decoder_linears(model):
                    module.weight.copy_(fp8_cast(module.weight, weight_scale))

    def install(self, model) -> None:
        """Make `model` compute at this setting: quantize the weights, round every covered Linear's input."""
        if self.kind == "real":
            return
        if self.fp32_head and model.get_output_embeddings().weight is model.get_input_embeddings().weight:
            head = model.get_output_embeddings()  # untie: the head keeps its own fp32 copy
            head.weight = torch.nn.Parameter(head.weight.detach().clone(), requires_grad=False)
        if self.kind == "emulated":
            bits = self.bits
            covered = [m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)
                       and not (self.fp32_head and m is model.get_output_embeddings())]
            cast = lambda x: round_mantissa(x, bits)  # noqa: E731
        else:
            covered = [m for _, m in _decoder_linears(model)]
            activation_scale = FP8[self.name][1]
            cast = lambda x: fp8_cast(x, activation_scale)  # noqa: E731
        for module in covered:
            module.register_forward_pre_hook(lambda _m, args: (cast(args[0]), *args[1:]))
        self.quantize_weights(model)


def _decoder_linears(model):
    return [(n, m) for n, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) and n.rsplit(".", 1)[-1] in DECODER_LINEARS]


def parse(name: str, fp32_head: bool = False) -> Dial:
    """A Dial from its name: fp32, bf16, fp16, fp8, fp8_channel, or m2 … m10 (emulated)."""
    emulated = re.fullmatch(r"m(\d+)", name)
    if not (name in REAL or name in FP8 or (emulated and int(emulated[1]) in EMULATED_BITS)):
        raise ValueError(f"sampler precision {name!r} is not on the dial; choose one of "
                         f"{', '.join(REAL + tuple(FP8))} or m2 … m10 (emulated mantissa bits).")
    if fp32_head and name in REAL:
        raise ValueError(f"fp32_head applies to the fp8 and emulated settings; {name!r} is a whole-engine dtype.")
    return Dial(name, fp32_head)


def engine(model, name: str, device: str = "cpu", fp32_head: bool = False):
    """An InferenceEngine at dial setting `name`, with a private copy of `model`'s weights."""
    dial = parse(name, fp32_head)
    return rollout.InferenceEngine(model, rollout.engine_dtype(dial.engine_dtype, device), device, dial=dial)
