"""The exact oracle of qt.accum's accumulator model and the input cases the accum tests share.

The oracle below restates the model of qtensor/accum/ (reference.py) (MMA-Sim's fused_dot_add rules) per
output element with Python integers and Fractions, independently of torch; the reference and
the compiled kernel must give its bits exactly (compared as int32 patterns).
"""
import math
from fractions import Fraction

import torch

import qtensor as qt
from qtensor import accum
from qtensor.accum.format import AccumFormat


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


# ---------------------------------------------------------------------------------------------
# QTensor and qt.convert: contractions summed by the operands' accumulator

def _bits_eq(x, y):
    x = x.dequantize() if isinstance(x, qt.QTensor) else x
    y = y.dequantize() if isinstance(y, qt.QTensor) else y
    return torch.equal(bits(x.float()), bits(y.float()))
