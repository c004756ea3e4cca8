"""Per-GEMM operand formats (``Recipe.gemm``): each operand of each of the three GEMMs of a
linear layer or convolution in its own format.

A converted ``nn.Linear`` / ``nn.Conv1d/2d/3d`` whose recipe has ``gemm`` runs its forward through
:class:`GemmForward`: its input x and weight W enter the op as views tagged with a
:class:`GemmOperand` in place of their ``mm_fmt``. Dispatch (``qtensor.dispatch._gemm_fmts``)
reads the tags: during that forward (``in_fprop()``) each tagged operand is rounded to its
forward format; later (autograd's backward ops on the saved views: ``mm(dY, W)``, ``mm(x^T, dY)``,
``convolution_backward``) a tagged operand is rounded to its backward format and the untagged one
(the gradient dY) to the format the tag gives it. Tags are kept by data movement (the
transposes and reshapes autograd makes) and dropped by every other op (its outputs take the
operand's own ``mm_fmt``), so nothing outside the layer sees them. The backward runs autograd's
own ops, so with every format equal to the roles' ``mm_fmt`` the bits are today's.
Details: docs/convert.md, "Per-GEMM operand formats".
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["GemmOperand", "GemmForward", "in_fprop", "tag", "SUPPORTED"]


@dataclass(frozen=True)
class GemmOperand:
    """The ``mm_fmt`` of a tagged operand: its format in the forward GEMM, in its backward GEMM
    (dgrad for W, wgrad for x), the format of the gradient it meets there (None: the gradient's
    own mm_fmt), and ``base``, the operand's own mm_fmt (what the outputs of ops take)."""

    fprop: Any
    bwd: Any
    other: Any
    base: Any

    def __str__(self) -> str:
        return f"gemm(fprop={self.fprop}, bwd={self.bwd}, grad={self.other}, own={self.base})"


_STATE = threading.local()


def in_fprop() -> bool:
    """Whether the forward GEMM of a GemmForward is running (on this thread)."""
    return getattr(_STATE, "fprop", False)


class _Fprop:
    def __enter__(self):
        self.before = in_fprop()
        _STATE.fprop = True

    def __exit__(self, *exc):
        _STATE.fprop = self.before


def tag(x: torch.Tensor, fprop, bwd, other) -> torch.Tensor:
    """x as a view whose mm_fmt is a GemmOperand (x itself when it is not a QTensor, or when the
    formats are x's own: nothing to do). A view shares x's version counter and autograd passes
    its gradient through unchanged (a data-movement op, no rounding)."""
    from .tensor import QTensor
    if not isinstance(x, QTensor):
        return x
    own = x.mm_fmt
    fprop = own if fprop is None else fprop
    bwd = own if bwd is None else bwd
    if fprop == own and bwd == own and other is None:
        return x
    y = x.view(x.shape)
    y.mm_fmt = GemmOperand(fprop, bwd, other, own)
    return y


def _linear(module, x, w):
    return F.linear(x, w, module.bias)


def _conv(module, x, w):
    return module._conv_forward(x, w, module.bias)


# module classes whose own forward is one contraction of (input, weight), and how to run it with
# the tagged operands (subclasses that override forward keep it, and the roles' mm_fmt)
SUPPORTED = {nn.Linear.forward: _linear, nn.Conv1d.forward: _conv, nn.Conv2d.forward: _conv,
             nn.Conv3d.forward: _conv}


def kind_of(module: nn.Module) -> Optional[str]:
    """"linear" or "conv" for the modules GemmForward runs (their own forward), else None."""
    run = SUPPORTED.get(type(module).forward)
    return None if run is None else "linear" if run is _linear else "conv"


class GemmForward:
    """``forward`` of a converted Linear/Conv under ``Recipe.gemm``: the module's own forward on
    tagged x and W (a small object, not a closure, so that the model pickles and deep-copies)."""

    def __init__(self, module: nn.Module, gemm):
        self.module = module
        self.gemm = gemm
        self.run = SUPPORTED[type(module).forward]

    @property
    def __wrapped__(self):  # the module's own forward, for its signature
        return type(self.module).forward.__get__(self.module)

    def __call__(self, input):
        g, m = self.gemm, self.module
        if not _is_q(input) and (g.fprop_x, g.wgrad_x, g.wgrad_dy) != (None, None, None):
            from .warn import warn_once
            warn_once(f"Recipe.gemm: a {type(m).__name__} got a plain input (its activation role "
                      "is full precision): its operand formats of x in fprop and wgrad, and of dY "
                      "in wgrad, do not apply (the input stays unrounded)")
        x = tag(input, g.fprop_x, g.wgrad_x, g.wgrad_dy)
        w = tag(m.weight, g.fprop_w, g.dgrad_w, g.dgrad_dy)
        with _Fprop():
            return self.run(m, x, w)


def _is_q(x) -> bool:
    from .tensor import QTensor
    return isinstance(x, QTensor)


def operand_formats(ops, fallback) -> Optional[list]:
    """The operand formats of one contraction whose multiplied operands are ``ops`` (QTensors or
    plain tensors), or None when none is tagged. ``fallback(a)``: a's own format (None for a
    plain tensor). In the forward GEMM each tagged operand takes its fprop format; otherwise the
    tagged one its backward format and the others the format the tag gives the gradient."""
    tags = [a.mm_fmt if _is_q(a) and type(a.mm_fmt) is GemmOperand else None for a in ops]
    first = next((t for t in tags if t is not None), None)
    if first is None:
        return None
    fprop = in_fprop()
    out = []
    for a, t in zip(ops, tags):
        if t is not None:
            out.append(t.fprop if fprop else t.bwd)
        elif not fprop and first.other is not None:
            out.append(first.other)
        else:
            out.append(fallback(a))
    return out
