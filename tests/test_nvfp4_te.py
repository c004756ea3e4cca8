"""NVFP4 (qt.nvfp4) is Transformer Engine's NVFP4, bit for bit: the FP32 tensor scale from the
tensor's amax, each 16-element block's E4M3 scale and its FP4 elements, in TE's float32 order of
operations (tests/oracles.py nvfp4_te, independent of qtensor.reference); and a QTensor of it
carries its tensor scale, so that moving its values never changes them."""
from __future__ import annotations

import math

import pytest
import torch

import qtensor as qt
from oracles import nvfp4_te


def _bits(t):
    return t.detach().float().contiguous().view(torch.int32)


def _inputs():
    g = torch.Generator().manual_seed(0)
    out = {
        "normal": torch.randn(8, 64, generator=g),
        # heavy tails: a normal divided by |normal|^3 (a few huge values per tensor)
        "heavy": torch.randn(8, 64, generator=g) / torch.randn(8, 64, generator=g).abs().pow(3),
        "tiny": torch.randn(8, 64, generator=g) * 1e-30,
        "subnormal": torch.randn(8, 64, generator=g) * 1e-41,
        "huge": torch.randn(8, 64, generator=g) * 1e37,
        "max": torch.full((2, 32), 3.4e38) * torch.sign(torch.randn(2, 32, generator=g)),
        "zeros": torch.zeros(2, 32),
        "wide": torch.randn(8, 64, generator=g) * torch.exp2(torch.randint(-60, 60, (8, 64),
                                                                         generator=g).float()),
        "partial": torch.randn(5, 23, generator=g),
    }
    out["one_block_hot"] = out["normal"].clone()
    out["one_block_hot"][0, :16] *= 1e6  # all other blocks far below: subnormal E4M3 scales
    return out


@pytest.mark.parametrize("name", list(_inputs()))
def test_nvfp4_matches_the_te_rule_bit_for_bit(name):
    x = _inputs()[name]
    want, s = nvfp4_te(x.tolist(), qt.fp8_e4m3, qt.fp4_e2m1)
    got = qt.quantize(x, qt.nvfp4)
    assert torch.equal(_bits(got), _bits(torch.tensor(want))), name
    q = qt.as_qtensor(x, qt.nvfp4)
    assert torch.equal(_bits(q.dequantize()), _bits(torch.tensor(want)))
    assert q.tensor_scale.dtype == torch.float32 and float(q.tensor_scale) == s


def test_nvfp4_bf16_and_half_inputs_follow_the_rule():
    x = torch.randn(4, 48, generator=torch.Generator().manual_seed(1))
    for dt in (torch.bfloat16, torch.float16):
        xd = x.to(dt)
        want, _ = nvfp4_te(xd.float().tolist(), qt.fp8_e4m3, qt.fp4_e2m1)
        got = qt.quantize(xd, qt.nvfp4)
        assert torch.equal(got.float(), torch.tensor(want).to(dt).float())


def test_given_tensor_scale_follows_the_rule():
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(2))
    s = 0.001
    s32 = float(torch.tensor(s, dtype=torch.float32))
    want, _ = nvfp4_te(x.tolist(), qt.fp8_e4m3, qt.fp4_e2m1, tensor_scale=s32)
    got = qt.quantize(x, qt.nvfp4, tensor_scale=s32)
    assert torch.equal(_bits(got), _bits(torch.tensor(want)))


@pytest.mark.parametrize("bad", [0.0, -1.0, float("inf"), float("nan"), 0.1, 1e39])
def test_a_tensor_scale_that_is_no_positive_finite_float32_is_refused(bad):
    with pytest.raises(ValueError, match="tensor_scale"):
        qt.quantize(torch.ones(16), qt.nvfp4, tensor_scale=bad)
