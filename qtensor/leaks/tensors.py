"""The tensors of an op: its arguments and results by role, and what holds values."""
from __future__ import annotations

import torch

from ..kernels.checks import FLOAT_DTYPES
from ..tensor.subclass import QTensor

# values a format could hold: complex ones too (no format is complex, so a complex tensor made
# from QTensors is a value computed in full precision)
VALUE_DTYPES = FLOAT_DTYPES | {torch.complex32, torch.complex64, torch.complex128}


def named_tensors(args, kwargs, schema):
    """(role, tensor) for every tensor argument, one list level deep (as aten arguments are)."""
    names = [a.name for a in schema.arguments] if schema is not None else []
    roles = [(names[i] if i < len(names) else f"arg{i}", a) for i, a in enumerate(args)]
    if kwargs:
        roles.extend(kwargs.items())
    out = []
    for role, a in roles:
        if isinstance(a, torch.Tensor):
            out.append((role, a))
        elif isinstance(a, (list, tuple)):
            for j, t in enumerate(a):
                if isinstance(t, torch.Tensor):
                    out.append((f"{role}[{j}]", t))
    return out


def flat_tensors(args, kwargs):
    """The tensor arguments, one list level deep, without names (the fast path)."""
    out = []
    for a in args:
        if isinstance(a, torch.Tensor):
            out.append(a)
        elif isinstance(a, (list, tuple)):
            out.extend(t for t in a if isinstance(t, torch.Tensor))
    if kwargs:
        for a in kwargs.values():
            if isinstance(a, torch.Tensor):
                out.append(a)
            elif isinstance(a, (list, tuple)):
                out.extend(t for t in a if isinstance(t, torch.Tensor))
    return out


def outputs(out):
    if isinstance(out, torch.Tensor):
        return [("result", out)]
    if isinstance(out, (list, tuple)):
        return [(f"result[{i}]", t) for i, t in enumerate(out) if isinstance(t, torch.Tensor)]
    return []


def is_float(t) -> bool:
    """A floating or complex tensor: one that holds values (not indices, masks)."""
    return t.dtype in VALUE_DTYPES


def storage_key(t):
    """The identity of t's memory (a QTensor's payload): views share it."""
    try:
        if isinstance(t, QTensor):
            t = t.payload
        return (t.device, t.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):
        return (t.device, id(t))



COPY_OPS = frozenset(("copy_", "_foreach_copy_"))
_DESTS: dict = {}
_TARGET_POS: dict = {}


def pure_destinations(func) -> frozenset:
    """Names of the arguments an op only writes, never reads: ``out=`` tensors, and the
    destination of ``copy_``."""
    d = _DESTS.get(func)
    if d is None:
        names = {a.name for a in func._schema.arguments
                 if a.alias_info is not None and a.alias_info.is_write and a.kwarg_only}
        if func._opname in COPY_OPS:
            names.add(func._schema.arguments[0].name)
        d = _DESTS[func] = frozenset(names)
    return d


def target_position(func):
    """Position of an argument named ``target`` in func's schema (loss ops), else None."""
    pos = _TARGET_POS.get(func, -1)
    if pos == -1:
        pos = None
        for i, a in enumerate(func._schema.arguments):
            if a.name == "target":
                pos = i
                break
        _TARGET_POS[func] = pos
    return pos
