"""qt.accum: the accumulator model, checked against an exact oracle (Fractions), and the kernel.

The oracle below restates the model of qtensor/accum.py (MMA-Sim's fused_dot_add rules) per
output element with Python integers and Fractions, independently of torch; the reference and
the compiled kernel must give its bits exactly (compared as int32 patterns).
"""
import copy
import dataclasses
import itertools
import math
import os
import types
import zlib
from fractions import Fraction

import pytest
import torch

import qtensor as qt
from qtensor import accum
from qtensor.accum import AccumFormat, AccumFormatError


# ---------------------------------------------------------------------------------------------
# The oracle

def _flog2(x: Fraction) -> int:
    """floor(log2|x|) of a nonzero Fraction, exactly."""
    x = abs(x)
    e = x.numerator.bit_length() - x.denominator.bit_length()
    return e - 1 if x < Fraction(2) ** e else e


def _rnd(x: Fraction, mode: str) -> int:
    if mode == "toward_zero":
        return int(x)
    if mode == "floor":
        return math.floor(x)
    return round(x)  # Fraction rounds half to even


def _to_grid(v: Fraction, man: int, mode: str, emin=-126, emax=127) -> float:
    """v rounded to man fractional bits, exponents from emin (the subnormal grid's), inf from
    2^(emax + 1) (float32's range by default)."""
    if v == 0:
        return 0.0
    q = Fraction(2) ** (max(_flog2(v), emin) - man)
    r = _rnd(v / q, mode) * q
    if abs(r) >= Fraction(2) ** (emax + 1):
        return math.copysign(math.inf, r)
    return float(r)


def _f32_add(x: float, y: float) -> float:
    return _to_grid(Fraction(x) + Fraction(y), 23, "nearest")


def oracle_dot(row, col, f: AccumFormat, a_emin=-126, b_emin=-126, ga=None, gb=None,
               c=0.0) -> float:
    """One output element: row, col lists of (finite) float32 values as Python floats.

    a_emin, b_emin: the operands' formats' minimum normal exponents (the clamp of e); ga, gb: the
    groups' exponents (a group aligns at ga[j] + gb[j]); c: the initial accumulator.
    """
    def e(x, emin=-126):  # alignment exponent of an operand or of p: floor(log2|x|) clamped
        return max(_flog2(Fraction(x)), emin)

    acc, p = 0.0, c
    K = len(row)
    for ci, k0 in enumerate(range(0, K, f.chunk)):
        k1 = min(k0 + f.chunk, K)
        terms = []  # (exact value, alignment exponent)
        zero = k1 - k0 < f.chunk  # a zero term: the padding slots of a short chunk
        if f.group == 1:
            for k in range(k0, k1):
                if row[k] != 0 and col[k] != 0:
                    terms.append((Fraction(row[k]) * Fraction(col[k]),
                                  e(row[k], a_emin) + e(col[k], b_emin)))
                else:
                    zero = True
        else:
            for g0 in range(k0, k1, f.group):
                ps = [Fraction(row[k]) * Fraction(col[k]) for k in range(g0, min(g0 + f.group,
                                                                                 k1))]
                s = sum(ps)
                if ga is not None:  # aligned at the group exponent unless all products are 0
                    if any(ps):
                        terms.append((s, ga[g0 // f.group] + gb[g0 // f.group]))
                    else:
                        zero = True
                elif s != 0:
                    terms.append((s, _flog2(s)))
                else:
                    zero = True
        if math.isinf(p):  # an overflowed partial (FP16 accumulators) stays inf
            terms, zero = [], False
        elif f.acc_in_alignment:
            if p != 0:
                terms.append((Fraction(p), e(p, f.acc_emin)))
            else:
                zero = True
        if terms:
            emax = max(t[1] for t in terms)
            if zero and f.e_zero is not None:  # a zero term's exponent is e_zero
                emax = max(emax, f.e_zero)
            S = sum(_rnd(t * Fraction(2) ** (f.frac_bits - emax), f.align_rounding)
                    for t, _ in terms)
            chunk = _to_grid(S * Fraction(2) ** (emax - f.frac_bits), f.acc_man, f.acc_rounding,
                             f.acc_emin, f.acc_emax)
        else:
            chunk = p if math.isinf(p) else 0.0
        p = chunk if f.acc_in_alignment or math.isinf(p) else _f32_add(p, chunk)
        if f.promote is not None and ((ci + 1) % f.promote == 0 or k1 == K):
            acc, p = _f32_add(acc, p), 0.0
    return p if f.promote is None or K == 0 else acc


def oracle(a: torch.Tensor, b: torch.Tensor, f: AccumFormat, **kw) -> torch.Tensor:
    A, B = a.tolist(), b.t().tolist()
    ga, gb = kw.pop("a_gexp", None), kw.pop("b_gexp", None)
    c = kw.pop("c", None)
    rows = []
    for i, r in enumerate(A):
        rows.append([oracle_dot(r, col, f, ga=None if ga is None else ga[i].tolist(),
                                gb=None if gb is None else gb[:, j].tolist(),
                                c=0.0 if c is None else float(c[i, j]), **kw)
                     for j, col in enumerate(B)])
    return torch.tensor(rows, dtype=torch.float32)


def bits(x):
    return x.contiguous().view(torch.int32)


# ---------------------------------------------------------------------------------------------
# Inputs: random, cancellation-heavy, huge exponent spread

def _random(g, M, K, N, fmt=None):
    a = torch.randn(M, K, generator=g)
    b = torch.randn(K, N, generator=g)
    if fmt is not None:
        a, b = qt.quantize(a, fmt), qt.quantize(b, fmt)
    return a, b


def _cancelling(g, M, K, N):
    """Products in +-pairs of large terms that cancel, leaving small ones to be swamped."""
    a, b = _random(g, M, K, N, "bf16")
    big = 2.0 ** torch.randint(8, 24, (M, K // 2), generator=g).float()
    a[:, 0:K - K % 2:2] = big
    a[:, 1:K - K % 2:2] = -big
    b[1:K - K % 2:2] = b[0:K - K % 2:2]
    a[:, ::5] *= 2.0 ** -20  # some tiny terms mixed in
    return a, b


def _spread(g, M, K, N):
    """Exponents spread over float32's whole range, subnormals and zeros included."""
    def one(*shape):
        e = torch.randint(-140, 60, shape, generator=g).float()
        x = qt.quantize(torch.randn(*shape, generator=g), "bf16") * 2.0 ** e
        x[torch.rand(*shape, generator=g) < 0.1] = 0.0
        return x
    return one(M, K), one(K, N)


def _subnormal(g, M, K, N):
    """a around float32's subnormal range: the -126 clamp of e(a) decides emax."""
    a = torch.randn(M, K, generator=g) * 2.0 ** torch.randint(-150, -120, (M, K), generator=g)
    return a, qt.quantize(torch.randn(K, N, generator=g), "bf16")


def _fp4(g, M, K, N):
    """MXFP4 operands (shared power-of-two scales along K), for the group presets."""
    a = qt.quantize(torch.randn(M, K, generator=g), "mxfp4")
    b = qt.quantize(torch.randn(N, K, generator=g), "mxfp4").t()
    return a, b


CUSTOM = [
    AccumFormat(chunk=4, frac_bits=10, align_rounding="floor"),
    AccumFormat(chunk=8, frac_bits=12, align_rounding="nearest", acc_rounding="nearest"),
    AccumFormat(chunk=8, frac_bits=16, acc_in_alignment=False, acc_man=10, promote=2),
    AccumFormat(chunk=16, frac_bits=20, group=4, promote=1),
    AccumFormat(chunk=2, frac_bits=3, acc_man=5, promote=3),
]
# the one-stage (NVIDIA) datapaths; AMD CDNA3's two stages (stages="cdna3*": their kernel against
# the reference in test_cdna3_kernel_*) are checked against MMA-Sim in tests/test_accum_mmasim.py
FORMATS = [p for p in accum.PRESETS.values() if p.stages == "fused"] + CUSTOM
INPUTS = {"random": lambda g: _random(g, 3, 70, 4),
          "fp8": lambda g: _random(g, 3, 300, 2, "fp8_e4m3"),
          "cancelling": lambda g: _cancelling(g, 3, 64, 3),
          "spread": lambda g: _spread(g, 3, 50, 3),
          "subnormal": lambda g: _subnormal(g, 3, 40, 3)}


@pytest.mark.parametrize("kind", list(INPUTS))
@pytest.mark.parametrize("f", FORMATS, ids=str)
def test_reference_equals_oracle(f, kind):
    if f.group > 1 and kind == "spread":
        pytest.skip("group sums are exact only within 53 bits (documented); see the fp4 test")
    g = torch.Generator().manual_seed(zlib.crc32(f"{f}{kind}".encode()))
    a, b = INPUTS[kind](g)
    got = accum.accum_matmul_reference(a, b, f)
    assert torch.equal(bits(got), bits(oracle(a, b, f)))


@pytest.mark.parametrize("f", [accum.blackwell_mxfp4, accum.blackwell_nvfp4], ids=str)
def test_reference_equals_oracle_fp4(f):
    g = torch.Generator().manual_seed(5)
    a, b = _fp4(g, 3, 256, 3)
    assert torch.equal(bits(accum.accum_matmul_reference(a, b, f)), bits(oracle(a, b, f)))


# ---------------------------------------------------------------------------------------------
# Hand-worked cases of the MMA-Sim rules (the expected values are derived in the comments)

def test_hopper_fp16_drops_terms_below_25_bits():
    # one k16 instruction: 1*1 and fifteen products of 2^-26; emax = 0, F = 25: each small
    # product is 0.5 units of 2^-25 and is truncated to 0, so the sum is exactly 1, where an FP32
    # accumulation gives 1 + 15 * 2^-26 (rounded: 1 + 2^-22)
    a = torch.tensor([[1.0] + [2.0 ** -13] * 15])
    b = a.t().clone()
    assert accum.accum_matmul_reference(a, b, accum.hopper_fp16).item() == 1.0
    assert (a.double() @ b.double()).float().item() == 1.0 + 2.0 ** -22


def test_hopper_fp8_truncates_to_13_bits_and_promotion_recovers():
    # K = 256 products 1 * (1 + 2^-7), exact sum 258. The first 128 (4 chunks) sum exactly to
    # 129 (p < 2^7 there, so emax <= 6 and each 1 + 2^-7 keeps its 7 fractional bits of 13).
    # After that p = 129 > 2^7 takes part in the alignment: each product keeps 13 - 7 = 6
    # fractional bits, its 2^-7 is truncated, and the last 128 products add 128: 257. Promoted
    # every 128 elements, both partials are 129 and the FP32 accumulator gets 258 exactly.
    a = torch.ones(1, 256)
    b = torch.full((256, 1), 1.0 + 2.0 ** -7)
    assert accum.accum_matmul_reference(a, b, accum.hopper_fp8_fast).item() == 257.0
    assert accum.accum_matmul_reference(a, b, accum.hopper_fp8).item() == 258.0
    assert oracle_dot([1.0] * 256, [1.0 + 2.0 ** -7] * 256, accum.hopper_fp8_fast) == 257.0


def test_product_exponent_is_the_sum_of_the_operand_exponents():
    # MMA-Sim aligns a product by e(a) + e(b), its significand in [1, 4), not by the product's
    # own exponent: 1.5 * 1.5 = 2.25 has alignment exponent 0. With F = 2: 2.25 * 4 = 9 and
    # 0.25 * 4 = 1 are kept, 10 / 4 = 2.5. (Aligned to 2^1 it would be trunc(4.5) + trunc(0.5)
    # = 4, i.e. 2.0.)
    a = torch.tensor([[1.5, 0.5]])
    b = torch.tensor([[1.5], [0.5]])
    f = AccumFormat(chunk=2, frac_bits=2)
    assert accum.accum_matmul_reference(a, b, f).item() == 2.5
    assert accum.accum_matmul(a, b, f).item() == 2.5


def test_accumulator_takes_part_in_alignment():
    # p = 2^20 after the first chunk (chunk 1); then the product 1.5 is aligned to 2^20 with
    # F = 4 fractional bits: 1.5 * 2^-20 * 2^4 < 1 is truncated: p stays 2^20. Without the
    # accumulator in the alignment the product survives and a float32 add keeps it.
    a = torch.tensor([[2.0 ** 20, 1.5]])
    b = torch.ones(2, 1)
    with_acc = AccumFormat(chunk=1, frac_bits=4)
    assert accum.accum_matmul_reference(a, b, with_acc).item() == 2.0 ** 20
    without = with_acc.replace(acc_in_alignment=False)
    assert accum.accum_matmul_reference(a, b, without).item() == 2.0 ** 20 + 1.5


def test_nonfinite():
    f = accum.hopper_fp16
    a = torch.tensor([[1.0, -math.inf], [math.inf, 0.0], [math.inf, -math.inf], [1.0, 2.0]])
    b = torch.tensor([[0.0, 1.0], [1.0, 1.0]])
    out = accum.accum_matmul_reference(a, b, f)
    assert out[0, 0].item() == -math.inf
    assert math.isnan(out[1, 0].item())  # inf * 0
    assert math.isnan(out[2, 1].item())  # inf - inf
    assert out[3].tolist() == [2.0, 3.0]
    assert bits(out[1, 0]).item() == bits(torch.tensor(math.nan)).item()


def test_zero_and_empty():
    f = accum.hopper_fp8
    assert torch.equal(bits(accum.accum_matmul_reference(torch.zeros(2, 0), torch.zeros(0, 3), f)),
                       bits(torch.zeros(2, 3)))
    a = torch.tensor([[-1e-30, 1e-30]])
    out = accum.accum_matmul_reference(a, torch.ones(2, 1), f)
    assert bits(out).item() == 0  # +0, not -0


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


# ---------------------------------------------------------------------------------------------
# The compiled kernel: the reference's bits, the op's fake implementation, opcheck

needs_kernel = pytest.mark.skipif(
    not (qt.ops.kernels_available() and hasattr(torch.ops.qtensor, "accum_matmul")),
    reason="the compiled qtensor._C extension (with accum_matmul) is not built")


@needs_kernel
@pytest.mark.parametrize("kind", list(INPUTS) + ["fp4", "batched", "nonfinite"])
@pytest.mark.parametrize("f", FORMATS, ids=str)
def test_kernel_equals_reference(f, kind):
    g = torch.Generator().manual_seed(zlib.crc32(f"{f}{kind}kernel".encode()))
    if kind == "fp4":
        a, b = _fp4(g, 5, 256, 70)
    elif kind == "batched":
        a, b = _random(g, 6, 130, 67, "fp8_e5m2")
        a, b = a.reshape(2, 3, 130), b.reshape(1, 130, 67).expand(2, 130, 67)
    elif kind == "nonfinite":
        a, b = _random(g, 4, 100, 3)
        a[0, 7], a[1, 40], b[90, 2], a[3, 3], b[3, 0] = math.inf, math.nan, -math.inf, 0.0, \
            math.inf
        a[2, 64:] = 1e38  # overflow of the accumulator format
        b[64:, 1] = 1e38
    else:
        a, b = INPUTS[kind](g)
    want = accum.accum_matmul_reference(a, b, f)
    got = accum.accum_matmul(a, b, f)
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert torch.equal(bits(got), bits(want))


def _c_case(g, f, kind):
    """Operands and an initial accumulator for the vector paths with c: rows in blocks of 4 and
    a remainder, columns past a lane panel, a batch; c with zeros, tiny, huge and opposite
    values (and inf/NaN for "nonfinite")."""
    if kind == "fp4":
        a, b = _fp4(g, 7, 200, 19)
    else:
        a, b = _random(g, 7, 150, 19, "fp8_e4m3" if kind == "fp8" else None)
    a, b = a.reshape(1, 7, -1).expand(2, 7, -1).clone(), b
    a[1] *= -0.75
    c = torch.randn(2, 7, 19, generator=g) * torch.exp2(
        torch.randint(-30, 30, (2, 7, 19), generator=g).float())
    c[:, 0] = 0.0
    c[:, 1, :5] = 2.0 ** -140
    c[:, 2, :5] = 1e30
    c[0, 3] = -accum.accum_matmul_reference(a[0, 3:4], b, f)[0]  # cancels the whole sum
    if kind == "nonfinite":
        c[0, 4, 2], c[1, 5, 3], c[1, 6, 0] = math.inf, math.nan, -math.inf
    return a, b, c


@needs_kernel
@pytest.mark.parametrize("kind", ["random", "fp8", "fp4", "nonfinite"])
@pytest.mark.parametrize("f", FORMATS, ids=str)
def test_kernel_initial_accumulator_equals_reference(f, kind):
    """c runs the double lanes and the group tiles (no longer the scalar path): the same bits
    as the reference, with and without group exponents."""
    g = torch.Generator().manual_seed(zlib.crc32(f"{f}{kind}c".encode()))
    a, b, c = _c_case(g, f, kind)
    want = accum.accum_matmul_reference(a, b, f, c=c)
    assert torch.equal(bits(accum.accum_matmul(a, b, f, c=c)), bits(want))
    if f.group > 1:
        K = a.shape[-1]
        ga = torch.randint(-5, 5, (2, 7, -(-K // f.group)), generator=g)
        gb = torch.randint(-5, 5, (-(-K // f.group), 19), generator=g)
        want = accum.accum_matmul_reference(a, b, f, c=c, a_gexp=ga, b_gexp=gb)
        got = accum.accum_matmul(a, b, f, c=c, a_gexp=ga, b_gexp=gb)
        assert torch.equal(bits(got), bits(want))
    empty = accum.accum_matmul(a[..., :0], b[:0], f, c=c)  # K = 0: c itself
    assert torch.equal(bits(empty), bits(c))


@needs_kernel
@pytest.mark.parametrize("isa", ["base", "avx2"])
def test_kernel_initial_accumulator_on_other_isas(isa):
    _pytest_under_isa(isa, "test_kernel_initial_accumulator_equals_reference and "
                           "(hopper_fp8 or blackwell_mxfp4 or ampere_bf16) and (fp8 or fp4)")


@needs_kernel
def test_kernel_large_and_strided():
    g = torch.Generator().manual_seed(0)
    a, b = _random(g, 37, 1000, 129, "fp8_e4m3")
    for f in (accum.hopper_fp8, accum.ampere_bf16):
        want = accum.accum_matmul_reference(a.t().contiguous().t(), b, f)
        got = accum.accum_matmul(a.t().contiguous().t(), b.t().contiguous().t(), f)
        assert torch.equal(bits(got), bits(want))


@needs_kernel
def test_kernel_opcheck_and_fake():
    a, b = torch.randn(2, 3, 40), torch.randn(2, 40, 5)
    args = (a, b, *accum.op_args(accum.hopper_fp8), None, None, None)
    torch.library.opcheck(torch.ops.qtensor.accum_matmul.default, args)
    # with group exponents and an initial accumulator (the scalar path)
    ga, gb = torch.zeros(2, 3, 3, dtype=torch.int32), torch.zeros(2, 3, 5, dtype=torch.int32)
    torch.library.opcheck(torch.ops.qtensor.accum_matmul.default,
                          (a, b, *accum.op_args(accum.blackwell_mxfp4), ga, gb,
                           torch.randn(2, 3, 5)))
    with torch._subclasses.fake_tensor.FakeTensorMode():
        out = torch.ops.qtensor.accum_matmul(torch.empty(2, 3, 40), torch.empty(2, 40, 5),
                                             *args[2:])
        assert out.shape == (2, 3, 5) and out.dtype == torch.float32


@needs_kernel
def test_kernel_argument_errors():
    a, b = torch.randn(1, 3, 8), torch.randn(1, 8, 2)
    good = list(accum.op_args(accum.hopper_fp16)) + [None, None, None]
    with pytest.raises(RuntimeError, match=r"frac_bits must be in \[0, 46\] for chunk=16, "
                                           r"group=1, got 60"):
        torch.ops.qtensor.accum_matmul(a, b, *good[:1], 60, *good[2:])
    with pytest.raises(RuntimeError, match=r"must be float32, got Double"):
        torch.ops.qtensor.accum_matmul(a.double(), b, *good)
    with pytest.raises(RuntimeError, match=r"do not multiply"):
        torch.ops.qtensor.accum_matmul(a, b[:, :5], *good)


def _check_subnormal_results(a, b, f):
    """a @ b with f has results in float32's subnormal range: the kernel gives the reference's
    bits, with torch.set_flush_denormal(True) too (both flushed)."""
    want = accum.accum_matmul_reference(a, b, f)
    assert (want != 0).any() and (want.abs() < 2.0 ** -126).any()
    assert torch.equal(bits(accum.accum_matmul(a, b, f)), bits(want))
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU cannot flush denormals")
    try:
        got = accum.accum_matmul(a, b, f)
        want = accum.accum_matmul_reference(a, b, f)
    finally:
        torch.set_flush_denormal(False)
    assert torch.equal(bits(got), bits(want))


def _run_under_isa(isa, code):
    """Run python code in a subprocess whose kernels are capped at QTENSOR_CPU_ISA=isa (the ISA
    is chosen once per process)."""
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, QTENSOR_CPU_ISA=isa),
                       cwd=root, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]


def _pytest_under_isa(isa, selection):
    """Run this file's tests selected by ``-k selection`` under QTENSOR_CPU_ISA=isa."""
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        os.path.abspath(__file__), "-k", selection],
                       env=dict(os.environ, QTENSOR_CPU_ISA=isa), cwd=root, capture_output=True,
                       text=True, timeout=900)
    assert r.returncode == 0 and " passed" in r.stdout, r.stdout[-3000:] + r.stderr[-2000:]


@needs_kernel
def test_kernel_baseline_isa_path():
    # the loops are compiled for the baseline and for AVX2; QTENSOR_CPU_ISA=base forces the first
    code = (
        "import sys, torch; sys.path.insert(0, 'tests'); import test_accum as T\n"
        "from qtensor import accum\n"
        "for f in T.FORMATS:\n"
        "    for kind in T.INPUTS:\n"
        "        a, b = T.INPUTS[kind](torch.Generator().manual_seed(3))\n"
        "        want = accum.accum_matmul_reference(a, b, f)\n"
        "        got = accum.accum_matmul(a, b, f)\n"
        "        assert torch.equal(T.bits(got), T.bits(want)), (f, kind)\n")
    _run_under_isa("base", code)


@pytest.mark.skipif(not torch.cuda.is_available() or not qt.ops.kernels_available("cuda"),
                    reason="needs CUDA and the CUDA kernels")
@pytest.mark.parametrize("f", FORMATS, ids=str)
def test_cuda_kernel_equals_reference(f):
    g = torch.Generator().manual_seed(11)
    for kind in INPUTS:
        a, b = INPUTS[kind](g)
        want = accum.accum_matmul_reference(a, b, f)
        assert torch.equal(bits(accum.accum_matmul(a.cuda(), b.cuda(), f).cpu()), bits(want))


# ---------------------------------------------------------------------------------------------
# QTensor and qt.convert: contractions summed by the operands' accumulator

def _bits_eq(x, y):
    x = x.dequantize() if isinstance(x, qt.QTensor) else x
    y = y.dequantize() if isinstance(y, qt.QTensor) else y
    return torch.equal(bits(x.float()), bits(y.float()))


def test_qtensor_mm_uses_its_accumulator():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(8, 512, generator=g), torch.randn(512, 6, generator=g)
    qa = qt.as_qtensor(a, "bf16", mm_fmt="fp8_e4m3")
    qb = qt.as_qtensor(b, "bf16", mm_fmt="fp8_e4m3")
    plain = torch.mm(qa, qb)
    qb.accum = accum.hopper_fp8_fast
    out = torch.mm(qa, qb)
    # the operands' format is fp8_e4m3: its subnormals align at its minimum normal exponent -6
    want = qt.quantize(accum.accum_matmul(qt.quantize(qa.dequantize(), "fp8_e4m3"),
                                          qt.quantize(qb.dequantize(), "fp8_e4m3"),
                                          accum.hopper_fp8_fast, a_emin=-6, b_emin=-6), "bf16")
    assert _bits_eq(out, want)
    assert not _bits_eq(out, plain)  # the accumulator changed the result
    assert out.accum is accum.hopper_fp8_fast  # results carry it on
    # matmul / einsum / F.linear / addmm decompose into the same contraction
    assert _bits_eq(qa @ qb, want)
    assert _bits_eq(torch.einsum("ik,kj->ij", qa, qb), want)
    assert _bits_eq(torch.nn.functional.linear(qa, qb.t()), want)
    assert (qb.t()).accum is accum.hopper_fp8_fast  # views keep it


def test_addmm_and_baddbmm_feed_c_into_the_datapath():
    """beta * C of the output's shape is the first instruction's accumulator input (a term of
    its alignment), not an FP32 add afterwards; a broadcast bias stays in the epilogue."""
    f = accum.hopper_fp16
    g = torch.Generator().manual_seed(3)
    a = qt.quantize(torch.randn(4, 48, generator=g), "fp16")
    b = qt.quantize(torch.randn(48, 5, generator=g), "fp16")
    c = torch.randn(4, 5, generator=g) * 2.0 ** 20  # large: it truncates the products' sum
    qa, qb = (qt.as_qtensor(x, "fp32", mm_fmt="fp16") for x in (a, b))  # fp32 results
    qa.accum = f
    got = torch.addmm(c, qa, qb)
    fed = accum.accum_matmul(a, b, f, a_emin=-14, b_emin=-14, c=c)
    assert _bits_eq(got, fed)
    assert not _bits_eq(got, accum.accum_matmul(a, b, f, a_emin=-14, b_emin=-14) + c)  # old
    assert torch.equal(bits(fed), bits(oracle(a, b, f, a_emin=-14, b_emin=-14, c=c)))
    got = torch.baddbmm(c[None], qa[None], qb[None], beta=2.0)
    assert _bits_eq(got, accum.accum_matmul(a, b, f, a_emin=-14, b_emin=-14, c=2 * c)[None])
    bias = c[0]  # (N,): a bias, added after the accumulation
    prod = accum.accum_matmul(a, b, f, a_emin=-14, b_emin=-14)
    assert _bits_eq(torch.addmm(bias, qa, qb), prod + bias)
    got = torch.addmm(c, qa, qb, alpha=0.5)  # alpha != 1: the epilogue
    assert _bits_eq(got, prod * 0.5 + c)


def _linear_model(K=300, N=5):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(K, 16), torch.nn.ReLU(), torch.nn.Linear(16, N))


@pytest.mark.parametrize("init_seed", [0, 1573])  # (1573: a subnormal operand's alignment)
def test_recipe_accumulate_forward_and_backward(init_seed):
    """Recipe(accumulate=...): forward and backward contractions of a converted model, by hand."""
    torch.manual_seed(init_seed)
    fp8 = ("bf16", "fp8_e4m3")
    recipe = qt.Recipe(weight=fp8, bias="bf16", activation=fp8, grad=fp8,
                       accumulate=accum.hopper_fp8_fast)
    assert recipe.accumulate is accum.hopper_fp8_fast
    model = qt.convert(torch.nn.Linear(300, 4, bias=False), recipe)
    x = torch.randn(64, 300, generator=torch.Generator().manual_seed(1))
    y = model(x)
    W = model.weight.dequantize()
    xq = qt.quantize(x, "bf16")
    # (the operands are E4M3 values: a subnormal one aligns at E4M3's emin -6, as the converted
    # model's contraction tells the datapath; without a_emin/b_emin 1 in 2,600 inits differed)
    want = qt.quantize(accum.accum_matmul(qt.quantize(xq, "fp8_e4m3"),
                                          qt.quantize(W, "fp8_e4m3").t(),
                                          accum.hopper_fp8_fast, a_emin=-6, b_emin=-6), "bf16")
    assert _bits_eq(y, want)
    # backward: grad_W = grad_y^T @ x, a contraction over the batch (64 terms), same datapath
    y.backward(torch.ones_like(y.dequantize()))
    gw = accum.accum_matmul(torch.ones(4, 64), qt.quantize(xq, "fp8_e4m3"),
                            accum.hopper_fp8_fast, a_emin=-6, b_emin=-6)
    assert _bits_eq(model.weight.grad, qt.quantize(gw, "bf16"))


def test_recipe_accumulate_changes_training_and_optimizer_works():
    recipe = qt.Recipe(weight=("bf16", "fp8_e4m3"), activation=("bf16", "fp8_e4m3"),
                       grad="bf16", accumulate="hopper_fp8_fast")
    assert recipe.accumulate is accum.hopper_fp8_fast
    assert "accumulate" in recipe.describe() and "hopper_fp8_fast" in recipe.describe()
    m1 = qt.convert(_linear_model(), recipe.replace(accumulate=None))
    m2 = qt.convert(_linear_model(), recipe)
    x = torch.randn(32, 300, generator=torch.Generator().manual_seed(2))
    opt = torch.optim.SGD(m2.parameters(), lr=0.1, momentum=0.9)
    for _ in range(2):
        opt.zero_grad()
        m2(x).float().square().mean().backward()
        opt.step()
    assert m2[0].weight.accum is accum.hopper_fp8_fast  # kept through the in-place updates
    assert not _bits_eq(m1(x), m2(x))


def test_accumulator_survives_save_load_and_deepcopy():
    """A converted model's parameters keep their accumulator through torch.save /
    torch.load(weights_only=True) of the state dict, pickling and deepcopy."""
    import copy
    import io
    import pickle
    recipe = qt.Recipe(weight=("bf16", "fp8_e4m3"), activation=("bf16", "fp8_e4m3"),
                       grad="bf16", accumulate="hopper_fp8")
    model = qt.convert(_linear_model(), recipe)
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    assert loaded["0.weight"].accum == accum.hopper_fp8
    assert pickle.loads(pickle.dumps(model))[0].weight.accum == accum.hopper_fp8
    assert copy.deepcopy(model)[0].weight.accum == accum.hopper_fp8


def test_recipe_accumulate_errors():
    with pytest.raises(AccumFormatError, match=r"unknown accumulator preset 'h100'"):
        qt.Recipe(weight="bf16", accumulate="h100")
    with pytest.raises(TypeError, match=r"Recipe.accumulate must be an AccumFormat"):
        qt.Recipe(weight="bf16", accumulate=13)


CONV_CASES = [(9, 8, 3, 1, 0, 1), (10, 9, 3, 2, 1, 1), (11, 12, 3, 2, 2, 2), (8, 8, 1, 1, 0, 1),
              (12, 11, 5, 3, 2, 1)]


@pytest.mark.parametrize("H, W, k, s, p, d", CONV_CASES)
def test_conv_as_gemm_layout(H, W, k, s, p, d):
    """The conv lowering (forward, grad_input, grad_weight, grad_bias) is the convolution: with a
    nearly exact accumulator it agrees with float64 aten to float32 rounding."""
    f = AccumFormat(chunk=8, frac_bits=45, acc_rounding="nearest")
    g = torch.Generator().manual_seed(H * 100 + k)
    x, w, b = (torch.randn(2, 3, H, W, generator=g), torch.randn(4, 3, k, k, generator=g),
               torch.randn(4, generator=g))
    geo = ([s, s], [p, p], [d, d], False, [0, 0], 1)
    ref = torch.nn.functional.conv2d(x.double(), w.double(), b.double(), stride=s, padding=p,
                                     dilation=d)
    out = accum.contract("convolution", [x, w, b, *geo], {}, f)
    assert out.shape == ref.shape
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=1e-5)
    go = torch.randn(ref.shape, generator=g)
    want = torch.ops.aten.convolution_backward(go.double(), x.double(), w.double(), [4], *geo,
                                               [True, True, True])
    got = accum.contract("convolution_backward", [go, x, w, [4], *geo, [True, True, True]], {}, f)
    for gt, wt in zip(got, want):
        assert gt.shape == wt.shape
        torch.testing.assert_close(gt.double(), wt, rtol=0, atol=1e-5)


def test_conv_forward_is_the_gemm_of_the_accumulator():
    # channels innermost along K: the output is accum_matmul of the (kh, kw, c)-ordered operands
    f = accum.hopper_fp8_fast
    g = torch.Generator().manual_seed(4)
    x = qt.quantize(torch.randn(1, 40, 5, 5, generator=g), "fp8_e4m3")
    w = qt.quantize(torch.randn(2, 40, 3, 3, generator=g), "fp8_e4m3")
    out = accum.contract("convolution", [x, w, None, [1, 1], [0, 0], [1, 1], False, [0, 0], 1],
                         {}, f)
    cols = x.unfold(2, 3, 1).unfold(3, 3, 1)  # (1, C, 3, 3, kh, kw)
    a = w.permute(0, 2, 3, 1).reshape(2, -1)  # (O, kh*kw*C)
    b = cols.permute(0, 4, 5, 1, 2, 3).reshape(9 * 40, 9)  # (kh*kw*C, L)
    assert torch.equal(bits(out.reshape(2, 9)), bits(accum.accum_matmul(a, b, f)))


def test_conv_model_with_accumulator():
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(3, 4, 3, padding=1)
    recipe = qt.Recipe(weight=("bf16", "fp8_e4m3"), activation=("bf16", "fp8_e4m3"),
                       grad="bf16", accumulate=accum.hopper_fp8_fast)
    model = qt.convert(conv, recipe)
    x = torch.randn(2, 3, 6, 6, requires_grad=True)
    y = model(x)
    y.float().sum().backward()
    assert model.weight.grad is not None and x.grad is not None


def test_bad_convolution_gets_torchs_error():
    """A convolution torch refuses is refused alike under the accumulator (its own checks)."""
    model = qt.convert(torch.nn.Conv2d(4, 4, 3, groups=2),
                       qt.Recipe(weight="bf16", activation="bf16", accumulate=accum.hopper_bf16))
    with pytest.raises(RuntimeError, match=r"to have 4 channels, but got 3 channels instead"):
        model(torch.randn(1, 3, 8, 8))
    with pytest.raises(RuntimeError, match=r"Kernel size can't be greater than actual input"):
        model(torch.randn(1, 4, 2, 8))


def test_accumulate_keeps_leak_check_clean():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(20, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    qt.convert(m, qt.Recipe(weight=("bf16", "fp8_e4m3"), activation=("bf16", "fp8_e4m3"),
                            grad=("bf16", "fp8_e5m2"), accumulate="hopper_fp8"))
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    x, y = torch.randn(8, 20), torch.randint(0, 3, (8,))
    with qt.leak_check(action="record", optimizer=opt, check_values=True) as report:
        loss = torch.nn.functional.cross_entropy(m(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert len(report) == 0, report.summary()
    assert m[0].weight.grad.accum is accum.hopper_fp8  # gradients carry it too


def test_accum_study_example_runs(tmp_path):
    """examples/accum_study.py --quick, as a user runs it: both tables, every run, the plots."""
    pytest.importorskip("sklearn", reason="the digits come from scikit-learn")
    pytest.importorskip("matplotlib", reason="the study plots with matplotlib")
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, os.path.join(root, "examples", "accum_study.py"),
                           "--quick", "--out", str(tmp_path)], cwd=root, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    import re
    kscan_heads = re.findall(r"^\| K +\|.*$", proc.stdout, re.M)  # the error-vs-K tables
    assert len(kscan_heads) == 2 and len(re.findall(r"^\| 512 +\|", proc.stdout, re.M)) == 2
    for run in ("fp32", "promote 1", "promote 4", "promote 16", "never", "wide never"):
        # a row of the digits and GPT tables, a column of each error-vs-K table
        assert len(re.findall(rf"^\| {run} +\|", proc.stdout, re.M)) == 2, run
        assert all(re.search(rf"\| +{run} +\|", h) for h in kscan_heads), run
    # the two-reference study: every accumulator's error vs the exact quantized product (small,
    # 0 for the wide ones) and vs the unquantized FP32 product (the quantization's, much larger)
    for run in ("fp32 adds", "hopper_fp8 promote 4", "hopper_fp8 never", "blackwell_f8f6f4"):
        rows = re.findall(rf"^\| {run} +\|(.*)$", proc.stdout, re.M)
        assert len(rows) == 2, run
        dot = [float(x) for x in rows[0].split("|")[1:-1]]  # datapath, 2 x exact, 2 x fp32
        lg = [float(x) for x in rows[1].split("|")[:-1] if x.strip()]
        assert max(dot[:2]) < min(dot[2:]) / 10 and lg[0] < lg[1] / 10, (run, dot, lg)
    assert {p.name for p in tmp_path.iterdir()} >= {
        "accum_study.md", "accum_study_digits.png", "accum_study_gpt.png", "accum_study_k.md",
        "accum_study_k.png", "accum_study_refs.md", "accum_study_refs.png"}


# ---------------------------------------------------------------------------------------------
# Convolutions of every kind through converted modules: 1-, 2-, 3-D, grouped, depthwise,
# transposed (output_padding), padding beyond the dilated kernel, string padding; forward and
# every gradient.

_nn = torch.nn
# name: (module class, in channels, out channels, kernel, keyword arguments, input size)
CONV_MODULES = {
    "1d_stride": (_nn.Conv1d, 4, 6, 3, dict(stride=2, padding=1), (11,)),
    "1d_depthwise_dil": (_nn.Conv1d, 4, 4, 3, dict(groups=4, dilation=2, padding=2), (9,)),
    "1d_pad_beyond": (_nn.Conv1d, 2, 3, 2, dict(padding=3, stride=2), (5,)),
    "2d_groups": (_nn.Conv2d, 4, 6, (3, 2), dict(groups=2, stride=(2, 1), padding=(1, 2),
                                                 dilation=(1, 2)), (7, 8)),
    "2d_depthwise_x2_same": (_nn.Conv2d, 3, 6, 3, dict(groups=3, padding="same", dilation=2),
                             (6, 7)),
    "2d_same_even": (_nn.Conv2d, 2, 3, (2, 4), dict(padding="same"), (5, 6)),
    "2d_valid": (_nn.Conv2d, 2, 3, 2, dict(padding="valid"), (4, 5)),
    "2d_pad_beyond": (_nn.Conv2d, 3, 2, 2, dict(padding=(3, 2), stride=2), (5, 4)),
    "3d": (_nn.Conv3d, 2, 4, 2, dict(stride=(1, 2, 1), padding=1), (4, 5, 3)),
    "3d_groups": (_nn.Conv3d, 4, 4, (1, 2, 3), dict(groups=2, dilation=(1, 1, 2),
                                                    padding=(0, 1, 3)), (3, 4, 6)),
    "t1d_out_pad": (_nn.ConvTranspose1d, 3, 4, 3, dict(stride=3, padding=1, output_padding=2),
                    (5,)),
    "t1d_out_pad_beyond_stride": (_nn.ConvTranspose1d, 2, 2, 2, dict(dilation=3,
                                                                      output_padding=2), (4,)),
    "t2d_groups": (_nn.ConvTranspose2d, 4, 6, (3, 2), dict(groups=2, stride=(2, 3),
                                                           padding=(1, 0), output_padding=(1, 2),
                                                           dilation=(1, 2)), (4, 5)),
    "t2d_depthwise": (_nn.ConvTranspose2d, 3, 3, 3, dict(groups=3, stride=2, dilation=2,
                                                         output_padding=1), (4, 4)),
    "t2d_pad_beyond": (_nn.ConvTranspose2d, 2, 3, 2, dict(stride=3, padding=2), (5, 4)),
    "t3d": (_nn.ConvTranspose3d, 2, 2, 2, dict(stride=(1, 2, 1), dilation=(2, 1, 1),
                                               output_padding=(1, 1, 0)), (3, 3, 4)),
}
_FP32 = dict(weight="fp32", bias="fp32", activation="fp32", grad="fp32")


def _conv_run(name, f, values):
    """The module ``name`` run plain and converted with accumulator f (float32 formats, so the
    accumulator is the only difference): (module, x, go, plain results, converted results), the
    results being (y, x.grad, weight.grad, bias.grad)."""
    cls, cin, cout, k, kw, size = CONV_MODULES[name]
    torch.manual_seed(zlib.crc32(name.encode()))
    m = cls(cin, cout, k, **kw)
    with torch.no_grad():
        m.weight.copy_(values(m.weight.shape))
        m.bias.copy_(values(m.bias.shape))
    x = values((2, cin, *size))
    q = qt.convert(copy.deepcopy(m), qt.Recipe(**_FP32, accumulate=f))
    results, go = [], None
    for mod in (m, q):
        xi = x.clone().requires_grad_()
        y = mod(xi)
        go = values(y.shape) if go is None else go
        y.backward(go)
        results.append([t.dequantize() if isinstance(t, qt.QTensor) else t.detach()
                        for t in (y, xi.grad, mod.weight.grad, mod.bias.grad)])
    return m, x, go, results[0], results[1]


def _small_ints(shape):
    return torch.randint(-3, 4, tuple(shape)).float()


@pytest.mark.parametrize("name", list(CONV_MODULES))
def test_conv_exact_on_small_integers(name):
    """With small integer operands and an accumulator that drops no bit, every convolution and
    each of its gradients is the exact sum: torch's float32 result, bit for bit (a wrong window,
    tap, channel or group mapping changes it)."""
    wide = AccumFormat(chunk=4, frac_bits=30, promote=3)
    *_, plain, conv = _conv_run(name, wide, _small_ints)
    for what, want, got in zip(("y", "grad_input", "grad_weight", "grad_bias"), plain, conv):
        assert got.shape == want.shape, what
        assert torch.equal(bits(got), bits(want)), what


def _geometry(m):
    k = m.kernel_size
    pad = m.padding
    if isinstance(pad, str):  # 'same': total d*(k-1), the smaller half on the left; 'valid': 0
        pad = [d * (kk - 1) // 2 if pad == "same" else 0 for d, kk in zip(m.dilation, k)]
    return k, m.stride, pad, m.dilation, m.groups


def _taps(k):
    return itertools.product(*(range(kk) for kk in k))


def _gather_conv(x, w, geo, n, o, pos):
    """The dot product vectors of output (n, o, *pos) of the forward convolution of x with w
    (O, C/groups, *k), in the K order (kernel position, channel of the group)."""
    k, stride, pad, dil, groups = geo
    cg, og = w.shape[1], w.shape[0] // groups
    xs, ws = [], []
    for j in _taps(k):
        q = [p * s - pd + jj * d for p, s, pd, jj, d in zip(pos, stride, pad, j, dil)]
        inside = all(0 <= qq < sz for qq, sz in zip(q, x.shape[2:]))
        for c in range(cg):
            xs.append(x[(n, o // og * cg + c, *q)].item() if inside else 0.0)
            ws.append(w[(o, c, *j)].item())
    return xs, ws


def _gather_conv_transpose(x, w, geo, n, o, pos):
    """The same for the transposed convolution of x with w (C, O/groups, *k): the forward
    convolution over x with (stride - 1) zeros between its elements, the kernel flipped: K =
    (flipped kernel position, channel of the group); the inserted zeros take their slots."""
    k, stride, pad, dil, groups = geo
    og, cg = w.shape[1], w.shape[0] // groups
    xs, ws = [], []
    for jf in _taps(k):
        j = [kk - 1 - a for kk, a in zip(k, jf)]
        num = [p + pd - jj * d for p, pd, jj, d in zip(pos, pad, j, dil)]
        t = [u // s for u, s in zip(num, stride)]
        inside = all(u % s == 0 and 0 <= tt < sz
                     for u, s, tt, sz in zip(num, stride, t, x.shape[2:]))
        for c in range(cg):
            xs.append(x[(n, o // og * cg + c, *t)].item() if inside else 0.0)
            ws.append(w[(o // og * cg + c, o % og, *j)].item())
    return xs, ws


def _gather_weight_grad(x, go, geo, o, c, j):
    """The vectors of weight gradient (o, c, *j) of the forward convolution x -> go: K =
    (batch, output position)."""
    k, stride, pad, dil, groups = geo
    cg, og = x.shape[1] // groups, go.shape[1] // groups
    xs, gs = [], []
    for n in range(x.shape[0]):
        for pos in _taps(go.shape[2:]):
            q = [p * s - pd + jj * d for p, s, pd, jj, d in zip(pos, stride, pad, j, dil)]
            inside = all(0 <= qq < sz for qq, sz in zip(q, x.shape[2:]))
            xs.append(x[(n, o // og * cg + c, *q)].item() if inside else 0.0)
            gs.append(go[(n, o, *pos)].item())
    return xs, gs


def _dot(xs, ws, f):
    return accum.accum_matmul_reference(torch.tensor([xs]), torch.tensor([ws]).t(), f)[0, 0]


@pytest.mark.parametrize("name", list(CONV_MODULES))
def test_conv_and_gradients_are_dots_of_the_accumulator(name):
    """With a truncating accumulator, elements of the output, grad_input and grad_weight are
    accum_matmul_reference of their dot product vectors gathered by hand in the documented K
    order, and the convolution differs from float32."""
    trunc = AccumFormat(chunk=4, frac_bits=7, acc_man=9, promote=3)
    m, x, go, plain, (y, gi, gw, gb) = _conv_run(name, trunc, torch.randn)
    geo, w = _geometry(m), m.weight.detach()
    transposed = isinstance(m, torch.nn.modules.conv._ConvTransposeNd)
    fwd, adj = ((_gather_conv_transpose, _gather_conv) if transposed
                else (_gather_conv, _gather_conv_transpose))
    for what, got, want in zip(("y", "grad_input", "grad_weight"), (y, gi, gw), plain):
        assert not torch.equal(bits(got), bits(want)), f"{what} is float32's"
        n = got.numel()
        for flat in (0, n // 3, n // 2, n - 1):
            idx = [int(i) for i in torch.unravel_index(torch.tensor(flat), got.shape)]
            if what == "y":
                ref = _dot(*fwd(x, w, geo, *idx[:2], idx[2:]), trunc) + m.bias[idx[1]].detach()
            elif what == "grad_input":
                ref = _dot(*adj(go, w, geo, *idx[:2], idx[2:]), trunc)
            else:  # a transposed convolution's weight is that of the forward map go -> x
                a, b = (go, x) if transposed else (x, go)
                ref = _dot(*_gather_weight_grad(a, b, geo, *idx[:2], idx[2:]), trunc)
            assert torch.equal(bits(got[tuple(idx)]), bits(ref)), (what, idx)


def test_conv_model_trains_with_accumulator():
    """A user's model (Conv1d, grouped Conv2d, ConvTranspose2d) trains under an accumulator with
    a real optimizer: losses finite and decreasing, no leak, and not float32's training."""
    def model():
        torch.manual_seed(0)
        return _nn.Sequential(
            _nn.Conv1d(3, 8, 3, padding=1), _nn.ReLU(), _nn.Unflatten(2, (4, 4)),
            _nn.Conv2d(8, 8, 3, padding=1, groups=4), _nn.ReLU(),
            _nn.ConvTranspose2d(8, 2, 2, stride=2), _nn.Flatten(),
            _nn.Linear(128, 3))
    g = torch.Generator().manual_seed(1)
    x, target = torch.randn(16, 3, 16, generator=g), torch.randint(0, 3, (16,), generator=g)
    fp8 = ("fp32", "fp8_e4m3")  # float32 values (outputs keep the accumulator's 13 bits)
    recipe = qt.Recipe(weight=fp8, activation=fp8, grad=("fp32", "fp8_e5m2"))
    runs = {}
    for acc in (None, accum.hopper_fp8):
        m = qt.convert(model(), recipe.replace(accumulate=acc))
        opt = torch.optim.SGD(m.parameters(), lr=0.02, momentum=0.9)
        losses = []
        with qt.leak_check(action="record", optimizer=opt, check_values=True) as report:
            for _ in range(6):
                loss = torch.nn.functional.cross_entropy(m(x), target)
                opt.zero_grad()
                loss.backward()
                opt.step()
                losses.append(loss.item())
        assert len(report) == 0, report.summary()
        assert all(math.isfinite(v) for v in losses), losses
        assert all(b < a for a, b in zip(losses, losses[1:])), losses
        runs[acc] = losses
    assert m[5].weight.grad.accum is accum.hopper_fp8
    assert runs[None] != runs[accum.hopper_fp8]  # the accumulator took part


# ---------------------------------------------------------------------------------------------
# The kernel's float32/int32 fast path (csrc/cpu/accum_fast.h, AVX-512 CPUs): taken when every
# product is exact and normal in float32 and a chunk's terms sum in int32, with a fallback to the
# double path for a tile whose emax or sums leave that range. The same calls run the double path
# where the fast one is refused (or under QTENSOR_CPU_ISA), so each must give the reference's bits.

FAST_FORMATS = [
    accum.hopper_fp8, accum.hopper_fp8_fast, accum.hopper_bf16, accum.volta_fp16,
    AccumFormat(chunk=32, frac_bits=13, align_rounding="floor", acc_man=13, promote=4),
    AccumFormat(chunk=32, frac_bits=13, align_rounding="nearest", acc_rounding="nearest"),
    AccumFormat(chunk=16, frac_bits=25, align_rounding="nearest", acc_rounding="nearest"),
    AccumFormat(chunk=16, frac_bits=10, align_rounding="floor", acc_in_alignment=False,
                acc_man=10, acc_rounding="nearest", promote=3),
    AccumFormat(chunk=8, frac_bits=3, align_rounding="nearest", acc_man=5),
    AccumFormat(chunk=24, frac_bits=0, align_rounding="floor", acc_man=2, promote=2),
    AccumFormat(chunk=16, frac_bits=28, acc_in_alignment=False),  # the widest terms it takes
    # the other two pairings of p in/out of the alignment and the accumulator rounding (the
    # AVX2 build compiles each pairing apart: accum_fast.h's FIN)
    AccumFormat(chunk=16, frac_bits=20, align_rounding="nearest", acc_man=12,
                acc_rounding="nearest"),
    AccumFormat(chunk=32, frac_bits=16, align_rounding="floor", acc_in_alignment=False,
                acc_rounding="nearest", promote=2),
    # chunks whose sums can pass 2^31 (two int32 halves, the finish in doubles: accum_fast.h's
    # finish_wide), toward zero to 24 or fewer bits or to nearest 24 bits
    accum.blackwell_f8f6f4,
    AccumFormat(chunk=32, frac_bits=26, align_rounding="floor", acc_man=13, promote=2),
    AccumFormat(chunk=24, frac_bits=25, align_rounding="nearest", acc_rounding="nearest",
                acc_in_alignment=False),
    # an FP16 accumulator (its subnormal grid, p's clamp at -14, e_zero -21 checked per chunk)
    accum.hopper_fp8_f16,
    accum.hopper_fp8_f16.replace(align_rounding="floor", promote=2),
    accum.hopper_fp8_f16.replace(acc_in_alignment=False, e_zero=None),
]
FAST_OPERANDS = ["fp8_e4m3", "fp8_e5m2", "bf16", "fp16", "fp6_e2m3", "fp4_e2m1"]


def _fast_case(seed, M, K, N, fmt):
    """Operands of format fmt with zero rows, columns and runs, and mixed signs."""
    g = torch.Generator().manual_seed(seed)
    a, b = _random(g, M, K, N, fmt)
    a[1 % M, 5:30] = 0.0
    b[:, 3 % N] = 0.0
    b[10:20] *= -1.0
    return a, b


@needs_kernel
@pytest.mark.parametrize("fmt", FAST_OPERANDS)
@pytest.mark.parametrize("f", FAST_FORMATS, ids=str)
def test_fast_path_equals_reference(f, fmt):
    # M = 7: an 8-row tile cut short (two 4-row exponent groups, the second partial); K = 77: a
    # partial last chunk for every chunk size; N = 37: two 16-lane panels and a partial one
    a, b = _fast_case(zlib.crc32(f"{f}{fmt}fast".encode()), 7, 77, 37, fmt)
    want = accum.accum_matmul_reference(a, b, f)
    assert torch.equal(bits(accum.accum_matmul(a, b, f)), bits(want))


@needs_kernel
@pytest.mark.parametrize("in_alignment", [True, False])
@pytest.mark.parametrize("rounding", accum.ALIGN_ROUNDINGS)
def test_fast_path_tiny_terms(rounding, in_alignment):
    """Products 2^-40 .. 2^40 apart: most terms are scaled far below 1, where toward_zero and
    nearest give 0 and floor gives -1 for a negative one; the partial p is often the largest."""
    g = torch.Generator().manual_seed(7)
    a, b = _random(g, 9, 200, 21, "fp8_e4m3")
    a = a * 2.0 ** torch.randint(-20, 21, a.shape, generator=g).float()
    b = b * 2.0 ** torch.randint(-20, 21, b.shape, generator=g).float()
    for promote in (None, 2):
        f = AccumFormat(chunk=32, frac_bits=13, align_rounding=rounding, acc_man=13,
                        acc_in_alignment=in_alignment, promote=promote)
        want = accum.accum_matmul_reference(a, b, f)
        assert torch.equal(bits(accum.accum_matmul(a, b, f)), bits(want)), promote


@needs_kernel
@pytest.mark.parametrize("f", [accum.hopper_fp8, accum.hopper_bf16,
                               AccumFormat(chunk=4, frac_bits=2, align_rounding="floor")], ids=str)
def test_fast_path_boundaries(f):
    """Operands at the edges of the fast path's range, and past them (double path or tile
    fallback): each must keep the reference's bits."""
    g = torch.Generator().manual_seed(11)
    cases = {}
    a, b = _random(g, 5, 64, 18, "bf16")
    # the largest significands, all one sign: the int32 sums come closest to 2^31
    cases["full sums"] = (torch.full((5, 64), 2 - 2 ** -7), torch.full((64, 18), 2 - 2 ** -7))
    # a partial just below the largest product's alignment exponent, then a chunk of the largest
    # products: with p's term the sum comes to 2^31 (hopper_bf16: those tiles fall back)
    x = torch.zeros(5, 64)
    y = torch.zeros(64, 18)
    x[:, 0], y[0] = 1.5 * 2.0 ** 6, 2.0 ** 4
    x[:, 16:32], y[16:32] = (2 - 2 ** -7) * 2.0 ** 5, (2 - 2 ** -7) * 2.0 ** 5
    cases["p's term at 2^31"] = (x, y)
    # products above 2^frac_bits (the scale is a multiply) with zero products among them
    z = a.clone()
    z[:, ::3] = 0.0
    cases["large products, zeros"] = (z * 2.0 ** 20, b * 2.0 ** 20)
    # emax growing past the fast path's limit in some rows only (those tiles fall back)
    big = a.clone()
    big[2:4, 40:] *= 2.0 ** 60
    cases["emax limit"] = (big, b * 2.0 ** 50)
    # products at float32's ends: the exponent checks of the glue
    cases["tiny products"] = (a * 2.0 ** -60, b * 2.0 ** -60)
    cases["huge products"] = (a * 2.0 ** 60, b * 2.0 ** 60)
    cases["overflow"] = (a * 2.0 ** 63, b * 2.0 ** 63)
    cases["subnormal operand"] = (torch.where(a == a.max(), 2.0 ** -130, a), b)
    cases["float32 operand"] = (a, torch.randn(64, 18, generator=g))
    cases["fp16 x bf16"] = (qt.quantize(a, "fp16"), b)
    cases["float32 x fp4"] = (torch.randn(5, 64, generator=g), qt.quantize(b, "fp4_e2m1"))
    cases["nonfinite"] = (torch.where(a == a.max(), math.inf, a), b)
    cases["zeros"] = (torch.zeros(5, 64), b)
    cases["K = 0"] = (torch.zeros(5, 0), torch.zeros(0, 18))
    for name, (x, y) in cases.items():
        want = accum.accum_matmul_reference(x, y, f)
        assert torch.equal(bits(accum.accum_matmul(x, y, f)), bits(want)), name


@needs_kernel
@pytest.mark.parametrize("f", [accum.hopper_fp8_f16, accum.hopper_fp8_f16.replace(promote=2),
                               accum.blackwell_f8f6f4], ids=str)
def test_fast_path_narrow_and_split_edges(f):
    """The fast path's FP16 accumulator (hopper_fp8_f16) and split sums (blackwell_f8f6f4) at
    their edges, each with the reference's bits: chunks whose products are all below e_zero
    (2^-21: a zero product or padding slot sets emax there; the tile is redone), FP16 subnormal
    and overflowing partials (inf: redone), partials that cancel to 0 mid-K, sums near 2^32."""
    g = torch.Generator().manual_seed(31)
    a, b = _random(g, 9, 100, 20, "fp8_e4m3")
    cases = {}
    tiny = a.clone()
    tiny[:4] *= 2.0 ** -9  # products down to 2^-36: below e_zero, some chunks only these
    tiny[2, 32:64] = 0.0
    cases["below e_zero"] = (tiny, b * 2.0 ** -6)
    cases["fp16 subnormal results"] = (a * 2.0 ** -7, b * 2.0 ** -6)
    big = a.clone()
    big[3:5] = 448.0
    cases["fp16 overflow"] = (big, b.abs() * 2.0 ** 4)
    x, y = a.clone(), b.clone()
    x[:, 32:64], y[32:64] = 1.0, 0.0
    x[:, 0:32], y[0:16], y[16:32] = 2.0, 3.0, -3.0  # the first chunk cancels: p = 0
    cases["p cancels"] = (x, y)
    cases["full sums"] = (torch.full((9, 100), 448.0), torch.full((100, 20), -448.0))
    for name, (x, y) in cases.items():
        x, y = qt.quantize(x, "fp8_e4m3"), qt.quantize(y, "fp8_e4m3")
        want = accum.accum_matmul_reference(x, y, f)
        assert torch.equal(bits(accum.accum_matmul(x, y, f)), bits(want)), name


@needs_kernel
@pytest.mark.parametrize("f", [accum.blackwell_mxf8f6f4, accum.hopper_fp8,
                               accum.hopper_fp8_f16], ids=str)
def test_fast_path_per_element_clamps(f):
    """Per-element clamps (a_emin/b_emin tensors: MX operands' block minimum normal exponents,
    which QTensor contractions pass where an element is subnormal) in the fast path's int8
    exponents and in the tiles it redoes: the reference's bits, for MXFP8 operands with subnormal
    elements and for random clamps."""
    g = torch.Generator().manual_seed(17)
    a = torch.randn(9, 96, generator=g)
    a[:, ::5] *= 2.0 ** -15  # E4M3 subnormals in their blocks
    b = torch.randn(96, 20, generator=g) * 2.0 ** torch.randint(-4, 4, (96, 1), generator=g)
    fa = qt.formats.format("mxfp8_e4m3")
    qa, qb = qt.quantize(a, fa), qt.quantize(b.t(), fa).t()
    oa, ob = (types.SimpleNamespace(mm_fmt=fa) for _ in range(2))
    ea, eb = accum._mx_emin(qa, oa, -1), accum._mx_emin(qb, ob, -2)
    assert ea is not None and eb is not None
    for x, y in ((ea, eb), (ea, None), (torch.randint(-30, 0, (9, 96), generator=g),
                                        torch.randint(-30, 0, (96, 20), generator=g))):
        want = accum.accum_matmul_reference(qa, qb, f, a_emin=x, b_emin=y)
        got = accum.accum_matmul(qa, qb, f, a_emin=x, b_emin=y)
        assert torch.equal(bits(got), bits(want))


@needs_kernel
def test_fast_path_batched_and_strided():
    g = torch.Generator().manual_seed(5)
    a, b = _random(g, 3 * 36, 100, 50, "fp8_e4m3")  # 36 rows: four 8-row tiles and a 4-row one
    a, b = a.reshape(3, 36, 100), b.t().contiguous().t()
    for f in (accum.hopper_fp8, accum.hopper_bf16):
        want = accum.accum_matmul_reference(a, b, f)
        assert torch.equal(bits(accum.accum_matmul(a, b, f)), bits(want))


@needs_kernel
@pytest.mark.parametrize("isa", ["base", "avx2"])
def test_fast_path_cases_on_other_isas(isa):
    """QTENSOR_CPU_ISA caps the instruction set: the same cases through the double lanes (base)
    or the AVX2 fast path (avx2; all of its cases: test_fast_path_avx2)."""
    code = (
        "import sys, torch, zlib; sys.path.insert(0, 'tests'); import test_accum as T\n"
        "from qtensor import accum\n"
        "for f in T.FAST_FORMATS:\n"
        "    for fmt in T.FAST_OPERANDS[:3]:\n"
        "        a, b = T._fast_case(zlib.crc32(f'{f}{fmt}'.encode()), 5, 40, 19, fmt)\n"
        "        want = accum.accum_matmul_reference(a, b, f)\n"
        "        got = accum.accum_matmul(a, b, f)\n"
        "        assert torch.equal(T.bits(got), T.bits(want)), (f, fmt)\n")
    _run_under_isa(isa, code)


@needs_kernel
def test_fast_path_avx2():
    """The AVX2 fast path (csrc/cpu/accum_fast_avx2.h: 8 lanes, no embedded rounding, exponent
    arithmetic in place of getexp/scalef) on every test_fast_path_* case of this file (all three
    alignment roundings, p in and out of the alignment, promotion, boundary operands, tiles that
    fall back, flush-denormal), bit for bit against the reference: pytest in a subprocess with
    QTENSOR_CPU_ISA=avx2. On an AVX-512 CPU the tests above run the AVX-512 build of the same
    algorithm; on an AVX2-only CPU this repeats them."""
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        pytest.skip("this CPU has no AVX2")
    _pytest_under_isa("avx2", "fast_path and not on_other_isas and not avx2")


@needs_kernel
def test_fast_path_with_flush_denormal():
    """Results in float32's subnormal range (the accumulator format's grid goes below 2^-126):
    with torch.set_flush_denormal(True) the kernel still gives the reference's bits."""
    g = torch.Generator().manual_seed(9)
    a, b = _random(g, 6, 96, 20, "fp8_e4m3")
    a, b = a * 2.0 ** -60, b * 2.0 ** -60
    f = AccumFormat(chunk=32, frac_bits=13, acc_man=13, promote=2)
    _check_subnormal_results(a, b, f)


# ---------------------------------------------------------------------------------------------
# Full float32 operands (up to 24 + 24 significant bits): products exact in double, not in
# float32, so no fast path; the double lanes (csrc/cpu/accum_lanes.h's dot_lanes: on AVX-512 one
# zmm per 8 outputs, the terms converted to int64 with the alignment rounding and summed in int64)
# must give the reference's bits over the whole range: exponent spread, cancellation, products at
# float32's and the format's ends, subnormal and non-finite operands.

FP32_FORMATS = FAST_FORMATS + [
    AccumFormat(chunk=8, frac_bits=47, align_rounding="nearest"),  # terms near 2^49 (int64)
    AccumFormat(chunk=2, frac_bits=49, align_rounding="floor", acc_in_alignment=False, promote=3),
]


def _fp32_cases(seed):
    g = torch.Generator().manual_seed(seed)

    def spread(*shape, lo=-60, hi=61):
        return torch.randn(*shape, generator=g) * 2.0 ** torch.randint(lo, hi, shape, generator=g)
    a, b = _random(g, 9, 77, 21)  # a 9-row tile and 3 panels cut short, a partial last chunk
    cases = {"random": (a, b), "spread": (spread(5, 90), spread(90, 11))}
    c = torch.randn(4, 64, generator=g)  # +-pairs of products that cancel, small ones between
    c[:, 1::2] = -c[:, ::2] * (1 + 2.0 ** -23)
    cases["cancelling"] = (c, torch.randn(64, 9, generator=g).repeat_interleave(2, 0)[:64]
                           * torch.where(torch.arange(64) % 4 < 2, 1.0, 2.0 ** -30)[:, None])
    cases["huge products"] = (a * 2.0 ** 100, b * 2.0 ** 27)  # near 2^127: beyond fp32's sums
    cases["tiny products"] = (a * 2.0 ** -100, b * 2.0 ** -40)  # below 2^-126, exact in double
    cases["float32 ends"] = (spread(6, 40, lo=-149, hi=128), spread(40, 10, lo=-149, hi=128))
    x, y = _subnormal(g, 5, 40, 12)
    cases["subnormal"] = (x, y * torch.randn(40, 12, generator=g))
    nf = a.clone()
    nf[0, 3], nf[2, 10], nf[3, 20] = math.inf, -math.inf, math.nan
    zb = b.clone()
    zb[3, :4] = 0.0  # inf * 0: NaN
    cases["nonfinite"] = (nf, zb)
    return cases


@needs_kernel
@pytest.mark.parametrize("f", FP32_FORMATS, ids=str)
def test_fp32_operands_equal_reference(f):
    for name, (a, b) in _fp32_cases(zlib.crc32(f"{f}fp32".encode())).items():
        want = accum.accum_matmul_reference(a, b, f)
        assert torch.equal(bits(accum.accum_matmul(a, b, f)), bits(want)), name


@needs_kernel
def test_fp32_operands_batched_strided_and_every_rounding():
    g = torch.Generator().manual_seed(3)
    a = torch.randn(2, 20, 130, generator=g)
    b = torch.randn(2, 37, 130, generator=g).transpose(1, 2)  # strided
    for rounding, in_alignment, promote in itertools.product(
            accum.ALIGN_ROUNDINGS, (True, False), (None, 2)):
        f = AccumFormat(chunk=32, frac_bits=20, align_rounding=rounding, acc_man=13,
                        acc_in_alignment=in_alignment, promote=promote)
        want = accum.accum_matmul_reference(a, b, f)
        assert torch.equal(bits(accum.accum_matmul(a, b, f)), bits(want)), f


@needs_kernel
@pytest.mark.parametrize("isa", ["base", "avx2"])
def test_fp32_operands_on_other_isas(isa):
    """The tests above under QTENSOR_CPU_ISA=base|avx2 (the baseline and AVX2 double lanes), in a
    subprocess."""
    _pytest_under_isa(isa, "fp32_operands and not other_isas")


@needs_kernel
def test_fp32_operands_recipe_accumulate():
    """A model converted with a float32 weight role and an accumulator: its contractions take
    the unrounded float32 operands (no fast path) and give the reference's bits."""
    recipe = qt.Recipe(weight="fp32", accumulate=accum.hopper_bf16)
    torch.manual_seed(0)
    model = qt.convert(torch.nn.Linear(300, 5, bias=False), recipe)
    assert model.weight.accum is accum.hopper_bf16
    x = torch.randn(33, 300, generator=torch.Generator().manual_seed(4))
    W = model.weight.dequantize().detach()
    assert W.view(torch.int32).bitwise_and(0xFFFF).any()  # wider than bf16: full float32
    y = model(x)
    want = accum.accum_matmul_reference(x, W.t(), accum.hopper_bf16)
    assert _bits_eq(y, want)
    assert not _bits_eq(y, x @ W.t())  # the accumulator took part


@pytest.mark.parametrize("name", ["2d_groups", "t2d_groups"])
def test_conv_empty_batch(name):
    """An empty batch gives empty outputs and input gradient, zero weight gradient, as torch."""
    cls, cin, cout, k, kw, size = CONV_MODULES[name]
    m = qt.convert(cls(cin, cout, k, **kw), qt.Recipe(**_FP32, accumulate=accum.hopper_fp8))
    x = torch.randn(0, cin, *size, requires_grad=True)
    y = m(x)
    y.sum().backward()
    plain = cls(cin, cout, k, **kw)(x.detach())
    assert y.shape == plain.shape and x.grad.shape == x.shape
    assert torch.equal(bits(m.weight.grad.dequantize()), bits(torch.zeros(m.weight.shape)))


@needs_kernel
@pytest.mark.parametrize("flush", [False, True])
def test_fast_path_floor_of_a_subnormal_term(flush):
    """floor aligns a tiny negative partial to -1: here p = -2^-126 (two products of 2^-113
    cancelling under floor) meets products of 2^14, so p's scaled term is -2^-127, subnormal
    (flushed to -0 under torch.set_flush_denormal), whose floor is still -1."""
    a = torch.tensor([[(1 + 2 ** -10) * 2.0 ** -56, 2.0 ** -56, 2.0 ** 7, 2.0 ** 7]])
    b = torch.tensor([[-(1 + 2 ** -10) * 2.0 ** -57], [(1 + 2 ** -9) * 2.0 ** -57], [2.0 ** 7],
                      [2.0 ** 6]]).expand(4, 17).contiguous()
    f = AccumFormat(chunk=2, frac_bits=13, align_rounding="floor")
    want = accum.accum_matmul_reference(a, b, f)
    assert want[0, 0].item() == 2.0 ** 14 + 2.0 ** 13 - 2.0 ** 1  # the -1 at 2^(14 - 13)
    if flush and not torch.set_flush_denormal(True):
        pytest.skip("this CPU cannot flush denormals")
    try:
        got = accum.accum_matmul(a, b, f)
    finally:
        torch.set_flush_denormal(False)
    assert torch.equal(bits(got), bits(want))


# The lean tiles (csrc/cpu/accum_fast.h's lean_tile): full 8-row tiles of the NVIDIA presets'
# datapath (alignment and result toward zero, p in the alignment, a float32 accumulator), the
# chunk a compile-time constant for 4, 8, 16 and 32 (else read at run time), the emax checks once
# per chunk over the 8 rows. The other tests above mostly use 5-7 rows (no full tile).
LEAN_FORMATS = [
    (accum.volta_fp16, "fp16"), (accum.ampere_tf32, "tf32"), (accum.ampere_bf16, "bf16"),
    (accum.hopper_fp16, "fp16"), (accum.hopper_fp8, "fp8_e4m3"), (accum.ada_fp8, "fp8_e5m2"),
    (accum.hopper_fp8_fast, "fp8_e4m3"), (accum.blackwell_tf32, "tf32"),
    (AccumFormat(chunk=5, frac_bits=11, acc_man=7, promote=3), "bf16"),  # chunk at run time
    (AccumFormat(chunk=4, frac_bits=9, acc_man=4, promote=1), "fp8_e4m3"),  # every chunk promotes
]


def _lean_cases(g, fmt, M=17, K=77, N=37):
    """Operands of format fmt (M = 17: two full 8-row tiles and one row; K = 77: a short last
    chunk for every chunk size; N = 37: a partial 16-lane panel), each stressing one step."""
    def q(x):
        return qt.quantize(x, fmt)
    a, b = torch.randn(M, K, generator=g), torch.randn(K, N, generator=g)
    cases = {"random": (q(a), q(b))}
    ea = torch.randint(-10, 11, (M, K), generator=g).float()
    eb = torch.randint(-10, 11, (K, N), generator=g).float()
    cases["exponent spread"] = (q(a * 2.0 ** ea), q(b * 2.0 ** eb))
    # the format's subnormals (normal in float32): their alignment exponents are clamped
    tiny = {"fp16": -16, "tf32": -128, "bf16": -128, "fp8_e4m3": -8, "fp8_e5m2": -16}[fmt]
    sub = a.clone()
    sub[:, ::3] *= 2.0 ** (tiny - 2)
    if fmt in ("tf32", "bf16"):  # float32 subnormals: the double path (not the fast one)
        sub[:, ::3] = torch.where(sub[:, ::3].abs() < 2.0 ** -126, 2.0 ** -126, sub[:, ::3])
    cases["subnormal operands"] = (q(sub), q(b * 2.0 ** (tiny // 2)))
    # zero rows, columns, a whole zero chunk in some rows (p alone sets emax there)
    z, zb = a.clone(), b.clone()
    z[3], z[9:12, 8:40], zb[:, 5], zb[60:] = 0.0, 0.0, 0.0, 0.0
    cases["zeros"] = (q(z), q(zb))
    # exact cancellation: the first chunks' products cancel (p = 0), then small products
    c, cb = a.clone() * 2.0 ** -6, b.clone()
    c[:, 0:16] = 3.0
    cb[0:8], cb[8:16] = 5.0, -5.0
    c[10:, 0:16:2] *= -1.0
    cases["cancellation"] = (q(c), q(cb))
    # a large partial swamping small later products (p sets emax), and the reverse
    d = a.clone()
    d[:, :8] *= 2.0 ** 8
    d[8:, -8:] *= 2.0 ** 9
    cases["partial dominates"] = (q(d), q(b))
    # emax of F or more (the scale a float32 multiply, not an exponent add); fp8: its largest
    big = {"fp8_e4m3": 2.0 ** 7, "fp8_e5m2": 2.0 ** 13}.get(fmt, 2.0 ** 13)
    cases["large products"] = (q(a * big), q(b * big))
    if fmt in ("bf16", "tf32"):  # emax past the fast path's limit in some rows: tiles redone
        e = a.clone()
        e[2:4, 40:] *= 2.0 ** 60
        cases["emax limit"] = (q(e), q(b * 2.0 ** 50))
    n = a.clone()
    n[4, 7] = math.inf
    cases["nonfinite"] = (q(n), q(b))
    cases["K = 3"] = (q(a[:, :3]), q(b[:3]))
    cases["K = 64"] = (q(a[:, :64]), q(b[:64]))
    return cases


@needs_kernel
@pytest.mark.parametrize("f, fmt", LEAN_FORMATS, ids=str)
def test_fast_path_lean_tiles(f, fmt):
    g = torch.Generator().manual_seed(zlib.crc32(f"lean{f}{fmt}".encode()))
    for name, (a, b) in _lean_cases(g, fmt).items():
        want = accum.accum_matmul_reference(a, b, f)
        assert torch.equal(bits(accum.accum_matmul(a, b, f)), bits(want)), name
    # batched, with the tiles at other rows of a
    a, b = _lean_cases(g, fmt, M=24, K=40, N=16)["exponent spread"]
    a, b = a.reshape(3, 8, 40), b.expand(3, 40, 16)
    assert torch.equal(bits(accum.accum_matmul(a, b, f)),
                       bits(accum.accum_matmul_reference(a, b, f)))


# ---------------------------------------------------------------------------------------------
# AMD CDNA3 (stages "cdna3" / "cdna3_fp8"): the kernel (csrc/cpu/accum_cdna3.cpp: the two-stage
# step lane-wise, step_general for a lane with inf/NaN, a nonfinite partial or a product that
# may reach 2^128) against the reference, bit for bit; tests/test_accum_mmasim.py holds both to
# MMA-Sim. Operands are codes of the instructions' input formats.

CDNA3_FORMATS = [
    accum.cdna3_fp16, accum.cdna3_bf16, accum.cdna3_fp8,
    accum.cdna3_bf16.replace(promote=2),             # promotion into FP32 every 2 instructions
    accum.cdna3_fp8.replace(promote=3),
    accum.cdna3_fp16.replace(chunk=4, frac_bits=20),  # other widths of the first stage
    accum.cdna3_fp8.replace(chunk=6, frac_bits=11),
]
_CDNA3_DTYPES = {"cdna3": [torch.float16, torch.bfloat16],
                 "cdna3_fp8": [torch.float8_e4m3fnuz, torch.float8_e5m2fnuz]}


def _cdna3_codes(g, dtype, shape, nonfinite):
    """Values of dtype from its codes: the whole code range (subnormals, the largest exponents,
    inf/NaN when nonfinite), moderate values, zeros and subnormals, mixed signs."""
    nbits = 8 if dtype.itemsize == 1 else 16
    codes = torch.randint(0, 1 << nbits, shape, generator=g)
    u = torch.rand(shape, generator=g)
    small = torch.randint(1, 8, shape, generator=g) | (torch.randint(0, 2, shape, generator=g)
                                                       << (nbits - 1))  # subnormal codes
    codes = torch.where(u < 0.15, small, torch.where(u < 0.3, 0, codes))
    view = torch.uint8 if nbits == 8 else torch.int16
    x = codes.to(torch.int32).to(view).view(dtype).float()
    moderate = (torch.randn(shape, generator=g) * 2.0 ** torch.randint(-3, 4, shape, generator=g))
    x = torch.where(u > 0.7, moderate.to(dtype).float(), x)
    if not nonfinite:
        x = torch.where(torch.isfinite(x), x, 0.0)
    return x.to(dtype)


def _cdna3_case(seed, f, M, K, N, nonfinite=False):
    """(a, b) of the format's input types, with exactly cancelling pairs along K."""
    g = torch.Generator().manual_seed(seed)
    ta, tb = _CDNA3_DTYPES[f.stages][seed % 2], _CDNA3_DTYPES[f.stages][seed // 2 % 2]
    a, b = _cdna3_codes(g, ta, (M, K), nonfinite), _cdna3_codes(g, tb, (K, N), nonfinite)
    for k in range(0, K - 1, 5):  # a[:, k + 1] = -a[:, k], b[k + 1] = b[k]
        a[:, k + 1] = (-a[:, k].float()).to(ta)
        b[k + 1] = b[k]
    return a, b


def _same(x, y):
    """Equal as bits, every NaN one NaN."""
    nx, ny = torch.isnan(x), torch.isnan(y)
    return torch.equal(nx, ny) and torch.equal(bits(torch.where(nx, 0.0, x)),
                                               bits(torch.where(ny, 0.0, y)))


def _cdna3_check(a, b, f, **kw):
    want = accum.accum_matmul_reference(a, b, f, **kw)
    got = accum.accum_matmul(a, b, f, **kw)
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert _same(got, want), (f, (got != want).nonzero()[:5].tolist())


needs_cdna3 = pytest.mark.skipif(
    not (qt.ops.kernels_available() and hasattr(torch.ops.qtensor, "accum_matmul_cdna3")),
    reason="the compiled qtensor._C extension (with accum_matmul_cdna3) is not built")


@needs_cdna3
@pytest.mark.parametrize("f", CDNA3_FORMATS, ids=str)
def test_cdna3_kernel_equals_reference(f, monkeypatch):
    """Codes of the input formats on odd shapes: M and N of 1 and odd (a task is 4 rows x 8
    columns), K of one element, of a short last chunk and of several instructions."""
    cases = []
    for i, (M, K, N, nonfinite) in enumerate([(1, 1, 1, False), (1, 37, 5, True),
                                              (7, 3 * f.chunk + 5, 1, False),
                                              (5, 2 * f.chunk, 9, True), (9, 77, 19, False),
                                              (6, 8 * f.chunk + 1, 11, True)]):
        a, b = _cdna3_case(zlib.crc32(f"{f}{i}".encode()), f, M, K, N, nonfinite)
        cases.append((a, b, accum.accum_matmul_reference(a, b, f)))
    # the kernel runs (not the reference)
    monkeypatch.setattr(accum, "_cdna3_chunk", lambda *a: pytest.fail("the reference ran"))
    for a, b, want in cases:
        assert _same(accum.accum_matmul(a, b, f), want), (f, a.shape, b.shape)


@needs_cdna3
@pytest.mark.parametrize("f", CDNA3_FORMATS[:5], ids=str)
def test_cdna3_kernel_hard_cases(f):
    g = torch.Generator().manual_seed(zlib.crc32(f"hard{f}".encode()))
    fp8 = f.stages == "cdna3_fp8"
    K = 4 * f.chunk + 3
    # exponent spread: float32 carriers over float32's whole range, zeros, subnormals
    a, b = _spread(g, 5, K, 9)
    _cdna3_check(a, b, f)
    # products at and past 2^128 (bf16 codes of the largest exponents: cdna3 makes them inf;
    # fp8's halves keep them, the result overflows when rounded to FP32), mixed signs
    x = torch.randn(6, K, generator=g) * 2.0 ** torch.randint(50, 80, (6, K), generator=g)
    y = torch.randn(K, 10, generator=g) * 2.0 ** torch.randint(40, 70, (K, 10), generator=g)
    x, y = qt.quantize(x, "bf16"), qt.quantize(y, "bf16")
    _cdna3_check(x, y, f)
    _cdna3_check(x.bfloat16() if not fp8 else x, y.bfloat16() if not fp8 else y, f)
    # an inf/NaN partial followed by products 25 binades above it (fp8 drops such a partial)
    x = torch.ones(3, 2 * f.chunk)
    y = torch.ones(2 * f.chunk, 4)
    x[0, 0], x[1, 0], x[2, 0] = math.inf, math.nan, -math.inf
    x[:, f.chunk:] = 2.0 ** 20
    y[f.chunk:, 1] = 2.0 ** 10
    y[f.chunk:, 2] = 2.0 ** 2
    y[f.chunk:, 3] = -(2.0 ** 12)
    _cdna3_check(x, y, f)
    # a products' sum exactly cancelled against the partial, then tiny terms
    x = torch.zeros(2, 2 * f.chunk)
    y = torch.zeros(2 * f.chunk, 3)
    x[:, 0], y[0] = 1.5, 2.0 ** torch.arange(3.0)
    x[:, f.chunk], y[f.chunk] = -1.5, 2.0 ** torch.arange(3.0)
    x[:, f.chunk + 1:], y[f.chunk + 1:] = 2.0 ** -30, 2.0 ** -2
    _cdna3_check(x, y, f)
    # the 31-bit floor before the FP32 rounding: a partial of 1 (the first instruction) and
    # products 2^-24 + 2^-32 below it: 1 + 2^-24 after the floor (a tie: 1.0), above the tie
    # without it (1 + 2^-23); the other columns: other signs and a sticky bit further down
    x = torch.zeros(1, 2 * f.chunk)
    y = torch.zeros(2 * f.chunk, 4)
    x[0, 0], x[0, f.chunk], x[0, f.chunk + 1] = 1.0, 2.0 ** -24, 2.0 ** -32
    y[0], y[f.chunk], y[f.chunk + 1] = 1.0, 1.0, torch.tensor([1.0, 0.5, -1.0, 0.25])
    y[0, 2] = -1.0
    y[f.chunk, 2] = -1.0
    _cdna3_check(x, y, f)
    assert accum.accum_matmul(x, y, f)[0, 0] == (1.0 if f.frac_bits == 24 else 1 + 2.0 ** -23)
    # the initial accumulator c (moderate, huge, tiny, subnormal, zero, inf, NaN) and batches
    a, b = _cdna3_case(zlib.crc32(f"c{f}".encode()), f, 6, 3 * f.chunk + 1, 7)
    c = torch.randn(6, 7, generator=g) * 2.0 ** torch.randint(-150, 128, (6, 7), generator=g)
    c[0, 0], c[1, 1], c[2, 2], c[3, 3], c[4, 4] = 0.0, -0.0, math.inf, math.nan, 2.0 ** -140
    _cdna3_check(a, b, f, c=c)
    _cdna3_check(a[:, :0], b[:0], f, c=c)  # K = 0: c itself
    _cdna3_check(a.float().expand(3, 6, -1), b.float().expand(3, -1, -1), f, c=c[:1])
    # per-element clamps (as an MX operand's) and explicit ones
    em = torch.randint(-20, 3, a.shape, generator=g)
    _cdna3_check(a.float(), b.float(), f, a_emin=em, b_emin=-9)


def _cdna3_fast_values(g, shape, lo, hi):
    """Values the kernel's float32 chains take (accum_cdna3.cpp's fast_operand): 11-bit
    significands (FP16's), exponents in [lo, hi] (within [-40, 40]), mixed signs, 15% zeros."""
    m = torch.randint(1 << 10, 1 << 11, shape, generator=g).double() / 2.0 ** 10
    e = torch.randint(lo, hi + 1, shape, generator=g).double()
    s = torch.where(torch.rand(shape, generator=g) < 0.5, -1.0, 1.0)
    x = (s * m * 2.0 ** e).float()
    return torch.where(torch.rand(shape, generator=g) < 0.15, 0.0, x)


@needs_cdna3
@pytest.mark.parametrize("f", CDNA3_FORMATS, ids=str)
def test_cdna3_kernel_fast_chains_hard_cases(f):
    """The float32/int32 chains (operands of at most 12 significant bits with exponents within
    [-40, 40], c finite): the products' exponent spread across the first alignment's width (the
    truncated terms, fp8's halves 31 and more binades apart), the partial against the products
    across the second alignment (its floors at 32 and frac_bits bits), exact cancellations,
    the 31-bit floor of negative sums, a tiny or subnormal c with zero products (the -126 clamp:
    step_general), c near FLT_MAX (an inf partial mid-chain) and the int32 sums' extremes."""
    g = torch.Generator().manual_seed(zlib.crc32(f"fast{f}".encode()))
    K = 6 * f.chunk + 3
    for lo, hi in ((-3, 3), (-14, 14), (-40, 40)):  # spreads around the alignment widths
        a, b = _cdna3_fast_values(g, (9, K), lo, hi), _cdna3_fast_values(g, (K, 19), lo, hi)
        _cdna3_check(a, b, f)
        # the partial (c) from far below to far above the products, subnormal, zero
        c = torch.randn(9, 19, generator=g) * 2.0 ** torch.randint(-140, 90, (9, 19), generator=g)
        c[0, :4] = torch.tensor([0.0, -0.0, 2.0 ** -149, -(2.0 ** -130)])
        _cdna3_check(a, b, f, c=c)
    # fp8's halves far apart: even products large, odd ones tiny (or the other way round)
    a = _cdna3_fast_values(g, (5, K), -2, 2)
    b = _cdna3_fast_values(g, (K, 11), -2, 2)
    a[:, 0::2] *= 2.0 ** 38
    a[:, 1::2] *= 2.0 ** -38
    _cdna3_check(a, b, f)
    _cdna3_check(b.t().contiguous(), a.t().contiguous(), f)
    # exact cancellations: pairs that cancel within a chunk, and a sum that cancels the partial
    a = _cdna3_fast_values(g, (4, K), -10, 10)
    b = _cdna3_fast_values(g, (K, 9), -10, 10)
    a[:, 1::2] = -a[:, 0::2][:, :a[:, 1::2].shape[1]]
    b[1::2] = b[0::2][:b[1::2].shape[0]]
    _cdna3_check(a, b, f)
    x, y = torch.zeros(2, 2 * f.chunk), torch.zeros(2 * f.chunk, 3)
    x[:, 0], y[0] = 1.5, 2.0 ** torch.arange(3.0)
    x[:, f.chunk], y[f.chunk] = -1.5, 2.0 ** torch.arange(3.0)
    x[:, f.chunk + 1:], y[f.chunk + 1:] = 2.0 ** -30, -(2.0 ** -9)
    _cdna3_check(x, y, f)
    # the 31-bit floor of negative and positive sums: a partial of -1 / 1 and products just
    # below its last bits (2^-24 + 2^-32 and beyond: floor toward -inf, ties, sticky bits)
    for sgn in (1.0, -1.0):
        x, y = torch.zeros(1, 2 * f.chunk), torch.zeros(2 * f.chunk, 6)
        x[0, 0], x[0, f.chunk], x[0, f.chunk + 1], x[0, f.chunk + 2] = sgn, 2.0 ** -24, 2.0 ** -32, 2.0 ** -36
        y[0], y[f.chunk] = 1.0, torch.tensor([1.0, -1.0, 1.0, -1.0, 0.5, -0.5])
        y[f.chunk + 1] = torch.tensor([1.0, -1.0, -1.0, 1.0, 0.25, -0.75])
        y[f.chunk + 2] = torch.tensor([0.0, 1.0, -1.0, -1.0, 1.0, 1.0])
        _cdna3_check(x, y, f)
    # zero products with a tiny or subnormal c (em < -94: the -126 clamp), one zero row
    a = _cdna3_fast_values(g, (4, K), -5, 5)
    a[1] = 0.0
    b = _cdna3_fast_values(g, (K, 5), -5, 5)
    c = torch.tensor([2.0 ** -149, -(2.0 ** -127), 2.0 ** -100, -(2.0 ** -95), 3.0 * 2.0 ** -96])
    _cdna3_check(a, b, f, c=c.expand(4, 5).contiguous())
    # c near FLT_MAX: the partial overflows to inf mid-chain (then a nonfinite partial)
    c = torch.tensor([3.4e38, -3.4e38, 3.0e38, 1.0, -3.4e38])
    b[:, 0], b[:, 1] = 2.0 ** 40, -(2.0 ** 40)
    a[0] = a[0].abs() * 2.0 ** 30
    _cdna3_check(a, b, f, c=c.expand(4, 5).contiguous())
    # the int32 sums' extremes: every product the same sign at the largest significands
    x = torch.full((3, K), (2.0 - 2.0 ** -10) * 2.0 ** 40)
    y = torch.full((K, 4), (2.0 - 2.0 ** -10) * 2.0 ** 40)
    y[:, 1] = -y[:, 1]
    _cdna3_check(x, y, f, c=torch.full((3, 4), -1.0))


def test_cdna3_reference_all_zero_chunk_at_25_bits():
    """frac_bits 25 (past the kernel's 24: the reference runs): an all-zero instruction scaled
    its 0 by 2^(-999 - 25), whose float64 bits are -inf, and 0 * -inf made the result NaN."""
    x, y = torch.zeros(2, 24), torch.ones(24, 3)
    x[0, 8:] = 1.0
    x[1, 16:] = 0.5
    for stages in ("cdna3", "cdna3_fp8"):
        f = accum.AccumFormat(chunk=8, frac_bits=25, stages=stages)
        assert accum.accum_matmul(x, y, f).tolist() == [[16.0] * 3, [4.0] * 3]


@needs_cdna3
def test_cdna3_kernel_with_flush_denormal():
    """Under torch.set_flush_denormal(True) a subnormal operand is a zero term in both."""
    a, b = _cdna3_case(3, accum.cdna3_fp16, 5, 40, 9)
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU cannot flush denormals")
    try:
        for f in (accum.cdna3_fp16, accum.cdna3_fp8):
            x, y = a.float() * 2.0 ** -110, b.float()
            _cdna3_check(x, y, f)
    finally:
        torch.set_flush_denormal(False)


@needs_cdna3
def test_cdna3_kernel_opcheck_fake_and_errors():
    a, b = torch.randn(2, 3, 40), torch.randn(2, 40, 5)
    op = torch.ops.qtensor.accum_matmul_cdna3
    torch.library.opcheck(op.default, (a, b, True, 16, 24, 0, -7, -15, None))
    torch.library.opcheck(op.default, (a, b, False, 8, 24, 2, -14, -14, torch.randn(2, 3, 5)))
    with torch._subclasses.fake_tensor.FakeTensorMode():
        out = op(torch.empty(2, 3, 40), torch.empty(2, 40, 5), False, 8, 24, 0, -14, -14, None)
        assert out.shape == (2, 3, 5) and out.dtype == torch.float32
    fn = torch.compile(lambda x, y: accum.accum_matmul(x, y, accum.cdna3_fp8), fullgraph=True)
    assert _same(fn(a[0], b[0]), accum.accum_matmul_reference(a[0], b[0], accum.cdna3_fp8))
    with pytest.raises(RuntimeError, match=r"frac_bits must be in \[0, 24\], got 25"):
        op(a, b, False, 8, 25, 0, -14, -14, None)
    with pytest.raises(RuntimeError, match=r"must be float32, got Double"):
        op(a.double(), b, False, 8, 24, 0, -14, -14, None)
    with pytest.raises(RuntimeError, match=r"a \(batch, M, K\) and b \(batch, K, N\)"):
        op(a, b[:, :5], False, 8, 24, 0, -14, -14, None)
    # frac_bits above 24: the reference (the same result through accum_matmul)
    f = accum.cdna3_bf16.replace(frac_bits=30)
    assert _same(accum.accum_matmul(a, b, f), accum.accum_matmul_reference(a, b, f))


@needs_cdna3
@pytest.mark.parametrize("isa", ["base", "avx2"])
def test_cdna3_kernel_on_other_isas(isa):
    """The baseline and AVX2 copies of the CDNA3 loops (QTENSOR_CPU_ISA caps the ISA)."""
    _pytest_under_isa(isa, "cdna3_kernel and not on_other_isas")


# ---------------------------------------------------------------------------------------------
# Group datapaths (group > 1: blackwell_mxfp4, blackwell_nvfp4): the kernel's tiles of double
# group sums (csrc/cpu/accum_lanes.h, rows_groups) must give the reference's bits, also where a
# group sum is inexact in float64 (then only the same sequential order in k gives the same bits).

GROUP_FORMATS = [
    accum.blackwell_mxfp4, accum.blackwell_nvfp4,
    AccumFormat(chunk=16, frac_bits=20, group=4, promote=1),
    AccumFormat(chunk=12, frac_bits=8, group=3, align_rounding="floor", acc_in_alignment=False,
                acc_man=10, acc_rounding="nearest", promote=2),
    AccumFormat(chunk=8, frac_bits=3, group=8, align_rounding="nearest", acc_man=5),
    AccumFormat(chunk=64, frac_bits=0, group=2, align_rounding="floor", acc_man=2, promote=3),
    AccumFormat(chunk=32, frac_bits=12, group=16, align_rounding="nearest",
                acc_in_alignment=False, promote=None),
]
# the AccumFormat limits: 256 groups per chunk, the widest frac_bits; one group of all of K
GROUP_LIMITS = [AccumFormat(chunk=512, frac_bits=42, group=2, promote=2),
                AccumFormat(chunk=65536, frac_bits=50, group=65536)]


def _group_spread(g, M, K, N):
    """Every 4 K-elements: a big product B (2^40 to 2^80 times the small ones), a small one, -B
    exactly (a negated, b repeated), a small one. Added in order the first small one is absorbed
    by B and lost when -B cancels it; the float64 group sums are inexact and depend on the order
    of the adds."""
    a = torch.randn(M, K, generator=g)
    b = torch.randn(K, N, generator=g)
    big = 2.0 ** torch.randint(20, 41, (K,), generator=g).float()
    big[K - 2:] = 1.0  # no partner to cancel
    a[:, 0::4] *= big[0::4]
    b[0::4] *= big[0::4, None]
    n = a[:, 2::4].shape[1]
    a[:, 2::4] = -a[:, 0::4][:, :n]
    b[2::4] = b[0::4][:n]
    a[:, 1::2][torch.rand(M, K // 2, generator=g) < 0.05] = 0.0  # some small ones zero
    return a, b


def _group_special(g, M, K, N):
    """Zero rows, columns and whole groups, inf, -inf and NaN (inf * 0 too), float32 overflow
    of the accumulator format, subnormal operands."""
    a, b = _random(g, M, K, N, "bf16")
    a[0] = 0.0                        # a zero row
    b[:, 1 % N] = 0.0                 # a zero column
    a[:, 16:32] = 0.0                 # zero groups: p alone in the alignment
    a[1 % M, 40] = math.inf           # inf * b, inf * 0 (b's zero column)
    a[2 % M, 70] = math.nan
    b[5, 2 % N] = -math.inf
    a[3 % M, 3], b[3, 3 % N] = math.inf, -1.0
    a[4 % M, 64:] = 3e38              # products and chunk sums far beyond float32
    b[64:, 4 % N] = 3e38
    a[5 % M, :8] = 2.0 ** -140 * torch.randn(8, generator=g)  # subnormals
    return a, b


GROUP_INPUTS = {
    "random": lambda g: _random(g, 11, 77, 19),          # K not a multiple of 2, 3, 16, 64
    "fp4": lambda g: _fp4(g, 9, 256, 33),
    "spread": lambda g: _group_spread(g, 7, 150, 21),
    "cancelling": lambda g: _cancelling(g, 5, 64, 17),
    "exponents": lambda g: _spread(g, 6, 90, 10),
    "special": lambda g: _group_special(g, 9, 100, 18),
    "subnormal": lambda g: _subnormal(g, 3, 40, 9),
}


def test_group_spread_inputs_are_inexact_in_float64():
    """The adversarial inputs do what they are for: the reference (float64 group sums) differs
    from the exact oracle, so the kernel must reproduce its rounding, not the exact sums."""
    f = AccumFormat(chunk=16, frac_bits=20, group=4, promote=1)
    a, b = _group_spread(torch.Generator().manual_seed(1), 3, 64, 3)
    want = accum.accum_matmul_reference(a, b, f)
    assert not torch.equal(bits(want), bits(oracle(a, b, f)))


@needs_kernel
@pytest.mark.parametrize("kind", list(GROUP_INPUTS))
@pytest.mark.parametrize("f", GROUP_FORMATS, ids=str)
def test_group_kernel_equals_reference(f, kind):
    g = torch.Generator().manual_seed(zlib.crc32(f"{f}{kind}groups".encode()))
    a, b = GROUP_INPUTS[kind](g)
    want = accum.accum_matmul_reference(a, b, f)
    assert torch.equal(bits(accum.accum_matmul(a, b, f)), bits(want))


@needs_kernel
@pytest.mark.parametrize("f", GROUP_LIMITS, ids=str)
def test_group_kernel_at_the_format_limits(f):
    g = torch.Generator().manual_seed(3)
    for a, b in (_random(g, 9, 1100, 17), _group_spread(g, 5, 1100, 9)):
        want = accum.accum_matmul_reference(a, b, f)
        assert torch.equal(bits(accum.accum_matmul(a, b, f)), bits(want))


@needs_kernel
def test_group_kernel_batched_strided_and_empty():
    f = accum.blackwell_mxfp4
    g = torch.Generator().manual_seed(4)
    a, b = _group_spread(g, 3 * 10, 100, 37)
    a, b = a.reshape(3, 10, 100), b.t().contiguous().t()  # b column-major
    want = accum.accum_matmul_reference(a, b, f)
    assert torch.equal(bits(accum.accum_matmul(a, b, f)), bits(want))
    for x, y in ((torch.zeros(4, 0), torch.zeros(0, 5)), (torch.ones(1, 1), torch.ones(1, 1)),
                 (torch.zeros(0, 8), torch.ones(8, 3))):
        want = accum.accum_matmul_reference(x, y, f)
        assert torch.equal(bits(accum.accum_matmul(x, y, f)), bits(want))


@needs_kernel
@pytest.mark.parametrize("isa", ["base", "avx2"])
def test_group_kernel_on_other_isas(isa):
    """QTENSOR_CPU_ISA caps the instruction set: the baseline and AVX2 tiles, the same bits."""
    code = (
        "import sys, torch, zlib; sys.path.insert(0, 'tests'); import test_accum as T\n"
        "from qtensor import accum\n"
        "for f in T.GROUP_FORMATS:\n"
        "    for kind in T.GROUP_INPUTS:\n"
        "        g = torch.Generator().manual_seed(zlib.crc32(kind.encode()))\n"
        "        a, b = T.GROUP_INPUTS[kind](g)\n"
        "        want = accum.accum_matmul_reference(a, b, f)\n"
        "        got = accum.accum_matmul(a, b, f)\n"
        "        assert torch.equal(T.bits(got), T.bits(want)), (f, kind)\n")
    _run_under_isa(isa, code)


@needs_kernel
@pytest.mark.parametrize("f", GROUP_FORMATS[:1] + GROUP_FORMATS[-1:], ids=str)
def test_group_kernel_with_flush_denormal(f):
    """Results in float32's subnormal range, p in the alignment or added by a float32 add: with
    torch.set_flush_denormal(True) the kernel gives the reference's bits (both flushed)."""
    a, b = _random(torch.Generator().manual_seed(9), 6, 96, 20, "bf16")
    a, b = a * 2.0 ** -60, b * 2.0 ** -70
    _check_subnormal_results(a, b, f)


@needs_kernel
def test_group_recipe_training_matches_the_reference(monkeypatch):
    """A user's model: qt.convert with Recipe(accumulate=blackwell_mxfp4), MXFP4 weights and
    gradients, float32 activations, a few SGD steps; every contraction (forward, grad_input,
    grad_weight) through the kernel gives the same losses and weights, bit for bit, as through
    accum_matmul_reference."""
    mx = ("fp32", "mxfp4")
    recipe = qt.Recipe(weight=mx, bias="fp32", activation="fp32", grad=mx,
                       accumulate=qt.accum.blackwell_mxfp4)

    def train(recipe, reference=False):
        if reference:
            monkeypatch.setattr(accum, "_kernel_ready", lambda a: False)
        torch.manual_seed(0)
        m = qt.convert(torch.nn.Sequential(torch.nn.Linear(200, 48), torch.nn.ReLU(),
                                           torch.nn.Linear(48, 5)), recipe)
        opt = torch.optim.SGD(m.parameters(), lr=1e-3, momentum=0.9)
        g = torch.Generator().manual_seed(1)
        # blocks of 32 inputs up to 2^24 apart: the 35-bit alignment drops bits of the small ones
        x = torch.randn(40, 7, 32, generator=g) * 2.0 ** torch.randint(-18, 7, (40, 7, 1),
                                                                       generator=g)
        x, y = x.flatten(1)[:, :200], torch.randn(40, 5, generator=g)
        losses = []
        for _ in range(3):
            opt.zero_grad()
            loss = (m(x).float() - y).square().mean()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        monkeypatch.undo()
        return torch.stack(losses), [bits(p.dequantize() if isinstance(p, qt.QTensor) else p)
                                     for p in m.parameters()]

    loss_k, params_k = train(recipe)
    loss_r, params_r = train(recipe, reference=True)
    assert torch.equal(bits(loss_k), bits(loss_r))
    assert all(torch.equal(pk, pr) for pk, pr in zip(params_k, params_r))
    # the accumulator took part: FP32 accumulation trains to other bits
    loss_fp32, _ = train(recipe.replace(accumulate=None))
    assert not torch.equal(bits(loss_k), bits(loss_fp32))


# ---------------------------------------------------------------------------------------------
# Where the scales of block-scaled operands are applied (AccumFormat.scales): per promotion
# interval (DeepSeek-V3's FP8 GEMM on Hopper), in the epilogue, inside the instruction

def _f32_fma(s: float, p: float, acc: float) -> float:
    """fp32(acc + s * p), one rounding (an FFMA)."""
    return _to_grid(Fraction(acc) + Fraction(s) * Fraction(p), 23, "nearest")


def _f32_mul(x: float, y: float) -> float:
    return _to_grid(Fraction(x) * Fraction(y), 23, "nearest")


def oracle_promotion_scaled(a, b, sa, sb, f, c=None, **kw):
    """Each interval of chunk * promote K-elements: its chain of instructions from 0 (the oracle
    above, no promotion), promoted as acc = fp32(acc + fp32(sa * sb) * p); acc starts at c."""
    blk = f.chunk * f.promote
    inner = f.replace(promote=None, scales="instruction")
    A, B = a.tolist(), b.t().tolist()
    out = []
    for i, row in enumerate(A):
        out.append([])
        for j, col in enumerate(B):
            acc = 0.0 if c is None else float(c[i, j])
            for kb, k0 in enumerate(range(0, len(row), blk)):
                p = oracle_dot(row[k0:k0 + blk], col[k0:k0 + blk], inner, **kw)
                acc = _f32_fma(_f32_mul(float(sa[i, kb]), float(sb[kb, j])), p, acc)
            out[-1].append(acc)
    return torch.tensor(out, dtype=torch.float32)


def _deepseek_operands(g, M, K, N, blk):
    """E4M3 elements (subnormals and zeros included) with float32 scales amax / 448 per 1 x blk
    row block of a and per blk-row block of b (DeepSeek-V3's fine-grained scaling)."""
    def elems(shape):
        x = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-9, 9, shape, generator=g)
                                                         .float())
        x = torch.where(torch.rand(shape, generator=g) < 0.1, 0.0, x)
        return qt.quantize(x.clamp(-448, 448), "fp8_e4m3")
    KB = -(-K // blk)
    sa = torch.rand(M, KB, generator=g) * 2.0 ** torch.randint(-12, 4, (M, KB), generator=g)
    sb = torch.rand(KB, N, generator=g) * 2.0 ** torch.randint(-12, 4, (KB, N), generator=g)
    return elems((M, K)), elems((K, N)), sa + 2 ** -14, sb + 2 ** -14


@pytest.mark.parametrize("promote", [1, 4])
@pytest.mark.parametrize("fn", ["reference", "kernel"])
def test_scales_on_promotion_equal_oracle(promote, fn):
    f = accum.hopper_fp8.replace(promote=promote, scales="promotion")
    g = torch.Generator().manual_seed(40 + promote)
    K = 2 * 32 * promote + 44  # two full intervals and a short one
    a, b, sa, sb = _deepseek_operands(g, 4, K, 3, 32 * promote)
    mm = accum.accum_matmul if fn == "kernel" else accum.accum_matmul_reference
    got = mm(a, b, f, a_scale=sa, b_scale=sb, a_emin=-6, b_emin=-6)
    want = oracle_promotion_scaled(a, b, sa, sb, f, a_emin=-6, b_emin=-6)
    assert torch.equal(bits(got), bits(want))
    c = torch.randn(4, 3, generator=g)  # an initial accumulator starts the FP32 accumulator
    got = mm(a, b, f, a_scale=sa, b_scale=sb, a_emin=-6, b_emin=-6, c=c)
    want = oracle_promotion_scaled(a, b, sa, sb, f, c=c, a_emin=-6, b_emin=-6)
    assert torch.equal(bits(got), bits(want))
    # the promotion is one FFMA: a separate float32 multiply and add differs somewhere
    blk = 32 * promote
    inner = f.replace(promote=None, scales="instruction")
    two = torch.zeros(4, 3)
    for kb, k0 in enumerate(range(0, K, blk)):
        p = accum.accum_matmul_reference(a[:, k0:k0 + blk], b[k0:k0 + blk], inner, a_emin=-6,
                                         b_emin=-6)
        two = two + (sa[:, kb, None] * sb[None, kb]) * p
    assert not torch.equal(bits(two), bits(got))


def test_scales_on_promotion_batched_and_broadcast():
    """A batch of GEMMs and DeepSeek's 128 x 128 weight blocks (one scale per K-block and
    128 outputs, expanded along N) give the per-matrix results; unit scales give the unscaled
    datapath (the promotion add is then the plain FP32 add)."""
    f = accum.hopper_fp8.replace(scales="promotion")
    g = torch.Generator().manual_seed(7)
    a = torch.stack([_deepseek_operands(g, 3, 300, 2, 128)[0] for _ in range(2)])
    b, sa = _deepseek_operands(g, 3, 300, 5, 128)[1:3]
    sw = torch.rand(3, 1, generator=g) + 0.5  # one 128x128 block's scale for all N columns
    got = accum.accum_matmul(a, b, f, a_scale=sa, b_scale=sw.expand(3, 5))
    for i in range(2):
        want = accum.accum_matmul_reference(a[i], b, f, a_scale=sa, b_scale=sw.expand(3, 5))
        assert torch.equal(bits(got[i]), bits(want))
    ones = accum.accum_matmul(a, b, f, a_scale=torch.ones(3, 3), b_scale=torch.ones(3, 5))
    assert torch.equal(bits(ones), bits(accum.accum_matmul(a, b, accum.hopper_fp8)))


@pytest.mark.parametrize("fn", ["reference", "kernel"])
def test_scales_in_epilogue_equal_oracle(fn):
    """Per-row scales of a, per-column scales of b (or one per tensor): the whole unscaled sum
    through the datapath, then one multiply by fp32(sa * sb)."""
    f = accum.hopper_fp8.replace(scales="epilogue")
    g = torch.Generator().manual_seed(3)
    a, b, _, _ = _deepseek_operands(g, 4, 200, 3, 128)
    sa, sb = torch.rand(4, 1, generator=g) + 0.3, torch.rand(3, generator=g) + 0.3
    mm = accum.accum_matmul if fn == "kernel" else accum.accum_matmul_reference
    got = mm(a, b, f, a_scale=sa, b_scale=sb, a_emin=-6, b_emin=-6)
    plain = oracle(a, b, accum.hopper_fp8, a_emin=-6, b_emin=-6)
    want = torch.tensor([[_f32_mul(float(plain[i, j]), _f32_mul(float(sa[i, 0]), float(sb[j])))
                          for j in range(3)] for i in range(4)], dtype=torch.float32)
    assert torch.equal(bits(got), bits(want))
    one = mm(a, b, f, a_scale=torch.tensor(2.0), b_scale=torch.tensor(0.5), a_emin=-6, b_emin=-6)
    assert torch.equal(bits(one), bits(plain))


@pytest.mark.parametrize("name", ["blackwell_nvfp4", "blackwell_mxfp4"])
def test_scales_inside_the_instruction_equal_oracle(name):
    """scales='instruction' (the default): FP4 elements with their block scales (NVFP4: E4M3
    per 16 K-elements; MXFP4: E8M0 per 32, a wide spread); each group aligns at the scales'
    exponents (the oracle's ga, gb)."""
    f = accum.PRESETS[name]
    bs = 16 if name == "blackwell_nvfp4" else 32
    g = torch.Generator().manual_seed(5)
    fp4 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    a = fp4[torch.randint(0, 8, (3, 128), generator=g)] * (torch.randint(0, 2, (3, 128),
                                                                         generator=g) * 2 - 1)
    b = fp4[torch.randint(0, 8, (128, 2), generator=g)]

    def scales(shape):
        if bs == 16:
            return torch.randint(1, 126, shape, generator=g).to(torch.uint8).view(
                torch.float8_e4m3fn)
        return torch.randint(127 - 40, 127 + 40, shape, generator=g).to(torch.uint8).view(
            torch.float8_e8m0fnu)
    sa, sb = scales((3, 128 // bs)), scales((128 // bs, 2))
    if bs == 32:  # a first block whose groups cancel, at a high scale: it sets the alignment
        a[:, 8:16], b[8:16] = -a[:, :8], b[:8]
        a[:, 24:32], b[24:32] = -a[:, 16:24], b[16:24]
        sa[:, 0] = torch.tensor(2.0 ** 60)
    got = accum.accum_matmul(a, b, f, a_scale=sa, b_scale=sb)
    r = bs // 16
    ea = torch.frexp(sa.float()).exponent.long().sub(1).clamp(min=-6 if bs == 16 else -127)
    eb = torch.frexp(sb.float()).exponent.long().sub(1).clamp(min=-6 if bs == 16 else -127)
    ad, bd = a * sa.float().repeat_interleave(bs, 1), b * sb.float().repeat_interleave(bs, 0)
    want = oracle(ad, bd, f, a_gexp=ea.repeat_interleave(r, 1), b_gexp=eb.repeat_interleave(r, 0))
    assert torch.equal(bits(got), bits(want))
    if bs == 32:  # the scales matter: the groups' own sums' exponents give other bits
        assert not torch.equal(bits(got), bits(oracle(ad, bd, f)))


@pytest.mark.parametrize("kw, msg", [
    (dict(scales="sideways"), "scales must be one of"),
    (dict(scales="promotion", promote=None), "needs a promotion interval"),
])
def test_scales_format_errors(kw, msg):
    with pytest.raises(AccumFormatError, match=msg):
        accum.hopper_fp8.replace(**kw)


def test_scales_field_is_part_of_the_format():
    import pickle
    f = accum.hopper_fp8.replace(scales="promotion")
    assert f != accum.hopper_fp8 and "scales=promotion" in str(f)
    assert pickle.loads(pickle.dumps(f)) == f and accum.hopper_fp8.scales == "instruction"


def test_scales_argument_errors():
    a, b = torch.ones(2, 300), torch.ones(300, 3)
    prom = accum.hopper_fp8.replace(scales="promotion")
    with pytest.raises(ValueError, match="go together"):
        accum.accum_matmul(a, b, prom, a_scale=torch.ones(2, 3))
    with pytest.raises(ValueError, match=r"one per 128 K-elements"):
        accum.accum_matmul(a, b, prom, a_scale=torch.ones(2, 10), b_scale=torch.ones(10, 3))
    with pytest.raises(ValueError, match="must broadcast"):
        accum.accum_matmul(a, b, accum.hopper_fp8.replace(scales="epilogue"),
                           a_scale=torch.ones(3), b_scale=torch.ones(3))
    with pytest.raises(ValueError, match="power-of-two"):
        accum.accum_matmul(a, b, accum.blackwell_mxf8f6f4, a_scale=torch.full((2, 10), 0.75),
                           b_scale=torch.ones(10, 3))
    with pytest.raises(TypeError, match="floating-point"):
        accum.accum_matmul(a, b, prom, a_scale=torch.ones(2, 3, dtype=torch.int32),
                           b_scale=torch.ones(3, 3))


def test_fma_f32_is_one_rounding():
    """The promotion's FFMA against Fractions, on sums that land near float32 ties."""
    g = torch.Generator().manual_seed(9)
    s = torch.rand(2000, generator=g) + 0.5
    p = torch.randn(2000, generator=g) * 2.0 ** torch.randint(-30, 30, (2000,), generator=g)
    acc = torch.randn(2000, generator=g)
    acc[:500] = (-(s[:500].double() * p[:500].double())).float()  # near-cancellation
    # 1 + 2^-23 + 2^-24 (1 - 2^-30): just below a float32 tie, but float64 rounds it onto the
    # tie (then to even: 1 + 2^-22, wrong); the rounding to odd keeps 1 + 2^-23
    s[0], p[0], acc[0] = 1 + 2 ** -15, (1 - 2 ** -15) * 2 ** -24, 1 + 2 ** -23
    s[1], p[1], acc[1] = 1 + 2 ** -15, -(1 - 2 ** -15) * 2 ** -24, -1 - 2 ** -23
    naive = (acc.double() + s.double() * p.double()).float()
    assert naive[0] == 1 + 2 ** -22 and naive[1] == -1 - 2 ** -22
    got = accum._fma_f32(s, p, acc)
    want = torch.tensor([_f32_fma(float(x), float(y), float(z)) for x, y, z in
                         zip(s.tolist(), p.tolist(), acc.tolist())], dtype=torch.float32)
    assert torch.equal(bits(got), bits(want))


# ---------------------------------------------------------------------------------------------
# Block scales through QTensor contractions: a converted model's MX/NVFP4 operands reach the
# datapath with their block scales (group exponents, or elements and scales on promotion), as an
# explicit accum_matmul(elements, a_scale=, b_scale=) gives them

def _e4m3_scales(x, bs=16):
    """NVFP4 (single-level) rounding of x along its last dim by hand: (elements, E4M3 scales),
    the scales from the unrounded blocks' amax (an oracle independent of accum's recovery)."""
    X = (x.abs().unflatten(-1, (-1, bs)).amax(-1) / 6).to(torch.float8_e4m3fn)
    X = torch.where(X.float() == 0, torch.ones_like(X.float()), X.float()).to(torch.float8_e4m3fn)
    xq = qt.quantize(x, "nvfp4_single")
    return xq / X.float().repeat_interleave(bs, -1), X


def _nvfp4_operands():
    """x (5, 64), w (3, 64): blocks of 16 from 2^-9 to 448 scales; rows 0-1 and column 0 have a
    group whose products cancel at the largest scale (the 35-bit alignment then drops the
    smallest products, which an alignment at the group sums' exponents keeps)."""
    g = torch.Generator().manual_seed(21)
    x = torch.randn(5, 4, 16, generator=g) * 2.0 ** torch.randint(-8, 9, (5, 4, 1), generator=g)
    w = torch.randn(3, 4, 16, generator=g) * 2.0 ** torch.randint(-8, 9, (3, 4, 1), generator=g)
    x[:2, 0], w[0, 0] = 0.0, 6 * 448.0
    x[:2, 0, 0], x[:2, 0, 1] = 6 * 448.0, -6 * 448.0
    x[:2, 1], w[0, 1] = 0.5 * 2.0 ** -9, 0.5 * 2.0 ** -9
    x[:2, 1, 0], w[0, 1, 0] = 6 * 2.0 ** -9, 6 * 2.0 ** -9
    return x.flatten(1), w.flatten(1)


def _spy_on_scale_arguments(monkeypatch):
    """A list that collects, per call of the kernel entry (accum._matmul, which contractions
    call), the names of its tensor keyword arguments (the scales and clamps it was given)."""
    calls = []
    kernel = accum._matmul

    def spy(*args, **kw):
        calls.append(sorted(k for k, v in kw.items() if isinstance(v, torch.Tensor)))
        return kernel(*args, **kw)
    monkeypatch.setattr(accum, "_matmul", spy)
    return calls


def _converted_linear_output(x, w, fmt, f):
    """x through qt.convert(nn.Linear with weight w), fmt at both operands, accumulator f."""
    lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
    with torch.no_grad():
        lin.weight.copy_(w)
    m = qt.convert(lin, qt.Recipe(weight=("fp32", fmt), activation=("fp32", fmt),
                                  accumulate=f))
    y = m(x)
    return y.dequantize() if isinstance(y, qt.QTensor) else y


@pytest.mark.parametrize("fmt", ["nvfp4_single", "nvfp4"])
def test_converted_linear_nvfp4_passes_block_scales(fmt):
    """qt.convert(nn.Linear) with NVFP4 weight and activation operand formats and
    Recipe(accumulate=blackwell_nvfp4): the output equals accum_matmul of the FP4 elements with
    their E4M3 block scales (tcgen05 kind::mxf4nvf4's alignment at the scales' exponents), bit
    for bit; NVFP4's per-tensor scales are applied after the sum (cuBLASLt's alpha). Without the
    scales (each group at its own sum's exponent, the previous behaviour) the bits differ."""
    f = accum.blackwell_nvfp4
    x, w = _nvfp4_operands()
    y = _converted_linear_output(x, w, fmt, f)
    if fmt == "nvfp4_single":
        xe, xs = _e4m3_scales(x)
        we, ws = _e4m3_scales(w)
        want = accum.accum_matmul(xe, we.t(), f, a_scale=xs, b_scale=ws.t())
    else:  # the per-tensor scales (TE's, from the tensors' amax) out of the elements, alpha
        def split(t):  # TE's S_enc and E4M3 scales of the unrounded blocks (float32 steps)
            enc = torch.tensor(6 * 448.0) / t.abs().amax()
            ts = 1 / enc
            s = t.abs().unflatten(-1, (-1, 16)).amax(-1) * (enc * torch.tensor(1 / 6.0))
            s = s.to(torch.float8_e4m3fn)
            tq = qt.quantize(t, fmt).double()
            e = tq / (s.double().repeat_interleave(16, -1) * ts.double())
            return e.round(decimals=6).float(), s, ts  # (e * X * s rounded once: e to 1e-6)
        xe, xs, tx = split(x)
        we, ws, tw = split(w)
        assert torch.equal(xe, qt.quantize(xe, "fp4_e2m1"))  # the elements recovered
        want = accum.accum_matmul(xe, we.t(), f, a_scale=xs, b_scale=ws.t()) * (tx * tw)
    assert torch.equal(bits(y), bits(want))
    old = accum.accum_matmul(qt.quantize(x, fmt), qt.quantize(w, fmt).t(), f)
    assert not torch.equal(bits(y), bits(old))


@pytest.mark.parametrize("fmt, f", [("mxfp4", accum.blackwell_mxfp4),
                                    ("mxfp8_e4m3", accum.blackwell_mxf8f6f4)])
def test_converted_conv2d_mxfp4_passes_block_exponents(fmt, f, monkeypatch):
    """qt.convert(nn.Conv2d) with MX operand formats and a Blackwell block-scaled preset: the
    convolution's GEMM (K = kernel position, channel) gets the E8M0 block scales of both operands
    (blocks of 32 channels: MXFP4's group exponents for blackwell_mxfp4, MXFP8's per-element
    clamps for blackwell_mxf8f6f4); equal, bit for bit, to accum_matmul of the im2col elements
    with their scales, and different from the values without them."""
    emax = qt.formats.format(fmt).elem.emax
    g = torch.Generator().manual_seed(5)
    conv = torch.nn.Conv2d(32, 3, 3, bias=False)
    x = torch.randn(2, 32, 5, 5, generator=g)
    x = x * 2.0 ** torch.randint(-24, 24, (2, 2, 1, 5, 5), generator=g).repeat_interleave(
        16, 1).flatten(1, 2)  # every group of 16 channels at its own scale
    x[:, :16, 1, 1] = torch.tensor([2.0 ** 30, -2.0 ** 30] * 8)  # groups that cancel
    with torch.no_grad():
        conv.weight.copy_(torch.randn(3, 32, 3, 3, generator=g))
        conv.weight[:, :16] = 1.0
        if fmt == "mxfp8_e4m3":  # E4M3 subnormal elements in every block
            x[:, 16:] = x[:, :16] * 2.0 ** -15
    m = qt.convert(conv, qt.Recipe(weight=("fp32", fmt), activation=("fp32", fmt),
                                   accumulate=f))
    calls = _spy_on_scale_arguments(monkeypatch)
    y = m(x)
    monkeypatch.undo()
    assert calls[0] == (["a_gexp", "b_gexp"] if f.group > 1 else ["b_emin"])
    y = y.dequantize() if isinstance(y, qt.QTensor) else y

    def split(t, dim):  # MX along dim: elements and E8M0 exponents of the unrounded blocks
        tq = qt.quantize(t, qt.formats.format(fmt).replace(axis=dim))
        amax = t.movedim(dim, -1).abs().unflatten(-1, (-1, 32)).amax(-1)
        e = (torch.frexp(amax).exponent - 1 - emax).clamp(-127, 127).movedim(-1, dim)
        return tq / torch.exp2(e.float()).repeat_interleave(32, dim), e.float()
    xe, xs = split(x, 1)  # (N, C, H, W), (N, 1, H, W)
    we, ws = split(conv.weight.detach(), 1)  # (O, C, 3, 3), (O, 1, 3, 3)
    N, O, L = 2, 3, 9

    def cols(t):  # (N, C, 5, 5) -> (N, K, L), K = (kernel position, channel)
        u = torch.nn.functional.unfold(t, 3)  # (N, C * 9, L), channel-major
        return u.unflatten(1, (t.shape[1], 9)).transpose(1, 2).flatten(1, 2)
    b, bsc = cols(xe), cols(torch.exp2(xs))  # scales: (N, 9, L), one per position
    a = we.permute(0, 2, 3, 1).reshape(O, -1)
    asc = torch.exp2(ws).permute(0, 2, 3, 1).reshape(O, 9)
    want = accum.accum_matmul(a, b, f, a_scale=asc, b_scale=bsc).reshape(N, O, 3, 3)
    assert torch.equal(bits(y), bits(want))
    xq = qt.quantize(x, qt.formats.format(fmt).replace(axis=1))
    wq = qt.quantize(conv.weight.detach(), qt.formats.format(fmt).replace(axis=1))
    old = accum.accum_matmul(wq.permute(0, 2, 3, 1).reshape(O, -1), cols(xq), f)
    if f.group > 1:
        assert not torch.equal(bits(y), bits(old.reshape(N, O, 3, 3)))


@pytest.mark.parametrize("scale", ["e8m0", "bf16", "fp32"])
def test_converted_linear_promotion_scales(scale, monkeypatch):
    """DeepSeek-V3-style FP8 GEMM through a converted nn.Linear: operand formats of E4M3 blocks
    of 128 along K (power-of-two E8M0 scales, or BF16 amax scales) and hopper_fp8 with
    scales="promotion": dispatch passes the elements and their block scales, so each 128-K
    interval's unscaled sum is promoted with its scales (one FFMA), bit for bit as accum_matmul
    with a_scale/b_scale. With BF16 scales summing the scaled values instead gives other bits;
    E8M0 scales are powers of two, which commute with the alignment (the kernel must still get
    them: checked on the call)."""
    f = accum.hopper_fp8.replace(scales="promotion")
    rule = "floor" if scale == "e8m0" else "amax"
    fmt = qt.BlockFormat("fp8_e4m3", 128, scale=scale, scale_rule=rule)
    g = torch.Generator().manual_seed(8)
    x = torch.randn(6, 3, 128, generator=g) * 2.0 ** torch.randint(-3, 3, (6, 3, 1), generator=g)
    w = torch.randn(4, 3, 128, generator=g) * 2.0 ** torch.randint(-3, 3, (4, 3, 1), generator=g)
    x, w = x.flatten(1), w.flatten(1)
    lin = torch.nn.Linear(384, 4, bias=False)
    with torch.no_grad():
        lin.weight.copy_(w)
    m = qt.convert(lin, qt.Recipe(weight=("fp32", fmt), activation=("fp32", fmt), accumulate=f))
    calls = []
    kernel = accum._matmul  # the kernel entry contractions call

    def spy(*args, **kw):
        calls.append(sorted(k for k, v in kw.items() if v is not None))
        return kernel(*args, **kw)
    monkeypatch.setattr(accum, "_matmul", spy)
    y = m(x)
    monkeypatch.undo()
    assert "a_scale" in calls[0] and "b_scale" in calls[0]
    y = y.dequantize() if isinstance(y, qt.QTensor) else y

    def split(t):  # the quantizer's scales of the unrounded blocks, and the elements
        amax = t.double().abs().unflatten(-1, (-1, 128)).amax(-1)
        if rule == "floor":
            s = torch.exp2((torch.frexp(amax).exponent - 1 - 8).double())
        elif scale == "bf16":
            s = (amax / 448).float().to(torch.bfloat16).double()
        else:  # DeepSeek-V3's FP32 scales, nearest on the 20-bit grid (E4M3 x scale: float32)
            m, e = torch.frexp(amax / 448)
            s = torch.ldexp(torch.round(m * 2.0 ** 20) / 2.0 ** 20, e)
        e = (qt.quantize(t, fmt).double() / s.repeat_interleave(128, -1)).float()
        assert torch.equal(qt.quantize(e, "fp8_e4m3"), e)
        return e, s.float()
    xe, xs = split(x)
    we, ws = split(w)
    want = accum.accum_matmul(xe, we.t(), f, a_scale=xs, b_scale=ws.t(), a_emin=-6, b_emin=-6)
    assert torch.equal(bits(y), bits(want))
    old = accum.accum_matmul(qt.quantize(x, fmt), qt.quantize(w, fmt).t(), f)
    assert torch.equal(bits(y), bits(old)) == (scale == "e8m0")


def _te_split(t, fmt):
    """_quantizer_split for a two-level format by Transformer Engine's rule, in its float32
    steps written out here (E4M3 casts by torch's float8_e4m3fn, RNE): the encode scale from
    t's amax, each block's E4M3 scale (amax: nearest of amax/6 * enc; ceil: the smallest E4M3
    whose 6 X s covers amax; 4over6: nearest of amax/6 * enc and of that * 1.5, the one of the
    lower float32 error sum, 6 on a tie), the elements of x * 1/(X s), values fl32(e X s)."""
    f32 = torch.float32
    bound = 256.0 if fmt.scale_rule == "4over6" else 448.0
    amax_t = t.abs().amax()
    enc = torch.tensor(6 * bound, dtype=f32) / amax_t
    dec = 1 / enc
    blocks = t.unflatten(-1, (-1, 16))
    bmax = blocks.abs().amax(-1, keepdim=True)

    def e4m3(v):
        return v.clamp(max=448.0).to(torch.float8_e4m3fn)

    def elements(X):
        inv = (1 / (X * dec)).clamp(max=torch.finfo(f32).max)
        return qt.quantize((blocks * inv).clamp(-6, 6), "fp4_e2m1")

    if fmt.scale_rule == "4over6":
        X6 = e4m3((bmax / 6.0) * enc).float()
        X4 = e4m3((bmax / 6.0) * enc * 1.5).float()

        def err(X):
            d = ((((elements(X) * X) * amax_t) / (6 * bound)) - blocks).abs()
            acc = torch.zeros_like(bmax)
            for j in range(16):
                acc = acc + d[..., j:j + 1]
            return acc
        X = torch.where(err(X4) < err(X6), X4, X6)
    elif fmt.scale_rule == "ceil":
        target = bmax * (enc * torch.tensor(1 / 6.0, dtype=f32))
        n = e4m3(target)
        up = torch.where(n.float() < target, (n.view(torch.uint8) + 1).view(torch.float8_e4m3fn),
                         n).float()
        down = torch.where(up > 0, (e4m3(up).view(torch.uint8) - 1).view(torch.float8_e4m3fn)
                           .float(), up)
        X = torch.where((6.0 * down) * dec >= bmax, down, up)
    else:
        X = e4m3(bmax * (enc * torch.tensor(1 / 6.0, dtype=f32))).float()
    e = elements(X)
    q = (e * X) * dec
    assert torch.equal(q.flatten(-2), qt.quantize(t, fmt))  # the quantizer's values
    e = torch.where(X == 0, q, e)  # a block rounded to zeros: zero elements, any scale (1)
    return e.flatten(-2), torch.where(X == 0, 1.0, X)[..., 0], dec.double()


def _quantizer_split(t, fmt):
    """t rounded to the block format fmt (blocks along the last dim) by the quantizer's own
    steps on the unrounded blocks (an oracle independent of accum's scale recovery): (elements,
    block scales X, tensor scale ts); 4over6 picks the candidate of the lower error (6 on a
    tie), as Transformer Engine."""
    if fmt.tensor_scale:
        return _te_split(t, fmt)
    from qtensor.reference import round_with_scale, scale_candidates
    bs = fmt.block_size
    t64 = t.double()
    blocks = t64.unflatten(-1, (-1, bs))
    amax = blocks.abs().amax(-1, keepdim=True)
    ts = None

    def settled(scale_of):  # a block whose rounded max has a lower scale takes that one
        X = scale_of(amax)
        q = round_with_scale(blocks, X, fmt, "nearest")
        while fmt.scale_rule != "ceil" or not fmt.power_of_two_scales:  # (RCEIL keeps X)
            again = scale_of(q.abs().amax(-1, keepdim=True))
            if not (again < X).any():
                return X, q
            X = torch.minimum(again, X)
            q = round_with_scale(blocks, X, fmt, "nearest")
        return X, q
    cands, qs = zip(*[settled(c) for c in scale_candidates(fmt)])
    X, q = cands[0], qs[0]
    if len(cands) == 2:
        err = [sum((qq[..., j:j + 1] - blocks[..., j:j + 1]).abs() for j in range(bs))
               for qq in qs]  # in element order
        X = torch.where(err[1] < err[0], cands[1], cands[0])
        q = torch.where(err[1] < err[0], qs[1], qs[0])
    assert torch.equal(q.flatten(-2).float(), qt.quantize(t, fmt))  # the quantizer's values
    ts = torch.ones((), dtype=torch.float64) if ts is None else ts
    X = torch.where(X == 0, ts, X) / ts  # a block rounded to zeros: any scale
    e = (q / (X * ts)).flatten(-2).float()
    assert torch.equal(qt.quantize(e, fmt.elem), e)
    return e, X[..., 0].float(), ts


@pytest.mark.parametrize("fmt, f", [
    (qt.BlockFormat("fp4_e2m1", 32, scale="e8m0", scale_rule="even"), accum.blackwell_mxfp4),
    (qt.BlockFormat("fp4_e2m1", 16, scale="fp8_e4m3", scale_rule="4over6"),
     accum.blackwell_nvfp4),
    (qt.BlockFormat("fp4_e2m1", 16, scale="fp8_e4m3", scale_rule="4over6", tensor_scale=True),
     accum.blackwell_nvfp4),
    (qt.BlockFormat("fp4_e2m1", 16, scale="fp8_e4m3", scale_rule="ceil", tensor_scale=True),
     accum.blackwell_nvfp4),
    (qt.BlockFormat("fp4_e2m1", 32, scale="e8m0", scale_rule="rceil"), accum.blackwell_mxfp4)],
    ids=["mxfp4_even", "nvfp4_4over6", "nvfp4_4over6_ts", "nvfp4_ceil", "mxfp4_rceil"])
def test_converted_linear_other_scale_rules_pass_block_scales(fmt, f):
    """Scale rules besides MX floor and NVFP4 amax through a converted nn.Linear with a
    Blackwell block-scaled preset: the scales recovered from the rounded operands are the
    quantizer's (even: the rounded max's binade; 4over6: the one of its two candidates whose
    elements are exact; ceil with E4M3 scales: the upward rounding of the rounded max / 6;
    MX RCEIL, ambiguous in the rounded blocks: the scales of the unrounded payloads the operands
    were rounded from), so the output equals accum_matmul of the elements with those scales
    (per-tensor scales as alpha), bit for bit; the values alone give other bits."""
    x, w = _nvfp4_operands()
    if fmt.block_size == 32:  # MX: a block of x that cancels at 2^60, far above the others
        x[:2, :32] = torch.tensor([2.0 ** 60, -2.0 ** 60] * 16)
        w[:, :32] = 1.0
    y = _converted_linear_output(x, w, fmt, f)
    if fmt.scale_rule == "ceil" and fmt.power_of_two_scales:  # the rounded x alone: ambiguous
        assert accum._block_scales(qt.quantize(x, fmt), fmt, -1) is None
    xe, xs, tx = _quantizer_split(x, fmt)
    we, ws, tw = _quantizer_split(w, fmt)
    want = accum.accum_matmul(xe, we.t(), f, a_scale=xs, b_scale=ws.t())
    if fmt.tensor_scale:
        want = want * (tx.float() * tw.float())
    assert torch.equal(bits(y), bits(want))
    old = accum.accum_matmul(qt.quantize(x, fmt), qt.quantize(w, fmt).t(), f)
    assert not torch.equal(bits(y), bits(old))


def test_block_scales_ceil_power_of_two_is_ambiguous():
    """MX ceil (RCEIL) scales are not a function of the rounded block: a block whose rounded max
    is max_elem * 2^k rounds from 2^k (max 6) as from 2^(k+1) (max 3): recovery from the rounded
    values alone refuses it, and recovers the scales of a tensor without such blocks."""
    from qtensor.accum import _block_scales
    fmt = qt.BlockFormat("fp4_e2m1", 32, scale="e8m0", scale_rule="ceil")
    a = torch.full((1, 32), 1.0)
    a[0, 0] = 5.5  # scale 1, max 6 (from 2^0) ...
    b = a.clone()
    b[0, 0] = 6.2  # ... or scale 2, max 3 * 2 = 6: the same rounded block
    qa, qb = qt.quantize(a, fmt), qt.quantize(b, fmt)
    assert torch.equal(qa, qb) and _block_scales(qa, fmt, -1) is None
    c = a.clone()
    c[0, 0] = 4.4  # max 4: scale 1 only
    sc = _block_scales(qt.quantize(c, fmt), fmt, -1)
    assert sc is not None and sc[0].item() == 1.0


def test_addmm_nvfp4_feeds_c_through_the_datapath():
    """addmm(C, A, B) of NVFP4 operands (per-tensor scales) under blackwell_nvfp4: the datapath
    sums the unscaled products with the E4M3 block scales, alpha = ts_a * ts_b scales its
    result, so C (of the output's shape) is its initial accumulator as fp32(C / alpha):
    fp32(alpha * D(C / alpha)), bit for bit; the values with C (the previous behaviour) differ."""
    f = accum.blackwell_nvfp4
    x, w = _nvfp4_operands()
    g = torch.Generator().manual_seed(3)
    c = torch.randn(5, 3, generator=g)
    qa = qt.QTensor(x, "fp32", mm_fmt="nvfp4", accum=f)
    qb = qt.QTensor(w.t().contiguous(), "fp32", mm_fmt="nvfp4", accum=f)
    y = torch.addmm(c, qa, qb)
    y = y.dequantize() if isinstance(y, qt.QTensor) else y
    nv = qt.formats.format("nvfp4")
    xe, xs, tx = _quantizer_split(x, nv)
    we, ws, tw = _quantizer_split(w, nv)
    alpha = tx.float() * tw.float()
    want = accum.accum_matmul(xe, we.t(), f, a_scale=xs, b_scale=ws.t(), c=c / alpha) * alpha
    assert torch.equal(bits(y), bits(want))
    old = accum.accum_matmul(qt.quantize(x, nv), qt.quantize(w, nv).t(), f, c=c)
    assert not torch.equal(bits(y), bits(old))


def _mx_split(t, dim, fmt="mxfp4"):
    """MX rounding of t along dim by hand: elements and E8M0 scales (2^e, one per block of 32,
    the blocks' dim kept at its number of blocks) of the unrounded blocks."""
    f = qt.formats.format(fmt)
    tq = qt.quantize(t, f.replace(axis=dim))
    amax = t.movedim(dim, -1).abs().unflatten(-1, (-1, 32)).amax(-1)
    e = (torch.frexp(amax).exponent - 1 - f.elem.emax).clamp(-127, 127).movedim(-1, dim)
    s = torch.exp2(e.float())
    return tq / s.repeat_interleave(32, dim), s


def test_converted_grouped_conv2d_blocks_across_groups_pass_scales():
    """A grouped nn.Conv2d (2 groups of 16 channels) with MXFP4 operands under
    blackwell_mxfp4: the input's blocks of 32 channels span both groups, but each K-group of 16
    (one kernel position, 16 channels of one group) lies in one block, so the convolution's
    per-group GEMMs get the scales: equal, bit for bit, to accum_matmul per group of the
    elements with their scales; the values alone (the previous fallback) differ."""
    f = accum.blackwell_mxfp4
    g = torch.Generator().manual_seed(7)
    conv = torch.nn.Conv2d(32, 4, 3, groups=2, bias=False)
    x = torch.randn(1, 32, 4, 4, generator=g)
    x = x * 2.0 ** torch.randint(-4, 5, (1, 1, 4, 4), generator=g)
    x[0, :16, 1, 1] = torch.tensor([2.0 ** 60, -2.0 ** 60] * 8)  # a group cancels at 2^58
    with torch.no_grad():
        conv.weight.copy_(torch.randn(4, 16, 3, 3, generator=g))
        conv.weight[:, :, 1, 1] = 1.0
    m = qt.convert(conv, qt.Recipe(weight=("fp32", "mxfp4"), activation=("fp32", "mxfp4"),
                                   accumulate=f))
    y = m(x)
    y = y.dequantize() if isinstance(y, qt.QTensor) else y
    xe, xs = _mx_split(x, 1)  # (1, 32, 4, 4), (1, 1, 4, 4)
    wpad = torch.nn.functional.pad(conv.weight.detach(), (0, 0, 0, 0, 0, 16))  # blocks of 32
    we, ws = _mx_split(wpad, 1)
    we = we[:, :16]  # (4, 16, 3, 3), ws (4, 1, 3, 3)

    def cols(t):  # (1, C, 4, 4) -> (C, 9, L=4)
        return torch.nn.functional.unfold(t, 3)[0].unflatten(0, (t.shape[1], 9))
    want = []
    for grp in range(2):
        a = we[2 * grp:2 * grp + 2].permute(0, 2, 3, 1).reshape(2, 144)  # K = (position, c)
        asc = ws[2 * grp:2 * grp + 2].reshape(2, 9)
        b = cols(xe)[16 * grp:16 * grp + 16].transpose(0, 1).reshape(144, 4)
        bsc = cols(xs)[0]  # (9, L): the one block of the 32 channels at each position
        want.append(accum.accum_matmul(a, b, f, a_scale=asc, b_scale=bsc))
    want = torch.cat(want).reshape(1, 4, 2, 2)
    assert torch.equal(bits(y), bits(want))
    xq = qt.quantize(x, qt.formats.format("mxfp4").replace(axis=1))
    wq = qt.quantize(conv.weight.detach(), qt.formats.format("mxfp4").replace(axis=1))
    old = torch.cat([accum.accum_matmul(
        wq[2 * grp:2 * grp + 2].permute(0, 2, 3, 1).reshape(2, 144),
        cols(xq)[16 * grp:16 * grp + 16].transpose(0, 1).reshape(144, 4), f)
        for grp in range(2)]).reshape(1, 4, 2, 2)
    assert not torch.equal(bits(y), bits(old))


@pytest.mark.parametrize("fmt, f", [("mxfp4", accum.blackwell_mxfp4),
                                    ("mxfp8_e4m3", accum.blackwell_mxf8f6f4)])
def test_converted_conv2d_grad_weight_passes_block_scales(fmt, f, monkeypatch):
    """The weight gradient of a converted nn.Conv2d with MX input and gradient operands
    (blocked along the batch, as dispatch rounds grad_weight's operands) under a Blackwell
    block-scaled preset: K runs (output position, batch), the batch innermost, so each block of
    32 is a run of K and the GEMM gets both operands' scales (MXFP4: group exponents; MXFP8:
    per-element clamps, E4M3 subnormals in some blocks): equal, bit for bit, to accum_matmul of
    the elements with their scales; the values alone (the previous fallback, batch outermost)
    differ."""
    g = torch.Generator().manual_seed(9)
    N, L, P = 32, 4, 4
    conv = torch.nn.Conv2d(1, 2, 2, bias=False)
    x = torch.randn(N, 1, 3, 3, generator=g)
    x[:2] = 1.0
    go = torch.randn(N, 2, 2, 2, generator=g)
    go[:2, 0, 0, 0] = torch.tensor([2.0 ** 60, -2.0 ** 60])  # cancels at 2^58, position 0
    if fmt == "mxfp8_e4m3":
        x[2:4] *= 2.0 ** -12  # E4M3 subnormals of their blocks
        go[4:6] *= 2.0 ** -12
    with torch.no_grad():
        conv.weight.copy_(torch.randn(2, 1, 2, 2, generator=g))
    mx = ("fp32", fmt)
    m = qt.convert(conv, qt.Recipe(weight=mx, activation=mx, grad=mx, accumulate=f))
    y = m(x)
    calls = _spy_on_scale_arguments(monkeypatch)
    y.backward(go)
    monkeypatch.undo()
    assert calls == [["a_gexp", "b_gexp"] if f.group > 1 else ["a_emin", "b_emin"]]
    gw = m.weight.grad
    gw = gw.dequantize() if isinstance(gw, qt.QTensor) else gw
    xe, xs = _mx_split(x, 0, fmt)  # (N, 1, 3, 3), (1, 1, 3, 3)
    ge, gs = _mx_split(go, 0, fmt)  # (N, 2, 2, 2), (1, 2, 2, 2)

    def cols(t):  # (n, 1, 3, 3) -> (n, P, L)
        return torch.nn.functional.unfold(t, 2)
    a = ge.reshape(N, 2, L).permute(1, 2, 0).reshape(2, L * N)  # K = (l, n)
    asc = gs.reshape(2, L)
    b = cols(xe).permute(2, 0, 1).reshape(L * N, P)
    bsc = cols(xs)[0].t()  # (L, P)
    want = accum.accum_matmul(a, b, f, a_scale=asc, b_scale=bsc).reshape(2, 1, 2, 2)
    assert torch.equal(bits(gw), bits(want))
    xq = qt.quantize(x, qt.formats.format(fmt).replace(axis=0))
    gq = qt.quantize(go, qt.formats.format(fmt).replace(axis=0))
    old = accum.accum_matmul(gq.reshape(N, 2, L).permute(1, 0, 2).reshape(2, N * L),
                             cols(xq).permute(0, 2, 1).reshape(N * L, P), f)
    assert not torch.equal(bits(gw), bits(old.reshape(2, 1, 2, 2)))


def test_converted_grouped_conv_transpose2d_weight_blocks_across_groups():
    """A grouped nn.ConvTranspose2d (2 groups) with MXFP4 operands under blackwell_mxfp4: the
    weight (C_in, O/groups, kh, kw) is blocked along C_in, 32 channels across both groups, and
    group 0's weights are 1/4 of group 1's, so the shared block scale is group 1's: the GEMM
    (K = flipped kernel position, C_in of the group) gets that scale for both groups (a block
    partition of the regrouped kernel would give group 0 a smaller one), bit for bit as
    accum_matmul per group of the elements with their scales."""
    f = accum.blackwell_mxfp4
    g = torch.Generator().manual_seed(11)
    conv = torch.nn.ConvTranspose2d(32, 4, 2, groups=2, bias=False)
    x = torch.randn(1, 32, 3, 3, generator=g)
    x[0, :16, 1, 1] = torch.tensor([2.0 ** 36, -2.0 ** 36] * 8)  # the others: ~36 bits below
    with torch.no_grad():
        w = torch.randn(32, 2, 2, 2, generator=g)
        w[:16] *= 0.25
        w[1:16:2] = w[0:16:2]  # x's pairs +-2^36 at (1, 1) cancel in every product group
        conv.weight.copy_(w)
    m = qt.convert(conv, qt.Recipe(weight=("fp32", "mxfp4"), activation=("fp32", "mxfp4"),
                                   accumulate=f))
    y = m(x)
    y = y.dequantize() if isinstance(y, qt.QTensor) else y
    xe, xs = _mx_split(x, 1)  # (1, 32, 3, 3), (1, 1, 3, 3)
    we, ws = _mx_split(w, 0)  # (32, 2, 2, 2), (1, 2, 2, 2)
    we, ws = we.flip(2, 3), ws.flip(2, 3)

    def cols(t):  # (1, C, 3, 3) padded by 1 -> (C, 4 positions, L=16)
        u = torch.nn.functional.unfold(torch.nn.functional.pad(t, (1, 1, 1, 1)), 2)[0]
        return u.unflatten(0, (t.shape[1], 4))
    want = []
    for grp in range(2):
        a = we[16 * grp:16 * grp + 16].permute(1, 2, 3, 0).reshape(2, 64)  # K = (position, c)
        asc = ws[0].reshape(2, 4)
        b = cols(xe)[16 * grp:16 * grp + 16].transpose(0, 1).reshape(64, 16)
        bsc = cols(xs)[0]  # (4, 16)
        want.append(accum.accum_matmul(a, b, f, a_scale=asc, b_scale=bsc))
    want = torch.cat(want).reshape(1, 4, 4, 4)
    assert torch.equal(bits(y), bits(want))
    # group 0's own maxima give other scales (smaller, with valid elements too): other bits
    wrong = ws.clone()
    w0 = we[:16].abs().flatten(1).amax(0).reshape(2, 2, 2) * ws[0]
    wrong = torch.exp2(torch.floor(torch.log2(w0)) - 2)
    a = (we[:16] * ws[0] / wrong).permute(1, 2, 3, 0).reshape(2, 64)
    assert torch.equal(qt.quantize(a, "fp4_e2m1"), a)
    other = accum.accum_matmul(a, cols(xe)[:16].transpose(0, 1).reshape(64, 16), f,
                               a_scale=wrong.reshape(2, 4), b_scale=cols(xs)[0])
    assert not torch.equal(bits(want[0, :2].reshape(2, 16)), bits(other))


def test_converted_conv2d_grad_weight_promotion_scales():
    """DeepSeek-V3-style FP8 weight gradient of a converted nn.Conv2d: E4M3 blocks of 128 along
    the batch with BF16 amax scales and hopper_fp8 with scales="promotion": K runs (output
    position, batch), each 128-K interval is one block of each operand, promoted with its
    scales; bit for bit as accum_matmul with a_scale/b_scale; the values (batch outermost, the
    previous fallback) differ."""
    f = accum.hopper_fp8.replace(scales="promotion")
    fmt = qt.BlockFormat("fp8_e4m3", 128, scale="bf16", scale_rule="amax")
    g = torch.Generator().manual_seed(1)
    N, L, P = 128, 4, 4
    conv = torch.nn.Conv2d(1, 2, 2, bias=False)
    x, go = torch.randn(N, 1, 3, 3, generator=g), torch.randn(N, 2, 2, 2, generator=g)
    r = ("fp32", fmt)
    m = qt.convert(conv, qt.Recipe(weight=r, activation=r, grad=r, accumulate=f))
    m(x).backward(go)
    gw = m.weight.grad
    gw = gw.dequantize() if isinstance(gw, qt.QTensor) else gw

    def split(t):  # the quantizer's BF16 scales of the unrounded batch blocks, the elements
        amax = t.double().abs().amax(0, keepdim=True)
        s = (amax / 448).float().to(torch.bfloat16).double()
        e = (qt.quantize(t, fmt.replace(axis=0)).double() / s).float()
        assert torch.equal(qt.quantize(e, "fp8_e4m3"), e)
        return e, s[0].float()
    xe, xs = split(x)
    ge, gs = split(go)

    def cols(t):  # (n, 1, 3, 3) -> (n, P, L)
        return torch.nn.functional.unfold(t, 2)
    a = ge.reshape(N, 2, L).permute(1, 2, 0).reshape(2, L * N)  # K = (l, n)
    b = cols(xe).permute(2, 0, 1).reshape(L * N, P)
    want = accum.accum_matmul(a, b, f, a_scale=gs.reshape(2, L), b_scale=cols(xs[None])[0].t(),
                              a_emin=-6, b_emin=-6).reshape(2, 1, 2, 2)
    assert torch.equal(bits(gw), bits(want))
    xq, gq = qt.quantize(x, fmt.replace(axis=0)), qt.quantize(go, fmt.replace(axis=0))
    old = accum.accum_matmul(gq.reshape(N, 2, L).permute(1, 0, 2).reshape(2, N * L),
                             cols(xq).permute(0, 2, 1).reshape(N * L, P), f)
    assert not torch.equal(bits(gw), bits(old.reshape(2, 1, 2, 2)))
