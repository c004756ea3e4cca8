"""Checkpoints of converted models that plain tools can read: plain tensors plus formats as text.

A converted model's ``state_dict()`` holds QTensors: ``torch.save``/``torch.load`` round-trip
them exactly, but reading such a file needs qtensor imported (``torch.load(weights_only=True)``
refuses the unknown ``qtensor.tensor._rebuild_qtensor`` otherwise), and safetensors cannot store
them at all. This module stores the same values as plain tensors with their formats as strings:

- :func:`plain_state_dict` ``(model or state dict) -> {"qtensor": version, "tensors": {...},
  "formats": {...}, "recipe": {...} or None}``: ``tensors`` is an ordinary state dict (every
  value a plain tensor, the QTensors' payloads: the values exactly), ``formats`` gives each
  QTensor's ``{"fmt": ..., "mm_fmt": ..., "accum": ...}`` as strings, ``recipe`` the converted
  model's recipe as plain data. Only builtins and tensors: ``torch.load(weights_only=True)``
  reads it without qtensor, and ``model.load_state_dict(sd["tensors"])`` loads it into a plain
  model.
- :func:`load_plain_state_dict` (its inverse on a model: converts the model to the checkpoint's
  recipe when it is not converted yet, checks the formats, loads), :func:`qtensor_state_dict`
  (its inverse as a state dict of QTensors).
- :func:`save_safetensors` / :func:`load_safetensors`: the same in a ``.safetensors`` file, the
  formats and recipe as JSON in its metadata (``qtensor.formats``, ``qtensor.recipe``).
- :func:`recipe_to_dict` / :func:`recipe_from_dict`: a Recipe as JSON-able data and back.
"""
from __future__ import annotations

import dataclasses
import json
from typing import Any, Dict, Optional

import torch
from torch import nn

from .accum import AccumFormat, as_accum
from .convert import conversion_of, convert
from .formats import format as _parse_format
from .plans import LAYER_KINDS, ROLE_NAMES, GemmFormats, Recipe, Role
from .transforms import Hadamard
from .tensor import QTensor, _accum_of_token, _accum_token

__all__ = ["plain_state_dict", "load_plain_state_dict", "qtensor_state_dict", "save_safetensors",
           "load_safetensors", "recipe_to_dict", "recipe_from_dict", "tensor_formats",
           "METADATA_FORMATS", "METADATA_RECIPE"]

VERSION = "1"
METADATA_FORMATS = "qtensor.formats"  # safetensors metadata keys (values: JSON strings)
METADATA_RECIPE = "qtensor.recipe"


# ---------------------------------------------------------------------------------------------
# Formats and recipes as plain data

def _accum_str(accum: Optional[AccumFormat]) -> Optional[str]:
    return None if accum is None else _accum_token(accum)


def _accum_from(text: Optional[str]) -> Optional[AccumFormat]:
    if text is None:
        return None
    return _accum_of_token(text) if "=" in text else as_accum(text)  # fields, or a preset name


def tensor_formats(t: QTensor) -> Dict[str, str]:
    """A QTensor's formats as strings: ``{"fmt": ..., "mm_fmt": ..., "accum": ...}`` (the last
    two only when set)."""
    out = {"fmt": str(t.fmt)}
    if t.mm_fmt is not None:
        out["mm_fmt"] = str(t.mm_fmt)
    if t.accum is not None:
        out["accum"] = _accum_str(t.accum)
    return out


def _role_data(role: Role):
    return [None if role.fmt is None else str(role.fmt),
            None if role.mm_fmt is None else str(role.mm_fmt)]


def _gemm_data(g):
    """GemmFormats as plain data: formats as strings, transforms as {"size", "signs"}."""
    if g is None:
        return None
    out = {}
    for f in dataclasses.fields(g):
        v = getattr(g, f.name)
        if v is not None:
            out[f.name] = ({"size": v.size, "signs": v.signs} if f.name.endswith("_transform")
                           else str(v))
    return out


def _gemm_from(data):
    if data is None:
        return None
    fields = {k: (Hadamard(**v) if k.endswith("_transform") else _parse_format(v))
              for k, v in data.items()}
    return GemmFormats(**fields)


def _gemm_spec_data(gemm):
    """Recipe.gemm (or a rule's "gemm") as data: one GemmFormats, or per layer kind."""
    return ({k: _gemm_data(v) for k, v in gemm.items()} if isinstance(gemm, dict)
            else _gemm_data(gemm))


def _gemm_spec_from(data):
    if isinstance(data, dict) and set(data) <= set(LAYER_KINDS) and data:
        return {k: _gemm_from(v) for k, v in data.items()}
    return _gemm_from(data)


def recipe_to_dict(recipe: Recipe) -> Dict[str, Any]:
    """A Recipe as JSON-able data (formats as their strings); :func:`recipe_from_dict` inverts it."""
    rules = {}
    for pattern, spec in recipe.rules.items():
        rules[pattern] = (_role_data(spec) if isinstance(spec, Role)
                          else {k: _gemm_spec_data(v) if k == "gemm" else _role_data(v)
                                for k, v in spec.items()})
    return {
        **{role: _role_data(getattr(recipe, role)) for role in ROLE_NAMES},
        "rules": rules,
        "master_weights": recipe.master_weights,
        "loss_scale": recipe.loss_scale,
        "accumulate": _accum_str(recipe.accumulate),
        "gemm": _gemm_spec_data(recipe.gemm),
        "last_layers": (None if recipe.last_layers is None
                        else [recipe.last_layers[0], str(recipe.last_layers[1])]),
        "name": recipe.name,
        "source": recipe.source,
    }


def _role_from(data) -> Role:
    fmt, mm = data
    return Role(None if fmt is None else _parse_format(fmt),
                None if mm is None else _parse_format(mm))


def recipe_from_dict(data: Dict[str, Any]) -> Recipe:
    """The Recipe that :func:`recipe_to_dict` described."""
    rules = {p: (_role_from(s) if isinstance(s, list) else
                 {k: _gemm_spec_from(v) if k == "gemm" else _role_from(v) for k, v in s.items()})
             for p, s in data.get("rules", {}).items()}
    gemm, last = _gemm_spec_from(data.get("gemm")), data.get("last_layers")
    return Recipe(**{role: _role_from(data[role]) for role in ROLE_NAMES}, rules=rules,
                  master_weights=data.get("master_weights", False),
                  loss_scale=data.get("loss_scale"),
                  accumulate=_accum_from(data.get("accumulate")), gemm=gemm,
                  last_layers=None if last is None else (last[0], _parse_format(last[1])),
                  name=data.get("name"), source=data.get("source"))


# ---------------------------------------------------------------------------------------------
# Plain state dicts

def plain_state_dict(model_or_state_dict) -> Dict[str, Any]:
    """The state of a (converted) model, or a state dict, as plain tensors plus formats as
    strings (see the module docstring). Values are the QTensors' payloads, detached (not
    copied): the exact values, in the payload dtype (float32 unless built from another)."""
    if isinstance(model_or_state_dict, nn.Module):
        state, conv = model_or_state_dict.state_dict(), conversion_of(model_or_state_dict)
    else:
        state, conv = model_or_state_dict, None
    tensors, formats = {}, {}
    for name, value in state.items():
        if isinstance(value, QTensor):
            formats[name] = tensor_formats(value)
            value = value.detach().dequantize()
        tensors[name] = value
    return {"qtensor": VERSION, "tensors": tensors, "formats": formats,
            "recipe": None if conv is None else recipe_to_dict(conv.recipe)}


def _check_plain(sd) -> None:
    if not (isinstance(sd, dict) and "tensors" in sd and "formats" in sd):
        keys = ", ".join(list(sd)[:4]) if isinstance(sd, dict) else type(sd).__name__
        raise TypeError(
            "expected what qt.plain_state_dict returns ({'qtensor', 'tensors', 'formats', "
            f"'recipe'}}), got {keys}; a state dict of QTensors loads with model.load_state_dict")


def qtensor_state_dict(sd: Dict[str, Any]) -> Dict[str, torch.Tensor]:
    """The state dict of QTensors that :func:`plain_state_dict` described (plain tensors stay
    plain). The values are wrapped as they are: they were saved in their formats."""
    _check_plain(sd)
    out = {}
    for name, value in sd["tensors"].items():
        info = sd["formats"].get(name)
        if info is not None:
            value = QTensor(value, info["fmt"], info.get("mm_fmt"),
                            accum=_accum_from(info.get("accum")))
        out[name] = value
    return out


def load_plain_state_dict(model: nn.Module, sd: Dict[str, Any], strict: bool = True):
    """Load what :func:`plain_state_dict` (or :func:`load_safetensors`) gave into ``model``.

    A model that is not converted is first converted to the checkpoint's recipe (when it has
    one); a converted model must have that recipe. Each QTensor of the checkpoint must meet a
    QTensor of the same formats in the model (else a ValueError naming the tensors): the values
    load exactly, never rounded again. Returns ``model.load_state_dict``'s result."""
    _check_plain(sd)
    recipe = None if sd.get("recipe") is None else recipe_from_dict(sd["recipe"])
    conv = conversion_of(model)
    if recipe is not None:
        if conv is None:
            convert(model, recipe)
        elif conv.recipe != recipe:
            raise ValueError(
                "qt.load_plain_state_dict: the model is converted with another recipe than the "
                f"checkpoint's:\n{conv.recipe.describe()}\nvs the checkpoint's\n"
                f"{recipe.describe()}\nconvert it to the checkpoint's (model.to(recipe)) first")
    state = model.state_dict()
    wrong = []
    for name in sd["tensors"]:
        mine = state.get(name)
        if mine is None:
            continue  # load_state_dict reports unexpected keys (strict)
        info = sd["formats"].get(name, {"fmt": "plain"})
        have = tensor_formats(mine) if isinstance(mine, QTensor) else {"fmt": "plain"}
        if {k: have.get(k) for k in ("fmt", "mm_fmt")} != {k: info.get(k) for k in
                                                            ("fmt", "mm_fmt")}:
            wrong.append(f"{name}: checkpoint {info.get('fmt')}, model {have.get('fmt')}")
    if wrong:
        raise ValueError("qt.load_plain_state_dict: formats differ between the checkpoint and "
                         "the model: " + "; ".join(wrong))
    return model.load_state_dict(qtensor_state_dict(sd), strict=strict)


# ---------------------------------------------------------------------------------------------
# safetensors

def _unshared(tensors: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """Contiguous tensors that share no memory (safetensors refuses shared ones: tied weights
    are stored twice, and tie again when loaded into the model)."""
    seen, out = set(), {}
    for name, t in tensors.items():
        t = t.detach().contiguous()
        key = (t.untyped_storage().data_ptr(), t.device) if t.numel() else None
        if key is not None and key in seen:
            t = t.clone()
        elif key is not None:
            seen.add(key)
        out[name] = t
    return out


def save_safetensors(model_or_state_dict, path, metadata: Optional[Dict[str, str]] = None):
    """Save a (converted) model's state, or a state dict, as a .safetensors file: plain tensors,
    the formats and recipe as JSON in its metadata (keys METADATA_FORMATS, METADATA_RECIPE)."""
    from safetensors.torch import save_file  # optional dependency
    plain = plain_state_dict(model_or_state_dict)
    meta = {"format": "pt", **(metadata or {}), METADATA_FORMATS: json.dumps(plain["formats"])}
    if plain["recipe"] is not None:
        meta[METADATA_RECIPE] = json.dumps(plain["recipe"])
    save_file(_unshared(plain["tensors"]), str(path), metadata=meta)


def load_safetensors(path, device: str = "cpu") -> Dict[str, Any]:
    """What :func:`save_safetensors` wrote, as :func:`plain_state_dict` gives it: load it into a
    model with :func:`load_plain_state_dict`, or as QTensors with :func:`qtensor_state_dict`."""
    from safetensors import safe_open
    from safetensors.torch import load_file
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
    recipe = meta.get(METADATA_RECIPE)
    return {"qtensor": VERSION, "tensors": load_file(str(path), device=device),
            "formats": json.loads(meta.get(METADATA_FORMATS, "{}")),
            "recipe": None if recipe is None else json.loads(recipe)}
