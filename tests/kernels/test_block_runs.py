"""Power-of-two-scale blocks a run at a time: the CPU kernel's run path
(csrc/quantize_cpu.h pow2_block_run, pow2_grids, round_tile; qtensor/round.h round_magnitude_add,
round_fixed_fast_finite) against the reference, bit for bit, on the cases its argument rests on.

The run path computes each block's exponent k from the amax's bits (pow2_scale_exp) and rounds
float elements with c = 2^(max(binade, emin + k) + man') additions instead of the shifted grid's
integer operations. Swept here: every element code of each MX element format (and the midpoints
between neighbouring codes, values past max in its binade, and the floats next to those) times scales 2^k at both ends of E8M0's
range and in between, with the block's max element pinning k; blocks of float32 subnormals, of
signed zeros, with Inf/NaN, near float32's max (c would overflow: the per-block fallback) and at
float32's smallest normal; tiny elements far below the grid's half ulp next to large ones; rows
whose last block is partial and odd lengths; block sizes 32 (the compile-time size) and others;
floor, ceil and even rules; nearest, nearest_away, toward_zero; blocks along rows (the flat runs)
and down columns (the tiles); float32, bfloat16 and float16 payloads. test_other_isas reruns the
file under QTENSOR_CPU_ISA=base and avx2 (the ISA is chosen once per process).
"""
from __future__ import annotations

import math

import pytest
import torch

import qtensor as qt
from qtensor.kernels import ops, reference
from qtensor.formats.fixed import FixedFormat

from helpers import assert_bits_equal, assert_passes_under_isa

pytestmark = pytest.mark.skipif(not ops.kernels_available("cpu"),
                                reason="qtensor._C not built (pip install --no-build-isolation -e .)")

P = qt.PRESETS
NAMES = ["mxfp8_e4m3", "mxfp8_e5m2", "mxfp6_e3m2", "mxfp6_e2m3", "mxfp4_e2m1", "mxint8"]
RULES = ["floor", "ceil", "even"]
MODES = ["nearest", "nearest_away", "toward_zero"]
# scale exponents: both ends of E8M0 (-127..127), where the shifted grid leaves float32's
# normals, where c = 2^(binade + 23 - man) nears float32's top, and between
KS = [-127, -126, -125, -124, -121, -120, -119, -116, -60, -1, 0, 1, 100, 104, 110, 111, 112,
      113, 116, 120, 124, 126, 127]
F32_MAX = torch.finfo(torch.float32).max


def _codes(elem) -> torch.Tensor:
    """Every non-negative finite value of the element format (float64, ascending)."""
    if isinstance(elem, FixedFormat):
        kmax = (1 << (elem.wl - 1)) - 1 if elem.signed else (1 << elem.wl) - 1
        return torch.arange(kmax + 1, dtype=torch.float64) * 2.0 ** -elem.fl
    m = 1 << elem.man
    sub = torch.arange(m, dtype=torch.float64) * 2.0 ** (elem.emin - elem.man)
    e = torch.arange(elem.emin, elem.emax + 1, dtype=torch.float64)
    norm = ((1 + torch.arange(m, dtype=torch.float64) / m)[None, :] * torch.exp2(e)[:, None])
    v = torch.cat([sub, norm.reshape(-1)])
    return v[v <= elem.max]


def _nudge32(t: torch.Tensor) -> torch.Tensor:
    """t (float32) and its float32 neighbours."""
    return torch.cat([t, torch.nextafter(t, torch.full_like(t, math.inf)),
                      torch.nextafter(t, torch.full_like(t, -math.inf))])


def _blocks(elem, bs=32) -> torch.Tensor:
    """[n, bs] float32 blocks: per k, the codes, midpoints and their neighbours times 2^k, each
    block led by max * 2^k (its amax: the block's scale is 2^k under the floor rule), then the
    special blocks."""
    codes = _codes(elem)
    mids = (codes[1:] + codes[:-1]) / 2
    # past max in its binade (below 2^(emax+1): the floor rule's k is kept): the clamp to max
    top = 2.0 ** (elem.emax + 1)
    above = elem.max + (top - elem.max) * torch.arange(1, 8, dtype=torch.float64) / 8
    rows = []
    for k in KS:
        vals = torch.cat([codes, mids, above]) * 2.0 ** k
        vals = _nudge32(vals.clamp(max=F32_MAX).to(torch.float32))
        vals = torch.cat([vals, -vals])
        vals = vals[torch.randperm(vals.numel(), generator=torch.Generator().manual_seed(k + 200))]
        per = bs - 1
        n = -(-vals.numel() // per)
        vals = torch.cat([vals, vals[:n * per - vals.numel()]]).reshape(n, per)
        lead = torch.full((n, 1), min(elem.max * 2.0 ** k, F32_MAX), dtype=torch.float32)
        rows.append(torch.cat([lead * torch.where(torch.arange(n) % 2 == 0, 1.0, -1.0)[:, None],
                               vals], 1))
    g = torch.Generator().manual_seed(7)
    tiny = 2.0 ** -149
    sub_bits = torch.randint(1, 1 << 23, (6, bs), generator=g, dtype=torch.int32)
    special = [
        sub_bits.view(torch.float32),                                  # float32 subnormals
        -sub_bits.view(torch.float32),
        torch.full((1, bs), -0.0), torch.zeros(1, bs),                 # signed zeros
        torch.where(torch.arange(bs) % 2 == 0, -0.0, 0.0)[None],
        torch.full((1, bs), tiny), torch.full((1, bs), -tiny),
        # smallest normal and its neighbours, with subnormals
        _nudge32(torch.full((bs // 3 + 1,), 2.0 ** -126))[:bs][None],
        # float32's top (c = 2^(binade + d) would overflow: round_block)
        torch.full((1, bs), F32_MAX), torch.full((1, bs), -F32_MAX),
        torch.linspace(-F32_MAX, F32_MAX, bs)[None],
        (2.0 ** torch.arange(127 - bs + 1, 128, dtype=torch.float64)).to(torch.float32)[None],
        # tiny values far below the grid's half ulp next to a large one (and signed zeros)
        torch.cat([torch.tensor([1.0e30]), torch.full((bs - 1,), -1.0e-30)])[None],
        torch.cat([torch.tensor([3.0]), torch.full((bs - 1,), -tiny)])[None],
        torch.cat([torch.tensor([2.0 ** 100]), torch.randn(bs - 1, generator=g)])[None],
        torch.randn(4, bs, generator=g),
        torch.randn(2, bs, generator=g) * 2.0 ** -130,
    ]
    nan = torch.randn(4, bs, generator=g)
    nan[0, 3], nan[1, bs - 1], nan[2, 0], nan[3, 5] = math.nan, math.inf, -math.inf, -math.nan
    special.append(nan)
    return torch.cat(rows + special)


_CACHE = {}


def _inputs(name, bs=32):
    key = (name, bs)
    if key not in _CACHE:
        _CACHE[key] = _blocks(P[name].elem, bs)
    return _CACHE[key]


def _check(x, fmt, rounding, msg):
    got = ops.quantize(x, fmt, rounding=rounding)
    want = reference.quantize(x, fmt, rounding=rounding)
    assert_bits_equal(got, want, f"{fmt} {rounding} {x.dtype} {msg}", inputs=x)


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("name", NAMES)
def test_codes_times_scales(name, rule):
    """Every code and midpoint times 2^k, k over E8M0's range, and the special blocks: rows
    (axis -1: the flat runs) and columns (axis 0: the tiles), every deterministic mode."""
    fmt = P[name].replace(scale_rule=rule)
    x = _inputs(name)
    xt = x.t().contiguous()  # the same blocks down the columns
    for rounding in MODES:
        _check(x, fmt.replace(axis=-1), rounding, "rows")
        _check(xt, fmt.replace(axis=0), rounding, "tiles")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", ["mxfp8_e4m3", "mxfp6_e3m2", "mxfp4_e2m1", "mxint8"])
def test_half_payloads(name, dtype):
    x = _inputs(name).to(dtype)
    for rule in RULES:
        fmt = P[name].replace(scale_rule=rule)
        for rounding in MODES:
            _check(x, fmt.replace(axis=-1), rounding, "rows")
            _check(x.t().contiguous(), fmt.replace(axis=0), rounding, "tiles")


@pytest.mark.parametrize("cols", [1, 31, 33, 32 * 5 + 7])
@pytest.mark.parametrize("name", ["mxfp8_e4m3", "mxfp4_e2m1", "mxint8"])
def test_partial_blocks_and_odd_lengths(name, cols):
    """The same values in rows of odd lengths: a partial last block in each row (and runs of
    fewer than 64 blocks); down columns, partial tiles."""
    flat = _inputs(name).reshape(-1)
    x = flat[: (flat.numel() // cols) * cols].reshape(-1, cols)
    for rule in RULES:
        fmt = P[name].replace(scale_rule=rule)
        for rounding in MODES:
            _check(x, fmt.replace(axis=-1), rounding, "rows")
            _check(x.t().contiguous(), fmt.replace(axis=0), rounding, "tiles")


@pytest.mark.parametrize("bs", [7, 16])
@pytest.mark.parametrize("name", ["mxfp8_e5m2", "mxint8"])
def test_other_block_sizes(name, bs):
    """Block sizes other than MX's 32 (the run's size known only at run time)."""
    x = _inputs(name, bs)
    for rule in RULES:
        fmt = P[name].replace(scale_rule=rule, block_size=bs)
        for rounding in MODES:
            _check(x, fmt.replace(axis=-1), rounding, "rows")
            _check(x.t().contiguous(), fmt.replace(axis=0), rounding, "tiles")


def test_in_place_and_out():
    """In place (the run reads all of its blocks' amaxes, then writes) and into out=."""
    fmt = P["mxfp8_e4m3"]
    x = _inputs("mxfp8_e4m3")
    want = reference.quantize(x, fmt)
    y = x.clone()
    ops.quantize_(y, fmt)
    assert_bits_equal(y, want, "in place")
    out = torch.empty_like(x)
    ops.quantize(x, fmt, out=out)
    assert_bits_equal(out, want, "out=")
    xt = x.t().contiguous()
    y = xt.clone()
    ops.quantize_(y, fmt.replace(axis=0))
    assert_bits_equal(y, reference.quantize(xt, fmt.replace(axis=0)), "in place, tiles")


@pytest.mark.parametrize("isa", ["base", "avx2"])
def test_other_isas(isa):
    """This file's float32 tests under QTENSOR_CPU_ISA=base|avx2 (the baseline and AVX2 copies
    of the loops; the process's own run takes the best the CPU has, AVX-512 here), in a
    subprocess."""
    assert_passes_under_isa(__file__, isa, "codes_times_scales or partial or in_place")
