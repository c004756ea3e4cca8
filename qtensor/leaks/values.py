"""Values: is a QTensor's payload representable in its format?"""
from __future__ import annotations

import torch

from ..tensor import dispatch
from ..formats.block import BlockFormat
from ..formats.base import Format
from ..kernels.ops import quantize
from ..tensor.subclass import QTensor
from .tensors import FLOAT_DTYPES, is_float, named_tensors

_INT_VIEW = {torch.float64: torch.int64, torch.float32: torch.int32,
             torch.float16: torch.int16, torch.bfloat16: torch.int16}


def same_bits(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    a, b = a.contiguous(), b.contiguous()
    same = a.view(_INT_VIEW[a.dtype]) == b.view(_INT_VIEW[b.dtype])
    return same | (torch.isnan(a) & torch.isnan(b))


def sig_bits_and_quantum(x: torch.Tensor):
    """For float32 x (finite): number of significant bits, and exponent of the lowest set bit."""
    bits = x.view(torch.int32) & 0x7FFFFFFF
    e = bits >> 23
    m = bits & 0x7FFFFF
    sig = torch.where(e > 0, m | 0x800000, m)
    low = sig & (-sig)
    ctz = torch.frexp(low.to(torch.float64)).exponent - 1
    bitlen = torch.frexp(sig.to(torch.float64)).exponent
    nsig = bitlen - ctz
    quantum = torch.where(e > 0, e, torch.ones_like(e)) - 150 + ctz
    return nsig, quantum


def block_elements_ok(x: torch.Tensor, fmt: BlockFormat) -> torch.Tensor:
    """Element-wise necessary condition for a value of a block format, whatever the blocking:
    an element of ``fmt.elem`` times a scale (finite or NaN, within max, few enough
    significant bits, no bit below the smallest quantum)."""
    x32 = x.to(torch.float32)
    ok = x32.to(x.dtype) == x if x.dtype == torch.float64 else torch.ones_like(x32, dtype=torch.bool)
    nan = torch.isnan(x32)
    finite = torch.isfinite(x32)
    ok = ok & (nan | finite)
    if fmt.tensor_scale:  # a float32 per-tensor scale: any float32 significand can occur
        return ok | nan
    ok = ok & (nan | (x32.abs() <= fmt.max))
    allowed = fmt.elem.significant_bits
    if not fmt.power_of_two_scales:  # the scale has significant bits of its own
        allowed += fmt.amax_scale_format.man + 1
    nz = finite & (x32 != 0)
    nsig, quantum = sig_bits_and_quantum(torch.where(nz, x32, torch.ones_like(x32)))
    ok = ok & (~nz | ((nsig <= allowed) & (quantum >= fmt.min_quantum_exp)))
    return ok | nan


def unrepresentable(payload: torch.Tensor, fmt: Format, aligned: bool = True):
    """None if every value of payload is in fmt, else (count, first index, value, nearest).

    A block format's quantize is idempotent (docs/formats.md), so a payload whose blocks are the
    format's own (``aligned`` and not a view) is in format exactly when quantizing it changes
    nothing; a view (a slice, a reshape) may have shifted the blocks: each element is judged."""
    if payload.numel() == 0 or payload.dtype not in FLOAT_DTYPES:
        return None
    p = payload.detach()
    f = dispatch.fit_format(fmt, p.dim())
    q = quantize(p, f, rounding="nearest")
    if torch.equal(p, q):  # the common case, one pass (NaN needs the bit comparison below)
        return None
    ok = same_bits(p, q)
    if bool(ok.all()):
        return None
    if fmt.is_block and (not aligned or p._is_view()):
        # the blocks may not line up any more (slices, reshapes): judge each element
        ok = block_elements_ok(p, fmt)
        if bool(ok.all()):
            return None
    bad = (~ok).reshape(-1)
    i = int(bad.nonzero()[0, 0])
    return int(bad.sum()), i, p.reshape(-1)[i].item(), q.reshape(-1)[i].item()


def sparse_in_format(t: torch.Tensor, fmts) -> bool:
    """A sparse tensor cannot be a QTensor (nn.Embedding(sparse=True)'s gradient): it counts as
    in format when its stored values are representable in each of ``fmts``."""
    if not t.is_sparse or not fmts:
        return False
    values = t._values()
    return all(unrepresentable(values, f, aligned=False) is None for f in fmts)


def moves_checked_values(func, args, kwargs, outs, checked) -> bool:
    """A data-movement op whose inputs are all checked QTensors of the outputs' format (no
    plain floating input): its outputs hold those values, they need no second check."""
    rule = dispatch.rule_of(func)
    if rule.kind != dispatch.MOVE_KIND or rule.mutated or func._opname in dispatch.MOVE_IF:
        return False  # (ops that move only under a condition may round: check them)
    fmt = outs[0][1].fmt
    for _, t in named_tensors(args, kwargs, None):
        if isinstance(t, QTensor):
            if not same_format(t.fmt, fmt) or t.is_inference() or \
                    checked.get(t) != (t._version, t.payload._version):
                return False
        elif is_float(t):
            return False
    return all(same_format(t.fmt, fmt) for _, t in outs)


def same_format(a: Format, b: Format) -> bool:
    """Equal formats; block formats compare without their axis (it follows transposes)."""
    if a == b:
        return True
    if a.is_block and b.is_block:
        return a.replace(axis=-1) == b.replace(axis=-1)  # (2D blocks need an axis)
    return False


