import math

import pytest
import torch

from labutils import formats


def test_layouts_match_torch_finfo():
    expected = {  # name: (bits, eps, max)
        "float32": (32, 2**-23, 3.4028234663852886e38),
        "bfloat16": (16, 2**-7, 3.3895313892515355e38),
        "float16": (16, 2**-10, 65504.0),
        "float8_e4m3fn": (8, 2**-3, 448.0),
        "float8_e5m2": (8, 2**-2, 57344.0),
    }
    for name, (bits, eps, largest) in expected.items():
        f = formats.get(name)
        assert (f.bits, f.eps, f.max) == (bits, eps, largest)


def test_smallest_numbers_are_exact():
    assert formats.get("float16").tiny == 2**-14
    assert formats.get("float16").smallest_subnormal == 2**-24
    assert formats.get("bfloat16").smallest_subnormal == 2**-133
    assert formats.round_to(2**-24, "float16") == 2**-24
    assert formats.round_to(2**-26, "float16") == 0.0


def test_decompose_one_and_minus_two_and_a_half():
    assert str(formats.decompose(1.0, "float16")) == "0 01111 0000000000"
    assert str(formats.decompose(1.0, "bfloat16")) == "0 01111111 0000000"
    b = formats.decompose(-2.5, "float32")
    assert (b.sign, b.exponent, b.mantissa) == ("1", "10000000", "01" + "0" * 21)
    assert str(formats.decompose(1.0, "float8_e4m3fn")) == "0 0111 000"
    assert str(formats.decompose(-1.5, "float8_e5m2")) == "1 01111 10"


def test_decompose_reports_stored_value():
    assert formats.decompose(0.1, "bfloat16").value == 0.10009765625
    assert formats.decompose(1.001, "float16").value == 1.0009765625


def test_ulp_and_neighbours_agree():
    for name in ("bfloat16", "float16", "float32", "float8_e4m3fn", "float8_e5m2"):
        for x in (1.0, 3.0, 0.3, 10.0):
            below, above = formats.neighbours(x, name)
            stored = formats.round_to(x, name)
            assert above - stored == formats.ulp(x, name)
            assert below < stored < above


def test_neighbours_of_one_in_fp16_are_exact():
    assert formats.neighbours(1.0, "float16") == (1 - 2**-11, 1 + 2**-10)
    assert formats.neighbours(-1.0, "float16") == (-1 - 2**-10, -1 + 2**-11)
    assert formats.neighbours(0.0, "float16") == (-(2**-24), 2**-24)


def test_ulp_in_subnormal_range_is_constant():
    assert formats.ulp(1e-7, "float16") == 2**-24
    assert formats.ulp(2**-20, "float16") == 2**-24


def test_rounding_error():
    absolute, relative = formats.rounding_error(0.1, "bfloat16")
    assert absolute == pytest.approx(0.10009765625 - 0.1, rel=1e-12)
    assert relative == pytest.approx(absolute / 0.1)
    assert formats.rounding_error(0.5, "float16") == (0.0, 0.0)


def test_demo_pairs():
    assert formats.same_after_rounding(1.0009765625, 1.001, "float16")  # the source says otherwise
    assert formats.same_after_rounding(1.0078125, 1.008, "bfloat16")
    assert not formats.same_after_rounding(1.0, 1.001, "float16")
    assert formats.same_after_rounding(1.0, 1.001, "bfloat16")


def test_overflow_and_unknown_format():
    assert math.isinf(formats.round_to(70000.0, "float16"))
    with pytest.raises(ValueError, match="choose one of"):
        formats.get("float12")


def test_max_relative_rounding_skips_all_zero_tensors():
    from labutils.formats import max_relative_rounding

    zero, ones = torch.zeros(3), torch.ones(4)
    assert max_relative_rounding([zero], torch.bfloat16) == 0.0
    assert max_relative_rounding([zero, ones], torch.bfloat16) == 0.0  # 1 is exact in bf16
    third = torch.tensor([1 / 3], dtype=torch.float64)
    expected = abs(float(third.bfloat16().double()) - 1 / 3) / (1 / 3)
    assert max_relative_rounding([zero, third], torch.bfloat16) == pytest.approx(expected)
    assert expected <= 2**-8  # round to nearest: at most half bf16's spacing, relative
