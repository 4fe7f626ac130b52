"""The sampler precision dial: the arithmetic an inference engine samples in, the trainer untouched.

Three kinds of setting, named by one string:

* `fp32`, `bf16`, `fp16`: real formats; the whole engine holds and computes in that dtype.
* `fp8`, `fp8_channel`: real FP8 rollouts, run the way an FP8 serving stack runs them (vLLM's
  `quantization="fp8"`): the Linear layers inside the decoder blocks (attention q/k/v/o, MLP
  gate/up/down) are W8A8, and everything else is bf16. Their weight and input are cast to
  `torch.float8_e4m3fn` through a scale, per tensor for both (`fp8`) or per output channel for
  weights and per token for activations (`fp8_channel`); the products accumulate in fp32 and the
  output returns to bf16. The FP8 values are dequantized before the matmul, which computes the same
  products as an FP8 GEMM with an fp32 accumulator, up to the order of the additions: the casts are
  real, the GEMM is simulated. Embeddings, norms, attention (scores, softmax, the KV cache), the
  residual stream and the LM head are bf16. A per-tensor activation scale spans the whole batch,
  prefill padding included.
* `m2` … `m10`: an **emulated** format with that many mantissa bits, round-to-nearest-even, and
  fp32's exponent, applied to one mechanism only: the weight and the input of every Linear layer
  (the LM head included; a tied embedding keeps its own fp32 copy). Everything else (embeddings,
  norms, attention, the residual stream) and all accumulation stays fp32. No hardware has these
  formats: they are a dial between FP8's 3 mantissa bits, bf16's 7 and fp16's 10, labelled as
  emulation wherever they appear.
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

    @property
    def kind(self) -> str:
        return "real" if self.name in REAL else "fp8" if self.name in FP8 else "emulated"

    @property
    def bits(self) -> int | None:
        """Mantissa bits of an emulated setting."""
        return int(self.name[1:]) if self.kind == "emulated" else None

    @property
    def engine_dtype(self) -> str:
        """The dtype of the engine around its quantized layers: the real format, bf16 around FP8, else fp32."""
        return self.name if self.kind == "real" else "bf16" if self.kind == "fp8" else "fp32"

    @property
    def label(self) -> str:
        """How the book names this setting: emulation is always said."""
        if self.kind == "emulated":
            return f"{self.bits}-bit mantissa (emulated) in every Linear layer, the rest fp32"
        if self.kind == "fp8":
            w, a = FP8[self.name]
            return f"FP8 E4M3 decoder Linear layers (per-{w} weights, per-{a} activations), the rest bf16"
        return self.name

    def covered(self, model) -> list[torch.nn.Linear]:
        """The Linear layers this setting quantizes."""
        if self.kind == "emulated":
            return [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
        return [m for _, m in _decoder_linears(model)] if self.kind == "fp8" else []

    def quantize_weights(self, model) -> None:
        """Round the covered layers' weights in place (after every load: the weight sync)."""
        with torch.no_grad():
            for module in self.covered(model):
                if self.kind == "emulated":
                    module.weight.copy_(round_mantissa(module.weight, self.bits))
                else:
                    module.weight.copy_(fp8_cast(module.weight, FP8[self.name][0]))

    def install(self, model) -> None:
        """Make `model` compute at this setting: quantize the covered weights, cast every covered input."""
        if self.kind == "real":
            return
        head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
        if self.kind == "emulated" and head.weight is embedding.weight:
            # untie: the LM head is a Linear layer and is rounded, the embedding lookup stays fp32
            head.weight = torch.nn.Parameter(head.weight.detach().clone(), requires_grad=False)
        stream = embedding.weight.dtype
        for module in self.covered(model):
            if self.kind == "emulated":
                module.register_forward_pre_hook(lambda _m, args, b=self.bits: (round_mantissa(args[0], b), *args[1:]))
                continue
            # an FP8 GEMM: FP8 operands, products accumulated and scaled in fp32, the output back in bf16
            module.float()
            scale = FP8[self.name][1]
            module.register_forward_pre_hook(lambda _m, args, s=scale: (fp8_cast(args[0].float(), s), *args[1:]))
            module.register_forward_hook(lambda _m, _args, out: out.to(stream))
        self.quantize_weights(model)


def _decoder_linears(model):
    return [(n, m) for n, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) and n.rsplit(".", 1)[-1] in DECODER_LINEARS]


def parse(name: str) -> Dial:
    """A Dial from its name: fp32, bf16, fp16, fp8, fp8_channel, or m2 … m10 (emulated)."""
    emulated = re.fullmatch(r"m(\d+)", name)
    if not (name in REAL or name in FP8 or (emulated and int(emulated[1]) in EMULATED_BITS)):
        raise ValueError(f"sampler precision {name!r} is not on the dial; choose one of "
                         f"{', '.join(REAL + tuple(FP8))} or m2 … m10 (emulated mantissa bits).")
    return Dial(name)


def engine(model, name: str, device: str = "cpu"):
    """An InferenceEngine at dial setting `name`, with a private copy of `model`'s weights."""
    dial = parse(name)
    return rollout.InferenceEngine(model, rollout.engine_dtype(dial.engine_dtype, device), device, dial=dial)
