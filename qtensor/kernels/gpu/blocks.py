"""Triton kernel of the block family (qtensor::quantize_block): MX and custom block formats of any
size along any axis (strided, without a transposing copy), partial blocks, the floor, ceil, even,
amax and 4over6 scale rules (the even and amax rules' settling step included), power-of-two
(E8M0) and mantissa-bit (E4M3, FP32, bf16) scales, NVFP4's per-tensor scale; every rounding
mode. 2D tiles reach it laid out as 1D blocks (qtensor.kernels.ops). 4over6 with a tensor scale has no
Triton kernel (qtensor.kernels.gpu.covers: the reference rounds it).

One program rounds BR blocks, looping over each block's elements in chunks of BC: the amax pass,
the scale, then (for the even and amax rules) settling passes, (4over6) the second candidate's
and an error pass in element order, then the rounding pass."""
import math

import torch
import triton
import triton.language as tl

from . import _common as C
from ._layout import launcher, finish, interpreted, key_and_mode

__all__ = ["quantize_block"]

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
def _amax_scale(amax, ts, elem_max, s_man, s_emin, s_qlow, s_max, s_ovf, s_minn, s_uns,
                UP: tl.constexpr, TS: tl.constexpr):
    """round.h amax_block_scale: the scale (times the tensor scale) of blocks of amax (bits)."""
    a = amax.to(tl.float32, bitcast=True).to(tl.float64)
    if TS:
        denom = elem_max * ts
        ratio = tl.where(denom > 0, a / tl.where(denom > 0, denom, 1.0), 0.0)
    else:
        ratio = a / elem_max
    if UP:
        sc = _round_float_up(ratio, s_man, s_emin, s_qlow, s_max, s_ovf, s_minn, s_uns)
    else:
        zero = tl.zeros(amax.shape, tl.uint32)
        sc = C.round_float(ratio.to(tl.uint64, bitcast=True), s_man, s_emin, s_qlow, s_max,
                           s_ovf, s_minn, s_uns, zero, 0, True).to(tl.float64, bitcast=True)
    if TS:
        sc = sc * ts
    return sc


@triton.jit
def _round_amax(u, sc, rbits, ts, man, emin, qlow, e_max, fl, e_pos, e_neg,
                MODE: tl.constexpr, ELEM_FIXED: tl.constexpr, TS: tl.constexpr):
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
    if TS:
        q = q.to(tl.float32).to(tl.float64)
    return tl.where(ok, q.to(tl.float32).to(tl.uint32, bitcast=True), zero)


@triton.jit
def _settled(sc, x_ptr, xbase, xsl, start, L, bs, lbase, I, row_ok, cols, ts, elem_max, key,
             sr_or, man, emin, qlow, e_max, fl, e_pos, e_neg, s_man, s_emin, s_qlow, s_max,
             s_ovf, s_minn, s_uns, MODE: tl.constexpr, ELEM_FIXED: tl.constexpr,
             TS: tl.constexpr, UP: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr):
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
            q = _round_amax(u, sc[:, None], rb, ts, man, emin, qlow, e_max, fl, e_pos, e_neg,
                            MODE, ELEM_FIXED, TS)
            ram = tl.maximum(ram, tl.max(tl.where(m, q & 0x7FFFFFFF, 0), axis=1))
        again = _amax_scale(ram, ts, elem_max, s_man, s_emin, s_qlow, s_max, s_ovf, s_minn,
                            s_uns, UP, TS)
        lower = (again < sc) & (sc > 0)
        sc = tl.where(lower, again, sc)
    return sc


@triton.jit
def _block_kernel(x_ptr, y_ptr, ts_ptr, nblocks, L, I, nb, bs, xso, xsl, xsi, yso, ysl, ysi,
                  man, emin, qlow, elem_emax, elem_max, fl, kmin, kmax,
                  scale_emin, scale_emax, even_mbits,
                  s_man, s_emin, s_qlow, s_max, s_ovf, s_minn, s_uns, e_max, e_pos, e_neg,
                  key, sr_or,
                  RULE: tl.constexpr, MODE: tl.constexpr, ELEM_FIXED: tl.constexpr,
                  TS: tl.constexpr, UP: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr):
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
    if TS:
        ts = tl.load(ts_ptr)
    else:
        ts = 1.0

    # the blocks' amax (bits: NaN and Inf above every finite value)
    amax = tl.zeros([BR], tl.uint32)
    for c0 in range(0, bs, BC):
        j = c0 + cols
        m = row_ok[:, None] & (j[None, :] < bs) & ((start[:, None] + j[None, :]) < L)
        u = tl.load(x_ptr + xbase[:, None] + j[None, :] * xsl, mask=m, other=0.0)
        u = u.to(tl.uint32, bitcast=True) & 0x7FFFFFFF
        amax = tl.maximum(amax, tl.max(tl.where(m, u, 0), axis=1))
    bad = amax >= 0x7F800000
    amax = tl.where(bad, 0, amax)

    if RULE == 2 or RULE == 4:
        s_uns = s_uns != 0
        sc = _settled(_amax_scale(amax, ts, elem_max, s_man, s_emin, s_qlow, s_max, s_ovf,
                                  s_minn, s_uns, UP, TS),
                      x_ptr, xbase, xsl, start, L, bs, lbase, I, row_ok, cols, ts, elem_max,
                      key, sr_or, man, emin, qlow, e_max, fl, e_pos, e_neg, s_man, s_emin,
                      s_qlow, s_max, s_ovf, s_minn, s_uns, MODE, ELEM_FIXED, TS, UP, BR, BC)
        if RULE == 4:
            # 4over6: the scale mapping the max to 4 too, settled the same way; the block takes
            # the one whose sum of |q - x| (float64, in element order, as the CPU kernel) is
            # lower, 6 on a tie. (The elements keep their format, max 6, under either scale.)
            sc4 = _settled(_amax_scale(amax, ts, 4.0, s_man, s_emin, s_qlow, s_max, s_ovf,
                                       s_minn, s_uns, UP, TS),
                           x_ptr, xbase, xsl, start, L, bs, lbase, I, row_ok, cols, ts, 4.0,
                           key, sr_or, man, emin, qlow, e_max, fl, e_pos, e_neg, s_man, s_emin,
                           s_qlow, s_max, s_ovf, s_minn, s_uns, MODE, ELEM_FIXED, TS, UP, BR,
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
                q6 = _round_amax(u, sc, rb, ts, man, emin, qlow, e_max, fl, e_pos, e_neg,
                                 MODE, ELEM_FIXED, TS)
                q4 = _round_amax(u, sc4, rb, ts, man, emin, qlow, e_max, fl, e_pos, e_neg,
                                 MODE, ELEM_FIXED, TS)
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
            q = _round_amax(u, sc[:, None], rb, ts, man, emin, qlow, e_max, fl, e_pos, e_neg,
                            MODE, ELEM_FIXED, TS)
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


def _tensor_scale(xf, elem_max, ts_bound, ts_bits, ts_jmin):
    """op_common.h tensor_scale_from_amax on the device (a 0-dim float64 tensor, no sync)."""
    a = torch.where(torch.isfinite(xf), xf.abs(), 0.0).amax() if xf.numel() else \
        torch.zeros((), device=xf.device)
    t = a.double() / (elem_max * ts_bound)
    pos = t > 0
    t1 = torch.where(pos, t, 1.0)
    _, e = torch.frexp(t1)
    j = torch.clamp(e.to(torch.int64) - ts_bits, min=ts_jmin)
    p = ((j + 1023) << 52).view(torch.float64)
    ip = ((1023 - j) << 52).view(torch.float64)
    return torch.where(pos, torch.floor(t1 * ip) * p, 0.0)


def quantize_block(x, elem, elem_max, block_size, axis, scale_rule, scale, scale_max,
                   tensor_scale, rounding, seed, *, out=None):
    """qtensor::quantize_block with the Triton kernel (into ``out`` if given; out may be x)."""
    elem, scale = list(elem), list(scale)
    if len(elem) != 6 or elem[0] not in (0, 1) or len(scale) != 6:
        raise RuntimeError("qtensor::quantize_block: elem must be [0, man, emin, subnormals, 0, "
                           "emax] or [1, wl, fl, signed, symmetric, emax]; scale [man, emin, "
                           "emax, subnormals, overflow, unsigned]")
    up = scale_rule == _CEIL and scale[0] > 0
    rule = _AMAX if up else scale_rule
    if rule not in (_FLOOR, _CEIL, _AMAX, _EVEN, _4OVER6):
        raise RuntimeError(f"qtensor::quantize_block: unknown scale_rule {scale_rule}")
    if rule == _4OVER6 and tensor_scale:
        raise NotImplementedError("qtensor.kernels.gpu: 4over6 with a tensor scale has no Triton kernel "
                                  "(qtensor.kernels.gpu.covers: the reference rounds it)")
    if rule in (_FLOOR, _EVEN) and scale[0] != 0:
        raise RuntimeError("qtensor::quantize_block: scale_rule floor and even need an "
                           "exponent-only scale")
    if tensor_scale and rule not in (_AMAX, _4OVER6):
        raise RuntimeError("qtensor::quantize_block: tensor_scale needs scale_rule amax, 4over6, "
                           "or ceil with a scale of mantissa bits")
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
            p_elem, elem_q = (wl - 1 if signed else wl), -fl
        else:
            man, emin = elem[1], elem[2]
            if not 0 <= man <= 23:
                raise RuntimeError("qtensor::quantize_block: element man must be 0..23")
            qlow = emin - man if elem[3] else emin
            fl = kmin = kmax = 0
            even_mbits = man
            e_pos = e_neg = 0
            p_elem, elem_q = man + 1, emin - man
        s_man, s_emin, s_emax, s_sub, s_overflow, s_uns = scale
        s_qlow = s_emin - s_man if s_sub else s_emin
        s_max = _f64_bits(scale_max)
        s_ovf = s_max if (s_overflow == 0 or tensor_scale) else (
            0x7FF0000000000000 if s_overflow == 1 else 0x7FF8000000000000)
        ts = torch.zeros((), dtype=torch.float64, device=x.device)
        if tensor_scale:
            ts_bits = 23 - p_elem - (s_man + 1)
            if ts_bits < 1:
                raise RuntimeError("qtensor::quantize_block: tensor_scale needs element and "
                                   "scale formats of at most 22 significant bits together")
            ts_jmin = -149 - (elem_q + (s_emin - s_man)) + 1
            ts = _tensor_scale(xf, elem_max, scale_max, ts_bits, ts_jmin)
        prog = 16384 if interpreted() else 4096
        BC = min(triton.next_power_of_2(bs), prog)
        BR = max(1, prog // BC)
        grid = (triton.cdiv(nblocks, BR),)
        launcher(_block_kernel)[grid](
            xf, y_view, ts, nblocks, L, I, nb, bs, xso, xsl, xsi, yso, ysl, ysi,
            man, emin, qlow, elem[5], float(elem_max), fl, kmin, kmax,
            s_emin, s_emax, even_mbits,
            s_man, s_emin, s_qlow, s_max, s_ovf, _pow2_f64_bits(s_emin), int(bool(s_uns)),
            _f64_bits(elem_max), e_pos, e_neg, key, sr_or,
            RULE=rule, MODE=mode, ELEM_FIXED=fixed, TS=bool(tensor_scale), UP=up, BR=BR, BC=BC)
    if out is not None and y is out:
        return out
    return finish(x, y.reshape(x.shape), out)
