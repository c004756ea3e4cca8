"""The forward of a converted Linear/Conv under ``Recipe.gemm`` (per-GEMM operand formats):
the module's own op on x and W tagged with their per-GEMM formats (qtensor.tensor.gemm).
Details: docs/convert.md, "Per-GEMM operand formats".
"""
from __future__ import annotations

import weakref
from typing import Dict, Optional, Tuple

import torch
from torch import nn
from torch.nn import functional as F

from ..tensor import flush_warnings
from ..tensor.gemm import GemmOperand
from ..tensor.gemm import fprop as _forward_gemm
from ..tensor.subclass import QTensor
from ..warn import warn_once

__all__ = ["GemmForward", "ExpertsForward", "expert_weights", "tag", "kind_of", "SUPPORTED",
           "gemm_formats", "installed_gemm", "reduction_axes"]


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
    """The string that names the tag of these fields in a graph (qtensor.tensor.gemm.of_token), made
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


def installed_gemm(module: nn.Module):
    """The GemmFormats that ``qt.convert`` gave ``module`` (its GemmForward's; None: none)."""
    f = module.__dict__.get("forward")
    f = getattr(f, "inner", None) or f  # the root's ConvertedForward holds it as .inner
    return f.gemm if isinstance(f, GemmForward) else None


def reduction_axes(module: nn.Module) -> Dict[str, Tuple[int, int]]:
    """The axis along which each GEMM of a Linear/Conv reduces (blocks) each of its operands, in
    the order of :func:`gemm_formats`, on the tensors as the module holds them (x, W, dY): the
    forward's K is in_features / the input channels, dgrad's the output features / channels,
    wgrad's the tokens (dispatch's linear, mm and convolution_backward)."""
    if kind_of(module) == "linear":
        return {"fprop": (-1, -1), "dgrad": (-1, 0), "wgrad": (0, 0)}
    return {"fprop": (1, 1), "dgrad": (1, 0), "wgrad": (0, 0)}


def gemm_formats(module: nn.Module, x_fmt=None, dy_fmt=None, *,
                 x_plain: bool = False) -> Optional[Dict[str, tuple]]:
    """Which operand formats and transform each GEMM of ``module`` uses: ``{"fprop": (x, W, t),
    "dgrad": (dY, W, t), "wgrad": (x, dY, t)}`` (the operand order of ``plans.GEMMS``), a format
    None where that operand enters unrounded (at its values), ``t`` the transform applied to both
    operands along K before rounding (None: none). What dispatch does (qtensor.tensor.gemm's tags):
    ``Recipe.gemm`` / ``last_layers`` / a rule's ``"gemm"`` where ``qt.convert`` installed them,
    else each operand's own operand format. ``x_fmt``, ``dy_fmt``: the own operand format
    (mm_fmt) of the input and of the output's gradient, which the module does not know (the
    producing module's activation and grad roles); ``x_plain``: the input is a plain tensor
    (then nothing of x's applies: it is not tagged). None for a module that is not one
    contraction (see :func:`kind_of`)."""
    if kind_of(module) is None:
        return None
    w = module._parameters.get("weight")
    w_q = isinstance(w, QTensor)
    w_own = w.mm_fmt if w_q else None
    x_fmt = None if x_plain else x_fmt
    g = installed_gemm(module)
    if g is None:
        return {"fprop": (x_fmt, w_own, None), "dgrad": (dy_fmt, w_own, None),
                "wgrad": (x_fmt, dy_fmt, None)}

    def own(fmt, default):
        return default if fmt is None else fmt

    x_tag = not x_plain
    return {
        "fprop": (own(g.fprop_x, x_fmt) if x_tag else x_fmt,
                  own(g.fprop_w, w_own) if w_q else w_own,
                  g.fprop_transform if (x_tag or w_q) else None),
        "dgrad": ((own(g.dgrad_dy, dy_fmt), own(g.dgrad_w, w_own), g.dgrad_transform) if w_q
                  else (dy_fmt, w_own, None)),
        "wgrad": ((own(g.wgrad_x, x_fmt), own(g.wgrad_dy, dy_fmt), g.wgrad_transform) if x_tag
                  else (x_fmt, dy_fmt, None)),
    }


class GemmForward:
    """``forward`` of a converted Linear/Conv under ``Recipe.gemm``: the module's own forward on
    tagged x and W (a small object, not a closure, so that the model pickles and deep-copies).
    ``name``: the module's qualified name (the flush and clipping warnings name it)."""

    def __init__(self, module: nn.Module, gemm, name: str = ""):
        self.module = module
        self.gemm = gemm
        self.name = name or type(module).__name__
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
        (qtensor.tensor.gemm: every operand tagged); the backward GEMMs have the untagged dY."""
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
        if flush_warnings.watching():  # the forward GEMM's operands, as it rounds them
            fx, fw, t = gemm_formats(m, getattr(input, "mm_fmt", None),
                                     x_plain=not _is_q(input))["fprop"]
            ax, aw = reduction_axes(m)["fprop"]
            if _is_q(input):
                flush_warnings.check_gemm_operand("activation", f"input of {self.name}", fx,
                                                  input._data, ax, t)
            if _is_q(m.weight):
                flush_warnings.check_gemm_operand("weight", f"{self.name}.weight", fw,
                                                  m.weight._data, aw, t)
        x = tag(input, g.fprop_x, g.wgrad_x, g.wgrad_dy, g.fprop_transform, g.wgrad_transform)
        w = tag(m.weight, g.fprop_w, g.dgrad_w, g.dgrad_dy, g.fprop_transform, g.dgrad_transform)
        with _forward_gemm():
            return self.run(m, x, w)




# ---------------------------------------------------------------------------------------------
# Mixture-of-experts: a module holding its experts' weights stacked in 3D parameters (the
# experts modules of transformers' MoE models: gate_up_proj (E, 2I, H), down_proj (E, H, I))

# the calls through which such a module multiplies by its weights (grouped, per expert, batched)
_EXPERT_GEMMS = frozenset((torch._grouped_mm, F.grouped_mm, F.linear, torch.mm, torch.bmm,
                           torch.matmul, torch.Tensor.mm, torch.Tensor.bmm, torch.Tensor.matmul,
                           torch.Tensor.__matmul__))


def expert_weights(module: nn.Module) -> list:
    """The module's own 3D QTensor parameters if it holds stacked expert weights, else []: not
    torch.nn's own modules (a Conv1d's or ConvTranspose1d's weight is 3D too)."""
    if type(module).__module__.startswith("torch.nn."):
        return []
    return [p for p in module._parameters.values() if _is_q(p) and p.dim() == 3]


# gathers of expert weights (transformers' batched_mm: gate_up_proj[expert_ids], one weight per
# token)
_GATHERS = frozenset((torch.Tensor.__getitem__, torch.index_select, torch.Tensor.index_select))
# GEMMs that transformers' batched_mm calls with the weight first (W @ x): run as (x^T W^T)^T
_SWAPPABLE = frozenset((torch.mm, torch.bmm, torch.matmul, torch.Tensor.mm, torch.Tensor.bmm,
                        torch.Tensor.matmul, torch.Tensor.__matmul__))


class _TagExperts(torch.overrides.TorchFunctionMode):
    """Inside an experts module's forward: each GEMM with one of its weights (a view of it:
    transposed, one expert's slice, the per-token gather of batched_mm) is a linear layer's: its
    operands tagged as x and W (``gemm``; None: their own formats), x the first operand, so that
    the output takes the activation's value format (an op's output takes its first QTensor's),
    not the weight's."""

    def __init__(self, storages, gemm):
        super().__init__()
        self.storages = storages
        self.gemm = gemm
        self.gathered = {}  # id -> weakref of the gathers of a weight

    def _is_weight(self, t) -> bool:
        if not _is_q(t):
            return False
        ref = self.gathered.get(id(t))
        return (ref is not None and ref() is t) or (
            t._data.untyped_storage().data_ptr() in self.storages)

    def _tag(self, x, w):
        g = self.gemm
        if g is None:
            return x, w
        return (tag(x, g.fprop_x, g.wgrad_x, g.wgrad_dy, g.fprop_transform, g.wgrad_transform),
                tag(w, g.fprop_w, g.dgrad_w, g.dgrad_dy, g.fprop_transform, g.dgrad_transform))

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _GATHERS and args and self._is_weight(args[0]):
            out = func(*args, **kwargs)
            if _is_q(out):
                self.gathered[id(out)] = weakref.ref(out)
            return out
        if func in _EXPERT_GEMMS and len(args) >= 2:
            wpos = 1 if self._is_weight(args[1]) else 0 if self._is_weight(args[0]) else None
            if wpos is not None:
                x, w = self._tag(args[1 - wpos], args[wpos])
                with _forward_gemm():
                    if wpos == 1:
                        return func(x, w, *args[2:], **kwargs)
                    if (func in _SWAPPABLE and len(args) == 2 and not kwargs
                            and w.dim() >= 2 and x.dim() >= 2):
                        return func(x.transpose(-2, -1), w.transpose(-2, -1)).transpose(-2, -1)
                    return func(w, x, *args[2:], **kwargs)
        return func(*args, **kwargs)


class ExpertsForward:
    """``forward`` of a converted experts module: its own forward, each contraction with one of
    its stacked weights run as a linear layer's GEMMs (under ``Recipe.gemm``, x and W tagged with
    the per-GEMM formats, so that the backward's grouped GEMMs take dgrad's and wgrad's). Without
    Recipe.gemm (``gemm`` None) only transformers' batched_mm implementation needs it (its GEMMs
    put the weight first); other implementations run the module's own forward as it is."""

    def __init__(self, module: nn.Module, gemm):
        self.module = module
        self.gemm = gemm

    @property
    def __wrapped__(self):
        return type(self.module).forward.__get__(self.module)

    def __call__(self, *args, **kwargs):
        m = self.module
        if self.gemm is None and getattr(getattr(m, "config", None), "_experts_implementation",
                                         None) != "batched_mm":
            return type(m).forward(m, *args, **kwargs)
        return self._tagged(*args, **kwargs)

    # (as GemmForward: the tags are Python state that tracing does not keep; eager, same bits)
    @torch.compiler.disable
    def _tagged(self, *args, **kwargs):
        m = self.module
        storages = {p._data.untyped_storage().data_ptr() for p in expert_weights(m)}
        with _TagExperts(storages, self.gemm):
            return type(m).forward(m, *args, **kwargs)
