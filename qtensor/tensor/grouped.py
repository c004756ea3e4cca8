"""Grouped GEMMs as contractions: ``torch._grouped_mm`` / ``F.grouped_mm`` (the experts of
mixture-of-experts layers) and transformers' ``grouped_mm_fallback`` ops on QTensors.

A grouped GEMM is one matrix product per group (expert). Each group's operands are rounded to
their operand formats along that group's K, by themselves: blocks, 2D tiles, per-tensor scales
and transforms never reach across a group's boundary, as a loop over the experts of converted
``nn.Linear`` layers rounds each expert's input and weight. Per-GEMM formats (``Recipe.gemm``'s
tags, qtensor.tensor.gemm) and the accumulator (qtensor.accum) apply per group; each group is one ``mm``
on the rounded payloads, the bits of that loop. The layouts of ``torch._grouped_mm``:

- 2D x 3D with offs: A (M, K) split along M, B (G, K, N): out (M, N) (the forward; dgrad);
- 3D x 3D, no offs: A (G, M, K), B (G, K, N): out (G, M, N);
- 2D x 2D with offs: A (M, Ktot), B (Ktot, N) split along K: out (G, M, N) (wgrad);
- 3D x 2D with offs: A (G, M, K), B (K, Ntot) split along N: out (M, Ntot).

Rows (or columns) past ``offs[-1]`` belong to no group; torch leaves them uninitialized, here
they are zero. The per-group work is one custom op (``qtensor_dispatch::grouped_mm``) whose fake
implementation gives only the shape, so torch.compile traces a grouped GEMM without its
data-dependent group sizes; eager runs the same op. Details: docs/moe.md.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..accum import lowering as _accum
from . import dispatch as _dispatch
from . import gemm as _gemm
from .subclass import QTensor

__all__ = ["grouped_mm", "PACKETS"]

# the aten and transformers op packets handled here (their dispatch rules: qtensor.tensor.dispatch)
PACKETS = ("_grouped_mm", "grouped_mm_fallback", "grouped_mm_fallback_backward")

# What each group's operands are rounded to, by the key the custom op gets (an int: the op's
# schema holds no Python objects): (A's operand format, B's, transform along K, accumulator,
# A's value format, B's). Entries live for the process; a model has a handful.
_SPECS: list = []
_SPEC_KEYS: dict = {}


def _spec_key(spec: tuple) -> int:
    ids = tuple(id(s) for s in spec)
    hit = _SPEC_KEYS.get(ids)
    if hit is None:
        _SPECS.append(spec)  # (kept alive: the ids stay theirs)
        hit = _SPEC_KEYS[ids] = len(_SPECS) - 1
    return hit


def _layout_error(msg: str) -> ValueError:
    return ValueError(f"grouped_mm: {msg}")


def _check_shapes(a, b, offs) -> None:
    """The shape checks of torch._grouped_mm, as precise errors (they need no values)."""
    if a.dim() not in (2, 3) or b.dim() not in (2, 3):
        raise _layout_error(f"operands must be 2D or 3D, got {tuple(a.shape)} and "
                            f"{tuple(b.shape)}")
    jagged = a.dim() == 2 or b.dim() == 2
    if jagged and offs is None:
        raise _layout_error(f"a 2D operand ({tuple(a.shape)} x {tuple(b.shape)}) is split into "
                            "groups by offs; pass offs (int32, one end offset per group)")
    if not jagged and offs is not None:
        raise _layout_error(f"3D x 3D operands ({tuple(a.shape)} x {tuple(b.shape)}) are one "
                            "group per batch entry: offs must be None")
    if offs is not None:
        if offs.dtype != torch.int32:
            raise TypeError(f"grouped_mm: offs must be int32, got {offs.dtype}")
        if offs.dim() != 1:
            raise _layout_error(f"offs must be 1D (one end offset per group), got shape "
                                f"{tuple(offs.shape)}")
    ka = a.shape[-1]
    kb = b.shape[-2] if b.dim() == 3 else b.shape[0]
    if ka != kb:
        raise _layout_error(f"the operands' K differ: {tuple(a.shape)} x {tuple(b.shape)}")
    if a.dim() == 3 and b.dim() == 3 and a.shape[0] != b.shape[0]:
        raise _layout_error(f"3D x 3D operands must have as many groups: {tuple(a.shape)} x "
                            f"{tuple(b.shape)}")
    groups = b.shape[0] if (a.dim(), b.dim()) == (2, 3) else a.shape[0]
    if offs is not None and (a.dim(), b.dim()) != (2, 2) and offs.shape[0] != groups:
        raise _layout_error(f"offs has {offs.shape[0]} entries for {groups} groups (experts) of "
                            f"the 3D operand {tuple((b if b.dim() == 3 else a).shape)}")


def _out_shape(a, b, offs):
    if a.dim() == 2 and b.dim() == 3:
        return (a.shape[0], b.shape[-1])
    if a.dim() == 3 and b.dim() == 3:
        return (a.shape[0], a.shape[1], b.shape[-1])
    if a.dim() == 2:  # 2D x 2D: one product per group of K
        return (offs.shape[0], a.shape[0], b.shape[1])
    return (a.shape[1], b.shape[1])  # 3D x 2D


def _jagged_length(a, b) -> int:
    """The length of the dim that offs splits: tokens (2Dx3D), K (2Dx2D), or N (3Dx2D)."""
    if a.dim() == 2 and b.dim() == 3:
        return a.shape[0]
    if a.dim() == 2:
        return a.shape[1]
    return b.shape[1]


def _bounds(offs, length: int, what: str):
    """[(start, end)] of each group from the end offsets, checked against the split dim."""
    ends = [int(e) for e in offs.tolist()]
    start, out = 0, []
    for g, end in enumerate(ends):
        if end < start:
            raise _layout_error(
                f"offs must be non-decreasing end offsets, got {ends}: group {g} ends at {end} "
                f"before it starts at {start}")
        out.append((start, end))
        start = end
    if ends and ends[-1] > length:
        raise _layout_error(
            f"offs do not match the {what}: the last group ends at {ends[-1]}, past the "
            f"{length} {what} of the operand (offs {ends})")
    return out


def _tile_extent(fmt, dim: int, ndim: int) -> Optional[int]:
    """How far a 2D tile of the value format fmt reaches along ``dim`` of a matrix (None: not
    2D tiles)."""
    if fmt is None or not fmt.is_block or fmt.block_shape is None or fmt.axis is None:
        return None
    r, c = fmt.block_shape
    along_last = fmt.axis % ndim == ndim - 1
    return (c if along_last else r) if dim % ndim == ndim - 1 else (r if along_last else c)


def _check_tiles(fmt, dim: int, ndim: int, bounds, length: int, name: str) -> None:
    """A value format in 2D tiles along the split dim: its tiles straddle two groups wherever a
    group boundary is not a multiple of the tile (the values were rounded across experts)."""
    ext = _tile_extent(fmt, dim, ndim)
    if ext is None or ext == 1:
        return
    cuts = [e for _s, e in bounds[:-1] if 0 < e < length and e % ext]
    if cuts:
        raise _layout_error(
            f"the 2D tiles of {name}'s value format {fmt} ({ext} along the dim offs splits) "
            f"straddle experts: group boundaries {cuts} are not multiples of {ext}, so those "
            "tiles' shared scales were taken across two experts. Pad each expert's rows to a "
            f"multiple of {ext} (as grouped FP8 kernels require), or give this role 1D blocks")


def _round(x, fmt, axis, transform):
    if transform is not None:
        x = transform.apply(x, axis)
    if fmt is None:
        return x
    return _dispatch.quantize(x, _dispatch.with_axis(fmt, axis), keep_layout=False)


def _mm(a, b, spec):
    """One group's product: the operands rounded along K, summed in float32 or by the
    accumulator."""
    fa, fb, transform, acc, va, vb = spec
    a = _round(a, fa, 1, transform)
    b = _round(b, fb, 0, transform)
    if acc is None:
        return torch.mm(a, b)
    # (the accumulator reads each operand's format from its wrapper)
    qa = QTensor._wrap(a, va if va is not None else fa, fa)
    qb = QTensor._wrap(b, vb if vb is not None else fb, fb)
    return _accum.contract("mm", [a, b], {}, acc, [qa, qb])


def grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: Optional[torch.Tensor], spec) -> torch.Tensor:
    """The grouped GEMM of plain tensors a, b (torch._grouped_mm's layouts), each group's operands
    rounded by ``spec`` = (A's operand format, B's, transform, accumulator, A's value format,
    B's): one ``mm`` per group."""
    _check_shapes(a, b, offs)
    fa, fb, _t, _acc, va, vb = spec
    out = a.new_zeros(_out_shape(a, b, offs))
    if offs is None:  # 3D x 3D
        for g in range(a.shape[0]):
            out[g] = _mm(a[g], b[g], spec)
        return out
    length = _jagged_length(a, b)
    kinds = {(2, 3): "tokens", (2, 2): "K elements", (3, 2): "columns"}
    bounds = _bounds(offs, length, kinds[(a.dim(), b.dim())])
    # (value formats in 2D tiles across the split dim: rounded across experts already)
    if a.dim() == 2:
        _check_tiles(va, 0 if b.dim() == 3 else 1, 2, bounds, length, "A")
    if b.dim() == 2:
        _check_tiles(vb, 0 if a.dim() == 2 else 1, 2, bounds, length, "B")
    for g, (s, e) in enumerate(bounds):
        if s == e:
            continue  # an expert without tokens: no product (2D x 2D: its output stays zero)
        if b.dim() == 3:
            out[s:e] = _mm(a[s:e], b[g], spec)
        elif a.dim() == 2:
            out[g] = _mm(a[:, s:e], b[s:e], spec)
        else:
            out[:, s:e] = _mm(a[g], b[:, s:e], spec)
    return out


@torch.library.custom_op("qtensor_dispatch::grouped_mm", mutates_args=())
def _grouped_op(a: torch.Tensor, b: torch.Tensor, offs: Optional[torch.Tensor],
                spec: int) -> torch.Tensor:
    """grouped_mm with its spec by key, as one op for traced graphs (the group sizes are data)."""
    return grouped_mm(a, b, offs, _SPECS[spec])


@_grouped_op.register_fake
def _(a, b, offs, spec):
    _check_shapes(a, b, offs)
    return a.new_empty(_out_shape(a, b, offs))


# ---------------------------------------------------------------------------------------------
# The dispatch handlers (qtensor.tensor.dispatch's CONTRACT rules of PACKETS)

def _spec(ops):
    """The spec of one grouped GEMM whose multiplied operands are ``ops`` (QTensors or plain):
    the per-GEMM formats where an operand is tagged (qtensor.tensor.gemm), else each one's own."""
    fmts = _gemm.operand_formats(ops, _own_mm_fmt)
    if fmts is None:
        fmts = [_own_mm_fmt(a) for a in ops]
    transform = _gemm.operand_transform(ops)
    vals = [getattr(a, "fmt", None) for a in ops]
    return (fmts[0], fmts[1], transform, None, vals[0], vals[1])


def _own_mm_fmt(a):
    return _dispatch._own_mm_fmt(a, QTensor)


def _call(a, b, offs, spec, acc):
    spec = spec[:3] + (acc,) + spec[4:]
    return _grouped_op(a, b, offs, _spec_key(spec))


def _arg(args, kwargs, pos, name):
    return args[pos] if pos < len(args) else (kwargs or {}).get(name)


@_dispatch._handles("_grouped_mm")
def _grouped_mm_handler(func, args, uargs, ukwargs, acc=None, cls=QTensor):
    # _grouped_mm(self, mat2, offs=None, bias=None, out_dtype=None)
    bias = _arg(uargs, ukwargs, 3, "bias")
    out_dtype = _arg(uargs, ukwargs, 4, "out_dtype")
    a, b = uargs[0], uargs[1]
    if bias is not None:
        raise NotImplementedError("grouped_mm: bias is not supported (torch's CPU and CUDA "
                                  "kernels refuse it too); add it after the product")
    if out_dtype is not None and out_dtype != a.dtype:
        raise NotImplementedError(f"grouped_mm: out_dtype={out_dtype} on QTensors (payloads "
                                  f"{a.dtype}); the output format is the operands' own")
    offs = _arg(uargs, ukwargs, 2, "offs")
    return _call(a, b, offs, _spec((args[0], args[1])), acc)


@_dispatch._handles("grouped_mm_fallback")
def _fallback_handler(func, args, uargs, ukwargs, acc=None, cls=QTensor):
    # transformers::grouped_mm_fallback(input (S, K), weight (G, K, N), offs): 2D x 3D
    a, b = uargs[0], uargs[1]
    offs = _arg(uargs, ukwargs, 2, "offs")
    return _call(a, b, offs.to(torch.int32), _spec((args[0], args[1])), acc)


@_dispatch._handles("grouped_mm_fallback_backward")
def _fallback_backward_handler(func, args, uargs, ukwargs, acc=None, cls=QTensor):
    # transformers::grouped_mm_fallback_backward(input, weight, offs, grad_output): the dgrad
    # dX = dY W^T and the wgrad dW = X^T dY of each group, as autograd's _grouped_mm backward
    x, w, offs, dy = (_arg(uargs, ukwargs, i, n) for i, n in
                      enumerate(("input", "weight", "offs", "grad_output")))
    qx, qw, qdy = (_arg(args, ukwargs, i, n) for i, n in
                   ((0, "input"), (1, "weight"), (3, "grad_output")))
    offs = offs.to(torch.int32)
    gi = _call(dy, w.transpose(-2, -1), offs, _spec((qdy, qw)), acc)
    gw = _call(x.t(), dy, offs, _spec((qx, qdy)), acc)
    # dispatch rounds both outputs to grad_output's value format (the rule's order); the wgrad
    # takes X's first, as the mm(X^T, dY) of a Linear's backward does
    vx = getattr(qx, "fmt", None)
    if vx is not None:
        gw = _dispatch.quantize(gw, _dispatch.fit_format(vx, gw.dim()))
    return gi, gw

