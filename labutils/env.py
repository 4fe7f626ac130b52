"""What this run executes on: library versions and the device."""
from __future__ import annotations

import platform
from importlib import metadata
from pathlib import Path

LIBRARIES = ("torch", "transformers", "trl", "peft", "bitsandbytes", "accelerate", "gguf")
KERNEL_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16")  # what oneDNN can pick among


def installed_version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "not installed"


def env_report() -> dict:
    """Python and library versions, plus the device (cuda or cpu), its name and CUDA version."""
    import torch

    report = {"python": platform.python_version(), **{lib: installed_version(lib) for lib in LIBRARIES}}
    if torch.cuda.is_available():
        report.update(device="cuda", device_name=torch.cuda.get_device_name(0), cuda=torch.version.cuda)
    else:
        report.update(device="cpu", device_name=platform.processor() or platform.machine(), cuda=None)
    report.update(cpu=cpu_model(), kernels=kernel_set())
    return report


def kernel_set() -> str:
    """The CPU kernels torch may use here: ATen's vector capability, oneDNN's cap where one is set, and the
    CPU's flags that change bf16 and fp16 arithmetic. The same seed draws other numbers under another set."""
    import os

    import torch

    flags = cpu_flags()
    parts = [f"aten {torch.backends.cpu.get_cpu_capability()}",
             f"onednn max {os.environ.get('ONEDNN_MAX_CPU_ISA', 'default')}",
             "cpu " + (",".join(f for f in KERNEL_FLAGS if f in flags) or "?")]
    return "; ".join(parts)


def env_table(report: dict | None = None):
    """`env_report()` (or `report`) as a two-column table, for a chapter's setup cell."""
    from .tables import show  # pandas only where a table is shown

    return show(report or env_report(), columns=["component", "this run"])


def cpu_model() -> str:
    """This machine's CPU model name (from /proc/cpuinfo where there is one)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def cpu_flags() -> set[str]:
    """The CPU's feature flags (from /proc/cpuinfo; empty where there is none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()
