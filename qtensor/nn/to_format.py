"""``model.to(fmt)``, ``model.to(recipe)`` and ``tensor.to(fmt)``.

- ``model.to(fmt_or_recipe)`` is ``qt.convert(model, fmt_or_recipe)`` and returns the model; on a
  model already converted with another recipe it converts it again (``qt.unconvert`` then
  ``qt.convert``: from the values it has now; FP32 masters of its optimizers are dropped, as
  qt.unconvert does). ``model.to(device, fmt)`` moves the model first, then converts it.
- ``tensor.to(fmt)`` is ``qt.as_qtensor(tensor, fmt)``: a QTensor rounded to fmt,
  differentiable (straight through). ``tensor.to(device, fmt)`` moves it first.
- Strings cannot work: ``model.to("mxfp8_e4m3")`` and ``t.to("mxfp8_e4m3")`` are parsed by torch
  as device strings, before any Python hook can see them ("Invalid device string"); pass
  ``qt.format("mxfp8_e4m3")`` (or ``qt.mxfp8_e4m3``).

How the calls get here: :mod:`qtensor.formats.torch_function` (torch's ``__torch_function__`` protocol).
``nn.Module.to`` gives torch only its arguments, not the module, so the handler finds the module
in the calling ``nn.Module.to`` frame (its ``self``), converts it, and gives ``nn.Module.to`` back
an argument tuple without dtype, so that its own pass over the tensors changes nothing.
"""
from __future__ import annotations

import sys

import torch
from torch import nn

from ..formats import torch_function
from .convert import conversion_of, convert, unconvert
from ..formats.base import Format
from .plans import Recipe
from .spec import as_recipe
from ..tensor.subclass import as_qtensor

__all__ = ["handle", "to_spec"]

_MODULE_TO = nn.Module.to.__code__
_PARSE_TO = torch._C._nn._parse_to
_TENSOR_TO = torch.Tensor.to
_SPECS = (Format, Recipe)


def to_spec(model: nn.Module, spec) -> nn.Module:
    """``model`` converted to ``spec``: converted now, unchanged if it already has that recipe,
    converted again if it has another (the old conversion is restored if the new one fails)."""
    recipe = as_recipe(spec)
    conv = conversion_of(model)
    if conv is not None:
        if conv.recipe == recipe:
            return model
        old = conv.recipe
        unconvert(model)
        try:
            return convert(model, recipe)
        except Exception:
            convert(model, old)
            raise
    return convert(model, recipe)


def _split(args, kwargs, what: str):
    """(the format or recipe, the other positional arguments, the other keyword arguments)."""
    specs = [a for a in args if isinstance(a, _SPECS)]
    specs += [v for v in kwargs.values() if isinstance(v, _SPECS)]
    if len(specs) != 1:
        raise TypeError(f"{what}: pass one format or recipe, got {len(specs)}: "
                        + ", ".join(map(repr, specs)))
    rest = tuple(a for a in args if not isinstance(a, _SPECS))
    rest_kwargs = {k: v for k, v in kwargs.items() if not isinstance(v, _SPECS)}
    return specs[0], rest, rest_kwargs


def _calling_module():
    """The module whose ``nn.Module.to`` is running ``_parse_to`` (its frame's ``self``)."""
    frame = sys._getframe(1)
    for _ in range(16):
        if frame is None:
            return None
        if frame.f_code is _MODULE_TO:
            return frame.f_locals.get("self")
        frame = frame.f_back
    return None


@torch._disable_dynamo  # reads frames: torch.compile runs it outside the graph (a graph break)
def _module_to(args, kwargs):
    spec, rest, rest_kwargs = _split(args, kwargs, "model.to")
    model = _calling_module()
    if not isinstance(model, nn.Module):
        return NotImplemented  # _parse_to called with a format outside nn.Module.to
    device, dtype, non_blocking, memory_format = (
        _PARSE_TO(*rest, **rest_kwargs) if rest or rest_kwargs else (None, None, False, None))
    if dtype is not None:
        raise TypeError(
            f"model.to: got the dtype {dtype} and the {type(spec).__name__} {spec} together; the "
            "format decides the precision: pass it alone (model.to(fmt), or model.to(device, "
            "fmt)); to run in a torch dtype, qt.unconvert(model) then model.to(dtype)")
    if device is not None:
        model.to(device, non_blocking=non_blocking)  # round where the model will run
    to_spec(model, spec)
    # nn.Module.to goes on with these: no dtype, no device (done), so its pass changes nothing
    return None, None, non_blocking, memory_format


def _tensor_to(args, kwargs):
    spec, rest, rest_kwargs = _split(args[1:], kwargs, "tensor.to")
    t = args[0]
    if isinstance(spec, Recipe):
        raise TypeError(
            "tensor.to(recipe): a recipe gives formats to the roles of a model (model.to(recipe) "
            "or qt.convert(model, recipe)); a tensor takes a format: t.to(qt.mxfp8_e4m3), or "
            "qt.as_qtensor(t, fmt, mm_fmt=...) for an operand format too")
    rest_kwargs.pop("copy", None)  # the rounding makes a new tensor anyway
    if rest or rest_kwargs:
        t = t.to(*rest, **rest_kwargs)
    return as_qtensor(t, spec)


def handle(func, args, kwargs):
    """The ``__torch_function__`` of formats and recipes (see the module docstring)."""
    if func is _PARSE_TO:
        return _module_to(args, kwargs)
    if func is _TENSOR_TO and args and isinstance(args[0], torch.Tensor):
        return _tensor_to(args, kwargs)
    return NotImplemented


torch_function.register_to_handler(handle)
