"""What ``qt.convert`` plans for a model and keeps on its root (``model._qt_conversion``): every
tensor's and module's plan, computed before the model is touched, and what the conversion
changed (for ``qt.unconvert``, ``qt.describe``, the optimizer hooks and qt.analyze).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn

from .plans import ModulePlan, Recipe, TensorPlan
from .rules import _check_rules_match, _kind, _module_plan, _tensor_plan

__all__ = ["is_converted", "conversion_of", "plan_of"]


@dataclass
class _Conversion:
    """What convert() did to a model (kept on the root module as ``_qt_conversion``)."""

    recipe: Recipe
    tensor_plans: Dict[str, TensorPlan]
    module_plans: Dict[str, ModulePlan]
    handles: list = field(default_factory=list)
    converted_params: list = field(default_factory=list)   # (module, name)
    hooked_params: list = field(default_factory=list)      # (module, name, plan): floating params
    param_handles: list = field(default_factory=list)      # their handles
    converted_buffers: list = field(default_factory=list)  # (module, name)
    skipped: List[str] = field(default_factory=list)       # non-floating tensors rules name
    dtypes: Dict[str, torch.dtype] = field(default_factory=dict)  # original dtypes, by name
    nested_off: list = field(default_factory=list)  # TransformerEncoders: their use_nested_tensor
    gemms: Dict[str, Any] = field(default_factory=dict)  # module name: its GemmFormats, if any
    # whether the model's parameters carry its plans and hooks: a deep copy or an unpickled copy
    # of a converted model is not (its tensors kept neither), so a copy starts False
    attached: bool = False

    def __getstate__(self):
        state = dict(self.__dict__)
        state["attached"] = False
        return state


def is_converted(model: nn.Module) -> bool:
    """Whether ``model`` was converted by qt.convert (and not unconverted since)."""
    return getattr(model, "_qt_conversion", None) is not None


def conversion_of(model: nn.Module):
    """What qt.convert did to ``model`` (its module_plans and tensor_plans), else None."""
    return getattr(model, "_qt_conversion", None)


def plan_of(tensor: torch.Tensor) -> Optional[TensorPlan]:
    """The TensorPlan of a converted parameter (None for anything else)."""
    return getattr(tensor, "_qt_plan", None)


def _owners(model: nn.Module, attr: str) -> Dict[int, List[Tuple[nn.Module, str, str]]]:
    """id(tensor) -> [(module, local name, qualified name)], every owner of shared tensors."""
    out: Dict[int, List[Tuple[nn.Module, str, str]]] = {}
    for mname, mod in model.named_modules(remove_duplicate=False):
        for local, t in getattr(mod, attr).items():
            if t is None:
                continue
            qual = f"{mname}.{local}" if mname else local
            out.setdefault(id(t), []).append((mod, local, qual))
    return out


def _plan_tensors(conv: _Conversion, owners_by_id, is_buffer: bool) -> list:
    """Plan every floating parameter (or buffer) into ``conv``; return [(owners, plan)] of those
    whose values change (non-floating ones that a rule names are recorded as skipped)."""
    todo = []
    for owners in owners_by_id.values():
        mod, local, qual = owners[0]
        t = (mod._buffers if is_buffer else mod._parameters)[local]
        if not t.is_floating_point():
            # left alone silently (num_batches_tracked, bool masks), unless a rule names it
            if any(q in conv.recipe.rules for _m, _l, q in owners):
                conv.skipped.append(qual)
            continue
        kind = "buffer" if is_buffer else _kind(qual)
        aliases = [q for _m, _l, q in owners[1:]]  # tied tensors: every other name
        plan = _tensor_plan(conv.recipe, qual, kind, is_buffer=is_buffer, aliases=aliases)
        conv.tensor_plans[qual] = plan
        conv.dtypes[qual] = t.dtype
        if not plan.value.full_precision:
            todo.append((owners, plan))
    return todo


def _plan(model: nn.Module, recipe: Recipe, params, buffers,
          strict: bool = False) -> Tuple[_Conversion, list, list]:
    """Every plan of the conversion, computed before the model is touched (a bad rule leaves it
    unchanged): the _Conversion and the parameters and buffers whose values change."""
    module_names = [n for n, _ in model.named_modules() if n]
    tensor_names = [q for owners in [*params.values(), *buffers.values()]
                    for _m, _l, q in owners]  # every name of a tied tensor
    _check_rules_match(recipe, tensor_names + module_names, strict)
    conv = _Conversion(recipe, {}, {})
    todo_params = _plan_tensors(conv, params, is_buffer=False)
    todo_buffers = _plan_tensors(conv, buffers, is_buffer=True)
    for mname, mod in model.named_modules():
        conv.module_plans[mname] = _module_plan(recipe, mname)
    return conv, todo_params, todo_buffers
