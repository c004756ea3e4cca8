"""microxcaling's MxSpecs vocabulary on qtensor: ``qt.convert(model, qt.compat.mx.recipe(specs))``.

microxcaling (github.com/microsoft/microxcaling, package ``mx``) configures MX emulation with a dict
of "MX specs". ``recipe(specs)`` maps one onto a :class:`qtensor.Recipe`; ``quantize_mx`` /
``quantize_mx_op`` and ``quantize_elemwise_op`` are its two rounding primitives. ``specs`` may be
an ``mx.MxSpecs``, a plain dict, or any object with those attributes (an argparse Namespace);
missing keys take microxcaling's defaults, the ``_bp`` / ``round_*`` keys are derived as its
``finalize_mx_specs`` does, and unknown keys are an error, as there.

The ``_bp`` formats and per-product roundings of microxcaling's Linear and Conv layers map onto
``Recipe.gemm`` (per-GEMM operand formats), exactly; what is still approximated (contractions of
two activations, one gradient value format) comes with a warning naming the key. Where microxcaling's numerics are
wrong (its float32 ``log2`` shared exponent, NaN scales, negative zero of integer elements)
qtensor follows its own contract (qtensor/kernels/reference.py).

Names, the role mapping, every approximation and every difference: docs/compat.md.
"""
from __future__ import annotations

import warnings
from typing import Any, Dict, Optional

import torch

from ..formats.block import BlockFormat
from ..formats.fixed import FixedFormat
from ..formats.float import FloatFormat
from ..formats.presets import PRESETS
from ..kernels.ops import quantize as _qt_quantize
from ..nn.plans import Recipe

__all__ = ["DEFAULTS", "ELEM_FORMATS", "ROUNDING", "finalize_mx_specs", "elem_format",
           "rounding", "scale_format", "mx_format", "vector_format", "recipe", "quantize_mx",
           "quantize_mx_op", "quantize_elemwise_op"]

# microxcaling's MxSpecs keys and defaults (mx/specs.py)
DEFAULTS: Dict[str, Any] = {
    "scale_bits": 0,
    "w_elem_format": None, "a_elem_format": None, "w_elem_format_bp": None,
    "a_elem_format_bp": None, "a_elem_format_bp_ex": None, "a_elem_format_bp_os": None,
    "mx_flush_fp32_subnorms": False,
    "shared_exp_method": "max", "block_size": 0,
    "bfloat": 0, "fp": 0, "bfloat_subnorms": True,
    "quantize_backprop": True,
    "round": "nearest", "round_m": "nearest", "round_weight": "nearest", "round_output": "nearest",
    "round_grad_weight": "nearest", "round_grad_input": "nearest", "round_mx_output": "nearest",
    "round_mx_input_grad_input": "nearest", "round_mx_weight_grad_input": "nearest",
    "round_mx_grad_output_grad_input": "nearest", "round_mx_input_grad_weight": "nearest",
    "round_mx_grad_output_grad_weight": "nearest",
    "softmax_exp2": False, "vec_use_exp2": False, "vec_use_recip": False,
    "custom_cuda": False,
}

ROUNDING = {"nearest": "nearest_away", "even": "nearest", "floor": "toward_zero",
            "dither": "stochastic"}

_P = PRESETS
ELEM_FORMATS = {
    "fp8_e5m2": _P["fp8_e5m2"], "fp8_e4m3": _P["fp8_e4m3"], "fp6_e3m2": _P["fp6_e3m2"],
    "fp6_e2m3": _P["fp6_e2m3"], "fp4_e2m1": _P["fp4_e2m1"], "fp4": _P["fp4_e2m1"],
    "int8": FixedFormat(8, 6, symmetric=True), "int4": FixedFormat(4, 2, symmetric=True),
    "int2": FixedFormat(2, 0, symmetric=True),
    "float16": _P["fp16"], "fp16": _P["fp16"], "bfloat16": _P["bf16"], "bf16": _P["bf16"],
}

# keys microxcaling derives from others when unset (finalize_mx_specs), in its order
_DERIVED = [
    ("w_elem_format_bp", "w_elem_format"), ("a_elem_format_bp", "a_elem_format"),
    ("a_elem_format_bp_os", "a_elem_format"), ("a_elem_format_bp_ex", "a_elem_format"),
    ("round_m", "round"), ("round_output", "round"), ("round_grad_weight", "round"),
    ("round_grad_input", "round"), ("round_weight", "round"), ("round_mx_output", "round"),
    ("round_mx_input_grad_input", "round_grad_input"),
    ("round_mx_weight_grad_input", "round_grad_input"),
    ("round_mx_grad_output_grad_input", "round_grad_input"),
    ("round_mx_input_grad_weight", "round_grad_input"),
    ("round_mx_grad_output_grad_weight", "round_grad_input"),
]
_IGNORED = ("mx_flush_fp32_subnorms", "softmax_exp2", "vec_use_exp2", "vec_use_recip")


def _as_dict(specs) -> Dict[str, Any]:
    if specs is None:
        return {}
    if isinstance(specs, dict):
        return dict(specs)
    if hasattr(specs, "keys") and hasattr(specs, "__getitem__"):  # MxSpecs (a UserDict)
        return {k: specs[k] for k in specs.keys()}
    if hasattr(specs, "__dict__"):  # argparse.Namespace and similar
        return {k: v for k, v in vars(specs).items() if k in DEFAULTS}
    raise TypeError(f"MX specs must be a dict, an MxSpecs or an object with attributes, "
                    f"got {type(specs).__name__}")


def finalize_mx_specs(specs) -> Dict[str, Any]:
    """A complete spec dict: derived keys filled as microxcaling's finalize_mx_specs, then defaults."""
    given = _as_dict(specs)
    unknown = sorted(k for k in given if k not in DEFAULTS)
    if unknown:
        raise KeyError(f"unknown MX spec key(s) {', '.join(map(repr, unknown))}; "
                       f"known keys: {', '.join(DEFAULTS)}")
    for key, source in _DERIVED:
        if given.get(key) is None and given.get(source) is not None:
            given[key] = given[source]
    out = dict(DEFAULTS)
    out.update({k: v for k, v in given.items() if v is not None})
    return out


# ---------------------------------------------------------------------------------------------
# Names to formats

def elem_format(name):
    """The qtensor element format of a microxcaling element format name (None stays None)."""
    if name is None:
        return None
    key = getattr(name, "name", name)  # an mx.ElemFormat member
    if not isinstance(key, str) or key.lower() not in ELEM_FORMATS:
        raise ValueError(f"unknown microxcaling element format {name!r}; expected one of "
                         f"{', '.join(ELEM_FORMATS)}")
    return ELEM_FORMATS[key.lower()]


def rounding(name: str) -> str:
    """The qtensor rounding mode of a microxcaling rounding name."""
    if name not in ROUNDING:
        raise ValueError(f"unknown microxcaling rounding {name!r}; expected one of "
                         f"{', '.join(ROUNDING)} (its 'dither' is stochastic rounding)")
    return ROUNDING[name]


def scale_format(scale_bits: int = 8) -> FloatFormat:
    """The shared-exponent format: exponents -(2^(b-1)-1)..2^(b-1)-1 (E8M0 for b = 8; 0 means 8)."""
    bits = 8 if scale_bits in (0, None) else scale_bits
    if isinstance(bits, bool) or not isinstance(bits, int) or not 2 <= bits <= 8:
        raise ValueError(f"scale_bits must be 0 (= 8) or 2..8, got {scale_bits!r}")
    return FloatFormat(bits, 0, bias=2 ** (bits - 1) - 1, subnormals=False, specials="fn",
                       saturate=False, signed=False)


def mx_format(elem, block_size: int = 32, round: str = "nearest", *, axis: int = -1,
              scale_bits: int = 8, shared_exp_method: str = "max") -> Optional[BlockFormat]:
    """The BlockFormat of microxcaling's MX quantization (None when elem is None)."""
    efmt = elem_format(elem)
    if efmt is None:
        return None
    if shared_exp_method == "none":
        block_size = 1  # one exponent per element
    elif shared_exp_method != "max":
        raise ValueError(f"shared_exp_method must be 'max' or 'none', got {shared_exp_method!r}")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 0:
        raise ValueError(f"block_size must be an int >= 0 (0: the whole axis), got {block_size!r}")
    try:
        return BlockFormat(efmt, block_size or None, axis, scale=scale_format(scale_bits),
                           scale_rule="floor", rounding=rounding(round))
    except ValueError as e:  # e.g. bfloat16 elements: values below float32's subnormals
        raise ValueError(f"MX with {elem!r} elements cannot be emulated in float32: {e}") from None


def vector_format(specs, round: Optional[str] = None) -> Optional[FloatFormat]:
    """The bfloat/fp value format of a spec (None for FP32), with the given rounding name."""
    s = finalize_mx_specs(specs)
    bfloat, fp = s["bfloat"], s["fp"]
    mode = rounding(s["round"] if round is None else round)
    sub = bool(s["bfloat_subnorms"])
    if bfloat > 0 and fp > 0:
        raise ValueError("Cannot set both [bfloat] and [fp] in mx_specs.")
    if bfloat in (0, 32) and fp == 0:
        return None
    if bfloat:
        if bfloat <= 9:
            raise ValueError(f"bfloat must be > 9 (1 sign, 8 exponent, >= 1 mantissa bits), got {bfloat}")
        return FloatFormat(8, bfloat - 9, subnormals=sub, rounding=mode)
    if fp <= 6:
        raise ValueError(f"fp must be > 6 (1 sign, 5 exponent, >= 1 mantissa bits), got {fp}")
    return FloatFormat(5, fp - 6, subnormals=sub, rounding=mode)


# ---------------------------------------------------------------------------------------------
# The recipe

# The operand formats of microxcaling's three GEMMs (elem key, rounding key); None: "nearest"
# (its quantize_mx_op default). mx.Linear (mx/linear.py) uses the _bp formats backward;
# mx.Conv (mx/convolution.py) the forward elem formats in all three, with the default rounding.
_GEMM_KEYS = {
    "linear": {"fprop": (("a_elem_format", "round_mx_output"), ("w_elem_format", "round_mx_output")),
               "dgrad": (("a_elem_format_bp_os", "round_mx_grad_output_grad_input"),
                         ("w_elem_format_bp", "round_mx_weight_grad_input")),
               "wgrad": (("a_elem_format_bp", "round_mx_input_grad_weight"),
                         ("a_elem_format_bp_ex", "round_mx_grad_output_grad_weight"))},
    "conv": {"fprop": (("a_elem_format", None), ("w_elem_format", None)),
             "dgrad": (("a_elem_format", None), ("w_elem_format", None)),
             "wgrad": (("a_elem_format", None), ("a_elem_format", None))},
}


def _approximation_warnings(s: Dict[str, Any]) -> list:
    notes = []
    if s["round_grad_weight"] != s["round_grad_input"] and s["quantize_backprop"]:
        notes.append(f"round_grad_weight={s['round_grad_weight']!r} differs from round_grad_input="
                     f"{s['round_grad_input']!r}: round_grad_input is used (one gradient value "
                     "format)")
    if (elem_format(s["a_elem_format_bp"]) != elem_format(s["a_elem_format"])
            or s["round_mx_input_grad_input"] != s["round_mx_output"]) and s["quantize_backprop"]:
        notes.append("a_elem_format_bp / round_mx_input_grad_input: contractions of two "
                     "activations (mx.matmul, mx.bmm: attention) keep a_elem_format "
                     "(round_mx_output) in their backward products; Linear and Conv layers are "
                     "exact")
    if not s["quantize_backprop"] and (s["bfloat"] or s["fp"]):
        notes.append("quantize_backprop=False: the backward products use the bfloat/fp values "
                     "of x and W (microxcaling saves the unrounded FP32 ones)")
    for key in _IGNORED:
        if s[key] != DEFAULTS[key]:
            notes.append(f"{key}={s[key]!r} is not emulated (ignored)")
    if s["round_m"] != s["round"]:
        notes.append("round_m (microxcaling's own optimizers) is ignored")
    return notes


def recipe(specs, *, warn: bool = True):
    """A ``qt.Recipe`` reproducing an MxSpecs setup (docs/compat.md gives the mapping).

    ``warn``: emit one warning listing the spec keys that the recipe can only approximate.
    """
    s = finalize_mx_specs(specs)
    mx = lambda key, rnd: mx_format(s[key], s["block_size"], s[rnd] if rnd else "nearest",
                                    scale_bits=s["scale_bits"],
                                    shared_exp_method=s["shared_exp_method"])
    v_weight = vector_format(s, s["round_weight"])
    v_act = vector_format(s, s["round_output"])
    v_grad = vector_format(s, s["round_grad_input"])
    w_mm = mx("w_elem_format", "round_mx_output")
    a_mm = mx("a_elem_format", "round_mx_output")
    g_mm = mx("a_elem_format_bp_os", "round_mx_grad_output_grad_input")

    def role(value, mm):
        if value is None and mm is None:
            return None
        return (value or _P["fp32"], mm)

    grad = role(v_grad, g_mm) if s["quantize_backprop"] else None
    # per-GEMM operand formats (Recipe.gemm) where they differ from what the roles give:
    # fprop (x, W), dgrad (dY, W), wgrad (x, dY); None (no MX) is FP32, unrounded
    g_own = g_mm if s["quantize_backprop"] else None
    own = {"fprop": (a_mm, w_mm), "dgrad": (g_own, w_mm), "wgrad": (a_mm, g_own)}
    gemm = {}
    for kind, gemms in _GEMM_KEYS.items():
        fmts = {name: tuple(mx(k, r) if s["quantize_backprop"] or name == "fprop" else None
                            for k, r in pair) for name, pair in gemms.items()}
        if fmts != own:
            gemm[kind] = {name: tuple(f or _P["fp32"] for f in pair)
                          for name, pair in fmts.items()}
    if warn:
        notes = _approximation_warnings(s)
        if notes:
            warnings.warn("qtensor.compat.mx.recipe approximates: " + "; ".join(notes),
                          stacklevel=2)
    name = ", ".join(f"{k}={s[k]}" for k in ("w_elem_format", "a_elem_format", "block_size",
                                              "bfloat", "fp") if s[k])
    return Recipe(weight=role(v_weight, w_mm), bias=v_weight, activation=role(v_act, a_mm),
                  grad=grad, optimizer_state=None, master_weights=v_weight is not None,
                  gemm=gemm or None, name=f"mx({name})",
                  source="microxcaling MxSpecs via qtensor.compat.mx")


# ---------------------------------------------------------------------------------------------
# Rounding primitives

def quantize_mx(x: torch.Tensor, elem_format, block_size: int = 32, axis: int = -1,
                round: str = "nearest", scale_bits: int = 8,
                shared_exp_method: str = "max") -> torch.Tensor:
    """x in MX(elem_format) with blocks of ``block_size`` along ``axis`` (0: the whole axis).

    microxcaling's ``_quantize_mx`` with qtensor.kernels.reference's exact shared exponent.
    """
    fmt = mx_format(elem_format, block_size, round, axis=axis, scale_bits=scale_bits,
                    shared_exp_method=shared_exp_method)
    return x if fmt is None else _qt_quantize(x, fmt)


def quantize_mx_op(A: torch.Tensor, mx_specs, elem_format=None, block_size=None, axes=None,
                   round: str = "nearest", expand_and_reshape: bool = False) -> torch.Tensor:
    """microxcaling's ``quantize_mx_op`` signature; ``axes``: one axis (an int or a 1-list)."""
    if elem_format is None:
        return A
    s = finalize_mx_specs(mx_specs)
    if axes is None:
        raise ValueError("quantize_mx_op needs axes (the axis the blocks run along)")
    axes = [axes] if isinstance(axes, int) else list(axes)
    if len(axes) != 1:
        raise ValueError(f"blocks along several axes at once are not supported, got axes={axes}")
    return quantize_mx(A, elem_format, s["block_size"] if block_size is None else block_size,
                       axes[0], round, s["scale_bits"], s["shared_exp_method"])


def quantize_elemwise_op(A: torch.Tensor, mx_specs, round: Optional[str] = None) -> torch.Tensor:
    """microxcaling's bfloat/fp rounding of vector-op values (a no-op without bfloat/fp)."""
    if mx_specs is None:
        return A
    fmt = vector_format(mx_specs, round)
    return A if fmt is None else _qt_quantize(A, fmt)
