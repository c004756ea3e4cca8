"""Block-scaled operands of QTensor contractions: their block scales (and NVFP4's tensor scales)
recovered from the rounded values, and the plan that hands them to the datapath where it applies
them (group exponents, per-element clamps, promotion scales)."""
from __future__ import annotations

from typing import Optional

import torch

from ..formats.base import Format, is_stochastic
from ..kernels import backend as _backend
from ..kernels import ops as _ops
from ..kernels.reference import scale_amax, scale_candidates, two_level_payload
from . import kernel as _kernel
from .exponents import _exponent, _pow2
from .format import AccumFormat

def _emin_of(x) -> Optional[int]:
    """The minimum normal exponent of an operand's input format (a QTensor's operand format: its
    mm_fmt, else its fmt), where it is one float format; None: from the payload's dtype."""
    fmt = getattr(x, "mm_fmt", None) or getattr(x, "fmt", None)
    if isinstance(fmt, Format) and fmt.is_float and fmt.subnormals:
        return max(min(fmt.emin, 127), -1000)
    return None


def _operand_block_fmt(q):
    """The block format an operand was rounded to (its QTensor's mm_fmt, else fmt), or None."""
    fmt = getattr(q, "mm_fmt", None) or getattr(q, "fmt", None)
    fmt = getattr(fmt, "base", fmt)  # a per-GEMM operand tag (qtensor.tensor.gemm)
    if (isinstance(fmt, Format) and fmt.is_block and fmt.block_size and fmt.elem.is_float
            and fmt.block_shape is None):  # 2D tiles: scales are not runs along K
        return fmt
    return None


def _payload_sources(q, x: torch.Tensor):
    """Where dispatch rounded the operand x from the payload of its QTensor q (q has an operand
    format, mm_fmt): the payload, or its transpose for a 2-D x (linear's weight.t()), as
    candidates of x's shape (the caller checks that rounding one gives x)."""
    data = getattr(q, "_data", None)
    if getattr(q, "mm_fmt", None) is None or not isinstance(data, torch.Tensor):
        return []
    out = [data] if data.shape == x.shape else []
    if data.dim() == 2 and data.t().shape == x.shape:
        out.append(data.t())
    return out


def _block_scales(x: torch.Tensor, fmt, kdim: int, need: str = "value", q=None):
    """The block scales of x, whose values were rounded to the block format fmt along kdim,
    recovered from the values: (X, ts), X the scale-format factor of each block (float64, x's
    shape with kdim cut into blocks), ts the per-tensor scale (a 0-dim float64 tensor; 1.0
    without tensor_scale); None where no scale, or more than one, gives x back exactly (x / (X *
    ts) elements of the element format). need: ``"value"`` (X itself is used: promotion) or
    ``"exponent"`` (only floor(log2 X): group exponents, clamps), which decides when two
    decompositions of a block are a real ambiguity.

    Each rule's scale of the rounded block, derived again from its own maximum rmax
    (docs/formats.md, idempotence; docs/accum.md lists what each rule allows):
    - floor, even: 2^(floor(log2 rmax) - emax_elem) (even's round-half-up of the max never moves
      a value of the element grid, and the quantizer settles a block on the scale of its
      rounded max), clamped to the scale format as the quantizer clamps it;
    - amax (NVFP4, FP32 scales on amax_scale_format's grid) and ceil with mantissa bits: the
      scale format's rounding of rmax / max_elem (the quantizer settles each block on it);
      NVFP4's tensor scale from the rounded tensor's maximum (max_elem * max_scale * ts);
    - ceil with power-of-two scales: the smallest 2^k with rmax / 2^k <= max_elem; a block whose
      rounded max is max_elem * 2^k came from 2^k or from 2^(k+1) (max_elem / 2 is on the
      grid, and the quantizer keeps the scale of the unrounded max): two candidates;
    - 4over6: the amax-rule scales mapping rmax to 6 and to 4: two candidates.
    Of two candidates the one whose elements are exact is the scale; where both are (a block of
    elements on both grids) and they differ in what ``need`` uses, the block is ambiguous: None;
    except for ceil, where q (x's QTensor) gives the payload x was rounded from and rounding it
    again gives x: then the scale of its unrounded blocks, the quantizer's own.
    """
    compiling = torch.compiler.is_compiling()  # no data-dependent branch in a graph
    if fmt is None or x.numel() == 0:
        return None
    if fmt.tensor_scale:
        # values fl32(e * X * s): s the tensor scale the QTensor carries (else TE's of x's
        # amax); the block scales are those of the payloads e * X, a one-level format's values
        s = _two_level_scale(x, fmt, q)
        got = None if compiling else _two_level_source_scales(x, fmt, kdim, s, q)
        if got is not None:
            return got
        p = _unscaled(x, s, fmt)
        if fmt.scale_rule == "amax" and not fmt.settle and not compiling:
            got = _te_block_scales(p, fmt, kdim)
        else:
            got = _block_scales(p, fmt.replace(tensor_scale=False, settle=False), kdim, need)
        return None if got is None else (got[0], s.double())
    bs = fmt.block_size
    d = kdim % x.dim()
    xk = x.float()
    K = xk.shape[d]
    if K % bs:
        xk = torch.nn.functional.pad(xk, (0, 0) * (x.dim() - 1 - d) + (0, -K % bs))
    # in x's own layout (a reduction over a middle dim runs in vectors; no copy of x)
    blocks = xk.unflatten(d, (-1, bs))
    r = d + 1  # the dim of a block's elements
    amax = scale_amax(blocks, fmt, r, False)  # exact (float32 values), as the rule reads it
    if not compiling and not torch.isfinite(amax).all():  # inf or NaN in some block
        return None
    ts = torch.ones((), dtype=torch.float64, device=x.device)
    cands = [c(amax) for c in scale_candidates(fmt)]
    if fmt.scale_rule == "ceil" and fmt.power_of_two_scales:  # rmax = max_elem * 2^k
        X = cands[0]
        cands.append(torch.where((amax == fmt.elem.max * X) & (X < 2.0 ** fmt.scale.emax),
                                 2 * X, X))
    cands = [torch.where(amax == 0, 1.0, X) for X in cands]  # all-zero block: any scale
    if compiling and len(cands) == 1:  # (no data-dependent branch in a graph: unchecked)
        return cands[0], ts
    if compiling and fmt.scale_rule == "ceil":  # RCEIL's ambiguity needs a branch: values
        return None

    def exact(X, per_block):  # the elements x / Xt round to themselves, e * Xt is exact
        Xt = (X * ts).float().unsqueeze(r)
        pos = Xt > 0  # (a candidate's scale can round to 0: not a scale of a nonzero block)
        if not per_block:
            if not bool(pos.all()):
                return False
            inv = fmt.power_of_two_scales  # (1 / 2^k: exact in float32 for E8M0's range)
            e = _ops.quantize(blocks * (1 / Xt) if inv else blocks / Xt, fmt.elem,
                              rounding="nearest")
            return torch.equal(e * Xt, blocks)
        e = _ops.quantize(blocks / torch.where(pos, Xt, 1.0), fmt.elem, rounding="nearest")
        return ((e * Xt == blocks) & pos).all(r)
    if len(cands) == 1:
        return (cands[0], ts) if exact(cands[0], False) else None
    (X1, X2) = cands
    v1, v2 = exact(X1, True), exact(X2, True)
    if compiling:  # 4over6 in a graph: the exact candidate per block (ties: the first, 6)
        return torch.where(v1, X1, X2), ts
    same = (_exponent(X1, None) == _exponent(X2, None)) if need == "exponent" else X1 == X2
    if not bool((v1 | v2).all()) or bool((v1 & v2 & ~same).any()):
        if fmt.scale_rule != "ceil" or is_stochastic(fmt.rounding):
            return None
        for src in _payload_sources(q, x):  # RCEIL: the unrounded payload decides
            if torch.equal(_ops.quantize(src, fmt.replace(axis=d)), x):
                s = src.float()
                if K % bs:
                    s = torch.nn.functional.pad(s, (0, 0) * (x.dim() - 1 - d) + (0, -K % bs))
                X = scale_candidates(fmt)[0](s.unflatten(d, (-1, bs)).abs().amax(r).double())
                return (X, ts) if exact(X, False) else None
        return None
    return torch.where(v1, X1, X2), ts


def _two_level_source_scales(x, fmt, kdim: int, s, q):
    """The block scales TE's rule gave x where dispatch rounded x from its QTensor q's payload
    (deterministic rounding): that payload rounded again under the same tensor scale, with its
    scales; None where no payload gives x. (From the values alone a coarse subnormal block scale
    can be ambiguous: ceil's 3 x 2q and 6 x q are one block.)"""
    if is_stochastic(fmt.rounding):
        return None
    d = kdim % x.dim()
    for src in _payload_sources(q, x):
        v, s2, X = _backend.two_level(src.detach().float(), fmt.replace(axis=d), fmt.rounding, 0,
                                   tensor_scale=s, block_scales=True)
        if torch.equal(v.view(torch.int32), x.detach().float().view(torch.int32)):
            X = torch.where(X == 0, 1.0, X)[..., 0].movedim(-1, d)  # all-zero block: any scale
            return X.double(), s.double()
    return None


def _positive_values(f) -> list:
    """The positive values of a FloatFormat, largest first."""
    out = {k / 2 ** f.man * 2.0 ** f.emin for k in range(1, 2 ** f.man)} if f.subnormals else set()
    for e in range(f.emin, f.emax + 1):
        out |= {(1 + k / 2 ** f.man) * 2.0 ** e for k in range(2 ** f.man)}
    return sorted((v for v in out if v <= f.max), reverse=True)


def _te_block_scales(p: torch.Tensor, fmt, kdim: int):
    """The E4M3 block scales (float64, one per block along kdim) of payloads p = e * X of
    Transformer Engine's two-level rule (nearest, not settled), or None where no scale gives a
    block back. TE's X rounds amax / 6 (under the tensor scale) to nearest: in the normal range
    the block's max element is then 6, but a subnormal X is coarse and the max element can be
    4 or 3 (X = 2 or 1 subnormal quanta), so X is pmax / e for the largest element value e
    that gives a scale-format value whose block elements are exact (no two such candidates
    exist for TE's nearest scales: pmax / 6 is never a subnormal quantum's multiple then)."""
    bs = fmt.block_size
    d = kdim % p.dim()
    K = p.shape[d]
    if K % bs:
        p = torch.nn.functional.pad(p, (0, 0) * (p.dim() - 1 - d) + (0, -K % bs))
    blocks = p.float().unflatten(d, (-1, bs))
    r = d + 1
    pmax = blocks.abs().amax(r)
    if not bool(torch.isfinite(pmax).all()):
        return None
    sf = fmt.amax_scale_format.replace(rounding="nearest", saturate=True)
    X = torch.where(pmax == 0, 1.0, 0.0)
    found = pmax == 0
    for e in _positive_values(fmt.elem):
        Xc = pmax / e
        ok = ~found & (Xc > 0) & (_ops.quantize(Xc, sf) == Xc)
        if not bool(ok.any()):
            continue
        Xt = torch.where(ok, Xc, 1.0).unsqueeze(r)
        el = _ops.quantize(blocks / Xt, fmt.elem, rounding="nearest")
        ok &= (el * Xt == blocks).all(r)
        X = torch.where(ok, Xc, X)
        found |= ok
        if bool(found.all()):
            return X.double(), torch.ones((), dtype=torch.float64, device=p.device)
    return None


def _two_level_scale(x: torch.Tensor, fmt, q=None) -> torch.Tensor:
    """The FP32 decode tensor scale of x's values in the two-level format fmt: the one the
    QTensor q carries, else Transformer Engine's from x's amax (0-dim float32)."""
    if q is not None and getattr(q, "fmt", None) == fmt and q.tensor_scale is not None:
        return q.tensor_scale.to(x.device)
    return _ops.quantize_with_scale(x.detach().float(), fmt)[1]


def _unscaled(x: torch.Tensor, s: torch.Tensor, fmt) -> torch.Tensor:
    """x's values without the tensor scale s: the payloads e * X of a two-level format (float32
    exactly; x / s in float32 is not, s being any FP32), x itself (float32) otherwise."""
    if not fmt.tensor_scale:
        return x.float()
    return two_level_payload(x.float(), s, fmt).float()


def _scale_exps(X: torch.Tensor, fmt) -> torch.Tensor:
    """floor(log2 X) of block scales X in the scale format of fmt (a subnormal scale at the
    format's minimum normal exponent, as MMA-Sim's nvf4 takes E4M3 subnormal scales at -6)."""
    return _exponent(X, fmt.scale.emin if fmt.scale.subnormals else None)


def _per_element(X: torch.Tensor, bs: int, kdim: int, K: int) -> torch.Tensor:
    """Per-block values X repeated over their blocks' elements along kdim (K of them)."""
    return X.repeat_interleave(bs, kdim).narrow(kdim, 0, K)


def _mx_emin(x: torch.Tensor, q, kdim: int):
    """Per-element clamps of an MX operand (the element format's minimum normal exponent plus
    the block's scale exponent) where one of its elements is subnormal in its format, else None
    (then its float32 exponents are already the hardware's: no clamp binds)."""
    fmt = _operand_block_fmt(q)
    if fmt is None or not fmt.power_of_two_scales:
        return None
    sc = _block_scales(x, fmt, kdim, "exponent", q)
    if sc is None:
        return None
    E = _scale_exps(sc[0], fmt) + fmt.elem.emin  # per block
    d, bs = kdim % x.dim(), fmt.block_size
    if not torch.compiler.is_compiling():  # (no data-dependent branch in a graph)
        # a subnormal element: 0 < |x| < 2^E, tested per block (float32: 2^E >= 2^-149)
        xk = x.float()
        if xk.shape[d] % bs:
            xk = torch.nn.functional.pad(xk, (0, 0) * (x.dim() - 1 - d) + (0, -xk.shape[d] % bs))
        blocks = xk.unflatten(d, (-1, bs)).abs()
        if not ((blocks < _pow2(E).float().unsqueeze(d + 1)) & (blocks != 0)).any():
            return None
    return _per_element(E, bs, d, x.shape[d])


def _scale_plan(f: AccumFormat, a, qa, b, qb, a_kdim=-1, b_kdim=-2):
    """How the block scales of the operands a, b (rounded to the block formats of the QTensors
    qa, qb along their K dims) reach accum_matmul, where the datapath applies them: (a, b, kw,
    post), accum_matmul(a, b, f, **kw) * post (post: None, or the float32 product of the two
    per-tensor scales, cuBLASLt's alpha).
    - scales="instruction" with groups (blackwell_mxfp4/nvfp4) and both operands block-scaled
      (MX or NVFP4, blocks a multiple of the group): the group exponents of the scales
      (a_gexp/b_gexp); NVFP4's per-tensor scales are divided out of the operands (exactly) and
      multiplied into the result (post), as the hardware takes the E4M3 block scales only;
    - scales="instruction" without groups (blackwell_mxf8f6f4): per-element clamps of MX
      operands (a_emin/b_emin), where a subnormal element makes them bind;
    - scales="promotion" (Hopper FP8 per-block scaling) with both operands' blocks equal to the
      promotion interval (chunk * promote): the elements and their block scales (times the
      tensor scale) as a_scale/b_scale;
    else none: the values carry their scales (each group aligned at its own sum's exponent)."""
    kw, post = {}, None
    fa, fb = _operand_block_fmt(qa), _operand_block_fmt(qb)
    if f.scales == "instruction" and f.group == 1:
        ea, eb = _mx_emin(a, qa, a_kdim), _mx_emin(b, qb, b_kdim)
        if ea is not None:
            kw["a_emin"] = ea
        if eb is not None:
            kw["b_emin"] = eb
        return a, b, kw, post
    if fa is None or fb is None:
        return a, b, kw, post
    if f.scales == "instruction":
        if fa.block_size % f.group or fb.block_size % f.group:
            return a, b, kw, post
        sa = _block_scales(a, fa, a_kdim, "exponent", qa)
        sb = _block_scales(b, fb, b_kdim, "exponent", qb) if sa is not None else None
        if sb is None:
            return a, b, kw, post
        G = -(-a.shape[a_kdim] // f.group)
        kw["a_gexp"] = _scale_exps(sa[0], fa).repeat_interleave(
            fa.block_size // f.group, a_kdim).narrow(a_kdim, 0, G)
        kw["b_gexp"] = _scale_exps(sb[0], fb).repeat_interleave(
            fb.block_size // f.group, b_kdim).narrow(b_kdim, 0, G)
        if fa.tensor_scale or fb.tensor_scale:  # the tensor scales in the epilogue (alpha)
            a, b = _unscaled(a, sa[1], fa), _unscaled(b, sb[1], fb)
            post = sa[1].float() * sb[1].float()
        return a, b, kw, post
    if f.scales == "promotion":
        blk = f.chunk * f.promote
        if fa.block_size != blk or fb.block_size != blk:
            return a, b, kw, post
        sa, sb = _block_scales(a, fa, a_kdim, "value", qa), _block_scales(b, fb, b_kdim,
                                                                        "value", qb)
        if sa is None or sb is None:
            return a, b, kw, post
        Xa, Xb = sa[0], sb[0]
        if fa.tensor_scale or fb.tensor_scale:  # the tensor scales in the epilogue (alpha)
            post = sa[1].float() * sb[1].float()
        K = a.shape[a_kdim]
        # (float32 division: exact, the quotients are the elements)
        a = _unscaled(a, sa[1], fa) / _per_element(Xa.float(), blk, a_kdim % a.dim(), K)
        b = _unscaled(b, sb[1], fb) / _per_element(Xb.float(), blk, b_kdim % b.dim(), K)
        kw = dict(a_scale=Xa.float(), b_scale=Xb.float(), a_emin=fa.elem.emin,
                  b_emin=fb.elem.emin)
    return a, b, kw, post


def _gexps(f: AccumFormat, a, qa, b, qb, a_kdim=-1, b_kdim=-2) -> dict:
    """The accum_matmul keywords of _scale_plan where it leaves the operands as they are."""
    _, _, kw, post = _scale_plan(f, a, qa, b, qb, a_kdim, b_kdim)
    return kw if post is None and "a_scale" not in kw else {}


def _block_matmul(a, qa, b, qb, f: AccumFormat, kw: dict, fn=None, op=None) -> torch.Tensor:
    """fn(a, b, f, **kw) (fn: _matmul, the default, or _reference) with the operands' block
    scales where f applies them (_scale_plan; a is (..., M, K), b (..., K, N)). op (a public
    entry's name): refuse where a group preset gets no group exponents from the formats."""
    a2, b2, extra, post = _scale_plan(f, a, qa, b, qb)
    if op is not None and f.group > 1 and "a_gexp" not in extra:
        raise ValueError(
            f"{op}: {f.name or f} aligns each group of {f.group} products at its block scales' "
            f"exponents, which these operands do not give (both must be block-scaled along K, "
            f"blocks a multiple of {f.group}, each block's scale recoverable from its values): "
            f"a_fmt={_operand_block_fmt(qa)}, b_fmt={_operand_block_fmt(qb)}; pass the "
            f"elements with a_scale/b_scale instead")
    if "a_scale" in extra or post is not None:
        kw = {k: v for k, v in kw.items() if k not in ("a_emin", "b_emin")}
        if post is not None and kw.get("c") is not None:
            # the datapath sums unscaled products, alpha = post scales its result: an initial
            # accumulator C enters as fp32(C / alpha), so that alpha * D is C + A @ B
            kw["c"] = kw["c"].float() / post
    out = (fn or _kernel._matmul)(a2, b2, f, **{**kw, **extra})
    return out if post is None else out * post


