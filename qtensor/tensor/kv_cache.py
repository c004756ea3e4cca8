"""KV-cache formats: K and V stored in a cache format, as inference kernels store them.

A cache format rounds each token's key and value vectors when they enter the cache, one token
(and head) at a time, along the head dim: per-token scales (a block of the whole head dim, e.g.
:data:`FP8_PER_TOKEN`) or per-block scales (1D blocks along the head dim: MXFP4's 32, NVFP4's
16). Earlier tokens never change when tokens are appended, so a cache grown token by token holds
the bits of the whole sequence rounded at once. Attention reads the stored values (the
dequantized cache: each element times its block's scale, which is what a QTensor's payload
holds), the new tokens' included.

- :func:`store` rounds new key/value states into a cache format (for a plain ``torch.cat``
  cache: ``cache_k = torch.cat([cache_k, qt.kv_cache.store(k, fmt)], dim=-2)``).
- :func:`wrap` makes a Hugging Face cache (``DynamicCache``, ``StaticCache``, any ``Cache``)
  store its updates in a format; ``Recipe(kv_cache=fmt)`` wraps every cache a converted model's
  layers receive (qtensor.nn.attention_hooks).
- :func:`cache_format` checks that a format can be a cache format (precise errors).
"""
from __future__ import annotations

from typing import Optional

import torch

from . import dispatch as _dispatch
from ..formats.presets import PRESETS
from ..formats.block import BlockFormat
from ..formats.base import Format, FormatError
from ..formats.parse import format as _parse_format
from .subclass import QTensor

__all__ = ["store", "wrap", "cache_format", "FP8_PER_TOKEN", "FP8_PER_BLOCK", "NVFP4", "MXFP4",
           "MXFP8"]

# Cache formats: FP8 E4M3 with one FP32 scale per token and head (its amax / 448), or per
# block of 32 along the head dim; NVFP4 (E4M3 scales of 16 elements, no tensor scale: a
# tensor-wide scale would change as tokens arrive); MXFP4, MXFP8 (E8M0 scales of 32)
FP8_PER_TOKEN = BlockFormat(PRESETS["fp8_e4m3"], None, axis=-1, scale="fp32", scale_rule="amax")
FP8_PER_BLOCK = BlockFormat(PRESETS["fp8_e4m3"], 32, axis=-1, scale="fp32", scale_rule="amax")
NVFP4 = PRESETS["nvfp4_single"]
MXFP4 = PRESETS["mxfp4_e2m1"]
MXFP8 = PRESETS["mxfp8_e4m3"]


def cache_format(spec, what: str = "kv_cache") -> Optional[Format]:
    """The cache format ``spec`` (a format or its name; None: none), or a FormatError saying why
    it cannot hold a KV cache's values."""
    if spec is None:
        return None
    try:
        fmt = spec if isinstance(spec, Format) else _parse_format(spec)
    except (FormatError, ValueError, TypeError) as e:
        raise FormatError(f"{what}: {e}") from None
    elem = fmt.elem if fmt.is_block else fmt
    if elem.unsigned_range() is not None:
        raise FormatError(f"{what}: {fmt} cannot hold keys and values: they are signed, and it "
                          "holds no negative values")
    if fmt.is_block:
        if fmt.axis is None or fmt.block_shape is not None:
            raise FormatError(
                f"{what}: {fmt} shares scales across tokens ({'one block for the whole tensor' if fmt.axis is None else '2D tiles over tokens x head dim'}): "
                "a cache's stored tokens would change as tokens are appended. Use blocks along "
                "the head dim (axis=-1): per token (block_size=None) or per block")
        if fmt.axis != -1:
            raise FormatError(f"{what}: {fmt} has its blocks along axis {fmt.axis}; a cache's "
                              "blocks run along the head dim, axis=-1 (one token at a time)")
        if fmt.tensor_scale:
            raise FormatError(
                f"{what}: {fmt} has a per-tensor scale (from the whole tensor's amax), which "
                "would change as tokens are appended; use its block scales alone "
                "(qt.kv_cache.NVFP4 = nvfp4_single)")
    return fmt


def _check_values(x: torch.Tensor, fmt: Format, what: str) -> None:
    """A ValueError when fmt has no scale and x has finite values past its range (they would be
    clipped or become Inf: the cache cannot hold them)."""
    if fmt.is_block or x.numel() == 0:
        if fmt.is_block and x.shape[-1] % (fmt.block_size or x.shape[-1]):
            raise ValueError(
                f"{what}: the head dim {x.shape[-1]} is not a multiple of the cache format's "
                f"block size {fmt.block_size} ({fmt}): its last block would be partial")
        return
    finite = x[torch.isfinite(x)]
    amax = float(finite.abs().max()) if finite.numel() else 0.0
    if amax > fmt.max:
        raise ValueError(
            f"{what}: the cache format {fmt} cannot hold these values: |x| reaches {amax:g}, "
            f"past its largest value {fmt.max:g}. Use a scaled cache format "
            "(qt.kv_cache.FP8_PER_TOKEN: a scale per token and head)")


def store(x: torch.Tensor, fmt, what: str = "kv_cache") -> torch.Tensor:
    """Key or value states x (..., tokens, head_dim) as the cache stores them in ``fmt``: each
    token's vector rounded along the head dim. A QTensor x gives a QTensor in ``fmt`` that keeps
    x's operand format (attention's GEMMs round it as before); a plain x gives plain values."""
    fmt = cache_format(fmt, what)
    if fmt is None:
        return x
    data = x._data if isinstance(x, QTensor) else x
    if x.dim() < 2:
        raise ValueError(f"{what}: key/value states must be (..., tokens, head_dim), got shape "
                         f"{tuple(x.shape)}")
    _check_values(data.detach(), fmt, what)
    rounded = _dispatch.quantize(data.detach(), fmt)
    if not isinstance(x, QTensor):
        return rounded
    return QTensor._wrap(rounded, fmt, _dispatch._own_mm_fmt(x, QTensor))


class _CacheUpdate:
    """``cache.update`` of a wrapped Hugging Face cache: the new states rounded into the cache
    format, then the class's own update. A layer's buffers (DynamicLayer's empty start,
    StaticLayer's preallocated zeros) are made QTensors in the format before its first update,
    so that the update writes QTensors into QTensors (no plain tensor meets the states)."""

    def __init__(self, cache, fmt: Format):
        self.cache = cache
        self.fmt = fmt

    def __call__(self, key_states, value_states, layer_idx=None, *args, **kwargs):
        k = store(key_states, self.fmt, "kv_cache (keys)")
        v = store(value_states, self.fmt, "kv_cache (values)")
        layers = getattr(self.cache, "layers", None)
        if (isinstance(k, QTensor) and layers is not None and isinstance(layer_idx, int)
                and layer_idx < len(layers)):
            layer = layers[layer_idx]
            if not getattr(layer, "is_initialized", True):
                layer.lazy_initialization(k, v)
            for name, like in (("keys", k), ("values", v)):
                t = getattr(layer, name, None)
                if isinstance(t, torch.Tensor) and not isinstance(t, QTensor):
                    # (zeros and an empty start are in every format)
                    setattr(layer, name, QTensor._wrap(
                        t, _dispatch.fit_format(self.fmt, t.dim()), like.mm_fmt))
        return type(self.cache).update(self.cache, k, v, layer_idx, *args, **kwargs)


def wrap(cache, fmt):
    """Make the Hugging Face cache ``cache`` store K and V in ``fmt`` (checked by
    :func:`cache_format`); returns the cache. Wrapping again with another format is refused."""
    fmt = cache_format(fmt)
    if fmt is None:
        return cache
    if not callable(getattr(cache, "update", None)):
        raise TypeError(f"qt.kv_cache.wrap: expected a cache with an update(key_states, "
                        f"value_states, layer_idx, ...) method, got {type(cache).__name__}")
    have = cache.__dict__.get("update")
    if isinstance(have, _CacheUpdate):
        if have.fmt != fmt:
            raise ValueError(f"qt.kv_cache.wrap: this cache already stores {have.fmt}, not "
                             f"{fmt}; make a new cache")
        return cache
    cache.update = _CacheUpdate(cache, fmt)
    return cache


def format_of(cache) -> Optional[Format]:
    """The format a wrapped cache stores (None: not wrapped)."""
    have = getattr(cache, "__dict__", {}).get("update")
    return have.fmt if isinstance(have, _CacheUpdate) else None
