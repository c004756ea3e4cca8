"""Block-scaled operands: their scales applied where ``AccumFormat.scales`` says (in the
instruction, on promotion, in the epilogue), around the unscaled sums of the kernel or the
reference."""
from __future__ import annotations

import math
from typing import Optional

import torch

from .exponents import _ZERO_EXP, _exponent, _operand_emin, _pow2
from .format import AccumFormat

def _fma_f32(s: torch.Tensor, p: torch.Tensor, acc: torch.Tensor) -> torch.Tensor:
    """fp32(acc + s * p) with one rounding (the CUDA cores' FFMA that DeepGEMM's promotion
    ``final_accum += scale * accum`` compiles to); s, p, acc float32. s * p is exact in float64
    (two 24-bit significands); the sum is rounded to odd in float64 (TwoSum, then the last bit
    set toward the dropped part), which then rounds to nearest float32 correctly."""
    x, y = acc.double(), s.double() * p.double()
    hi = x + y
    yy = hi - x
    lo = (x - (hi - yy)) + (y - yy)
    even = (hi.view(torch.int64) & 1) == 0
    bump = (lo != 0) & even & torch.isfinite(hi)
    hi = torch.where(bump, torch.nextafter(hi, torch.where(lo > 0, math.inf, -math.inf)), hi)
    return hi.float()


def _scale_emin(s: torch.Tensor) -> Optional[int]:
    """The clamp of positive scales' floor(log2) (E4M3 subnormal scales at -6, as MMA-Sim's
    nvf4)."""
    return -6 if s.dtype == torch.float8_e4m3fn else None


def _scaled(fn, a, b, f: AccumFormat, a_scale, b_scale, kw, block_size=None) -> torch.Tensor:
    """a @ b of unscaled operands a, b with their scales applied where ``f.scales`` says; fn (the
    kernel entry or the reference) computes the unscaled sums.

    - ``instruction`` (Blackwell block-scaled MMA): a_scale (..., M, KB), b_scale (..., KB, N),
      one scale per block of ``block_size`` K-elements (the last block may be shorter; without
      block_size, K / KB where KB divides K, else refused: KB blocks of a ragged K do not say
      their size); a NaN scale (E8M0's NaN code) makes every output it enters NaN, as the
      hardware's; the operands are dequantized (exactly, each K-block's pair of operands shifted
      by opposite powers of two where one would leave float32's range) and
      each product aligns at its elements' and scales' exponents: with groups the group
      exponents are the scales' floor(log2) (a_gexp/b_gexp), without them the scales must be
      powers of two (E8M0) and add to the elements' clamps (a_emin/b_emin).
    - ``promotion`` (DeepSeek-V3 / DeepGEMM on Hopper): a_scale (..., M, KB), b_scale
      (..., KB, N), one per promotion interval of ``chunk * promote`` K-elements (expand a
      128x128 weight block's scale along N); each interval's chain of instructions starts from 0,
      its unscaled partial p is promoted as acc = fp32(acc + fp32(a_scale * b_scale) * p) (one
      FFMA); c starts acc.
    - ``epilogue``: a_scale broadcast to (..., M, 1), b_scale to (..., 1, N) (per tensor or per
      row / column); the whole sum of unscaled products, then fp32(sum * fp32(a_scale * b_scale)).
    """
    if a_scale is None or b_scale is None:
        raise ValueError("accum_matmul: a_scale and b_scale go together (a scale of 1 for an "
                         "operand without scales)")
    for n, x in (("a_scale", a_scale), ("b_scale", b_scale)):
        if not isinstance(x, torch.Tensor) or not x.dtype.is_floating_point:
            raise TypeError(f"accum_matmul: {n} must be a floating-point tensor, got {x!r:.80}")
    a_scale, b_scale = a_scale.to(a.device), b_scale.to(a.device)
    batch = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    M, K, N = a.shape[-2], a.shape[-1], b.shape[-1]
    if f.scales == "epilogue":
        try:
            sa = a_scale.float().expand(*batch, M, 1)
            sb = b_scale.float().expand(*batch, 1, N)
        except RuntimeError:
            raise ValueError(f"accum_matmul: with scales='epilogue' a_scale {tuple(a_scale.shape)}"
                             f" must broadcast to {(*batch, M, 1)} and b_scale "
                             f"{tuple(b_scale.shape)} to {(*batch, 1, N)}") from None
        out = fn(a, b, f, **kw)
        s = (sa.double() * sb.double()).float()
        return (out.double() * s.double()).float()
    if a_scale.dim() < 2 or b_scale.dim() < 2:
        raise ValueError("accum_matmul: a_scale must be (..., M, KB) and b_scale (..., KB, N)")
    KB = a_scale.shape[-1]
    if block_size is not None and (isinstance(block_size, bool) or not isinstance(
            block_size, int) or block_size < 1):
        raise ValueError(f"accum_matmul: block_size must be a positive int, got {block_size!r}")
    if f.scales == "promotion":
        blk = f.chunk * f.promote
        if block_size is not None and block_size != blk:
            raise ValueError(f"accum_matmul: scales='promotion' takes one scale per promotion "
                             f"interval (chunk * promote = {blk} K-elements), got "
                             f"block_size={block_size}")
    elif block_size is not None:
        blk = block_size
    elif KB and K % KB:
        lo, hi = -(-K // KB), (-(-K // (KB - 1)) - 1) if KB > 1 else K
        raise ValueError(
            f"accum_matmul: K={K} with {KB} scale columns: blocks of {lo} to {hi} K-elements "
            f"all give {KB} blocks (the last one shorter), so the block size is ambiguous; "
            f"pass block_size= (e.g. 32 for MX, 16 for NVFP4)")
    else:
        blk = K // KB if KB else 0
    want = -(-K // blk) if blk else 0
    try:
        if KB != want or b_scale.shape[-2] != want:
            raise RuntimeError
        sa = a_scale.expand(*batch, M, want)
        sb = b_scale.expand(*batch, want, N)
    except RuntimeError:
        what = (f"one per {blk} K-elements (chunk * promote)" if f.scales == "promotion"
                else "one per block of K, the same blocks for both")
        raise ValueError(f"accum_matmul: a_scale is {tuple(a_scale.shape)} and b_scale "
                         f"{tuple(b_scale.shape)}; for K={K} expected {(*batch, M, want)} and "
                         f"{(*batch, want, N)} ({what})") from None
    if f.scales == "instruction":
        return _instruction_scaled(fn, a, b, f, sa, sb, blk, kw)
    if kw["a_gexp"] is not None or kw["b_gexp"] is not None:
        raise ValueError("accum_matmul: scales='promotion' takes no a_gexp/b_gexp")
    inner = f.replace(promote=None, scales="instruction")
    c = kw.pop("c")
    kw.pop("a_gexp"), kw.pop("b_gexp")
    acc = (torch.zeros((*batch, M, N), dtype=torch.float32, device=a.device) if c is None
           else c.float().to(a.device).expand(*batch, M, N).clone())  # (-0.0 kept, as _reference)
    nb = K // blk
    xa, xb = a.expand(*batch, M, K), b.expand(*batch, K, N)
    ea, eb = _operand_emin(a, kw["a_emin"]), _operand_emin(b, kw["b_emin"])
    if isinstance(ea, torch.Tensor):
        ea = ea.expand(*batch, M, K)
    if isinstance(eb, torch.Tensor):
        eb = eb.expand(*batch, K, N)

    def cut(x, lo, hi, kdim):  # the K-slice lo:hi of an operand or of its clamps
        return x.narrow(kdim, lo, hi - lo) if isinstance(x, torch.Tensor) else x

    def split_a(x):  # (..., M, nb * blk) -> (..., nb, M, blk)
        return x.unflatten(-1, (nb, blk)).movedim(-2, -3) if isinstance(x, torch.Tensor) else x

    def split_b(x):  # (..., nb * blk, N) -> (..., nb, blk, N)
        return x.unflatten(-2, (nb, blk)) if isinstance(x, torch.Tensor) else x

    parts = []
    if nb:  # every full interval in one batched call: (..., nb, M, N)
        parts.append(fn(split_a(cut(xa, 0, nb * blk, -1)), split_b(cut(xb, 0, nb * blk, -2)),
                        inner, a_emin=split_a(cut(ea, 0, nb * blk, -1)),
                        b_emin=split_b(cut(eb, 0, nb * blk, -2))))
    if K > nb * blk:  # the last, shorter interval
        parts.append(fn(cut(xa, nb * blk, K, -1), cut(xb, nb * blk, K, -2), inner,
                        a_emin=cut(ea, nb * blk, K, -1),
                        b_emin=cut(eb, nb * blk, K, -2)).unsqueeze(-3))
    if parts:
        P = torch.cat(parts, -3) if len(parts) > 1 else parts[0]
        for kb in range(want):
            s = (sa[..., :, kb, None].double() * sb[..., kb, None, :].double()).float()
            acc = _fma_f32(s, P[..., kb, :, :], acc)
    return torch.where(torch.isnan(acc), math.nan, acc)


def _block_shift(ad, bd, blk, nb):
    """Per K-block exponents d (int64, (nb,)): a * 2^-d and b * 2^d keep every product, and
    their exponents' sums, the alignment; chosen (0 where it already fits) to bring both
    operands of a block into float32's normal range, which E8M0 scales at the ends of theirs
    leave (2^127 on a, 2^-127 on b: a's dequantized values overflow float32)."""
    K = ad.shape[-1]

    def ranges(x):  # (hi, lo) of the nonzero values' exponents per block of K (last dim)
        e = _exponent(x, None).reshape(-1, K)
        e = torch.nn.functional.pad(e, (0, nb * blk - K), value=_ZERO_EXP).unflatten(-1, (nb, blk))
        nz = e != _ZERO_EXP
        hi = torch.where(nz, e, -10000).amax((0, 2)) if e.numel() else torch.zeros(nb)
        lo = torch.where(nz, e, 10000).amin((0, 2)) if e.numel() else torch.zeros(nb)
        return hi.long(), lo.long()
    hi_a, lo_a = ranges(ad)
    hi_b, lo_b = ranges(bd.transpose(-1, -2))
    low = torch.maximum(hi_a - 127, -126 - lo_b)   # a below 2^128, b at or above 2^-126
    high = torch.minimum(lo_a + 126, 127 - hi_b)   # a at or above 2^-126, b below 2^128
    d = torch.clamp(torch.zeros_like(low), max=high)
    return torch.maximum(d, low)  # (no d fits both: the exactness check refuses)


def _instruction_scaled(fn, a, b, f, sa, sb, blk, kw):
    """scales='instruction': the dequantized operands with the scales' exponents in the
    alignment (group exponents, or the elements' clamps plus power-of-two scale exponents)."""
    K = a.shape[-1]
    # a NaN scale (E8M0's NaN code): the hardware's products of its block are NaN, whatever
    # the elements; the other outputs are computed with a scale of 1 in its place
    nan_a, nan_b = torch.isnan(sa), torch.isnan(sb)
    clamp_a, clamp_b = _scale_emin(sa), _scale_emin(sb)
    sa, sb = torch.where(nan_a, 1.0, sa.double()), torch.where(nan_b, 1.0, sb.double())
    nb = sa.shape[-1]
    ra = sa.repeat_interleave(blk, -1)[..., :K]
    rb = sb.repeat_interleave(blk, -2)[..., :K, :]
    ad, bd = a.double() * ra, b.double() * rb
    d = _block_shift(ad, bd, blk, nb) if K else torch.zeros(nb, dtype=torch.int64)
    if bool((d != 0).any()):
        ad = ad * _pow2(-d).repeat_interleave(blk)[:K]
        bd = bd * _pow2(d).repeat_interleave(blk)[:K, None]
    a32, b32 = ad.float(), bd.float()
    if not (torch.equal(a32.double(), ad) and torch.equal(b32.double(), bd)):
        raise ValueError("accum_matmul: scales='instruction' needs elements * scales exact in "
                         "float32 (block-scaled formats' elements and scales are)")
    kw = dict(kw)
    ea, eb = _exponent(sa, clamp_a), _exponent(sb, clamp_b)
    pow2_scales = torch.equal(_pow2(ea), sa) and torch.equal(_pow2(eb), sb)
    ea, eb = ea - d, eb + d[:, None]  # (the shifted operands' scales)
    if f.group > 1:
        if kw["a_gexp"] is not None or kw["b_gexp"] is not None:
            raise ValueError("accum_matmul: give the scales or the group exponents, not both")
        if blk % f.group:
            raise ValueError(f"accum_matmul: a scale block ({blk} K-elements) must hold whole "
                             f"groups of {f.group}")
        G = -(-K // f.group)
        kw["a_gexp"] = ea.repeat_interleave(blk // f.group, -1)[..., :G]
        kw["b_gexp"] = eb.repeat_interleave(blk // f.group, -2)[..., :G, :]
    else:  # an element's clamp moves by its block's scale exponent (MMA-Sim's MMA_ST_FDPA)
        if not pow2_scales:
            raise ValueError("accum_matmul: scales='instruction' without groups takes "
                             "power-of-two (E8M0) scales, as tcgen05 kind::mxf8f6f4")
        em_a = _operand_emin(a, kw["a_emin"])
        em_b = _operand_emin(b, kw["b_emin"])
        kw["a_emin"] = em_a + ea.repeat_interleave(blk, -1)[..., :K]
        kw["b_emin"] = em_b + eb.repeat_interleave(blk, -2)[..., :K, :]
    out = fn(a32, b32, f, **kw)
    nan = nan_a.any(-1)[..., :, None] | nan_b.any(-2)[..., None, :]
    return torch.where(nan, math.nan, out) if bool(nan.any()) else out


