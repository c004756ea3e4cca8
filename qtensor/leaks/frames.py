"""Frames: who issued an op (user code, torch, qtensor, the autograd engine), and the user's
source line."""
from __future__ import annotations

import os
from typing import Optional

import torch

from ..nn.convert import ConvertedForward
from ..tensor.subclass import QTensor
from .findings import Location
from .tensors import storage_key

LOSS_DATA = frozenset(("target", "weight", "pos_weight"))  # in ops with a target

_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_QT_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
USER, TORCH, QT, ENGINE, PLUMBING = range(5)
# frames between an op call and a dispatch mode: not the op's issuer
_PLUMBING_FILES = tuple(os.path.join(_TORCH_DIR, p) for p in (
    os.path.join("_dynamo", "eval_frame.py"), "_compile.py",
    os.path.join("utils", "_python_dispatch.py"), "_ops.py"))
_CODE_KIND: dict = {}
_CODE_CACHE_SIZE = 4096  # entries of the code caches here, before they start again
# a converted model's forward (convert.ConvertedForward) calls the class's forward: module-call
# machinery, like torch's own, so an op below it is issued by that forward's code
_MODULE_CALL_CODE = frozenset({ConvertedForward.__call__.__code__})
_PLUMBING_CODE: set = set()


def plumbing(fn):
    """Decorator: ``fn``'s frames pass ops on (a dispatch mode's ``__torch_dispatch__``), so an
    op that a nested leak_check passes on is still its caller's op."""
    _PLUMBING_CODE.add(fn.__code__)
    return fn


def _code_kind(code) -> int:
    k = _CODE_KIND.get(code)
    if k is None:
        fn = code.co_filename
        if not os.path.isabs(fn):
            fn = os.path.abspath(fn)
        if code in _MODULE_CALL_CODE:
            k = TORCH
        elif code in _PLUMBING_CODE:
            k = PLUMBING
        elif fn.startswith(_QT_DIR):
            k = QT
        elif fn.startswith(_TORCH_DIR):
            if code.co_name == "_engine_run_backward":
                k = ENGINE  # the autograd engine runs the graph: ops below are torch's own
            elif fn in _PLUMBING_FILES:
                k = PLUMBING
            else:
                k = TORCH
        else:
            k = USER
        if len(_CODE_KIND) >= _CODE_CACHE_SIZE:  # (code made anew, e.g. exec per call: bounded)
            _CODE_KIND.clear()
        _CODE_KIND[code] = k
    return k


def walk(frame):
    """(direct issuer kind, issuer kind, user Location) for an op called from ``frame``.

    direct: the first frame that is not dispatch plumbing (torch library code or not);
    issuer: the first frame outside torch (user code or qtensor), or the autograd engine.
    """
    direct = issuer = None
    f = frame
    while f is not None:
        k = _code_kind(f.f_code)
        if k != PLUMBING:
            if direct is None:
                direct = k
            if issuer is None and k != TORCH:
                issuer = k
            if k == USER:
                return direct, issuer, Location(f.f_code.co_filename, f.f_lineno,
                                                f.f_code.co_name)
        f = f.f_back
    return direct, issuer if issuer is not None else TORCH, None


_FUNCTIONAL_FILE = os.path.join(_TORCH_DIR, "nn", "functional.py")
_LOSS_CODE: dict = {}


def _is_loss_code(code) -> bool:
    """A function of torch.nn.functional with a ``target`` argument: a loss."""
    k = _LOSS_CODE.get(code)
    if k is None:
        fn = code.co_filename if os.path.isabs(code.co_filename) else \
            os.path.abspath(code.co_filename)
        if len(_LOSS_CODE) >= _CODE_CACHE_SIZE:
            _LOSS_CODE.clear()
        k = _LOSS_CODE[code] = fn == _FUNCTIONAL_FILE and "target" in code.co_varnames[
            :code.co_argcount + code.co_kwonlyargcount]
    return k


def loss_data(frame) -> Optional[frozenset]:
    """Storage keys of the plain target and class weights of the torch.nn.functional loss that
    issued an op (below the user's frame), None outside a loss. Composite losses compute with
    them in ops that have no ``target`` argument (cross_entropy with label smoothing or
    probability targets: ``log_probs * target``, ``* weight``)."""
    f = frame
    while f is not None:
        k = _code_kind(f.f_code)
        if k in (USER, QT):
            break
        if k == TORCH and _is_loss_code(f.f_code):
            local = f.f_locals
            return frozenset(storage_key(t) for t in (local.get(n) for n in LOSS_DATA)
                             if isinstance(t, torch.Tensor) and not isinstance(t, QTensor))
        f = f.f_back
    return None


def user_location(frame) -> Optional[Location]:
    f = frame
    while f is not None:
        if _code_kind(f.f_code) == USER:
            return Location(f.f_code.co_filename, f.f_lineno, f.f_code.co_name)
        f = f.f_back
    return None


# ---------------------------------------------------------------------------------------------
