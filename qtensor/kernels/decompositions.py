"""The rounding ops as pointwise torch ops, for torch.compile (inductor).

Under torch.compile the custom ops ``qtensor::quantize_{float,fixed,block}`` would be extern
kernels: one more pass over memory per rounding, and a fusion barrier. This module writes the
same rounding as integer arithmetic on the float32 bits (``csrc/include/qtensor/round.h``'s
general ``round_magnitude``, ``round_float``, ``round_fixed``, ``block_scale_exp``), which
inductor fuses into the kernel that produces the input. Every step is an exact integer (int32)
operation, so the bits are the eager kernel's wherever inductor computes the same float32 input.

Two sets:

- the scalar float formats' short form (:func:`round_float_fast`), the decompositions of
  ``qtensor_dispatch::round_to_dtype`` and ``qtensor_dispatch::round_float``, the ops QTensor
  code and traced ``qt.quantize`` call for float32 payloads (each rounding faster than the
  extern kernel under inductor, once its bit casts are vectorized: :func:`_vectorize_bitcasts`;
  off by default, the first compiled step takes about 3x longer): :func:`set_scalar_fusion` or
  ``QTENSOR_INDUCTOR_FUSE_SCALAR=1`` turns them on;
- the general formulas for the ``qtensor::`` ops themselves, below.

:func:`set_enabled` (or ``QTENSOR_INDUCTOR_DECOMPOSITIONS=1``) adds the decompositions to
inductor's table (only inductor's: torch.export and eager keep the custom op). They are off by
default: on CPU the generated integer code is slower than the hand-vectorized kernels, extra
pass over memory included (benchmarks/RESULTS.md, "Compiled roundings and the build"). A
decomposition returns ``NotImplemented`` (the custom op stays) where it is not exact or not
written:

- stochastic rounding (the kernels' random words depend on the element's index in the tensor's
  logical order and on a seed; under compile QTensor refuses stochastic rounding anyway);
- non-saturating fixed point (the two's-complement wrap needs 64-bit unsigned arithmetic);
- block formats other than floor and ceil with power-of-two (exponent-only) scales: the
  ``amax`` rule (NVFP4's blocks) makes the scale idempotent by a data-dependent loop
  (round.h settle_amax_scale) that a graph cannot unroll exactly; ``even`` rounds amax first
  and settles its scale by a second pass; ``4over6`` and ``ceil`` with scales of mantissa bits
  divide by a rounded scale (the formula below shifts the element grid by 2^k only);
- inputs other than float16/bfloat16/float32 on a device (the custom op refuses those alike).

Two-level formats (nvfp4) round by ``qtensor::quantize_two_level``, which has no decomposition:
it stays an extern call.
"""
from __future__ import annotations

import os
import struct

import torch

__all__ = ["set_enabled", "register", "quantize_float", "quantize_fixed", "quantize_block",
           "set_scalar_fusion", "register_scalar", "round_to_dtype", "round_float"]

_INF = 0x7F800000
_QNAN = 0x7FC00000
_ABS = 0x7FFFFFFF
_MANMASK = 0x007FFFFF
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_NEAREST, _NEAREST_AWAY, _TOWARD_ZERO = 0, 1, 2
_RULE_FLOOR, _RULE_CEIL = 0, 1


# ---------------------------------------------------------------------------------------------
# float32 bits as int32: inductor's CPU vectors do int32 shifts and compares natively (int64 ones
# are emulated lane by lane). Magnitudes (sign cleared) are non-negative int32s; the one unsigned
# comparison (the rounding word against the threshold) is done with both offset by 2^31.

_MIN = -(1 << 31)  # the sign bit as an int32


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float32).view(torch.int32)


def _from_bits(b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    f = b.view(torch.float32)
    if dtype == torch.float32:
        return f
    # the kernels' store (c10's T(float)) gives a NaN the canonical quiet NaN: float16 keeps the
    # sign, bfloat16 does not; torch's own cast (eager and compiled) may give other bits
    if dtype == torch.float16:
        nan_bits = ((b >> 16) & 0x8000) | 0x7E00
    else:
        nan_bits = torch.full_like(b, 0x7FC0)
    nan_bits = nan_bits - ((nan_bits >> 15) << 16)  # 0..2^16-1 -> the int16 with those bits
    h = f.to(dtype).view(torch.int16)
    return torch.where((b & _ABS) > _INF, nan_bits.to(torch.int16), h).view(dtype)


def _f32_bits(v: float) -> int:
    """The float32 bits of a Python float (rounded to float32 as the C++ glue's cast)."""
    return struct.unpack("<I", struct.pack("<f", v))[0]


def _pow2_bits_int(e: int) -> int:
    return (e + 127) << 23 if e >= -126 else 1 << min(max(e + 149, 0), 31)


def _pow2_bits(e):
    """round.h pow2_bits<uint32_t>: 2^e as float32 bits (subnormals included)."""
    sh = torch.clamp(e + 149, 0, 31)
    normal = torch.clamp(e + 127, 0, 255) << 23
    return torch.where(e >= -126, normal, torch.ones_like(sh) << sh)


def _pow2_f64(k: torch.Tensor) -> torch.Tensor:
    """2^k as float64 (per block: exact for the scales' exponent range)."""
    return ((k.to(torch.int64) + 1023) << 52).view(torch.float64)


def _binade(A: torch.Tensor, E: torch.Tensor) -> torch.Tensor:
    """round.h binade_of<uint32_t>: a subnormal's by converting its integer significand to
    float32 (exact: A < 2^23 there)."""
    sub = (A.to(torch.float32).view(torch.int32) >> 23) - 127 - 149
    return torch.where(E != 0, E - 127, sub)


def _round_magnitude(A: torch.Tensor, emin, man, qlow, mode: int) -> torch.Tensor:
    """round.h round_magnitude<MODE, uint32_t> for the deterministic modes: A holds finite
    magnitude bits (int32); emin, man, qlow are ints or per-block int32 tensors."""
    E = A >> 23
    binade = _binade(A, E)
    qexp = torch.where(binade >= emin, binade - man, qlow)
    ulp = torch.clamp(E, min=1) - 150
    d = qexp - ulp
    tiny = d > 23
    dn = torch.clamp(d, 0, 23)
    mask = (torch.ones_like(dn) << dn) - 1
    thr_n = ((A & mask) << (31 - dn)) << 1  # floor(frac * 2^32), as the uint32's bits
    M = torch.where(E != 0, (A & _MANMASK) | (1 << 23), A)
    ls = torch.clamp(32 - d, 0, 31)
    rs = torch.clamp(d - 32, 0, 31)
    thr = torch.where(tiny, torch.where(d <= 32, M << ls, M >> rs), thr_n)
    thr_s = thr ^ _MIN  # unsigned w < thr  <=>  signed (w - 2^31) < (thr ^ 2^31)
    if mode == _NEAREST:  # w = 2^31 - (lo & 1)
        up = -torch.where(tiny, torch.zeros_like(M), (M >> dn) & 1) < thr_s
    elif mode == _NEAREST_AWAY:  # w = 2^31 - 1
        up = thr_s > -1
    else:  # toward_zero: w = 2^32 - 1, never up
        up = torch.zeros_like(tiny)
    res_n = (A & ~mask) + (up.to(torch.int32) << dn)
    res_t = torch.where(up, _pow2_bits(qexp), torch.zeros_like(A))
    return torch.where(tiny, res_t, res_n)


# ---------------------------------------------------------------------------------------------
# Scalar float formats, the short form (on by default, through qtensor_dispatch's ops)
#
# For a signed float format with subnormals (or with none and emin >= -126) and man <= 22 the
# rounding point of a finite float32 magnitude A sits d = max(23 - man, qlow + 150 - E) bits up
# (E: A's exponent field; constant where the format's subnormals lie below float32's normals, as
# for bf16): round.h's round_magnitude reduces to the integer add-and-mask of the float32 bits
# (the carry into the exponent is the step to the next binade), plus a threshold compare for
# the magnitudes below the format's smallest quantum. About half the operations of the general
# formula, and inductor vectorizes them in the producing kernel.

def fast_float_applies(man, emin, subnormals, is_unsigned, rounding) -> bool:
    """Whether :func:`round_float_fast` covers this format and rounding."""
    qlow = emin - man if subnormals else emin
    return (rounding in (_NEAREST, _NEAREST_AWAY, _TOWARD_ZERO) and not is_unsigned
            and 0 <= man <= 22 and -149 <= qlow and emin <= 127
            and (subnormals or emin >= -126))


def round_float_fast(u, man, emin, subnormals, fmax, overflow, rounding, nan_bits=None):
    """round.h round_float on float32 bits u (int32), for fast_float_applies formats. NaN
    inputs give u (the kernels) or nan_bits(u) (a cast's NaN)."""
    qlow = emin - man if subnormals else emin
    max_bits = _f32_bits(fmax)
    ovf_bits = max_bits if overflow == 0 else (_INF if overflow == 1 else _QNAN)
    sign, A = u & _MIN, u & _ABS
    Am = torch.clamp(A, max=_INF)  # NaN -> Inf (replaced below): no int32 overflow
    d0 = 23 - man
    if not subnormals or qlow + 149 <= d0:
        d = d0  # one rounding point for every magnitude above the tiny ones
    else:
        d = torch.clamp(qlow + 150 - torch.clamp(Am >> 23, min=max(1, qlow + 127)), min=d0)
    if isinstance(d, int) and d < 23:
        mask, lsb = (1 << d) - 1, (Am >> d) & 1
    else:  # d = 23: the last kept bit is the implicit one (1; the exponent's bit is not it)
        mask = ((torch.ones_like(Am) << d) if isinstance(d, int) else (torch.ones_like(d) << d)) - 1
        lsb = ((Am | (1 << 23)) >> d) & 1
    if rounding == _NEAREST:
        r = (Am + (mask >> 1) + lsb) & ~mask
    elif rounding == _NEAREST_AWAY:
        r = (Am + (mask >> 1) + 1) & ~mask
    else:
        r = Am & ~mask
    if qlow >= -126:  # magnitudes below 2^qlow: 0 or 2^qlow (a tie goes to 0, the even one)
        low, half = _pow2_bits_int(qlow), _pow2_bits_int(qlow - 1)
        if rounding == _TOWARD_ZERO:
            tiny = torch.zeros_like(r)
        else:
            up = Am > half if rounding == _NEAREST else Am >= half
            tiny = torch.where(up, low, torch.zeros_like(r))
        r = torch.where(Am < low, tiny, r)
    if rounding == _TOWARD_ZERO:
        r = torch.where(r > max_bits, max_bits, r)
        r = torch.where(Am >= _INF, ovf_bits, r)
    else:  # Inf rounds to Inf, above max_bits
        r = torch.where(r > max_bits, ovf_bits, r)
    out = r | sign
    nan = A > _INF
    if nan_bits is None:
        return torch.where(nan, u, out)
    if overflow == 2:  # an overflow gives a NaN: a cast gives its own NaN there too
        nan = nan | (r == _QNAN)
    return torch.where(nan, u if nan_bits is None else nan_bits(u), out)


def _bf16_cast_nan(u):
    # torch's CPU cast to bfloat16 (eager, vectorized and not) makes every NaN 0xFFFF
    return torch.full_like(u, -(1 << 16))


def _f16_cast_nan(u):
    # torch's vectorized CPU cast to float16 keeps the sign and the payload's top 9 bits, quiet
    # (its scalar tail, the last < 64 elements of a tensor, gives 0x7FFFFFFF instead)
    return (u & (_MIN | 0x003FE000)) | 0x7FC00000


def _f8_cast_nan(quiet):
    def nan(u):
        return (u & _MIN) | quiet
    return nan


# round_to_dtype's dtypes: (man, emin, subnormals, max, overflow, NaN on CPU, NaN elsewhere).
# Eager CPU payloads round to the float8 dtypes by the kernel (qtensor.kernels.backend._SLOW_CPU_CASTS):
# the kernel's NaN (the input's) there; a cast's elsewhere.
_CAST_FORMATS = {
    torch.bfloat16: (7, -126, True, 3.3895313892515355e+38, 1, _bf16_cast_nan, _bf16_cast_nan),
    torch.float16: (10, -14, True, 65504.0, 1, _f16_cast_nan, _f16_cast_nan),
    torch.float8_e4m3fn: (3, -6, True, 448.0, 0, None, _f8_cast_nan(0x7FF00000)),
    torch.float8_e5m2: (2, -14, True, 57344.0, 1, None, _f8_cast_nan(0x7FE00000)),
}


def round_to_dtype(x, dtype):
    """qtensor_dispatch::round_to_dtype: float32 x cast to dtype and back, as eager rounds it."""
    spec = _CAST_FORMATS.get(dtype)
    if spec is None or x.dtype != torch.float32 or not _fast_enabled:
        return NotImplemented
    man, emin, sub, mx, ovf, nan_cpu, nan_other = spec
    _vectorize_bitcasts()
    nan = nan_cpu if x.device.type == "cpu" else nan_other
    return round_float_fast(_bits(x), man, emin, sub, mx, ovf, _NEAREST, nan).view(torch.float32)


def round_float(x, man, emin, subnormals, max, overflow, is_unsigned, rounding):
    """qtensor_dispatch::round_float: qtensor::quantize_float (deterministic) of float32 x."""
    if (x.dtype != torch.float32 or not _fast_enabled
            or not fast_float_applies(man, emin, subnormals, is_unsigned, rounding)):
        return NotImplemented
    _vectorize_bitcasts()
    return round_float_fast(_bits(x), man, emin, subnormals, max, overflow,
                            rounding).view(torch.float32)


# ---------------------------------------------------------------------------------------------
# The decompositions (the ops' schemas, csrc/quantize.cpp)

def _applies(x: torch.Tensor, rounding: int) -> bool:
    return x.dtype in _DTYPES and rounding in (_NEAREST, _NEAREST_AWAY, _TOWARD_ZERO)


def quantize_float(x, man, emin, subnormals, max, overflow, is_unsigned, rounding, seed):
    """qtensor::quantize_float (round.h round_float)."""
    if not _applies(x, rounding) or not (0 <= man <= 23 and -149 <= emin <= 127):
        return NotImplemented
    qlow = emin - man if subnormals else emin
    max_bits = _f32_bits(max)
    ovf_bits = max_bits if overflow == 0 else (_INF if overflow == 1 else _QNAN)
    u = _bits(x)
    sign, A = u & _MIN, u & _ABS
    nonfinite, nan = A >= _INF, A > _INF
    r = _round_magnitude(torch.where(nonfinite, torch.zeros_like(A), A), emin, man, qlow,
                         rounding)
    finite_overflow = max_bits if rounding == _TOWARD_ZERO else ovf_bits
    r = torch.where(r > max_bits, finite_overflow, r)
    r = torch.where(nonfinite, ovf_bits, r)
    if is_unsigned:  # no zero and no sign: zero becomes the smallest value, <= 0 is NaN
        min_normal = _pow2_bits_int(emin)
        r = torch.where(r == 0, min_normal, r)
        out = torch.where((sign == 0) & (A != 0) & ~nan, r, _QNAN)
    else:
        out = torch.where(nan, u, r | sign)
    return _from_bits(out, x.dtype)


def _fixed_limits(wl: int, fl_shifted, is_signed: bool, symmetric: bool):
    """make_fixed_spec's kmax/kmin bits on the grid 2^qexp, qexp = -fl (a tensor inside
    blocks): pos_bits, neg_bits, neg_sat_bits."""
    kmax = (1 << (wl - 1)) - 1 if is_signed else (1 << wl) - 1
    kmin_abs = ((1 << (wl - 1)) - (1 if symmetric else 0)) if is_signed else 0
    q = _pow2_bits(fl_shifted).view(torch.float32)
    pos = (q * float(kmax)).view(torch.int32)  # exact: <= 24 bits
    neg = (q * float(kmin_abs)).view(torch.int32)
    neg_sat = torch.where(neg != 0, neg | _MIN, torch.zeros_like(neg))
    return pos, neg, neg_sat


def _round_fixed_bits(u, qexp, pos, neg, neg_sat, rounding: int):
    """round.h round_fixed<MODE, WRAP=false>: u holds float32 bits (int32)."""
    sign, A = u & _MIN, u & _ABS
    nonfinite, nan = A >= _INF, A > _INF
    r = _round_magnitude(torch.where(nonfinite, torch.zeros_like(A), A), 100000, 0, qexp,
                         rounding)
    negative = sign != 0
    if isinstance(pos, int):  # (torch.where of two Python ints would be int64)
        pos, neg, neg_sat = (torch.full_like(A, v) for v in (pos, neg, neg_sat))
    lim = torch.where(negative, neg, pos)
    over = nonfinite | (r > lim)
    sat = torch.where(negative, neg_sat, pos)
    out = torch.where(over, sat, r | torch.where(r != 0, sign, torch.zeros_like(sign)))
    return torch.where(nan, u, out)


def quantize_fixed(x, wl, fl, is_signed, symmetric, saturate, rounding, seed):
    """qtensor::quantize_fixed, saturating (round.h round_fixed)."""
    if (not _applies(x, rounding) or not saturate
            or not (1 <= wl <= 24 and -fl >= -149 and wl - fl <= 127)):
        return NotImplemented
    kmax = (1 << (wl - 1)) - 1 if is_signed else (1 << wl) - 1
    kmin_abs = ((1 << (wl - 1)) - (1 if symmetric else 0)) if is_signed else 0
    q = struct.unpack("<f", struct.pack("<I", _pow2_bits_int(-fl)))[0]
    pos, neg = _f32_bits(kmax * q), _f32_bits(kmin_abs * q)  # exact: <= 24 bits
    neg_sat = neg - (1 << 32) + (1 << 31) if neg != 0 else 0  # neg | sign, as an int32
    qexp = -fl
    return _from_bits(_round_fixed_bits(_bits(x), qexp, pos, neg, neg_sat, rounding), x.dtype)


def quantize_block(x, elem, elem_max, block_size, axis, scale_rule, scale, scale_max,
                   tensor_scale, rounding, seed):
    """qtensor::quantize_block with power-of-two scales: the floor rule, and ceil with an
    exponent-only scale format (MX). Every other rule declines (see the module docstring)."""
    pow2 = scale_rule == _RULE_FLOOR or (scale_rule == _RULE_CEIL and scale[0] == 0)
    # (tensor_scale=True: the op's own error, two-level formats round by quantize_two_level)
    if not _applies(x, rounding) or not pow2 or tensor_scale or x.numel() == 0:
        return NotImplemented
    elem_fixed = elem[0] == 1
    whole = axis is None or x.dim() == 0
    if whole:
        moved = x.reshape(1, -1)
    else:
        moved = x.movedim(axis, -1)
    n = moved.shape[-1]
    bs = block_size if (block_size > 0 and not whole) else n
    bs = max(min(bs, n), 1)
    pad = (-n) % bs
    u = _bits(moved)
    if pad:
        u = torch.nn.functional.pad(u, (0, pad))  # zeros: no effect on the amax
    u = u.reshape(*u.shape[:-1], -1, bs)
    A = u & _ABS
    key = A
    if scale_rule == _RULE_FLOOR and elem_fixed and elem[3] != 0 and elem[4] == 0:
        # (quantize_cpu.h lowered_abs_bits) two's-complement elements: a negative power of two
        # counts a binade lower
        pow2 = torch.where(A < 0x00800000, (A & (A - 1)) == 0, (A & 0x007FFFFF) == 0)
        key = A - ((u < 0) & pow2 & (A > 1) & (A < _INF)).to(A.dtype)
    amax = key.amax(dim=-1, keepdim=True)  # |x| as integers orders like the values, NaN on top
    # round.h block_scale_exp
    b = torch.where(amax == 0, -1, _binade(amax, amax >> 23))
    k = b - elem[5]
    if scale_rule == _RULE_CEIL:
        p = _pow2_f64(k) * elem_max  # exact
        k = k + (amax.view(torch.float32).to(torch.float64) > p).to(torch.int32)
    k = torch.clamp(k, scale[1], scale[2])
    if elem_fixed:
        wl, fl, is_signed, symmetric = elem[1], elem[2], elem[3] != 0, elem[4] != 0
        qexp = k - fl
        pos, neg, neg_sat = _fixed_limits(wl, qexp, is_signed, symmetric)
        q = _round_fixed_bits(u, qexp, pos, neg, neg_sat, rounding)
    else:
        man, emin = elem[1], elem[2]
        qlow = emin - man if elem[3] else emin
        # shift_elem: max * 2^k in double, then to float32 (Inf beyond float32: no saturation)
        mx = (_pow2_f64(k) * elem_max).to(torch.float32).view(torch.int32)
        r = _round_magnitude(A, emin + k, man, qlow + k, rounding)
        q = torch.minimum(r, mx) | (u & _MIN)
    q = torch.where(amax >= _INF, _QNAN, q)  # NaN or Inf in the block: all NaN
    q = q.reshape(*q.shape[:-2], -1)[..., :n]
    out = _from_bits(q, x.dtype)
    if whole:
        return out.reshape(x.shape)
    return out.movedim(-1, axis)


# ---------------------------------------------------------------------------------------------
# Registration in inductor's decomposition table

# Off by default: on CPU, inductor's code for these integer formulas is slower than the
# hand-vectorized kernels plus their extra pass over memory (benchmarks/RESULTS.md, "Compiled
# roundings and the build"). QTENSOR_INDUCTOR_DECOMPOSITIONS=1 or set_enabled(True) turns them on.
_enabled = os.environ.get("QTENSOR_INDUCTOR_DECOMPOSITIONS", "0") == "1"
_registered = False


# The scalar short forms (round_float_fast) for qtensor_dispatch's ops, the ops that QTensor
# code calls under tracing for scalar float formats. Off by default: each rounding is faster
# fused than as an extern call, but on the benchmark models the step gains at most a few percent
# while the first compiled step takes about 3x longer (benchmarks/RESULTS.md "Compiled scalar
# roundings fused"); QTENSOR_INDUCTOR_FUSE_SCALAR=1 or set_scalar_fusion(True) turns them on.
# The qtensor:: ops called directly keep the switch below.
_fast_enabled = os.environ.get("QTENSOR_INDUCTOR_FUSE_SCALAR", "0") == "1"
_fast_registered = False


def set_scalar_fusion(enabled: bool) -> None:
    """Whether inductor fuses QTensor's scalar float roundings (bf16, fp16, the FP8 presets, any
    signed float format in a deterministic rounding mode) into the kernels producing their
    inputs (True) or calls the kernels (False, the default). Takes effect for graphs compiled
    afterwards (torch._dynamo.reset() when comparing the two in one process; the on-disk
    caches key on the switch)."""
    global _fast_enabled
    _fast_enabled = bool(enabled)
    _key_the_caches()


def _fast_table() -> dict:
    return {torch.ops.qtensor_dispatch.round_to_dtype.default: round_to_dtype,
            torch.ops.qtensor_dispatch.round_float.default: round_float}


_TAG_MARK = "|qtensor-inductor:"


def _key_the_caches() -> None:
    """Put the switches into the key of torch.compile's caches (inductor's FX graph cache,
    AOTAutograd's cache), which do not key on the decomposition table: a graph compiled with a
    switch on, in this process or an earlier one, must not be reused with it off, nor the
    reverse. torch.compiler.config.cache_key_tag is the tag every one of those keys includes;
    only a switch that is on adds to it, so with both off the user's tag stays as it is.
    Called where a switch changes and by the ops' fake implementations, i.e. on every trace,
    before the compile looks up its caches."""
    from torch.compiler import config as compiler_config
    tag = compiler_config.cache_key_tag
    base = tag.split(_TAG_MARK)[0]
    on = [name for name, flag in (("decompositions", _enabled), ("fuse_scalar", _fast_enabled))
          if flag]
    want = base + _TAG_MARK + ",".join(on) if on else base
    if want != tag:
        compiler_config.cache_key_tag = want


def register_scalar() -> None:
    """Add the scalar short forms to inductor's table (once; called by the ops' fake
    implementations, i.e. when something traces them). Where a form declines (disabled, another
    dtype), the op stays an extern call."""
    global _fast_registered
    _key_the_caches()
    if _fast_registered:
        return
    _add_to_inductor(_fast_table())
    _fast_registered = True


_bitcasts_vectorized = False


def _vectorize_bitcasts() -> None:
    """Inductor's CPU vector code bit casts float32 <-> int32 (Tensor.view(dtype)) through a
    scalar loop over a stack buffer (torch 2.13: to_dtype_bitcast has no vector form), which
    costs more than the rounding's integer arithmetic; at::vec::cast reinterprets the register.
    Other bit casts keep inductor's code. (Once; skipped if inductor's internals differ.)"""
    global _bitcasts_vectorized
    if _bitcasts_vectorized:
        return
    _bitcasts_vectorized = True
    try:
        from torch._inductor.codegen import cpp
        from torch._inductor.virtualized import V
        scalarized = cpp.CppVecOverrides.__dict__["to_dtype_bitcast"].__func__
        if getattr(scalarized, "_qtensor", False):
            return
    except (ImportError, KeyError, AttributeError):
        return
    same_width = {torch.float32, torch.int32}

    def to_dtype_bitcast(x, dtype, src_dtype):
        kernel = V.kernel
        if ({dtype, src_dtype} == same_width and isinstance(kernel, cpp.CppVecKernel)
                and kernel._get_num_vectors(torch.float32) == 1):
            return f"at::vec::cast<{cpp.DTYPE_TO_CPP[dtype]}>({x})"
        return scalarized(x, dtype, src_dtype)

    to_dtype_bitcast._qtensor = True
    to_dtype_bitcast.__name__ = "to_dtype_bitcast"
    cpp.CppVecOverrides.to_dtype_bitcast = staticmethod(to_dtype_bitcast)


def _add_to_inductor(table: dict) -> None:
    from torch._inductor import decomposition as inductor_decomp
    from torch._inductor import lowering
    for op in table:
        if op not in lowering.lowerings:
            # where a decomposition declines, the op stays an extern kernel: its fallback made
            # here, as inductor's implicit one (which refuses an op that has a decomposition)
            tag = lowering.get_layout_constraint_tag(op, with_default=True)
            lowering.make_fallback(op, layout_constraint=lowering.tag_to_layout_constraint(tag),
                                   warn=False, override_decomp=True)
    inductor_decomp.decompositions.update(table)
    # the table inductor selects is a cached copy (fast_random_decomps): update it too
    inductor_decomp.fast_random_decomps().update(table)


def _ops_table() -> dict:
    return {torch.ops.qtensor.quantize_float.default: quantize_float,
            torch.ops.qtensor.quantize_fixed.default: quantize_fixed,
            torch.ops.qtensor.quantize_block.default: quantize_block}


def set_enabled(enabled: bool) -> None:
    """Whether torch.compile (inductor) gets the roundings as fusable pointwise torch ops
    (True) or as extern custom-op calls (False, the default). Takes effect for graphs compiled
    afterwards."""
    global _enabled
    _enabled = bool(enabled)
    _key_the_caches()
    if _enabled:
        register()
    elif _registered:
        _unregister()


def register() -> None:
    """Add the decompositions to inductor's table, when enabled (once; before a compile picks
    its table). Imported lazily: torch._inductor is not needed until something compiles."""
    global _registered
    _key_the_caches()
    if _registered or not _enabled or not hasattr(torch.ops.qtensor, "quantize_float"):
        return
    _add_to_inductor(_ops_table())
    _vectorize_bitcasts()
    _registered = True


def _unregister() -> None:
    global _registered
    from torch._inductor import decomposition as inductor_decomp
    for op in _ops_table():
        inductor_decomp.decompositions.pop(op, None)
        inductor_decomp.fast_random_decomps().pop(op, None)
    _registered = False
