"""Blocks along a strided axis: the CPU kernel's tiles (csrc/quantize_cpu.h,
blocks_tiled) and dispatch.quantize's use of them (STRIDED_BLOCKS) against the reference and the
transposing copy they replace, bit for bit.

Layouts: a contiguous matrix blocked along dim 0, a transposed view blocked along its last dim,
3-D tensors blocked along the middle and the first dim; sizes that leave partial blocks and
partial lane chunks (the tiles are 64 lanes wide); blocks with NaN, Inf, zeros, subnormals and
values near float32's limits; float32, float16 and bfloat16; functional, out= and in place.
"""
from __future__ import annotations

import pytest
import torch

import qtensor as qt
from qtensor.tensor import dispatch
from qtensor.kernels import backend
from qtensor.kernels import ops, reference
from qtensor.formats.block import BlockFormat
from qtensor.formats.fixed import FixedFormat
from qtensor.formats.float import FloatFormat

from helpers import assert_bits_equal
from test_kernels import block_inputs

pytestmark = pytest.mark.skipif(not ops.kernels_available("cpu"),
                                reason="qtensor._C not built (pip install --no-build-isolation -e .)")

P = qt.PRESETS
DETERMINISTIC = ("nearest", "nearest_away", "toward_zero")

FORMATS = [
    P["mxfp8_e4m3"], P["mxfp8_e5m2"], P["mxfp6_e3m2"], P["mxfp6_e2m3"], P["mxfp4_e2m1"],
    P["mxint8"], P["nvfp4_single"],  # (two-level nvfp4 is not rounded by the kernels)
    BlockFormat(P["fp4_e2m1"], 16, scale=P["fp8_e4m3"], scale_rule="amax"),  # no tensor scale
    BlockFormat(P["fp8_e4m3"], 32, scale_rule="ceil"),
    BlockFormat(P["fp8_e4m3"], 32, scale_rule="rceil"),
    BlockFormat(P["fp8_e5m2"], 7, scale_rule="ceil"),
    BlockFormat(P["fp8_e4m3"], 32, scale_rule="even"),
    BlockFormat(P["fp4_e2m1"], 32, scale_rule="even"),
    BlockFormat(FixedFormat(6, 4, signed=False), 5, scale_rule="even"),  # settled pass over x
    BlockFormat(FixedFormat(8, 6), 32),
    BlockFormat(FixedFormat(6, 4, signed=False), 5),
    BlockFormat(FixedFormat(4, 2), None),                                # one block per lane
    BlockFormat(P["fp6_e3m2"], 3, scale=P["fp8_e5m2"], scale_rule="amax"),
    BlockFormat(FixedFormat(8, 6, symmetric=True), 8, scale=P["fp8_e4m3"], scale_rule="amax"),
    BlockFormat(FixedFormat(5, 3, signed=False), 8, scale=P["fp8_e4m3"], scale_rule="amax"),
    BlockFormat(P["fp4_e2m1"], 16, scale=P["fp8_e4m3"], scale_rule="ceil"),  # amax rule, up
    BlockFormat(FloatFormat(3, 4, bias=3), 32, scale_rule="ceil"),
]


def _inputs(rows, cols, seed):
    """block_inputs' specials and ranges, spread along both dims (blocks run down columns here)."""
    a = block_inputs(rows, cols, seed=seed)
    b = block_inputs(cols, rows, seed=seed + 1).t()
    x = torch.where(torch.arange(cols) % 2 == 0, a, b)
    x[rows // 2:, 1] = float("nan")  # a NaN in the partial last block of a lane
    x[:, 2] = 0.0
    return x


def _layouts(x2, x3):
    """(label, tensor, axis): the strided-axis layouts the tiles take."""
    return [("rows-axis0", x2, 0), ("rows-axis-2", x2, -2),
            ("transposed-axis-1", x2.t().contiguous().t(), -1),
            ("3d-axis1", x3, 1), ("3d-axis0", x3, 0),
            ("3d-permuted-axis0", x3.permute(2, 0, 1).contiguous().permute(1, 2, 0), 0),
            ("3d-permuted-axis1 (innermost: the copy)",
             x3.permute(2, 0, 1).contiguous().permute(1, 2, 0), 1)]


def _reference(x, fmt):
    return reference.quantize(x, fmt, rounding=fmt.rounding)


def _via_copy(x, fmt):
    """today's transposing copy (dispatch with STRIDED_BLOCKS off)."""
    old = backend.STRIDED_BLOCKS
    backend.STRIDED_BLOCKS = False
    try:
        return dispatch.quantize(x, fmt, keep_layout=False)
    finally:
        backend.STRIDED_BLOCKS = old


@pytest.mark.parametrize("fmt", FORMATS, ids=str)
def test_tiles_match_reference_and_copy(fmt):
    x2 = _inputs(50, 150, seed=11)            # 50 rows: partial blocks; 150 lanes: 64+64+22
    x3 = _inputs(36, 70, seed=12).reshape(6, 6, 70)
    for rounding in DETERMINISTIC:
        for label, x, axis in _layouts(x2, x3):
            f = fmt.replace(axis=axis, rounding=rounding)
            msg = f"{f} {label}"
            want = _reference(x, f)
            assert_bits_equal(_via_copy(x, f), want, msg + " copy", inputs=x)
            for keep in (False, True):
                got = dispatch.quantize(x, f, keep_layout=keep)
                assert_bits_equal(got, want, f"{msg} dispatch keep_layout={keep}", inputs=x)
                if keep and x.is_contiguous():
                    assert got.is_contiguous(), msg
            # the op as it lies: functional, out= in x's layout, in place
            assert_bits_equal(ops.quantize_with_seed(x, f, rounding, 0), want, msg + " op")
            out = torch.empty_like(x)
            ops.quantize_with_seed(x, f, rounding, 0, out=out)
            assert_bits_equal(out, want, msg + " out=")
            y = x.clone()
            assert qt.quantize_(y, f) is y
            assert_bits_equal(y, want, msg + " in place")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_tiles_half_dtypes(dtype):
    x2 = _inputs(40, 100, seed=13).clamp(-6e4, 6e4).to(dtype)
    x3 = _inputs(24, 70, seed=14).clamp(-6e4, 6e4).to(dtype).reshape(4, 6, 70)
    for fmt in (P["mxfp8_e4m3"], P["mxfp4_e2m1"], P["mxint8"], P["nvfp4"],
                BlockFormat(P["fp8_e4m3"], 32, scale_rule="even"),
                BlockFormat(FixedFormat(8, 6, symmetric=True), 8, scale=P["fp8_e4m3"],
                            scale_rule="amax")):
        for rounding in ("nearest", "toward_zero"):
            for label, x, axis in _layouts(x2, x3):
                f = fmt.replace(axis=axis, rounding=rounding)
                want = _reference(x, f)
                assert_bits_equal(dispatch.quantize(x, f), want, f"{f} {label} {dtype}")
                assert_bits_equal(_via_copy(x, f), want, f"{f} {label} {dtype} copy")
                y = x.clone()
                qt.quantize_(y, f)
                assert_bits_equal(y, want, f"{f} {label} {dtype} in place")


@pytest.mark.parametrize("shape,axis", [((33, 1), 0), ((1, 33), 1), ((70, 3), 0),
                                        ((5, 1, 9), 0), ((65, 65), 0), ((2, 2), 0)])
def test_tiles_odd_shapes(shape, axis):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(sum(shape))) * 3
    for fmt in (P["mxfp8_e4m3"], P["nvfp4"], BlockFormat(P["fp8_e4m3"], 4, scale_rule="even")):
        f = fmt.replace(axis=axis)
        want = _reference(x, f)
        assert_bits_equal(dispatch.quantize(x, f), want, f"{f} {shape}")
        y = x.clone()
        qt.quantize_(y, f)
        assert_bits_equal(y, want, f"{f} {shape} in place")


def test_stochastic_and_4over6_keep_their_paths():
    """Stochastic rounding (words by element index) and 4over6 are not tiled: still the
    reference's bits on strided axes."""
    x = _inputs(40, 70, seed=15)
    for fmt in (P["mxfp8_e4m3"].replace(axis=0),
                BlockFormat(P["fp4_e2m1"], 16, axis=0, scale=P["fp8_e4m3"],
                            scale_rule="4over6")):
        for rounding in ("nearest", "stochastic"):
            got = ops.quantize_with_seed(x, fmt, rounding, 5)
            assert_bits_equal(got, reference.quantize_with_seed(x, fmt, rounding, 5),
                              f"{fmt} {rounding}")
    f = BlockFormat(P["fp4_e2m1"], 16, axis=0, scale=P["fp8_e4m3"], scale_rule="4over6")
    assert backend._strided_blocks(x, f, 0) is not None  # (dispatch checks the rule itself)
    assert not backend.tiles_in_place(x, f)


def test_dispatch_takes_the_tiles(monkeypatch):
    """quantize() gives strided block axes to the kernel without a copy (and keeps x's layout);
    the copy path stays where the axis is already the innermost of a permuted tensor."""
    calls = []
    real = backend._strided_blocks
    monkeypatch.setattr(backend, "_strided_blocks",
                        lambda *a: calls.append(a[2]) or real(*a))
    x = torch.randn(64, 96)
    q = dispatch.quantize(x, P["mxfp8_e4m3"].replace(axis=0), keep_layout=False)
    assert calls and q.stride() == x.stride()
    xt = torch.randn(96, 64).t()
    q = dispatch.quantize(xt, P["mxfp8_e4m3"].replace(axis=-1), keep_layout=False)
    assert q.stride() == xt.stride()
    assert real(xt, P["mxfp8_e4m3"].replace(axis=0), 0) is None  # innermost: the flat kernel


def _train(fmt, strided, steps=3):
    # (convolution operands keep the copy's layout: tests/tensor/test_gemm.py's
    # test_conv2d_three_gemms_against_manual fails where they take the tiles)
    old = backend.STRIDED_BLOCKS
    backend.STRIDED_BLOCKS = strided
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.GELU(),
                                    torch.nn.Linear(96, 32))
        qt.convert(model, fmt)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        g = torch.Generator().manual_seed(1)
        grads = []
        for _ in range(steps):
            x = torch.randn(48, 64, generator=g)
            loss = model(x).square().mean()
            opt.zero_grad()
            loss.backward()
            grads.append([torch.as_tensor(p.grad).detach().clone() for p in model.parameters()])
            opt.step()
        return [p.detach().clone() for p in model.parameters()], grads
    finally:
        backend.STRIDED_BLOCKS = old


def _recipe(name):
    """as qt.recipes.mxfp6: f matmul operands, BF16 values, FP32 master weights"""
    f = P[name]
    return qt.Recipe(weight=(P["fp32"], f), bias=P["fp32"], activation=(P["bf16"], f),
                     grad=(P["bf16"], f), optimizer_state=None, master_weights=True)


@pytest.mark.parametrize("name", ["mxfp8_e4m3", "nvfp4_single"])  # (two-level nvfp4: not the kernels)
def test_converted_model_same_bits(name, monkeypatch):
    """A converted MLP trained a few steps: the same parameters and gradients, bit for bit, with
    the tiles on and off; and the tiles were used (backward rounds operands along strided axes)."""
    calls = []
    real = backend._strided_blocks
    monkeypatch.setattr(backend, "_strided_blocks",
                        lambda *a: calls.append(1) or real(*a))
    p_on, g_on = _train(_recipe(name), True)
    assert calls, "the strided path was not taken"
    n_on = len(calls)
    p_off, g_off = _train(_recipe(name), False)
    assert len(calls) == n_on
    for a, b in zip(p_on, p_off):
        assert_bits_equal(a, b, f"{name} parameters")
    for step_on, step_off in zip(g_on, g_off):
        for a, b in zip(step_on, step_off):
            assert_bits_equal(a, b, f"{name} gradients")


def test_round_fresh_in_place():
    """An op's fresh output blocked along a non-innermost axis is rounded in place by the tiles
    (no copy), with the copy path's bits."""
    x = _inputs(50, 150, seed=16)
    for fmt in (P["mxfp8_e4m3"].replace(axis=0), P["nvfp4"].replace(axis=0)):
        want = _via_copy(x, fmt)
        out = x.clone()
        got = dispatch._round_fresh(out, fmt, torch.ops.aten.mm.default)
        assert got is out
        assert_bits_equal(got, want, f"{fmt} fresh")
        old = backend.STRIDED_BLOCKS
        backend.STRIDED_BLOCKS = False
        try:
            out = x.clone()
            got = dispatch._round_fresh(out, fmt, torch.ops.aten.mm.default)
        finally:
            backend.STRIDED_BLOCKS = old
        assert got is not out  # (the copy path)
        assert_bits_equal(got, want, f"{fmt} fresh, copy")
