"""Sensitivity: one copy of the model per layer (or per role of a layer) in which only that
layer (role) takes the recipe's formats, run against the FP32 reference (the change in loss,
the KL of the outputs, the gradient cosine). :func:`convert_one_layer` builds such a copy.
"""
from __future__ import annotations

import copy
import dataclasses
import warnings
from typing import Any, Dict, Optional

from torch import nn

from ..nn.conversion import conversion_of
from ..nn.convert import convert
from ..nn.hooks import _InputHook
from ..nn.plans import _FP32, GemmFormats, ModulePlan, Recipe, Role
from ..nn.spec import as_recipe
from .layers import ROLES, _layer_plans, _lossy
from .runs import _compare, _run

__all__ = ["convert_one_layer", "gemm_part", "ROLE_GEMM_FIELDS", "sensitivity_rows"]


# the per-GEMM fields (GemmFormats) of each role of a layer: its weight W, its input x (its
# activation), the gradient dY of its output; and the transforms of the GEMMs they enter
ROLE_GEMM_FIELDS = {"weight": ("fprop_w", "dgrad_w", "fprop_transform", "dgrad_transform"),
                    "activation": ("fprop_x", "wgrad_x", "fprop_transform", "wgrad_transform"),
                    "grad": ("dgrad_dy", "wgrad_dy", "dgrad_transform", "wgrad_transform")}


def gemm_part(g, roles) -> Optional[GemmFormats]:
    """The fields of GemmFormats ``g`` that belong to ``roles`` (:data:`ROLE_GEMM_FIELDS`), the
    others None (their own operand formats); None if none is left."""
    if g is None:
        return None
    keep = {f for r in roles for f in ROLE_GEMM_FIELDS[r]}
    return GemmFormats.of(GemmFormats(**{f.name: getattr(g, f.name)
                                         for f in dataclasses.fields(g) if f.name in keep}))


def _unit_rules(plans: dict, role: str = "all") -> Dict[str, Any]:
    """Rules that give one layer (``plans``: :func:`_layer_plans`) the formats of ``role`` only:
    "all" (its parameters, its output's activation and grad roles), "weight" (its parameters'
    values and optimizer state; FP32 gradients, plain output), "activation" (its output's
    activation role; FP32 gradients, FP32 parameters) or "grad" (the gradients of its output
    and of its parameters; FP32 values, exact)."""
    fp32 = Role(_FP32)
    rules: Dict[str, Any] = {}
    for qual, t in plans["params"].items():
        if role == "all":
            rules[qual] = {t.kind: t.value, "grad": t.grad, "optimizer_state": t.optimizer_state}
        elif role == "weight":
            rules[qual] = {t.kind: t.value, "grad": None, "optimizer_state": t.optimizer_state}
        elif role == "grad" and not t.value.full_precision:
            # an FP32 QTensor (exact): a plain parameter's gradient would not be rounded
            rules[qual] = {t.kind: fp32, "grad": t.grad}
        else:
            rules[qual] = None
    act, grad = plans["activation"], plans["grad"]
    if role == "all":
        rules_m = {"activation": act, "grad": grad}
    elif role == "weight":
        rules_m = {"activation": None, "grad": None}
    elif role == "activation":
        rules_m = {"activation": act, "grad": None}
    else:  # grad: exact FP32 values, so that the output's gradient is rounded
        rules_m = {"activation": fp32 if not grad.full_precision else None, "grad": grad}
    if plans.get("gemm") is not None:  # its GEMMs' formats (those of the role)
        rules_m["gemm"] = gemm_part(plans["gemm"], ROLES if role == "all" else (role,))
    return {"module": rules_m, "params": rules}


def _one_layer_recipe(full: Recipe, conv, layer: str, model: nn.Module,
                      role: str = "all") -> Recipe:
    """A recipe in which only ``layer`` (only its ``role``: :func:`_unit_rules`) takes what the
    full conversion gave it; every other module plain (a rule of None: FP32 parameters, plain
    inputs and outputs, so that the layer's output format does not spread into the modules
    after it)."""
    rules: Dict[str, Any] = {n: None for n, _m in model.named_modules() if n and n != layer}
    unit = _unit_rules(_layer_plans(conv, layer, model), role)
    rules.update(unit["params"])
    rules[layer] = unit["module"]
    return Recipe(rules=rules, accumulate=full.accumulate,
                  name=f"only {layer}" + ("" if role == "all" else f" ({role})"))


def _input_plan(conv, layer: str, role: str) -> Optional[ModulePlan]:
    """The rounding of ``layer``'s inputs in a one-layer run (None: left as they arrive)."""
    mplan = conv.module_plans[layer]
    act, grad = mplan.activation, mplan.grad
    if role == "weight":  # values as they arrive; the gradient that the layer's formats give
        # its input (an op on FP8 weights gives FP8) goes on upstream as a plain FP32 tensor
        return ModulePlan(layer, Role(), Role(_FP32))
    if role == "activation":
        grad = Role()
    elif role == "grad":
        if grad.full_precision:
            return None
        act = Role(_FP32)
    return ModulePlan(layer, act, grad)


def convert_one_layer(model: nn.Module, spec, layer: str, *, role: str = "all",
                      _plans=None) -> nn.Module:
    """Convert ``model`` in place so that only ``layer`` takes ``spec``'s formats: its
    parameters, its outputs and (a forward pre-hook) its inputs, rounded to its activation and
    grad roles as a converted model's preceding module would round them. ``role``: "all", or
    only one role of the layer: "weight" (its parameters), "activation" (its inputs and output)
    or "grad" (the gradients of its inputs, output and parameters). (``_plans``: what
    ``qt.convert(copy, spec)`` planned, when the caller has it.)"""
    if role != "all" and role not in ROLES:
        raise ValueError(f"convert_one_layer: role must be 'all' or one of {ROLES}, got {role!r}")
    recipe = as_recipe(spec)
    conv = _plans if _plans is not None else conversion_of(convert(copy.deepcopy(model), recipe))
    one = _one_layer_recipe(recipe, conv, layer, model, role)
    with warnings.catch_warnings():  # (a tied weight's names meet two of these rules: intended)
        warnings.filterwarnings("ignore", message=".*is tied to .*rules disagree")
        convert(model, one)
    plan = _input_plan(conv, layer, role)
    if plan is not None:
        mod = model.get_submodule(layer)
        handle = mod.register_forward_pre_hook(_InputHook(plan), with_kwargs=True)
        conversion_of(model).handles.append(handle)  # qt.unconvert removes it
    return model


def _progress(items, desc, enabled):
    if not enabled:
        return items
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return items
    return tqdm(items, desc=desc, leave=False)


def sensitivity_rows(base: nn.Module, recipe: Recipe, conv, plans: dict, names, roles, ref: dict,
                     inputs, loss_fn, same, progress) -> list:
    """One row per one-layer run against the FP32 run ``ref``: each layer of ``names`` with all
    its formats (role "all"), then, for ``roles`` (True: :data:`ROLES`; a name or some names),
    each role of each of them that rounds anything. ``plans``: :func:`_layer_plans` of the
    layers the caller has them for; ``conv``: what the full conversion planned."""
    runs = [(n, "all") for n in names]
    which = ROLES if roles is True else (() if not roles else tuple(
        [roles] if isinstance(roles, str) else roles))
    bad = [r for r in which if r not in ROLES]
    if bad:
        raise ValueError(f"qt.analyze: roles must be True, False or some of {ROLES}, got "
                         f"{roles!r}")
    if which:
        for n in names:
            p = plans.get(n) or _layer_plans(conv, n, base)
            has = {"weight": any(_lossy(t.value) for t in p["params"].values()),
                   "activation": _lossy(p["activation"]),
                   "grad": _lossy(p["grad"]) or any(
                       _lossy(t.grad) and not t.value.full_precision
                       for t in p["params"].values())}
            runs += [(n, r) for r in which if has[r]]
    rows = []
    for layer, role in _progress(runs, "qt.analyze: layers", progress):
        m = convert_one_layer(copy.deepcopy(base), recipe, layer, role=role, _plans=conv)
        row = {"layer": layer, "role": role, "type": type(m.get_submodule(layer)).__name__}
        row.update(_compare(ref, _run(m, inputs, loss_fn, same)))
        rows.append(row)
    return rows
