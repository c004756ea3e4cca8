"""What a spec passed to ``qt.convert`` means: :func:`as_recipe`.

A spec is a :class:`~qtensor.nn.plans.Recipe`, the name of a preset in :mod:`qtensor.nn.recipes`, a
format, a format string or a pair (value_fmt, mm_fmt); a bare format means "every value in this
format", with FP32 master weights and optimizer state for formats that lack FP32's range
(docs/convert.md explains why).
"""
from __future__ import annotations

from typing import Optional

from ..formats.base import Format, FormatError
from ..formats.parse import dtype_hint
from ..formats.parse import format as _parse_format
from .plans import Recipe, Role, check_signed
from .recipes import PRESETS_BY_NAME

__all__ = ["as_recipe"]


def _has_fp32_range(fmt: Format) -> bool:
    """Whether ``fmt`` is a float format with FP32's exponent range (BF16, TF32, FP32)."""
    return fmt.has_fp32_range


def _bare_format_recipe(spec) -> Recipe:
    """The recipe of a bare format (see the module docstring): every value in it, except that
    the optimizer runs in FP32 on FP32 master weights when the format lacks FP32's range."""
    role = Role.of(spec, "format")
    name = str(role)
    check_signed(role, f"qt.convert(model, {name!r})")
    if _has_fp32_range(role.fmt):
        return Recipe.uniform(role, name=name)
    return Recipe(weight=role, bias=role, activation=role, grad=role, optimizer_state=None,
                  master_weights=True, name=name,
                  source="a bare format without FP32's range: values in it, FP32 master weights "
                  "and optimizer")


def _recipe_named(name: str) -> Optional[Recipe]:
    """The preset recipe ``qt.recipes.<name>``; an error if ``name`` is also a format."""
    recipe = PRESETS_BY_NAME.get(name.strip().lower())
    if recipe is None:
        return None
    try:
        fmt = _parse_format(name)
    except (FormatError, ValueError):
        return recipe
    raise ValueError(
        f"qt.convert: {name!r} names both the recipe qt.recipes.{recipe.name} ({recipe.source}) "
        f"and the format {fmt} (every value in it); pass the one you mean: "
        f"qt.convert(model, qt.recipes.{recipe.name}) or "
        f"qt.convert(model, qt.format({str(fmt)!r}))")


def as_recipe(spec) -> Recipe:
    """A Recipe from a Recipe, a preset recipe's name, a format, a format string or a pair
    (value_fmt, mm_fmt): see the module docstring for what a bare format means."""
    if isinstance(spec, Recipe):
        return spec
    if isinstance(spec, dict):
        return Recipe(**spec)
    if spec is None:
        raise TypeError("qt.convert needs a format, a format string or a qt.Recipe, got None")
    if isinstance(spec, str):
        named = _recipe_named(spec)
        if named is not None:
            return named
    if isinstance(spec, (Format, str, tuple, list, Role)):
        return _bare_format_recipe(spec)
    raise TypeError(f"qt.convert needs a format, a format string or a qt.Recipe, got "
                    f"{spec if type(spec).__module__ == 'torch' else type(spec).__name__}"
                    f"{dtype_hint(spec)}")
