"""The rounding of a converted model as it runs: its root's forward (:class:`ConvertedForward`:
inputs and outputs rounded inside it), the module hooks that round outputs (or keep a module
plain) and their gradients, the buffer hook (in-place updates the ops do not announce) and the
parameters' gradient hook. Small callable objects, not closures, so that a converted model
pickles and deep-copies.
"""
from __future__ import annotations

from typing import List, Optional

import torch
from torch import nn
from torch.utils._pytree import tree_map

from ..kernels.ops import quantize
from .plans import _FP32, ModulePlan, Role, TensorPlan, _is_q, _plain, round_to
from ..tensor.subclass import _accum_of, _grad_values, grad_with_accum, refuse_transformed

__all__ = ["ConvertedForward"]


_ACT_TAG = "_qt_act"


def _round_activation(x, plan: ModulePlan, what: str = "output"):
    """Round one floating tensor of a module's inputs/outputs to the activation and grad roles."""
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        return x
    if not torch.compiler.is_dynamo_compiling():
        refuse_transformed(x, f"the output of {plan.name or 'the model'} (or its input)")
    key = (plan.activation, plan.grad)
    # dynamo cannot compare versions (data-dependent): it rounds again, which changes nothing
    tag = None if torch.compiler.is_dynamo_compiling() else getattr(x, _ACT_TAG, None)
    if tag is not None and tag[0] == key and tag[1] == x._version:
        return x  # already done (e.g. a container returning its last child's output)
    y = x
    # grad role None with a rounded activation: the gradient is FP32 without an operand format
    # (else it would inherit the activation's mm_fmt through the ops and be rounded to it in the
    # backward contractions)
    grad = plan.grad
    if grad.full_precision and not plan.activation.full_precision:
        grad = Role(_FP32)
    # (while dynamo traces, no layer name: it would be a guard, and each layer's hook a graph)
    name = (f"{what} of a compiled module" if torch.compiler.is_dynamo_compiling()
            else f"{what} of {plan.name or 'the model'}")
    if not grad.full_precision and torch.is_grad_enabled() and x.requires_grad:
        y = _RoundActivation.apply(x, plan.activation, grad, name)
    elif not plan.activation.full_precision:
        y = round_to(x, plan.activation, name=name, kind="activation")
    if y is not x:
        try:
            setattr(y, _ACT_TAG, (key, y._version))
        except (AttributeError, RuntimeError):
            pass
    return y


class _RoundActivation(torch.autograd.Function):
    """Forward: round to the activation role (a new tensor, never a view, so that in-place ops
    such as ReLU(inplace=True) may follow). Backward: round the gradient to the grad role; it
    keeps its accumulator, else takes the activation's (as quantize_grad). One autograd node
    instead of as_qtensor + quantize_grad."""

    @staticmethod
    def forward(ctx, x, act: Role, grad: Role, name: str = "tensor"):
        # (a DTensor of QTensors, under tensor parallelism, is no plain input)
        ctx.grad_role = grad
        ctx.name = name
        ctx.plain_input = not (_is_q(x) or _is_q(getattr(x, "_local_tensor", None)))
        ctx.accum = _accum_of(x)
        if act.full_precision:  # values left as they are (a copy: never a view)
            return x.clone()
        return round_to(x.detach(), act, name=name, kind="activation")

    @staticmethod
    def backward(ctx, g):
        accum = ctx.accum
        if torch.compiler.is_compiling() and _is_q(g):
            # dynamo traces this for a guessed gradient, a QTensor in the output's formats,
            # which round_to would pass as is (activation and grad roles alike), but when run
            # it may come plain (the output dequantized in the compiled code): round its values
            accum = _accum_of(g) or accum
            g = _grad_values(g)
        q = grad_with_accum(round_to(g, ctx.grad_role, name=f"gradient of the {ctx.name}",
                                     kind="grad"), accum)
        # a plain input gets a plain gradient (as as_qtensor does), with the rounded values
        return (_plain(q) if ctx.plain_input else q), None, None, None  # (a DTensor too)


def _to_plain(x):
    # differentiable: QTensor.dequantize is straight-through under autograd
    return x.dequantize() if _is_q(x) else x


class _OutputHook:
    what = "output"

    def __init__(self, plan: ModulePlan):
        self.plan = plan

    def _one(self, t):
        return _to_plain(t) if self.plan.plain else _round_activation(t, self.plan, self.what)

    def __call__(self, module, args, output):
        return tree_map(self._one, output)


class _InputHook(_OutputHook):
    what = "input"

    def __call__(self, module, args, kwargs):
        return tree_map(self._one, args), tree_map(self._one, kwargs)


class ConvertedForward:
    """``model.forward`` of a converted model: its inputs and outputs rounded inside forward, not
    by hooks on the root. ``torch.compile(model)`` runs the root's hooks as frames of their own,
    outside the compiled forward, and PyTorch 2.13's dynamo with ``dynamic=True`` cannot build
    the guards of a frame whose input is a tensor subclass that another dynamic frame returned
    ("sources must not be empty for symbol ..."). Inside forward, it is one frame. (So hooks
    a user puts on the root see its inputs as given and its outputs rounded.)"""

    def __init__(self, module: nn.Module, inputs: Optional[_InputHook], outputs: _OutputHook):
        self.module = module
        self.inputs = inputs
        self.outputs = outputs

    # the model's own forward, for its signature (inspect.signature follows __wrapped__) and its
    # code: torch.export reads both from model.forward
    @property
    def __wrapped__(self):
        return type(self.module).forward.__get__(self.module)

    @property
    def __code__(self):
        return type(self.module).forward.__code__

    inner = None  # a GemmForward when the root is a Linear/Conv under Recipe.gemm

    def __call__(self, *args, **kwargs):
        if self.inputs is not None:
            args, kwargs = self.inputs(self.module, args, kwargs)
        if self.inner is not None:
            out = self.inner(*args, **kwargs)
        else:
            out = type(self.module).forward(self.module, *args, **kwargs)
        return self.outputs(self.module, args, out)


class _BufferHook:
    """Re-round buffers an op updated in place without saying so: aten.native_batch_norm writes
    running_mean/running_var, but its schema does not mark them as mutated, so QTensor dispatch
    cannot round them. Runs after forward in training mode only; idempotent when the values are
    already in format."""

    def __init__(self, names: List[str]):
        self.names = list(names)

    def __call__(self, module, args, output):
        if not module.training:
            return None
        with torch.no_grad():
            for name in self.names:
                b = module._buffers.get(name)
                if _is_q(b):
                    # round the payload itself: bumping the QTensor's version counter would
                    # break backward (native_batch_norm saves the running stats)
                    payload = b.dequantize()
                    payload.copy_(quantize(payload, b.fmt))
        return None


class _GradHook:
    def __init__(self, plan: TensorPlan):
        self.plan = plan  # plan.grad is Role() (a plain gradient) for parameters left plain

    def __call__(self, g):
        if g.layout == torch.sparse_coo:  # nn.Embedding(sparse=True): round the values
            g = g.coalesce()
            v = _plain(round_to(g.values(), self.plan.grad, name=f"gradient of {self.plan.name}",
                                kind="grad"))
            return torch.sparse_coo_tensor(g.indices(), v, g.shape, is_coalesced=True,
                                           check_invariants=False)  # indices of g
        return round_to(g, self.plan.grad, name=f"gradient of {self.plan.name}", kind="grad")
