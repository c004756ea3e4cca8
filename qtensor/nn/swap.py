"""The rounded values into the model: each converted parameter swapped in place
(``torch.utils.swap_tensors``: the same Python object, so that optimizers and other references
follow; a new Parameter, with one warning, where something else holds the tensor), and the
buffers reassigned with the hook that keeps them in format. Nothing is swapped until every
value is rounded: an error leaves the model as it was.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch
from torch import nn

from . import training
from .conversion import _Conversion
from .hooks import _BufferHook
from .plans import Recipe, _is_q, _plain, round_to
from ..warn import warn as _warn, warn_once as _warn_once


def _swap_param(owners, new_value: torch.Tensor, new_grad) -> Tuple[torch.Tensor, Optional[str]]:
    """Make every owner's parameter hold ``new_value``: (the parameter object, None), or
    (a new Parameter object, why) when the object could not be kept.

    swap_tensors keeps the Python object (so optimizers and other references follow). It is
    refused while something else holds the tensor (an autograd graph still alive from a forward
    before conversion, a weak reference); then the owners get a new Parameter object instead
    (the callers say so in one warning, and re-point the optimizers they know of).
    """
    module, pname = owners[0][0], owners[0][1]
    param = module._parameters[pname]
    requires_grad = param.requires_grad
    old_grad = param.grad
    if old_grad is not None:
        param.grad = None  # holding .grad blocks the swap (use count)
    new_param = nn.Parameter(new_value, requires_grad=requires_grad)
    why = None
    try:
        torch.utils.swap_tensors(param, new_param)
    except RuntimeError as e:
        if old_grad is not None:
            param.grad = old_grad
        why = str(e)
        param = new_param
        for mod, local, _q in owners:
            mod._parameters[local] = param
    if new_grad is not None:
        param.grad = new_grad
    return param, why


def _replaced_warning(who: str, replaced: List[Tuple[str, str]], consequence: str) -> None:
    if replaced:
        reasons = sorted({why for _name, why in replaced})
        _warn(f"{who}: {', '.join(name for name, _why in replaced)} could not be changed in place "
              f"({'; '.join(reasons)}); each was replaced by a new Parameter object, so "
              f"{consequence}")


class _FlatWeights:
    """RNN modules keep weak references to their parameters (which block swap_tensors): drop
    them around the swap and rebuild them after, as nn.RNNBase._apply does."""

    def __init__(self, model: nn.Module):
        self.mods = [m for m in model.modules() if hasattr(m, "_flat_weight_refs")]

    def __enter__(self):
        for m in self.mods:
            m._flat_weight_refs = []

    def __exit__(self, *exc):
        for m in self.mods:
            if hasattr(m, "_init_flat_weights"):
                m._init_flat_weights()


def _round_values(recipe: Recipe, todo_params: list, todo_buffers: list) -> Tuple[list, list]:
    """The new values (and parameter gradients), rounded to their plans; nothing is swapped yet,
    so an error names the tensor and leaves the model untouched."""
    new_params = []
    for owners, plan in todo_params:
        mod, local, qual = owners[0]
        p = mod._parameters[local]
        with torch.no_grad():
            value = round_to(_plain(p.detach()), plan.value, name=qual, kind=plan.kind)
            if recipe.accumulate is not None and _is_q(value):
                value.accum = recipe.accumulate  # every contraction with it sums this way
            grad = None if p.grad is None else round_to(_plain(p.grad), plan.grad,
                                                        name=f"{qual}.grad")
        new_params.append((owners, plan, value, grad))
    new_buffers = []
    for owners, plan in todo_buffers:
        mod, local, qual = owners[0]
        with torch.no_grad():
            value = round_to(_plain(mod._buffers[local]), plan.value, name=qual)
        new_buffers.append((owners, plan, value))
    return new_params, new_buffers


def _swap_params(model: nn.Module, conv: _Conversion, new_params: list) -> None:
    """Put the rounded values into the parameters (the same objects where possible)."""
    replaced, moved = [], {}
    with _FlatWeights(model):
        for owners, plan, value, grad in new_params:
            old = owners[0][0]._parameters[owners[0][1]]
            param, why = _swap_param(owners, value, grad)
            if why is not None:
                replaced.append((plan.name, why))
                moved[id(old)] = (old, param)
            conv.converted_params.extend((mod, local, plan.name) for mod, local, _q in owners)
    training.follow_replaced(moved)
    _replaced_warning(
        "qt.convert", replaced,
        "references taken before conversion (an optimizer created before it, a weak reference) "
        "do not see it. Convert before creating optimizers, and drop outputs computed before "
        "conversion (or call qt.convert under torch.no_grad()).")


def _swap_buffers(conv: _Conversion, new_buffers: list) -> None:
    """Put the rounded buffers into their modules, with the hooks that keep them in format."""
    for owners, plan, value in new_buffers:
        for mod, local, _qual in owners:
            mod._buffers[local] = value
            conv.converted_buffers.append((mod, local, plan.name))
    by_module: Dict[int, Tuple[nn.Module, List[str]]] = {}
    for mod, local, _qual in conv.converted_buffers:
        by_module.setdefault(id(mod), (mod, []))[1].append(local)
    for mod, names in by_module.values():
        conv.handles.append(mod.register_forward_hook(_BufferHook(names)))
    if conv.skipped:
        _warn_once("qt.convert: non-floating tensors are left alone, although a rule names "
                   "them: " + ", ".join(conv.skipped))
