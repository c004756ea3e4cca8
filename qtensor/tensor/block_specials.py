"""A warning when an Inf or NaN turns a block's finite values into NaN.

In a block format a block that holds an Inf or NaN is NaN altogether (the MX rule: its shared
scale is NaN), so a causal mask's -inf, rounded into MXFP8 with the scores, makes every score
of its 32-value block NaN, silently. :func:`check` warns once per converted model and op (a
second model, say the next seed of a sweep, is told too), at the user's line, naming the op and
the module; once a model was told, a block rounding whose values already hold NaN (later
layers, the backward pass) follows from the first and is not said. It costs one reduction per
rounding to a block format (a sum, NaN iff a value is NaN; it looks closer only when that
finds one). Why, and the recipes that keep vector ops out of block formats: docs/formats.md
("Inf and NaN in block formats").
"""
from __future__ import annotations

import sys
import weakref
from typing import Optional

import torch

from ..warn import warn

__all__ = ["check", "watching"]

# what has been said: per converted model (weakly: a model's entry goes with it, and a new model
# at the same address is a new key), the ops and tensor names; outside a converted model, per op
_said: "weakref.WeakKeyDictionary[torch.nn.Module, set]" = weakref.WeakKeyDictionary()
_said_unowned: set = set()
_told = [False]  # whether anything was said in this process


def watching() -> bool:
    """Whether :func:`check` looks at all (always: every model and op is told once)."""
    return True


def _reset() -> None:
    """Forget what was said (tests)."""
    _said.clear()
    _said_unowned.clear()
    _told[0] = False


def _spread(before: torch.Tensor, after: torch.Tensor) -> bool:
    """Whether rounding made finite values NaN next to an Inf or NaN of the input."""
    if torch.compiler.is_compiling() or type(after) is not torch.Tensor or after.numel() == 0:
        return False  # traced (fake or functional payloads): no data to look at
    if not torch.isnan(after.sum()):
        return False
    finite = torch.isfinite(before)
    return bool((torch.isnan(after) & finite).any()) and not bool(finite.all())


def _modules_on_stack():
    """The innermost nn.Module running on the stack and the outermost converted model around
    it (None for either where there is none)."""
    inner = root = None
    frame = sys._getframe(2)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if isinstance(owner, torch.nn.Module):
            inner = owner if inner is None else inner
            if getattr(owner, "_qt_conversion", None) is not None:
                root = owner
        frame = frame.f_back
    return inner, root


def _describe(inner, root) -> str:
    """Where ``inner`` is: its name in the converted model ``root``."""
    if inner is None:
        return ""
    if root is not None:
        for name, mod in root.named_modules():
            if mod is inner:
                return f" in module {name!r} ({type(inner).__name__})" if name else \
                    f" in the model's own forward ({type(inner).__name__})"
    return f" in a {type(inner).__name__}"


def check(before: torch.Tensor, after: torch.Tensor, fmt, *, op=None,
          what: Optional[str] = None) -> None:
    """Warn (once per converted model and ``op`` or ``what``) if rounding ``before`` to the
    block format ``fmt`` gave ``after`` with NaN for finite values because of an Inf or NaN in
    their block. ``op``: the aten op whose output it is; ``what``: the tensor's name otherwise
    (a module's output)."""
    if not _spread(before, after):
        return
    inner, root = _modules_on_stack()
    said = _said_unowned if root is None else _said.setdefault(root, set())
    key = op if op is not None else what
    # NaN already in the values, once the model (outside one, e.g. in backward: the process)
    # was told: what an earlier block spread
    told = bool(said) if root is not None else _told[0]
    if key in said or (told and bool(torch.isnan(before).any())):
        return
    said.add(key)
    _told[0] = True
    where = f"{op}{_describe(inner, root)}" if op is not None else (what or "a tensor")
    warn(
        f"qtensor: {where}: rounding to the block format {fmt} turned finite values into NaN: "
        "the values hold an Inf or NaN (a mask's -inf?), and a block that holds one is NaN "
        "altogether (the MX rule: its shared scale is NaN), so every value sharing its block is "
        "lost. Keep masks, softmax and other vector ops out of block formats: use block formats "
        "only for matrix-multiply operands (qt.recipes.mxfp6, qt.recipes.mxfp4_weights: BF16 "
        "values, MX inside contractions) or give the attention modules a rule of their own. "
        "See docs/formats.md (\"Inf and NaN in block formats\").")
