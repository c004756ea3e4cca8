"""String forms and parsing: ``str(f)`` (a preset's name, or the fields that differ from the
defaults) and :func:`format` (a format from a name, an alias or a string form), which give each
other back: ``qt.format(str(f)) == f``."""
from __future__ import annotations

import dataclasses
import difflib
import re
import types

from .base import Format, FormatError, register_string_form
from .block import BlockFormat
from .fixed import FixedFormat
from .float import FloatFormat, _p3109_name, p3109
from .presets import _PRESET_NAMES, _REFUSED, ALIASES, FORMAT_CLASSES, PRESETS

_FIELD_DEFAULTS = {
    cls: {f.name: f.default for f in dataclasses.fields(cls)} for cls in FORMAT_CLASSES}


def _value_str(v) -> str:
    if isinstance(v, Format):
        return _to_string(v)
    return str(v)


def _to_string(f: Format) -> str:
    if f in _PRESET_NAMES:
        return _PRESET_NAMES[f]
    # a preset with a different rounding mode: "fp8_e4m3(rounding=stochastic)"
    for name, p in PRESETS.items():
        if type(p) is type(f) and p.replace(rounding=f.rounding) == f:
            return f"{name}(rounding={f.rounding})"
    if isinstance(f, FloatFormat) and _p3109_name(f) is not None:
        base = _p3109_name(f)
        canonical = types.SimpleNamespace(saturate=False, rounding="nearest")
        skip, always = ("exp", "man", "bias", "subnormals", "specials", "signed"), ()
    elif isinstance(f, FloatFormat):
        base = f"e{f.exp}m{f.man}"
        # the defaults of FloatFormat(exp, man), without validating them: e1mY is only valid
        # with specials="none", so constructing the default could fail
        canonical = types.SimpleNamespace(
            bias=2 ** (f.exp - 1) - 1, subnormals=True, specials="ieee", saturate=False,
            rounding="nearest", signed=True)
        named = PRESETS.get(ALIASES.get(base, base))
        if named is not None:  # "e8m0", "e4m3" name presets: spell out the differences from it
            canonical = named
        skip, always = ("exp", "man"), ()
    elif isinstance(f, FixedFormat):
        canonical = FixedFormat(f.wl, f.fl)
        if f.fl <= f.wl:
            base, skip, always = f"fixed{f.wl}.{f.fl}", ("wl", "fl"), ()
        else:  # fixed(wl=8, fl=9): the shorthand fixed8.9 is refused (it reads as Q8.9)
            base, skip, always = "fixed", (), ("wl", "fl")
    else:
        base = "block"
        canonical = None
        skip, always = (), ("elem",)
    args = []
    for field in dataclasses.fields(f):
        if field.name in skip:
            continue
        value = getattr(f, field.name)
        if field.name not in always:
            if canonical is not None and getattr(canonical, field.name) == value:
                continue
            if canonical is None and value == _block_default(field.name):
                continue
        if field.name == "block_size" and f.block_shape is not None:
            continue  # rows * cols
        if field.name == "block_shape":
            value = f"{value[0]}x{value[1]}"
        args.append(f"{field.name}={_value_str(value)}")
    return base + (f"({', '.join(args)})" if args else "")


def _block_default(name):
    if name == "scale":
        return PRESETS["e8m0"]
    if name == "rounding":
        return "nearest"
    return _FIELD_DEFAULTS[BlockFormat][name]


def _split_args(text: str) -> list:
    """Split 'a=1, b=block(x=1, y=2)' on top-level commas."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
            if depth < 0:
                raise FormatError(f"unbalanced parentheses in {text!r}")
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth != 0:
        raise FormatError(f"unbalanced parentheses in {text!r}")
    parts.append(text[start:])
    return [p.strip() for p in parts if p.strip()]


def _parse_value(key: str, text: str):
    if key in ("elem", "scale"):
        return format(text)
    if text in ("True", "true"):
        return True
    if text in ("False", "false"):
        return False
    if text in ("None", "none") and key != "specials":
        return None
    if re.fullmatch(r"[+-]?\d+", text):
        return int(text)
    return text


def _known_names() -> str:
    names = [n for n in PRESETS if not n.startswith("binary")]
    return ", ".join(names + ["binaryKpP{s|u}{e|f} (IEEE P3109, e.g. binary8p3se)",
                              "eXmY (e.g. e3m4)", "fixedWL.FL (e.g. fixed8.4)",
                              "fixed(wl=..., fl=...)", "block(elem=..., block_size=...)"])


def format(spec) -> Format:
    """A format from a preset name, an alias, a string form (``str(f)``) or a format itself.

    Examples: ``"fp8_e4m3"``, ``"mxfp4_e2m1"``, ``"e3m4(bias=3)"``, ``"fixed8.4"``,
    ``"fp8_e4m3(rounding=stochastic)"``, ``"block(elem=fixed8.6(symmetric=True), block_size=16)"``.

    The grammar: ``NAME`` or ``NAME(key=value, ...)`` with keys the fields of the format. NAME is
    case-insensitive and is a preset (keys change its fields), an alias, ``eXmY``
    (``FloatFormat(X, Y)``: IEEE-style, except the OCP names below), ``fixedWL.FL``
    (``FixedFormat(WL, FL)``, only for FL <= WL: ``fixed8.9`` would read as Q8.9, so a word
    shorter than its fraction is spelled ``fixed(wl=8, fl=9)``), ``fixed(wl=..., fl=...)`` or
    ``block(elem=..., ...)``, or IEEE P3109's ``binaryKpP{s|u}{e|f}`` (:func:`p3109`; also
    gfloat's spelling ``p3109_kKpP..``; the K = 8 family are presets). Values: ints, names, formats, and for the flags exactly
    ``True``/``true`` or ``False``/``false``. Aliases, each exactly the format named: the torch
    dtype names ``float32``/``float`` (fp32), ``bfloat16`` (bf16), ``float16``/``half`` (fp16),
    ``float8_e4m3fn`` (fp8_e4m3, saturating as torch's cast), ``float8_e5m2`` (fp8_e5m2), which
    round as torch's casts from float32, float16 and bfloat16 (from float64 torch casts through
    float32, rounding twice; qtensor rounds once); ``mxfp8``, ``mxfp6``, ``mxfp4`` for the MX
    variants mxfp8_e4m3, mxfp6_e3m2, mxfp4_e2m1; ``mxfp4_b16`` for mxfp4_e2m1_b16 (MXFP4 with
    blocks of 16); and the OCP element names ``e4m3``
    (fp8_e4m3, max 448), ``e5m2`` (fp8_e5m2), ``e3m2`` (fp6_e3m2), ``e2m3`` (fp6_e2m3),
    ``e2m1`` (fp4_e2m1, max 6), with keys changing the preset (``e4m3(rounding=stochastic)``);
    the IEEE-style ``FloatFormat(4, 3)`` (max 240) is spelled ``e4m3(specials=ieee,
    saturate=False)``. ``float8_e8m0fnu`` is refused: torch's cast to it differs from ``e8m0``.
    """
    if isinstance(spec, Format):
        return spec
    if isinstance(spec, str):
        # equal strings give the same object: the kernels' caches are keyed by a format's id
        # (its hash walks its fields), so a string parsed anew per call would add entries
        f = _PARSED.get(spec)
        if f is None:
            f = _parse_string(spec)
            if len(_PARSED) >= _PARSED_SIZE:  # (strings made anew per call: bounded)
                _PARSED.clear()
            _PARSED[spec] = f
        return f
    return _parse_string(spec)


def dtype_hint(spec) -> str:
    """For a torch dtype given where a format belongs: "; for torch.X use qt.Y ..." (else "")."""
    name = str(spec).removeprefix("torch.") if type(spec).__module__ == "torch" else None
    if name in ALIASES:  # point at the format that is exactly the dtype
        return f"; for {spec} use qt.{ALIASES[name]} (or the string {name!r})"
    if name in _REFUSED:
        return f"; {_REFUSED[name]}"
    return ""


_PARSED: dict = {}  # format string -> its format (formats are immutable: sharing is safe)
_PARSED_SIZE = 1024
_MAX_NESTING = 8  # parentheses: block(elem=e4m3(...), scale=...) needs 2


def _nesting(text: str) -> int:
    depth = deepest = 0
    for ch in text:
        depth += (ch == "(") - (ch == ")")
        deepest = max(deepest, depth)
    return deepest


def _parse_string(spec) -> Format:
    if not isinstance(spec, str):
        raise FormatError(f"a format must be a format object or a string, got "
                          f"{type(spec).__name__}{dtype_hint(spec)}")
    text = spec.strip()
    if _nesting(text) > _MAX_NESTING:  # (the parser recurses per level)
        raise FormatError(f"format {short_repr(spec)} nests parentheses more than {_MAX_NESTING} "
                          "deep; no format needs that")
    m = re.fullmatch(r"([A-Za-z0-9_.\-]+)\s*(?:\((.*)\))?", text, flags=re.S)
    if not m:
        raise FormatError(f"cannot parse format {spec!r}; known formats: {_known_names()}")
    base, argtext = m.group(1), m.group(2)
    kwargs = {}
    for arg in _split_args(argtext or ""):
        if "=" not in arg:
            raise FormatError(f"in format {spec!r}: expected key=value, got {arg!r}")
        key, value = (s.strip() for s in arg.split("=", 1))
        kwargs[key] = _parse_value(key, value)
    lower = base.lower()
    if lower in _REFUSED:
        raise FormatError(f"format {spec!r}: {_REFUSED[lower]}")
    lower = ALIASES.get(lower, lower)
    try:
        if lower in PRESETS:
            return PRESETS[lower].replace(**kwargs) if kwargs else PRESETS[lower]
        mm = re.fullmatch(r"(?:binary|p3109_k)(\d+)p(\d+)([su])([ef])", lower)
        if mm:
            domain = "extended" if mm.group(4) == "e" else "finite"
            f = p3109(int(mm.group(1)), int(mm.group(2)), mm.group(3) == "s", domain)
            return f.replace(**kwargs) if kwargs else f
        mm = re.fullmatch(r"e(\d+)m(\d+)", lower)
        if mm:
            return FloatFormat(int(mm.group(1)), int(mm.group(2)), **kwargs)
        mm = re.fullmatch(r"fixed(\d+)\.(-?\d+)", lower)  # fl may be negative
        if mm:
            wl, fl = int(mm.group(1)), int(mm.group(2))
            if fl > wl:
                raise FormatError(
                    f"format {spec!r}: fixed{wl}.{fl} would be {fl} fractional bits in a word of "
                    f"{wl} bits (all values below 1/2); if that is meant, write fixed(wl={wl}, "
                    f"fl={fl}); for {wl} integer bits (sign included) and {fl} fractional bits, "
                    f"write fixed{wl + fl}.{fl}")
            return FixedFormat(wl, fl, **kwargs)
        if lower == "fixed":
            if "wl" not in kwargs or "fl" not in kwargs:
                raise FormatError(f"fixed-point format {spec!r} needs wl=... and fl=...")
            return FixedFormat(**kwargs)
        if lower == "block":
            if "elem" not in kwargs:
                raise FormatError(f"block format {spec!r} needs elem=...")
            return BlockFormat(**kwargs)
    except TypeError as e:  # unknown keyword
        raise FormatError(f"in format {spec!r}: {e}") from None
    close = difflib.get_close_matches(lower, list(PRESETS) + list(ALIASES), n=3, cutoff=0.6)
    hint = f"did you mean {' or '.join(repr(n) for n in close)}? " if close else ""
    raise FormatError(f"unknown format {short_repr(spec)}; {hint}known formats: {_known_names()}")


def short_repr(spec: str, limit: int = 80) -> str:
    """repr(spec), cut to ``limit`` characters (a malformed string may be long)."""
    r = repr(spec)
    return r if len(r) <= limit else r[:limit - 5] + "...'" + f" ({len(spec)} characters)"


register_string_form(_to_string, format)
