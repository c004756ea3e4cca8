"""qt.accum.AccumFormat: validation, str, hashing."""
import dataclasses

import pytest
import torch

from qtensor import accum
from qtensor.accum.format import AccumFormat, AccumFormatError


# ---------------------------------------------------------------------------------------------
# AccumFormat: validation, str, hashing

def test_format_is_frozen_hashable_readable():
    f = accum.hopper_fp8
    assert hash(f) == hash(f.replace())
    # e_zero: the exponent MMA-Sim gives zero terms on Hopper (-133)
    assert f == AccumFormat(chunk=32, frac_bits=13, acc_man=13, promote=4, e_zero=-133)
    assert str(f) == ("hopper_fp8: AccumFormat(chunk=32, frac_bits=13, acc_man=13, e_zero=-133, "
                      "promote=4)")
    with pytest.raises(dataclasses.FrozenInstanceError):
        f.chunk = 3


@pytest.mark.parametrize("kw, msg", [
    (dict(chunk=0, frac_bits=4), r"chunk must be in \[1, 65536\], got 0"),
    (dict(chunk=8, frac_bits=4, group=3), r"chunk \(8\) must be a multiple of group \(3\)"),
    (dict(chunk=8, frac_bits=60), r"frac_bits=60 is too wide .* at most 47"),
    (dict(chunk=8, frac_bits=4, acc_man=24), r"acc_man must be in \[0, 23\], got 24"),
    (dict(chunk=8, frac_bits=4, promote=0), r"promote must be >= 1, got 0"),
    (dict(chunk=8, frac_bits=4, e_zero=-2000), r"e_zero must be in \[-1000, 128\], got -2000"),
    (dict(chunk=8, frac_bits=4, acc_emin=-127), r"acc_emin must be in \[-126, 0\], got -127"),
    (dict(chunk=8, frac_bits=4, acc_emax=128), r"acc_emax must be in \[1, 127\], got 128"),
    (dict(chunk=8, frac_bits=4, align_rounding="up"), r"align_rounding must be one of"),
    (dict(chunk=8, frac_bits=4, acc_rounding="floor"), r"acc_rounding must be one of"),
    (dict(chunk=8.0, frac_bits=4), r"chunk must be an int, got 8.0"),
    (dict(chunk=8, frac_bits=4, acc_in_alignment=1), r"acc_in_alignment must be a bool"),
])
def test_format_errors(kw, msg):
    with pytest.raises(AccumFormatError, match=msg):
        AccumFormat(**kw)


def test_operand_errors():
    f = accum.hopper_fp16
    with pytest.raises(ValueError, match=r"contraction sizes differ"):
        accum.accum_matmul(torch.ones(2, 3), torch.ones(4, 2), f)
    with pytest.raises(TypeError, match=r"dtype torch.float64"):
        accum.accum_matmul(torch.ones(2, 3, dtype=torch.float64), torch.ones(3, 2), f)
    with pytest.raises(AccumFormatError, match=r"unknown accumulator preset 'h100'"):
        accum.accum_matmul(torch.ones(2, 3), torch.ones(3, 2), "h100")
    with pytest.raises(ValueError, match=r"at least 2 dims"):
        accum.accum_matmul(torch.ones(3), torch.ones(3, 2), f)


def test_qt_accum_names_as_before():
    from qtensor import accum as package
    assert sorted(package.__all__) == sorted(
        ["AccumFormat", "AccumFormatError", "OperandFormatWarning", "accum_matmul",
         "accum_matmul_reference", "as_accum", "contract", "PRESETS", "ALIGN_ROUNDINGS",
         "ACC_ROUNDINGS"])
    for n in package.__all__:
        assert getattr(package, n) is not None
    for name, f in package.PRESETS.items():
        assert getattr(package, name) is f and package.as_accum(name) is f
    assert callable(package.contract)  # the function, not the lowering module
