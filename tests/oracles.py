"""Slow, exact, independent oracles for the number formats (qtensor/formats/, reference.py).

Written from the contract's text with Python integers and ``fractions.Fraction``; they read only a
format's *fields* (exp, man, bias, specials, ... / wl, fl, ...), never its computed properties or
anything in qtensor.kernels.reference, so a bug there cannot hide here.

Conventions (the numerical contract):
- Rounding picks one of the two neighbours lo <= |x| <= hi on the grid extended past max with the
  spacing of max's binade; it works on magnitudes and the sign of x is put back (so -0.0 results
  in float formats; fixed point has no negative zero, nor have integer block elements: +0.0).
- "Ties to even": the neighbour that is an even multiple of the spacing hi - lo. For man >= 1 this
  is the code whose mantissa ends in 0. It also fixes the two cases where codes do not decide:
  man = 0 (1.5 * 2^e goes up to 2^(e+1), as ml_dtypes and torch do for E8M0), and formats without
  subnormals, where min_normal / 2 goes to 0.
- Overflow = the rounded magnitude exceeds max: the format's overflow value (max, Inf or NaN),
  except that toward_zero gives max for a finite x (IEEE 754 roundTowardZero); Inf input always
  gives the overflow value.
"""
from __future__ import annotations

import math
from fractions import Fraction
from typing import List, Optional, Tuple

INF = float("inf")
NAN = float("nan")


# ---------------------------------------------------------------------------------------------
# Float formats, from their fields

def float_fields(fmt):
    """(exp, man, bias, subnormals, specials, saturate, signed) with FloatFormat's default bias."""
    bias = fmt.bias if fmt.bias is not None else 2 ** (fmt.exp - 1) - 1
    return fmt.exp, fmt.man, bias, fmt.subnormals, fmt.specials, fmt.saturate, fmt.signed


def decode_float(code: int, fmt) -> Optional[float]:
    """The value of a bit pattern (sign | exponent | mantissa), as a Python float.

    NaN/Inf for special codes, None for codes that are not values (subnormal codes of a format
    without subnormals). Unsigned formats without subnormals (E8M0-like): value 2^(E - bias),
    all-ones code NaN; unsigned ones with subnormals (UE5M3): no sign bit, else as signed.
    """
    exp, man, bias, subnormals, specials, _, signed = float_fields(fmt)
    top_e = 2 ** exp - 1
    if not signed and not subnormals:
        return NAN if code == top_e else math.ldexp(1.0, code - bias)
    sign = -1.0 if signed and code >> (exp + man) & 1 else 1.0
    e_field = (code >> man) & top_e
    m_field = code & (2 ** man - 1)
    if specials == "ieee" and e_field == top_e:
        return sign * INF if m_field == 0 else NAN
    if specials == "fn" and e_field == top_e and m_field == 2 ** man - 1:
        return NAN
    if e_field == 0:
        if m_field and not subnormals:
            return None
        return sign * float(Fraction(m_field, 2 ** man) * Fraction(2) ** (1 - bias))
    return sign * float((1 + Fraction(m_field, 2 ** man)) * Fraction(2) ** (e_field - bias))


def float_codes(fmt) -> List[Tuple[int, float]]:
    """Every code of a format and its value (None-valued codes dropped)."""
    nbits = int(fmt.signed) + fmt.exp + fmt.man
    out = []
    for code in range(2 ** nbits):
        v = decode_float(code, fmt)
        if v is not None:
            out.append((code, v))
    return out


def float_limits(fmt) -> Tuple[int, int, Fraction, Fraction]:
    """(emin, emax, max, min_positive) straight from the contract's definitions."""
    exp, man, bias, subnormals, specials, _, signed = float_fields(fmt)
    if not signed and not subnormals:  # exponent-only: 2^-bias .. 2^(2^exp - 2 - bias)
        return -bias, 2 ** exp - 2 - bias, Fraction(2) ** (2 ** exp - 2 - bias), Fraction(2) ** -bias
    emin = 1 - bias
    if specials == "ieee" or (specials == "fn" and man == 0):
        emax = 2 ** exp - 2 - bias
        top_m = 2 ** man - 1
    elif specials == "fn":
        emax, top_m = 2 ** exp - 1 - bias, 2 ** man - 2
    else:
        emax, top_m = 2 ** exp - 1 - bias, 2 ** man - 1
    mx = (1 + Fraction(top_m, 2 ** man)) * Fraction(2) ** emax
    mn = Fraction(2) ** (emin - man) if subnormals else Fraction(2) ** emin
    return emin, emax, mx, mn


def floor_log2(a: Fraction) -> int:
    """floor(log2(a)) for a > 0, exactly."""
    e = a.numerator.bit_length() - a.denominator.bit_length()
    return e - 1 if Fraction(2) ** e > a else e


def _pick(a: Fraction, lo: Fraction, q: Fraction, mode: str):
    """Round a in [lo, lo + q] (q the spacing) by mode; stochastic gives both candidates."""
    hi = lo + q
    if a == lo:
        return lo
    if mode == "toward_zero":
        return lo
    if mode == "stochastic":
        return (lo, hi)
    d_lo, d_hi = a - lo, hi - a
    if d_lo != d_hi:
        return lo if d_lo < d_hi else hi
    if mode == "nearest_away":
        return hi
    return lo if (lo / q) % 2 == 0 else hi  # ties to even


def _with_sign(v, negative: bool) -> float:
    v = float(v)
    return -v if negative else v  # -0.0 for negative inputs that round to zero


def _split(x):
    """(negative, |x| as Fraction) of a float or a Fraction; None for NaN."""
    if isinstance(x, Fraction):
        return x < 0, abs(x)
    return math.copysign(1.0, x) < 0, Fraction(abs(x))


def round_float(x, fmt, mode: Optional[str] = None):
    """x (a float or an exact Fraction) rounded to a FloatFormat, as a float.

    Stochastic rounding gives the tuple of the two possible results.
    """
    mode = mode or fmt.rounding
    exp, man, bias, subnormals, specials, saturate, signed = float_fields(fmt)
    emin, emax, mx, mn = float_limits(fmt)
    overflow = float(mx) if saturate else (INF if specials == "ieee" else NAN)
    if isinstance(x, float) and math.isnan(x):
        return NAN
    e8m0 = not signed and not subnormals
    if e8m0:
        if not x > 0:  # no zero, no negatives
            return NAN
        if x == INF:
            return overflow
    elif not signed and x < 0:  # unsigned with zero (UE5M3): no negatives; -0.0 is +0.0
        return NAN
    elif not signed and x == 0:
        return 0.0
    elif isinstance(x, float) and math.isinf(x):
        return math.copysign(overflow, x) if not math.isnan(overflow) else NAN
    neg, a = _split(x)
    if a == 0:
        return _with_sign(0, neg)
    e = floor_log2(a)
    if e > emax:
        q = Fraction(2) ** (emax - man)
    elif e >= emin:
        q = Fraction(2) ** (e - man)
    else:
        q = Fraction(2) ** (emin - man) if subnormals else Fraction(2) ** emin
    lo = (a // q) * q
    r = _pick(a, lo, q, mode)

    def finish(v):
        if v > mx:
            over = float(mx) if mode == "toward_zero" else overflow  # x is finite here
            return over if (math.isnan(over) or not signed) else _with_sign(over, neg)
        if e8m0 and v < mn:  # nothing below the smallest scale
            return float(mn)
        return _with_sign(v, neg)
    return tuple(finish(v) for v in r) if isinstance(r, tuple) else finish(r)


# ---------------------------------------------------------------------------------------------
# Fixed point

def fixed_range(fmt) -> Tuple[int, int]:
    """(kmin, kmax) from the contract (FixedFormat)."""
    if not fmt.signed:
        return 0, 2 ** fmt.wl - 1
    return -(2 ** (fmt.wl - 1)) + int(fmt.symmetric), 2 ** (fmt.wl - 1) - 1


def round_fixed(x: float, fmt, mode: Optional[str] = None):
    """x rounded to a FixedFormat k * 2^-fl, as a float (stochastic: the two candidates)."""
    mode = mode or fmt.rounding
    kmin, kmax = fixed_range(fmt)
    scale = Fraction(2) ** -fmt.fl
    if isinstance(x, float) and math.isnan(x):
        return NAN
    if isinstance(x, float) and math.isinf(x):
        return float((kmax if x > 0 else kmin) * scale)
    neg, a = _split(x)
    y = a / scale
    r = _pick(y, Fraction(math.floor(y)), Fraction(1), mode)

    def finish(k):
        k = -k if neg else k
        if kmin <= k <= kmax:  # no negative zero: k = 0 is +0.0
            return float(k * scale)
        if fmt.saturate:
            k = min(max(k, kmin), kmax)
        else:  # two's-complement wrap into the word
            low = -(2 ** (fmt.wl - 1)) if fmt.signed else 0
            k = (k - low) % (2 ** fmt.wl) + low
            k = min(max(k, kmin), kmax)  # symmetric: the dropped code -2^(wl-1) clamps
        return float(k * scale)  # a clamped or wrapped 0 is +0.0
    return tuple(finish(k) for k in r) if isinstance(r, tuple) else finish(r)


def round_scalar(x: float, fmt, mode: Optional[str] = None):
    if hasattr(fmt, "wl"):
        return round_fixed(x, fmt, mode)
    return round_float(x, fmt, mode)


def elem_limits(elem) -> Tuple[int, Fraction]:
    """(emax, max) of a block's element format: the exponent of its largest value, and it."""
    if hasattr(elem, "wl"):
        mx = fixed_range(elem)[1] * Fraction(2) ** -elem.fl
        return floor_log2(mx), mx
    _, emax, mx, _ = float_limits(elem)
    return emax, mx


# ---------------------------------------------------------------------------------------------
# Blocks

def block_scale(amax: Fraction, fmt, ts: Optional[Fraction] = None) -> Fraction:
    """The shared scale X of a block with finite amax > 0 (BlockFormat's scale_rule); with a
    tensor scale ts (tensor_scale=True), X * ts with X saturating."""
    emax_elem, max_elem = elem_limits(fmt.elem)
    if fmt.scale_rule == "amax" and ts is not None:
        if ts == 0:
            return Fraction(0)
        sat = fmt.scale.replace(saturate=True)
        return Fraction(round_float(amax / (max_elem * ts), sat, "nearest")) * ts
    if fmt.scale_rule == "amax":  # the scale format's nearest value to the exact amax / max_elem
        return Fraction(round_float(amax / max_elem, fmt.scale, "nearest"))
    k = floor_log2(amax) - emax_elem
    if fmt.scale_rule == "ceil":  # the smallest power of two with amax / X <= max_elem
        while amax / Fraction(2) ** k > max_elem:
            k += 1
        while amax / Fraction(2) ** (k - 1) <= max_elem:
            k -= 1
    s_emin, s_emax, _, _ = float_limits(fmt.scale)
    return Fraction(2) ** min(max(k, s_emin), s_emax)


def twos_complement(elem) -> bool:
    """Whether elem is signed two's-complement fixed point: one more negative code,
    -2^(wl-1-fl), than positive ones."""
    return hasattr(elem, "wl") and elem.signed and not elem.symmetric


def floor_binade(values, fmt) -> Optional[int]:
    """The exponent b of the floor rule's scale 2^(b - emax_elem) of a block (None: all zeros):
    floor(log2 amax); with two's-complement elements the smallest b with every value in
    [-2^(b+1), 2^(b+1)), i.e. the max of floor(log2 p) over positives p and ceil(log2 |n|) - 1
    over negatives n (a block's -2^c is the code -2^(emax_elem+1) of the scale below)."""
    b = None
    for v in values:
        if v == 0:
            continue
        a = abs(Fraction(v))
        e = floor_log2(a)
        if v < 0 and twos_complement(fmt.elem) and a == Fraction(2) ** e:
            e -= 1
        b = e if b is None else max(b, e)
    return b


def quantize_block(values: List[float], fmt, mode: Optional[str] = None,
                   ts: Optional[Fraction] = None) -> list:
    """One block (a list of floats) quantized; stochastic entries are (lo, hi) tuples; ts: the
    tensor scale of a tensor_scale=True format."""
    mode = mode or fmt.rounding
    if any(math.isnan(v) or math.isinf(v) for v in values):
        return [NAN] * len(values)  # the E8M0 NaN scale
    amax = max((Fraction(abs(v)) for v in values), default=Fraction(0))
    integer = hasattr(fmt.elem, "wl")

    def zero(v):  # float elements keep the sign of zero; integer elements have only +0.0
        return 0.0 if integer else _with_sign(0, math.copysign(1.0, v) < 0)
    if amax == 0:
        return [zero(v) for v in values]
    if fmt.scale_rule == "floor":  # (amax's binade, or the two's-complement rule's)
        amax = Fraction(2) ** floor_binade(values, fmt)
    X = block_scale(amax, fmt, ts)
    elem = fmt.elem.replace(saturate=True)
    if fmt.scale_rule == "amax" and mode != "stochastic":
        # the scale of the rounded block's own amax must be X: else round again with it
        while X > 0:
            rmax = max(abs(Fraction(round_scalar(Fraction(v) / X, elem, mode))) for v in values) * X
            X2 = block_scale(rmax, fmt, ts) if rmax > 0 else Fraction(0)
            if X2 >= X:
                break
            X = X2

    if fmt.scale_rule == "amax" and mode == "stochastic":
        # every scale the re-rounding can reach; an element's candidates at each of them
        scales, todo = {X}, [X]
        while todo:
            S = todo.pop()
            if S == 0:
                continue
            cands = [round_scalar(Fraction(v) / S, elem, mode) for v in values]
            cands = [c if isinstance(c, tuple) else (c,) for c in cands]
            floor_max = max(min(abs(Fraction(c)) for c in cs) for cs in cands)
            for cs in cands:
                for c in cs:
                    if abs(Fraction(c)) >= floor_max:
                        S2 = (block_scale(abs(Fraction(c)) * S, fmt, ts) if c != 0
                              else Fraction(0))
                        if S2 < S and S2 not in scales:
                            scales.add(S2)
                            todo.append(S2)
        per_scale = [_block_at(values, S, elem, mode, zero) for S in sorted(scales)]
        return [tuple(sorted(set(c for q in qs for c in (q if isinstance(q, tuple) else (q,))),
                             key=lambda c: (c, math.copysign(1, c))))
                for qs in zip(*per_scale)]
    return _block_at(values, X, elem, mode, zero)


def _block_at(values, X, elem, mode, zero) -> list:
    """One block's elements rounded with the scale X."""
    def back(r, v):
        if r == 0:
            return zero(v)
        return float(Fraction(r) * X)
    out = []
    for v in values:
        if v == 0 or X == 0:  # a zero scale (NVFP4 underflow) leaves zeros
            out.append(zero(v))
            continue
        r = round_scalar(Fraction(v) / X, elem, mode)  # x / X exactly
        out.append(tuple(back(c, v) for c in r) if isinstance(r, tuple) else back(r, v))
    return out


# ---------------------------------------------------------------------------------------------
# Test inputs

def sample_float32(n: int, emin: int, emax: int, man: int, seed: int = 0):
    """n float32 values that exercise a format with exponents emin..emax and man mantissa bits.

    A quarter are random bit patterns (every binade of float32, its subnormals, +-Inf, NaNs), half
    have random exponents from the format's smallest quantum to past its max (every binade of the
    target, its subnormals, overflow) with random 23-bit mantissas, and a quarter have only man + 2
    random mantissa bits, so they hit the target's ties and quarter points exactly. Plus +-0,
    +-Inf, NaN and float32's extremes.
    """
    import torch
    g = torch.Generator().manual_seed(seed)
    n1, n2 = n // 4, n // 2
    n3 = n - n1 - n2
    raw = torch.randint(-2 ** 31, 2 ** 31, (n1,), generator=g, dtype=torch.int64)
    part1 = raw.to(torch.int32).view(torch.float32)
    lo_e, hi_e = max(emin - man - 3, -160), min(emax + 3, 128)

    def with_exponents(k, mant_bits):
        e = torch.randint(lo_e, hi_e, (k,), generator=g, dtype=torch.int64)
        m = torch.randint(0, 2 ** mant_bits, (k,), generator=g, dtype=torch.int64)
        sig = 1.0 + m.to(torch.float64) / 2.0 ** mant_bits
        sign = torch.randint(0, 2, (k,), generator=g).to(torch.float64) * 2 - 1
        return (sign * torch.ldexp(sig, e.to(torch.float64))).to(torch.float32)
    part2 = with_exponents(n2, 23)
    part3 = with_exponents(n3, min(man + 2, 23))
    fmax = torch.finfo(torch.float32).max
    tiny = torch.finfo(torch.float32).smallest_normal
    special = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), fmax, -fmax,
                            tiny, -tiny, 2.0 ** -149, -(2.0 ** -149)], dtype=torch.float32)
    return torch.cat([special, part1, part2, part3])


# ---------------------------------------------------------------------------------------------
# Clipping inside a block (qtensor.tensor.flush_warnings.clipping)

def _e4m3_nearest(v: float) -> float:
    """v >= 0 rounded to nearest-even OCP E4M3 (saturating at 448), by its grid."""
    if v >= 448:
        return 448.0
    e = max(math.floor(math.log2(v)), -6) if v > 0 else -6
    q = 2.0 ** (e - 3)
    return round(v / q) * q  # Python's round: ties to even


def block_clipping(x, rule: str, elem_max: float, emax: int, bs=None, tile=None,
                   elem_min=None, nvfp4=False):
    """(clipped, lost) of x (a list of rows): each block's scale by the rule, block by block
    in float64; a value is clipped where it lies beyond elem_max * X (below elem_min * X), and
    loses its distance to that value. Rules: "floor" (2^(floor(log2 amax) - emax)), "ceil"
    (2^ceil(log2(amax / elem_max))), "amax" with ``nvfp4`` (Transformer Engine's rule in its
    float32 steps: encode scale S = fl32(6 * 448 / tensor amax), decode 1/S, X the E4M3 value
    nearest to fl32(amax * fl32(S * fl32(1/6))), the block's top fl32(6 * X * decode)). Blocks
    of ``bs`` along the rows, or tiles ``tile`` = (rows, cols), partial at the ends."""
    elem_min = -elem_max if elem_min is None else elem_min
    R, C = len(x), len(x[0])
    if tile is not None:
        r, c = tile
        blocks = [[x[i][j] for i in range(i0, min(i0 + r, R)) for j in range(j0, min(j0 + c, C))]
                  for i0 in range(0, R, r) for j0 in range(0, C, c)]
    else:
        blocks = [x[i][j:j + bs] for i in range(R) for j in range(0, C, bs)]
    enc = dec = None
    if nvfp4:
        enc = f32(f32(6 * 448.0) / f32(max(abs(v) for row in x for v in row)))
        dec = f32(1.0 / enc)
    count, lost = 0, 0.0
    for blk in blocks:
        amax = max(abs(v) for v in blk)
        if amax == 0:
            continue
        if rule == "floor":
            X = 2.0 ** (math.floor(math.log2(amax)) - emax)
        elif rule == "ceil":
            X = 2.0 ** math.ceil(math.log2(amax / elem_max))
        else:
            X = None
            top = f32(6 * _e4m3_nearest(f32(f32(amax) * f32(enc * f32(1 / 6.0)))) * dec)
        hi, lo = (elem_max * X, elem_min * X) if X is not None else (top, -top)
        for v in blk:
            if v > hi:
                count, lost = count + 1, lost + v - hi
            elif v < lo:
                count, lost = count + 1, lost + lo - v
    return count, lost


# ---------------------------------------------------------------------------------------------
# NVFP4 by Transformer Engine's rule, one float32 step at a time (each step computed exactly in
# Python's float64 and rounded once to float32: for one +, *, / of float32 operands that is the
# float32 operation's own result)

def f32(v: float) -> float:
    """v rounded to nearest float32 (inf past FLT_MAX)."""
    import numpy as np
    with np.errstate(over="ignore"):
        return float(np.float32(v))


F32_MAX = 3.4028234663852886e38


def round_with_word(x: float, fmt, word: int, nbits: int = 32) -> float:
    """x (a float within fmt's range) stochastically rounded to a FloatFormat with the random
    word ``word`` (a uint32): up to the larger neighbour iff the word's top ``nbits`` bits, as an
    integer, are below floor(frac * 2^nbits), frac = x's distance above the smaller neighbour
    in units of their spacing."""
    r = round_float(x, fmt, "stochastic")
    if not isinstance(r, tuple):
        return r
    lo, hi = r
    frac = (abs(Fraction(x)) - abs(Fraction(lo))) / (abs(Fraction(hi)) - abs(Fraction(lo)))
    return hi if (word >> (32 - nbits)) < math.floor(frac * 2 ** nbits) else lo


def _fmt_max(fmt) -> float:
    return float(max(v for _c, v in float_codes(fmt) if v is not None and math.isfinite(v)))


def nvfp4_te(rows, e4m3, e2m1, bound: Optional[float] = None, block: int = 16,
             tensor_scale=None, *, mode: str = "nearest", words=None, nbits: int = 32,
             scale_rule: str = "amax", settle: bool = False):
    """rows (lists of float32 values; blocks of ``block`` along each row) by TE's NVFP4 rule:
    (values, decode tensor scale). e4m3/e2m1: the scale and element formats (rounded through
    :func:`round_float`, saturating as TE's satfinite casts; the scale to nearest). ``bound``:
    the scale value the tensor amax maps to (default: the scale format's max; for 4over6 the
    largest power of two <= max * 4/6). ``tensor_scale``: a given decode scale instead of the
    one of the rows' amax (its encode scale: 1/s in float32).

    mode: the elements' rounding (nearest, nearest_away, toward_zero, stochastic); stochastic
    takes ``words`` (rows of uint32, one per element) and uses their top ``nbits`` bits.
    toward_zero and stochastic keep an element whose nearest rounding gives back x exactly.
    scale_rule: "amax" (X the nearest scale to the block's target), "4over6" (X6 and X4 = the
    nearest scales to base = fl32(fl32(amax_b / 6) * S_enc) and fl32(base * 1.5), the block
    rounded with each, map-4 kept where its float32 sum of |fl32(fl32(fl32(e X) amax) / M) - x|
    in element order is lower), "ceil" (the smallest scale value X whose block top
    fl32(fl32(6 X) s) is at least amax_b; the scale's max if none). settle: each block rounded
    again with the scale of its rounded max while that scale is lower (4over6: each
    candidate on its own)."""
    elem_max = _fmt_max(e2m1)
    smax = _fmt_max(e4m3)
    if bound is None:
        bound = smax if scale_rule != "4over6" else 2.0 ** math.floor(math.log2(smax * 4 / 6))
    M = f32(elem_max * bound)
    if tensor_scale is None:
        finite = [abs(v) for r in rows for v in r if math.isfinite(v)]
        amax = max(finite, default=0.0)
        enc = f32(M / amax) if amax > 0 else 1.0
        enc = min(enc, F32_MAX)
        if enc == 0:
            enc = 1.0
        dec = f32(1.0 / enc)
    else:
        dec = tensor_scale
        enc = f32(1.0 / dec)
        amax = f32(M / enc)
    amax32 = f32(amax)
    inv_max = f32(1.0 / elem_max)
    scales = sorted(v for _c, v in float_codes(e4m3) if v is not None and math.isfinite(v)
                    and v >= 0)

    def nearest_scale(t):
        return round_float(min(t, smax), e4m3, "nearest")

    def scale_amax(a):
        return nearest_scale(f32(a * f32(enc * inv_max)))

    def scale_ceil(a):
        return next((X for X in scales if f32(f32(elem_max * X) * dec) >= a), smax)

    def scale_map6(a):
        return nearest_scale(f32(f32(a / elem_max) * enc))

    def scale_map4(a):
        return nearest_scale(f32(f32(f32(a / elem_max) * enc) * 1.5))

    scale_ofs = {"amax": [scale_amax], "ceil": [scale_ceil],
                 "4over6": [scale_map6, scale_map4]}[scale_rule]

    def element(v, y, X, w):
        y = max(-elem_max, min(elem_max, y))
        en = round_float(y, e2m1, "nearest")
        if mode == "nearest_away":
            return round_float(y, e2m1, mode)
        if mode == "nearest" or f32(en * X * dec) == v:
            return en
        if mode == "toward_zero":
            return round_float(y, e2m1, mode)
        return round_with_word(y, e2m1, w, nbits)

    def payload(vals, ws, X):  # the elements times X, exact
        d = f32(X * dec)
        inv = F32_MAX if d == 0 else min(f32(1.0 / d), F32_MAX)
        return [element(v, f32(v * inv), X, w) * X for v, w in zip(vals, ws)]

    def settled(vals, ws, scale_of):
        X = scale_of(max(abs(v) for v in vals))
        p = payload(vals, ws, X)
        while settle:
            X2 = scale_of(max(abs(f32(q * dec)) for q in p))
            if X2 >= X:
                break
            X, p = X2, payload(vals, ws, X2)
        return p

    def err(vals, p):
        acc = 0.0
        for v, q in zip(vals, p):
            acc = f32(acc + abs(f32(f32(f32(q * amax32) / M) - v)))
        return acc

    out = []
    for i, r in enumerate(rows):
        res = []
        for b in range(0, len(r), block):
            vals = r[b:b + block]
            ws = words[i][b:b + block] if words is not None else [None] * len(vals)
            if not all(math.isfinite(v) for v in vals):
                res += [NAN] * len(vals)
                continue
            p = settled(vals, ws, scale_ofs[0])
            if len(scale_ofs) == 2:
                p4 = settled(vals, ws, scale_ofs[1])
                if err(vals, p4) < err(vals, p):
                    p = p4
            for v, q in zip(vals, p):
                q = f32(q * dec)  # (e * X exact: one float32 rounding)
                res.append(math.copysign(0.0, v) if q == 0 else q)
        out.append(res)
    return out, dec
