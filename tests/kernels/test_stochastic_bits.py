"""Stochastic rounding with a limited number of random bits ("stochasticN"): as
hardware does it (NVIDIA's cvt.rs takes 8 random bits per element; MPTorch exposes the count).

Element i rounds its magnitude up iff the top N bits of its 32-bit random word are below
floor(frac * 2^N): P(up) = floor(frac * 2^N) / 2^N exactly, biased low by less than 2^-N of a
quantum. Tested: the rule itself (oracle below), its exact expectation, kernels = reference for
float, fixed and block formats, reproducibility, the string form.
"""
from __future__ import annotations

import math

import pytest
import torch

import qtensor as qt
from qtensor.kernels import ops, reference
from qtensor.formats.block import BlockFormat
from qtensor.formats.fixed import FixedFormat
from qtensor.formats.float import FloatFormat
from qtensor.formats.base import FormatError

from helpers import assert_bits_equal

P = qt.PRESETS
SEED = 0x5EED_0F_B175


def test_string_form_and_refusals():
    for text in ("fp8_e4m3(rounding=stochastic8)", "bf16(rounding=stochastic1)",
                 "fixed8.4(rounding=stochastic31)", "mxfp4_e2m1(rounding=stochastic8)",
                 "nvfp4(rounding=stochastic16)"):
        f = qt.format(text)
        assert str(f) == text and qt.format(str(f)) == f
    assert qt.formats.stochastic_bits("stochastic") == 32
    assert qt.formats.stochastic_bits("stochastic8") == 8
    assert qt.formats.stochastic_bits("nearest") is None
    for bad in ("stochastic0", "stochastic32", "stochastic08", "stochastic-1", "stochastic 8"):
        with pytest.raises(FormatError, match="stochasticN"):
            FloatFormat(4, 3, rounding=bad)
    with pytest.raises(FormatError, match="stochasticN"):
        qt.quantize(torch.ones(3), "bf16", rounding="stochastic33")


def oracle(x: torch.Tensor, quantum: float, nbits: int, seed: int) -> torch.Tensor:
    """Positive x on a grid of spacing ``quantum`` (no overflow): the N-bit rule by hand."""
    y = x.double() / quantum
    lo = torch.floor(y)
    thr = torch.floor((y - lo) * 2 ** nbits)
    top = reference.random_bits(seed, torch.arange(x.numel()).reshape(x.shape)) >> (32 - nbits)
    return ((lo + (top < thr).double()) * quantum).float()


@pytest.mark.parametrize("nbits", [1, 2, 8, 13, 31])
def test_rule_against_oracle(nbits):
    g = torch.Generator().manual_seed(nbits)
    x = torch.rand(4096, generator=g) * 4 + 4  # [4, 8): fp8_e4m3 spacing 0.5
    x[:64] = 4.0 + torch.arange(64) / 128  # fractions of exactly few bits (thresholds)
    fmt = FloatFormat(4, 3, specials="fn", saturate=True)
    want = oracle(x, 0.5, nbits, SEED)
    assert_bits_equal(reference.quantize_with_seed(x, fmt, f"stochastic{nbits}", SEED), want,
                      "reference")
    if ops.kernels_available("cpu"):
        assert_bits_equal(ops.quantize_with_seed(x, fmt, f"stochastic{nbits}", SEED), want,
                          "kernel")


@pytest.mark.parametrize("nbits,frac", [(2, 0.2), (2, 0.3), (8, 0.5 + 2 ** -10), (8, 0.0037),
                                        (4, 0.99)])
def test_exact_expectation(nbits, frac):
    """E[q] = lo + quantum * floor(frac * 2^N) / 2^N: for N = 2 a fraction 0.2 never rounds up
    (floor(0.8) = 0) and 0.3 rounds up with probability 1/4, not 0.3; the mean of 2^16 draws
    is within 5 sigma of that, and the bias (E[q] - x) lies in (-quantum * 2^-N, 0]."""
    n = 1 << 16
    quantum = 2.0 ** -3  # bf16 spacing in [1, 2) is 2^-7; fp8_e4m3 in [1, 2): 2^-3
    x = torch.full((n,), 1.0 + frac * quantum)
    q = qt.quantize(x, "fp8_e4m3", rounding=f"stochastic{nbits}",
                    generator=torch.Generator().manual_seed(3)).double()
    p = math.floor(frac * 2 ** nbits) / 2 ** nbits
    expect = 1.0 + p * quantum
    sigma = quantum * math.sqrt(p * (1 - p) / n)
    assert abs(q.mean().item() - expect) <= 5 * sigma + 1e-15
    if p == 0:
        assert bool((q == 1.0).all())
    bias = expect - float(x[0])
    assert -quantum * 2.0 ** -nbits < bias <= 0
    if nbits == 2 and frac == 0.3:  # distinguishable from the 32-bit rounding's 0.3
        assert abs(q.mean().item() - (1.0 + 0.3 * quantum)) > 10 * sigma


FORMATS = [P["fp8_e4m3"], P["bf16"], FloatFormat(5, 2, subnormals=False), FixedFormat(8, 4),
           FixedFormat(8, 4, saturate=False), FixedFormat(6, 2, signed=False),
           P["mxfp4_e2m1"], P["mxint8"], P["nvfp4"], P["nvfp4_single"],
           BlockFormat(P["fp8_e4m3"], 16, axis=0), BlockFormat(P["fp6_e2m3"], None, axis=None),
           BlockFormat(P["fp4_e2m1"], 16, scale=P["fp8_e4m3"], scale_rule="4over6")]


@pytest.mark.skipif(not ops.kernels_available("cpu"), reason="qtensor._C not built")
@pytest.mark.parametrize("nbits", [1, 8, 23])
@pytest.mark.parametrize("fmt", FORMATS, ids=str)
def test_kernels_match_reference(fmt, nbits):
    g = torch.Generator().manual_seed(7)
    x = torch.randn(32, 48, generator=g) * torch.exp2(torch.randint(-30, 20, (32, 1),
                                                                    generator=g).float())
    x[0, :4] = torch.tensor([0.0, -0.0, float("inf"), 2.0 ** -140])
    x[1, 3] = float("nan")
    mode = f"stochastic{nbits}"
    for t in (x, x.t(), x.to(torch.bfloat16)):
        assert_bits_equal(ops.quantize_with_seed(t, fmt, mode, SEED),
                          reference.quantize_with_seed(t, fmt, mode, SEED), f"{fmt} {mode}",
                          inputs=t)
    y = x.clone()
    torch.manual_seed(11)
    qt.quantize_(y, fmt, rounding=mode)
    torch.manual_seed(11)
    assert_bits_equal(y, reference.quantize(x, fmt, rounding=mode), "in place, manual_seed")


def test_reproducible_under_manual_seed_and_generator():
    x = torch.randn(4096)
    fmt = qt.format("fp8_e4m3(rounding=stochastic8)")
    torch.manual_seed(5)
    a = qt.quantize(x, fmt)
    torch.manual_seed(5)
    b = qt.quantize(x, fmt)
    assert_bits_equal(a, b, "manual_seed")
    assert not torch.equal(a, qt.quantize(x, fmt))
    d = qt.quantize(x, fmt, generator=torch.Generator().manual_seed(9))
    e = reference.quantize(x, fmt, generator=torch.Generator().manual_seed(9))
    assert_bits_equal(d, e, "generator, kernel vs reference")
    # 8 random bits are the top 8 of the 32-bit word: where frac has at most 8 bits both agree
    x8 = 1.0 + torch.randint(0, 256, (4096,)).float() * 2.0 ** -11  # e4m3 spacing 2^-3
    s32 = qt.quantize(x8, "fp8_e4m3", rounding="stochastic", generator=torch.Generator()
                      .manual_seed(2))
    s8 = qt.quantize(x8, "fp8_e4m3", rounding="stochastic8", generator=torch.Generator()
                     .manual_seed(2))
    assert_bits_equal(s8, s32, "frac of 8 bits")


def test_qtensor_and_converted_model():
    """A QTensor in a limited-bit stochastic format rounds with it (data movement leaves its
    values alone: they are in format)."""
    fmt = qt.format("bf16(rounding=stochastic8)")
    q = qt.as_qtensor(torch.randn(64, 64), fmt)
    v = q.dequantize().clone()
    assert_bits_equal(torch.cat([q, q]).dequantize(), torch.cat([v, v]), "cat")
    model = torch.nn.Linear(8, 4)
    qt.convert(model, qt.Recipe.uniform(fmt))
    model(torch.randn(3, 8)).sum().backward()
