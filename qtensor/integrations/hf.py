"""Hugging Face transformers: save and load converted models with their formats.

safetensors cannot store a QTensor as it is: it reads each tensor's bytes at ``t.data_ptr()``,
and a QTensor is a wrapper subclass whose own ``data_ptr()`` is 0 (its values live in its
payload), so it writes no bytes for a non-empty shape ("invalid shape, data type, or offset").
:func:`save_pretrained` saves the plain values (:func:`qtensor.integrations.serialization.plain_state_dict`)
through the class's own ``save_pretrained`` and puts the recipe and every tensor's formats in the
config (``config.json``, key ``"qtensor"``). ``qt.convert`` of a transformers ``PreTrainedModel``
installs it as the model's ``save_pretrained`` (an instance attribute, :class:`SavePretrained`;
``qt.unconvert`` removes it): ``model.save_pretrained(dir)``, and what calls it (``push_to_hub``,
the Trainer), work on a converted model. ``from_pretrained`` is a class method that qtensor does
not see: the class's own gives a plain model; :func:`from_pretrained` loads with it and converts
the model to the saved recipe (the values are already in their formats, so they come back bit
for bit), checking that each tensor got the formats it was saved with. Nothing here imports
transformers: the model and its class bring it.

``LEAK_ALLOW``: what ``qt.leak_check`` reports in HF models that is by design (docs/huggingface.md).
"""
from __future__ import annotations

import inspect
from typing import Any, Dict

import torch
from torch import nn

from ..nn.convert import conversion_of, convert, register_model_hooks
from ..formats.parse import short_repr
from ..kernels.ops import count_off_format
from .serialization import (formats_data, parse_formats, plain_state_dict, recipe_from_dict,
                            recipe_to_dict, tensor_formats)
from ..tensor.subclass import QTensor

__all__ = ["save_pretrained", "from_pretrained", "SavePretrained", "CONFIG_KEY", "LEAK_ALLOW",
           "LEAK_ALLOW_EAGER"]

CONFIG_KEY = "qtensor"

# leak_check(allow=...) patterns (module names) for the plain values HF models make by design:
# the rotary position tables (position ids times inv_freq, in the rotary module) ...
LEAK_ALLOW = ("*rotary_emb",)
# ... and, with attn_implementation="eager", the additive float attention mask (0 / dtype min)
# that HF's masking utilities build and eager attention adds to the scores (reported in the
# attention module: allowing it hides any other plain value there too; SDPA avoids it)
LEAK_ALLOW_EAGER = LEAK_ALLOW + ("*.attn", "*.self_attn", "*.attention")


def save_pretrained(model: nn.Module, save_directory, **kwargs) -> None:
    """``model.save_pretrained(save_directory, **kwargs)`` for a converted model: plain values in
    the safetensors files, the recipe and formats in config.json (under ``"qtensor"``).
    A plain checkpoint of the same values, loadable by any transformers code; only
    :func:`from_pretrained` converts it back. A ``state_dict=`` of QTensors (the Trainer passes
    ``model.state_dict()``) is saved the same way: its plain values, its formats."""
    conv = conversion_of(model)
    if conv is None:
        raise ValueError("qt.hf.save_pretrained: the model is not converted; use "
                         "model.save_pretrained")
    state_dict = kwargs.pop("state_dict", None)
    plain = plain_state_dict(model if state_dict is None else state_dict)
    recipe = recipe_to_dict(conv.recipe)
    config = model.config
    had, old = hasattr(config, CONFIG_KEY), getattr(config, CONFIG_KEY, None)
    setattr(config, CONFIG_KEY, {"version": plain["qtensor"], "recipe": recipe,
                                 "formats": plain["formats"]})
    try:  # the class's own save_pretrained (the instance's is SavePretrained: this function)
        type(model).save_pretrained(model, save_directory, state_dict=plain["tensors"], **kwargs)
    finally:  # the live model's config stays as it was
        if had:
            setattr(config, CONFIG_KEY, old)
        else:
            delattr(config, CONFIG_KEY)


class SavePretrained:
    """``model.save_pretrained`` of a converted transformers model: :func:`save_pretrained`.
    An object rather than a closure, so that the model deep-copies and pickles (as
    qtensor.nn.convert.ConvertedForward)."""

    def __init__(self, module: nn.Module):
        self.module = module

    @property
    def __wrapped__(self):  # the class's method, for inspect.signature and help()
        return type(self.module).save_pretrained.__get__(self.module)

    def __call__(self, *args, **kwargs):
        # by name, whatever was passed by position (state_dict is the third parameter)
        bound = inspect.signature(type(self.module).save_pretrained).bind(self.module, *args,
                                                                         **kwargs)
        named = dict(bound.arguments)
        named.pop(next(iter(named)))  # self
        named.update(named.pop("kwargs", {}))
        return save_pretrained(self.module, named.pop("save_directory"), **named)


def _is_pretrained_model(model: nn.Module) -> bool:
    """A transformers PreTrainedModel, found without importing transformers."""
    return any(c.__name__ == "PreTrainedModel" and c.__module__.startswith("transformers.")
               for c in type(model).__mro__)


def attach(model: nn.Module) -> None:
    """Called by qt.convert: a converted PreTrainedModel saves through :func:`save_pretrained`
    (a save_pretrained the user put on the instance is left alone)."""
    if _is_pretrained_model(model) and "save_pretrained" not in model.__dict__:
        model.save_pretrained = SavePretrained(model)


def detach(model: nn.Module) -> None:
    """Called by qt.unconvert: the class's save_pretrained again."""
    if isinstance(model.__dict__.get("save_pretrained"), SavePretrained):
        del model.__dict__["save_pretrained"]


def from_pretrained(model_class, pretrained_model_name_or_path, **kwargs):
    """``model_class.from_pretrained(path, **kwargs)``, converted back to the recipe saved by
    :func:`save_pretrained` (a ValueError when a tensor does not get the formats it was saved
    with). A checkpoint without qtensor formats loads plain (convert it then: ``model.to(fmt)``)."""
    model = model_class.from_pretrained(pretrained_model_name_or_path, **kwargs)
    info = getattr(model.config, CONFIG_KEY, None)
    if not info:
        return model
    delattr(model.config, CONFIG_KEY)  # the conversion is on the model now, not in its config
    where = f"{pretrained_model_name_or_path}: config.json's {CONFIG_KEY!r}"
    if not isinstance(info, dict) or "recipe" not in info:
        raise ValueError(f"{where}: expected {{'version', 'recipe', 'formats'}} (what "
                         f"qt.hf.save_pretrained writes), got {short_repr(info)}")
    formats = parse_formats(info.get("formats", {}), None, f"{where} 'formats'")
    try:
        recipe = recipe_from_dict(info["recipe"])
    except ValueError as e:
        raise ValueError(f"{where} 'recipe': {e}") from None
    _check_values(model, formats)
    convert(model, recipe)
    _check_formats(model, formats)
    return model


def _check_values(model: nn.Module, formats: Dict[str, tuple]) -> None:
    """The loaded values must be in the formats the config names (else converting would round
    them again, silently): a checkpoint changed after qt.hf.save_pretrained is refused. (A load
    with another dtype= that keeps them representable, e.g. FP8 values in float16, passes.)"""
    state = model.state_dict()
    changed = []
    for name, (fmt, _mm_fmt, _accum) in formats.items():
        t = state.get(name)
        if t is not None and t.is_floating_point() and count_off_format(t, fmt):
            changed.append(f"{name} ({fmt})")
    if changed:
        raise ValueError(
            "qt.hf.from_pretrained: the checkpoint's values are not in the formats its config "
            "names (changed after qt.hf.save_pretrained, or loaded with a dtype= that cannot hold "
            "them): "
            + ", ".join(changed) + "; to convert it anyway, load it with "
            "cls.from_pretrained and convert it: model.to(recipe)")


def _check_formats(model: nn.Module, formats: Dict[str, tuple]) -> None:
    state = model.state_dict()
    wrong = []
    for name, saved in formats.items():
        t = state.get(name)
        if not isinstance(t, QTensor) or (t.fmt, t.mm_fmt, t.accum) != saved:
            have = tensor_formats(t) if isinstance(t, QTensor) else {"fmt": "missing or plain"}
            wrong.append(f"{name}: saved {formats_data(*saved)}, loaded {have}")
    if wrong:
        raise ValueError("qt.hf.from_pretrained: tensors did not get the formats they were saved "
                         "with (another transformers version renaming weights?): "
                         + "; ".join(wrong))


register_model_hooks(attach, detach)
