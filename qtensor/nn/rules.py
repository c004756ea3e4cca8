"""Rules by qualified name (``Recipe.rules``): which rule decides a parameter, buffer or module
(exact name, then pattern, then enclosing module; tied tensors by the most specific rule over
all their names), the plan it gives each (:class:`~qtensor.nn.plans.TensorPlan`,
:class:`~qtensor.nn.plans.ModulePlan`), and the rules that match nothing. Precedence:
docs/convert.md.
"""
from __future__ import annotations

import difflib
import fnmatch
import re
from typing import Any, List, Optional, Tuple

from .plans import _FP32, ModulePlan, Recipe, Role, TensorPlan
from ..warn import warn as _warn


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
