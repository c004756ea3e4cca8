"""A QTensor op's payloads: the arguments unwrapped to them, and their roundings to a format
(a fresh output, in place after an in-place op), as the op rules (qtensor.tensor.dispatch) and
the collectives (qtensor.tensor.collectives) call the rounding back end."""
from __future__ import annotations

import torch

from . import block_specials as _block_specials
from . import shards as _shards
from ..kernels import backend as _backend
from ..kernels.backend import fit_format
from ..kernels.checks import FLOAT_DTYPES
from ..formats.base import Format, is_stochastic

__all__ = ["quantize", "round_fresh", "round_inplace", "unwrap", "unwrap_list", "whole_of"]


def quantize(x: torch.Tensor, fmt: Format, keep_layout: bool = True,
             tiles: bool = True) -> torch.Tensor:
    """One rounding of a plain payload tensor to fmt, fitted to its dims (fit_format): the
    op rules' call of the rounding back end (qtensor.kernels.backend.round_payload, whose
    docstring tells keep_layout and tiles)."""
    return _backend.round_payload(x, fit_format(fmt, x.dim()), keep_layout, tiles)


def round_fresh(out, fmt, func):
    """An op's own new output, an eager CPU tensor that the kernels take (_eager_cpu_kernel),
    rounded to fmt (fitted to it): in place where the kernels can (the same bits as
    ``quantize``, without a second buffer), else by ``quantize``; block formats are watched for
    NaN blocks (qtensor.tensor.block_specials)."""
    block = fmt.is_block
    if (is_stochastic(fmt.rounding) or not out.is_contiguous()
            or out.is_neg() or fmt.is_tiled
            or (block and fmt.axis is not None and out.dim() > 1
                and fmt.axis % out.dim() != out.dim() - 1
                and not _backend.tiles_in_place(out, fmt))):
        before, out = out, _backend.round_payload(out, fmt)
        if block:
            _block_specials.check(before, out, fmt, op=func)
        return out
    if (block and _block_specials.watching() and out.numel()
            and not torch.isfinite(out.sum())):  # an Inf or NaN may spread over its block
        before = out.clone()
        _backend.round_fresh_in_place(out, fmt)
        _block_specials.check(before, out, fmt, op=func)
        return out
    _backend.round_fresh_in_place(out, fmt)
    return out


def whole_of(q):
    """(the payload of the whole tensor that the block-format QTensor q is a view of, its
    format fitted to it): q's own where q is that tensor (or no eager payload: traced ones alias
    nothing that dispatch sees)."""
    g, data = q._group, q._data
    if (g is None or g.root is data or type(data) is not torch.Tensor
            or type(g.root) is not torch.Tensor):
        return data, fit_format(q.fmt, data.dim())
    return g.root, fit_format(g.fmt, g.root.dim())


def _dense_dims(t):
    """t's dims of size > 1 as (stride, dim), by stride, where t is non-overlapping and dense
    (each stride the product of the sizes below it); else None."""
    dims = sorted((st, d) for d, (n, st) in enumerate(zip(t.shape, t.stride())) if n > 1)
    expect = 1
    for st, d in dims:
        if st != expect:
            return None
        expect *= t.shape[d]
    return dims


def _box_of(data, root):
    """data, a view of the dense tensor root, as a strided box of it: per root dim its first
    index, count and step, and the root dim each of data's dims runs along (None: size 1); None
    where data is no box of root (a diagonal, a flat view across rows, root not dense)."""
    dims = _dense_dims(root)
    if dims is None:
        return None
    sizes = root.shape
    diff = data.storage_offset() - root.storage_offset()
    nd = root.dim()
    start, count, step = [0] * nd, [1] * nd, [1] * nd
    for st, d in dims:
        start[d] = (diff // st) % sizes[d]
    if diff < 0 or sum(start[d] * st for st, d in dims) != diff:
        return None
    along = []
    for n, vst in zip(data.shape, data.stride()):
        if n == 1:
            along.append(None)
            continue
        d = next((d for st, d in dims if st <= vst < st * sizes[d] and vst % st == 0), None)
        if d is None or count[d] != 1:
            return None
        m = vst // root.stride(d)
        if start[d] + (n - 1) * m >= sizes[d]:
            return None
        count[d], step[d] = n, m
        along.append(d)
    return start, count, step, along


def _block_extents(fmt, shape):
    """The elements a block of the (fitted) block format fmt spans along each dim of shape."""
    return [fmt.block_extent(len(shape), d, n) for d, n in enumerate(shape)]


def _touched_blocks(data, fmt, root, rfmt):
    """After an in-place op through data (in format fmt), a view of root (the payload of the
    whole one-level block-format tensor, in format rfmt): the part of root to round again, the
    blocks data writes into, or None where data holds whole blocks of root, grouped as fmt
    groups them (rounding data alone is right). Views that are no box of root round all of it
    (blocks are independent: the others keep their bits)."""
    if (data.numel() == 0 or data.dtype != root.dtype or data.device != root.device
            or data.untyped_storage().data_ptr() != root.untyped_storage().data_ptr()):
        return None  # (not a view of root's values any more)
    box = _box_of(data, root)
    if box is None:
        return root
    start, count, step, along = box
    ext = _block_extents(rfmt, root.shape)
    own = _block_extents(fmt, data.shape)
    sizes = root.shape
    whole = all(e == 1 or sizes[d] == 1 for d, e in enumerate(ext) if d not in along)
    for j, d in enumerate(along):
        if d is not None and ext[d] > 1 and not (
                own[j] == ext[d] and step[d] == 1 and start[d] % ext[d] == 0
                and (count[d] % ext[d] == 0 or start[d] + count[d] == sizes[d])):
            whole = False
    if whole and all(own[j] == 1 or (d is None and data.shape[j] == 1)
                     for j, d in enumerate(along) if d is None or ext[d] == 1):
        return None
    idx = []
    for d, e in enumerate(ext):
        hi = start[d] + (count[d] - 1) * step[d] + 1
        if e == 1:
            idx.append(slice(start[d], hi, step[d]))
        else:
            idx.append(slice(start[d] // e * e, min(-(-hi // e) * e, sizes[d])))
    return root[tuple(idx)]


def round_inplace(q, func=None, moved=False) -> None:
    """Round a QTensor's payload in place to its own format (after an in-place op). A view of
    a one-level block-format tensor rounds the blocks of the whole tensor it writes into;
    ``moved``: the values written are in the format as blocks of the view's own (a move), so
    a view that holds whole blocks needs no rounding."""
    data = q._data
    fmt = fit_format(q.fmt, data.dim())
    if fmt.is_block and not fmt.is_two_level and q._group is not None:
        root, rfmt = whole_of(q)
        part = None if root is data or (  # (.data, detach(): all of root, as it lies)
            data.shape == root.shape and data.stride() == root.stride()
            and data.storage_offset() == root.storage_offset()) else _touched_blocks(
                data, fmt, root, rfmt)
        if part is None:
            if moved:
                return
        else:
            data, fmt = part, fit_format(rfmt, part.dim())
    if fmt.is_two_level:  # computed in place: a fresh tensor scale (a shard's: the whole's)
        shard = _shards.live(q) if q._shard is not None else None
        if shard is not None:
            v, q._tscale = _shards.round_shard(data, fmt, shard)
        else:
            # one scale for the whole tensor a view is part of: its blocks and amax are the
            # whole's, and the new scale is every alias's (q._tscale is their group's)
            data, fmt = whole_of(q)
            v, q._tscale = _backend.round_with_scale(data, fmt)
        data.copy_(v)
        return
    if (fmt.is_block and _block_specials.watching() and type(data) is torch.Tensor
            and data.numel() and not torch.compiler.is_compiling()
            and not torch.isfinite(data.sum())):  # an Inf or NaN may spread over its block
        before = data.clone()
        _backend.round_payload(data, fmt, out=data)
        _block_specials.check(before, data, fmt, op=func)
        return
    _backend.round_payload(data, fmt, out=data)


def unwrap_list(seq, qs, cls):
    out = []
    plain = False
    for a in seq:
        if isinstance(a, cls):
            qs.append(a)
            out.append(a._data)
        else:
            if isinstance(a, torch.Tensor) and a.dtype in FLOAT_DTYPES:
                plain = True
            out.append(a)
    return out, plain


def unwrap(args, kwargs, qs, cls):
    """(args, kwargs) with payloads in place of QTensors (one list level deep, as aten arguments
    are), appended to qs; and whether a plain floating tensor is among them (high-precision
    values meeting QTensors)."""
    plain = False
    uargs = []
    for a in args:
        if isinstance(a, cls):
            qs.append(a)
            uargs.append(a._data)
        elif isinstance(a, (list, tuple)):
            a, p = unwrap_list(a, qs, cls)
            uargs.append(a)
            plain |= p
        else:
            if isinstance(a, torch.Tensor) and a.dtype in FLOAT_DTYPES:
                plain = True
            uargs.append(a)
    ukwargs = {}
    if kwargs:
        for k, a in kwargs.items():
            if isinstance(a, cls):
                qs.append(a)
                ukwargs[k] = a._data
            elif isinstance(a, (list, tuple)):
                ukwargs[k], p = unwrap_list(a, qs, cls)
                plain |= p
            else:
                if isinstance(a, torch.Tensor) and a.dtype in FLOAT_DTYPES:
                    plain = True
                ukwargs[k] = a
    return uargs, ukwargs, plain
