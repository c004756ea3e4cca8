"""Triton kernels of the block families: qtensor::quantize_block and qtensor::quantize_two_level.

quantize_block: MX and custom block formats of any size along any axis (strided, without a
transposing copy), partial blocks, the floor, ceil, even, amax and 4over6 scale rules (the even
and amax rules' settling step included), power-of-two (E8M0) and mantissa-bit (E4M3, FP32, bf16)
scales; every rounding mode. 2D tiles reach it laid out as 1D blocks (qtensor.kernels.ops). One
program rounds BR blocks, looping over each block's elements in chunks of BC: the amax pass, the
scale, then (for the even and amax rules) settling passes, (4over6) the second candidate's and an
error pass in element order, then the rounding pass.

quantize_two_level: two-level formats (tensor_scale=True: nvfp4 and its variants) by Transformer
Engine's rule, reference.quantize_two_level's float32 steps (the C++ kernel's tl_blocks): the
tensor's finite amax is a torch reduction, then one program rounds BR blocks (1D blocks along any
axis and 2D tiles, as the tiles of x viewed as [groups, rows, cols]) in the same passes."""
import math

import torch
import triton
import triton.language as tl

from . import _common as C
from ._layout import launcher, finish, interpreted, key_and_mode

__all__ = ["quantize_block", "quantize_two_level"]

_FLOOR, _CEIL, _AMAX, _EVEN, _4OVER6 = 0, 1, 2, 3, 4


@triton.jit
def _scale_exp(amax, elem_emax, elem_max, scale_emin, scale_emax, even_mbits, RULE: tl.constexpr):
    """round.h block_scale_exp: the power-of-two scale's exponent of blocks of amax (bits)."""
    b = tl.where(amax == 0, -1, C.binade_of(amax, False))
    a64 = amax.to(tl.float32, bitcast=True).to(tl.float64)
    if RULE == 3:
        thr = (C.pow2_bits(b + 1, True).to(tl.float64, bitcast=True)
               - C.pow2_bits(b - even_mbits - 1, True).to(tl.float64, bitcast=True))
        b += (a64 >= thr).to(tl.int32)
    k = b - elem_emax
    if RULE == 1:
        p = C.pow2_bits(k, True).to(tl.float64, bitcast=True) * elem_max
        k += (a64 > p).to(tl.int32)
    return C.clamp_i(k, scale_emin, scale_emax)


@triton.jit
def _round_pow2(u, k, rbits, man, emin, qlow, elem_max, fl, kmax, kmin,
                MODE: tl.constexpr, ELEM_FIXED: tl.constexpr):
    """round.h round_block_elem: finite bits u rounded to the element format scaled by 2^k."""
    if ELEM_FIXED:
        qexp = k - fl
        q = C.pow2_bits(qexp, False).to(tl.float32, bitcast=True).to(tl.float64)
        pos = (kmax * q).to(tl.float32).to(tl.uint32, bitcast=True)
        neg = (-kmin * q).to(tl.float32).to(tl.uint32, bitcast=True)
        neg_sat = tl.where(neg != 0, neg | 0x80000000, 0).to(tl.uint32)
        out, _r, _w = C.round_fixed(u, qexp, pos, neg, neg_sat, rbits, MODE, False)
        return out
    else:
        maxk = (elem_max * C.pow2_bits(k, True).to(tl.float64, bitcast=True))
        maxk = maxk.to(tl.float32).to(tl.uint32, bitcast=True)
        A = u & 0x7FFFFFFF
        r = C.round_magnitude(A, emin + k, man, qlow + k, rbits, MODE, False)
        return tl.minimum(r, maxk) | (u & 0x80000000)


@triton.jit
def _round_float_up(r, s_man, s_emin, s_qlow, s_max, s_ovf, s_minn, s_uns):
    """round.h round_float_up: non-negative r (float64) rounded up to the scale format."""
    zero = tl.zeros(r.shape, tl.uint32)
    tb = C.round_float(r.to(tl.uint64, bitcast=True), s_man, s_emin, s_qlow, s_max, s_ovf,
                       s_minn, s_uns, zero, 2, True)
    t = tb.to(tl.float64, bitcast=True)
    b = C.binade_of(tl.where(t > 0, tb, 1).to(tl.uint64), True)
    qexp = tl.where(t > 0, tl.maximum(b, s_emin) - s_man, s_qlow)
    nxt = t + C.pow2_bits(qexp, True).to(tl.float64, bitcast=True)
    nxt = tl.where(nxt > s_max.to(tl.float64, bitcast=True), s_ovf.to(tl.float64, bitcast=True),
                   nxt)
    return tl.where(t < r, nxt, t)


@triton.jit
def _amax_scale(amax, elem_max, s_man, s_emin, s_qlow, s_max, s_ovf, s_minn, s_uns,
                UP: tl.constexpr):
    """round.h amax_block_scale: the scale of blocks of amax (bits)."""
    a = amax.to(tl.float32, bitcast=True).to(tl.float64)
    ratio = a / elem_max
    if UP:
        sc = _round_float_up(ratio, s_man, s_emin, s_qlow, s_max, s_ovf, s_minn, s_uns)
    else:
        zero = tl.zeros(amax.shape, tl.uint32)
        sc = C.round_float(ratio.to(tl.uint64, bitcast=True), s_man, s_emin, s_qlow, s_max,
                           s_ovf, s_minn, s_uns, zero, 0, True).to(tl.float64, bitcast=True)
    return sc


@triton.jit
def _round_amax(u, sc, rbits, man, emin, qlow, e_max, fl, e_pos, e_neg,
                MODE: tl.constexpr, ELEM_FIXED: tl.constexpr):
    """round.h round_amax_elem: bits u rounded to the elements times the scale sc, in float64."""
    ok = sc > 0
    safe = tl.where(ok, sc, 1.0)
    x = u.to(tl.float32, bitcast=True)
    zb = (x.to(tl.float64) / safe).to(tl.uint64, bitcast=True)
    if ELEM_FIXED:
        e_neg_sat = tl.where(e_neg != 0, e_neg | 0x8000000000000000, 0).to(tl.uint64)
        qzb, _r, _w = C.round_fixed(zb, -fl, e_pos, e_neg, e_neg_sat, rbits, MODE, True)
        zero = tl.zeros(u.shape, tl.uint32)
    else:
        qzb = C.round_float(zb, man, emin, qlow, e_max, e_max, e_max, False, rbits, MODE, True)
        zero = u & 0x80000000
    q = qzb.to(tl.float64, bitcast=True) * safe
    return tl.where(ok, q.to(tl.float32).to(tl.uint32, bitcast=True), zero)


@triton.jit
def _settled(sc, x_ptr, xbase, xsl, start, L, bs, lbase, I, row_ok, cols, elem_max, key,
             sr_or, man, emin, qlow, e_max, fl, e_pos, e_neg, s_man, s_emin, s_qlow, s_max,
             s_ovf, s_minn, s_uns, MODE: tl.constexpr, ELEM_FIXED: tl.constexpr,
             UP: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr):
    """round.h settle_amax_scale: while the scale of the rounded block's amax is lower, the
    block takes it (idempotence)."""
    lower = sc > 0
    while tl.max(lower.to(tl.int32), axis=0) > 0:
        ram = tl.zeros([BR], tl.uint32)
        for c0 in range(0, bs, BC):
            j = c0 + cols
            m = row_ok[:, None] & (j[None, :] < bs) & ((start[:, None] + j[None, :]) < L)
            u = tl.load(x_ptr + xbase[:, None] + j[None, :] * xsl, mask=m, other=0.0)
            u = u.to(tl.uint32, bitcast=True)
            if MODE == 3:
                rb = C.random_word(key, lbase[:, None] + j[None, :] * I, sr_or)
            else:
                rb = tl.zeros(u.shape, tl.uint32)
            q = _round_amax(u, sc[:, None], rb, man, emin, qlow, e_max, fl, e_pos, e_neg,
                            MODE, ELEM_FIXED)
            ram = tl.maximum(ram, tl.max(tl.where(m, q & 0x7FFFFFFF, 0), axis=1))
        again = _amax_scale(ram, elem_max, s_man, s_emin, s_qlow, s_max, s_ovf, s_minn,
                            s_uns, UP)
        lower = (again < sc) & (sc > 0)
        sc = tl.where(lower, again, sc)
    return sc


@triton.jit
def _block_kernel(x_ptr, y_ptr, nblocks, L, I, nb, bs, xso, xsl, xsi, yso, ysl, ysi,
                  man, emin, qlow, elem_emax, elem_max, fl, kmin, kmax,
                  scale_emin, scale_emax, even_mbits,
                  s_man, s_emin, s_qlow, s_max, s_ovf, s_minn, s_uns, e_max, e_pos, e_neg,
                  key, sr_or,
                  RULE: tl.constexpr, MODE: tl.constexpr, ELEM_FIXED: tl.constexpr,
                  UP: tl.constexpr, LOWERED: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr):
    b = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    row_ok = b < nblocks
    per_o = nb * I
    o = b // per_o
    rem = b % per_o
    blk = rem // I
    i = rem % I
    start = blk * bs
    xbase = o * xso + start * xsl + i * xsi
    ybase = o * yso + start * ysl + i * ysi
    lbase = o * L * I + start * I + i
    cols = tl.arange(0, BC)
    s_max = s_max.to(tl.uint64)
    s_ovf = s_ovf.to(tl.uint64)
    s_minn = s_minn.to(tl.uint64)
    e_max = e_max.to(tl.uint64)
    e_pos = e_pos.to(tl.uint64)
    e_neg = e_neg.to(tl.uint64)

    # the blocks' amax (bits: NaN and Inf above every finite value)
    amax = tl.zeros([BR], tl.uint32)
    for c0 in range(0, bs, BC):
        j = c0 + cols
        m = row_ok[:, None] & (j[None, :] < bs) & ((start[:, None] + j[None, :]) < L)
        u = tl.load(x_ptr + xbase[:, None] + j[None, :] * xsl, mask=m, other=0.0)
        u = u.to(tl.uint32, bitcast=True)
        a = u & 0x7FFFFFFF
        if LOWERED:  # (quantize_cpu.h lowered_abs_bits) a negative power of two: a binade lower
            pow2 = tl.where(a < 0x00800000, (a & (a - 1)) == 0, (a & 0x007FFFFF) == 0)
            a -= (((u >> 31) != 0) & pow2 & (a > 1) & (a < 0x7F800000)).to(tl.uint32)
        amax = tl.maximum(amax, tl.max(tl.where(m, a, 0), axis=1))
    bad = amax >= 0x7F800000
    amax = tl.where(bad, 0, amax)

    if RULE == 2 or RULE == 4:
        s_uns = s_uns != 0
        sc = _settled(_amax_scale(amax, elem_max, s_man, s_emin, s_qlow, s_max, s_ovf,
                                  s_minn, s_uns, UP),
                      x_ptr, xbase, xsl, start, L, bs, lbase, I, row_ok, cols, elem_max,
                      key, sr_or, man, emin, qlow, e_max, fl, e_pos, e_neg, s_man, s_emin,
                      s_qlow, s_max, s_ovf, s_minn, s_uns, MODE, ELEM_FIXED, UP, BR, BC)
        if RULE == 4:
            # 4over6: the scale mapping the max to 4 too, settled the same way; the block takes
            # the one whose sum of |q - x| (float64, in element order, as the CPU kernel) is
            # lower, 6 on a tie. (The elements keep their format, max 6, under either scale.)
            sc4 = _settled(_amax_scale(amax, 4.0, s_man, s_emin, s_qlow, s_max, s_ovf,
                                       s_minn, s_uns, UP),
                           x_ptr, xbase, xsl, start, L, bs, lbase, I, row_ok, cols, 4.0,
                           key, sr_or, man, emin, qlow, e_max, fl, e_pos, e_neg, s_man, s_emin,
                           s_qlow, s_max, s_ovf, s_minn, s_uns, MODE, ELEM_FIXED, UP, BR,
                           BC)
            e6 = tl.zeros([BR], tl.float64)
            e4 = tl.zeros([BR], tl.float64)
            for j in range(0, bs):
                m = row_ok & ((start + j) < L)
                u = tl.load(x_ptr + xbase + j * xsl, mask=m, other=0.0)
                xv = u.to(tl.float64)
                u = u.to(tl.uint32, bitcast=True)
                if MODE == 3:
                    rb = C.random_word(key, lbase + j * I, sr_or)
                else:
                    rb = tl.zeros(u.shape, tl.uint32)
                q6 = _round_amax(u, sc, rb, man, emin, qlow, e_max, fl, e_pos, e_neg,
                                 MODE, ELEM_FIXED)
                q4 = _round_amax(u, sc4, rb, man, emin, qlow, e_max, fl, e_pos, e_neg,
                                 MODE, ELEM_FIXED)
                d6 = q6.to(tl.float32, bitcast=True).to(tl.float64) - xv
                d4 = q4.to(tl.float32, bitcast=True).to(tl.float64) - xv
                e6 = tl.where(m, e6 + tl.abs(d6), e6)
                e4 = tl.where(m, e4 + tl.abs(d4), e4)
            sc = tl.where(e4 < e6, sc4, sc)
    else:
        k = _scale_exp(amax, elem_emax, elem_max, scale_emin, scale_emax, even_mbits, RULE)
        if RULE == 3:
            lower = row_ok
            while tl.max(lower.to(tl.int32), axis=0) > 0:
                ram = tl.zeros([BR], tl.uint32)
                for c0 in range(0, bs, BC):
                    j = c0 + cols
                    m = row_ok[:, None] & (j[None, :] < bs) & ((start[:, None] + j[None, :]) < L)
                    u = tl.load(x_ptr + xbase[:, None] + j[None, :] * xsl, mask=m, other=0.0)
                    u = u.to(tl.uint32, bitcast=True)
                    if MODE == 3:
                        rb = C.random_word(key, lbase[:, None] + j[None, :] * I, sr_or)
                    else:
                        rb = tl.zeros(u.shape, tl.uint32)
                    q = _round_pow2(u, k[:, None], rb, man, emin, qlow, elem_max, fl, kmax, kmin,
                                    MODE, ELEM_FIXED)
                    ram = tl.maximum(ram, tl.max(tl.where(m, q & 0x7FFFFFFF, 0), axis=1))
                again = _scale_exp(ram, elem_emax, elem_max, scale_emin, scale_emax, even_mbits,
                                   RULE)
                lower = (again < k) & row_ok
                k = tl.where(lower, again, k)

    for c0 in range(0, bs, BC):
        j = c0 + cols
        m = row_ok[:, None] & (j[None, :] < bs) & ((start[:, None] + j[None, :]) < L)
        u = tl.load(x_ptr + xbase[:, None] + j[None, :] * xsl, mask=m, other=0.0)
        u = u.to(tl.uint32, bitcast=True)
        if MODE == 3:
            rb = C.random_word(key, lbase[:, None] + j[None, :] * I, sr_or)
        else:
            rb = tl.zeros(u.shape, tl.uint32)
        if RULE == 2 or RULE == 4:
            q = _round_amax(u, sc[:, None], rb, man, emin, qlow, e_max, fl, e_pos, e_neg,
                            MODE, ELEM_FIXED)
        else:
            q = _round_pow2(u, k[:, None], rb, man, emin, qlow, elem_max, fl, kmax, kmin,
                            MODE, ELEM_FIXED)
        q = tl.where(bad[:, None], 0x7FC00000, q).to(tl.uint32)
        tl.store(y_ptr + ybase[:, None] + j[None, :] * ysl, q.to(tl.float32, bitcast=True), mask=m)


def _f64_bits(v: float) -> int:
    return int(torch.tensor(v, dtype=torch.float64).view(torch.int64)) & (2 ** 64 - 1)


def _pow2_f64_bits(e: int) -> int:
    if e >= -1022:
        return (e + 1023) << 52
    return 1 << min(max(e + 1074, 0), 63)


def _three_dims(t, axis):
    """t as (outer, axis, inner) sizes and strides, or None where the dims before or after the
    axis are not one strided run."""
    def run(dims):
        size, stride = 1, 0
        for s, st in reversed(dims):
            if s == 1:
                continue
            if size == 1:
                size, stride = s, st
            elif st == stride * size:
                size *= s
            else:
                return None
        return size, stride
    dims = list(zip(t.shape, t.stride()))
    before, after = run(dims[:axis]), run(dims[axis + 1:])
    if before is None or after is None:
        return None
    return (before[0], t.shape[axis], after[0]), (before[1], t.stride(axis), after[1])


def quantize_block(x, elem, elem_max, block_size, axis, scale_rule, scale, scale_max,
                   tensor_scale, rounding, seed, *, out=None):
    """qtensor::quantize_block with the Triton kernel (into ``out`` if given; out may be x);
    tensor_scale=True never reaches it (checks.check_op_args refuses it, as the C++ op)."""
    elem, scale = list(elem), list(scale)
    if len(elem) != 6 or elem[0] not in (0, 1) or len(scale) != 6:
        raise RuntimeError("qtensor::quantize_block: elem must be [0, man, emin, subnormals, 0, "
                           "emax] or [1, wl, fl, signed, symmetric, emax]; scale [man, emin, "
                           "emax, subnormals, overflow, unsigned]")
    up = scale_rule == _CEIL and scale[0] > 0
    rule = _AMAX if up else scale_rule
    if rule not in (_FLOOR, _CEIL, _AMAX, _EVEN, _4OVER6):
        raise RuntimeError(f"qtensor::quantize_block: unknown scale_rule {scale_rule}")
    if rule in (_FLOOR, _EVEN) and scale[0] != 0:
        raise RuntimeError("qtensor::quantize_block: scale_rule floor and even need an "
                           "exponent-only scale")
    key, sr_or, mode = key_and_mode(seed, rounding)
    whole = axis is None or x.dim() == 0
    if not whole and not -x.dim() <= axis < x.dim():
        raise IndexError(f"qtensor::quantize_block: axis {axis} is out of range for a tensor of "
                         f"shape {list(x.shape)}")
    xf = x if x.dtype is torch.float32 else x.float()
    y = out if (out is not None and out.dtype is torch.float32) else None
    if whole:
        xf = xf.reshape(-1) if xf.is_contiguous() else xf.contiguous().reshape(-1)
        ax = 0
        if y is not None and not y.is_contiguous():
            y = None
    else:
        ax = axis % x.dim()
        if _three_dims(xf, ax) is None:
            xf = xf.contiguous()
        if y is not None and _three_dims(y, ax) is None:
            y = None
    if y is None:
        y = torch.empty_like(xf, memory_format=torch.contiguous_format)
        y_view = y
    else:
        y_view = y.reshape(-1) if whole else y
    n = xf.numel()
    if n:
        (O, L, I), (xso, xsl, xsi) = _three_dims(xf, ax)
        _, (yso, ysl, ysi) = _three_dims(y_view, ax)
        bs = L if (whole or block_size <= 0) else min(block_size, L)
        bs = max(bs, 1)
        nb = -(-L // bs)
        nblocks = O * nb * I
        fixed = elem[0] == 1
        if fixed:
            wl, fl, signed, sym = elem[1], elem[2], bool(elem[3]), bool(elem[4])
            if not 1 <= wl <= 24:
                raise RuntimeError("qtensor::quantize_block: fixed element wl must be 1..24")
            man = emin = qlow = 0
            kmax = (1 << (wl - 1)) - 1 if signed else (1 << wl) - 1
            kmin = -(1 << (wl - 1)) + int(sym) if signed else 0
            even_mbits = wl - 2 if signed else wl - 1
            e_pos = _f64_bits(kmax * 2.0 ** -fl)
            e_neg = _f64_bits(-kmin * 2.0 ** -fl)
            # the floor rule counts a negative power of two a binade lower with one more
            # negative code (reference.negative_power_lowers)
            lowered = rule == _FLOOR and signed and not sym
        else:
            man, emin = elem[1], elem[2]
            if not 0 <= man <= 23:
                raise RuntimeError("qtensor::quantize_block: element man must be 0..23")
            qlow = emin - man if elem[3] else emin
            fl = kmin = kmax = 0
            even_mbits = man
            e_pos = e_neg = 0
            lowered = False
        s_man, s_emin, s_emax, s_sub, s_overflow, s_uns = scale
        s_qlow = s_emin - s_man if s_sub else s_emin
        s_max = _f64_bits(scale_max)
        s_ovf = s_max if s_overflow == 0 else (
            0x7FF0000000000000 if s_overflow == 1 else 0x7FF8000000000000)
        prog = 16384 if interpreted() else 4096
        BC = min(triton.next_power_of_2(bs), prog)
        BR = max(1, prog // BC)
        grid = (triton.cdiv(nblocks, BR),)
        launcher(_block_kernel)[grid](
            xf, y_view, nblocks, L, I, nb, bs, xso, xsl, xsi, yso, ysl, ysi,
            man, emin, qlow, elem[5], float(elem_max), fl, kmin, kmax,
            s_emin, s_emax, even_mbits,
            s_man, s_emin, s_qlow, s_max, s_ovf, _pow2_f64_bits(s_emin), int(bool(s_uns)),
            _f64_bits(elem_max), e_pos, e_neg, key, sr_or,
            RULE=rule, MODE=mode, ELEM_FIXED=fixed, UP=up, LOWERED=lowered, BR=BR, BC=BC)
    if out is not None and y is out:
        return out
    return finish(x, y.reshape(x.shape), out)


# ---------------------------------------------------------------------------------------------
# Two-level formats: Transformer Engine's rule (qtensor::quantize_two_level)
#
# Every step is the float32 operation of reference._two_level_blocks, computed in float64 and
# rounded once to float32: a product of two float32s is exact in float64, and a float64 sum or
# quotient of float32s rounded to float32 is the correctly rounded float32 one (53 >= 2 * 24 + 2
# bits). So no step depends on the GPU compiler's float32 division (approximate on NVIDIA), FMA
# contraction or subnormal flushing.

_F32_MAX = 3.4028234663852886e38
_TILE_ROW, _TILE_COL, _TILE_2D = 0, 1, 2


@triton.jit
def _mul32(a, b):
    return (a.to(tl.float64) * b).to(tl.float32)  # (b: float32, or a float argument)


@triton.jit
def _div32(a, b):
    return (a.to(tl.float64) / b).to(tl.float32)


@triton.jit
def _tl_offsets(base, j, mc, ncols, TILE: tl.constexpr):
    """x's flat offsets of element j of blocks at base (a tile's elements in row-major order;
    mc: the tile's columns)."""
    if TILE == 0:
        return base + j
    elif TILE == 1:
        return base + j.to(tl.int64) * ncols
    else:
        return base + (j // mc).to(tl.int64) * ncols + j % mc


@triton.jit
def _tl_chunk(x_ptr, base, m, mc, ncols, c0, key, sr_or, MODE: tl.constexpr, TILE: tl.constexpr,
              BC: tl.constexpr):
    """Elements c0 .. c0 + BC - 1 of blocks at base with m elements: (mask, x's offsets,
    values, random words)."""
    j = c0 + tl.arange(0, BC)
    msk = j[None, :] < m[:, None]
    off = _tl_offsets(base[:, None], j[None, :], mc[:, None], ncols, TILE)
    xv = tl.load(x_ptr + off, mask=msk, other=0.0)
    if MODE == 3:
        w = C.random_word(key, off, sr_or)
    else:
        w = tl.zeros(xv.shape, tl.uint32)
    return msk, off, xv, w


@triton.jit
def _tl_code(t, s_man, s_emin, s_qlow, s_max32, s_minn32, s_max64, s_minn64,
             UP: tl.constexpr):
    """reference._scale_code: t (>= 0; NaN and +Inf read as FLT_MAX) to the scale format,
    nearest and saturating, or upward (the ceil rule), at most the scale's max."""
    tt = tl.where(t < 3.4028234663852886e38, t, 3.4028234663852886e38)
    if UP:
        up = _round_float_up(tt.to(tl.float64), s_man, s_emin, s_qlow, s_max64, s_max64,
                             s_minn64, False)
        smax = s_max32.to(tl.float32, bitcast=True)
        X = tl.where(up < smax.to(tl.float64), up.to(tl.float32), smax)
    else:
        zero = tl.zeros(t.shape, tl.uint32)
        X = C.round_float(tt.to(tl.uint32, bitcast=True), s_man, s_emin, s_qlow, s_max32,
                          s_max32, s_minn32, False, zero, 0, False).to(tl.float32, bitcast=True)
    return X


@triton.jit
def _tl_scale(am, enc, dec, c_amax, elem_max, ceil_k, s_man, s_emin, s_qlow, s_max32,
              s_minn32, s_max64, s_minn64, RULE: tl.constexpr, CAND: tl.constexpr):
    """reference.te_scale_fns: blocks' scale X (float32, a scale value) from their amax; CAND 1
    is 4over6's map-to-4 candidate."""
    if RULE == 4:
        t = _mul32(_div32(am, elem_max), enc)
        if CAND == 1:
            t = _mul32(t, 1.5)
        X = _tl_code(t, s_man, s_emin, s_qlow, s_max32, s_minn32, s_max64, s_minn64, False)
    else:
        X = _tl_code(_mul32(am, c_amax), s_man, s_emin, s_qlow, s_max32, s_minn32, s_max64,
                     s_minn64, RULE == 1)
        if RULE == 1:
            # the smallest scale whose largest value covers am (ceil_of)
            zero = tl.zeros(am.shape, tl.uint32)
            down = C.round_float(_mul32(X, ceil_k).to(tl.uint32, bitcast=True), s_man, s_emin,
                                 s_qlow, s_max32, s_max32, s_minn32, False, zero, 2, False)
            down = down.to(tl.float32, bitcast=True)
            X = tl.where(_mul32(_mul32(down, elem_max), dec) >= am, down, X)
    return X


@triton.jit
def _tl_inv(X, dec):
    """min(1 / (X * dec), FLT_MAX) in float32 (a zero X: FLT_MAX)."""
    d = _mul32(X, dec)
    r = _div32(tl.full(d.shape, 1.0, tl.float32), tl.where(d > 0, d, 1.0))
    return tl.where((d > 0) & (r < 3.4028234663852886e38), r, 3.4028234663852886e38)


@triton.jit
def _tl_round(t, w, man, emin, qlow, e_max, e_minn, fqexp, f_pos, f_neg, f_nsat,
              MODE: tl.constexpr, EK: tl.constexpr):
    """float32 t rounded to the (saturating) element format, as float32."""
    u = t.to(tl.uint32, bitcast=True)
    if EK == 1:
        r, _r, _w = C.round_fixed(u, fqexp, f_pos, f_neg, f_nsat, w, MODE, False)
    else:
        r = C.round_float(u, man, emin, qlow, e_max, e_max, e_minn, False, w, MODE, False)
    return r.to(tl.float32, bitcast=True)


@triton.jit
def _tl_payload(xv, w, X, inv, dec, man, emin, qlow, e_max, e_minn, fqexp, f_pos, f_neg,
                f_nsat, MODE: tl.constexpr, EK: tl.constexpr):
    """The payloads p = e * X of x under the scale X (reference: payload): e = Q(x * inv);
    directed and stochastic rounding keep the nearest e where fl32(e * X * dec) is x itself."""
    t = _mul32(xv, inv)
    if MODE == 0 or MODE == 1:
        e = _tl_round(t, w, man, emin, qlow, e_max, e_minn, fqexp, f_pos, f_neg, f_nsat, MODE,
                      EK)
    else:
        en = _tl_round(t, w, man, emin, qlow, e_max, e_minn, fqexp, f_pos, f_neg, f_nsat, 0, EK)
        ed = _tl_round(t, w, man, emin, qlow, e_max, e_minn, fqexp, f_pos, f_neg, f_nsat, MODE,
                       EK)
        e = tl.where(_mul32(_mul32(en, X), dec) == xv, en, ed)
    return _mul32(e, X)


@triton.jit
def _tl_error(xv, w, X, inv, dec, a32, denom, man, emin, qlow, e_max, e_minn, fqexp, f_pos,
              f_neg, f_nsat, MODE: tl.constexpr, EK: tl.constexpr):
    """TE's 4over6 error term of x under the scale X: |fl32(fl32(p * amax) / M) - x|."""
    p = _tl_payload(xv, w, X, inv, dec, man, emin, qlow, e_max, e_minn, fqexp, f_pos, f_neg,
                    f_nsat, MODE, EK)
    v = _div32(_mul32(p, a32), denom)
    return tl.abs((v.to(tl.float64) - xv).to(tl.float32))


@triton.jit
def _tl_settle(X, live, x_ptr, base, m, mc, ncols, bs, enc, dec, c_amax, elem_max, ceil_k,
               s_man, s_emin, s_qlow, s_max32, s_minn32, s_max64, s_minn64, key, sr_or,
               man, emin, qlow, e_max, e_minn, fqexp, f_pos, f_neg, f_nsat,
               RULE: tl.constexpr, CAND: tl.constexpr, MODE: tl.constexpr, EK: tl.constexpr,
               TILE: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr):
    """settle=: while the scale of a block's rounded max (fl32(p * dec)) is lower, the block
    takes it (each step lowers X, so this ends)."""
    lower = live
    while tl.max(lower.to(tl.int32), axis=0) > 0:
        inv = _tl_inv(X, dec)
        rmax = tl.zeros([BR], tl.uint32)
        for c0 in range(0, bs, BC):
            msk, off, xv, w = _tl_chunk(x_ptr, base, m, mc, ncols, c0, key, sr_or, MODE, TILE, BC)
            p = _tl_payload(xv, w, X[:, None], inv[:, None], dec, man, emin, qlow, e_max,
                            e_minn, fqexp, f_pos, f_neg, f_nsat, MODE, EK)
            q = _mul32(p, dec).to(tl.uint32, bitcast=True) & 0x7FFFFFFF
            rmax = tl.maximum(rmax, tl.max(tl.where(msk, q, 0), axis=1))
        X2 = _tl_scale(rmax.to(tl.float32, bitcast=True), enc, dec, c_amax, elem_max, ceil_k,
                       s_man, s_emin, s_qlow, s_max32, s_minn32, s_max64, s_minn64, RULE, CAND)
        lower = live & (X2 < X)
        X = tl.where(lower, X2, X)
    return X


# (the sizes are not specialized on: one compiled kernel per format and mode, whatever the shape)
@triton.jit(do_not_specialize=["nblocks", "R", "ncols", "tr", "tc", "nbr", "nbc", "bs"])
def _two_level_kernel(x_ptr, y_ptr, xs_ptr, sc_ptr, nblocks, R, ncols, tr, tc, nbr, nbc, bs,
                      man, emin, qlow, e_max, e_minn, fqexp, f_pos, f_neg, f_nsat,
                      elem_max, ceil_k, denom, s_man, s_emin, s_qlow, s_max32, s_minn32,
                      s_max64, s_minn64, key, sr_or,
                      RULE: tl.constexpr, MODE: tl.constexpr, EK: tl.constexpr,
                      SETTLE: tl.constexpr, WRITE_X: tl.constexpr, TILE: tl.constexpr,
                      BR: tl.constexpr, BC: tl.constexpr):
    b = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    row_ok = b < nblocks
    per = nbr * nbc
    g = b // per
    rem = b % per
    br = rem // nbc
    bc = rem % nbc
    base = g * R * ncols + br * tr * ncols + bc * tc
    mr = tl.where(row_ok, tl.minimum(tr, R - br * tr), 0)
    mc = tl.where(row_ok, tl.minimum(tc, ncols - bc * tc), 1)
    m = mr * mc
    cols = tl.arange(0, BC)
    e_max = e_max.to(tl.uint32)
    e_minn = e_minn.to(tl.uint32)
    f_pos = f_pos.to(tl.uint32)
    f_neg = f_neg.to(tl.uint32)
    f_nsat = f_nsat.to(tl.uint32)
    s_max32 = s_max32.to(tl.uint32)
    s_minn32 = s_minn32.to(tl.uint32)
    s_max64 = s_max64.to(tl.uint64)
    s_minn64 = s_minn64.to(tl.uint64)
    enc = tl.load(sc_ptr)
    dec = tl.load(sc_ptr + 1)
    c_amax = tl.load(sc_ptr + 2)
    a32 = tl.load(sc_ptr + 3)

    # the blocks' amax (|x|'s bits: NaN above Inf above every finite value)
    bm = tl.zeros([BR], tl.uint32)
    for c0 in range(0, bs, BC):
        msk, off, xv, w = _tl_chunk(x_ptr, base, m, mc, ncols, c0, key, sr_or, 0, TILE, BC)
        u = xv.to(tl.uint32, bitcast=True) & 0x7FFFFFFF
        bm = tl.maximum(bm, tl.max(tl.where(msk, u, 0), axis=1))
    bad = bm >= 0x7F800000
    live = row_ok & (bm < 0x7F800000)
    am = tl.where(bad, 0, bm).to(tl.float32, bitcast=True)

    X = _tl_scale(am, enc, dec, c_amax, elem_max, ceil_k, s_man, s_emin, s_qlow, s_max32,
                  s_minn32, s_max64, s_minn64, RULE, 0)
    if SETTLE:
        X = _tl_settle(X, live, x_ptr, base, m, mc, ncols, bs, enc, dec, c_amax, elem_max,
                       ceil_k, s_man, s_emin, s_qlow, s_max32, s_minn32, s_max64, s_minn64, key,
                       sr_or, man, emin, qlow, e_max, e_minn, fqexp, f_pos, f_neg, f_nsat,
                       RULE, 0, MODE, EK, TILE, BR, BC)
    if RULE == 4:
        # 4over6: the map-to-4 candidate where TE's error sum, |fl32(fl32(p * amax) / M) - x|
        # added in float32 in element order, is lower (map-to-6 on a tie)
        X4 = _tl_scale(am, enc, dec, c_amax, elem_max, ceil_k, s_man, s_emin, s_qlow, s_max32,
                       s_minn32, s_max64, s_minn64, RULE, 1)
        if SETTLE:
            X4 = _tl_settle(X4, live, x_ptr, base, m, mc, ncols, bs, enc, dec, c_amax,
                            elem_max, ceil_k, s_man, s_emin, s_qlow, s_max32, s_minn32, s_max64,
                            s_minn64, key, sr_or, man, emin, qlow, e_max, e_minn, fqexp, f_pos,
                            f_neg, f_nsat, RULE, 1, MODE, EK, TILE, BR, BC)
        inv6 = _tl_inv(X, dec)
        inv4 = _tl_inv(X4, dec)
        e6 = tl.zeros([BR], tl.float32)
        e4 = tl.zeros([BR], tl.float32)
        for c0 in range(0, bs, BC):
            msk, off, xv, w = _tl_chunk(x_ptr, base, m, mc, ncols, c0, key, sr_or, MODE, TILE, BC)
            d6 = _tl_error(xv, w, X[:, None], inv6[:, None], dec, a32, denom, man, emin, qlow,
                           e_max, e_minn, fqexp, f_pos, f_neg, f_nsat, MODE, EK)
            d4 = _tl_error(xv, w, X4[:, None], inv4[:, None], dec, a32, denom, man, emin, qlow,
                           e_max, e_minn, fqexp, f_pos, f_neg, f_nsat, MODE, EK)
            d6 = tl.where(msk, d6, 0.0)
            d4 = tl.where(msk, d4, 0.0)
            for k in range(0, BC):  # in element order (a column's sum is its one term)
                sel = cols[None, :] == k
                e6 = (e6.to(tl.float64) + tl.sum(tl.where(sel, d6, 0.0), axis=1)).to(tl.float32)
                e4 = (e4.to(tl.float64) + tl.sum(tl.where(sel, d4, 0.0), axis=1)).to(tl.float32)
        X = tl.where(e4 < e6, X4, X)

    # the values fl32(p * dec); a zero takes x's sign, a block holding Inf or NaN is all NaN
    inv = _tl_inv(X, dec)
    for c0 in range(0, bs, BC):
        msk, off, xv, w = _tl_chunk(x_ptr, base, m, mc, ncols, c0, key, sr_or, MODE, TILE, BC)
        p = _tl_payload(xv, w, X[:, None], inv[:, None], dec, man, emin, qlow, e_max, e_minn,
                        fqexp, f_pos, f_neg, f_nsat, MODE, EK)
        q = _mul32(p, dec)
        qb = tl.where(q == 0, xv.to(tl.uint32, bitcast=True) & 0x80000000,
                      q.to(tl.uint32, bitcast=True))
        qb = tl.where(bad[:, None], 0x7FC00000, qb).to(tl.uint32)
        tl.store(y_ptr + off, qb.to(tl.float32, bitcast=True), mask=msk)
    if WRITE_X:
        tl.store(xs_ptr + b, tl.where(bad, 0.0, X), mask=row_ok)


def quantize_two_level(x, elem, elem_max, scale_rule, scale, scale_max, geom, bound, settle,
                       tensor_scale, block_scales, rounding, seed, *, out=None):
    """qtensor::quantize_two_level with the Triton kernel: (values, the decode tensor scale as a
    0-dim float32 tensor, each block's scale X in block order where block_scales, else an empty
    tensor); the values into ``out`` if given (out may be x). geom [rows, cols, tr, tc]: the
    blocks are the tr x tc tiles of x viewed as contiguous [-1, rows, cols]. tensor_scale: the
    decode scale to round under (a positive finite 0-dim float32 tensor, as qtensor.kernels.ops
    checks it), else the one of x's largest finite magnitude."""
    from .scalar import fixed_params, float_params
    elem, scale, geom = list(elem), list(scale), list(geom)
    op = "qtensor::quantize_two_level"
    if len(elem) != 6 or elem[0] not in (0, 1) or len(scale) != 6:
        raise RuntimeError(f"{op}: elem and scale as quantize_block's")
    if len(geom) != 4 or min(geom) < 1:
        raise RuntimeError(f"{op}: geom must be [rows, cols, tr, tc], each >= 1")
    R, ncols, tr, tc = geom
    if x.numel() % (R * ncols):
        raise RuntimeError(f"{op}: geom {geom} does not tile a tensor of shape {list(x.shape)}")
    ceil_rule = scale_rule == _CEIL and scale[0] > 0
    if not (scale_rule in (_AMAX, _4OVER6) or ceil_rule):
        raise RuntimeError(f"{op}: scale_rule must be amax, 4over6, or ceil with a scale of "
                           "mantissa bits")
    if not (0 <= scale[0] <= 23 and -149 <= scale[1] <= 127):
        raise RuntimeError(f"{op}: scale format out of float32's range")
    fixed = elem[0] == 1
    if fixed:
        if not 1 <= elem[1] <= 24:
            raise RuntimeError(f"{op}: fixed element wl must be 1..24")
        fqexp, f_pos, f_neg, f_nsat = fixed_params(elem[1], elem[2], bool(elem[3]),
                                                   bool(elem[4]))[:4]
        eparams = (0, 0, 0, 0, 0, fqexp, f_pos, f_neg, f_nsat)
    else:
        man, emin, qlow, e_max, _ovf, e_minn, _u = float_params(elem[1], elem[2], bool(elem[3]),
                                                                elem_max, 0, False)
        eparams = (man, emin, qlow, e_max, e_minn, 0, 0, 0, 0)
    e2m1 = not fixed and elem[1] == 1 and elem[2] == 0 and elem[3] != 0 and elem_max == 6.0
    if scale_rule == _4OVER6 and not e2m1:
        raise RuntimeError(f"{op}: scale_rule 4over6 needs e2m1 elements")
    s_man, s_emin, _smx, s_sub = scale[:4]
    _, _, s_qlow, s_max32, _o, s_minn32, _u = float_params(s_man, s_emin, bool(s_sub), scale_max,
                                                           0, False)
    sparams = (s_man, s_emin, s_qlow, s_max32, s_minn32, _f64_bits(scale_max),
               _pow2_f64_bits(s_emin))
    key, sr_or, mode = key_and_mode(seed, rounding)

    dev = x.device
    xf = (x if x.dtype is torch.float32 else x.float()).contiguous()
    one = torch.ones((), dtype=torch.float32, device=dev)
    if tensor_scale is not None:
        if tensor_scale.numel() != 1 or tensor_scale.dtype is not torch.float32:
            raise RuntimeError(f"{op}: tensor_scale must be one float32")
        dec = tensor_scale.detach().reshape(()).to(dev, copy=True)  # (not an alias of an input)
        enc = one / dec
        a32 = (torch.full((), elem_max * bound, dtype=torch.float64, device=dev)
               / enc.double()).float()
    else:
        # the largest finite |x|, then TE's encode scale (reference.encode_scale)
        a32 = (xf.abs().nan_to_num(0.0, posinf=0.0).amax() if xf.numel()
               else torch.zeros((), device=dev))
        enc = torch.clamp(torch.full((), elem_max * bound, dtype=torch.float32, device=dev)
                          / a32, max=_F32_MAX)
        enc = torch.where((a32 == 0) | (enc == 0), one, enc)
        dec = one / enc
    c_amax = enc * torch.full((), 1.0 / elem_max, dtype=torch.float32, device=dev)
    groups = x.numel() // (R * ncols)
    nbr, nbc = -(-R // tr), -(-ncols // tc)
    nblocks = groups * nbr * nbc
    X = torch.empty(nblocks if block_scales else 0, dtype=torch.float32, device=dev)
    y = out if (out is not None and out.dtype is torch.float32 and out.is_contiguous()) else \
        torch.empty_like(xf)
    if xf.numel():
        bs = tr * tc
        tile = _TILE_ROW if tr == 1 else (_TILE_COL if tc == 1 else _TILE_2D)
        prog = 16384 if interpreted() else 2048
        # (4over6's error sums take BC steps per chunk: short chunks)
        BC = min(triton.next_power_of_2(bs), 64 if scale_rule == _4OVER6 else prog)
        BR = max(1, prog // BC)
        if interpreted():  # (no masked-off blocks to step through: ~7 ms per program there)
            BR = min(BR, triton.next_power_of_2(nblocks))
        sc = torch.stack([enc, dec, c_amax, a32]).float()
        launcher(_two_level_kernel)[(triton.cdiv(nblocks, BR),)](
            xf, y, X if block_scales else sc, sc, nblocks, R, ncols, tr, tc, nbr, nbc, bs,
            *eparams, float(elem_max), float(1.0 - 2.0 ** -(s_man + 2)),
            float(elem_max * bound), *sparams, key, sr_or,
            RULE=_4OVER6 if scale_rule == _4OVER6 else (_CEIL if ceil_rule else _AMAX),
            MODE=mode, EK=int(fixed), SETTLE=bool(settle), WRITE_X=bool(block_scales),
            TILE=tile, BR=BR, BC=BC, enable_fp_fusion=False)
    return finish(x, y.reshape(x.shape), out), dec, X
