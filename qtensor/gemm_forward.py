"""The forward of a converted Linear/Conv under ``Recipe.gemm`` (per-GEMM operand formats):
the module's own op on x and W tagged with their per-GEMM formats (qtensor.gemm).
Details: docs/convert.md, "Per-GEMM operand formats".
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn
from torch.nn import functional as F

from .gemm import GemmOperand
from .gemm import fprop as _forward_gemm
from .tensor import QTensor
from .warn import warn_once

__all__ = ["GemmForward", "tag", "kind_of", "SUPPORTED"]


def _is_q(x) -> bool:
    return isinstance(x, QTensor)


def tag(x: torch.Tensor, fprop, bwd, other, fprop_t=None, bwd_t=None,
        force: bool = False) -> torch.Tensor:
    """x as a view whose mm_fmt is a GemmOperand (x itself when it is not a QTensor, or when the
    formats are x's own and there are no transforms: nothing to do, unless ``force``). A view
    shares x's version counter and autograd passes its gradient through unchanged (a
    data-movement op, no rounding)."""
    if not isinstance(x, QTensor):
        return x
    own = x.mm_fmt
    fprop = own if fprop is None else fprop
    bwd = own if bwd is None else bwd
    if (fprop == own and bwd == own and other is None and fprop_t is None and bwd_t is None
            and not force):
        return x
    if torch.compiler.is_dynamo_compiling():
        # (dynamo would apply the attribute set below after its graph: the graph's ops would
        # not see the tag) a QTensor built with it, which the graph holds as one node
        return _Tagged.apply(x, _tag_token(fprop, bwd, other, own, fprop_t, bwd_t))
    y = x.view(x.shape)
    y.mm_fmt = GemmOperand(fprop, bwd, other, own, fprop_t, bwd_t)
    return y


@torch.compiler.assume_constant_result
def _tag_token(*fields) -> str:
    """The string that names the tag of these fields in a graph (qtensor.gemm.of_token), made
    outside the trace: dynamo takes it for a constant (a tag object that it took for one could
    not be an argument of the next such function, _graph_tokens)."""
    return str(GemmOperand(*fields))


class _Tagged(torch.autograd.Function):
    """x's payload as a QTensor whose mm_fmt is the tag named ``token`` (the gradient passes
    unchanged): tag() in a traced graph."""

    @staticmethod
    def forward(ctx, x, token):
        return QTensor._wrap(x._data.view_as(x._data), x.fmt, token, accum=x.accum)

    @staticmethod
    def backward(ctx, g):
        return g, None


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
        if torch.compiler.is_dynamo_compiling():
            if _is_q(input) and _is_q(self.module.weight):
                return self._traced(input)
            return self._eager(input)
        return self._forward(input)

    def _traced(self, input):
        """The forward while dynamo traces: the thread-local flag of the forward GEMM is Python
        state that the graph does not keep, so both operands are tagged (a tag with x's own
        formats where the recipe gives it none) and dispatch reads the forward GEMM off that
        (qtensor.gemm: every operand tagged); the backward GEMMs have the untagged dY."""
        g, m = self.gemm, self.module
        x = tag(input, g.fprop_x, g.wgrad_x, g.wgrad_dy, g.fprop_transform, g.wgrad_transform,
                force=True)
        w = tag(m.weight, g.fprop_w, g.dgrad_w, g.dgrad_dy, g.fprop_transform, g.dgrad_transform,
                force=True)
        return self.run(m, x, w)

    # a plain input or weight under torch.compile: without both tags the graph could not tell
    # the forward GEMM from dgrad/wgrad, so the layer runs eagerly (a graph break), eager's bits
    @torch.compiler.disable
    def _eager(self, input):
        return self._forward(input)

    def _forward(self, input):
        g, m = self.gemm, self.module
        if not _is_q(input) and (g.fprop_x, g.wgrad_x, g.wgrad_dy) != (None, None, None):
            warn_once(f"Recipe.gemm: a {type(m).__name__} got a plain input (its activation role "
                      "is full precision): its operand formats of x in fprop and wgrad, and of dY "
                      "in wgrad, do not apply (the input stays unrounded)")
        if not _is_q(m.weight):
            warn_once(f"Recipe.gemm: the weight of a {type(m).__name__} is a "
                      f"{type(m.weight).__name__}, not a QTensor (a DTensor under tensor "
                      "parallelism, or replaced after qt.convert): the per-GEMM formats of W, and "
                      "of dY in dgrad, do not apply (the roles' mm_fmt do)")
        if not _is_q(input) and g.wgrad_transform is not None:
            warn_once(f"Recipe.gemm: a {type(m).__name__} got a plain input (its activation role "
                      "is full precision): the transform of its wgrad GEMM does not apply")
        x = tag(input, g.fprop_x, g.wgrad_x, g.wgrad_dy, g.fprop_transform, g.wgrad_transform)
        w = tag(m.weight, g.fprop_w, g.dgrad_w, g.dgrad_dy, g.fprop_transform, g.dgrad_transform)
        with _forward_gemm():
            return self.run(m, x, w)
