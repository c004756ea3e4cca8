"""Triton helpers shared by the kernel families: the per-element rounding of
csrc/include/qtensor/round.h, written with integer bit operations only (no native float8/bf16
casts, float division, fma or transcendental functions), every shift amount clamped, so that
Triton's CPU interpreter and the GPU compiler give the same bits (docs/gpu.md).

``U`` below is a float32 carrier (uint32 bits) unless ``WIDE`` (float64, uint64 bits).
"""
import triton
import triton.language as tl

NEAREST: tl.constexpr = tl.constexpr(0)
NEAREST_AWAY: tl.constexpr = tl.constexpr(1)
TOWARD_ZERO: tl.constexpr = tl.constexpr(2)
STOCHASTIC: tl.constexpr = tl.constexpr(3)


@triton.jit
def lowbias32(v):
    v ^= v >> 16
    v *= 0x7FEB352D
    v ^= v >> 15
    v *= 0x846CA68B
    v ^= v >> 16
    return v


@triton.jit
def random_word(key, index, sr_or):
    """The element's 32-bit random word (reference.random_bits) for its logical int64 index,
    OR-ed with the low bits a limited-bit stochastic rounding drops."""
    ikey = key.to(tl.uint32) ^ lowbias32((index >> 32).to(tl.uint32))
    return lowbias32(index.to(tl.uint32) ^ ikey) | sr_or.to(tl.uint32)


@triton.jit
def u32(v):
    return v.to(tl.uint32)


@triton.jit
def clamp_i(v, lo, hi):
    return tl.minimum(tl.maximum(v, lo), hi)


@triton.jit
def pow2_bits(e, WIDE: tl.constexpr):
    """2^e as carrier bits (e in the carrier's range, subnormals included)."""
    if WIDE:
        sh = clamp_i(e + 1074, 0, 63).to(tl.uint64)
        normal = (e + 1023).to(tl.uint64) << 52
        return tl.where(e >= -1022, normal, tl.full(e.shape, 1, tl.uint64) << sh)
    else:
        sh = clamp_i(e + 149, 0, 31).to(tl.uint32)
        normal = (e + 127).to(tl.uint32) << 23
        return tl.where(e >= -126, normal, tl.full(e.shape, 1, tl.uint32) << sh)


@triton.jit
def pow2_f64(e):
    """2^e as a float64 (e in float64's normal range)."""
    return ((e.to(tl.int64) + 1023) << 52).to(tl.float64, bitcast=True)


@triton.jit
def binade_of(A, WIDE: tl.constexpr):
    """floor(log2 a) of a positive finite magnitude from its bits; a subnormal's through the
    exact int -> float conversion of its significand."""
    if WIDE:
        E = (A >> 52).to(tl.int32)
        sub = ((A.to(tl.int64).to(tl.float64).to(tl.uint64, bitcast=True) >> 52).to(tl.int32)
               - 1023 - 1074)
        return tl.where(E != 0, E - 1023, sub)
    else:
        E = (A >> 23).to(tl.int32)
        sub = ((A.to(tl.int32).to(tl.float32).to(tl.uint32, bitcast=True) >> 23).to(tl.int32)
               - 127 - 149)
        return tl.where(E != 0, E - 127, sub)


@triton.jit
def mode_up(lo_odd, rbits, thr, MODE: tl.constexpr):
    """Whether the magnitude rounds up: the mode's 32-bit word < thr = floor(frac * 2^32)."""
    if MODE == 0:
        w = 0x80000000 - lo_odd
    elif MODE == 1:
        w = tl.full(thr.shape, 0x7FFFFFFF, tl.uint32)
    elif MODE == 2:
        w = tl.full(thr.shape, 0xFFFFFFFF, tl.uint32)
    else:
        w = rbits
    return w.to(tl.uint32) < thr


@triton.jit
def round_magnitude(A, emin, man, qlow, rbits, MODE: tl.constexpr, WIDE: tl.constexpr):
    """round.h round_magnitude: a finite magnitude (bits A) rounded to the grid of spacing
    2^(binade - man) from 2^emin up, 2^qlow below."""
    if WIDE:
        MAN: tl.constexpr = 52
        BIAS_MAN: tl.constexpr = 1075
        UT: tl.constexpr = tl.uint64
        E = (A >> 52).to(tl.int32)
        MANMASK = tl.full(A.shape, 0x000FFFFFFFFFFFFF, tl.uint64)
    else:
        MAN: tl.constexpr = 23
        BIAS_MAN: tl.constexpr = 150
        UT: tl.constexpr = tl.uint32
        E = (A >> 23).to(tl.int32)
        MANMASK = tl.full(A.shape, 0x007FFFFF, tl.uint32)
    one = tl.full(A.shape, 1, UT)
    binade = binade_of(A, WIDE)
    qexp = tl.where(binade >= emin, binade - man, qlow)
    ulp = tl.maximum(E, 1) - BIAS_MAN
    d = qexp - ulp
    tiny = d > MAN
    dn = tl.where(d < 0, 0, tl.where(tiny, MAN, d))
    mask = (one << dn.to(UT)) - 1
    fb = A & mask
    if WIDE:
        sl = tl.where(dn < 31, 31 - dn, 0).to(tl.uint64)
        sr = tl.where(dn > 32, dn - 32, 0).to(tl.uint64)
        thr_n = tl.where(dn <= 31, (fb << sl) << 1, fb >> sr).to(tl.uint32)
    else:
        thr_n = (fb << (31 - dn).to(tl.uint32)) << 1
    M = tl.where(E != 0, (A & MANMASK) | (one << MAN), A)
    ls = clamp_i(32 - d, 0, 31).to(UT)
    rs = clamp_i(d - 32, 0, 63 if WIDE else 31).to(UT)
    thr_t = tl.where(d <= 32, M << ls, M >> rs).to(tl.uint32)
    thr = tl.where(tiny, thr_t, thr_n)
    lo_odd = tl.where(tiny, 0, ((M >> dn.to(UT)) & 1).to(tl.uint32)).to(tl.uint32)
    up = mode_up(lo_odd, rbits, thr, MODE)
    res_n = (A & (mask ^ (0xFFFFFFFFFFFFFFFF if WIDE else 0xFFFFFFFF))) + (up.to(UT) << dn.to(UT))
    res_t = tl.where(up, pow2_bits(qexp, WIDE), tl.zeros(A.shape, UT))
    return tl.where(tiny, res_t, res_n)


@triton.jit
def round_float(u, man, emin, qlow, max_bits, ovf_bits, min_normal_bits, is_unsigned, rbits,
                MODE: tl.constexpr, WIDE: tl.constexpr):
    """round.h round_float: bits u rounded to a float format (is_unsigned: exponent-only, no zero
    and no sign)."""
    if WIDE:
        SIGN = tl.full(u.shape, 0x8000000000000000, tl.uint64)
        ABS = tl.full(u.shape, 0x7FFFFFFFFFFFFFFF, tl.uint64)
        INF = tl.full(u.shape, 0x7FF0000000000000, tl.uint64)
        QNAN = tl.full(u.shape, 0x7FF8000000000000, tl.uint64)
    else:
        SIGN = tl.full(u.shape, 0x80000000, tl.uint32)
        ABS = tl.full(u.shape, 0x7FFFFFFF, tl.uint32)
        INF = tl.full(u.shape, 0x7F800000, tl.uint32)
        QNAN = tl.full(u.shape, 0x7FC00000, tl.uint32)
    sign = u & SIGN
    A = u & ABS
    nonfinite = A >= INF
    nan = A > INF
    r = round_magnitude(tl.where(nonfinite, 0, A).to(A.dtype), emin, man, qlow, rbits, MODE, WIDE)
    if MODE == 2:
        r = tl.where(r > max_bits, max_bits, r)
    else:
        r = tl.where(r > max_bits, ovf_bits, r)
    r = tl.where(nonfinite, ovf_bits, r).to(A.dtype)
    r_uns = tl.where(r == 0, min_normal_bits, r).to(A.dtype)
    r_uns = tl.where((sign == 0) & (A != 0) & (~nan), r_uns, QNAN)
    return tl.where(is_unsigned, r_uns, tl.where(nan, u, r | sign))


@triton.jit
def wrap_fixed(r, negative, qexp, wl, kmin, kmax, is_signed):
    """round.h wrap_fixed (float32 carrier): the two's-complement wrap of an out-of-range
    rounded magnitude r into the format's range, as float32 bits."""
    E = (r >> 23).to(tl.int32)
    M = tl.where(E != 0, (r & 0x007FFFFF) | 0x00800000, r).to(tl.uint64)
    t = tl.maximum(E, 1) - 150 - qexp
    span_mask = (tl.full(r.shape, 1, tl.uint64) << wl.to(tl.uint64)) - 1
    kmod = tl.where(t >= wl, 0,
                    tl.where(t >= 0, M << clamp_i(t, 0, 63).to(tl.uint64),
                             M >> clamp_i(-t, 0, 63).to(tl.uint64))).to(tl.uint64)
    kmod &= span_mask
    kmod = tl.where(negative, (0 - kmod) & span_mask, kmod)
    k = kmod.to(tl.int64)
    half = tl.full(r.shape, 1, tl.int64) << (wl - 1).to(tl.int64)
    k = tl.where(is_signed & (k >= half), k - 2 * half, k)
    k = clamp_i(k, kmin, kmax)
    q = pow2_bits(tl.full(r.shape, 0, tl.int32) + qexp, False).to(tl.float32, bitcast=True)
    # the product is exact in float64 and rounded once to float32, as round.h's float product
    return (k.to(tl.float64) * q.to(tl.float64)).to(tl.float32).to(tl.uint32, bitcast=True)


@triton.jit
def round_fixed(u, qexp, pos_bits, neg_bits, neg_sat_bits, rbits, MODE: tl.constexpr,
                WIDE: tl.constexpr):
    """round.h round_fixed without the wrap: bits u rounded to the fixed grid 2^qexp, clamped
    (no negative zero)."""
    if WIDE:
        SIGN = tl.full(u.shape, 0x8000000000000000, tl.uint64)
        ABS = tl.full(u.shape, 0x7FFFFFFFFFFFFFFF, tl.uint64)
        INF = tl.full(u.shape, 0x7FF0000000000000, tl.uint64)
    else:
        SIGN = tl.full(u.shape, 0x80000000, tl.uint32)
        ABS = tl.full(u.shape, 0x7FFFFFFF, tl.uint32)
        INF = tl.full(u.shape, 0x7F800000, tl.uint32)
    sign = u & SIGN
    A = u & ABS
    nonfinite = A >= INF
    nan = A > INF
    r = round_magnitude(tl.where(nonfinite, 0, A).to(A.dtype), 100000, 0, qexp, rbits, MODE, WIDE)
    neg = sign != 0
    lim = tl.where(neg, neg_bits, pos_bits)
    over = nonfinite | (r > lim)
    sat = tl.where(neg, neg_sat_bits, pos_bits)
    out = tl.where(over, sat, r | tl.where(r != 0, sign, 0)).to(A.dtype)
    return tl.where(nan, u, out), r, over & (~nonfinite)
