"""The numerical contract (qtensor/kernels/reference.py, formats.py), checked against independent oracles.

Every test runs both ``qt.quantize`` (which may use compiled kernels) and
``qtensor.kernels.reference.quantize`` (the ``quantize`` fixture of conftest.py). The oracles are
hand-written decoders and exact rational arithmetic (tests/oracles.py), torch's own casts,
ml_dtypes and gfloat, never qtensor.kernels.reference itself.
"""
from __future__ import annotations

import functools
import math
import random
from fractions import Fraction

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import qtensor as qt
from qtensor.kernels import ops, reference
from qtensor.formats.fixed import FixedFormat
from qtensor.formats.float import FloatFormat
from qtensor.formats.block import BlockFormat
from qtensor.formats.base import FormatError

import oracles
from helpers import as_bits, assert_bits_equal, twos_complement_blocks

MODES = ["nearest", "nearest_away", "toward_zero", "stochastic"]
DETERMINISTIC = ["nearest", "nearest_away", "toward_zero"]
F32 = torch.float32


def t32(values):
    return torch.tensor(values, dtype=torch.float64).to(F32)


def oracle_tensor(x: torch.Tensor, fmt, mode) -> torch.Tensor:
    """The scalar oracle applied to every element (deterministic modes), in x's dtype."""
    out = [oracles.round_scalar(v, fmt, mode) for v in x.reshape(-1).tolist()]
    return torch.tensor(out, dtype=torch.float64).reshape(x.shape).to(x.dtype)


def assert_in_candidates(q: torch.Tensor, x: torch.Tensor, fmt, where=""):
    """Each stochastic result is one of the oracle's two candidates (bits, NaN by position)."""
    for xi, qi in zip(x.reshape(-1).tolist(), q.reshape(-1).tolist()):
        c = oracles.round_scalar(xi, fmt, "stochastic")
        cands = c if isinstance(c, tuple) else (c,)
        ok = any((math.isnan(qi) and math.isnan(ci)) or
                 (qi == ci and math.copysign(1, qi) == math.copysign(1, ci)) for ci in cands)
        assert ok, f"{where} {fmt} stochastic: x={xi!r} gave {qi!r}, expected one of {cands}"


# ---------------------------------------------------------------------------------------------
# Every code of every format of 8 bits or fewer

SMALL_FLOATS = {
    "fp8_e4m3": qt.fp8_e4m3,
    "fp8_e5m2": qt.fp8_e5m2,
    "fp6_e3m2": qt.fp6_e3m2,
    "fp6_e2m3": qt.fp6_e2m3,
    "fp4_e2m1": qt.fp4_e2m1,
    "e8m0": qt.e8m0,
    "e3m4": FloatFormat(3, 4),
    "e2m2_nosub": FloatFormat(2, 2, subnormals=False, specials="none"),
    "e4m3_ieee": FloatFormat(4, 3),
    "e5m2_fn_sat": FloatFormat(5, 2, specials="fn", saturate=True),
    "e3m0_none": FloatFormat(3, 0, specials="none"),
    "e4m2_bias3": FloatFormat(4, 2, bias=3, specials="none"),
}
SMALL_FIXED = {
    "fixed8.4": FixedFormat(8, 4),
    "fixed4.1_unsigned": FixedFormat(4, 1, signed=False),
    "fixed6.2_symmetric": FixedFormat(6, 2, symmetric=True),
    "fixed5.-1": FixedFormat(5, -1),
}


def _grid(fmt):
    """[(signed value, code)] of the finite values, sorted, one entry per value (+0 for 0)."""
    if isinstance(fmt, FixedFormat):
        kmin, kmax = oracles.fixed_range(fmt)
        return [(k * 2.0 ** -fmt.fl, k) for k in range(kmin, kmax + 1)]
    seen = {}
    for code, v in oracles.float_codes(fmt):
        if math.isfinite(v) and (v not in seen or math.copysign(1, v) > 0):
            seen[v] = code
    return sorted(seen.items())


def _tie_goes_up(fmt, lo, c_lo, hi, c_hi) -> bool:
    """Which neighbour (by magnitude) a tie rounds to under ties-to-even, from the codes."""
    if isinstance(fmt, FixedFormat):
        return c_hi % 2 == 0 if abs(hi) > abs(lo) else c_lo % 2 == 0
    if min(abs(lo), abs(hi)) == 0:
        # 0 and the smallest positive value: 0 is even (for a format without subnormals, or with
        # man = 0, both codes are even, and 0 = 0 x spacing is the even multiple)
        return False
    if fmt.man == 0:
        # both significands are "1": the upper power of two is the even multiple of the spacing
        # (ml_dtypes and torch round E8M0 ties up too)
        return True
    small, big = (c_lo, c_hi) if abs(hi) > abs(lo) else (c_hi, c_lo)
    assert (small % 2) != (big % 2), (fmt, lo, hi)
    return big % 2 == 0


def _code_cases(fmt):
    """(points, expected per deterministic mode, (lo, hi) magnitudes, up-probability) for every
    pair of neighbours: the points 1/4, 1/2 and 3/4 of the way between them."""
    grid = _grid(fmt)
    xs, exp, pairs, p_up = [], {m: [] for m in DETERMINISTIC}, [], []
    for (lo, c_lo), (hi, c_hi) in zip(grid, grid[1:]):
        small, big = (lo, hi) if abs(hi) > abs(lo) else (hi, lo)
        for t in (0.25, 0.5, 0.75):
            x = float(Fraction(lo) + (Fraction(hi) - Fraction(lo)) * Fraction(t))
            assert float(np.float32(x)) == x  # the point is a float32 exactly
            f_up = abs(Fraction(x) - Fraction(small)) / abs(Fraction(big) - Fraction(small))
            if f_up == Fraction(1, 2):
                near = big if _tie_goes_up(fmt, lo, c_lo, hi, c_hi) else small
                away = big
            else:
                near = away = big if f_up > Fraction(1, 2) else small
            # a zero result keeps the sign of x (fixed point has no negative zero)
            zero = 0.0 if isinstance(fmt, FixedFormat) else math.copysign(0.0, x)
            fix = lambda v: zero if v == 0 else v  # noqa: E731
            xs.append(x)
            exp["nearest"].append(fix(near))
            exp["nearest_away"].append(fix(away))
            exp["toward_zero"].append(fix(small))
            pairs.append((fix(small), fix(big)))
            p_up.append(float(f_up))
    return xs, exp, pairs, p_up


SMALL_ALL = {**SMALL_FLOATS, **SMALL_FIXED}


@pytest.mark.parametrize("name", list(SMALL_ALL))
def test_every_code_is_kept(quantize, name):
    """Each code's value (decoded independently) quantizes to itself, in every mode; specials per
    The contract: NaN stays NaN, Inf stays Inf when not saturating, else becomes +-max."""
    fmt = SMALL_ALL[name]
    if isinstance(fmt, FixedFormat):
        values = [v for v, _ in _grid(fmt)]
        expected = values
    else:
        values, expected = [], []
        mx = max(v for _, v in oracles.float_codes(fmt) if math.isfinite(v))
        for _, v in oracles.float_codes(fmt):
            values.append(v)
            if math.isinf(v) and fmt.saturate:
                expected.append(math.copysign(mx, v))
            else:
                expected.append(v)
    x, e = t32(values), t32(expected)
    for mode in MODES:
        assert_bits_equal(quantize(x, fmt, rounding=mode), e, f"{name} {mode}", inputs=x)


@pytest.mark.parametrize("name", list(SMALL_ALL))
@pytest.mark.parametrize("mode", DETERMINISTIC)
def test_between_neighbours(quantize, name, mode):
    """Points 1/4, 1/2, 3/4 between every pair of neighbouring codes: nearest sends ties to the
    even code, nearest_away to the larger magnitude, toward_zero to the smaller one."""
    fmt = SMALL_ALL[name]
    xs, exp, _, _ = _code_cases(fmt)
    x = t32(xs)
    assert_bits_equal(quantize(x, fmt, rounding=mode), t32(exp[mode]), f"{name} {mode}", inputs=x)


@pytest.mark.parametrize("name", list(SMALL_ALL))
def test_between_neighbours_stochastic(quantize, name):
    """Stochastic rounding gives one of the two neighbours, the upper one with probability equal
    to the distance from the lower one (over 1000 draws: within 5 standard errors)."""
    fmt = SMALL_ALL[name]
    xs, _, pairs, p_up = _code_cases(fmt)
    draws = 1000
    x = t32(xs).unsqueeze(1).expand(-1, draws).contiguous()
    # a fixed seed: thousands of rows at 5 standard errors would otherwise fail ~1% of runs
    q = quantize(x, fmt, rounding="stochastic",
                 generator=torch.Generator().manual_seed(len(name))).double()
    small = torch.tensor([p[0] for p in pairs], dtype=torch.float64).unsqueeze(1)
    big = torch.tensor([p[1] for p in pairs], dtype=torch.float64).unsqueeze(1)
    assert bool(((q == small) | (q == big)).all()), f"{name}: a result is not a neighbour"
    frac_up = (q == big).double().mean(1)
    p = torch.tensor(p_up, dtype=torch.float64)
    tol = 5 * torch.sqrt(p * (1 - p) / draws)
    bad = (frac_up - p).abs() > tol
    assert not bool(bad.any()), (
        f"{name}: up-fractions {frac_up[bad][:5].tolist()} for p={p[bad][:5].tolist()} "
        f"at x={x[:, 0][bad][:5].tolist()}")


@pytest.mark.parametrize("name", list(SMALL_FLOATS))
def test_beyond_max(quantize, name):
    """Overflow per the contract: the extended grid past max, then +-max (saturating) or +-Inf
    ("ieee") or NaN ("fn"); toward_zero gives +-max for finite values."""
    fmt = SMALL_FLOATS[name]
    _, emax, mx, _ = oracles.float_limits(fmt)
    mx = float(mx)
    step = 2.0 ** (emax - fmt.man)  # the spacing of max's binade
    over = float("nan") if fmt.specials == "fn" and not fmt.saturate else (
        mx if fmt.saturate else float("inf"))
    # a tie between max and the next point of the extended grid goes to the even one: up for
    # "ieee"/"none" (max's mantissa is all ones, odd), down for "fn" (max ends in ...10).
    tie_up = fmt.specials != "fn" or fmt.man == 0
    pts = [mx + step / 4, mx + step / 2, mx + 3 * step / 4, mx * 4, float("inf")]
    exp_near = [mx, over if tie_up else mx, over, over, over]
    signs = [1.0] if not fmt.signed else [1.0, -1.0]
    for s in signs:
        x = t32([s * p for p in pts])
        e = t32([s * v if not math.isnan(v) else v for v in exp_near])
        assert_bits_equal(quantize(x, fmt), e, f"{name} nearest", inputs=x)
        # from the tie up, nearest_away rounds past max: overflow
        away = t32([s * over if not math.isnan(over) else over] * 4)
        assert_bits_equal(quantize(x[1:], fmt, rounding="nearest_away"), away,
                          f"{name} nearest_away", inputs=x[1:])
        # toward_zero: +-max for every finite x (mx * 4 may be Inf in float32: overflow value)
        tz = [math.copysign(mx, v) if math.isfinite(v) else
              (over if math.isnan(over) else math.copysign(over, v)) for v in x.tolist()]
        assert_bits_equal(quantize(x, fmt, rounding="toward_zero"), t32(tz),
                          f"{name} toward_zero", inputs=x)


def test_toward_zero_overflow_gives_max(quantize):
    """The contract (IEEE 754 roundTowardZero): a finite value beyond max gives +-max in every
    format, also where overflow is otherwise Inf ("ieee") or NaN ("fn"); an Inf input follows the
    format's overflow rule (Inf, NaN, or max when saturating). Before: fp16 gave Inf for 70000."""
    inf, nan = float("inf"), float("nan")
    x = t32([70000.0, -70000.0, inf, -1e30, 65519.0, -inf, 3e38])
    assert_bits_equal(quantize(x, qt.fp16, rounding="toward_zero"),
                      t32([65504.0, -65504.0, inf, -65504.0, 65504.0, -inf, 65504.0]), "fp16", x)
    fn = FloatFormat(4, 3, specials="fn")  # not saturating: overflow is NaN, except toward_zero
    x = t32([470.0, 1000.0, -1000.0, 450.0, inf, -inf, nan])
    assert_bits_equal(quantize(x, fn, rounding="toward_zero"),
                      t32([448.0, 448.0, -448.0, 448.0, nan, nan, nan]), "e4m3 fn", x)
    x = t32([65536.0, -1e9, inf])
    assert_bits_equal(quantize(x, qt.fp8_e5m2, rounding="toward_zero"),
                      t32([57344.0, -57344.0, inf]), "e5m2", x)
    # the other modes still overflow to Inf (nearest) as before
    assert_bits_equal(quantize(t32([70000.0]), qt.fp16), t32([inf]), "fp16 nearest")
    # float16 and float64 inputs: fp16 -> e5m2, and float64 beyond float32's range -> fp32, e8m0
    h = torch.tensor([65504.0, -65504.0], dtype=torch.float16)
    assert_bits_equal(quantize(h, qt.fp8_e5m2, rounding="toward_zero"),
                      torch.tensor([57344.0, -57344.0], dtype=torch.float16), "fp16 input")
    d = torch.tensor([1e300, -1e300, inf], dtype=torch.float64)
    fmax = torch.finfo(F32).max
    assert_bits_equal(quantize(d, qt.fp32, rounding="toward_zero"),
                      torch.tensor([fmax, -fmax, inf], dtype=torch.float64), "fp32 float64")
    assert_bits_equal(quantize(d[:1], qt.e8m0, rounding="toward_zero"),
                      torch.tensor([2.0 ** 127], dtype=torch.float64), "e8m0 float64")


def test_toward_zero_overflow_in_qtensor_ops():
    """A QTensor op whose result overflows under its format's toward_zero rounding gives max."""
    fmt = qt.fp16.replace(rounding="toward_zero")
    a = qt.as_qtensor(torch.tensor([60000.0, -60000.0, 1.0]), fmt)
    for y, third in ((a * 2, 2.0), (a + a, 2.0), (torch.mul(a, 3.0), 3.0)):
        assert isinstance(y, qt.QTensor) and y.fmt == fmt
        assert_bits_equal(y.dequantize(), t32([65504.0, -65504.0, third]), "op overflow")


def _negative_zeros(t: torch.Tensor) -> int:
    t = t.detach().float().reshape(-1)
    return int(((t == 0) & torch.signbit(t)).sum())


@pytest.mark.parametrize("fmt", ["fixed8.4", FixedFormat(8, 4, saturate=False),
                                 FixedFormat(8, 4, symmetric=True), FixedFormat(4, 1, signed=False),
                                 FixedFormat(16, 0), FixedFormat(12, 3, saturate=False)], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_fixed_point_has_no_negative_zero(quantize, fmt, dtype):
    """The contract: fixed point has no negative-zero code; a value that rounds to zero is +0.0
    (the bits of 0.0), in every rounding mode and for -0.0 itself. Before: -0.0."""
    x = torch.tensor([-1e-9, -0.0, -0.01, 0.0, -0.03, -1e-30], dtype=dtype)
    for mode in MODES:
        q = quantize(x, fmt, rounding=mode)
        assert _negative_zeros(q) == 0, f"{fmt} {mode} {dtype}: {q.tolist()}"
    q = quantize(x.to(F32), fmt, rounding="nearest")
    assert q[:2].view(torch.int32).tolist() == [0, 0]


@pytest.mark.parametrize("fmt", [
    "mxint8", BlockFormat(FixedFormat(8, 6, symmetric=True), 8, scale=qt.fp8_e4m3,
                          scale_rule="amax"),
    BlockFormat(FixedFormat(4, 2, symmetric=True), None, axis=None),
    BlockFormat(FixedFormat(6, 4, signed=False), 5)], ids=str)
def test_integer_block_elements_have_no_negative_zero(quantize, fmt):
    """Integer block elements (MXINT8's) have no negative zero either: an all-zero block, an
    element that rounds to zero next to a large one, and a block whose amax-rule scale is 0."""
    x = t32([-0.0] * 32 + [-1e-9, 1.0, -0.001, -0.0] + [0.0] * 28 + [-1e-30, -0.0] + [0.0] * 30)
    for mode in MODES:
        q = quantize(x, fmt, rounding=mode)
        assert _negative_zeros(q) == 0, f"{fmt} {mode}: {q.tolist()}"
    q = quantize(x, fmt)
    assert bool(q[:32].view(torch.int32).eq(0).all()) and q[32].view(torch.int32).item() == 0


def test_converted_model_fixed_point_output_has_no_negative_zero():
    """A model converted to fixed point: outputs that round to zero from below are +0.0."""
    model = torch.nn.Linear(2, 4)
    with torch.no_grad():  # weights and inputs on the fixed8.4 grid; products below 2^-5
        model.weight.copy_(torch.tensor([[-0.0625, 0.0], [-0.125, 0.0], [0.5, 0.0],
                                         [-0.0625, 0.0625]]))
        model.bias.zero_()
    qt.convert(model, qt.format("fixed8.4"))
    y = model(torch.tensor([[0.25, 0.125]]))
    assert isinstance(y, qt.QTensor)
    assert y.dequantize().view(torch.int32).tolist() == [[0, 0, 0x3E000000, 0]]  # 0.125


# ---------------------------------------------------------------------------------------------
# Bit-exact against torch casts, ml_dtypes and bf16/fp16 casts, on a million values

N_BIG = 1_000_000


@functools.lru_cache(maxsize=None)
def _sample_for(fmt_name, seed, n=N_BIG):
    f = qt.format(fmt_name)
    emin, emax, _, _ = oracles.float_limits(f)
    return oracles.sample_float32(n, emin, emax, f.man, seed=seed)


def _torch_cast(dtype):
    return lambda x: x.to(dtype).to(x.dtype)


def _ml_cast(dtype):
    return lambda x: torch.from_numpy(x.numpy().astype(dtype).astype(np.float32))


# (format, oracle, which values to compare, what the oracle does differently from the contract)
CAST_ORACLES = {
    # torch >= 2.12 saturates e4m3fn casts to +-448 (Inf too), exactly qtensor's fp8_e4m3.
    "torch.float8_e4m3fn": ("fp8_e4m3", _torch_cast(torch.float8_e4m3fn), "all"),
    # torch's e5m2 overflows to +-Inf, exactly qtensor's non-saturating "ieee" fp8_e5m2.
    "torch.float8_e5m2": ("fp8_e5m2", _torch_cast(torch.float8_e5m2), "all"),
    "torch.bfloat16": ("bf16", _torch_cast(torch.bfloat16), "all"),
    "torch.float16": ("fp16", _torch_cast(torch.float16), "all"),
    # ml_dtypes' e4m3fn turns overflow (and Inf) into NaN; qtensor saturates: compare only
    # values whose magnitude rounds to at most 448 (checked separately in test_cast_out_of_range).
    "ml_dtypes.float8_e4m3fn": ("fp8_e4m3", _ml_cast(ml_dtypes.float8_e4m3fn), "in_range"),
    "ml_dtypes.float8_e5m2": ("fp8_e5m2", _ml_cast(ml_dtypes.float8_e5m2), "all"),
    # ml_dtypes' fp6/fp4 saturate like qtensor but turn NaN into -0: NaN compared separately.
    "ml_dtypes.float6_e3m2fn": ("fp6_e3m2", _ml_cast(ml_dtypes.float6_e3m2fn), "not_nan"),
    "ml_dtypes.float6_e2m3fn": ("fp6_e2m3", _ml_cast(ml_dtypes.float6_e2m3fn), "not_nan"),
    "ml_dtypes.float4_e2m1fn": ("fp4_e2m1", _ml_cast(ml_dtypes.float4_e2m1fn), "not_nan"),
    # e8m0fnu: compare positive values from 2^-126 to 2^127. ml_dtypes (and torch's
    # float8_e8m0fnu) round float32 subnormal inputs in (2^-127, 2^-126) up to 2^-126 even when
    # 2^-127 is nearer (e.g. 1.1 * 2^-127); qtensor rounds to nearest: checked in
    # test_cast_out_of_range.
    "ml_dtypes.float8_e8m0fnu": ("e8m0", _ml_cast(ml_dtypes.float8_e8m0fnu), "e8m0_range"),
}


@functools.lru_cache(maxsize=None)
def _cast_case(oracle):
    """(inputs, the oracle's answers), computed once for both quantizers."""
    fmt_name, cast, which = CAST_ORACLES[oracle]
    x = _sample_for(fmt_name, seed=len(oracle))
    mx = qt.format(fmt_name).max
    if which == "in_range":
        # |x| < max + half a spacing rounds to at most max (the tie max + 16 rounds to 448 too)
        keep = x.abs() <= mx + 16
    elif which == "not_nan":
        keep = ~torch.isnan(x)
    elif which == "e8m0_range":
        keep = (x >= 2.0 ** -126) & (x <= 2.0 ** 127)
    else:
        keep = torch.ones_like(x, dtype=torch.bool)
    x = x[keep]
    assert x.numel() > N_BIG * 0.4, "too few values left to compare"
    with np.errstate(all="ignore"):
        return x, cast(x)


@pytest.mark.parametrize("oracle", list(CAST_ORACLES))
def test_bit_exact_vs_casts(quantize, oracle):
    x, expected = _cast_case(oracle)
    assert_bits_equal(quantize(x, CAST_ORACLES[oracle][0]), expected, oracle, inputs=x)


def test_cast_out_of_range(quantize):
    """Where the oracles above were not compared: the contract's answers."""
    x = t32([464.0, 500.0, 1e30, float("inf"), -464.0, -1e30, float("-inf"), float("nan")])
    assert_bits_equal(quantize(x, "fp8_e4m3"),
                      t32([448, 448, 448, 448, -448, -448, -448, float("nan")]), "e4m3 saturates")
    for name, mx in [("fp6_e3m2", 28.0), ("fp6_e2m3", 7.5), ("fp4_e2m1", 6.0)]:
        assert_bits_equal(quantize(x, name),
                          t32([mx, mx, mx, mx, -mx, -mx, -mx, float("nan")]), name)
    z = t32([0.0, -0.0, -1.0, float("-inf"), float("nan"), 2.0 ** 128 * 0.99, 2.0 ** -140,
             1.1 * 2.0 ** -127, 1.6 * 2.0 ** -127, 1.5 * 2.0 ** -127])
    assert_bits_equal(quantize(z, "e8m0"),
                      t32([float("nan")] * 5 + [float("nan"), 2.0 ** -127, 2.0 ** -127,
                                                2.0 ** -126, 2.0 ** -126]), "e8m0 edges")


@pytest.mark.parametrize("fmt_name,dtype", [
    ("fp8_e4m3", torch.float8_e4m3fn), ("fp8_e5m2", torch.float8_e5m2),
    ("bf16", torch.bfloat16), ("fp16", torch.float16)])
@pytest.mark.parametrize("in_dtype", [torch.float16, torch.bfloat16])
def test_half_inputs_vs_casts(quantize, fmt_name, dtype, in_dtype):
    """float16/bfloat16 inputs: the result is in the input's dtype and equals one rounding of the
    input (the direct cast of the exact float32 value), then the exact cast back."""
    x = _sample_for(fmt_name, 7, 200_000).to(in_dtype)  # float32 -> half: a valid input
    q = quantize(x, fmt_name)
    assert q.dtype == in_dtype
    expected = x.float().to(dtype).float().to(in_dtype)
    assert_bits_equal(q, expected, f"{in_dtype} -> {fmt_name}", inputs=x)


# ---------------------------------------------------------------------------------------------
# The exact Fraction oracle on custom formats and all rounding modes

CUSTOM_FLOATS = [
    FloatFormat(3, 4), FloatFormat(4, 3, specials="fn", saturate=True), FloatFormat(5, 2),
    FloatFormat(2, 1, specials="none"), FloatFormat(6, 5, bias=40), FloatFormat(8, 7),
    FloatFormat(8, 10), FloatFormat(5, 10), FloatFormat(8, 23), FloatFormat(4, 0),
    FloatFormat(3, 3, subnormals=False, specials="none"), FloatFormat(5, 4, saturate=True),
    FloatFormat(4, 5, specials="fn"), FloatFormat(7, 12, subnormals=False), qt.e8m0,
    FloatFormat(8, 3, bias=128, specials="none"),
]
CUSTOM_FIXED = [
    FixedFormat(8, 4), FixedFormat(4, 1, signed=False), FixedFormat(6, 2, symmetric=True),
    FixedFormat(12, 10), FixedFormat(16, 0, saturate=False), FixedFormat(5, 3, signed=False,
                                                                         saturate=False),
    FixedFormat(3, -2), FixedFormat(24, 30), FixedFormat(8, 6, saturate=False),
]


def _custom_inputs(fmt, n, seed):
    if isinstance(fmt, FixedFormat):
        emin, emax, man = -fmt.fl, fmt.wl - fmt.fl, fmt.wl
    else:
        emin, emax, _, _ = oracles.float_limits(fmt)
        man = fmt.man
    return oracles.sample_float32(n, emin, emax, man, seed=seed)


@functools.lru_cache(maxsize=None)
def _oracle_case(fmt, x_key, mode):
    return oracle_tensor(_CASE_INPUTS[x_key], fmt, mode)


_CASE_INPUTS = {}


@pytest.mark.parametrize("fmt", CUSTOM_FLOATS + CUSTOM_FIXED, ids=str)
def test_fraction_oracle(quantize, fmt):
    key = ("custom", fmt)
    if key not in _CASE_INPUTS:
        _CASE_INPUTS[key] = _custom_inputs(fmt, 1500, seed=len(str(fmt)))
    x = _CASE_INPUTS[key]
    for mode in DETERMINISTIC:
        assert_bits_equal(quantize(x, fmt, rounding=mode), _oracle_case(fmt, key, mode),
                          f"{fmt} {mode}", inputs=x)
    assert_in_candidates(quantize(x, fmt, rounding="stochastic"), x, fmt)


@pytest.mark.parametrize("fmt_name", ["fp8_e4m3", "fp8_e5m2", "fp4_e2m1", "bf16", "fp16",
                                      "tf32", "fp32", "e8m0"])
def test_float64_inputs_exact(quantize, fmt_name):
    """float64 inputs are rounded once, correctly (no detour through float32): values within a
    hair of the target's ties, which a float32 detour would move onto the tie."""
    fmt = qt.format(fmt_name)
    rng = random.Random(fmt_name)
    emin, emax, _, _ = oracles.float_limits(fmt)
    xs = [0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1e300, -1e-300, 2.0 ** -1074]
    for _ in range(1500):
        e = rng.randint(max(emin - fmt.man - 2, -1020), min(emax + 2, 1020))
        k = rng.randint(0, 2 ** (fmt.man + 1) - 1)
        tie = (2 ** (fmt.man + 1) + 2 * k + 1) * 2.0 ** (e - fmt.man - 1)  # a tie in binade e
        hair = tie * 2.0 ** -rng.randint(30, 52) * rng.choice([-1, 1])
        xs.append(rng.choice([1, -1]) * (tie + hair if rng.random() < 0.8 else tie))
        xs.append(rng.choice([1, -1]) * rng.random() * 2.0 ** e)
    key = ("float64", fmt_name)
    _CASE_INPUTS.setdefault(key, torch.tensor(xs, dtype=torch.float64))
    x = _CASE_INPUTS[key]
    for mode in DETERMINISTIC:
        q = quantize(x, fmt, rounding=mode)
        assert q.dtype == torch.float64
        assert_bits_equal(q, _oracle_case(fmt, key, mode), f"float64 {fmt_name} {mode}",
                          inputs=x)
    assert_in_candidates(quantize(x, fmt, rounding="stochastic"), x, fmt, "float64")


# ---------------------------------------------------------------------------------------------
# Shapes, strides, dtypes

def test_shapes_and_strides(quantize):
    base = torch.randn(6, 8, 5, dtype=torch.float64).to(F32) * 30
    for fmt in ["fp8_e4m3", "fixed8.4", "mxfp4_e2m1", "nvfp4",
                "block(elem=fp8_e5m2, block_size=4, axis=0)"]:
        contiguous = quantize(base, fmt)
        for view in (base.transpose(0, 2), base[:, ::2, 1:], base.permute(2, 0, 1)[..., ::3],
                     base.expand(2, 6, 8, 5)):
            q = quantize(view, fmt)
            assert q.shape == view.shape and q.dtype == view.dtype
            # the result depends on the logical values only, not on the memory layout
            assert_bits_equal(q, quantize(view.contiguous(), fmt), f"{fmt} strided")
            # stochastic rounding keys its random bits by the logical (row-major) index
            g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
            assert_bits_equal(quantize(view, fmt, rounding="stochastic", generator=g1),
                              quantize(view.contiguous(), fmt, rounding="stochastic",
                                       generator=g2), f"{fmt} strided stochastic")
        assert_bits_equal(quantize(base.transpose(0, 2), fmt).transpose(0, 2).contiguous(),
                          quantize(base.transpose(0, 2).contiguous(), fmt).transpose(0, 2),
                          f"{fmt} transposed")
        if not isinstance(qt.format(fmt), BlockFormat):
            assert_bits_equal(quantize(base.transpose(0, 2), fmt),
                              contiguous.transpose(0, 2), f"{fmt} transposed elementwise")


def test_empty_and_scalar(quantize):
    for fmt in ["fp8_e4m3", "fixed8.4", "mxfp8_e4m3", "nvfp4", "e8m0"]:
        for shape in [(0,), (3, 0), (0, 32)]:
            e = torch.empty(shape)
            q = quantize(e, fmt)
            assert q.shape == e.shape and q.dtype == e.dtype
        s = torch.tensor(3.3)
        q = quantize(s, fmt)
        assert q.shape == () and q.dtype == F32
    assert quantize(torch.tensor(3.3), "fp8_e4m3").item() == 3.25
    assert quantize(torch.tensor(3.3), "mxfp8_e4m3").item() == 3.25  # one block of one


def test_input_not_modified_and_not_aliased(quantize):
    x = torch.tensor([1.1, 2.2, -3.3, 0.0])
    keep = x.clone()
    q = quantize(x, "fp4_e2m1")
    assert_bits_equal(x, keep, "input changed")
    q.add_(1)
    assert_bits_equal(x, keep, "result aliases the input")
    y = torch.tensor([1.0, 2.0])  # already representable: still a new tensor
    assert quantize(y, "fp8_e4m3").data_ptr() != y.data_ptr()


def test_requires_grad_input(quantize):
    x = torch.randn(10, requires_grad=True)
    q = quantize(x, "bf16")
    assert q.shape == x.shape and q.dtype == x.dtype


# ---------------------------------------------------------------------------------------------
# Bad input

@pytest.mark.parametrize("bad,err,match", [
    (torch.arange(4), TypeError, r"int64.*float32"),
    (torch.arange(4, dtype=torch.int8), TypeError, r"int8"),
    (torch.zeros(3, dtype=torch.complex64), TypeError, r"complex"),
    (torch.zeros(3, dtype=torch.bool), TypeError, r"bool"),
    ([1.0, 2.0], TypeError, r"torch\.Tensor"),
])
def test_bad_tensor(quantize, bad, err, match):
    with pytest.raises(err, match=match):
        quantize(bad, "fp8_e4m3")


def test_bad_format_and_rounding(quantize):
    x = torch.ones(3)
    with pytest.raises(ValueError, match=r"unknown format 'fp7'.*fp8_e4m3"):
        quantize(x, "fp7")
    with pytest.raises(ValueError, match=r"unknown rounding mode 'up'.*stochastic"):
        quantize(x, "fp8_e4m3", rounding="up")
    with pytest.raises(ValueError, match=r"a format must be a format object or a string"):
        quantize(x, 8)
    with pytest.raises(IndexError, match=r"axis 3 is out of range"):
        quantize(torch.ones(4, 4), qt.BlockFormat(qt.fp8_e4m3, 2, axis=3))


# ---------------------------------------------------------------------------------------------
# Blocks

def block_oracle(x: torch.Tensor, fmt: BlockFormat, mode=None) -> torch.Tensor:
    """Split x into blocks along fmt.axis (numpy loops), quantize each with the exact oracle."""
    a = x.detach().double().numpy()
    if fmt.axis is None or a.ndim == 0:
        flat = a.reshape(1, -1)
        moved = flat
    else:
        moved = np.moveaxis(a, fmt.axis, -1)
    n = moved.shape[-1]
    bs = n if (fmt.block_size is None or fmt.axis is None) else fmt.block_size
    rows = moved.reshape(-1, n)
    out = np.empty(rows.shape, dtype=np.float64)
    ts = None
    if fmt.tensor_scale:
        finite = a[np.isfinite(a)]
        ts = _tensor_scale_oracle(Fraction(float(np.abs(finite).max())) if finite.size else
                                  Fraction(0), fmt)
    for r in range(rows.shape[0]):
        for s in range(0, n, max(bs, 1)):
            out[r, s:s + bs] = oracles.quantize_block(rows[r, s:s + bs].tolist(), fmt, mode, ts)
    out = out.reshape(moved.shape)
    if not (fmt.axis is None or a.ndim == 0):
        out = np.moveaxis(out, -1, fmt.axis)
    return torch.from_numpy(out.reshape(a.shape)).to(x.dtype)


# (two-level nvfp4 follows Transformer Engine's float32 steps, not this exact oracle's tensor
# scale: tests/formats/test_nvfp4_te.py holds it to the TE-rule oracle, oracles.nvfp4_te)
BLOCK_PRESETS = ["mxfp8_e4m3", "mxfp8_e5m2", "mxfp6_e3m2", "mxfp6_e2m3", "mxfp4_e2m1", "mxint8",
                 "nvfp4_single"]


def _block_inputs(rows, cols, seed):
    """Blocks with varied dynamic ranges: each block gets its own exponent offset and spread."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(rows, cols, generator=g, dtype=torch.float64)
    spread = torch.randint(-20, 21, (rows, cols), generator=g).double()
    offset = torch.randint(-120, 110, (rows, 1), generator=g).double()
    x = (base * torch.exp2(offset + spread * torch.rand(rows, cols, generator=g,
                                                        dtype=torch.float64) / 4)).to(F32)
    if rows >= 3:
        x[0, :5] = 0.0
        x[1, :] = 0.0
        x[2, :] = -0.0
    return x


@pytest.mark.parametrize("name", BLOCK_PRESETS)
def test_block_presets_vs_oracle(quantize, name):
    fmt = qt.format(name)
    x = _block_inputs(40, 70, seed=len(name))  # 70 = partial last block for 32 and 16
    for mode in DETERMINISTIC:
        assert_bits_equal(quantize(x, fmt, rounding=mode), _block_case(name, mode),
                          f"{name} {mode}", inputs=x)


@functools.lru_cache(maxsize=None)
def _block_case(name, mode):
    return block_oracle(_block_inputs(40, 70, seed=len(name)), qt.format(name), mode)


@pytest.mark.parametrize("name", BLOCK_PRESETS)
def test_block_stochastic_candidates(quantize, name):
    fmt = qt.format(name)
    x = _block_inputs(8, 48, seed=3)
    q = quantize(x, fmt, rounding="stochastic")
    cand = block_oracle_candidates(x, fmt)
    for qi, c in zip(q.reshape(-1).tolist(), cand):
        cs = c if isinstance(c, tuple) else (c,)
        assert any(qi == ci and math.copysign(1, qi) == math.copysign(1, ci) for ci in cs), (qi, cs)


def block_oracle_candidates(x, fmt):
    rows = x.double().numpy()
    ts = None
    if fmt.tensor_scale:
        ts = _tensor_scale_oracle(Fraction(float(np.abs(rows).max())), fmt)
    out = []
    for r in rows:
        for s in range(0, len(r), fmt.block_size):
            out += oracles.quantize_block(r[s:s + fmt.block_size].tolist(), fmt, "stochastic",
                                          ts)
    return out


def test_block_power_of_two_amax(quantize):
    """amax exactly 2^k and the float just below it: the scale comes from the bits, not log2."""
    for name, emax_elem in [("mxfp8_e4m3", 8), ("mxfp4_e2m1", 2), ("mxint8", 0)]:
        fmt = qt.format(name)
        for k in [-100, -3, 0, 1, 20, 100]:
            p = torch.tensor(2.0 ** k, dtype=F32)
            below = torch.nextafter(p, torch.tensor(0.0))
            for amax in (p, below):
                x = torch.stack([amax, torch.tensor(2.0 ** (k - 3)), -amax / 3])
                assert_bits_equal(quantize(x, fmt), block_oracle(x, fmt), f"{name} 2^{k}", x)
            # alone, 2^k is kept (X = 2^(k - emax)), while just below 2^k the scale is
            # 2^(k - 1 - emax) and the element saturates at max_elem
            max_elem = {"mxfp8_e4m3": 448.0, "mxfp4_e2m1": 6.0, "mxint8": 127 / 64}[name]
            assert_bits_equal(quantize(p.reshape(1), fmt), p.reshape(1), f"{name} 2^{k}")
            assert_bits_equal(quantize(below.reshape(1), fmt),
                              t32([max_elem * 2.0 ** (k - 1 - emax_elem)]), f"{name} below 2^{k}")


def test_anchor_microxcaling_off_by_one(quantize):
    """A known value: [1048575.94, 4.0] in mxfp8_e4m3 is [917504, 4] (microxcaling's log2 gives
    [1048576, 8])."""
    x = torch.tensor([1048575.94, 4.0])
    assert x[0].item() == 1048575.9375
    assert_bits_equal(quantize(x, "mxfp8_e4m3"), t32([917504.0, 4.0]), "anchor")


def test_block_nan_inf(quantize):
    fmt = qt.format("block(elem=fp8_e4m3, block_size=4)")
    for bad in [float("nan"), float("inf"), float("-inf")]:
        x = t32([1.0, 2.0, bad, 3.0, 1.0, 2.0, 3.0, 4.0, -0.0, 5.0])
        q = quantize(x, fmt)
        assert bool(torch.isnan(q[:4]).all())
        assert_bits_equal(q[4:], t32([1.0, 2.0, 3.0, 4.0, -0.0, 5.0]), "other blocks")
    for name in BLOCK_PRESETS:
        x = torch.randn(3, 40)
        x[1, 33] = float("inf")
        q = quantize(x, name)
        bs = qt.format(name).block_size
        start = 33 // bs * bs
        assert bool(torch.isnan(q[1, start:start + bs]).all())
        assert not bool(torch.isnan(q[1, :start]).any()) and not bool(torch.isnan(q[0]).any())


def test_block_zero(quantize):
    for name in BLOCK_PRESETS:
        x = t32([0.0, -0.0, 0.0, -0.0] * 8)
        # signs kept, except by integer elements (no negative zero)
        e = x.abs() if isinstance(qt.format(name).elem, FixedFormat) else x
        assert_bits_equal(quantize(x, name), e, f"{name} all-zero block")


def test_block_tiny_and_huge(quantize):
    # tiny: the scale is clamped at 2^-127, elements below half the smallest element underflow
    x = t32([2.0 ** -130, 2.0 ** -140, -(2.0 ** -133), 2.0 ** -149])
    exp = []
    for v in x.tolist():  # X = 2^-127; element = Q_e4m3(v / X), min subnormal 2^-9
        z = v / 2.0 ** -127
        exp.append(oracles.round_float(z, qt.fp8_e4m3) * 2.0 ** -127)
    assert_bits_equal(quantize(x, "mxfp8_e4m3"), t32(exp), "tiny block", x)
    assert quantize(x, "mxfp8_e4m3")[0].item() == 2.0 ** -130  # 2^-3 is an e4m3 value
    assert_bits_equal(quantize(x, "mxfp8_e4m3"), block_oracle(x, qt.mxfp8_e4m3), "tiny vs oracle")
    # huge: an element format with max < 1 needs X = 2^131 for float32's largest values: the
    # scale clamps at 2^127 and the elements saturate
    fmt = BlockFormat(FixedFormat(8, 10), 4)  # values k/1024, k in -128..127: emax -4
    x = t32([3e38, 1e38, -2e38, 1.0])
    q = quantize(x, fmt)
    assert_bits_equal(q, t32([127 * 2.0 ** 117, 127 * 2.0 ** 117, -(2.0 ** 124), 0.0]),
                      "huge block", x)
    assert_bits_equal(q, block_oracle(x, fmt), "huge vs oracle", x)
    # float64 inputs beyond float32's range: the scale clamps at 2^127, elements saturate at 448
    x64 = torch.tensor([1e300, 1.0], dtype=torch.float64)
    assert_bits_equal(quantize(x64, "mxfp8_e4m3"),
                      torch.tensor([448 * 2.0 ** 127, 0.0], dtype=torch.float64), "float64 huge")


@pytest.mark.xfail(strict=True, reason=(
    "known issue (reported): with the ceil rule, amax near float32's max gives X = 2^126 for "
    "fp4 and the element 4, so X * 4 = 2^128 is Inf in the float32 carrier; the contract does not "
    "say what a saturating block format should give there"))
def test_block_ceil_top_of_float32(quantize):
    x = t32([torch.finfo(F32).max, 1.0])
    q = quantize(x, BlockFormat(qt.fp4_e2m1, 32, scale_rule="ceil"))
    assert bool(torch.isfinite(q).all()), q


def test_block_layouts(quantize):
    x = _block_inputs(12, 37, seed=11).reshape(12, 37)
    cases = [
        BlockFormat(qt.fp8_e4m3, 8, axis=0),
        BlockFormat(qt.fp6_e2m3, 5, axis=1),
        BlockFormat(qt.fp4_e2m1, None, axis=0),   # each column one block
        BlockFormat(qt.fp4_e2m1, None, axis=-1),  # each row one block
        BlockFormat(qt.fp8_e5m2, 7, axis=None),   # the whole tensor one block
        BlockFormat(qt.fp4_e2m1, 32, scale_rule="ceil"),
        BlockFormat(qt.fp8_e4m3, 3, axis=0, scale_rule="ceil"),
        BlockFormat(FixedFormat(8, 6, symmetric=True), 16, scale_rule="ceil"),
        BlockFormat(FloatFormat(3, 4), 6),
        BlockFormat(FixedFormat(5, 3), 4, axis=0),
    ]
    for fmt in cases:
        assert_bits_equal(quantize(x, fmt), block_oracle(x, fmt), str(fmt), inputs=x)
    x3 = _block_inputs(6, 20, seed=2).reshape(2, 3, 20)
    for fmt in [BlockFormat(qt.fp8_e4m3, 4, axis=1), BlockFormat(qt.fp4_e2m1, 2, axis=-2),
                BlockFormat(qt.fp6_e3m2, 3, axis=0)]:
        assert_bits_equal(quantize(x3, fmt), block_oracle(x3, fmt), str(fmt), inputs=x3)


def test_block_partial_last_block(quantize):
    """A last, shorter block behaves as if padded with zeros: the same as quantizing it alone."""
    x = _block_inputs(1, 37, seed=5)[0]
    q = quantize(x, "mxfp8_e4m3")
    assert_bits_equal(q[32:], quantize(x[32:].clone(), "mxfp8_e4m3"), "tail alone")
    assert_bits_equal(q[:32], quantize(x[:32].clone(), "mxfp8_e4m3"), "head alone")


def test_block_ceil_rule(quantize):
    """floor vs ceil: amax 7 in fp4 (max 6): floor gives X = 2^(2-2) = 1 and 7 saturates to 6;
    ceil gives the smallest X with 7 / X <= 6, X = 2, and 7/2 = 3.5 -> 4 (ties to even)."""
    x = t32([7.0, 1.0, -0.5, 3.0])
    floor = BlockFormat(qt.fp4_e2m1, 4)
    ceil = BlockFormat(qt.fp4_e2m1, 4, scale_rule="ceil")
    assert_bits_equal(quantize(x, floor), t32([6.0, 1.0, -0.5, 3.0]), "floor")
    assert_bits_equal(quantize(x, ceil), t32([8.0, 1.0, -0.0, 3.0]), "ceil")
    # amax exactly max_elem * 2^k: ceil keeps X = 2^k (amax / X == max_elem is allowed)
    y = t32([6.0 * 2 ** 5, 1.0])
    assert_bits_equal(quantize(y, ceil), t32([192.0, 0.0]), "ceil exact")


def test_nvfp4(quantize):
    """single-level NVFP4: X = RNE_e4m3(amax / 6), elements Q_fp4(x / X) with x / X exact."""
    # amax 6: X = 1, plain fp4
    x = t32([6.0, 2.5, -1.25, 0.2] + [0.0] * 12)
    assert_bits_equal(quantize(x, "nvfp4_single"), t32([6.0, 2.0, -1.0, 0.0] + [0.0] * 12), "X=1")
    # amax / 6 = 3.3 / 6 = 0.55 -> e4m3 0.5625; elements x / 0.5625 exactly
    x = t32([3.3, 1.0, -0.7] + [0.0] * 13)
    assert_bits_equal(quantize(x, "nvfp4_single"), block_oracle(x, qt.nvfp4_single), "X=0.5625", x)
    # amax / 6 in E4M3's subnormal range (torchao's scale differs there)
    for amax in [0.05, 0.01, 0.003, 0.0015, 2.0 ** -9 * 6, 2.0 ** -10 * 6, 1e-4]:
        x = t32([amax, amax / 2, -amax / 7, amax / 3] + [0.0] * 12)
        assert_bits_equal(quantize(x, "nvfp4_single"), block_oracle(x, qt.nvfp4_single), f"amax {amax}", x)
    # amax / 6 below half of e4m3's smallest subnormal 2^-9: the scale is 0, all signed zeros
    x = t32([2.0 ** -14, -(2.0 ** -15)] + [0.0] * 14)
    assert_bits_equal(quantize(x, "nvfp4_single"), t32([0.0, -0.0] + [0.0] * 14), "zero scale")
    # huge amax: the scale saturates at 448 and elements at 6 * 448
    x = t32([1e6, 3e5] + [0.0] * 14)
    assert_bits_equal(quantize(x, "nvfp4_single"), block_oracle(x, qt.nvfp4_single), "saturated scale", x)


def test_nvfp4_division_tie(quantize):
    """x / X must be exact: a float32 computation of it can land on an fp4 tie that the exact
    quotient is just below.

    amax = 11.25 gives X = RNE_e4m3(11.25 / 6) = 1.875. For x = 1.4062498807907104 the exact
    x / X is 0.75 - 6.4e-8, which rounds to 0.5 (result 0.9375), but x * float32(1 / X) is
    exactly the tie 0.75, which ties-to-even sends to 1.0 (result 1.875). Likewise
    3.281249761581421 / X is just below the tie 1.75 (result 1.5 X = 2.8125, not 2 X = 3.75).
    (A single correctly rounded float32 division cannot land on a tie when X has few bits, as
    here: neighbouring quotients are more than half an ulp apart; the reciprocal product can.)
    """
    X = Fraction(15, 8)
    xs = [1.4062498807907104, 3.281249761581421, -1.4062498807907104]
    ties = [Fraction(3, 4), Fraction(7, 4), Fraction(-3, 4)]
    recip = np.float32(1) / np.float32(1.875)
    for xv, tie in zip(xs, ties):
        assert np.float32(xv) == xv
        assert Fraction(float(np.float32(xv) * recip)) == tie  # the float32 shortcut lands on the tie
        assert abs(Fraction(xv) / X) < abs(tie)         # the exact quotient is below it
    x = t32([11.25] + xs + [0.0] * 12)
    expected = t32([11.25, 0.9375, 2.8125, -0.9375] + [0.0] * 12)
    assert_bits_equal(quantize(x, "nvfp4_single"), expected, "division tie", x)
    assert_bits_equal(expected, block_oracle(x, qt.nvfp4_single), "oracle agrees")
    # and the mirror case: just above a tie, a float32 shortcut that lands on it would go down
    for mode in ("nearest_away", "toward_zero"):
        assert_bits_equal(quantize(x, "nvfp4_single", rounding=mode), block_oracle(x, qt.nvfp4_single, mode),
                          f"division tie {mode}", x)


def test_mxint8():
    x = t32([1.0, 0.5, 127 / 64, -2.0, 0.0078125, 0.01] + [0.0] * 26)
    # amax 2: X = 2^(1 - 0) = 2; elements k/64 with |k| <= 127, x / 2 exactly
    for qfn in (qt.quantize, reference.quantize):
        assert_bits_equal(qfn(x, "mxint8"), block_oracle(x, qt.mxint8), "mxint8", x)
        # amax 100: X = 2^6, so the grid is k * 2^6 / 64 = k: 1.3 -> 1, 100 -> 100
        assert qfn(t32([100.0, 1.3, -1.5, 2.5]), "mxint8").tolist() == [100.0, 1.0, -2.0, 2.0]


def test_qpytorch_block_floating_point(quantize):
    """QPyTorch's block_quantize is a BlockFormat of symmetric wl-bit integers with
    wl - 2 fraction bits over the whole tensor: block max 100, wl=4 -> 96."""
    bfp4 = BlockFormat(FixedFormat(4, 2, symmetric=True), None, axis=None)
    assert quantize(t32([100.0, 3.0, -50.0]), bfp4).tolist() == [96.0, 0.0, -48.0]
    # the grid: step 2^(e + 2 - wl) with e = floor(log2 max), magnitudes up to (2^(wl-1)-1) step
    rng = np.random.default_rng(0)
    for wl in (4, 8):
        fmt = BlockFormat(FixedFormat(wl, wl - 2, symmetric=True), None, axis=None)
        x = torch.from_numpy(rng.standard_normal(50).astype(np.float32) * 37)
        e = math.floor(math.log2(float(x.abs().max())))
        step = 2.0 ** (e + 2 - wl)
        k = torch.round(x.double() / step).clamp(-(2 ** (wl - 1) - 1), 2 ** (wl - 1) - 1)
        # + 0.0: integer elements have no negative zero
        assert_bits_equal(quantize(x, fmt), (k * step + 0.0).to(F32), f"bfp wl={wl}", x)


try:
    import gfloat as _gfloat
    from gfloat import formats as _gf
except ImportError:  # optional oracle
    _gfloat = None


@pytest.mark.skipif(_gfloat is None, reason="gfloat not installed (pip install gfloat)")
@pytest.mark.parametrize("name,gfi", [
    ("mxfp8_e4m3", "format_info_mxfp8_e4m3"), ("mxfp8_e5m2", "format_info_mxfp8_e5m2"),
    ("mxfp6_e3m2", "format_info_mxfp6_e3m2"), ("mxfp6_e2m3", "format_info_mxfp6_e2m3"),
    ("mxfp4_e2m1", "format_info_mxfp4_e2m1"), ("mxint8", "format_info_mxint8")])
def test_mx_vs_gfloat(quantize, name, gfi):
    """gfloat's quantize_block with compute_scale_amax (OCP floor rule, scale clipped to
    2^+-127), one block at a time, on finite blocks (gfloat gives NaN for non-finite ones too)."""
    fi = getattr(_gf, gfi)
    x = _block_inputs(30, 64, seed=9)
    expected = np.empty(x.shape)
    for r in range(x.shape[0]):
        for s in range(0, 64, 32):
            expected[r, s:s + 32] = _gfloat.quantize_block(
                fi, x[r, s:s + 32].double().numpy(), _gfloat.compute_scale_amax)
    # gfloat returns +0 for -0 inputs; compare the sign of zeros against the contract instead
    # (signed for float elements, +0 for MXINT8's integers)
    q = quantize(x, name)
    e = torch.from_numpy(expected).to(F32)
    zero = e == 0
    if not isinstance(qt.format(name).elem, FixedFormat):
        e[zero] = torch.copysign(torch.zeros_like(e[zero]), x[zero])
    else:
        e[zero] = 0.0
    assert_bits_equal(q, e, f"{name} vs gfloat", inputs=x)


# ---------------------------------------------------------------------------------------------
# Properties (hypothesis) over random formats and values

@st.composite
def float_formats(draw):
    exp = draw(st.integers(1, 8))
    man = draw(st.integers(0, 12))
    specials = draw(st.sampled_from(["ieee", "fn", "none"]))
    if specials == "ieee" and exp == 1:
        specials = "none"  # e1 ieee has no finite normals
    saturate = True if specials == "none" else draw(st.booleans())
    sub = draw(st.booleans())
    try:
        return FloatFormat(exp, man, subnormals=sub, specials=specials, saturate=saturate)
    except FormatError:
        return FloatFormat(4, 3)


@st.composite
def fixed_formats(draw):
    wl = draw(st.integers(2, 16))
    fl = draw(st.integers(-4, 20))
    signed = draw(st.booleans())
    return FixedFormat(wl, fl, signed=signed, symmetric=signed and draw(st.booleans()))


@st.composite
def block_formats(draw):
    elem = draw(st.one_of(float_formats(), fixed_formats()))
    try:
        return BlockFormat(elem, draw(st.sampled_from([1, 2, 5, 16, None])),
                           scale_rule=draw(st.sampled_from(["floor", "ceil"])))
    except FormatError:
        return qt.mxfp8_e4m3


any_format = st.one_of(float_formats(), fixed_formats(), block_formats(),
                       st.sampled_from(list(qt.PRESETS.values())))
finite32 = st.floats(allow_nan=False, allow_infinity=False, width=32)
PROPS = settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
impls = st.sampled_from([qt.quantize, reference.quantize])


@PROPS
@given(fmt=any_format, xs=st.lists(st.floats(width=32), min_size=1, max_size=40),
       mode=st.sampled_from(DETERMINISTIC), q=impls)
def test_prop_idempotent(fmt, xs, mode, q):
    x = t32(xs)
    once = q(x, fmt, rounding=mode)
    # known issue, see test_block_ceil_top_of_float32: a block can round past float32's max
    assume(not bool((torch.isinf(once) & torch.isfinite(x)).any()) or
           not isinstance(fmt, BlockFormat))
    assert_bits_equal(q(once, fmt, rounding=mode), once, f"{fmt} {mode} q(q(x))")
    # stochastic rounding of representable values is exact too
    assert_bits_equal(q(once, fmt, rounding="stochastic"), once, f"{fmt} stochastic q(q(x))")


@PROPS
@given(fmt=st.one_of(float_formats(), fixed_formats()), xs=st.lists(finite32, min_size=2,
                                                                     max_size=40),
       mode=st.sampled_from(DETERMINISTIC), q=impls)
def test_prop_monotone(fmt, xs, mode, q):
    x = torch.sort(t32(xs)).values
    r = q(x, fmt, rounding=mode)
    if isinstance(fmt, FloatFormat) and not fmt.saturate:
        r = r[~torch.isnan(r)]  # "fn" overflow is NaN, outside the order
    assert bool((r[1:] >= r[:-1]).all()), f"{fmt} {mode}: {x.tolist()} -> {r.tolist()}"


@PROPS
@given(fmt=st.one_of(float_formats(), fixed_formats()), xs=st.lists(finite32, min_size=1,
                                                                     max_size=40), q=impls)
def test_prop_half_quantum(fmt, xs, q):
    """|q(x) - x| <= half the spacing of x's neighbours for nearest, in range."""
    x = t32(xs)
    r = q(x, fmt)
    for xi, ri in zip(x.tolist(), r.tolist()):
        if isinstance(fmt, FixedFormat):
            kmin, kmax = oracles.fixed_range(fmt)
            if not kmin * 2.0 ** -fmt.fl <= xi <= kmax * 2.0 ** -fmt.fl:
                continue
            half = Fraction(2) ** -fmt.fl / 2
        else:
            emin, emax, mx, _ = oracles.float_limits(fmt)
            if abs(Fraction(xi)) > mx or xi == 0:
                continue
            e = oracles.floor_log2(abs(Fraction(xi)))
            if e < emin:
                half = Fraction(2) ** ((emin - fmt.man) if fmt.subnormals else emin) / 2
            else:
                half = Fraction(2) ** (e - fmt.man) / 2
        assert abs(Fraction(ri) - Fraction(xi)) <= half, (fmt, xi, ri)


@PROPS
@given(fmt=any_format, xs=st.lists(st.floats(width=32), min_size=1, max_size=40),
       mode=st.sampled_from(DETERMINISTIC), q=impls)
def test_prop_symmetric(fmt, xs, mode, q):
    """q(-x) == -q(x) for the symmetric modes (not for asymmetric fixed-point ranges)."""
    if isinstance(fmt, FixedFormat) and not fmt.symmetric:
        fmt = fmt.replace(signed=True, symmetric=True) if fmt.wl >= 2 else fmt
    if isinstance(fmt, BlockFormat) and isinstance(fmt.elem, FixedFormat):
        fmt = fmt.replace(elem=fmt.elem.replace(signed=True, symmetric=True))
    if isinstance(fmt, FloatFormat) and not fmt.signed:
        return
    x = t32(xs)
    expected = -q(x, fmt, rounding=mode)
    if isinstance(getattr(fmt, "elem", fmt), FixedFormat) or getattr(fmt, "no_negative_zero",
                                                                      False):
        expected = expected + 0.0  # no negative zero (fixed point, P3109)
    assert_bits_equal(q(-x, fmt, rounding=mode), expected, f"{fmt} {mode}")


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(fmt=st.one_of(float_formats(), fixed_formats()), x=finite32, q=impls)
def test_prop_stochastic_unbiased(fmt, x, q):
    """The mean of many draws is x within 5 standard errors (in range, no overflow)."""
    c = oracles.round_scalar(x, fmt, "stochastic")
    if not isinstance(c, tuple) or not all(math.isfinite(v) for v in c):
        return
    lo, hi = sorted(c)
    if isinstance(fmt, FixedFormat) and not (fmt.min <= x <= fmt.max):
        return
    if isinstance(fmt, FloatFormat) and max(abs(lo), abs(hi)) > fmt.max:
        return
    n = 4000
    draws = q(torch.full((n,), x), fmt, rounding="stochastic",
              generator=torch.Generator().manual_seed(1)).double()
    if lo == hi:  # x is representable: every draw is x
        assert bool((draws == lo).all()), (fmt, x)
        return
    p = (Fraction(x) - Fraction(lo)) / (Fraction(hi) - Fraction(lo))
    sd = (hi - lo) * math.sqrt(float(p * (1 - p)) / n)
    assert abs(draws.mean().item() - x) <= 5 * sd + 1e-300, (fmt, x, draws.mean().item())


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fixed8.4", "mxfp4_e2m1", "nvfp4", "bf16"])
def test_stochastic_reproducible(quantize, fmt):
    x = torch.randn(1000) * 3
    torch.manual_seed(123)
    a = quantize(x, fmt, rounding="stochastic")
    torch.manual_seed(123)
    b = quantize(x, fmt, rounding="stochastic")
    assert_bits_equal(a, b, "manual_seed")
    c = quantize(x, fmt, rounding="stochastic")  # the generator moved on
    assert not torch.equal(as_bits(a), as_bits(c)), "two draws gave identical results"
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    assert_bits_equal(quantize(x, fmt, rounding="stochastic", generator=g1),
                      quantize(x, fmt, rounding="stochastic", generator=g2), "generator")
    g3 = torch.Generator().manual_seed(6)
    d = quantize(x, fmt, rounding="stochastic", generator=torch.Generator().manual_seed(5))
    e = quantize(x, fmt, rounding="stochastic", generator=g3)
    assert not torch.equal(as_bits(d), as_bits(e)), "different seeds gave identical results"
    # an explicit generator does not consume the default one
    torch.manual_seed(1)
    quantize(x, fmt, rounding="stochastic", generator=torch.Generator().manual_seed(9))
    after = torch.rand(3)
    torch.manual_seed(1)
    assert torch.equal(after, torch.rand(3))


def test_format_default_rounding_is_used(quantize):
    """A format's own rounding mode applies when rounding=None; rounding= overrides it."""
    x = t32([2.5, 3.5, -2.5])
    away = qt.fp8_e4m3.replace(rounding="nearest_away")
    tz = FixedFormat(8, 0, rounding="toward_zero")
    assert quantize(x, away).tolist() == [2.5, 3.5, -2.5]
    assert quantize(t32([2.5, -2.5]), tz).tolist() == [2.0, -2.0]
    assert quantize(t32([2.5, -2.5]), tz, rounding="nearest_away").tolist() == [3.0, -3.0]
    assert quantize(t32([2.5, 3.5]), FixedFormat(8, 0)).tolist() == [2.0, 4.0]


def _tensor_scale_oracle(amax: Fraction, fmt) -> Fraction:
    """s = amax / (max_elem * max_scale) rounded down to fmt.tensor_scale_bits significant bits
    (and to a multiple of 2^fmt.tensor_scale_min_exp), exactly."""
    t = amax / (Fraction(fmt.elem.max) * Fraction(fmt.scale.max))
    if t == 0:
        return Fraction(0)
    e = oracles.floor_log2(t) + 1  # t = m 2^e, m in [1/2, 1)
    j = max(e - fmt.tensor_scale_bits, fmt.tensor_scale_min_exp)
    return Fraction(math.floor(t / Fraction(2) ** j)) * Fraction(2) ** j


def test_block_of_asymmetric_fixed_elements_is_idempotent(quantize):
    """The floor rule with two's-complement elements: -1.5 X rounds (ties to even) to the most
    negative code -2 X = -2^56, a negative power of two, which derives X = 2^55 again (not 2^56,
    under which 3.6e16 = 2^55 would go to 0)."""
    scale = FloatFormat(8, 0, subnormals=False, specials="fn", signed=False)
    fmt = BlockFormat(FixedFormat(2, 0), 2, scale=scale, scale_rule="floor")
    once = quantize(t32([1.801440065696563e+16, -5.404319552844595e+16]), fmt)
    assert_bits_equal(once, t32([2.0 ** 55, -2.0 ** 56]), "q(x)")
    assert_bits_equal(quantize(once, fmt), once, "q(q(x))")
    # a block whose amax is -2^c takes the scale 2^(c-1), where -2^c is the code -2: the other
    # values keep a bit more (1.5 / 2 rounds to 1; under 2^c, 1.5 / 4 would round to 0)
    assert_bits_equal(quantize(t32([-4.0, 1.5, -2.0 ** -140]), fmt.replace(block_size=3)),
                      t32([-4.0, 2.0, 0.0]), "-2^c")


@pytest.mark.xfail(strict=True, reason="known issue: the even rule with two's-complement "
                   "elements settles (toward_zero, stochastic) to a scale X where a value is the "
                   "most negative code -2 X, whose own scale, rounded again, is 2 X")
def test_even_rule_block_of_asymmetric_fixed_elements_is_not_idempotent(quantize):
    fmt = BlockFormat(FixedFormat(2, 0), 2, scale_rule="even")
    once = quantize(t32([-0.753058910369873, -6.170853614807129]), fmt, rounding="toward_zero")
    assert_bits_equal(once, t32([-0.5, -1.0]), "q(x)")
    assert_bits_equal(quantize(once, fmt, rounding="toward_zero"), once, "q(q(x))")


TWOS_FIXED = [FixedFormat(2, 0), FixedFormat(3, 1), FixedFormat(4, -2),
              FixedFormat(3, 0, saturate=False)]


@pytest.mark.parametrize("elem", TWOS_FIXED, ids=str)
@pytest.mark.parametrize("bs", [2, 3, 4])
def test_twos_complement_block_elements_exhaustive(elem, bs):
    """Floor-rule blocks of two's-complement fixed elements, every tuple of codes and points
    between them at several scales, every rounding mode: the C++ kernels give the reference's
    bits on each of their paths (blocks along rows, a run of blocks of 32, tiles of a strided
    axis, one block per call and a strided whole tensor) and rounding again gives them back."""
    x = twos_complement_blocks(elem, bs)
    fmt = BlockFormat(elem, bs, scale_rule="floor")
    wide = torch.nn.functional.pad(x, (0, 32 - bs))  # zeros change no block's scale
    for mode in DETERMINISTIC + ["stochastic", "stochastic8"]:
        for t, f in ((x, fmt), (wide, fmt.replace(block_size=32)),
                     (x.t().contiguous(), fmt.replace(axis=0)), (x.t(), fmt.replace(axis=0))):
            want = reference.quantize_with_seed(t, f, mode, 5)
            assert_bits_equal(ops.quantize_with_seed(t, f, mode, 5), want, f"{f} {mode}")
            for q in (reference.quantize_with_seed, ops.quantize_with_seed):
                assert_bits_equal(q(want, f, mode, 6), want, f"{f} {mode} q(q(x))")
        whole = fmt.replace(block_size=None, axis=None)
        for row in x[::max(1, x.shape[0] // 40)]:  # one block per tensor, strided
            t = row.repeat_interleave(2)[::2]
            want = reference.quantize_with_seed(t, whole, mode, 5)
            assert_bits_equal(ops.quantize_with_seed(t, whole, mode, 5), want, f"whole {mode}")
            assert_bits_equal(ops.quantize_with_seed(want, whole, mode, 6), want,
                              f"whole {mode} q(q(x))")


@pytest.mark.parametrize("elem", TWOS_FIXED[:3], ids=str)
def test_twos_complement_floor_rule_oracle(elem, quantize):
    """Blocks of two's-complement elements against the exact oracle of the floor rule
    (oracles.floor_binade, oracles.quantize_block); it differs from 2^(floor(log2 amax) -
    emax_elem) exactly where the block's largest magnitude is a negative power of two."""
    x = twos_complement_blocks(elem, 2, limit=400)
    fmt = BlockFormat(elem, 2, scale_rule="floor")
    for mode in DETERMINISTIC:
        got = quantize(x, fmt, rounding=mode)
        for row, g in zip(x.tolist(), got.tolist()):
            assert g == oracles.quantize_block(row, fmt, mode), (elem, mode, row, g)
    lowered = [r for r in x.tolist() if any(r) and oracles.floor_binade(r, fmt)
               < oracles.floor_log2(max(abs(Fraction(v)) for v in r))]
    assert lowered and all(min(r) == -max(abs(v) for v in r) and
                           math.log2(-min(r)).is_integer() for r in lowered)
