"""Find precision configurations that will crash or silently misbehave, before any work is lost.

    findings = preflight.check(trainer.model, trainer.args)          # after building the trainer
    preflight.assert_ok(model, args, device="cuda", before_trainer=True)  # plan a CUDA run on a laptop
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .profiles import BF16_MIN_CAPABILITY
from .updates import min_adam_eps, v_flush_bound


@dataclass(frozen=True)
class Finding:
    """One problem: how bad, what it is, why it happens, what to do."""

    code: str
    severity: str  # "error": crashes; "warning": runs but not as asked
    what: str
    why: str
    fix: str

    def __str__(self) -> str:
        return f"[{self.severity}] {self.what} Why: {self.why} Fix: {self.fix}"


class PrecisionConfigError(ValueError):
    """A configuration `check` found errors in; `.findings` holds them."""

    def __init__(self, findings: list[Finding]):
        self.findings = findings
        super().__init__("precision preflight failed:\n" + "\n".join(f"  - {f}" for f in findings))


def _flag(args, name: str) -> bool:
    return bool(args.get(name) if isinstance(args, dict) else getattr(args, name, False))


def _value(args, name: str, default):
    value = args.get(name) if isinstance(args, dict) else getattr(args, name, None)
    return default if value is None else value


def _is_quantized(model) -> bool:
    return bool(getattr(model, "is_loaded_in_4bit", False) or getattr(model, "is_loaded_in_8bit", False))


def trainable_dtypes(model, before_trainer: bool = False) -> set[torch.dtype]:
    """Dtypes of the parameters that will be trained.

    With `before_trainer`, a quantized model's trainables are reported as trl's trainers will
    leave them: cast to bf16 in their `__init__` (trl >= 0.26).
    """
    dtypes = {p.dtype for p in model.parameters() if p.requires_grad}
    if before_trainer and _is_quantized(model) and dtypes:
        return {torch.bfloat16}
    return dtypes


def _device(args, device: str | None) -> str:
    if device is not None:
        if not device.startswith(("cpu", "cuda")):
            raise ValueError(f"device={device!r} is not checked; pass 'cpu' or 'cuda'.")
        return "cuda" if device.startswith("cuda") else "cpu"
    return "cuda" if torch.cuda.is_available() and not _flag(args, "use_cpu") else "cpu"


def check(model, args, device: str | None = None, capability: tuple[int, int] | None = None,
          before_trainer: bool = False) -> list[Finding]:
    """Findings for training `model` with trainer arguments `args` (a TrainingArguments-like object or dict).

    `device` ('cpu' or 'cuda') defaults to where the run would go; `capability` is the CUDA compute
    capability to assume when checking a CUDA plan on a machine without that GPU.
    """
    device = _device(args, device)
    fp16, bf16 = _flag(args, "fp16"), _flag(args, "bf16")
    dtypes = trainable_dtypes(model, before_trainer)
    names = ", ".join(sorted(str(d).removeprefix("torch.") for d in dtypes)) or "none"
    findings = []
    if fp16 and bf16:
        findings.append(Finding(
            "both_flags", "error", "fp16=True and bf16=True are both set.",
            "mixed precision is one dtype; transformers refuses the pair and accelerate can honour only one.",
            "keep the one your GPU supports: bf16 on Ampere or newer, fp16 with fp32 trainables on older GPUs."))
    scaler = fp16 and device == "cuda"  # accelerate builds a GradScaler only for fp16 off the CPU
    if scaler and torch.bfloat16 in dtypes:
        findings.append(Finding(
            "fp16_scaler_bf16_trainables", "error",
            f"fp16 mixed precision on CUDA with bf16 trainable parameters ({names}).",
            "fp16 makes accelerate build a GradScaler; its unscale step calls "
            "_amp_foreach_non_finite_check_and_unscale_cuda, which has no BFloat16 kernel, so "
            "training stops with 'not implemented for BFloat16' at the first optimizer step. "
            "trl casts QLoRA trainables to bf16 whatever fp16/bf16 say.",
            "use bf16=True (no scaler) on a bf16-capable GPU, or cast the trainables to float32 after "
            "building the trainer and keep fp16=True, or train in fp32."))
    if scaler and torch.float16 in dtypes:
        findings.append(Finding(
            "fp16_scaler_fp16_trainables", "error",
            "fp16 mixed precision on CUDA with fp16 trainable parameters.",
            "GradScaler.unscale_ refuses fp16 gradients ('ValueError: Attempting to unscale FP16 "
            "gradients'): mixed precision keeps master weights in fp32 and only computes in fp16.",
            "load the model in float32 (or cast the trainable parameters to float32) and let "
            "autocast do the fp16 compute."))
    if bf16 and device == "cuda":
        cap = capability or (torch.cuda.get_device_capability() if torch.cuda.is_available() else None)
        if cap is not None and tuple(cap) < BF16_MIN_CAPABILITY:
            findings.append(Finding(
                "bf16_unsupported_gpu", "warning",
                f"bf16=True on a GPU of compute capability {cap[0]}.{cap[1]} (bf16 arithmetic needs 8.0, Ampere).",
                "T4, V100 and older GPUs have no bf16 tensor cores: PyTorch runs bf16 there without them (values "
                "stored and rounded in bf16, slowly), and attention with a mask falls back to its math kernel.",
                "for speed, use fp16=True with fp32 trainable parameters (a GradScaler handles the range), or fp32."))
    if fp16 and device == "cpu":
        findings.append(Finding(
            "fp16_on_cpu", "warning", "fp16=True on the CPU is silently ignored.",
            "accelerate enables neither fp16 autocast nor a GradScaler on the CPU, so the run is plain "
            "fp32 (or whatever dtype the weights have), not fp16 mixed precision.",
            "drop fp16 on the CPU, use bf16=True for CPU autocast, or make the fp16 compute explicit "
            "(weights loaded in float16, or autocast in a trainer subclass)."))
    eps = float(_value(args, "adam_epsilon", 1e-8))
    beta2 = float(_value(args, "adam_beta2", 0.999))
    floor = min_adam_eps(beta2)
    if torch.float16 in dtypes and eps < floor:
        eps_fp16 = torch.tensor(eps, dtype=torch.float16).item()
        findings.append(Finding(
            "adam_eps_underflow", "warning",
            f"fp16 trainable parameters with Adam eps={eps:g} ({eps_fp16:g} in fp16), below {floor:.2g}.",
            "torch's Adam keeps its state in the parameter's dtype. Its second moment v gains (1-beta2)*g^2 "
            f"per step, which is 0 in fp16 for |g| <= {v_flush_bound(beta2):.2g} (beta2={beta2:g}); the step "
            "is then lr*|m_hat|/eps, infinite when eps is 0 in fp16 and larger than lr whenever eps is below "
            "that gradient bound.",
            "keep trainable parameters (and so optimizer state) in float32; if the state must be fp16, "
            f"use eps >= {floor:.2g}, which keeps such steps at or below lr."))
    return findings


def assert_ok(model, args, **kwargs) -> None:
    """Raise `PrecisionConfigError` if `check` finds any error (warnings are printed)."""
    findings = check(model, args, **kwargs)
    for finding in findings:
        if finding.severity == "warning":
            print(f"preflight: {finding}")
    errors = [f for f in findings if f.severity == "error"]
    if errors:
        raise PrecisionConfigError(errors)
