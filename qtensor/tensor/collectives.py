"""Collectives (torch.distributed) on QTensors: the values that arrive are the values sent, in
format. c10d's ops and the functional collectives (DTensor, FSDP2) run on the payloads, are
waited for here, and what they write is rounded once; a two-level format's tensor scale travels
with its values (docs/distributed.md, docs/formats.md "NVFP4: the tensor scale")."""
from __future__ import annotations

import collections
import functools

import torch

from .payloads import quantize, round_inplace, unwrap
from ..kernels import backend as _backend
from ..kernels.backend import fit_format
from ..kernels.checks import FLOAT_DTYPES
from ..kernels.reference import finite_amax

__all__ = ["collective", "NAMESPACES"]

# torch.distributed's op namespaces: functional collectives (DTensor, FSDP2) and c10d's
NAMESPACES = frozenset({"_c10d_functional", "c10d"})



def _wait_all(out) -> None:
    """Wait for the collective that produces ``out`` (its payloads, or a c10d Work)."""
    wait = torch.ops._c10d_functional.wait_tensor.default
    for o in out if isinstance(out, (tuple, list)) else (out,):
        if isinstance(o, (tuple, list)):
            _wait_all(o)
        elif isinstance(o, torch.Tensor):
            wait(o)
        elif hasattr(o, "wait"):  # a c10d Work (async_op=True, or the sync API before its wait)
            o.wait()


def collective(func, args, kwargs, cls):
    """A collective on QTensors: run on the payloads, wait for it here (its results must not be
    read, nor rounded, before they have arrived), then round once into the format: a reduction
    sums (or averages) the payloads in their precision (float32) and rounds the result once;
    a gather, broadcast or all-to-all moves values already in format (rounding them again
    changes nothing, unless blocks were regrouped). New outputs keep the formats of the QTensor
    input they come from (of a coalesced op: the input at their index); destinations written in
    place keep their own. Two-level formats: :func:`_two_level_received`. An async collective
    is thus complete on return (its later wait is a no-op)."""
    name = func._opname
    if name == "wait_tensor":  # the output was waited on when it was made
        a = args[0] if args else kwargs["tensor"]
        if isinstance(a, cls):
            func(a._data)
        return a
    if func.namespace == "c10d":
        return _c10d_collective(func, args, kwargs, cls)
    qs = []
    uargs, ukwargs, _plain = unwrap(args, kwargs, qs, cls)
    out = func(*uargs, **ukwargs)
    _wait_all(out)
    bound = _bound(func, args, kwargs)
    comm = _FunctionalComm(bound)
    kind = _FUNCTIONAL_KINDS.get(name.rstrip("_").removesuffix("_coalesced")
                                 .removesuffix("_out"), "whole")
    coalesced = name.rstrip("_").endswith("_coalesced")
    alias = {id(q._data): q for q in qs}  # an output that is an input's payload is that QTensor
    if name.endswith("_") or "out" in bound:  # written in place (all_reduce_, broadcast_), out=
        written = (list(args[0]) if coalesced else [args[0]]) if name.endswith("_") else [
            bound["out"]]
        sources = written if name.endswith("_") else [args[0]]
        keep = [i for i, q in enumerate(written) if isinstance(q, cls)]
        _into_written(kind, [(written[i], written[i]._data) for i in keep],
                      [sources[i] for i in keep], comm)
        return _aliased(out, alias)
    outs = list(out) if isinstance(out, (tuple, list)) else [out]
    sources = list(args[0]) if coalesced else [qs[0]] * len(outs)
    res = list(outs)
    two = []
    for i, (o, s) in enumerate(zip(outs, sources)):
        if not isinstance(s, cls) or not isinstance(o, torch.Tensor) or o.dtype not in FLOAT_DTYPES:
            continue
        if id(o) in alias:
            res[i] = alias[id(o)]
        elif s.fmt.is_two_level:
            two.append(i)
        else:
            res[i] = _wrap_received(cls, quantize(o, s.fmt), s, o.dim())
    if two:
        fmts = [fit_format(sources[i].fmt, outs[i].dim()) for i in two]
        got = _two_level_received(kind, [outs[i] for i in two], fmts,
                                  [sources[i] for i in two], comm)
        for i, (v, tscale) in zip(two, got):
            res[i] = _wrap_received(cls, v, sources[i], outs[i].dim())
            res[i]._tscale = tscale
    if isinstance(out, (tuple, list)):
        return type(out)(res)
    return res[0]


def _aliased(out, alias):
    """``out`` with the payloads among its tensors replaced by their QTensors."""
    if isinstance(out, (tuple, list)):
        return type(out)(_aliased(o, alias) for o in out)
    return alias.get(id(out), out)


def _wrap_received(cls, values, src, ndim):
    w = cls._wrap(values, fit_format(src.fmt, ndim), src.mm_fmt)
    if src.accum is not None:
        w._accum = src.accum
    return w


# How each functional collective's two-level outputs take their tensor scale (the coalesced,
# in-place and out= forms as their single form): _two_level_received
_FUNCTIONAL_KINDS = {"broadcast": "bcast", "all_gather_into_tensor": "cat",
                     "all_to_all_single": "cat", "reduce_scatter_tensor": "part",
                     "_wrap_tensor_autograd": "same"}
# c10d's ops: the tensors they write are their first argument (send writes none); "from": each
# tensor written is a whole tensor one rank sent (_senders says which)
_C10D_KINDS = {"broadcast_": "bcast", "_allgather_base_": "cat",
               "allgather_into_tensor_coalesced_": "cat", "alltoall_base_": "cat",
               "allgather_": "from", "allgather_coalesced_": "from", "gather_": "from",
               "scatter_": "from", "alltoall_": "from",
               "_reduce_scatter_base_": "part", "reduce_scatter_tensor_coalesced_": "part",
               "reduce_scatter_": "part"}
_P2P = frozenset({"send", "recv_", "recv_any_source_"})


def _bound(func, args, kwargs) -> dict:
    """The arguments of an op call by their schema names (those passed)."""
    bound = dict(zip((a.name for a in func._schema.arguments), args))
    bound.update(kwargs or {})
    return bound


def _c10d_collective(func, args, kwargs, cls):
    """c10d's ops write into their first argument (a tensor, a list, a list of lists), and some
    backends' Work copies its result into it again on every wait() (gloo's reduce-scatter):
    they write into copies of the destinations' payloads, and the destinations get the
    results once; the tensors only read are passed as payloads (a destination's input may be a
    view of it: FSDP's all-gather in place)."""
    pairs = []

    def copy_of(a):  # (scatter, gather, allgather take lists of lists)
        if isinstance(a, (list, tuple)):
            return type(a)(copy_of(x) for x in a)
        if isinstance(a, cls):
            pairs.append((a, a._data.clone()))
            return pairs[-1][1]
        return a

    def payload(a):
        if isinstance(a, (list, tuple)):
            return type(a)(payload(x) for x in a)
        return a._data if isinstance(a, cls) else a
    name = func._opname
    if name in _P2P:
        return _p2p(func, args, kwargs, cls)
    uargs = [copy_of(args[0])] + [payload(a) for a in args[1:]]
    out = func(*uargs, **(kwargs or {}))
    _wait_all(out)
    bound = _bound(func, args, kwargs)
    kind = _C10D_KINDS.get(name, "whole")
    dst = args[0]
    if kind == "from":
        pg = _group(bound)
        sent, origins = _senders(name, bound, pg.rank(), pg.size())
        flat = _flat(dst)
        exchange = any(isinstance(t, cls) and t.fmt.is_two_level for t in flat + sent)
        _received_whole(pairs, [o for t, o in zip(flat, origins) if isinstance(t, cls)], sent,
                        _C10dComm(bound, pg.size()), exchange)
    elif pairs and not (name == "reduce_" and _group(bound).rank() != bound["root_rank"]):
        # (a reduce's result is the root's: the other ranks' tensors were only read)
        src = next((bound[k] for k in ("input_tensor", "input", "inputs", "input_tensors")
                    if k in bound), None)
        if kind == "cat":  # each output's input
            sources = [src] if isinstance(dst, cls) else [
                s for q, s in zip(dst, src) if isinstance(q, cls)]
        else:
            sources = [q for q, _c in pairs]
        _into_written(kind, pairs, sources, _C10dComm(bound, _group(bound).size()))
    return _aliased(out, {id(c): q for q, c in pairs})


def _group(bound):
    """The c10d ProcessGroup of an op's ``process_group`` argument."""
    import torch.distributed as dist
    return dist.ProcessGroup.unbox(bound["process_group"])


def _flat(a) -> list:
    if isinstance(a, (list, tuple)):
        return [t for x in a for t in _flat(x)]
    return [a]


def _senders(name, bound, me, world):
    """(the tensors this rank sends, the same number on every rank (None: a rank that sends
    none); for each tensor the op writes, in _flat order: (the rank that sent it, its index
    in that rank's list))."""
    dst = bound["output_tensors"] if "output_tensors" in bound else bound["output_lists"]
    if name == "scatter_":
        ins = bound["input_tensors"]
        return (list(ins[0]) if ins else [None] * world), [(bound["root_rank"], me)]
    if name == "allgather_":  # output_tensors[i][j]: rank j's input_tensors[i]
        return list(bound["input_tensors"]), [(j, i) for i, row in enumerate(dst)
                                              for j, _t in enumerate(row)]
    if name == "allgather_coalesced_":  # output_lists[j][i]: rank j's input_list[i]
        return list(bound["input_list"]), [(j, i) for j, row in enumerate(dst)
                                           for i, _t in enumerate(row)]
    if name == "gather_":  # the root's output_tensors[0][j]: rank j's input_tensors[0]
        return list(bound["input_tensors"]), [(j, 0) for row in dst
                                              for j, _t in enumerate(row)]
    return list(bound["input_tensors"]), [(j, me) for j, _t in enumerate(dst)]  # alltoall_


def _fingerprint(fmt) -> float:
    """A number that tells formats apart across processes (24 bits: exact in float32)."""
    import zlib
    return float(zlib.crc32(str(fmt).encode()) & 0xFFFFFF)


def _sent_scales(sent, device) -> torch.Tensor:
    """[len(sent), 2] float32 on ``device``: each sent tensor's tensor scale and format
    fingerprint (zeros for a tensor that is not a two-level QTensor)."""
    rows = []
    for t in sent:
        if getattr(t, "fmt", None) is not None and t.fmt.is_two_level:
            rows.append(torch.stack([t.tensor_scale.reshape(()).to(torch.float32).cpu(),
                                     torch.tensor(_fingerprint(fit_format(t.fmt, t.dim())))]))
        else:
            rows.append(torch.zeros(2))
    return (torch.stack(rows) if rows else torch.zeros(0, 2)).to(device)


def _as_sent(c, fmt, row):
    """A received whole tensor ``c`` (two-level ``fmt``) as a copy_ of the tensor sent (its
    scale and fingerprint ``row``) gives it in one process: its values under its scale; one not
    of the format: rounded under a fresh scale of its own amax."""
    if bool(row[0] > 0) and float(row[1]) == _fingerprint(fmt):
        return c, row[0].to(device=c.device).clone()
    return _backend.round_with_scale(c, fmt)


def _received_whole(written, origins, sent, comm, exchange) -> None:
    """Collectives whose every output is a whole tensor one rank sent (list all-gather, gather,
    scatter, all-to-all of lists): ``written`` ((destination, the payload it received)) came
    from ``origins`` ((rank, index)); every rank's ``sent`` scales are all-gathered (where
    ``exchange``: any of the op's tensors is two-level, on every rank alike)."""
    table = None
    if exchange:
        dev = next(t.device for t in [c for _q, c in written] + sent + [torch.zeros(())]
                   if isinstance(t, torch.Tensor))  # (a scatter's non-root sends none)
        table = comm.gather(_sent_scales(sent, dev).reshape(-1)).view(comm.world, len(sent), 2)
    for (q, c), (j, i) in zip(written, origins):
        if q.fmt.is_two_level:
            v, q._tscale = _as_sent(c, fit_format(q.fmt, c.dim()), table[j, i])
            q._data.copy_(v)
        else:
            q._data.copy_(quantize(c, q.fmt))


# The trailer a send of a two-level QTensor puts after its payload's bytes (int32: a magic
# number, the tensor scale's and the format fingerprint's float32 bits, the magic number)
_MAGIC = 0x51547363
_TRAILER = 16


def _p2p(func, args, kwargs, cls):
    """send/recv: a two-level QTensor is sent as one message, its payload's bytes then a
    trailer with its tensor scale and format fingerprint (_TRAILER bytes); a QTensor receives
    into a buffer that long, which gloo fills with a shorter message too: a trailer present
    gives the sender's scale (a two-level receiver takes it), one absent (still zeros) a plain
    tensor's values (rounded into the receiver's format, under a fresh scale where two-level).
    So every pairing of QTensors and plain tensors gets one process's ``dst.copy_(src)``, but a
    two-level QTensor sent to a plain tensor (a message longer than its buffer: gloo aborts
    that rank) and, on backends that need a recv as long as its message (NCCL), a two-level
    QTensor and anything else. A send stays in flight (a batch of isend/irecv in which every
    rank sends first must not wait here); a recv is complete here, its Work a done one."""
    import torch.distributed as dist
    bound = _bound(func, args, kwargs)
    tensors, pg = bound["tensors"], bound["process_group"]
    if func._opname == "send":
        return func([_framed(t, cls) for t in tensors], *args[1:], **(kwargs or {}))
    bufs = [_frame_buffer(t, cls, pg) for t in tensors]
    out = func([b if b is not None else t for b, t in zip(bufs, tensors)], *args[1:],
               **(kwargs or {}))
    _wait_all(out)
    peer = bound["src"] if "src" in bound else dist.Work.unbox(out)._source_rank()
    for q, buf in zip(tensors, bufs):
        if buf is not None:
            _into_received(q, buf)
    return _work_of([], peer).boxed()


def _framed(t, cls):
    """What a send of ``t`` sends: a two-level QTensor's payload bytes and trailer; else the
    payload (a plain tensor: itself)."""
    if not isinstance(t, cls):
        return t
    if not t.fmt.is_two_level:
        return t._data
    magic = torch.tensor([_MAGIC], dtype=torch.int32, device=t.device)
    row = _sent_scales([t], t.device)[0].view(torch.int32)
    return torch.cat([t._data.contiguous().reshape(-1).view(torch.uint8),
                      torch.cat([magic, row, magic]).view(torch.uint8)])


def _frame_buffer(t, cls, pg):
    """The buffer a QTensor ``t`` receives into: its payload's bytes and a trailer, zeros (a
    non-two-level QTensor only where the backend takes a message shorter than the buffer);
    None where it receives into a copy of its payload."""
    if not isinstance(t, cls) or not (t.fmt.is_two_level or _takes_shorter(pg, t.device)):
        return t._data.clone() if isinstance(t, cls) else None
    return torch.zeros(t._data.numel() * t._data.element_size() + _TRAILER, dtype=torch.uint8,
                       device=t.device)


def _takes_shorter(pg, device) -> bool:
    """Whether ``pg``'s backend for ``device`` receives a message shorter than the buffer (gloo:
    a recv's buffer must only be long enough; NCCL's must be as long as the message)."""
    import torch.distributed as dist
    try:
        return isinstance(dist.ProcessGroup.unbox(pg)._get_backend(device), dist.ProcessGroupGloo)
    except (AttributeError, RuntimeError):
        return False


def _into_received(q, buf) -> None:
    """Write what the QTensor ``q`` received (``buf``: a copy of its payload, or a frame) into
    it, as ``q.copy_`` of the tensor sent in one process."""
    c = q._data
    row = None
    if buf.dtype != c.dtype:  # a frame
        tail = buf[-_TRAILER:].clone().view(torch.int32)
        if bool((tail[0] == _MAGIC) & (tail[3] == _MAGIC)):
            row = tail[1:3].clone().view(torch.float32)
        elif bool(tail.any()):
            raise ValueError(
                f"recv into a QTensor of {q.fmt} ({tuple(c.shape)}, {c.dtype}): the message is "
                f"longer than the tensor (a tensor of another shape or dtype was sent)")
        buf = buf[:-_TRAILER].view(c.dtype).view(c.shape)
    if q.fmt.is_two_level:
        v, q._tscale = _as_sent(buf, fit_format(q.fmt, c.dim()),
                                torch.zeros(2, device=c.device) if row is None else row)
        c.copy_(v)
    else:
        c.copy_(quantize(buf, q.fmt))


def _work_of(works, source_rank):
    """A c10d Work that waits for ``works`` (c10d Works, each once); its source rank: a recv
    from any source asks for it."""
    w = _work_type()()
    w.works, w.source = list(works), source_rank
    _KEPT.append(w)
    return w


# The Python side of a _work_of Work must live until the op's caller holds it (what the
# dispatcher returns is the C++ Work, whose base wait() would block): the last ones are kept
_KEPT = collections.deque(maxlen=64)


@functools.cache
def _work_type():
    import torch.distributed as dist

    class _Works(dist.Work):
        def wait(self, timeout=None):
            while self.works:
                dist.Work.unbox(self.works.pop(0)).wait()
            return True

        def is_completed(self):
            return all(dist.Work.unbox(w).is_completed() for w in self.works)

        def get_future(self):
            self.wait()
            fut = torch.futures.Future()
            fut.set_result(None)
            return fut

        def _source_rank(self):
            return self.source

        source_rank = _source_rank
    return _Works


def _into_written(kind, written, sources, comm) -> None:
    """The QTensors of ``written`` ((destination, the payload it received)) get the received
    values in their formats; ``sources``: what each destination's values come from (its
    tensor scale)."""
    two, two_sources = [], []
    for (q, c), s in zip(written, sources):
        if q.fmt.is_two_level:
            two.append((q, c))
            two_sources.append(s)
        elif c is q._data:
            round_inplace(q)
        else:
            q._data.copy_(quantize(c, q.fmt))
    if not two:
        return
    outs = [c for _q, c in two]
    fmts = [fit_format(q.fmt, c.dim()) for q, c in two]
    if kind in ("bcast", "same"):  # (in place: the destination is the source)
        two_sources = [q for q, _c in two]
    got = _two_level_received(kind, outs, fmts, two_sources, comm)
    for (q, c), (v, tscale) in zip(two, got):
        if v is not q._data:
            q._data.copy_(v)
        q._tscale = tscale


def _scales_of(tensors, fmts, outs) -> torch.Tensor:
    """The tensor scales of ``tensors`` as one float32 vector, 0 for a tensor without one or not
    of the format its output has (``fmts``, fitted to ``outs``): values no scale of it gives."""
    zero = torch.zeros((), dtype=torch.float32, device=outs[0].device)
    return torch.stack([
        t.tensor_scale.reshape(()).to(torch.float32)
        if (getattr(t, "fmt", None) is not None and t.fmt.is_two_level
            and fit_format(t.fmt, o.dim()) == f) else zero
        for t, f, o in zip(tensors, fmts, outs)])


class _FunctionalComm:
    """The scale collectives of a functional collective, in its group."""

    def __init__(self, bound):
        self.bound = bound

    def gather(self, t):  # [group size, len(t)]
        c10d, b = torch.ops._c10d_functional, self.bound
        size = b.get("group_size")
        if size is None:  # (all_to_all_single names its group only)
            from torch.distributed.distributed_c10d import _resolve_process_group
            size = _resolve_process_group(b["group_name"]).size()
        return c10d.wait_tensor(c10d.all_gather_into_tensor(
            t, size, b["group_name"])).view(size, -1)

    def broadcast(self, t):
        c10d, b = torch.ops._c10d_functional, self.bound
        return c10d.wait_tensor(c10d.broadcast(t.clone(), b["src"], b["group_name"]))


class _C10dComm:
    """The scale collectives of a c10d collective, in its process group."""

    def __init__(self, bound, world):
        self.bound, self.world = bound, world

    def gather(self, t):
        out = t.new_empty(self.world * t.numel())
        _wait_all(torch.ops.c10d._allgather_base_.default(out, t.contiguous(),
                                                          self.bound["process_group"]))
        return out.view(self.world, -1)

    def broadcast(self, t):
        t = t.clone()
        _wait_all(torch.ops.c10d.broadcast_.default([t], self.bound["process_group"],
                                                    self.bound["root_rank"], 0))
        return t


def _two_level_received(kind, outs, fmts, sources, comm):
    """The values and tensor scales of a collective's two-level outputs ``outs`` (received
    payloads, ``fmts`` their formats) as one process holding the whole tensors has them;
    ``sources``: the tensors each output's values come from (their tensor scales).

    - ``bcast``: the source rank's values, under its scale (broadcast with them).
    - ``cat``: an all-gather of parts that share one tensor scale keeps their values and that
      scale (the ranks' scales are gathered too); of parts of different scales, as a cat of
      them: rounded again under one fresh scale (of the gathered amax).
    - ``part``: a reduce-scatter rounds each rank's part under the scale of the whole reduced
      tensor's amax (the parts' amaxes gathered: their max).
    - ``same``: the identity (autograd's wrapper of an output): the source's scale.
    - ``whole`` (all-reduce, a reduce's root): rounded under the scale of their own amax (an
      all-reduce's result is the same on every rank: so is its scale).
    c10d's collectives of whole tensors sent (gather, scatter, lists): :func:`_received_whole`.
    Eager or traced (torch.compile: a choice by the gathered scales is a torch.where)."""
    if kind == "same":
        return [(o, s.tensor_scale) for o, s in zip(outs, sources)]
    if kind == "bcast":
        scales = comm.broadcast(_scales_of(sources, fmts, outs))
        return [(o, scales[i]) for i, o in enumerate(outs)]
    if kind == "part":
        amax = comm.gather(torch.stack([finite_amax(o).reshape(()) for o in outs])).amax(0)
        return [_backend.round_with_scale(o, f, tensor_amax=amax[i])
                for i, (o, f) in enumerate(zip(outs, fmts))]
    if kind != "cat":
        return [_backend.round_with_scale(o, f) for o, f in zip(outs, fmts)]
    gathered = comm.gather(_scales_of(sources, fmts, outs))
    res = []
    for i, (o, f) in enumerate(zip(outs, fmts)):
        col = gathered[:, i]
        bits = col.view(torch.int32)
        same = (bits == bits[:1]).all() & (col[0] > 0)
        if type(o) is torch.Tensor and bool(same):  # eager: no rounding to do
            res.append((o, col[0].clone()))
            continue
        q, fresh = _backend.round_with_scale(o, f)
        if type(o) is torch.Tensor:
            res.append((q, fresh))
        else:  # (traced)
            res.append((torch.where(same, o, q), torch.where(same, col[0], fresh)))
    return res
