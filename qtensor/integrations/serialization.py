"""Checkpoints of converted models that plain tools can read: plain tensors plus formats as text.

A converted model's ``state_dict()`` holds QTensors: ``torch.save``/``torch.load`` round-trip
them exactly, but reading such a file needs qtensor imported (``torch.load(weights_only=True)``
refuses the unknown ``qtensor.tensor.subclass._rebuild_qtensor`` otherwise), and safetensors cannot store
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

from ..accum.format import AccumFormat, as_accum
from ..nn.convert import conversion_of, convert
from ..kernels.checks import FLOAT_DTYPES as PAYLOAD_DTYPES
from ..formats.parse import format as _parse_format, short_repr
from ..kernels.ops import count_off_format
from ..nn.plans import LAYER_KINDS, ROLE_NAMES, GemmFormats, Recipe, Role
from ..tensor.transforms import Hadamard
from ..tensor.subclass import QTensor, _accum_of_token, _accum_token

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
    if not isinstance(text, str):
        raise ValueError(f"an accumulator must be a string (a preset's name or field=value;...), "
                         f"got {type(text).__name__}")
    return _accum_of_token(text) if "=" in text else as_accum(text)  # fields, or a preset name


def tensor_formats(t: QTensor) -> Dict[str, str]:
    """A QTensor's formats as strings: ``{"fmt": ..., "mm_fmt": ..., "accum": ...}`` (the last
    two only when set)."""
    return formats_data(t.fmt, t.mm_fmt, t.accum)


def formats_data(fmt, mm_fmt=None, accum=None) -> Dict[str, str]:
    """:func:`tensor_formats` of a QTensor with these formats."""
    out = {"fmt": str(fmt)}
    if mm_fmt is not None:
        out["mm_fmt"] = str(mm_fmt)
    if accum is not None:
        out["accum"] = _accum_str(accum)
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
        "attention": None if recipe.attention is None else recipe.attention.to_dict(),
        "kv_cache": None if recipe.kv_cache is None else str(recipe.kv_cache),
        "name": recipe.name,
        "source": recipe.source,
    }


def _role_from(data) -> Role:
    fmt, mm = data
    return Role(None if fmt is None else _parse_format(fmt),
                None if mm is None else _parse_format(mm))


# what malformed plain data raises in the parsers below (a wrong type, a missing key, ...)
_MALFORMED = (TypeError, KeyError, IndexError, AttributeError, ValueError)


def _field(data, key, parse, what="recipe"):
    """``parse(data[key])`` with any failure as a ValueError naming the field."""
    try:
        return parse(data[key])
    except _MALFORMED as e:
        problem = "missing" if isinstance(e, KeyError) and e.args == (key,) else str(e) or repr(e)
        raise ValueError(f"{what} field {key!r}: {problem}") from None


def _rule_from(spec):
    if isinstance(spec, list):
        return _role_from(spec)
    return {k: _gemm_spec_from(v) if k == "gemm" else _role_from(v) for k, v in spec.items()}


def recipe_from_dict(data: Dict[str, Any]) -> Recipe:
    """The Recipe that :func:`recipe_to_dict` described (a ValueError naming the field where
    the data is not such a description)."""
    if not isinstance(data, dict):
        raise ValueError(f"a recipe must be a dict (recipe_to_dict's), got {type(data).__name__}")
    data = {"rules": {}, "master_weights": False, "loss_scale": None, "accumulate": None,
            "gemm": None, "last_layers": None, "attention": None, "kv_cache": None,
            "name": None, "source": None, **data}
    roles = {role: _field(data, role, _role_from) for role in ROLE_NAMES}
    rules = _field(data, "rules", lambda r: {p: _rule_from(v) for p, v in r.items()})
    last = _field(data, "last_layers",
                  lambda v: None if v is None else (v[0], _parse_format(v[1])))
    accumulate = _field(data, "accumulate", _accum_from)
    gemm = _field(data, "gemm", _gemm_spec_from)
    try:
        return Recipe(**roles, rules=rules, master_weights=data["master_weights"],
                      loss_scale=data["loss_scale"], accumulate=accumulate, gemm=gemm,
                      last_layers=last, attention=data["attention"], kv_cache=data["kv_cache"],
                      name=data["name"], source=data["source"])
    except (TypeError, ValueError) as e:
        raise ValueError(f"recipe: {e}") from None


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
    if not isinstance(sd["tensors"], dict):
        raise ValueError(f"{_where(sd, 'tensors')}: expected a dict of tensor names to tensors, "
                         f"got {type(sd['tensors']).__name__}")


def _where(sd, key: str) -> str:
    """Where a checkpoint's entry ``key`` came from, for errors: the file and its metadata key
    where load_safetensors read it."""
    path = sd.get("file")
    if path is None:
        return f"the checkpoint's {key!r}"
    meta = {"formats": METADATA_FORMATS, "recipe": METADATA_RECIPE}.get(key)
    return f"{path}: " + (f"metadata {meta!r}" if meta else "its tensors")


def _file(sd) -> str:
    return "" if sd.get("file") is None else f"{sd['file']}: "


_FORMAT_KEYS = ("fmt", "mm_fmt", "accum")


def parse_formats(formats, names, where: str) -> Dict[str, tuple]:
    """``{name: (fmt, mm_fmt, accum)}`` of what :func:`tensor_formats` wrote for each tensor,
    checked: a ValueError naming ``where`` and the tensor for anything else (a hand-edited,
    truncated or hostile checkpoint). ``names``: the tensors the checkpoint holds (None: not
    checked here)."""
    if not isinstance(formats, dict):
        raise ValueError(f"{where}: expected a dict of tensor names to formats, got "
                         f"{type(formats).__name__}")
    out = {}
    for name, info in formats.items():
        tensor = f"{where}, tensor {name!r}"
        if names is not None and name not in names:
            raise ValueError(f"{tensor}: formats for a tensor that the checkpoint does not hold")
        if not isinstance(info, dict) or not isinstance(info.get("fmt"), str):
            raise ValueError(f"{tensor}: expected {{'fmt': str, 'mm_fmt': str, 'accum': str}} "
                             f"(the last two optional), got {short_repr(info)}")
        extra = sorted(map(str, set(info) - set(_FORMAT_KEYS)))
        if extra:
            raise ValueError(f"{tensor}: unknown keys {', '.join(extra)} (expected "
                             f"{', '.join(_FORMAT_KEYS)})")
        try:
            out[name] = (_parse_format(info["fmt"]),
                         None if info.get("mm_fmt") is None else _parse_format(info["mm_fmt"]),
                         _accum_from(info.get("accum")))
        except (TypeError, ValueError) as e:  # (FormatError and AccumFormatError are ValueErrors)
            raise ValueError(f"{tensor}: {e}") from None
    return out


def _recipe_of(sd) -> Optional[Recipe]:
    data = sd.get("recipe")
    if data is None:
        return None
    try:
        return recipe_from_dict(data)
    except ValueError as e:
        raise ValueError(f"{_where(sd, 'recipe')}: {e}") from None


def qtensor_state_dict(sd: Dict[str, Any]) -> Dict[str, torch.Tensor]:
    """The state dict of QTensors that :func:`plain_state_dict` described (plain tensors stay
    plain). Each value must be in its format, as saved: a checkpoint changed after saving
    (a value that is not, say, an FP8 value under an FP8 format) is a ValueError naming the
    tensors, as is a malformed entry."""
    _check_plain(sd)
    formats = parse_formats(sd["formats"], sd["tensors"], _where(sd, "formats"))
    out, off = {}, []
    for name, value in sd["tensors"].items():
        if name in formats:
            fmt, mm_fmt, accum = formats[name]
            if not (isinstance(value, torch.Tensor) and value.dtype in PAYLOAD_DTYPES):
                raise ValueError(
                    f"{_where(sd, 'formats')}, tensor {name!r}: format {fmt} on a "
                    f"{type(value).__name__} of dtype {getattr(value, 'dtype', None)}; only "
                    "float32, float64, float16 and bfloat16 tensors carry a format")
            n = count_off_format(value, fmt)
            if n:
                off.append(f"{name} ({fmt}: {n} of {value.numel()} values)")
            value = QTensor._wrap(value, fmt, mm_fmt, accum=accum)
        out[name] = value
    if off:
        raise ValueError(
            f"{_where(sd, 'tensors')}: values not in the formats the checkpoint names (changed "
            "after saving?): " + ", ".join(off) + "; to load them rounded into the formats, "
            "load the plain values into a converted model: model.load_state_dict(sd['tensors'])")
    return out


def load_plain_state_dict(model: nn.Module, sd: Dict[str, Any], strict: bool = True):
    """Load what :func:`plain_state_dict` (or :func:`load_safetensors`) gave into ``model``.

    A model that is not converted is first converted to the checkpoint's recipe (when it has
    one); a converted model must have that recipe. Each QTensor of the checkpoint must meet a
    QTensor of the same formats in the model (else a ValueError naming the tensors): the values
    load exactly, never rounded again. Values not in their formats, and malformed entries, are
    refused before the model changes (:func:`qtensor_state_dict`). Returns
    ``model.load_state_dict``'s result."""
    _check_plain(sd)
    recipe = _recipe_of(sd)
    tensors = qtensor_state_dict(sd)
    conv = conversion_of(model)
    if recipe is not None:
        if conv is None:
            convert(model, recipe)
        elif conv.recipe != recipe:
            raise ValueError(
                f"{_file(sd)}qt.load_plain_state_dict: the model is converted with another recipe than the "
                f"checkpoint's:\n{conv.recipe.describe()}\nvs the checkpoint's\n"
                f"{recipe.describe()}\nconvert it to the checkpoint's (model.to(recipe)) first")
    state = model.state_dict()
    wrong = []
    for name, value in tensors.items():
        mine = state.get(name)
        if mine is None:
            continue  # load_state_dict reports unexpected keys (strict)
        have, saved = ((t.fmt, t.mm_fmt) if isinstance(t, QTensor) else ("plain", None)
                       for t in (mine, value))
        if have != saved:
            wrong.append(f"{name}: checkpoint {saved[0]}, model {have[0]}")
    if wrong:
        raise ValueError(f"{_file(sd)}qt.load_plain_state_dict: formats differ between the checkpoint and "
                         "the model: " + "; ".join(wrong))
    return model.load_state_dict(tensors, strict=strict)


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
    """What :func:`save_safetensors` wrote, as :func:`plain_state_dict` gives it, plus
    ``"file"``: the path, which later errors name. Load it into a model with
    :func:`load_plain_state_dict`, or as QTensors with :func:`qtensor_state_dict`. Malformed
    metadata (hand-edited, truncated, hostile) is a ValueError naming the file, the metadata
    key and the tensor."""
    from safetensors import SafetensorError, safe_open
    from safetensors.torch import load_file
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
        tensors = load_file(str(path), device=device)
    except SafetensorError as e:
        raise ValueError(f"{path}: not a readable safetensors file: {e}") from None

    def parsed(key, default):
        text = meta.get(key)
        if text is None:
            return default
        try:
            return json.loads(text)
        except (ValueError, RecursionError) as e:  # (RecursionError: nested arrays)
            raise ValueError(f"{path}: metadata {key!r} is not the JSON that "
                             f"qt.save_safetensors writes: {short_repr(str(e))}") from None

    sd = {"qtensor": VERSION, "tensors": tensors, "formats": parsed(METADATA_FORMATS, {}),
          "recipe": parsed(METADATA_RECIPE, None), "file": str(path)}
    parse_formats(sd["formats"], tensors, _where(sd, "formats"))  # (errors here, not later)
    _recipe_of(sd)
    return sd
