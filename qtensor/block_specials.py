"""A warning when an Inf or NaN turns a block's finite values into NaN.

In a block format a block that holds an Inf or NaN is NaN altogether (the MX rule: its shared
scale is NaN), so a causal mask's -inf, rounded into MXFP8 with the scores, makes every score
of its 32-value block NaN, silently. :func:`check` warns the first time it happens in a process
(later NaN blocks are mostly its consequences), at the user's line, naming the op and the
module. Until then it costs one reduction per rounding to a block format (a sum, NaN iff a
value is NaN; it looks closer only when that finds one), after it nothing. Why, and the
recipes that keep vector ops out of block formats: docs/formats.md ("Inf and NaN in block
formats").
"""
from __future__ import annotations

import sys
from typing import Optional

import torch

from .warn import warn

__all__ = ["check", "watching"]

_said = [False]  # once per process: the first block is the cause, later ones its consequences


def watching() -> bool:
    """Whether :func:`check` still looks (it stops after its warning)."""
    return not _said[0]


def _spread(before: torch.Tensor, after: torch.Tensor) -> bool:
    """Whether rounding made finite values NaN next to an Inf or NaN of the input."""
    if torch.compiler.is_compiling() or type(after) is not torch.Tensor or after.numel() == 0:
        return False  # traced (fake or functional payloads): no data to look at
    if not torch.isnan(after.sum()):
        return False
    finite = torch.isfinite(before)
    return bool((torch.isnan(after) & finite).any()) and not bool(finite.all())


def _module_on_stack() -> str:
    """The innermost nn.Module running on the stack, by its name in the converted model."""
    inner = root = None
    frame = sys._getframe(2)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if isinstance(owner, torch.nn.Module):
            inner = owner if inner is None else inner
            if getattr(owner, "_qt_conversion", None) is not None:
                root = owner
        frame = frame.f_back
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
    """Warn (once per process) if rounding ``before`` to the block format ``fmt`` gave
    ``after`` with NaN for finite values because of an Inf or NaN in their block. ``op``: the
    aten op whose output it is; ``what``: the tensor's name otherwise (a module's output)."""
    if _said[0] or not _spread(before, after):
        return
    _said[0] = True
    where = f"{op}{_module_on_stack()}" if op is not None else (what or "a tensor")
    warn(
        f"qtensor: {where}: rounding to the block format {fmt} turned finite values into NaN: "
        "the values hold an Inf or NaN (a mask's -inf?), and a block that holds one is NaN "
        "altogether (the MX rule: its shared scale is NaN), so every value sharing its block is "
        "lost. Keep masks, softmax and other vector ops out of block formats: use block formats "
        "only for matrix-multiply operands (qt.recipes.mxfp6, qt.recipes.mxfp4_weights: BF16 "
        "values, MX inside contractions) or give the attention modules a rule of their own. "
        "See docs/formats.md (\"Inf and NaN in block formats\").")
