"""Recipe.attention and Recipe.kv_cache on a converted model: the hooks qt.convert attaches.

- ``attention``: the root's forward runs under :class:`qtensor.tensor.attention.AttentionMode` (entered
  by a forward pre-hook, left by a forward hook that runs even when forward raises), so every
  ``F.scaled_dot_product_attention`` and ``nn.MultiheadAttention`` inside it is emulated with
  the recipe's formats; a Hugging Face model with ``attn_implementation="eager"`` runs its eager
  attention functions through the same emulation. A model with no attention, and a Hugging Face
  model whose attention is computed otherwise (kernels, eager code with more math than the role
  defines), are refused with a ValueError.
- ``kv_cache``: every module whose forward takes a cache (``past_key_values``, ``cache``,
  ``past_key_value``, ``layer_past``) gets a pre-hook that wraps the Hugging Face cache it
  receives (qtensor.tensor.kv_cache.wrap) before its layers update it.
"""
from __future__ import annotations

import dis
import inspect
import types

import torch
from torch import nn

from ..tensor import kv_cache as _kv
from ..tensor import dispatch as _dispatch
from ..tensor.attention import AttentionMode, recording, with_globals
from ..tensor.subclass import QTensor
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


# HF's eager attention functions compute O = dropout(softmax(Q K^T * scaling + mask)) V (GQA by
# repeat_kv) when they use no other names than these; others (softcapping, sinks, position
# biases) compute something else and are refused
_EAGER_NAMES = frozenset({"repeat_kv", "num_key_value_groups", "torch", "matmul", "transpose",
                          "nn", "functional", "softmax", "float32", "to", "dtype", "dropout",
                          "training", "contiguous", "size", "type", "shape"})
_EAGER_PARAMS = frozenset({"module", "query", "key", "value", "attention_mask", "scaling",
                           "dropout", "kwargs"})
_EAGER = "eager_attention_forward"


def _eager_function(mod):
    """The module's HF eager attention function (the global its forward calls it by), or None."""
    fwd = inspect.unwrap(getattr(type(mod), "forward", None) or (lambda: None))
    code = getattr(fwd, "__code__", None)
    if code is None or _EAGER not in code.co_names:
        return None
    return fwd.__globals__.get(_EAGER)


def _eager_modules(model):
    """{module: its eager attention function} of an HF model, each checked to compute the role's
    math."""
    out = {}
    for name, mod in model.named_modules():
        fn = _eager_function(mod)
        if fn is None:
            continue
        code = fn.__code__
        extra = sorted(set(code.co_names) - _EAGER_NAMES)
        extra += sorted(set(code.co_varnames[:code.co_argcount + code.co_kwonlyargcount])
                        - _EAGER_PARAMS)
        if extra:
            raise ValueError(
                f"Recipe.attention: {fn.__module__}.{_EAGER} (attn_implementation='eager', used "
                f"by {name or 'the model'}) computes more than softmax(Q K^T * scaling + mask) V "
                f"with dropout ({', '.join(extra)}), which the attention formats do not define; "
                "use 'sdpa' (model.set_attn_implementation('sdpa'))")
        if getattr(mod, "reorder_and_upcast_attn", False):
            raise ValueError(
                f"Recipe.attention: {name} computes its eager attention in its own "
                "_upcast_and_reordered_attn (reorder_and_upcast_attn=True), which the attention "
                "formats do not reach; set reorder_and_upcast_attn=False or use 'sdpa'")
        out[mod] = fn
    if not out:
        raise ValueError(
            "Recipe.attention: this Hugging Face model uses attn_implementation='eager' in code "
            f"that does not call an {_EAGER}, which qtensor does not reach; use 'sdpa' "
            "(model.set_attn_implementation('sdpa'))")
    return out


def _emulated_eager(fn):
    """An HF eager attention function that runs as the attention role defines it: through HF's
    SDPA function (its masks, GQA and dropout) with eager's semantics (no implicit causal mask, the
    mask the function would add, dropout only in training), whose F.scaled_dot_product_attention
    the active AttentionMode emulates. It also returns P after dropout, as eager does."""
    uses_mask = any(i.argval == "attention_mask" and i.opname.startswith("LOAD_FAST")
                    for i in dis.get_instructions(fn))

    def eager_attention_forward(module, query, key, value, attention_mask, scaling=None,
                                dropout=0.0, **kwargs):
        if not any(isinstance(t, QTensor) for t in (query, key, value)):
            return fn(module, query, key, value, attention_mask, scaling=scaling,
                      dropout=dropout, **kwargs)
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
        with recording() as got:
            out, _ = sdpa_attention_forward(
                module, query, key, value, attention_mask if uses_mask else None,
                dropout=dropout if module.training else 0.0, scaling=scaling, is_causal=False)
        # (B, heads, queries, keys), as SDPA's packed GQA of one query gives it back
        w = got[-1].detach().reshape(out.shape[0], -1, query.shape[-2], got[-1].shape[-1])
        fmt = _dispatch.fit_format(out.fmt, w.dim())
        return out, QTensor._wrap(_dispatch.quantize(w, fmt), fmt,
                                  _dispatch._own_mm_fmt(out, QTensor))

    return eager_attention_forward


def _check_hf(model):
    impl = _hf_implementation(model)
    if impl == "eager":
        return _eager_modules(model)
    if impl is not None and impl != "sdpa":
        raise ValueError(
            f"Recipe.attention: this Hugging Face model uses attn_implementation={impl!r}, whose "
            "attention the attention formats do not reach (its own kernels); use 'sdpa' "
            "(model.set_attn_implementation('sdpa')) or 'eager', which qtensor emulates")
    return {}


class _Enter:
    def __init__(self, model, formats):
        self.model = model
        self.formats = formats
        self.active = []
        self.patched = []  # modules given an emulated eager forward for this forward
        self._forwards = {}  # class -> its forward calling the emulated eager function

    def __call__(self, module, args):
        eager = _check_hf(self.model)
        mode = AttentionMode(self.formats)
        mode.__enter__()
        self.active.append(mode)
        if len(self.active) == 1:
            self._patch(eager)

    def _patch(self, eager):
        # HF's eager attention modules call their modeling file's eager attention function as a
        # global: for the forward only, each module runs its class's forward with that global bound
        # to the emulation (an instance attribute; transformers is not changed)
        for mod, fn in eager.items():
            if "forward" in mod.__dict__:
                continue
            cls = type(mod)
            if cls not in self._forwards:
                self._forwards[cls] = with_globals(
                    cls.forward, **{_EAGER: _emulated_eager(fn)})
            mod.__dict__["forward"] = types.MethodType(self._forwards[cls], mod)
            self.patched.append(mod)

    def unpatch(self):
        while self.patched:
            self.patched.pop().__dict__.pop("forward", None)


class _Leave:
    def __init__(self, enter: _Enter):
        self.enter = enter

    def __call__(self, module, args, output):
        if self.enter.active:
            self.enter.active.pop().__exit__(None, None, None)
        if not self.enter.active:
            self.enter.unpatch()


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
