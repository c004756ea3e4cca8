"""Pure-PyTorch reference quantizers: the readable specification of every format.

``quantize(x, fmt)`` returns x rounded to ``fmt`` as a plain tensor of x's shape, dtype and device.
The compiled kernels (qtensor.kernels.ops) must agree with this module bit for bit, stochastic rounding
included; where no compiler is available this module is the fallback.

- Every step is exact: float32/float64 inputs are processed in float64, float16/bfloat16 ones
  through float32, and the result is cast back.
- Rounding works on magnitudes, so a float format keeps -0.0 and symmetric modes satisfy
  q(-x) = -q(x); fixed point (block elements too) has no negative zero.
- Overflow gives the format's overflow value (max, Inf or NaN); toward_zero gives max for a
  finite x.
- Stochastic rounding: one 64-bit seed per call (:func:`draw_seed`, so ``torch.manual_seed``
  reproduces it, on CPU and CUDA alike); element i gets the 32-bit word ``random_bits(seed, i)``
  and its magnitude rounds up iff that word < floor(frac * 2^32): unbiased.

The exact computation and the random-bits formula the kernels implement: docs/formats.md.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from .checks import check_axis, check_generator, check_input, resolve_rounding
from ..formats.float import FloatFormat
from ..formats.block import BlockFormat
from ..formats.fixed import FixedFormat
from ..formats.base import _significant_bits, stochastic_bits

__all__ = ["quantize", "quantize_with_seed", "draw_seed", "check_generator", "random_bits",
           "needs_sign_fixup", "sign_fixup"]

_MASK32 = 0xFFFFFFFF


# ---------------------------------------------------------------------------------------------
# Random bits

def _lowbias32_int(v: int) -> int:
    v &= _MASK32
    v ^= v >> 16
    v = (v * 0x7FEB352D) & _MASK32
    v ^= v >> 15
    v = (v * 0x846CA68B) & _MASK32
    v ^= v >> 16
    return v


def _lowbias32(v: torch.Tensor) -> torch.Tensor:
    # int64 arithmetic wraps on overflow; masking keeps the exact low 32 bits.
    v = v ^ (v >> 16)
    v = (v * 0x7FEB352D) & _MASK32
    v = v ^ (v >> 15)
    v = (v * 0x846CA68B) & _MASK32
    return v ^ (v >> 16)


def seed_key(seed: int) -> int:
    """The 32-bit key of a 64-bit seed (the kernels receive the seed and derive the same key)."""
    seed &= (1 << 64) - 1
    return _lowbias32_int((seed & _MASK32) ^ _lowbias32_int((seed >> 32) ^ 0x9E3779B9))


def random_bits(seed: int, index: torch.Tensor) -> torch.Tensor:
    """The 32-bit random word (as int64) of each element index in ``index`` (int64)."""
    key = seed_key(seed)
    hi = _lowbias32(index >> 32)
    return _lowbias32((index & _MASK32) ^ key ^ hi)


# a generator that stands in for torch's default one in draw_seed (qt.analyze: stochastic
# rounding then draws nothing from the stream that dropout draws its masks from)
SEED_GENERATOR: list = [None]


def draw_seed(generator: Optional[torch.Generator] = None) -> int:
    """One 63-bit seed from ``generator`` (torch's default CPU generator when None, or
    ``SEED_GENERATOR[0]`` while one is set)."""
    check_generator(generator)
    if generator is None:
        generator = SEED_GENERATOR[0]
    device = generator.device if generator is not None else "cpu"
    return int(torch.randint(0, 2 ** 63 - 1, (), generator=generator, device=device))


# ---------------------------------------------------------------------------------------------
# Helpers

def _pow2(exponent: torch.Tensor) -> torch.Tensor:
    """2**exponent as float64, exactly, for integer exponents in float64's normal range."""
    return ((exponent.to(torch.int64) + 1023) << 52).view(torch.float64)


def _round_magnitude(y: torch.Tensor, rounding: str, index: Optional[torch.Tensor],
                     seed: Optional[int]) -> torch.Tensor:
    """Round non-negative float64 y to an integer by the rounding mode."""
    if rounding == "nearest":
        return torch.round(y)  # ties to even
    lo = torch.floor(y)
    frac = y - lo
    if rounding == "nearest_away":
        return lo + (frac >= 0.5).to(y.dtype)
    if rounding == "toward_zero":
        return lo
    nbits = stochastic_bits(rounding)
    if nbits is not None:
        # N random bits: the top N of the element's 32-bit word against floor(frac * 2^N), so
        # P(up) = floor(frac * 2^N) / 2^N (biased low by less than 2^-N of a quantum)
        threshold = torch.floor(frac * 2.0 ** nbits)
        bits = (random_bits(seed, index) >> (32 - nbits)).to(torch.float64)
        return lo + (bits < threshold).to(y.dtype)
    raise ValueError(f"unknown rounding mode {rounding!r}")


def _round_float(x: torch.Tensor, fmt: FloatFormat, rounding: str,
                 index: Optional[torch.Tensor], seed: Optional[int]) -> torch.Tensor:
    """x (float64) rounded to a FloatFormat, as float64."""
    a = x.abs()
    finite = torch.isfinite(a)
    a_f = torch.where(finite, a, torch.zeros_like(a))
    _, e = torch.frexp(a_f)
    binade = e.to(torch.int64) - 1
    if fmt.subnormals:
        qexp = torch.clamp(binade, min=fmt.emin) - fmt.man
    else:  # below the smallest normal the grid is {0, min_normal}
        qexp = torch.where(binade >= fmt.emin, binade - fmt.man,
                           torch.full_like(binade, fmt.emin))
    quantum = _pow2(qexp)
    r = _round_magnitude(a_f / quantum, rounding, index, seed)
    q = r * quantum
    overflow_value = fmt.max if fmt.saturate else (float("inf") if fmt.has_inf else float("nan"))
    finite_overflow = fmt.max if rounding == "toward_zero" else overflow_value
    q = torch.where(q > fmt.max, torch.full_like(q, finite_overflow), q)
    q = torch.where(finite, q, torch.full_like(q, overflow_value))
    q = torch.where(torch.isnan(x), x, q)
    if not fmt.has_zero:  # exponent-only scale: no zero, no sign
        q = torch.where(q == 0, torch.full_like(q, fmt.min_normal), q)
        return torch.where(x > 0, q, torch.full_like(q, float("nan")))
    q = torch.copysign(q, x)
    return sign_fixup(x, q, fmt, rounding) if needs_sign_fixup(fmt) else q


def needs_sign_fixup(fmt) -> bool:
    """Whether rounding to fmt takes :func:`sign_fixup` after the signed rounding (the kernels'
    quantize_float): P3109 formats and unsigned formats with zero (UE5M3)."""
    return fmt.is_float and fmt.has_zero and (
        fmt.no_negative_zero or (fmt.man == 0 and fmt.is_p3109))


def sign_fixup(x: torch.Tensor, q: torch.Tensor, fmt: FloatFormat, rounding: str) -> torch.Tensor:
    """q, x rounded to fmt as a signed format with -0.0 (the kernels' quantize_float, any float
    dtype), made fmt's: no negative zero (-0.0 + 0.0 = +0.0); an unsigned format's negative x
    gives NaN; and for P3109's precision 1 (man = 0) a tie under "nearest" goes to the even
    code, the binade whose biased exponent is even (the kernels take the larger binade)."""
    if fmt.man == 0 and fmt.is_p3109 and rounding == "nearest":
        m, e = torch.frexp(x.abs())  # |x| = m * 2^e, m in [1/2, 1)
        b = e.to(torch.int64) - 1  # 1.5 * 2^b ties 2^b and 2^(b+1)
        even = torch.remainder(b + fmt.bias, 2) == 0
        tie = (m == 0.75) & (b >= fmt.emin) & (b <= fmt.emax) & even
        q = torch.where(tie, (x / 1.5).to(q.dtype), q)  # +-2^b exactly
    q = torch.where(q == 0, torch.zeros_like(q), q)  # (not q + 0.0: a half NaN would change bits)
    if not fmt.signed:  # negative x, and any NaN: the positive canonical NaN (as e8m0's)
        q = torch.where((x < 0) | torch.isnan(q), torch.full_like(q, float("nan")), q)
    return q


def _round_float_up(r: torch.Tensor, fmt: FloatFormat) -> torch.Tensor:
    """Non-negative finite r (float64) rounded up to a value of the signed FloatFormat fmt (the
    ceil scale rule): the value toward zero, and if that is below r the next one (past max:
    fmt's overflow value)."""
    t = _round_float(r, fmt, "toward_zero", None, None)
    _, e = torch.frexp(t)
    qexp = torch.where(t > 0, torch.clamp(e.to(torch.int64) - 1, min=fmt.emin) - fmt.man,
                       torch.full_like(e, fmt.emin - fmt.man if fmt.subnormals else fmt.emin,
                                       dtype=torch.int64))
    nxt = t + _pow2(qexp)
    overflow = fmt.max if fmt.saturate else (float("inf") if fmt.has_inf else float("nan"))
    nxt = torch.where(nxt > fmt.max, torch.full_like(nxt, overflow), nxt)
    return torch.where(t < r, nxt, t)


def _round_fixed(x: torch.Tensor, fmt: FixedFormat, rounding: str,
                 index: Optional[torch.Tensor], seed: Optional[int]) -> torch.Tensor:
    """x (float64) rounded to a FixedFormat, as float64."""
    y = x * 2.0 ** fmt.fl
    a = y.abs()
    finite = torch.isfinite(a)
    a_f = torch.where(finite, a, torch.zeros_like(a))
    k = torch.copysign(_round_magnitude(a_f, rounding, index, seed), y)
    k = torch.where(finite, k, y)  # +-Inf always clamps below
    kmin, kmax = float(fmt.kmin), float(fmt.kmax)
    out_of_range = (k > kmax) | (k < kmin)
    if fmt.saturate:
        k = torch.where(out_of_range, torch.clamp(k, kmin, kmax), k)
    else:
        span = 2.0 ** fmt.wl
        low = -(2.0 ** (fmt.wl - 1)) if fmt.signed else 0.0
        # remainder by a power of two is exact in float64; k - low is not once |k| >= 2^53
        wrapped = torch.remainder(torch.remainder(k, span) - low, span) + low
        wrapped = torch.clamp(wrapped, kmin, kmax)  # symmetric: the dropped code clamps
        wrapped = torch.where(torch.isfinite(k), wrapped, torch.clamp(k, kmin, kmax))
        k = torch.where(out_of_range, wrapped, k)
    return (k + 0.0) * 2.0 ** -fmt.fl  # -0.0 + 0.0 = +0.0: no negative zero


def round_scalar64(x64: torch.Tensor, fmt, rounding, index, seed) -> torch.Tensor:
    """x64 (float64) rounded to a scalar (float or fixed-point) format, as float64; stochastic
    rounding draws each element's random bits by its ``index`` under ``seed``."""
    if fmt.is_float:
        return _round_float(x64, fmt, rounding, index, seed)
    return _round_fixed(x64, fmt, rounding, index, seed)


def tile_blocks(x: torch.Tensor, fmt: BlockFormat):
    """x laid out for a 2D block format: (y, restore, fmt1) with y of shape
    [..., R/r, C/c, r*c] (each r x c tile of the last two dims, zero-padded at the ends, as one
    contiguous run), fmt1 the 1D format that rounds y's runs as the tiles, and restore(q) that
    undoes the layout. Zeros change no block's amax nor the tensor's, so the padded tiles round
    as the partial tiles they hold."""
    r, c = fmt.block_shape
    if fmt.axis % x.dim() == x.dim() - 2:  # cols along dim -2: the tiles are c x r
        r, c = c, r
    R, C = x.shape[-2], x.shape[-1]
    r, c = max(min(r, R), 1), max(min(c, C), 1)  # a tile longer than its dim is the dim
    pr, pc = (-R) % r, (-C) % c
    y = torch.nn.functional.pad(x, (0, pc, 0, pr)) if pr or pc else x
    lead = x.shape[:-2]
    y = y.reshape(*lead, (R + pr) // r, r, (C + pc) // c, c).transpose(-3, -2)
    y = y.reshape(*lead, (R + pr) // r, (C + pc) // c, r * c)
    fmt1 = fmt.replace(block_shape=None, block_size=r * c, axis=-1)
    A, B = (R + pr) // r, (C + pc) // c

    def restore(q, into=None):
        """q back in x's layout (a view), or copied into ``into`` (x's shape)."""
        q = q.reshape(*lead, A, B, r, c)
        if into is not None and not (pr or pc) and into.is_contiguous():
            # (a permuted destination and a contiguous source: torch's fast permuting copy)
            into.view(*lead, A, r, B, c).transpose(-3, -2).copy_(q)
            return into
        v = q.transpose(-3, -2).reshape(*lead, R + pr, C + pc)[..., :R, :C]
        return v if into is None else into.copy_(v)
    return y, restore, fmt1


def negative_power_lowers(fmt: BlockFormat) -> bool:
    """Whether fmt's scale rule counts a negative power of two one binade lower: the floor rule
    with signed two's-complement fixed-point elements (codes down to -2^(emax_elem+1), one past
    the positive max), whose scale 2^(c-1-emax_elem) holds -2^c as that code."""
    # (an element range past -max: two's complement's most negative code -max - 2^-fl)
    return fmt.scale_rule == "floor" and -fmt.elem.lowest > fmt.elem.max


def scale_amax(blocks: torch.Tensor, fmt: BlockFormat, dim=-1, keepdim: bool = True):
    """The magnitude the blocks' scales derive from (what :func:`scale_candidates` takes): the
    largest |x| along dim, float64 (NaN or Inf where the block holds one). Under
    :func:`negative_power_lowers` a negative x = -2^c (c > -149) counts as the largest float64
    below 2^c: b = max(floor(log2 p) over positives, ceil(log2 |n|) - 1 over negatives), so a
    block's own rounded values (its most negative code -2^(emax_elem+1) * X) derive the same
    scale again (docs/formats.md, the floor rule). (-2^-149 keeps its binade: both scales
    clamp to the smallest.)"""
    a = blocks.abs().double()
    if negative_power_lowers(fmt):
        m, _ = torch.frexp(a)
        lower = (blocks < 0) & (m == 0.5) & (a > 2.0 ** -149)
        a = torch.where(lower, a * (1 - 2.0 ** -53), a)  # exact: 53 ones below 2^c
    if not a.numel():
        return a.sum(dim, keepdim)
    return a.amax(dim, keepdim) if dim is not None else a.amax()


def scale_candidates(fmt: BlockFormat) -> list:
    """The functions amax -> X of blocks whose largest magnitude is amax (finite float64,
    >= 0), by ``fmt.scale_rule``: one, or two for 4over6 (the block's max mapped to max_elem
    and to 4; the block takes the one with the lower error). (Two-level formats: te_scale_fns.)"""
    elem = fmt.elem
    emax_elem, max_elem = elem.emax, elem.max
    if fmt.power_of_two_scales:  # floor, even, ceil: 2^k from amax's exponent
        def scale_of(a):
            _, e = torch.frexp(a)
            b = e.to(torch.int64) - 1  # floor(log2 a); -1 for a = 0
            if fmt.scale_rule == "even":
                # a rounded half away from zero to the element's significant bits reaches the
                # next binade: a >= 2^(b+1) - 2^(b-m-1), m the bits after the leading one
                m = _significant_bits(elem) - 1
                b = b + (a >= _pow2(b + 1) - _pow2(b - m - 1)).to(torch.int64)
            k = b - emax_elem
            if fmt.scale_rule == "ceil":
                k = k + (a / _pow2(k) > max_elem).to(torch.int64)
            return _pow2(torch.clamp(k, fmt.scale.emin, fmt.scale.emax))
        return [scale_of]
    # amax, 4over6, ceil: a rounding of amax / max_elem to the scale format
    scale_fmt = fmt.amax_scale_format.replace(rounding="nearest")
    rnd = _round_float_up if fmt.scale_rule == "ceil" else (
        lambda r, f: _round_float(r, f, "nearest", None, None))

    def amax_scale(a, target):  # the scale X mapping a to target
        return rnd(a / target, scale_fmt)
    targets = (max_elem, 4.0) if fmt.scale_rule == "4over6" else (max_elem,)
    return [lambda a, t=t: amax_scale(a, t) for t in targets]


def block_scale(amax: torch.Tensor, fmt: BlockFormat) -> torch.Tensor:
    """The scale X of blocks whose largest magnitude is ``amax`` (finite float64, >= 0), by
    ``fmt.scale_rule`` (two-level formats: te_block_scale). (qtensor.analysis.weight_grid decides the scale of
    each block of a weight from the values the block holds when it is reached.) 4over6 has no
    single scale of an amax (a block picks by its rounding error): ValueError."""
    candidates = scale_candidates(fmt)
    if len(candidates) != 1:
        raise ValueError(f"{fmt}: the 4over6 rule picks each block's scale by the block's "
                         "rounding error, not from its amax alone")
    return candidates[0](amax)


def round_with_scale(x64: torch.Tensor, scale: torch.Tensor, fmt: BlockFormat,
                     rounding: str, index: Optional[torch.Tensor] = None,
                     seed: Optional[int] = None) -> torch.Tensor:
    """x (float64) rounded to ``fmt``'s elements times ``scale`` (broadcast; a block's X), as
    float64: exact. A zero scale gives (signed, for float elements) zeros."""
    elem = fmt.elem
    safe_scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = round_scalar64(x64 / safe_scale, elem, rounding, index, seed) * safe_scale  # exact
    zero = torch.zeros_like(q)
    if not elem.no_negative_zero:  # signed zeros; integer elements have no -0.0
        zero = torch.copysign(zero, x64)
    return torch.where(scale > 0, q, zero)


def block_layout(x: torch.Tensor, fmt: BlockFormat) -> torch.Tensor:
    """x laid out as [..., blocks, block size] by fmt's 1D blocking: the block axis moved last
    (axis=None: the whole tensor one block), zero-padded to whole blocks at its end."""
    moved = x.reshape(1, -1) if fmt.axis is None or x.dim() == 0 else x.movedim(fmt.axis, -1)
    n = moved.shape[-1]
    bs = fmt.block_size if (fmt.block_size is not None and fmt.axis is not None) else n
    bs = max(min(bs, n), 1)  # a block longer than the axis is the axis (no padding to 2**62)
    pad = (-n) % bs
    if pad:
        moved = torch.nn.functional.pad(moved, (0, pad))
    return moved.reshape(*moved.shape[:-1], -1, bs)


# ---------------------------------------------------------------------------------------------
# Two-level block formats (tensor_scale=True, NVFP4): Transformer Engine's rule, each step a
# float32 operation as TE's kernels do it (docs/formats.md, "NVFP4: the tensor scale")

_F32_MAX = float(torch.finfo(torch.float32).max)


def check_tensor_scale(s, fmt) -> torch.Tensor:
    """A given tensor (decode) scale as a 0-dim float32 tensor: a positive finite float32."""
    if isinstance(s, torch.Tensor):
        if s.numel() != 1 or not s.is_floating_point():
            raise ValueError(f"{fmt}: tensor_scale must be one positive finite float32, got a "
                             f"{s.dtype} tensor of shape {tuple(s.shape)}")
        v = s.detach().reshape(())
        if v.device.type != "meta":
            f = float(v)
            if not (math.isfinite(f) and f > 0 and float(v.to(torch.float32)) == f):
                raise ValueError(f"{fmt}: tensor_scale must be a positive finite float32, got {f!r}")
        return v.to(torch.float32)
    if isinstance(s, bool) or not isinstance(s, (int, float)):
        raise TypeError(f"{fmt}: tensor_scale must be a float or a 0-dim tensor, got "
                        f"{type(s).__name__}")
    f = float(s)
    if not (math.isfinite(f) and f > 0) or float(torch.tensor(f, dtype=torch.float32)) != f:
        raise ValueError(f"{fmt}: tensor_scale must be a positive finite float32 (TE's FP32 "
                         f"per-tensor scale), got {s!r}")
    return torch.tensor(f, dtype=torch.float32)


def finite_amax(x: torch.Tensor) -> torch.Tensor:
    """x's largest finite magnitude as float32 (0-dim; 0 for none): a two-level format's amax."""
    x = x.detach().to(torch.float32)
    if not x.numel():
        return x.new_zeros(())
    return torch.where(torch.isfinite(x), x.abs(), torch.zeros_like(x)).amax()


def encode_scale(amax: torch.Tensor, fmt: BlockFormat) -> torch.Tensor:
    """TE's global encode scale (float32, 0-dim) of a tensor whose largest finite magnitude is
    ``amax``: max_elem * bound / amax in float32 (bound: 448, 256 for 4over6), FLT_MAX where
    that overflows, 1 for amax 0 (and where it underflows to 0)."""
    a = amax.to(torch.float32)
    num = torch.tensor(fmt.elem.max * fmt.tensor_scale_bound, dtype=torch.float32,
                       device=a.device)
    enc = torch.clamp(num / a, max=_F32_MAX)
    return torch.where((a == 0) | (enc == 0), torch.ones_like(enc), enc)


def _f32(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.float32)


def round_scalar32(t: torch.Tensor, fmt, rounding: str, index: Optional[torch.Tensor],
                   seed: Optional[int], inplace: bool = False) -> torch.Tensor:
    """float32 t rounded to a scalar format, as float32 (exact: a value of fmt). index None
    under stochastic rounding: each element's own flat index in t. inplace: t may be
    overwritten with the result (here a new tensor is returned)."""
    if index is None and stochastic_bits(rounding) is not None:
        index = torch.arange(t.numel(), device=t.device, dtype=torch.int64).reshape(t.shape)
    return _f32(round_scalar64(t.to(torch.float64), fmt, rounding, index, seed))


def _scale_code(t32: torch.Tensor, fmt: BlockFormat, rnd) -> torch.Tensor:
    """A block's scale-format value (float32) from its float32 target: nearest (the cast
    TE makes, saturating), or upward for the ceil rule."""
    sf = fmt.amax_scale_format.replace(rounding="nearest", saturate=True)
    t = torch.nan_to_num(t32, nan=_F32_MAX, posinf=_F32_MAX)
    if fmt.scale_rule == "ceil":
        return _f32(torch.clamp(_round_float_up(t.to(torch.float64), sf), max=sf.max))
    return rnd(t, sf, "nearest", None, None)


def te_scale_fns(fmt: BlockFormat, enc: torch.Tensor, dec: torch.Tensor, rnd=None) -> list:
    """TE's block scale rules under encode/decode tensor scales enc, dec (float32, 0-dim): the
    functions block amax (float32) -> X (float32, scale-format values); two for 4over6 (the
    max mapped to 6 and to 4)."""
    rnd = round_scalar32 if rnd is None else rnd
    elem = fmt.elem
    inv_max = _f32(torch.tensor(1.0, dtype=torch.float64) / elem.max).to(enc.device)
    if fmt.scale_rule == "4over6":  # (TE's 4over6 order)
        return [lambda a: _scale_code((a / elem.max) * enc, fmt, rnd),
                lambda a: _scale_code((a / elem.max) * enc * 1.5, fmt, rnd)]
    if fmt.scale_rule != "ceil":
        return [lambda a: _scale_code(a * (enc * inv_max), fmt, rnd)]
    sf = fmt.amax_scale_format.replace(rounding="toward_zero", saturate=True)

    def ceil_of(a):
        # the smallest scale whose largest value covers a: the float32 target of a block
        # max fl32(6 X s) can land just above X, whose largest value already covers it
        X = _scale_code(a * (enc * inv_max), fmt, rnd)
        down = rnd(X * (1 - 2.0 ** -(sf.man + 2)), sf, "toward_zero", None, None)
        return torch.where((elem.max * down) * dec >= a, down, X)
    return [ceil_of]


def te_block_scale(amax: torch.Tensor, fmt: BlockFormat, scales) -> torch.Tensor:
    """X * s (float64, exact) of blocks of largest magnitude amax (float64, read as float32)
    by TE's rule under scales = (encode, decode) tensor scales; not for 4over6 (ValueError)."""
    fns = te_scale_fns(fmt, *scales)
    if len(fns) != 1:
        raise ValueError(f"{fmt}: the 4over6 rule picks each block's scale by the block's "
                         "rounding error, not from its amax alone")
    return fns[0](_f32(amax)).to(torch.float64) * scales[1].to(torch.float64)


def te_round_with_scale(x64: torch.Tensor, scale: torch.Tensor, fmt: BlockFormat,
                        rounding: str, scales) -> torch.Tensor:
    """x (read as float32) rounded by TE's steps with block scales ``scale`` = X * s (float64,
    from te_block_scale; broadcast) under scales = (encode, decode): fl32(e X s), as float64."""
    dec = scales[1]
    X = _f32(scale / dec.to(torch.float64))  # (exact)
    inv = torch.clamp(torch.ones_like(X) / (X * dec), max=_F32_MAX)
    e = round_scalar32(_f32(x64) * inv, fmt.elem, rounding, None, None)
    q = ((e * X) * dec).to(torch.float64)
    return torch.where(q == 0, torch.copysign(torch.zeros_like(q), x64), q)


def _two_level_blocks(blocks: torch.Tensor, fmt: BlockFormat, rounding: str,
                      idx: Optional[torch.Tensor], seed: Optional[int], tensor_scale, rnd,
                      tensor_amax=None):
    """blocks ([..., n, block], float32) rounded by TE's rule, as float32 values, and the decode
    tensor scale (float32, 0-dim): tensor_scale (checked) if given, else the one of the blocks'
    largest finite magnitude. Every step is one float32 operation, as in TE's kernels (products
    of an element and a block scale are exact in float32); rnd rounds a float32 tensor to a
    scalar format (round_scalar32's signature; idx None: flat indices)."""
    elem = fmt.elem
    # one tensor of the blocks' size, the result, also holds the intermediate steps
    buf = torch.empty(blocks.shape, dtype=torch.float32, device=blocks.device)
    if blocks.numel():
        # |x|'s bits: ordered as integers as |x| is, NaN above inf (a NaN's max is a NaN)
        bits = torch.bitwise_and(blocks.view(torch.int32), 0x7FFFFFFF, out=buf.view(torch.int32))
        bmax = bits.amax(dim=-1, keepdim=True)
        bad = bmax >= 0x7F800000  # an inf or NaN in the block
        amax_b = bmax.view(torch.float32)
    else:
        amax_b = blocks.sum(-1, True)
        bad = ~torch.isfinite(amax_b)
    # (no data-dependent branch on a device, where it syncs, nor in a traced graph)
    any_bad = (blocks.device.type != "cpu" or torch.compiler.is_compiling()
               or type(blocks) is not torch.Tensor or bool(bad.any()))
    if any_bad:
        amax_b = torch.where(bad, torch.zeros_like(amax_b), amax_b)
    if tensor_scale is None:
        if tensor_amax is not None:  # a part of a tensor: the whole one's amax
            amax_t = tensor_amax.to(torch.float32).reshape(())
        elif any_bad and blocks.numel():  # (a non-finite value's block included)
            amax_t = finite_amax(blocks)
        else:
            amax_t = amax_b.amax() if amax_b.numel() else amax_b.sum()
        enc = encode_scale(amax_t, fmt)
        dec = torch.ones_like(enc) / enc
    else:
        dec = check_tensor_scale(tensor_scale, fmt).to(blocks.device)
        enc = torch.ones_like(dec) / dec
        amax_t = fmt.elem.max * fmt.tensor_scale_bound / enc.double()

    def payload(X, into=None):  # X (float32, scale values) -> the blocks' e * X (exact)
        inv = torch.clamp(torch.ones_like(X) / (X * dec), max=_F32_MAX)
        t = torch.mul(blocks, inv, out=into) if into is not None else blocks * inv
        if rounding in ("nearest", "nearest_away"):
            e = rnd(t, elem, rounding, idx, seed, inplace=True)
        else:
            # x * inv of a value fl32(e * X * s) is e only to a few ulps: directed and stochastic
            # rounding keep such a value of the format (nearest rounds it to e already)
            en = rnd(t, elem, "nearest", None, None)
            e = torch.where((en * X) * dec == blocks, en, rnd(t, elem, rounding, idx, seed))
        return e.mul_(X)

    scale_ofs = te_scale_fns(fmt, enc, dec, rnd)

    def settled(scale_of, into=None):  # -> (e * X, X)
        X = scale_of(amax_b)
        p = payload(X, into)
        # settle: each block again with the scale of its own rounded max, until the scale
        # repeats, so that rounding the values once more under the same tensor scale gives
        # them back (each step lowers X, so this ends)
        while fmt.settle:
            q = p * dec
            rmax = q.abs().amax(dim=-1, keepdim=True) if q.numel() else q.sum(-1, True)
            lower = (scale_of(rmax) < X) & ~bad
            if lower.device.type == "meta" or not bool(lower.any()):
                break
            X = torch.where(lower, scale_of(rmax), X)
            p = torch.where(lower, payload(X), p)
        return p, X

    p, X = settled(scale_ofs[0], buf)
    if len(scale_ofs) == 2:  # map-to-4 where its float32 error sum is lower (map-to-6 on a tie)
        p4, X4 = settled(scale_ofs[1])
        denom = float(elem.max * fmt.tensor_scale_bound)
        a32 = _f32(amax_t)

        def err(p_):
            val = (p_ * a32) / denom  # TE's dequantized value, float32 steps
            d = (val - blocks).abs()
            acc = torch.zeros_like(amax_b)
            for j in range(blocks.shape[-1]):  # in element order
                acc = acc + d[..., j:j + 1]
            return acc
        pick4 = err(p4) < err(p)
        p, X = torch.where(pick4, p4, p), torch.where(pick4, X4, X)
    q = p.mul_(dec)  # one float32 rounding; a zero keeps e's sign, which is x's for float e
    if elem.no_negative_zero:  # (integer elements have no -0.0: x's sign)
        q = torch.where(q == 0, torch.copysign(torch.zeros_like(q), blocks), q)
    if any_bad:
        q = torch.where(bad, torch.full_like(q, float("nan")), q)
    return q, dec, X


def quantize_two_level(x: torch.Tensor, fmt: BlockFormat, rounding: str, seed: int = 0,
                       tensor_scale=None, rnd=round_scalar32, block_scales: bool = False,
                       tensor_amax=None):
    """x rounded to a two-level block format by Transformer Engine's NVFP4 rule: (values like
    x, the decode tensor scale as a 0-dim float32 tensor). tensor_scale: round under this
    decode scale (a positive finite float32; the encode scale is then its float32 reciprocal)
    instead of the one of x's amax. Inputs are read as float32 (a float64 x is rounded to
    float32 first, as TE reads its inputs). rnd: the scalar rounding of float32 tensors
    (round_scalar32; qtensor.kernels.ops passes the compiled kernels'). block_scales: also return each
    block's scale-format factor X (float32, the blocks' layout: block_layout's, or
    tile_blocks's, with a last dim of 1). tensor_amax: the amax whose scale to use (a 0-dim
    float32 tensor, of a whole tensor that x is a part of) instead of x's own."""
    x32 = x.detach().to(torch.float32)
    if x.numel() == 0:
        s = check_tensor_scale(tensor_scale, fmt) if tensor_scale is not None else \
            torch.ones((), dtype=torch.float32) if tensor_amax is None else \
            1 / encode_scale(tensor_amax.reshape(()), fmt)
        return x.detach().clone(), s.to(x.device)
    stochastic = stochastic_bits(rounding) is not None

    def index():
        return torch.arange(x.numel(), device=x.device, dtype=torch.int64).reshape(x.shape)
    if fmt.block_shape is not None:
        check_axis(x32, fmt)
        y, restore, fmt1 = tile_blocks(x32, fmt)
        iy = tile_blocks(index(), fmt)[0] if stochastic else None
        q, dec, X = _two_level_blocks(y, fmt1, rounding, iy, seed, tensor_scale, rnd,
                                      tensor_amax)
        q = restore(q)
    else:
        shape = x32.shape
        axis = None if fmt.axis is None or x32.dim() == 0 else fmt.axis
        if axis is not None:
            check_axis(x32, fmt)
        blocks = block_layout(x32, fmt)
        moved = x32.reshape(1, -1) if axis is None else x32.movedim(axis, -1)
        n = moved.shape[-1]
        # the random bits follow each element's index in x: the blocks' own flat index where
        # they are x's elements in order (None), else laid out as the blocks
        flat = n % blocks.shape[-1] == 0 and (axis is None or axis % x32.dim() == x32.dim() - 1)
        idx = block_layout(index(), fmt) if stochastic and not flat else None
        q, dec, X = _two_level_blocks(blocks, fmt, rounding, idx, seed, tensor_scale, rnd,
                                      tensor_amax)
        q = q.reshape(*moved.shape[:-1], -1)[..., :n]
        q = q.reshape(shape) if axis is None else q.movedim(-1, axis)
    out = (_nan_bits(q.to(x.dtype), q, x, fmt), dec)
    return out + (X,) if block_scales else out


def two_level_payload(values: torch.Tensor, s: torch.Tensor, fmt: BlockFormat) -> torch.Tensor:
    """The payloads p = element x block scale (float64, exact) of a two-level format's values
    fl32(p x s): values / s rounded to the significant bits an element times a scale has (the
    float32 rounding of p x s moves it by far less than their spacing)."""
    r = values.to(torch.float64) / s.to(torch.float64)
    bits = _significant_bits(fmt.elem) + fmt.amax_scale_format.man + 1
    a = r.abs()
    _, e = torch.frexp(torch.where(a > 0, a, torch.ones_like(a)))
    q = _pow2(e.to(torch.int64) - bits)
    return torch.where(a > 0, torch.round(r / q) * q, r)


def two_level_valid(values: torch.Tensor, s: torch.Tensor, fmt: BlockFormat) -> torch.Tensor:
    """Which values are fl32(p x s) for a payload p of fmt's element times scale bits."""
    p = two_level_payload(values, s, fmt)
    elem = fmt.elem
    sf = fmt.amax_scale_format
    # (p on the grid of numbers of that many bits: a superset of the element x scale products)
    return (p.abs() <= elem.max * sf.max) & (_f32(p * s.to(torch.float64)) == values.float())


def _quantize_blocks(x64: torch.Tensor, fmt: BlockFormat, rounding: str,
                     index: Optional[torch.Tensor], seed: Optional[int]) -> torch.Tensor:
    """x (float64) rounded to a BlockFormat, as float64 (float32-exact values)."""
    if fmt.block_shape is not None:  # 2D tiles: each one a 1D block of r*c (the same bits)
        check_axis(x64, fmt)
        y, restore, fmt1 = tile_blocks(x64, fmt)
        # the random bits stay those of each element's index in x
        iy = tile_blocks(index, fmt)[0] if index is not None else None
        return restore(_quantize_blocks(y, fmt1, rounding, iy, seed))
    shape = x64.shape
    if fmt.axis is None or x64.dim() == 0:
        axis = None
    else:
        check_axis(x64, fmt)
        axis = fmt.axis
    blocks = block_layout(x64, fmt)
    idx = block_layout(index, fmt) if index is not None else None
    moved = x64.reshape(1, -1) if axis is None else x64.movedim(axis, -1)
    n = moved.shape[-1]
    amax = scale_amax(blocks, fmt)
    bad = ~torch.isfinite(amax)
    amax_f = torch.where(bad, torch.zeros_like(amax), amax)

    candidates = scale_candidates(fmt)

    def round_at(scale):
        return round_with_scale(blocks, scale, fmt, rounding, idx, seed)

    def settled(scale_of):
        scale = scale_of(amax_f)
        q = round_at(scale)
        if fmt.scale_rule in ("floor", "ceil") and fmt.power_of_two_scales:
            return q  # (their blocks keep their scale: a lower one would give the same values)
        # Idempotence: the scale of the rounded block, derived again from its own amax, must be
        # X. Rounding can lower the block's max below max_elem * X (a scale in the subnormal
        # range, toward_zero, stochastic; for even, a max rounded down out of the top binade);
        # then the block is rounded again with the scale of its rounded max, until that scale
        # repeats. Each step lowers X, so this ends; usually after the first step.
        while True:
            rmax = q.abs().amax(dim=-1, keepdim=True) if q.numel() else q.sum(-1, True)
            again = scale_of(torch.where(bad, torch.zeros_like(rmax), rmax))
            lower = again < scale
            # (the loop's test is one device sync per step on CUDA; meta tensors hold no values:
            # one step stands for all)
            if lower.device.type == "meta" or not bool(lower.any()):
                break
            scale = torch.where(lower, again, scale)
            q = torch.where(lower, round_at(scale), q)
        return q

    q = settled(candidates[0])
    if len(candidates) == 2:  # 4over6: map to 4 where its error sum is lower (6 on a tie)
        q4 = settled(candidates[1])
        err6 = torch.zeros_like(amax_f)
        err4 = torch.zeros_like(amax_f)
        for j in range(blocks.shape[-1]):  # in element order, as the kernels add them
            err6 = err6 + (q[..., j:j + 1] - blocks[..., j:j + 1]).abs()
            err4 = err4 + (q4[..., j:j + 1] - blocks[..., j:j + 1]).abs()
        q = torch.where(err4 < err6, q4, q)
    q = torch.where(bad, torch.full_like(q, float("nan")), q)
    q = q.reshape(*moved.shape[:-1], -1)[..., :n]
    if axis is None:
        return q.reshape(shape)
    return q.movedim(-1, axis)


# ---------------------------------------------------------------------------------------------
# Public entry points

def quantize_with_seed(x: torch.Tensor, fmt, rounding: Optional[str] = None,
                       seed: int = 0) -> torch.Tensor:
    """``quantize`` with an explicit stochastic-rounding seed (what the kernels receive)."""
    fmt = check_input(x, fmt)
    rounding = resolve_rounding(fmt, rounding)
    if x.numel() == 0:
        return x.detach().clone()
    index = None
    if stochastic_bits(rounding) is not None:
        index = torch.arange(x.numel(), device=x.device, dtype=torch.int64).reshape(x.shape)
    if fmt.is_two_level:
        return quantize_two_level(x, fmt, rounding, seed)[0]
    x64 = x.detach().to(torch.float64)
    if fmt.is_block:
        q = _quantize_blocks(x64, fmt, rounding, index, seed)
    else:
        q = round_scalar64(x64, fmt, rounding, index, seed)
    if x.dtype in (torch.float16, torch.bfloat16):
        return _nan_bits(q.to(torch.float32).to(x.dtype), q, x, fmt)
    return _nan_bits(q.to(x.dtype), q, x, fmt)


def _half_bits(bits: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.tensor(bits - (1 << 16) if bits >> 15 else bits, dtype=torch.int16).view(dtype)


def _nan_bits(out: torch.Tensor, q: torch.Tensor, x: torch.Tensor, fmt) -> torch.Tensor:
    """out with its NaNs written as the kernels write them (docs/formats.md, "NaN bits"): in
    float32/float64 a scalar signed format returns an input NaN with all its bits (the float64
    detour would quiet a signalling one); a block format and e8m0 (no sign) give the positive
    canonical NaN; float16 keeps the sign of the float32 result's NaN
    with the quiet payload 0x7E00, bfloat16 is always 0x7FC0 (c10's scalar conversions, which
    the kernels narrow with; torch's vectorised cast gives 0xFFFF)."""
    if out.dtype == torch.bfloat16:
        return torch.where(torch.isnan(q), _half_bits(0x7FC0, out.dtype).to(out.device), out)
    if out.dtype == torch.float16:
        pos, neg = (_half_bits(b, out.dtype).to(out.device) for b in (0x7E00, 0xFE00))
        return torch.where(torch.isnan(q), torch.where(torch.signbit(q), neg, pos), out)
    if fmt.is_block or fmt.scale_only:  # (block formats, unsigned floats)
        return out  # (the positive canonical NaN already)
    return torch.where(torch.isnan(x), x.detach(), out)


def quantize(x: torch.Tensor, fmt, *, rounding: Optional[str] = None,
             generator: Optional[torch.Generator] = None, tensor_scale=None) -> torch.Tensor:
    """x rounded to ``fmt`` (a format or its name), as a new plain tensor like x.

    rounding overrides the format's own mode; generator feeds stochastic rounding;
    tensor_scale: a two-level format's FP32 decode tensor scale to round under (as qt.quantize).
    """
    fmt = check_input(x, fmt)
    rounding = resolve_rounding(fmt, rounding)
    check_generator(generator)
    seed = draw_seed(generator) if stochastic_bits(rounding) is not None else 0
    if tensor_scale is not None:
        if not (fmt.is_two_level):
            raise ValueError(f"quantize to {fmt}: tensor_scale is for two-level block formats "
                             "(tensor_scale=True, such as nvfp4)")
        return quantize_two_level(x, fmt, rounding, seed, tensor_scale)[0]
    return quantize_with_seed(x, fmt, rounding, seed)
