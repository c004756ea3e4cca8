"""The format protocol: :class:`Format` (the questions code outside qtensor.formats asks of a
format, each family answering them in its own class), :class:`FormatError`, the rounding modes,
and the float32 carrier's limits and the argument checks the families share.

The string form and the parser name presets and build formats of every family, so they sit
above the families (qtensor.formats.parse) and register here (:func:`register_string_form`):
``str(f)`` and a family given a format by name (``BlockFormat(elem="fp8_e4m3")``) use them.
"""
from __future__ import annotations

import dataclasses
import math
import re
from typing import Optional

from .torch_function import TorchFunctionTarget

# (besides these, "stochasticN" for N = 1..31: stochastic rounding with N random bits, as
# hardware does it: NVIDIA's cvt.rs takes 8; "stochastic" uses 32)
ROUNDING_MODES = ("nearest", "nearest_away", "toward_zero", "stochastic")
_DETERMINISTIC = frozenset({"nearest", "nearest_away", "toward_zero"})

# The float32 carrier: every value of every format must be a float32 exactly.
_F32_MAN = 23
_F32_EMAX = 127
_F32_MIN_QUANTUM_EXP = -149  # exponent of the smallest float32 subnormal
_F32_MAX = 3.4028234663852886e38
_F32_EXP = 8  # more exponent bits give more binades than float32's 2^-149..2^127
# A block size or axis beyond any tensor's (the kernels take int64 and add sizes to block sizes)
_MAX_INDEX = 2 ** 62


class FormatError(ValueError):
    """An impossible or unknown number format."""


def _significant_bits(f) -> int:
    """Significant bits of a float or fixed-point format's values (the implicit bit counted)."""
    return f.significant_bits


def stochastic_bits(rounding: str) -> Optional[int]:
    """The random bits per element of a stochastic rounding mode (32 for ``"stochastic"``, N for
    ``"stochasticN"``), None for the deterministic modes."""
    if rounding == "stochastic":
        return 32
    if isinstance(rounding, str):
        if rounding in _DETERMINISTIC:  # (no regex: this runs on every rounding)
            return None
        m = re.fullmatch(r"stochastic([1-9][0-9]?)", rounding)
        if m and int(m.group(1)) <= 31:
            return int(m.group(1))
    return None


def is_stochastic(rounding: str) -> bool:
    """Whether a rounding mode draws random bits (``"stochastic"`` or ``"stochasticN"``)."""
    return stochastic_bits(rounding) is not None


def _check_rounding(rounding: str) -> None:
    if rounding not in ROUNDING_MODES and stochastic_bits(rounding) is None:
        hint = ""
        if isinstance(rounding, str) and rounding.startswith("stochastic"):
            hint = ("; limited-bit stochastic rounding is 'stochasticN' with N = 1..31 random "
                    "bits per element ('stochastic' uses 32)")
        raise FormatError(
            f"unknown rounding mode {rounding!r}; expected one of {', '.join(ROUNDING_MODES)} "
            f"or stochasticN (N = 1..31){hint}")


def _check_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise FormatError(f"{name} must be an int, got {value!r}")


def _int_str(v: int) -> str:
    """An int for a message, huge ones as 2**k + d or about 10**k (2**63, 10**30 stay readable)."""
    a = abs(v)
    if a < 10 ** 12:
        return str(v)
    for k in (a.bit_length() - 1, a.bit_length()):
        d = a - 2 ** k
        if abs(d) < 10 ** 6:
            text = f"2**{k}" + (f" {'+-'[d < 0]} {abs(d)}" if d else "")
            break
    else:
        n = len(str(a)) - 1
        text = f"10**{n}" if a == 10 ** n else f"about 10**{n}"
    return text if v >= 0 else (f"-{text}" if text.startswith("2**") and "+" not in text
                                and " - " not in text else f"-({text})")


def _check_bool(name: str, value) -> None:
    # only True/False: a truthy "no", "FALSE" or 0/1 would silently flip the flag's meaning
    if not isinstance(value, bool):
        raise FormatError(f"{name} must be True or False, got {value!r}")


_to_string = None  # (format) -> its string form: formats.parse._to_string
_parse = None  # (spec) -> a format: formats.parse.format


def register_string_form(to_string, parse) -> None:
    """Set the string form and the parser (qtensor.formats.parse registers its own)."""
    global _to_string, _parse
    _to_string, _parse = to_string, parse


def parse(spec) -> "Format":
    """A format from its name or string form (the registered parser: qtensor.formats.format)."""
    return _parse(spec)


class Format(TorchFunctionTarget):
    """Common behaviour of all formats (``model.to(fmt)``, ``t.to(fmt)``: qtensor.formats.torch_function).

    The format protocol: the questions code outside this module asks of a format, answered by
    each family (the defaults below are a scalar format's), so that callers need not switch on
    the format's class and a new family answers them in its own class
    (docs/architecture.md, "The format protocol")."""

    #: Whether its values are sign, exponent and significand with a fixed minimum normal exponent
    #: (then the format has ``man``, ``emin``, ``emax``, ``subnormals``, ``signed``, ``specials``).
    is_float = False
    #: Whether -0.0 is no value of it: a result that rounds to zero is +0.0 (fixed point, P3109,
    #: unsigned formats); otherwise zeros keep their sign.
    no_negative_zero = True
    #: Whether values share scales in blocks (then the format has ``elem``, ``scale``,
    #: ``block_size``, ``axis``, ``block_shape``, ``scale_rule`` and ``tensor_scale``).
    is_block = False
    #: Whether the format only holds block scales: no sign, so no model value (E8M0, UE5M3).
    scale_only = False
    #: Whether its exponent range is FP32's (BF16, TF32, FP32): no model value overflows it.
    has_fp32_range = False
    #: Whether it has FP32's exponent and mantissa widths (e8m23): rounding a float32 to it is
    #: (FP32's own bias and specials aside) no rounding.
    is_fp32 = False
    #: Whether rounding can put a finite value beyond its block's largest value (a block format
    #: whose block scale can be too small for a block's amax).
    clips_in_blocks = False
    #: Whether rounding follows Transformer Engine's two-level rule: an FP32 scale per tensor,
    #: from its amax, and the block scales under it (then the format has ``settle`` and
    #: ``tensor_scale_bound``; a QTensor of it carries its tensor scale).
    is_two_level = False
    #: Whether its blocks are 2D tiles (``block_shape``) over a tensor's last two dims.
    is_tiled = False

    @property
    def max_magnitude(self) -> Optional[float]:
        """The largest finite magnitude a rounding to this format gives (None: none fixed)."""
        return None

    def unsigned_range(self) -> Optional[str]:
        """The values, in words, of a format that cannot hold negative values (None: signed)."""
        return None

    def block_extent(self, ndim: int, dim: int, size: int) -> int:
        """How many consecutive indices along ``dim`` (of ``size``) one block spans in a tensor of
        ``ndim`` dims: 1 where the rounding is elementwise along ``dim``."""
        return 1

    def storage_bits(self, shape) -> float:
        """The bits a tensor of ``shape`` takes in this format (block scales counted per block)."""
        return float(self.bits * math.prod(shape))

    def kernel_args(self) -> tuple:
        """``(name, args)``: the custom op ``qtensor::<name>`` that rounds a tensor to this format
        and its arguments after x, before the rounding mode's code and the seed (the op schemas
        of csrc/quantize.cpp)."""
        raise NotImplementedError(
            f"{type(self).__name__} has no rounding kernel: a format family implements kernel_args")

    def element_args(self) -> list:
        """Its arguments as a block's element format in the block ops (``quantize_block``,
        ``quantize_two_level``): [kind, ...] as csrc/op_common.h reads them."""
        raise FormatError(f"{self} cannot be a block's element format")

    def replace(self, **changes) -> "Format":
        """A copy with some fields changed, validated like a new format."""
        return dataclasses.replace(self, **changes)

    def __str__(self) -> str:
        return _to_string(self)

