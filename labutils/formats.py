"""Floating-point formats: bit layouts, spacing, neighbours and rounding, read off real casts."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Format:
    """One binary floating-point format."""

    name: str
    dtype: torch.dtype
    exponent_bits: int
    mantissa_bits: int

    @property
    def bits(self) -> int:
        return 1 + self.exponent_bits + self.mantissa_bits

    @property
    def bias(self) -> int:
        return 2 ** (self.exponent_bits - 1) - 1

    @property
    def eps(self) -> float:
        """Gap between 1 and the next representable number."""
        return 2.0 ** -self.mantissa_bits

    @property
    def max(self) -> float:
        return float(torch.finfo(self.dtype).max)

    @property
    def tiny(self) -> float:
        """Smallest positive normal number."""
        return float(torch.finfo(self.dtype).tiny)

    @property
    def smallest_subnormal(self) -> float:
        return 2.0 ** (1 - self.bias - self.mantissa_bits)


FORMATS = {
    f.name: f
    for f in (
        Format("float32", torch.float32, 8, 23),
        Format("bfloat16", torch.bfloat16, 8, 7),
        Format("float16", torch.float16, 5, 10),
        Format("float8_e4m3fn", torch.float8_e4m3fn, 4, 3),
        Format("float8_e5m2", torch.float8_e5m2, 5, 2),
    )
}
_INT_VIEW = {32: torch.int32, 16: torch.int16, 8: torch.uint8}


def get(fmt: str | Format) -> Format:
    """A Format by name ('float32', 'bfloat16', 'float16', 'float8_e4m3fn', 'float8_e5m2')."""
    if isinstance(fmt, Format):
        return fmt
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; choose one of {', '.join(FORMATS)}.")
    return FORMATS[fmt]


def round_to(x: float, fmt: str | Format) -> float:
    """The value `x` becomes when stored in `fmt` (round to nearest even, as torch casts)."""
    return float(torch.tensor(x, dtype=torch.float64).to(get(fmt).dtype).to(torch.float64))


def _pattern(x: float, f: Format) -> int:
    stored = torch.tensor([x], dtype=torch.float64).to(f.dtype)
    return int(stored.view(_INT_VIEW[f.bits]).item()) & ((1 << f.bits) - 1)


def _from_pattern(bits: int, f: Format) -> float:
    if f.bits != 8 and bits >= 1 << (f.bits - 1):
        bits -= 1 << f.bits  # signed views for 16 and 32 bits
    raw = torch.tensor([bits], dtype=_INT_VIEW[f.bits])
    return float(raw.view(f.dtype).to(torch.float64).item())


@dataclass(frozen=True)
class Bits:
    """A value's stored bit pattern, split into fields."""

    value: float  # what is actually stored
    sign: str
    exponent: str
    mantissa: str

    def __str__(self) -> str:
        return f"{self.sign} {self.exponent} {self.mantissa}"


def decompose(x: float, fmt: str | Format) -> Bits:
    """The sign, exponent and mantissa bits of `x` stored in `fmt`."""
    f = get(fmt)
    text = format(_pattern(x, f), f"0{f.bits}b")
    return Bits(round_to(x, f), text[0], text[1:1 + f.exponent_bits], text[1 + f.exponent_bits:])


def ulp(x: float, fmt: str | Format) -> float:
    """Spacing of `fmt` at magnitude |x|: the gap from |x|'s binade to the next number up."""
    f = get(fmt)
    magnitude = abs(x)
    if magnitude < f.tiny:
        return f.smallest_subnormal
    return 2.0 ** (math.floor(math.log2(magnitude)) - f.mantissa_bits)


def neighbours(x: float, fmt: str | Format) -> tuple[float, float]:
    """The representable numbers just below and just above `x` rounded into `fmt`."""
    f = get(fmt)
    stored = round_to(x, f)
    if stored == 0.0:
        return -f.smallest_subnormal, f.smallest_subnormal
    bits = _pattern(stored, f)
    toward_zero, away = _from_pattern(bits - 1, f), _from_pattern(bits + 1, f)
    return (toward_zero, away) if stored > 0 else (away, toward_zero)


def rounding_error(x: float, fmt: str | Format) -> tuple[float, float]:
    """(absolute, relative) error of storing `x` in `fmt`."""
    stored = round_to(x, fmt)
    absolute = abs(stored - x)
    return absolute, (absolute / abs(x) if x else 0.0)


def same_after_rounding(a: float, b: float, fmt: str | Format) -> bool:
    """Whether `fmt` stores `a` and `b` as the same number."""
    return round_to(a, fmt) == round_to(b, fmt)


def max_relative_rounding(tensors, dtype) -> float:
    """The largest |round(w) − w| / |w| over the nonzero entries of `tensors` when stored in `dtype`
    (0.0 where every entry is zero: a fresh LoRA B matrix or a zero-initialised bias moves nothing)."""
    worst = 0.0
    for w in tensors:
        exact = w.detach().double()
        nonzero = exact != 0
        if bool(nonzero.any()):
            moved = (w.detach().to(dtype).double() - exact).abs()[nonzero] / exact.abs()[nonzero]
            worst = max(worst, float(moved.max()))
    return worst
