"""The reference datapath: the model of an MMA datapath in PyTorch float64, vectorized over
(batch, M, N), a loop over chunks (docs/accum.md); the kernels give its bits."""
from __future__ import annotations

import math

import torch

from .exponents import _ZERO_EXP, _check_operands, _exponent, _group_exps, _operand_emin, _pow2
from .format import AccumFormat
from .scaled import _scaled

def _round(x: torch.Tensor, mode: str) -> torch.Tensor:
    if mode == "toward_zero":
        return torch.trunc(x)
    if mode == "floor":
        return torch.floor(x)
    return torch.round(x)  # ties to even


def _to_acc(v: torch.Tensor, f: AccumFormat) -> torch.Tensor:
    """Step 4: the exact float64 value v rounded to the accumulator format (float64 out)."""
    q = _pow2(_exponent(v, f.acc_emin).clamp(min=f.acc_emin) - f.acc_man)
    r = _round(v / q, f.acc_rounding) * q + 0.0  # + 0.0: a zero result is +0
    return torch.where(r.abs() >= 2.0 ** (f.acc_emax + 1), r.sign() * math.inf, r)


def _nonfinite(t: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """The IEEE result of a chunk with a non-finite term (t: terms along dim -2, p: partial)."""
    nan = torch.isnan(t).any(-2) | torch.isnan(p)
    pos = (t == math.inf).any(-2) | (p == math.inf)
    neg = (t == -math.inf).any(-2) | (p == -math.inf)
    out = torch.where(pos, math.inf, -math.inf)
    return torch.where(nan | (pos & neg), math.nan, out).to(t.dtype)


def _trunc_fuse(t, et, F):
    """MMA-Sim's truncated fused sum of the nonzero terms t (dim -2) at alignment exponents et:
    (the integer sum of trunc(t * 2^(F - emax)), emax); emax -999 where all are zero."""
    et = torch.where(t == 0, -999, et)
    if et.shape[-2] == 0:  # an empty half (a last chunk of one K-element): its slots are zeros
        return t.sum(-2), torch.full(t.sum(-2).shape, -999, dtype=torch.int64, device=t.device)
    emax = et.amax(-2)  # (all zero, -999: the zeros scaled by 2^1023 at most)
    return torch.trunc(t * _pow2((F - emax).clamp(max=1023))[..., None, :]).sum(-2), emax


def _cdna3_chunk(a, b, ea, eb, p, f):
    """One CDNA3 MFMA step (stages ``cdna3``/``cdna3_fp8``): the new partial from the chunk's
    operands a (..., M, k), b (..., k, N) (float64, alignment exponents ea, eb) and p."""
    F, F2 = f.frac_bits, 31
    t = a[..., :, :, None] * b[..., None, :, :]
    et = ea[..., :, :, None] + eb[..., None, :, :]
    if f.stages == "cdna3":  # a product of 2^128 or more (its significand in [1, 4)) is inf
        over = (et + (t.abs() >= _pow2(et + 1)).long()) >= 128
        t = torch.where(over & torch.isfinite(t), t.sign() * math.inf, t)
    tbad = ~torch.isfinite(t).all(-2)
    pbad = ~torch.isfinite(p)
    tf = torch.where(torch.isfinite(t), t, 0.0)
    if f.stages == "cdna3":
        D, ed = _trunc_fuse(tf, et, F)  # the products' sum: D * 2^(ed - F)
    else:  # two interleaved halves, each fused, then added at F bits of the larger exponent
        De, ee = _trunc_fuse(tf[..., 0::2, :], et[..., 0::2, :], F)
        Do, eo = _trunc_fuse(tf[..., 1::2, :], et[..., 1::2, :], F)
        ed = torch.maximum(ee, eo)  # (an all-zero half, -999: its 0 scaled by 2^-1022 at least)
        D = (torch.floor(De * _pow2((ee - ed).clamp(min=-1022)))
             + torch.floor(Do * _pow2((eo - ed).clamp(min=-1022))))
    pf = torch.where(pbad, 0.0, p)
    ec = torch.where(pf == 0, -126, _exponent(pf, -126))
    ec = torch.where(pbad, -1, ec)  # an inf/NaN partial aligns at -1 (frexp's exponent 0)
    em = torch.maximum(ed, ec)
    if f.stages == "cdna3_fp8":  # a partial 25 or more binades below the products is dropped,
        pbad = pbad & ~(ec < em - F - 1)  # an inf/NaN one too (as MMA-Sim's MMA_GTR_FDPA)
    bad = tbad | pbad
    sd = torch.floor(D * _pow2((ed - F).clamp(min=-1022)) * _pow2(F2 + 1 - em))  # at 2^(em - 32)
    sc = torch.floor(pf * _pow2(F - em))                      # at 2^(em - F)
    if f.stages == "cdna3_fp8":
        sc = torch.where(ec < em - F - 1, 0.0, sc)
    v = sd * _pow2(em - F2 - 1) + sc * _pow2(em - F)
    ev = torch.where(v == 0, 0, _exponent(v, -126))
    r = torch.floor(v * _pow2(F2 - ev)) * _pow2(ev - F2)
    # to nearest FP32 (inf from 2^128); a negative value below its grid gives -0.0, as the MFMA
    new = r.float().double()
    return torch.where(bad, _nonfinite(t, torch.where(pbad, p, 0.0)), new)



def _reference(a, b, f: AccumFormat, *, a_emin=None, b_emin=None, a_gexp=None, b_gexp=None,
               c=None, a_scale=None, b_scale=None, block_size=None) -> torch.Tensor:
    """accum_matmul_reference after its operands' formats are resolved (_entry)."""
    _check_operands(a, b, "accum_matmul_reference")
    if a_scale is not None or b_scale is not None:
        return _scaled(_reference, a, b, f, a_scale, b_scale,
                       dict(a_emin=a_emin, b_emin=b_emin, a_gexp=a_gexp, b_gexp=b_gexp, c=c),
                       block_size)
    a_emin, b_emin = _operand_emin(a, a_emin), _operand_emin(b, b_emin)
    batch = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    M, K, N = a.shape[-2], a.shape[-1], b.shape[-1]
    G = -(-K // f.group)
    if (a_gexp is None) != (b_gexp is None) or (a_gexp is not None and f.group == 1):
        raise ValueError("accum_matmul: a_gexp and b_gexp go together, with a group format")
    a_gexp = _group_exps(a_gexp, (*batch, M, G), "a_gexp")
    b_gexp = _group_exps(b_gexp, (*batch, G, N), "b_gexp")
    a = a.float().expand(*batch, M, K).double()
    b = b.float().expand(*batch, K, N).double()
    if isinstance(a_emin, torch.Tensor):
        a_emin = a_emin.expand(*batch, M, K)
    if isinstance(b_emin, torch.Tensor):
        b_emin = b_emin.expand(*batch, K, N)
    ea = _exponent(a, a_emin)
    eb = _exponent(b, b_emin)
    shape = (*batch, M, N)
    acc = torch.zeros(shape, dtype=torch.float32, device=a.device)   # the FP32 accumulator
    if c is None:  # the instruction partial
        p = torch.zeros(shape, dtype=torch.float64, device=a.device)
    else:  # c itself, -0.0 included: it is K == 0's output (MMA-Sim's dpa returns C)
        p = c.float().double().to(a.device).expand(shape).clone()
    F = f.frac_bits
    ez = f.e_zero
    for ci, k0 in enumerate(range(0, K, f.chunk)):
        k1 = min(k0 + f.chunk, K)
        if f.stages != "fused":
            p = _cdna3_chunk(a[..., :, k0:k1], b[..., k0:k1, :], ea[..., :, k0:k1],
                             eb[..., k0:k1, :], p, f)
            if f.promote is not None and ((ci + 1) % f.promote == 0 or k1 == K):
                acc, p = acc + p.float(), torch.zeros_like(p)
            continue
        # 1. the exact products, (..., M, k, N), and their alignment exponents e(a) + e(b)
        t = a[..., :, k0:k1, None] * b[..., None, k0:k1, :]
        et = ea[..., :, k0:k1, None] + eb[..., None, k0:k1, :]
        zero = (t == 0).any(-2) | (k1 - k0 < f.chunk)  # a zero term (padding slots included)
        if f.group > 1:  # exact group sums (sequential float64 adds, exact for FP4 operands)
            k = k1 - k0
            g = -(-k // f.group) * f.group
            if g != k:
                t = torch.nn.functional.pad(t, (0, 0, 0, g - k))
            t = t.unflatten(-2, (g // f.group, f.group))
            allzero = (t == 0).all(-2)
            s = t[..., 0, :]
            for j in range(1, f.group):
                s = s + t[..., j, :]
            t = s
            if a_gexp is None:
                et = _exponent(t, None)
                zero = (t == 0).any(-2) | (k1 - k0 < f.chunk)
            else:
                g0 = k0 // f.group
                gn = t.shape[-2]
                et = a_gexp[..., :, g0:g0 + gn, None] + b_gexp[..., None, g0:g0 + gn, :]
                et = torch.where(allzero, _ZERO_EXP, et)
                zero = allzero.any(-2) | (k1 - k0 < f.chunk)
        finite = torch.isfinite(t).all(-2) & torch.isfinite(p)
        t = torch.where(finite[..., None, :], t, 0.0)
        # 2. emax over the nonzero terms (p included when it takes part in the alignment); zero
        # terms at e_zero
        emax = et.amax(-2)
        if f.acc_in_alignment:
            pe = torch.where(finite, p, 0.0)
            emax = torch.maximum(emax, _exponent(pe, f.acc_emin))
            zero = zero | (pe == 0)
        if ez is not None:
            emax = torch.where(zero, torch.clamp(emax, min=ez), emax)
        emax = torch.where(emax < _ZERO_EXP // 2, 0, emax)  # all terms zero: any scale will do
        # 3. each term to F fractional bits of 2^emax, rounded to an integer; 4. summed exactly
        scale = _pow2(F - emax)
        S = _round(t * scale[..., None, :], f.align_rounding).sum(-2)
        if f.acc_in_alignment:
            S = S + _round(torch.where(finite, p, 0.0) * scale, f.align_rounding)
            new = _to_acc(S * _pow2(emax - F), f)
        else:  # 5. the chunk's sum, normalized, then a float32 add into p
            new = (p.float() + _to_acc(S * _pow2(emax - F), f).float()).double()
        nonfinite = _nonfinite(
            a[..., :, k0:k1, None] * b[..., None, k0:k1, :], p)
        p = torch.where(finite, new, nonfinite)
        # 6. promotion into the FP32 accumulator
        if f.promote is not None and ((ci + 1) % f.promote == 0 or k1 == K):
            acc = acc + p.float()
            p = torch.zeros_like(p)
    out = p.float() if f.promote is None or K == 0 else acc  # K == 0: c (or 0) unchanged
    return torch.where(torch.isnan(out), math.nan, out)  # one NaN encoding


