"""Scale rules beside OCP's floor: even, ceil (= rceil), ceil on an E4M3 scale, and
Transformer Engine's NVFP4 4over6, against oracles written here in plain numpy / fractions
(torchao's bit formulas for FLOOR, EVEN and RCEIL; exact rationals for the rest), kernels and
reference alike, over every positive normal bf16 value as a block's max.
"""
from __future__ import annotations

from fractions import Fraction

import numpy as np
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
MODES = ("nearest", "nearest_away", "toward_zero", "stochastic")
SEED = 0x0DDB_A11_5EED


# ---------------------------------------------------------------------------------------------
# Oracles

def float_grid(exp: int, man: int, bias: int, top: float) -> np.ndarray:
    """Every non-negative value of an exp/man float with subnormals, up to ``top``."""
    vals = [m * 2.0 ** (1 - bias - man) for m in range(2 ** man)]  # zero and subnormals
    for e in range(1 - bias, 2 ** exp - bias):
        vals += [(1 + m / 2 ** man) * 2.0 ** e for m in range(2 ** man)]
    return np.array(sorted(v for v in vals if v <= top))


GRIDS = {  # the OCP element grids, written out (independent of qtensor.formats)
    "fp8_e4m3": (float_grid(4, 3, 7, 448.0), 8, 3),      # (grid, emax = floor(log2 max), mbits)
    "fp8_e5m2": (float_grid(5, 2, 15, 57344.0), 15, 2),
    "fp6_e2m3": (float_grid(2, 3, 1, 7.5), 2, 3),
    "fp6_e3m2": (float_grid(3, 2, 3, 28.0), 4, 2),
    "fp4_e2m1": (float_grid(2, 1, 1, 6.0), 2, 1),
    "int8": (np.arange(128) / 64.0, 0, 6),               # MXINT8: k / 64, |k| <= 127
}
ELEM_FORMATS = {"fp8_e4m3": P["fp8_e4m3"], "fp8_e5m2": P["fp8_e5m2"],
                "fp6_e2m3": P["fp6_e2m3"], "fp6_e3m2": P["fp6_e3m2"],
                "fp4_e2m1": P["fp4_e2m1"], "int8": FixedFormat(8, 6, symmetric=True)}
E4M3_VALUES = float_grid(4, 3, 7, 448.0)


def round_grid(v: np.ndarray, grid: np.ndarray) -> np.ndarray:
    """|v| to the nearest grid value (ties to the even code, saturating), sign kept."""
    a = np.minimum(np.abs(v), grid[-1])
    hi = np.clip(np.searchsorted(grid, a), 1, len(grid) - 1)
    lo = hi - 1
    dlo, dhi = a - grid[lo], grid[hi] - a
    pick = np.where(dlo < dhi, lo, np.where(dhi < dlo, hi, np.where(lo % 2 == 0, lo, hi)))
    return np.copysign(grid[pick], v)


def f32_bits(a: np.ndarray) -> np.ndarray:
    return a.astype(np.float32).view(np.int32).astype(np.int64)


def torchao_exponent(amax: np.ndarray, rule: str, emax: int, mbits: int, max_pos: float):
    """The unbiased E8M0 scale exponent as torchao's to_mx computes it (mx_tensor.py), for
    positive normal float32 amax: FLOOR, EVEN, CEIL from amax's bits, RCEIL from the float32
    descale amax * fl32(1 / max_pos) (_f32_to_e8m0_rceil)."""
    bits = f32_bits(amax)
    if rule == "rceil":
        d = (amax.astype(np.float32) * np.float32(1.0 / max_pos)).astype(np.float32)
        db = f32_bits(d)
        assert ((db >> 23) & 0xFF).min() > 0, "normal descales only"
        e = ((db >> 23) & 0xFF) + ((db & 0x7FFFFF) != 0) - 127
    else:
        if rule == "even":
            bits = (bits + (1 << (23 - mbits - 1))) & (0x1FF << 23)
        e = ((bits >> 23) & 0xFF) - 127
        if rule == "ceil":
            e = e + ((f32_bits(amax) & 0x7FFFFF) > 0)
        e = e - emax
    return np.clip(e, -127, 127)


def exact_exponent(a: Fraction, rule: str, emax: int, mbits: int, max_elem: Fraction) -> int:
    """The scale exponent by the rules' definitions, in exact rationals."""
    def floor_log2(q: Fraction) -> int:
        e = q.numerator.bit_length() - q.denominator.bit_length()
        return e if Fraction(2) ** e <= q else e - 1
    if rule == "floor":
        k = floor_log2(a) - emax
    elif rule == "even":  # a rounded half away from zero to mbits + 1 significant bits
        b = floor_log2(a)
        q = Fraction(2) ** (b - mbits)
        k = floor_log2((a / q + Fraction(1, 2)).__floor__() * q) - emax
    else:  # ceil: the smallest k with a / 2^k <= max_elem
        k = floor_log2(a / max_elem)
        if a / Fraction(2) ** k > max_elem:
            k += 1
    return max(-127, min(127, k))


def bf16_normal_maxima() -> np.ndarray:
    """Every positive normal bf16 value, and the float32 neighbours of the rules' boundaries."""
    codes = np.arange(0x0080, 0x7F80, dtype=np.int32) << 16
    return codes.view(np.float32).astype(np.float64)


def boundary_maxima(max_elem: float, mbits: int) -> np.ndarray:
    js = np.arange(-100, 100, dtype=np.float64)
    pts = np.concatenate([max_elem * 2.0 ** js, (2 - 2.0 ** -(mbits + 1)) * 2.0 ** js,
                          2.0 ** js])
    f = pts.astype(np.float32)
    return np.concatenate([f, np.nextafter(f, np.float32(np.inf)),
                           np.nextafter(f, np.float32(0))]).astype(np.float64)


FRACS = np.array([1.0, -0.37, 0.0113, -0.5])  # each block: amax, then smaller elements


def blocks_of(amax: np.ndarray) -> torch.Tensor:
    return torch.from_numpy((amax[:, None] * FRACS[None, :]).astype(np.float32))


# ---------------------------------------------------------------------------------------------
# E8M0 scales: floor, even, ceil/rceil

@pytest.mark.parametrize("rule", ["floor", "even", "ceil", "rceil"])
@pytest.mark.parametrize("elem", list(ELEM_FORMATS))
def test_pow2_rules_against_oracle(elem, rule):
    """Every positive normal bf16 value (and the float32 neighbours of each binade's decision
    points) as a block's max, E8M0 scales: torchao's bit formulas (FLOOR, EVEN, and RCEIL for
    ceil/rceil) for the OCP float elements, the exact definitions for MXINT8 (torchao has none)."""
    grid, emax, mbits = GRIDS[elem]
    fmt = BlockFormat(ELEM_FORMATS[elem], 4, scale=P["e8m0"], scale_rule=rule)
    assert fmt.scale_rule == ("ceil" if rule == "rceil" else rule)
    rule = fmt.scale_rule
    amax = np.concatenate([bf16_normal_maxima(), boundary_maxima(grid[-1], mbits)])
    amax = amax[(amax >= 2.0 ** -100) & (amax < 2.0 ** 120)]
    x = blocks_of(amax)
    a = x.double().numpy()[:, 0]
    if elem == "int8":
        k = np.array([exact_exponent(Fraction(float(v)), rule, emax, mbits, Fraction(grid[-1]))
                      for v in a])
    else:
        k = torchao_exponent(a, "rceil" if rule == "ceil" else rule, emax, mbits, grid[-1])
        if rule == "ceil":
            # torchao's float32 RCEIL is the exact rule here (normal descales) ...
            exact = [exact_exponent(Fraction(float(v)), "ceil", emax, mbits, Fraction(grid[-1]))
                     for v in a[::53]]
            assert (k[::53] == np.array(exact)).all()
            # ... and its CEIL, 2^(ceil(log2 amax) - emax), is another rule (max_elem is not a
            # power of two): one binade larger for amax / 2^j in (2^emax, max_elem]
            ceil_ta = torchao_exponent(a, "ceil", emax, mbits, grid[-1])
            assert ((ceil_ta == k) | (ceil_ta == k + 1)).all() and (ceil_ta != k).any()
    X = 2.0 ** k[:, None]
    x64 = x.double().numpy()
    want = torch.from_numpy((round_grid(x64 / X, grid) * X).astype(np.float32))
    for quantize in (qt.quantize, reference.quantize):
        assert_bits_equal(quantize(x, fmt), want, f"{fmt} {quantize.__module__}", inputs=x)


def test_even_rounds_a_near_binade_max_up():
    """torchao's EVEN: amax >= 1.9375 * 2^8 (E4M3, 3 mantissa bits) rounds to 2^9, so the scale
    is 2 and 496..511 round to 512 (floor: scale 1, the block max saturates to 448)."""
    even = BlockFormat(P["fp8_e4m3"], 2, scale_rule="even")
    floor = BlockFormat(P["fp8_e4m3"], 2, scale_rule="floor")
    for quantize in (qt.quantize, reference.quantize):
        for v in (496.0, 500.0, 511.0):
            x = torch.tensor([[v, 1.0]])
            assert quantize(x, even).tolist() == [[512.0, 1.0]]
            assert quantize(x, floor).tolist() == [[448.0, 1.0]]
        assert quantize(torch.tensor([[495.0, 1.0]]), even).tolist() == [[448.0, 1.0]]


def test_rules_string_form_round_trips():
    for f in [BlockFormat(P["fp8_e4m3"], 32, scale_rule="even"),
              BlockFormat(P["fp8_e4m3"], 32, scale_rule="rceil"),
              BlockFormat(P["fp4_e2m1"], 16, scale=P["fp8_e4m3"], scale_rule="ceil"),
              BlockFormat(P["fp4_e2m1"], 16, scale=P["fp8_e4m3"], scale_rule="ceil",
                          tensor_scale=True),
              BlockFormat(P["fp4_e2m1"], 16, scale=P["fp8_e4m3"], scale_rule="4over6"),
              BlockFormat(P["fp4_e2m1"], 16, scale=P["fp8_e4m3"], scale_rule="4over6",
                          tensor_scale=True, rounding="stochastic8")]:
        assert qt.format(str(f)) == f, str(f)
    assert qt.format("mxfp8_e4m3(scale_rule=rceil)") == qt.format("mxfp8_e4m3(scale_rule=ceil)")


def test_rules_that_have_no_meaning_are_refused():
    with pytest.raises(FormatError, match="exponent-only scale format"):
        BlockFormat(P["fp4_e2m1"], 16, scale=P["fp8_e4m3"], scale_rule="even")
    with pytest.raises(FormatError, match="exponent-only scale format"):
        BlockFormat(P["fp4_e2m1"], 16, scale=P["fp8_e4m3"], scale_rule="floor")
    with pytest.raises(FormatError, match="needs fp4_e2m1 elements"):
        BlockFormat(P["fp8_e4m3"], 16, scale=P["fp8_e4m3"], scale_rule="4over6")
    with pytest.raises(FormatError, match="cannot tell apart"):
        BlockFormat(P["fp4_e2m1"], 16, scale=P["e8m0"], scale_rule="4over6")
    with pytest.raises(FormatError, match="tensor_scale=True needs scales with significant"):
        BlockFormat(P["fp4_e2m1"], 16, scale_rule="ceil", tensor_scale=True)
    with pytest.raises(FormatError, match="unknown scale_rule 'round'.*rceil"):
        BlockFormat(P["fp4_e2m1"], 16, scale_rule="round")


# ---------------------------------------------------------------------------------------------
# E4M3 scales: ceil (rounded up) and 4over6

def e4m3_up(r: Fraction) -> Fraction:
    for v in E4M3_VALUES:
        if Fraction(v) >= r:
            return Fraction(v)
    return Fraction(448)  # the scale saturates


def e4m3_nearest(r: Fraction) -> Fraction:
    return Fraction(float(round_grid(np.array([float(r)]), E4M3_VALUES)[0])) \
        if Fraction(float(r)) == r else _e4m3_nearest_exact(r)


def _e4m3_nearest_exact(r: Fraction) -> Fraction:
    vals = [Fraction(v) for v in E4M3_VALUES]
    best = min(range(len(vals)), key=lambda i: (abs(vals[i] - r), i % 2))
    return vals[best]


def nvfp4_inputs(seed=0, rows=600):
    """16-element blocks with maxima over E4M3's normal scale range (no tensor scale)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 16, generator=g, dtype=torch.float64)
    x = x * torch.exp2(torch.randint(-5, 9, (rows, 1), generator=g).double())
    x[:40] = torch.round(x[:40] * 2) / 2  # blocks of few significant bits: ties, exact fits
    return x.float()


def settled_block(row: np.ndarray, scale_of):
    """The block rounded (e2m1, nearest) with X = scale_of(amax), then, as long as the scale of
    its rounded max is lower (idempotence, docs/formats.md), with that one: (q, X)."""
    grid = GRIDS["fp4_e2m1"][0]

    def rnd(X):
        return round_grid(row / X, grid) * X if X > 0 else np.copysign(0.0, row)
    X = scale_of(float(np.abs(row).max()))
    q = rnd(X)
    while scale_of(float(np.abs(q).max())) < X:
        X = scale_of(float(np.abs(q).max()))
        q = rnd(X)
    return q, X


def test_ceil_on_e4m3_scale_against_oracle():
    """X = the smallest E4M3 value >= amax / 6: the block max never saturates."""
    fmt = BlockFormat(P["fp4_e2m1"], 16, scale=P["fp8_e4m3"], scale_rule="ceil")
    x = nvfp4_inputs(1)
    want = [settled_block(row, lambda a: float(e4m3_up(Fraction(a) / 6)))[0]
            for row in x.double().numpy()]
    want = torch.from_numpy(np.array(want)).float()
    for quantize in (qt.quantize, reference.quantize):
        assert_bits_equal(quantize(x, fmt), want, f"ceil e4m3 {quantize.__module__}", inputs=x)
    # the block max never saturates (where X is an E4M3 normal: amax / 6 >= 2^-6)
    normal = x.abs().amax(1) >= 6 * 2.0 ** -6
    assert (qt.quantize(x, fmt).abs().amax(1) >= x.abs().amax(1))[normal].all()
    assert not (qt.quantize(x, "nvfp4_single").abs().amax(1) >= x.abs().amax(1))[normal].all()


def four_over_six_oracle(row: np.ndarray) -> np.ndarray:
    """TE's criterion in exact rationals: map-to-6 and map-to-4 scales (E4M3, nearest),
    e2m1 elements to nearest, the lower sum of |x - q| wins, 6 on a tie."""
    out = {}
    for t in (6, 4):  # each candidate settled (idempotence) on its own
        q, _ = settled_block(row, lambda a: float(_e4m3_nearest_exact(Fraction(a) / t)))
        out[t] = (q, sum(abs(Fraction(float(a)) - Fraction(float(b))) for a, b in zip(row, q)))
    return out[4][0] if out[4][1] < out[6][1] else out[6][0]


def test_4over6_against_oracle():
    fmt = BlockFormat(P["fp4_e2m1"], 16, scale=P["fp8_e4m3"], scale_rule="4over6")
    x = nvfp4_inputs(2)
    want = torch.from_numpy(np.array([four_over_six_oracle(r) for r in x.double().numpy()]))
    want = want.float()
    for quantize in (qt.quantize, reference.quantize):
        assert_bits_equal(quantize(x, fmt), want, f"4over6 {quantize.__module__}", inputs=x)
    single = qt.quantize(x, "nvfp4_single")
    picked4 = (want != single).any(1)
    assert 0.1 < float(picked4.double().mean()) < 0.9  # both candidates occur
    assert float((qt.quantize(x, fmt) - x).abs().sum()) < float((single - x).abs().sum())


def test_4over6_tie_takes_6_and_exact_blocks_stay():
    fmt = BlockFormat(P["fp4_e2m1"], 16, scale=P["fp8_e4m3"], scale_rule="4over6")
    exact6 = torch.tensor([[6.0, 3.0, 1.5, 0.5] + [0.0] * 12])  # on both grids: tie, map to 6
    assert_bits_equal(qt.quantize(exact6, fmt), exact6, "exact")
    four = torch.tensor([[4.0, 3.0, 1.0, 0.5] + [0.0] * 12])   # X4 = 1 fits it exactly
    assert_bits_equal(qt.quantize(four, fmt), four, "map to 4")
    assert not torch.equal(qt.quantize(four, "nvfp4_single"), four)


def test_4over6_tensor_scale_bound_256():
    """With a tensor scale, the tensor's amax maps to 6 * 256 (TE's 4over6 E4M3 bound), so the
    map-to-4 scale of its block (384) does not saturate at 448."""
    fmt = BlockFormat(P["fp4_e2m1"], 16, scale=P["fp8_e4m3"], scale_rule="4over6",
                      tensor_scale=True)
    assert fmt.tensor_scale_bound == 256.0
    x = torch.tensor([[4.0, 3.0, 1.0, 0.5] + [0.0] * 12]) * 384  # tensor scale 1536 / 1536
    assert_bits_equal(qt.quantize(x, fmt), x, "kernel")
    assert_bits_equal(reference.quantize(x, fmt), x, "reference")
    # (with the NVFP4 bound 448 the map-to-4 scale 672 would saturate: no exact fit)
    assert not torch.equal(qt.quantize(x, qt.nvfp4), x)


# ---------------------------------------------------------------------------------------------
# Kernels = reference, every mode, layouts, dtypes

NEW_BLOCKS = [
    BlockFormat(P["fp8_e4m3"], 32, scale_rule="even"),
    BlockFormat(P["fp4_e2m1"], 16, scale_rule="even", axis=0),
    BlockFormat(FixedFormat(8, 6, symmetric=True), 8, scale_rule="even"),
    BlockFormat(FixedFormat(5, 3, signed=False), 5, scale_rule="even"),
    BlockFormat(P["fp6_e3m2"], None, axis=None, scale_rule="even"),
    BlockFormat(P["fp4_e2m1"], 16, scale=P["fp8_e4m3"], scale_rule="ceil"),
    BlockFormat(P["fp4_e2m1"], 16, scale=P["fp8_e4m3"], scale_rule="ceil", tensor_scale=True),
    BlockFormat(P["fp6_e2m3"], 7, axis=0, scale=P["bf16"], scale_rule="ceil"),
    BlockFormat(P["fp4_e2m1"], 16, scale=P["fp8_e4m3"], scale_rule="4over6"),
    BlockFormat(P["fp4_e2m1"], 16, scale=P["fp8_e4m3"], scale_rule="4over6", tensor_scale=True),
    BlockFormat(P["fp4_e2m1"], 5, axis=0, scale=P["fp8_e4m3"], scale_rule="4over6"),
    BlockFormat(P["fp4_e2m1"], None, axis=None, scale=P["fp8_e4m3"], scale_rule="4over6"),
]


def wide_inputs(rows=24, cols=48, seed=3):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g, dtype=torch.float64)
    x = x * torch.exp2(torch.randint(-140, 100, (rows, 1), generator=g).double())
    x[0, :5] = torch.tensor([0.0, -0.0, 496.0, 495.0, 480.0])
    x[1, 3] = float("nan")
    x[2] = 0.0
    x[3] = torch.round(x[3] * 4) / 4 * 0 + torch.arange(cols) % 7 - 3.0
    return x.float()


@pytest.mark.skipif(not ops.kernels_available("cpu"), reason="qtensor._C not built")
@pytest.mark.parametrize("fmt", NEW_BLOCKS, ids=str)
def test_kernels_match_reference(fmt):
    x = wide_inputs()
    for rounding in MODES + ("stochastic8",):
        got = ops.quantize_with_seed(x, fmt, rounding, SEED)
        want = reference.quantize_with_seed(x, fmt, rounding, SEED)
        assert_bits_equal(got, want, f"{fmt} {rounding}", inputs=x)
    for dtype in (torch.bfloat16, torch.float16):
        xd = x.to(dtype)
        assert_bits_equal(ops.quantize_with_seed(xd, fmt, "nearest", SEED),
                          reference.quantize_with_seed(xd, fmt, "nearest", SEED), f"{dtype}")
    xt = x.t()  # strided input: blocks along a non-contiguous axis
    for rounding in ("nearest", "stochastic"):
        assert_bits_equal(ops.quantize_with_seed(xt, fmt, rounding, SEED),
                          reference.quantize_with_seed(xt, fmt, rounding, SEED), "strided")
    y = x.clone()  # in place
    qt.quantize_(y, fmt)
    assert_bits_equal(y, reference.quantize(x, fmt), "in place")


# ---------------------------------------------------------------------------------------------
# Presets: mxfp8_pretraining (arXiv 2506.08027) and nvfp4_4over6 (Transformer Engine)

def test_preset_mxfp8_pretraining():
    r = qt.recipes.mxfp8_pretraining
    mx = BlockFormat(P["fp8_e4m3"], 32, scale=P["e8m0"], scale_rule="ceil")
    assert r.weight == qt.Role(P["fp32"], mx)
    assert r.activation == qt.Role(P["bf16"], mx) == r.grad  # E4M3 for gradients too
    assert r.master_weights and r.bias == qt.Role(P["fp32"])
    assert mx.rounding == "nearest" and mx.scale_rule == "ceil"
    assert "2506.08027" in r.source and "mxfp8_pretraining" in qt.recipes.describe(False)
    # the paper's point: the scale rounded up keeps a block max that floor saturates
    x = torch.tensor([[480.0] + [1.0] * 31])
    assert qt.quantize(x, mx)[0, 0] == 480.0
    assert qt.quantize(x, "mxfp8_e4m3")[0, 0] == 448.0


def test_preset_nvfp4_4over6():
    r = qt.recipes.nvfp4_4over6
    f46 = BlockFormat(P["fp4_e2m1"], 16, scale=P["fp8_e4m3"], scale_rule="4over6",
                      tensor_scale=True)
    assert r.weight == qt.Role(P["fp32"], f46)
    assert r.activation == qt.Role(P["bf16"], f46)
    assert r.grad == qt.Role(P["bf16"], P["nvfp4"].replace(rounding="stochastic"))
    assert f46.rounding == "nearest" and r.master_weights
    assert "4over6" in r.source and "nvfp4_4over6" in qt.recipes.describe(False)
    for role in ("weight", "activation", "grad"):
        f = getattr(r, role).mm_fmt
        assert qt.format(str(f)) == f


@pytest.mark.parametrize("name", ["mxfp8_pretraining", "nvfp4_4over6"])
def test_presets_round_the_forward_operands(name):
    """A converted Linear's forward product takes x and W rounded to the preset's operand format
    along the reduction dim (checked against the product of the rounded operands), and a
    training step runs."""
    r = getattr(qt.recipes, name)
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 8, bias=False)
    w = lin.weight.detach().clone()
    x = torch.randn(4, 64)
    want = x_q = qt.quantize(x.to(torch.bfloat16).float(), r.activation.mm_fmt)
    want = torch.nn.functional.linear(x_q, qt.quantize(w, r.weight.mm_fmt))
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    qt.convert(lin, r)
    out = lin(x)
    got = out.dequantize() if isinstance(out, qt.QTensor) else out
    torch.testing.assert_close(got.float(), want.to(torch.bfloat16).float(), rtol=1e-2,
                               atol=1e-3)
    got.sum().backward() if got.requires_grad else out.sum().backward()
    opt.step()
