"""The CPU kernel's fast NVFP4 paths against the reference, bit for bit, on their edge cases:
stochastic NVFP4 (csrc/quantize_cpu.h fp4_sto_run along contiguous rows, block_fp4_sto for any
other block; fp4_sto_grid8's double-precision quotient and its settling loop) and 4over6's error
sums 8 lanes at a time where they are exact (fp4_sums_exact; else in element order).

Swept: tensor scale on and off (nvfp4, nvfp4_single), stochastic and stochasticN, rows whose
last block is partial, block sizes 16 (the compile-time size) and others (multiples of 8 or
not), blocks along a strided axis, Half/BFloat16 payloads, blocks of zeros, of NaN/Inf, of
float32 subnormals, near float32's max, with a dynamic range wider than the exact sums allow,
blocks that settle often (every element just above 4 X: stochastic rounding to 4 lowers the
block's max), in place and into out=. test_other_isas reruns the file under
QTENSOR_CPU_ISA=base and avx2.
"""
from __future__ import annotations


import pytest
import torch

import qtensor as qt
from qtensor.kernels import ops, reference
from qtensor.nn.recipes import _nvfp4_4over6

from helpers import assert_bits_equal, assert_passes_under_isa

pytestmark = pytest.mark.skipif(not ops.kernels_available("cpu"),
                                reason="qtensor._C not built (pip install --no-build-isolation -e .)")

P = qt.PRESETS
F32_MAX = torch.finfo(torch.float32).max
STO_FORMATS = {"nvfp4": P["nvfp4"], "nvfp4_single": P["nvfp4_single"]}
F46_FORMATS = {"4over6": _nvfp4_4over6, "4over6_single": _nvfp4_4over6.replace(tensor_scale=False)}


def _inputs(rows: int = 24, cols: int = 100, seed: int = 0) -> torch.Tensor:
    """Rows of heavy-tailed values with the edge cases above, one kind of block per row."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g) * torch.rand(rows, cols, generator=g) ** 4 * 3
    x[1] = 0.0
    x[2, 5] = float("nan")
    x[3, 17 % cols] = float("inf")
    x[4] = torch.randn(cols, generator=g) * 1e-40  # float32 subnormals
    x[5] = torch.randn(cols, generator=g).clamp(-1, 1) * F32_MAX * 0.9
    x[6] = torch.randn(cols, generator=g) * torch.exp2(torch.randint(-30, 30, (cols,), generator=g).float())
    # every element just above 4 X (X = amax / 6): each block's max often rounds down to 4 X
    x[7] = (4.0 + torch.rand(cols, generator=g) * 0.5) * torch.where(
        torch.rand(cols, generator=g) < 0.5, -1.0, 1.0)
    x[7, ::16] = 6.0
    x[8] = torch.randn(cols, generator=g) * 1e-30
    x[8, ::3] = 0.0
    x[9, ::2] = -0.0
    return x


def _check(x, fmt, rounding, msg, seed=3):
    want = reference.quantize_with_seed(x, fmt, rounding, seed)
    got = ops.quantize_with_seed(x, fmt, rounding, seed)
    assert_bits_equal(got, want, f"{msg} {fmt} {rounding}", inputs=x)


@pytest.mark.parametrize("name", sorted(STO_FORMATS))
@pytest.mark.parametrize("rounding", ["stochastic", "stochastic8"])
@pytest.mark.parametrize("cols", [16, 100, 131])
def test_stochastic_rows(name, rounding, cols):
    """Rows (the run path), partial last blocks; several seeds."""
    x = _inputs(cols=cols)
    for seed in range(3):
        _check(x, STO_FORMATS[name], rounding, f"cols {cols}", seed=seed)


@pytest.mark.parametrize("name", sorted(STO_FORMATS))
@pytest.mark.parametrize("bs", [8, 12, 24, 32, 64])
def test_stochastic_block_sizes(name, bs):
    """Block sizes other than 16 (runtime-sized runs), rows and strided."""
    x = _inputs(cols=100)
    fmt = STO_FORMATS[name].replace(block_size=bs)
    _check(x, fmt, "stochastic", "rows")
    _check(x.t().contiguous(), fmt.replace(axis=0), "stochastic", "strided")


@pytest.mark.parametrize("name", sorted(STO_FORMATS))
def test_stochastic_strided_and_3d(name):
    """Blocks along a strided axis (block_fp4_sto, per block) and a middle axis."""
    x = _inputs(cols=48)
    fmt = STO_FORMATS[name]
    _check(x.t().contiguous(), fmt.replace(axis=0), "stochastic", "axis 0")
    _check(x.t(), fmt.replace(axis=-1), "stochastic", "transposed view")
    x3 = _inputs(rows=12, cols=40).reshape(12, 5, 8).transpose(1, 2).contiguous()
    _check(x3, fmt.replace(axis=1), "stochastic", "3d axis 1")


@pytest.mark.parametrize("name", sorted(STO_FORMATS))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_stochastic_half_payloads(name, dtype):
    x = _inputs(cols=100).clamp(-6e4, 6e4).to(dtype)
    _check(x, STO_FORMATS[name], "stochastic", str(dtype))


@pytest.mark.parametrize("name", sorted(F46_FORMATS))
@pytest.mark.parametrize("rounding", ["nearest", "nearest_away", "toward_zero"])
@pytest.mark.parametrize("bs", [16, 8, 24, 12])
def test_4over6_rows(name, rounding, bs):
    """4over6 runs: vector sums (m a multiple of 8, exact) and the element-order fallback (wide
    dynamic range, partial blocks, other sizes)."""
    x = _inputs(cols=100)
    _check(x, F46_FORMATS[name].replace(block_size=bs), rounding, f"bs {bs}")


def test_4over6_exact_sum_boundary():
    """Blocks whose dynamic range straddles fp4_sums_exact's bound (2^20..2^26 between the
    amax and the smallest nonzero element): both paths, and the inexact sums decide ties."""
    g = torch.Generator().manual_seed(5)
    rows = []
    for e in range(18, 30):
        r = torch.randn(64, generator=g)
        r[::16] = 5.0
        r[1::16] = 2.0 ** -e * (1 + torch.rand(4, generator=g))
        r[2::16] = -(2.0 ** -(e + 1))
        rows.append(r)
    x = torch.stack(rows)
    for fmt in F46_FORMATS.values():
        for rounding in ("nearest", "toward_zero"):
            _check(x, fmt, rounding, "range")


def test_in_place_and_out():
    """In place (the stochastic run stores after settling; 4over6 reads a block before writing
    it) and into out=."""
    x = _inputs(cols=100)
    for fmt, rounding in ((P["nvfp4"], "stochastic"), (_nvfp4_4over6, "nearest")):
        want = reference.quantize_with_seed(x, fmt, rounding, 7)
        y = x.clone()
        ops.quantize_with_seed(y, fmt, rounding, 7, out=y)
        assert_bits_equal(y, want, f"in place {fmt}")
        out = torch.empty_like(x)
        ops.quantize_with_seed(x, fmt, rounding, 7, out=out)
        assert_bits_equal(out, want, f"out= {fmt}")


def test_parallel_chunks():
    """Two threads: the parallel chunks (2048 blocks of 16) end in the middle of rows, so runs
    start at a block whose logical index is not a row's start."""
    g = torch.Generator().manual_seed(11)
    x = torch.randn(300, 1000, generator=g) * torch.rand(300, 1000, generator=g) ** 3
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        _check(x, P["nvfp4"], "stochastic", "2 threads")
        _check(x, _nvfp4_4over6, "nearest", "2 threads")
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("isa", ["base", "avx2"])
def test_other_isas(isa):
    """This file's float32 tests under QTENSOR_CPU_ISA=base|avx2 (the 8-lane vectors split for
    SSE2 and AVX2), in a subprocess."""
    assert_passes_under_isa(__file__, isa, "stochastic_rows or 4over6_rows or strided_and_3d or boundary")
