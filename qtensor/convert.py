"""Model conversion: ``qt.convert(model, spec)``, recipes and per-parameter rules.

``qt.convert(model, spec)`` turns a model into a low-precision emulation of itself, in place, and
returns it; ``qt.unconvert(model)`` restores plain tensors and removes every hook. ``spec`` is a
format, a format string, a pair ``(value_fmt, mm_fmt)``, a :class:`Recipe` or the name of a
preset in ``qt.recipes`` (a name that is also a format, ``"mxfp6"`` or ``"fp16"``, is refused).

- Parameters are swapped in place (``torch.utils.swap_tensors``: the same Python objects) for
  QTensors of their role's format; floating buffers are reassigned; integer buffers are left alone.
- The model's inputs and every module's outputs are rounded to the activation role, and their
  gradients and every converted parameter's gradient to the grad role (module and tensor hooks).
- Optimizer state and FP32 master weights are kept by the step hooks of qtensor.training.
- ``rules`` override roles by qualified name (exact name, then pattern, then enclosing module,
  then the role's default); a rule that matches nothing is a warning (strict=True: an error).
- Converting twice with the same spec does nothing; with another spec it is an error.

Roles, rules, precedence and every detail: docs/convert.md.
"""
from __future__ import annotations

import difflib
import fnmatch
import re
import weakref
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn
from torch.utils._pytree import tree_map

from . import distributed, gemm_forward as _gemm, training
from .ops import quantize
from .plans import (_FP32, ROLE_NAMES, ModulePlan, Recipe, Role, TensorPlan, _is_q, _plain,
                    gemm_for, round_to, GEMMS, GemmFormats, last_layers_count)
from .spec import as_recipe
from .tensor import _accum_of, _grad_values, grad_with_accum, refuse_transformed
from .warn import warn as _warn, warn_once as _warn_once

__all__ = ["Role", "Recipe", "TensorPlan", "ModulePlan", "convert", "unconvert", "describe",
           "is_converted", "plan_of", "ROLE_NAMES", "as_recipe"]


# (attach, detach) pairs that modules above this one register (qtensor/hf.py): called on each
# model qt.convert converts and qt.unconvert restores
_model_hooks: list = []


def register_model_hooks(attach, detach) -> None:
    """Call ``attach(model)`` at the end of each qt.convert and ``detach(model)`` in unconvert."""
    _model_hooks.append((attach, detach))


# ---------------------------------------------------------------------------------------------
# Plans: what each tensor and module gets

def _kind(name: str) -> str:
    last = name.rsplit(".", 1)[-1]
    return "bias" if last.startswith("bias") or last.endswith("bias") else "weight"


def _matches(pattern: str, name: str) -> bool:
    if pattern.startswith("re:"):
        return re.fullmatch(pattern[3:], name) is not None
    return fnmatch.fnmatchcase(name, pattern)


def _is_pattern(pattern: str) -> bool:
    return pattern.startswith("re:") or any(c in pattern for c in "*?[")


def _enclosing(name: str) -> List[str]:
    """Enclosing module names of a qualified name, innermost first ('a.b.c' -> ['a.b', 'a'])."""
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(len(parts) - 1, 0, -1)]


def _ranked_rule(rules: dict, name: str) -> Optional[Tuple[tuple, Tuple[str, Any, bool]]]:
    """(rank, (pattern, spec, matched_name_itself)) of the rule deciding ``name``, per the
    precedence; a smaller rank is a more specific rule (it compares the names of tied tensors)."""
    if not rules:
        return None
    order = {pattern: i for i, pattern in enumerate(rules)}
    scopes = [name] + _enclosing(name)
    for depth, scope in enumerate(scopes):  # 1. exact names, innermost first
        if scope in rules and not scope.startswith("re:"):
            return (1, depth, order[scope]), (scope, rules[scope], scope == name)
    for pattern, spec in rules.items():  # 2. patterns on the name itself, in order
        if _is_pattern(pattern) and _matches(pattern, name):
            return (2, 0, order[pattern]), (pattern, spec, True)
    for depth, scope in enumerate(scopes[1:], 1):  # 3. patterns on enclosing modules
        for pattern, spec in rules.items():
            if _is_pattern(pattern) and _matches(pattern, scope):
                return (3, depth, order[pattern]), (pattern, spec, False)
    return None


def _find_rule(rules: dict, name: str) -> Optional[Tuple[str, Any, bool]]:
    """(pattern, spec, matched_name_itself) of the rule deciding ``name``, per the precedence."""
    ranked = _ranked_rule(rules, name)
    return None if ranked is None else ranked[1]


def _find_rule_tied(rules: dict, name: str, aliases) -> Optional[Tuple[str, Any, bool]]:
    """The rule deciding a tensor known by several names (tied weights: ``lm_head.weight`` is
    ``wte.weight``): the most specific rule over all its names, by the precedence; between
    equally specific rules, the earlier one in ``rules``. Disagreeing rules are warned about."""
    ranked = [(r, n) for n in [name, *aliases] for r in [_ranked_rule(rules, n)] if r is not None]
    if not ranked:
        return None
    (_rank, best), best_name = min(ranked, key=lambda item: item[0][0])
    losers = sorted({r[1][0] for r, _n in ranked if r[1][1] != best[1]})
    if losers:
        _warn(f"qt.convert: {name} is tied to {', '.join(aliases)}, and rules disagree on it: "
              f"{best[0]!r} (for {best_name}) applies, not {', '.join(map(repr, losers))} (the "
              "most specific rule over all its names wins; between equals, the earlier rule)")
    return best


def _tensor_plan(recipe: Recipe, name: str, kind: str, is_buffer: bool,
                 aliases=()) -> TensorPlan:
    default_value = Role(recipe.weight.fmt) if is_buffer else getattr(recipe, kind)
    value, grad, state = default_value, recipe.grad, recipe.optimizer_state
    found = _find_rule_tied(recipe.rules, name, aliases)
    pattern = None
    if found is not None:
        pattern, spec, _own = found
        if isinstance(spec, Role):
            value = spec
            if spec.full_precision:
                grad, state = Role(), Role()
        else:
            key = "weight" if is_buffer else kind
            if key in spec:
                value = Role(spec[key].fmt) if is_buffer else spec[key]
            grad = spec.get("grad", grad)
            state = spec.get("optimizer_state", state)
    if value.full_precision:
        grad, state = Role(), Role()
    if is_buffer:
        grad, state = Role(), Role()
    master = recipe.master_weights and not value.full_precision and not is_buffer
    if master and not state.full_precision:
        raise ValueError(
            f"{name}: master_weights=True runs the optimizer in FP32, but a rule ({pattern!r}) "
            f"gives it optimizer_state {state}")
    if not value.full_precision and not is_buffer:
        # Full precision for the gradient or optimizer state of a QTensor parameter: FP32
        # QTensors, so that the optimizer's arithmetic meets no plain tensors (no leaks)
        if grad.full_precision:
            grad = Role(_FP32)
        if state.full_precision and not master:
            state = Role(_FP32)
    return TensorPlan(name, "buffer" if is_buffer else kind, value, grad, state, master, pattern)


def _module_plan(recipe: Recipe, name: str) -> ModulePlan:
    act, grad = recipe.activation, recipe.grad
    found = _find_rule(recipe.rules, name) if name else None
    pattern = None
    if found is not None:
        pattern, spec, _own = found
        if isinstance(spec, Role):
            act = spec
            if spec.full_precision:
                grad = Role()
        else:
            act = spec.get("activation", act)
            grad = spec.get("grad", grad)
    plain = found is not None and act.full_precision and (
        isinstance(found[1], Role) or "activation" in found[1])
    return ModulePlan(name, act, grad, pattern, plain)


def _check_rules_match(recipe: Recipe, names: List[str], strict: bool) -> None:
    """Rules that match no name: an error with strict=True, else one warning (so that one
    recipe serves models that lack some of the names it has rules for)."""
    unmatched = []
    for pattern in recipe.rules:
        if any(_matches(pattern, n) if _is_pattern(pattern) else pattern == n for n in names):
            continue
        probe = pattern[3:] if pattern.startswith("re:") else pattern
        near = difflib.get_close_matches(probe, names, n=6, cutoff=0.3)
        if not near:
            near = names[:6]
        unmatched.append(
            f"rule {pattern!r} matches no parameter, buffer or module of the model; "
            f"nearest names: {', '.join(near) if near else '(the model has no names)'}")
    if not unmatched:
        return
    if strict:
        raise ValueError("qt.convert: " + "; ".join(unmatched))
    _warn("qt.convert: " + "; ".join(unmatched) + " (left unused; qt.convert(..., strict=True) "
          "makes this an error)")


# ---------------------------------------------------------------------------------------------
# Hooks

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


# The hooks are small callable objects rather than closures so that a converted model pickles
# (torch.save(model)) and deep-copies.

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


distributed.register_grad_hook(_GradHook)  # (FSDP2's unsharded parameters get it too)


# ---------------------------------------------------------------------------------------------
# convert / unconvert

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


def is_converted(model: nn.Module) -> bool:
    """Whether ``model`` was converted by qt.convert (and not unconverted since)."""
    return getattr(model, "_qt_conversion", None) is not None


def conversion_of(model: nn.Module):
    """What qt.convert did to ``model`` (its module_plans and tensor_plans), else None."""
    return getattr(model, "_qt_conversion", None)


def plan_of(tensor: torch.Tensor) -> Optional[TensorPlan]:
    """The TensorPlan of a converted parameter (None for anything else)."""
    return getattr(tensor, "_qt_plan", None)


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


def _attach(conv: _Conversion) -> None:
    """Put the plans and gradient hooks on the parameters (tensor attributes and tensor hooks)."""
    training.bump_epoch()
    for mod, local, plan in conv.hooked_params:
        p = mod._parameters[local]
        distributed.remember_plan(mod, local, plan)  # for FSDP2's sharded parameters
        if not plan.value.full_precision:
            p._qt_plan = plan
        if p.requires_grad:
            conv.param_handles.append(p.register_hook(_GradHook(plan)))


# Models whose parameters carry their plans and hooks. A deep copy or an unpickled copy of a
# converted model is not in it (weak: a freed model's id cannot be mistaken for a live one's).
_attached = weakref.WeakSet()


def _reattach_hook(model, args):
    # A deep copy of a converted model copies its modules, hooks and _qt_conversion, but a copied
    # tensor keeps neither its attributes nor its hooks: attach them again on first use.
    conv = getattr(model, "_qt_conversion", None)
    if conv is not None and model not in _attached:
        conv.param_handles = []
        _attach(conv)
        _attached.add(model)
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


def _attach_grad_hooks(model: nn.Module, conv: _Conversion, params) -> None:
    """Converted parameters get gradients in their grad role; parameters left in full precision
    get plain gradients (so their optimizer update stays plain too)."""
    for owners in params.values():
        mod, local, qual = owners[0]
        plan = conv.tensor_plans.get(qual)
        if plan is not None:
            conv.hooked_params.append((mod, local, plan))
    _attach(conv)
    _attached.add(model)
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
    formats (qtensor.gemm); a module or weight a rule decides keeps its roles' mm_fmt, unless the
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
    for attach, _ in _model_hooks:  # (qtensor/hf.py: a transformers model's save_pretrained)
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
        mod.__dict__.pop(distributed.PLANS_ATTR, None)
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
    del model._qt_conversion
    _attached.discard(model)
    training.unconvert_optimizers(moved)
    _replaced_warning(
        "qt.unconvert", replaced,
        "the optimizers that stepped the model hold the new one, but other references taken "
        "before qt.unconvert (weak references, lists of parameters) still see the converted one.")
    training.bump_epoch()
    return model


# ---------------------------------------------------------------------------------------------
# describe

def _total_bits(t: torch.Tensor) -> float:
    """Storage of ``t`` in bits: its format's bits per value, block scales counted per block
    actually present (a short last block still has a whole scale)."""
    n = t.numel()
    if not _is_q(t):
        if t.dtype == torch.bool:
            return 8.0 * n
        info = torch.finfo(t.dtype) if t.is_floating_point() else torch.iinfo(t.dtype)
        return float(info.bits * n)
    return t.fmt.storage_bits(t.shape)


def _rule_of(plan, recipe: Recipe, roles: Tuple[str, ...]) -> str:
    """Which rule chose a plan's formats (per role where a rule gives only some), else the
    recipe's default for the role."""
    if plan is None:
        return "-"
    if plan.rule is None:
        return f"default ({roles[0]})"
    spec = recipe.rules.get(plan.rule)
    if not isinstance(spec, dict):
        return f"rule {plan.rule!r}"
    own = [r for r in roles if r in spec]
    rest = [r for r in roles if r not in spec]
    if not rest:
        return f"rule {plan.rule!r}"
    return (f"rule {plan.rule!r} ({', '.join(own)}); " if own else
            f"rule {plan.rule!r} sets no role of it; ") + f"default ({', '.join(rest)})"


def _table(rows) -> List[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return lines


def _module_rows(model: nn.Module, conv: _Conversion) -> List[Tuple[str, ...]]:
    """One row per module: its activation (output) and gradient formats and what chose them."""
    rows = [("module", "type", "activation", "gradient", "chosen by")]
    for mname, mod in model.named_modules():
        plan = conv.module_plans.get(mname)
        if plan is None:
            continue
        act = "plain (kept full precision)" if plan.plain else str(plan.activation)
        grad = "plain" if plan.plain else str(plan.grad)
        rows.append((mname or "(model: inputs and outputs)", type(mod).__name__, act, grad,
                     _rule_of(plan, conv.recipe, ("activation", "grad"))))
    return rows


def _gemm_rows(model: nn.Module, conv: _Conversion) -> List[Tuple[str, ...]]:
    """One row per GEMM of each converted Linear/Conv: its operands' formats and bits and its
    transform (qtensor.gemm_forward.gemm_formats: Recipe.gemm, last_layers, rules)."""
    rows = [("gemm", "module", "operands", "bits", "transform")]
    for mname, mod in model.named_modules():
        if not _is_q(mod._parameters.get("weight")):
            continue
        plan = conv.module_plans.get(mname)
        act, grad = (plan.activation, plan.grad) if plan is not None else (Role(), Role())
        used = _gemm.gemm_formats(mod, act.mm_fmt or act.fmt, grad.mm_fmt or grad.fmt)
        if used is None:
            continue
        for gemm, (fa, fb, t) in used.items():
            ops = GEMMS[gemm]
            w = mod.weight
            fmts = [w.fmt if f is None and o == "w" else f for o, f in zip(ops, (fa, fb))]
            bits = ["32" if f is None else f"{f.bits:.4g}" for f in fmts]
            rows.append((gemm, mname or "(model)",
                         " x ".join(f"{o} {f if f is not None else 'fp32'}"
                                    for o, f in zip(ops, fmts)),
                         " x ".join(bits), "-" if t is None else str(t)))
    return rows


def describe(model: nn.Module, *, file=None, print_table: bool = True) -> Optional[str]:
    """Print a table of every parameter and buffer (to ``file``, default stdout; returns None,
    so the REPL shows it once), or return it as a string with ``print_table=False``: name,
    shape, value format, operand (mm) format, bits per value, and the model's total size in
    bits against FP32. For a converted model also: which rule (or the role's default) chose
    each tensor's formats, and a second table, per module, of the activation and gradient
    formats of its outputs and what chose them, and a third, per converted Linear/Conv, of the
    operand formats (and bits) and transform of each of its GEMMs (fprop, dgrad, wgrad), which
    ``Recipe.gemm`` can set apart from the roles; a weight's "mm format" then names its GEMMs'.

    Bits per value are the value format's (the operand format costs no storage), with block
    scales counted per block present; non-floating buffers count at their dtype's width in both
    totals."""
    conv = getattr(model, "_qt_conversion", None)
    head = ("name", "shape", "format", "mm format", "bits") + (("chosen by",) if conv else ())
    rows = [head]
    total = fp32_total = 0.0
    seen = set()
    entries = [(n, t, "param") for n, t in model.named_parameters(remove_duplicate=False)] + \
              [(n, t, "buffer") for n, t in model.named_buffers(remove_duplicate=False)]
    gemm_weights = {}  # weights whose GEMMs do not use their own mm_fmt: (fprop's, dgrad's)
    for mod in model.modules():
        used = _gemm.gemm_formats(mod) if _gemm.installed_gemm(mod) is not None else None
        if used is not None:
            gemm_weights[id(mod.weight)] = (used["fprop"][1] or "-", used["dgrad"][1] or "-")
    names: Dict[int, List[str]] = {}
    for name, t, _what in entries:
        names.setdefault(id(t), []).append(name)
    for name, t, _what in entries:
        if id(t) in seen:
            continue
        seen.add(id(t))
        if len(names[id(t)]) > 1:  # tied: one tensor, counted once, shown with its other names
            name = f"{name} (= {', '.join(names[id(t)][1:])})"
        n = t.numel()
        size = _total_bits(t)
        bits = size / n if n else 0.0
        if _is_q(t):
            fmt, mm = str(t.fmt), str(t.mm_fmt) if getattr(t, "mm_fmt", None) is not None else "-"
            fw = gemm_weights.get(id(t))
            if fw is not None:  # its GEMMs' formats, not its own mm_fmt (Recipe.gemm)
                mm = f"{fw[0]} in fprop, {fw[1]} in dgrad (per-GEMM, below)"
        else:
            fmt, mm = f"plain {str(t.dtype).replace('torch.', '')}", "-"
        total += size
        fp32_total += 32 * n if t.is_floating_point() else size
        row = (name, "x".join(map(str, t.shape)) or "scalar", fmt, mm, f"{bits:.4g}")
        if conv is not None:
            plan = conv.tensor_plans.get(name)
            roles = (("weight",) if plan is None or plan.kind == "buffer"  # (no gradient)
                     else (plan.kind, "grad", "optimizer_state"))
            row += ("not floating: left alone" if plan is None and not t.is_floating_point()
                    else _rule_of(plan, conv.recipe, roles),)
        rows.append(row)
    lines = _table(rows)
    ratio = total / fp32_total if fp32_total else 1.0
    lines.append(f"total: {total:,.0f} bits ({total / 8 / 2**20:.3f} MiB) vs FP32 "
                 f"{fp32_total:,.0f} bits ({fp32_total / 8 / 2**20:.3f} MiB): {ratio:.3f}x")
    if conv is not None:
        root = conv.module_plans.get("")
        if root is not None:
            lines.append(f"activations: {root.activation}; gradients: {conv.recipe.grad}; "
                         f"optimizer state: {conv.recipe.optimizer_state}; "
                         f"master weights: {conv.recipe.master_weights}")
        lines.append("")
        lines.extend(_table(_module_rows(model, conv)))
        gemms = _gemm_rows(model, conv)
        if len(gemms) > 1:
            lines += ["", "GEMMs of each Linear/Conv: the operand formats (bits per value) and "
                      "transform each uses (x and dY, where Recipe.gemm leaves them their own: the operand "
                      "formats of this module's activation and grad roles, as its producer's are "
                      "by default)"]
            lines.extend(_table(gemms))
    text = "\n".join(lines)
    if print_table:
        print(text, file=file)
        return None
    return text
