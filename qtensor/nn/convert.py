"""Model conversion: ``qt.convert(model, spec)``, recipes and per-parameter rules.

``qt.convert(model, spec)`` turns a model into a low-precision emulation of itself, in place, and
returns it; ``qt.unconvert(model)`` restores plain tensors and removes every hook. ``spec`` is a
format, a format string, a pair ``(value_fmt, mm_fmt)``, a :class:`Recipe` or the name of a
preset in ``qt.recipes`` (a name that is also a format, ``"mxfp6"`` or ``"fp16"``, is refused).

- Parameters are swapped in place (``torch.utils.swap_tensors``: the same Python objects) for
  QTensors of their role's format; floating buffers are reassigned; integer buffers are left alone.
- The model's inputs and every module's outputs are rounded to the activation role, and their
  gradients and every converted parameter's gradient to the grad role (module and tensor hooks).
- Optimizer state and FP32 master weights are kept by the step hooks of qtensor.nn.training.
- ``rules`` override roles by qualified name (exact name, then pattern, then enclosing module,
  then the role's default); a rule that matches nothing is a warning (strict=True: an error).
- Converting twice with the same spec does nothing; with another spec it is an error.

This module runs the conversion's steps and undoes them; its parts are modules of their own:
the rules and plans (:mod:`.rules`, :mod:`.conversion`), the swap of the rounded values
(:mod:`.swap`), the converted forward and hooks (:mod:`.hooks`) and ``qt.describe``
(:mod:`.describe`).

Roles, rules, precedence and every detail: docs/convert.md.
"""

from __future__ import annotations


import torch
from torch import nn

from . import distributed, gemm_forward as _gemm, masters, training
# (F401: names this module had before its parts were modules of their own: conversion_of, which
# other modules import from here, and the classes a converted model's pickle names here)
from .conversion import _Conversion, _owners, _plan, conversion_of, is_converted, plan_of  # noqa: F401
from .describe import describe
from .hooks import ConvertedForward, _BufferHook, _GradHook, _InputHook, _OutputHook  # noqa: F401
from .plans import (ROLE_NAMES, ModulePlan, Recipe, Role, TensorPlan, _is_q, _plain, gemm_for,
                    GEMMS, GemmFormats, last_layers_count)
from .spec import as_recipe
from .swap import (_FlatWeights, _replaced_warning, _round_values, _swap_buffers, _swap_param,
                   _swap_params)

__all__ = ["Role", "Recipe", "TensorPlan", "ModulePlan", "convert", "unconvert", "describe",
           "is_converted", "plan_of", "ROLE_NAMES", "as_recipe"]


# (attach, detach) pairs that modules above this one register (qtensor/integrations/hf.py): called on each
# model qt.convert converts and qt.unconvert restores. A slot, not an argument: users call
# qt.convert, and integrations/ sits above nn/ (attention_hooks reads this module's table)
_model_hooks: list = []


def register_model_hooks(attach, detach) -> None:
    """Call ``attach(model)`` at the end of each qt.convert and ``detach(model)`` in unconvert."""
    _model_hooks.append((attach, detach))




def _attach(conv: _Conversion) -> None:
    """Put the plans and gradient hooks on the parameters (tensor attributes and tensor hooks)."""
    masters.bump_epoch()
    for mod, local, plan in conv.hooked_params:
        p = mod._parameters[local]
        distributed.remember_plan(mod, local, plan, _GradHook)  # for FSDP2's sharded parameters
        if not plan.value.full_precision:
            p._qt_plan = plan
        if p.requires_grad:
            conv.param_handles.append(p.register_hook(_GradHook(plan)))


def _reattach_hook(model, args):
    # A deep copy of a converted model copies its modules, hooks and _qt_conversion, but a copied
    # tensor keeps neither its attributes nor its hooks: attach them again on first use. (A flag
    # on the conversion, not a set of models: torch.compile guards on what the hook reads, and a
    # guard on a weak set's members breaks when another model is freed meanwhile.)
    conv = getattr(model, "_qt_conversion", None)
    if conv is not None and not conv.attached:
        conv.param_handles = []
        _attach(conv)
        conv.attached = True
    distributed.check_ddp_forward(model)  # inside a DDP's forward: its options (once per DDP)
    return None


def _check_convertible(model: nn.Module) -> None:
    """A model that contains an already converted submodule cannot be converted, nor one whose
    forward is an instance attribute (convert wraps the class's forward). Checked before any
    change to the model."""
    if isinstance(model.__dict__.get("_apply"), _NoDtypeCast):
        # a submodule of a converted model: converting it would round its tensors and add its
        # hooks a second time
        raise RuntimeError(
            "qt.convert: this module is part of an already converted model (qt.convert or "
            "model.to(fmt) of the model that contains it); converting it too would round its "
            "tensors and hook it twice. To give it other formats, convert the whole model with a "
            "rule for it: model.to(qt.Recipe.uniform(fmt, rules={'<its name>': other_fmt})) "
            "(converts the model again), or qt.unconvert(model) first")
    if "forward" in model.__dict__:
        raise ValueError("qt.convert: this model's forward is an instance attribute "
                         f"({model.__dict__['forward']!r}); qt.convert wraps the class's forward")
    for mname, mod in model.named_modules():
        if mname and getattr(mod, "_qt_conversion", None) is not None:
            raise RuntimeError(
                f"qt.convert: submodule {mname!r} is already converted; call "
                f"qt.unconvert(model.{mname}) first")


def _attach_grad_hooks(model: nn.Module, conv: _Conversion, params) -> None:
    """Converted parameters get gradients in their grad role; parameters left in full precision
    get plain gradients (so their optimizer update stays plain too)."""
    for owners in params.values():
        mod, local, qual = owners[0]
        plan = conv.tensor_plans.get(qual)
        if plan is not None:
            conv.hooked_params.append((mod, local, plan))
    _attach(conv)
    conv.attached = True
    conv.handles.append(model.register_forward_pre_hook(_reattach_hook))


def _attach_activation_hooks(model: nn.Module, conv: _Conversion) -> None:
    """The root rounds its inputs and outputs in its forward; every other module that rounds (or
    is kept plain) gets hooks."""
    root_plan = conv.module_plans[""]
    rounds = not (root_plan.activation.full_precision and root_plan.grad.full_precision)
    if rounds or root_plan.plain:
        model.forward = ConvertedForward(model, _InputHook(root_plan) if rounds else None,
                                         _OutputHook(root_plan))
    for mname, mod in model.named_modules():
        mplan = conv.module_plans[mname]
        if not mname:
            continue  # the root's rounding is in its forward
        if mplan.plain:  # a rule keeps this module in full precision: plain inputs and outputs
            conv.handles.append(mod.register_forward_pre_hook(_InputHook(mplan),
                                                              with_kwargs=True))
        elif mplan.activation.full_precision and mplan.grad.full_precision:
            continue
        conv.handles.append(mod.register_forward_hook(_OutputHook(mplan)))


def _install_experts(model: nn.Module, conv: _Conversion) -> None:
    """MoE experts modules (stacked 3D weights): their GEMMs run as linear layers'
    (gemm_forward.ExpertsForward): Recipe.gemm's per-GEMM formats unless a rule decides the
    module or its weights; with or without them, the weight-first GEMMs of transformers'
    batched_mm take the activation's value format."""
    recipe = conv.recipe
    linear = None if recipe.gemm is None else gemm_for(recipe.gemm, "linear")
    for mname, mod in model.named_modules():
        if not _gemm.expert_weights(mod) or (mname and "forward" in mod.__dict__):
            continue
        prefix = f"{mname}." if mname else ""
        mplan = conv.module_plans.get(mname)
        ruled = (mplan is not None and mplan.rule is not None) or any(
            conv.tensor_plans[prefix + n].rule is not None
            for n, p in mod._parameters.items() if prefix + n in conv.tensor_plans)
        fwd = _gemm.ExpertsForward(mod, None if ruled else linear)
        if not mname and isinstance(model.__dict__.get("forward"), ConvertedForward):
            model.forward.inner = fwd
        else:
            mod.forward = fwd


def _install_gemm(model: nn.Module, conv: _Conversion) -> None:
    """Recipe.gemm: every converted Linear/Conv1d/2d/3d (its own forward, weight a QTensor)
    that no rule decides (neither the module nor its weight) runs its GEMMs in the per-GEMM
    formats (qtensor.tensor.gemm); a module or weight a rule decides keeps its roles' mm_fmt, unless the
    module's rule gives "gemm" (its per-GEMM formats, which win over everything else). So do
    MoE experts modules (stacked 3D weights: gemm_forward.ExpertsForward), as linear layers.
    Recipe.last_layers: the last of those layers (model order, rules or not) run every GEMM
    operand in its format instead."""
    recipe = conv.recipe
    ruled = {p for p, spec in recipe.rules.items() if isinstance(spec, dict) and "gemm" in spec}
    _install_experts(model, conv)
    if recipe.gemm is None and recipe.last_layers is None and not ruled:
        return
    layers = [(mname, mod) for mname, mod in model.named_modules()
              if _gemm.kind_of(mod) is not None and _is_q(mod._parameters.get("weight"))
              and not (mname and "forward" in mod.__dict__)]  # a forward of its own: kept
    last = set()
    if recipe.last_layers is not None:  # every operand of their GEMMs in this format
        fmt = recipe.last_layers[1]
        last = {mname for mname, _ in layers[len(layers) - last_layers_count(
            recipe.last_layers, len(layers)):]}
        high = GemmFormats(**{f"{gemm}_{o}": fmt for gemm, ops in GEMMS.items() for o in ops})
    for mname, mod in layers:
        mplan = conv.module_plans.get(mname)
        if mplan is not None and mplan.rule in ruled:
            g = gemm_for(recipe.rules[mplan.rule]["gemm"], _gemm.kind_of(mod))
        elif mname in last:
            g = high
        else:
            g = None if recipe.gemm is None else gemm_for(recipe.gemm, _gemm.kind_of(mod))
            wplan = conv.tensor_plans.get(f"{mname}.weight" if mname else "weight")
            if (wplan is not None and wplan.rule is not None) or (
                    mplan is not None and mplan.rule is not None):
                continue
        if g is None:
            continue
        conv.gemms[mname] = g
        if not mname and isinstance(model.__dict__.get("forward"), ConvertedForward):
            model.forward.inner = _gemm.GemmForward(mod, g, mname)
        else:
            mod.forward = _gemm.GemmForward(mod, g, mname)


def convert(model: nn.Module, spec, *, strict: bool = False) -> nn.Module:
    """Convert ``model`` in place to the formats of ``spec`` (a format, a string or a Recipe).

    Returns the model. A rule that matches no name of the model is a warning (an error with
    ``strict=True``). Roles, rules, precedence and hooks: docs/convert.md.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"qt.convert expects an nn.Module, got {type(model).__name__}")
    distributed.check_unwrapped(model)  # DDP(model), fully_shard(model): convert, then wrap
    recipe = as_recipe(spec)
    existing = getattr(model, "_qt_conversion", None)
    if existing is not None:
        if existing.recipe == recipe:
            _reattach_hook(model, ())  # (a deep copy: re-attach its parameters' hooks)
            return model  # idempotent
        raise RuntimeError(
            "qt.convert: this model is already converted with a different recipe; call "
            "qt.unconvert(model) first, then convert it again")
    _check_convertible(model)

    params = _owners(model, "_parameters")
    conv, todo_params, todo_buffers = _plan(model, recipe, params, _owners(model, "_buffers"),
                                            strict)
    new_params, new_buffers = _round_values(recipe, todo_params, todo_buffers)
    _swap_params(model, conv, new_params)
    _swap_buffers(conv, new_buffers)
    _attach_grad_hooks(model, conv, params)
    _attach_activation_hooks(model, conv)
    _install_gemm(model, conv)

    _disable_nested_fast_path(model, conv)
    for mod in model.modules():
        mod._apply = _NoDtypeCast(mod)
    model._qt_conversion = conv
    for attach, _ in _model_hooks:  # (qtensor/integrations/hf.py: a transformers model's save_pretrained)
        attach(model)
    training.install_optimizer_hooks()
    return model


def _disable_nested_fast_path(model: nn.Module, conv: _Conversion) -> None:
    """nn.TransformerEncoder's inference fast path (eval, no_grad, src_key_padding_mask) packs
    its input into a nested tensor and runs every layer as one fused kernel: no QTensor can hold
    a nested tensor, and the fused kernels would skip the emulated ops. A converted encoder takes
    its ordinary path (the padding mask goes to each layer), as in training."""
    for mod in model.modules():
        if isinstance(mod, nn.TransformerEncoder) and getattr(mod, "use_nested_tensor", False):
            conv.nested_off.append(mod)
            mod.use_nested_tensor = False


class _NoDtypeCast:
    """``module._apply`` of a converted module: ``model.half()``, ``.bfloat16()``, ``.double()``
    and ``.to(dtype)`` change every payload's dtype but not the formats, and the next forward
    mixes payload dtypes; they are refused at the call (device moves pass)."""

    def __init__(self, module: nn.Module):
        self.module = module

    def __call__(self, fn, recurse=True):
        probe = torch.zeros(())
        try:
            dtype = fn(probe).dtype
        except Exception:  # e.g. .cuda() without CUDA: _apply raises its own error
            dtype = probe.dtype
        if dtype != probe.dtype:
            dtype = str(dtype).replace("torch.", "")
            raise RuntimeError(
                f"qt.convert: this model is converted, and casting it to {dtype} (model.half(), "
                ".bfloat16(), .double(), .to(dtype)) is not supported: its formats decide its "
                "precision. To emulate FP16 or BF16, convert to that format instead: "
                "qt.unconvert(model), then qt.convert(model, qt.fp16) (or qt.bf16); to run in "
                f"torch's own {dtype}, call qt.unconvert(model) first.")
        return type(self.module)._apply(self.module, fn, recurse)


def unconvert(model: nn.Module) -> nn.Module:
    """Undo qt.convert: plain parameters (the same objects), buffers and gradients, in their
    original dtypes, with the values they have now; no hooks."""
    conv = getattr(model, "_qt_conversion", None)
    if conv is None:
        raise RuntimeError("qt.unconvert: this model was not converted by qt.convert")
    for handle in conv.handles + conv.param_handles:
        handle.remove()
    for mod in model.modules():
        if isinstance(mod.__dict__.get("forward"),
                      (ConvertedForward, _gemm.GemmForward, _gemm.ExpertsForward)):
            del mod.__dict__["forward"]
    for _, detach in _model_hooks:
        detach(model)
    for mod in model.modules():
        if isinstance(mod.__dict__.get("_apply"), _NoDtypeCast):
            del mod.__dict__["_apply"]
        distributed.forget_plans(mod)
    for mod in conv.nested_off:
        mod.use_nested_tensor = True
    replaced, moved = [], {}
    with _FlatWeights(model):
        for mod, local, qual in conv.converted_params:
            p = mod._parameters.get(local)
            if p is None or not _is_q(p):
                continue
            dtype = conv.dtypes.get(qual, p.dtype)
            with torch.no_grad():
                value = p.dequantize().detach().to(dtype, copy=True)
                grad = None if p.grad is None else _plain(p.grad).detach().to(dtype, copy=True)
            owners = [(m, n, q) for m, n, q in conv.converted_params if m._parameters.get(n) is p]
            p.__dict__.pop("_qt_plan", None)
            param, why = _swap_param(owners, value, grad)
            moved[id(p)] = (p, param)
            if why is not None:
                replaced.append((qual, why))
    for mod, local, qual in conv.converted_buffers:
        b = mod._buffers.get(local)
        if b is not None and _is_q(b):
            mod._buffers[local] = b.dequantize().detach().to(conv.dtypes.get(qual, b.dtype),
                                                             copy=True)
    conv.attached = False
    del model._qt_conversion
    training.unconvert_optimizers(moved)
    _replaced_warning(
        "qt.unconvert", replaced,
        "the optimizers that stepped the model hold the new one, but other references taken "
        "before qt.unconvert (weak references, lists of parameters) still see the converted one.")
    masters.bump_epoch()
    return model
