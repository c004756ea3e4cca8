"""qt.recipes.direct_cast(fmt): the MX paper's direct-cast inference in any format."""
import copy

import pytest
import torch
import torch.nn.functional as F

import qtensor as qt


@pytest.mark.parametrize("name", ["mxfp8_e4m3", "mxfp4_e2m1", "nvfp4", "bf16"])
def test_direct_cast_rounds_only_the_contraction_operands(name):
    fmt = qt.format(name)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.GELU(), torch.nn.Linear(32, 8))
    x = torch.randn(6, 64)
    recipe = qt.recipes.direct_cast(name)
    assert recipe.weight == qt.Role(qt.fp32, fmt) and recipe.activation == qt.Role(qt.fp32, fmt)
    assert recipe.bias == qt.Role(qt.fp32) and recipe.grad.full_precision
    assert recipe.name == f"direct_cast({fmt})"
    conv = qt.convert(copy.deepcopy(model), recipe)
    with torch.no_grad():
        out = conv(x)
    # by hand: operands rounded along the reduction (last) axis, FP32 sums, FP32 everything else
    q = (lambda t: qt.quantize(t, fmt.replace(axis=-1))) if isinstance(fmt, qt.BlockFormat) \
        else (lambda t: qt.quantize(t, fmt))
    w1, b1, w2, b2 = (p.detach() for p in model.parameters())
    h = F.gelu(q(x) @ q(w1).T + b1)
    ref = q(h) @ q(w2).T + b2
    assert out.fmt == qt.fp32 and out.mm_fmt == fmt
    torch.testing.assert_close(out.dequantize(), ref, rtol=1e-5, atol=1e-5)
    # the stored values stay FP32 (the parameters are the trained ones)
    for p, p0 in zip(conv.parameters(), model.parameters()):
        assert torch.equal(p.dequantize(), p0.detach())
    # and the rounding is real: the output differs from FP32's
    assert not torch.allclose(out.dequantize(), model(x), rtol=0, atol=1e-7)


def test_direct_cast_of_mxint8_is_the_mxint8_inference_preset():
    assert qt.recipes.direct_cast(qt.mxint8) == qt.recipes.mxint8_inference


def test_direct_cast_refuses_what_is_not_a_signed_format():
    with pytest.raises((qt.FormatError, ValueError)):
        qt.recipes.direct_cast("not_a_format")
    with pytest.raises(qt.FormatError, match="cannot hold"):
        qt.recipes.direct_cast(qt.format("e8m0"))
