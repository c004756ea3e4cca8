"""Recipe.attention and Recipe.kv_cache on a converted model: the hooks qt.convert attaches.

- ``attention``: the root's forward runs under :class:`qtensor.tensor.attention.AttentionMode` (entered
  by a forward pre-hook, left by a forward hook that runs even when forward raises), so every
  ``F.scaled_dot_product_attention`` and ``nn.MultiheadAttention`` inside it is emulated with
  the recipe's formats. A model with no attention, and a Hugging Face model whose
  ``attn_implementation`` is not ``"sdpa"``, are refused with a ValueError.
- ``kv_cache``: every module whose forward takes a cache (``past_key_values``, ``cache``,
  ``past_key_value``, ``layer_past``) gets a pre-hook that wraps the Hugging Face cache it
  receives (qtensor.tensor.kv_cache.wrap) before its layers update it.
"""
from __future__ import annotations

import inspect

import torch
from torch import nn

from ..tensor import kv_cache as _kv
from ..tensor.attention import AttentionMode
from .convert import conversion_of, register_model_hooks, unconvert

__all__ = ["has_attention", "CACHE_ARGS"]

F = torch.nn.functional
CACHE_ARGS = ("past_key_values", "cache", "past_key_value", "layer_past")
_HANDLES = "_qt_attention_handles"


def _forward_source(mod) -> str:
    try:
        return inspect.getsource(type(mod).forward)
    except (OSError, TypeError):
        return ""


def _hf_implementation(model):
    impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
    return impl if isinstance(impl, str) else None


def has_attention(model: nn.Module) -> bool:
    """Whether the model has attention that Recipe.attention reaches: an
    nn.MultiheadAttention, a Hugging Face model with an attention implementation, or a module
    whose forward calls scaled_dot_product_attention."""
    if _hf_implementation(model) is not None:
        return True
    sources = {}
    for mod in model.modules():
        if isinstance(mod, nn.MultiheadAttention):
            return True
        cls = type(mod)
        if cls not in sources:
            sources[cls] = "scaled_dot_product_attention" in _forward_source(mod)
            if sources[cls]:
                return True
    return False


def _check_hf(model):
    impl = _hf_implementation(model)
    if impl is not None and impl != "sdpa":
        raise ValueError(
            f"Recipe.attention: this Hugging Face model uses attn_implementation={impl!r}, whose "
            "attention the attention formats do not reach (its own kernels or Python ops); use "
            "'sdpa' (model.set_attn_implementation('sdpa')), which qtensor emulates under any "
            "SDPA backend")


class _Enter:
    def __init__(self, model, formats):
        self.model = model
        self.formats = formats
        self.active = []

    def __call__(self, module, args):
        _check_hf(self.model)
        mode = AttentionMode(self.formats)
        mode.__enter__()
        self.active.append(mode)


class _Leave:
    def __init__(self, enter: _Enter):
        self.enter = enter

    def __call__(self, module, args, output):
        if self.enter.active:
            self.enter.active.pop().__exit__(None, None, None)


def _is_cache(v) -> bool:
    return callable(getattr(v, "update", None)) and type(v).__name__.endswith("Cache")


class _WrapCache:
    def __init__(self, fmt):
        self.fmt = fmt

    def __call__(self, module, args, kwargs):
        for v in list(args) + list(kwargs.values()):
            if _is_cache(v):
                _kv.wrap(v, self.fmt)


def _takes_cache(mod) -> bool:
    try:
        params = inspect.signature(type(mod).forward).parameters
    except (TypeError, ValueError):
        return False
    return any(name in params for name in CACHE_ARGS)


def _attach(model: nn.Module) -> None:
    recipe = conversion_of(model).recipe
    if recipe.attention is None and recipe.kv_cache is None:
        return
    handles = []
    try:
        if recipe.attention is not None:
            if not has_attention(model):
                raise ValueError(
                    "Recipe.attention: the model has no attention (no nn.MultiheadAttention, no "
                    "Hugging Face attention, no forward that calls "
                    "F.scaled_dot_product_attention); leave attention=None")
            _check_hf(model)
            enter = _Enter(model, recipe.attention)
            handles.append(model.register_forward_pre_hook(enter))
            handles.append(model.register_forward_hook(_Leave(enter), always_call=True))
        if recipe.kv_cache is not None:
            takers = [m for m in model.modules() if _takes_cache(m)]
            if not takers:
                raise ValueError(
                    "Recipe.kv_cache: no module of the model takes a KV cache (a forward "
                    f"argument named {', '.join(CACHE_ARGS)}); for a cache of your own, store "
                    "its states with qt.kv_cache.store(x, fmt)")
            hook = _WrapCache(recipe.kv_cache)
            handles.extend(m.register_forward_pre_hook(hook, with_kwargs=True) for m in takers)
    except ValueError:
        for h in handles:
            h.remove()
        unconvert(model)
        raise
    model.__dict__[_HANDLES] = handles


def _detach(model: nn.Module) -> None:
    for h in model.__dict__.pop(_HANDLES, ()):
        h.remove()


register_model_hooks(_attach, _detach)
