"""Triton kernels of the scalar families: float formats (qtensor::quantize_float) and fixed point
(qtensor::quantize_fixed), every rounding mode, stochastic with the CPU kernels' random words."""
import torch
import triton
import triton.language as tl

from . import _common as C
from ._layout import launcher, elementwise_layout, finish, key_and_mode, launch_args, prepare

__all__ = ["quantize_float", "quantize_fixed"]


@triton.jit
def _offsets(i, s1, s2, s3, t0, t1, t2, t3, CONTIG: tl.constexpr):
    """The memory offsets of logical (row-major) indices i in a tensor of up to 4 dims
    (sizes [., s1, s2, s3], strides t0..t3)."""
    if CONTIG:
        return i
    i3 = i % s3
    r = i // s3
    i2 = r % s2
    r = r // s2
    i1 = r % s1
    i0 = r // s1
    return i0 * t0 + i1 * t1 + i2 * t2 + i3 * t3


@triton.jit
def _float_kernel(x_ptr, y_ptr, n, s1, s2, s3, xs0, xs1, xs2, xs3, ys0, ys1, ys2, ys3,
                  man, emin, qlow, max_bits, ovf_bits, min_normal_bits, is_unsigned, key, sr_or,
                  MODE: tl.constexpr, XCONTIG: tl.constexpr, YCONTIG: tl.constexpr,
                  BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    u = tl.load(x_ptr + _offsets(i, s1, s2, s3, xs0, xs1, xs2, xs3, XCONTIG), mask=m, other=0.0)
    u = u.to(tl.uint32, bitcast=True)
    if MODE == 3:
        rbits = C.random_word(key, i, sr_or)
    else:
        rbits = tl.zeros(u.shape, tl.uint32)
    r = C.round_float(u, man, emin, qlow, max_bits.to(tl.uint32), ovf_bits.to(tl.uint32),
                      min_normal_bits.to(tl.uint32), is_unsigned != 0, rbits, MODE, False)
    tl.store(y_ptr + _offsets(i, s1, s2, s3, ys0, ys1, ys2, ys3, YCONTIG),
             r.to(tl.float32, bitcast=True), mask=m)


@triton.jit
def _fixed_kernel(x_ptr, y_ptr, n, s1, s2, s3, xs0, xs1, xs2, xs3, ys0, ys1, ys2, ys3,
                  qexp, pos_bits, neg_bits, neg_sat_bits, wl, kmin, kmax, is_signed, key, sr_or,
                  MODE: tl.constexpr, WRAP: tl.constexpr, XCONTIG: tl.constexpr,
                  YCONTIG: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    u = tl.load(x_ptr + _offsets(i, s1, s2, s3, xs0, xs1, xs2, xs3, XCONTIG), mask=m, other=0.0)
    u = u.to(tl.uint32, bitcast=True)
    if MODE == 3:
        rbits = C.random_word(key, i, sr_or)
    else:
        rbits = tl.zeros(u.shape, tl.uint32)
    out, r, wraps = C.round_fixed(u, qexp, pos_bits.to(tl.uint32), neg_bits.to(tl.uint32),
                                  neg_sat_bits.to(tl.uint32), rbits, MODE, False)
    if WRAP:
        neg = (u & 0x80000000) != 0
        w = C.wrap_fixed(r, neg, qexp, wl, kmin.to(tl.int64), kmax.to(tl.int64), is_signed != 0)
        out = tl.where(wraps, w, out)
    tl.store(y_ptr + _offsets(i, s1, s2, s3, ys0, ys1, ys2, ys3, YCONTIG),
             out.to(tl.float32, bitcast=True), mask=m)


def _f32_bits(v: float) -> int:
    return int(torch.tensor(v, dtype=torch.float32).view(torch.int32)) & 0xFFFFFFFF


def _pow2_f32_bits(e: int) -> int:
    """round.h pow2_bits<uint32_t>(e): 2^e's float32 bits (clamped below float32's range)."""
    if e >= -126:
        return ((e + 127) << 23) & 0xFFFFFFFF
    return 1 << min(max(e + 149, 0), 31)


def float_params(man, emin, subnormals, maxval, overflow, is_unsigned):
    """round.h make_float_spec (float32 carrier) as kernel arguments."""
    if not (0 <= man <= 23 and -149 <= emin <= 127 and 0 <= overflow <= 2):
        raise RuntimeError(f"qtensor::quantize_float: format out of the float32 carrier's range "
                           f"(man={man}, emin={emin})")
    max_bits = _f32_bits(maxval)
    ovf = (max_bits, 0x7F800000, 0x7FC00000)[overflow]
    return (man, emin, emin - man if subnormals else emin, max_bits, ovf, _pow2_f32_bits(emin),
            int(bool(is_unsigned)))


def fixed_params(wl, fl, is_signed, symmetric, shift=0):
    """round.h make_fixed_spec (float32 carrier) as kernel arguments."""
    if not (1 <= wl <= 24 and -fl >= -149 and wl - fl <= 127):
        raise RuntimeError(f"qtensor::quantize_fixed: fixed{wl}.{fl} is out of the float32 "
                           "carrier's range")
    qexp = shift - fl
    kmax = (1 << (wl - 1)) - 1 if is_signed else (1 << wl) - 1
    kmin = -(1 << (wl - 1)) + (1 if symmetric else 0) if is_signed else 0
    q = torch.tensor(_pow2_f32_bits(qexp), dtype=torch.int32).view(torch.float32).double()
    pos = _f32_bits(float(kmax * q))
    neg = _f32_bits(float(-kmin * q))
    neg_sat = (neg | 0x80000000) if neg else 0
    return qexp, pos, neg, neg_sat, wl, kmin, kmax, int(bool(is_signed))


def _launch(kernel, x, out, params, rounding, seed, **const):
    xf, yf = prepare(x, out)
    n = xf.numel()
    if n:
        shape, xs, ys, xc, yc = elementwise_layout(xf, yf)
        block, grid = launch_args(n)
        key, sr_or, mode = key_and_mode(seed, rounding)
        launcher(kernel)[grid](xf, yf, n, *shape[1:], *xs, *ys, *params, key, sr_or, MODE=mode,
                     XCONTIG=xc, YCONTIG=yc, BLOCK=block, **const)
    return finish(x, yf, out)


def quantize_float(x, man, emin, subnormals, max, overflow, is_unsigned, rounding, seed, *,
                   out=None):
    """qtensor::quantize_float with the Triton kernel (into ``out`` if given; out may be x)."""
    return _launch(_float_kernel, x, out,
                   float_params(man, emin, subnormals, max, overflow, is_unsigned),
                   rounding, seed)


def quantize_fixed(x, wl, fl, is_signed, symmetric, saturate, rounding, seed, *, out=None):
    """qtensor::quantize_fixed with the Triton kernel (into ``out`` if given; out may be x)."""
    return _launch(_fixed_kernel, x, out, fixed_params(wl, fl, is_signed, symmetric),
                   rounding, seed, WRAP=not saturate)
