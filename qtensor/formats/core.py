"""Number formats: immutable descriptions, presets and parsing.

A format says which values exist and how a real number is rounded to one of them. Three kinds:

- ``FloatFormat(exp, man, ...)``: sign/exponent/mantissa floats (IEEE-like, OCP "fn", or with no
  special codes at all), plus exponent-only scale formats such as E8M0 (``signed=False``).
- ``FixedFormat(wl, fl, ...)``: integers k times 2^-fl.
- ``BlockFormat(elem, block_size, axis, ...)``: runs of elements sharing one scale (MX, NVFP4,
  block floating point).

Every format is a frozen dataclass: hashable, comparable with ``==``, ``f.replace(...)`` gives a
modified copy, and ``qt.format(str(f)) == f``. Construction refuses formats that make no sense or
that the float32 carrier used by the kernels cannot hold exactly, with a message that says why.
"""
from __future__ import annotations

import dataclasses
import difflib
import math
import re
import types
from dataclasses import dataclass
from typing import Optional, Union

from .torch_function import TorchFunctionTarget

__all__ = [
    "ROUNDING_MODES", "SPECIALS", "SCALE_RULES", "Format", "FormatError", "FloatFormat",
    "FixedFormat", "BlockFormat", "format", "PRESETS", "ALIASES", "is_stochastic",
    "stochastic_bits", "p3109",
]

# (besides these, "stochasticN" for N = 1..31: stochastic rounding with N random bits, as
# hardware does it: NVIDIA's cvt.rs takes 8; "stochastic" uses 32)
ROUNDING_MODES = ("nearest", "nearest_away", "toward_zero", "stochastic")
_DETERMINISTIC = frozenset({"nearest", "nearest_away", "toward_zero"})
# p3109_extended / p3109_finite: IEEE P3109's domains (no -0: NaN takes its code, or the top code
# of an unsigned format; extended: the top code is +Inf, and its negative -Inf)
SPECIALS = ("ieee", "fn", "none", "p3109_extended", "p3109_finite")
_P3109_SPECIALS = ("p3109_extended", "p3109_finite")
# floor/even: OCP's and torchao's power-of-two scales from amax's exponent; ceil (= torchao's
# RCEIL, also spelled "rceil"): the smallest scale with amax / X <= max_elem; amax: scale =
# Q_scale(amax / max_elem); 4over6: NVFP4 blocks whose max maps to 4 or to 6 (Transformer Engine)
SCALE_RULES = ("floor", "ceil", "amax", "even", "4over6")
_SCALE_RULE_ALIASES = {"rceil": "ceil"}

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


class Format(TorchFunctionTarget):
    """Common behaviour of all formats (``model.to(fmt)``, ``t.to(fmt)``: qtensor.formats.torch_function).

    The format protocol: the questions code outside this module asks of a format, answered by
    each family (the defaults below are a scalar format's), so that callers need not switch on
    the format's class and a new family answers them in its own class
    (docs/architecture.md, "The format protocol")."""

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

    def replace(self, **changes) -> "Format":
        """A copy with some fields changed, validated like a new format."""
        return dataclasses.replace(self, **changes)

    def __str__(self) -> str:
        return _to_string(self)


@dataclass(frozen=True, repr=False)
class FloatFormat(Format):
    """A float with ``exp`` exponent bits and ``man`` mantissa bits (the implicit bit not counted).

    specials: ``"ieee"`` (top exponent code is Inf/NaN), ``"fn"`` (only the all-ones code is NaN,
    as OCP E4M3), ``"none"`` (every code is a number; requires ``saturate=True``).
    ``"p3109_extended"`` / ``"p3109_finite"`` (IEEE P3109's domains: no negative zero, its
    code is the NaN (an unsigned format's NaN is its top code); extended: the top code is +Inf
    and its negative -Inf (unsigned: the code below the NaN), finite: no Inf).
    saturate: overflow gives +-max (True) or +-Inf/NaN (False). Defaults to True for "none".
    toward_zero rounding gives +-max for every finite input (IEEE 754 roundTowardZero).
    signed=False: no sign bit. With subnormals=False it describes exponent-only scale formats
    such as E8M0: no zero, exponent code 0 is 2^-bias, the all-ones code is NaN; zero, negative
    and NaN inputs give NaN. With subnormals=True (UE5M3, P3109's unsigned formats) code 0 is
    zero as in a signed format; negative inputs give NaN (the format has no negative values),
    -0.0 gives +0.0. :func:`p3109` builds P3109's formats (``binary8p3se``).
    """

    exp: int
    man: int
    bias: Optional[int] = None
    subnormals: bool = True
    specials: str = "ieee"
    saturate: Optional[bool] = None
    rounding: str = "nearest"
    signed: bool = True

    def __post_init__(self):
        _check_int("exp", self.exp)
        _check_int("man", self.man)
        _check_bool("subnormals", self.subnormals)
        _check_bool("signed", self.signed)
        if self.saturate is not None:  # None: the default for the specials
            _check_bool("saturate", self.saturate)
        if self.exp < 1:
            raise FormatError(f"exp must be >= 1, got exp={_int_str(self.exp)}")
        if self.exp > _F32_EXP:  # before 2 ** (exp - 1) below, which is huge for an absurd exp
            raise FormatError(
                f"exp={_int_str(self.exp)} does not fit the float32 carrier (at most "
                f"{_F32_EXP} exponent bits: more give more binades than float32's 2^-149..2^127)")
        if self.man < 0:
            raise FormatError(f"man must be >= 0, got man={_int_str(self.man)}")
        if self.man > _F32_MAN:
            raise FormatError(
                f"man={_int_str(self.man)} does not fit the float32 carrier (at most {_F32_MAN} "
                "mantissa bits)")
        if self.bias is None:
            object.__setattr__(self, "bias", 2 ** (self.exp - 1) - 1)
        _check_int("bias", self.bias)
        if self.specials not in SPECIALS:
            raise FormatError(
                f"unknown specials {self.specials!r}; expected one of {', '.join(SPECIALS)}")
        if self.saturate is None:
            object.__setattr__(self, "saturate", self.specials == "none")
        if self.specials == "none" and not self.saturate:
            raise FormatError(
                f"e{self.exp}m{self.man} with specials='none' has neither Inf nor NaN, so overflow "
                "cannot be represented: it requires saturate=True")
        _check_rounding(self.rounding)
        if not self.signed and (
                (not self.subnormals and (self.man != 0 or self.specials != "fn"))
                or self.specials not in ("fn",) + _P3109_SPECIALS):
            raise FormatError(
                "signed=False describes exponent-only scale formats without zero (as E8M0: "
                "man=0, subnormals=False, specials='fn') or unsigned formats with zero (as "
                "UE5M3: subnormals=True, specials 'fn', 'p3109_extended' or 'p3109_finite': a "
                f"NaN for negative inputs), got e{self.exp}m{self.man} with subnormals="
                f"{self.subnormals}, specials={self.specials!r}")
        if self.bits < 2 and self.specials in _P3109_SPECIALS:
            raise FormatError(f"a P3109 format has at least 2 bits, got {self.bits}")
        if self.emax < self.emin:
            raise FormatError(
                f"e{self.exp}m{self.man} with bias={_int_str(self.bias)} has no normal numbers")
        if self.emax > _F32_EMAX:
            raise FormatError(
                f"e{self.exp}m{self.man} with bias={_int_str(self.bias)} has "
                f"emax={_int_str(self.emax)}: its largest values do not fit the float32 carrier "
                f"(emax <= {_F32_EMAX})")
        if self.min_quantum_exp < _F32_MIN_QUANTUM_EXP:
            raise FormatError(
                f"e{self.exp}m{self.man} with bias={_int_str(self.bias)} has values down to "
                f"2^{_int_str(self.min_quantum_exp)}, below float32's smallest subnormal 2^-149")

    @property
    def emin(self) -> int:
        """Exponent of the smallest normal number."""
        return -self.bias if not self.has_zero else 1 - self.bias

    @property
    def has_zero(self) -> bool:
        """False for the exponent-only formats without zero (E8M0: signed=False, no subnormals)."""
        return self.signed or self.subnormals

    @property
    def no_negative_zero(self) -> bool:
        """Whether -0.0 is no value of the format (P3109's domains, unsigned formats): a result
        that rounds to zero is +0.0."""
        return not self.signed or self.specials in _P3109_SPECIALS

    def _max_code(self) -> int:
        """The code (exponent and mantissa fields) of the largest finite value: the top code less
        the codes of the top that are Inf or NaN."""
        specials = {"ieee": 2 ** self.man, "fn": 1, "none": 0,
                    "p3109_extended": 1 if self.signed else 2,
                    "p3109_finite": 0 if self.signed else 1}[self.specials]
        return 2 ** (self.exp + self.man) - 1 - specials

    @property
    def emax(self) -> int:
        """Exponent of the largest finite number."""
        return (self._max_code() >> self.man) - self.bias

    @property
    def max(self) -> float:
        """The largest finite value."""
        frac = self._max_code() & (2 ** self.man - 1)
        return (1.0 + frac * 2.0 ** -self.man) * 2.0 ** self.emax

    @property
    def min_normal(self) -> float:
        return 2.0 ** self.emin

    @property
    def min_subnormal(self) -> float:
        """The smallest positive value (the smallest normal when there are no subnormals)."""
        return 2.0 ** self.min_quantum_exp if self.subnormals else self.min_normal

    @property
    def min_quantum_exp(self) -> int:
        """Exponent of the finest spacing between neighbouring values."""
        return self.emin - self.man

    @property
    def eps(self) -> float:
        """Distance from 1 to the next larger value (the relative spacing)."""
        return 2.0 ** -self.man

    @property
    def bits(self) -> int:
        return int(self.signed) + self.exp + self.man

    @property
    def has_inf(self) -> bool:
        return self.specials in ("ieee", "p3109_extended")

    @property
    def has_nan(self) -> bool:
        return self.specials != "none"

    @property
    def significant_bits(self) -> int:
        """Significant bits of its values, the implicit bit counted."""
        return self.man + 1

    @property
    def lowest(self) -> float:
        """The most negative value (unsigned: the smallest one, 0 or 2^emin)."""
        if self.signed:
            return -self.max
        return 0.0 if self.has_zero else self.min_normal

    @property
    def max_magnitude(self) -> float:
        return self.max

    @property
    def scale_only(self) -> bool:
        return not self.signed

    @property
    def has_fp32_range(self) -> bool:
        return self.exp >= _F32_EXP

    @property
    def is_fp32(self) -> bool:
        return self.exp == _F32_EXP and self.man == _F32_MAN

    def unsigned_range(self) -> Optional[str]:
        if self.signed:
            return None
        if self.has_zero:  # (UE5M3)
            return f"[0, {self.max:g}] (no sign: negatives give NaN)"
        return f"[2^{self.emin}, 2^{self.emax}] (no sign and no zero: 0 and negatives give NaN)"

    def __repr__(self) -> str:
        return f"FloatFormat({_to_string(self)})"


class Fp32ScaleGrid(FloatFormat):
    """The grid of a BlockFormat's FP32 scales under the amax rule (``amax_scale_format``): the
    float32 numbers of ``man + 1`` significant bits from 2^emin up to float32's top binade, and
    below 2^emin multiples of 2^(emin - man) (its subnormals). A float-like format with float32's
    emax = 127 whatever its bias (so not a FloatFormat one could name: only the kernels and the
    reference round to it)."""

    def __post_init__(self):  # (the bias sets emin; the carrier checks do not apply)
        pass

    @property
    def emax(self) -> int:
        return _F32_EMAX

    def __repr__(self) -> str:
        return f"Fp32ScaleGrid(man={self.man}, emin={self.emin})"

    __str__ = __repr__


@dataclass(frozen=True, repr=False)
class FixedFormat(Format):
    """Fixed point: values k * 2^-fl with k a ``wl``-bit integer.

    ``wl`` is the word length (all bits, the sign included) and ``fl`` the fractional length, as
    QPyTorch's ``FixedPoint(wl, fl)``; not the Qm.n notation (m integer + n fractional bits).
    fl may be negative (a spacing above 1) or exceed wl (every value below 2^(wl-fl-1)).
    signed: k in [-2^(wl-1), 2^(wl-1)-1] (``symmetric`` drops the most negative), else [0, 2^wl-1].
    Out of range: clamp when ``saturate``, two's-complement wrap otherwise. NaN stays NaN, +-Inf
    clamps. No negative zero: a value that rounds to zero is +0.0.

    String form: ``fixedWL.FL`` (``fixed8.4``) when fl <= wl; ``fixed(wl=8, fl=9)`` otherwise, so
    that a shorthand like ``fixed8.9`` (most likely meant as Q8.9) is refused, not misread.
    """

    wl: int
    fl: int
    signed: bool = True
    symmetric: bool = False
    saturate: bool = True
    rounding: str = "nearest"

    def __post_init__(self):
        _check_int("wl", self.wl)
        _check_int("fl", self.fl)
        for name in ("signed", "symmetric", "saturate"):
            _check_bool(name, getattr(self, name))
        if not 1 <= self.wl <= 24:
            raise FormatError(
                f"wl={_int_str(self.wl)}: fixed-point word length must be 1..24 (the float32 "
                "carrier holds integers of at most 24 bits exactly)")
        if self.signed and self.symmetric and self.wl < 2:
            raise FormatError("a symmetric signed fixed-point format needs wl >= 2")
        if self.symmetric and not self.signed:
            raise FormatError("symmetric=True only applies to signed fixed-point formats")
        if -self.fl < _F32_MIN_QUANTUM_EXP or self.wl - self.fl > _F32_EMAX:
            raise FormatError(
                f"fixed point wl={self.wl}, fl={_int_str(self.fl)}: values "
                f"k*2^{_int_str(-self.fl)} do not fit the float32 carrier")
        _check_rounding(self.rounding)

    @property
    def kmax(self) -> int:
        return 2 ** (self.wl - 1) - 1 if self.signed else 2 ** self.wl - 1

    @property
    def kmin(self) -> int:
        if not self.signed:
            return 0
        return -(2 ** (self.wl - 1)) + (1 if self.symmetric else 0)

    @property
    def max(self) -> float:
        return self.kmax * 2.0 ** -self.fl

    @property
    def min(self) -> float:
        """The most negative value (0 for unsigned formats)."""
        return self.kmin * 2.0 ** -self.fl

    @property
    def eps(self) -> float:
        """The spacing 2^-fl."""
        return 2.0 ** -self.fl

    min_normal = eps
    min_subnormal = eps

    @property
    def emin(self) -> int:
        return -self.fl

    @property
    def emax(self) -> int:
        """Exponent of the largest value: floor(log2(max))."""
        return math.frexp(self.max)[1] - 1 if self.kmax > 0 else -self.fl

    @property
    def bits(self) -> int:
        return self.wl

    @property
    def significant_bits(self) -> int:
        """Significant bits of its values: the integer's bits less the sign."""
        return self.wl - 1 if self.signed else self.wl

    @property
    def min_quantum_exp(self) -> int:
        return -self.fl

    lowest = min

    @property
    def max_magnitude(self) -> float:
        return max(self.max, -self.min)

    def unsigned_range(self) -> Optional[str]:
        if self.signed:
            return None
        return (f"[0, {self.max:g}] (unsigned: negatives "
                f"{'clamp to 0' if self.saturate else 'wrap around'})")

    def __repr__(self) -> str:
        return f"FixedFormat({_to_string(self)})"


@dataclass(frozen=True, repr=False)
class BlockFormat(Format):
    """Blocks of ``block_size`` consecutive elements along ``axis`` share one scale.

    ``block_size=None``: the whole axis is one block; ``axis=None``: the whole tensor is one block.
    scale: the scale's format (``e8m0`` for MX, ``fp8_e4m3`` for NVFP4).
    scale_rule (torchao's ScaleCalculationMode names; docs/formats.md, "Scale rules"):
      ``floor`` (OCP MX, torchao FLOOR: 2^(floor(log2 amax) - emax_elem));
      ``even`` (torchao EVEN: as floor, of amax rounded half away from zero to the element's
      significant bits, so that a block max which would round up to the next binade gets the
      next scale);
      ``ceil``, also spelled ``rceil`` (torchao RCEIL, cuBLAS's and the MXFP8 recipe's
      "round the scale up": the smallest scale X with amax/X <= max_elem; for a power-of-two
      scale 2^ceil(log2(amax / max_elem)), for a scale with mantissa bits such as fp8_e4m3 the
      scale format's rounding of amax / max_elem upward). torchao's CEIL,
      2^(ceil(log2 amax) - emax_elem), is none of these: it equals ceil where max_elem is a power
      of two and is one binade larger for amax/2^k in (2^emax_elem, max_elem];
      ``amax`` (NVFP4: X = the scale format's nearest value to amax / max_elem);
      ``4over6`` (Transformer Engine's NVFP4 4over6: e2m1 elements, a scale with mantissa bits;
      each block takes the amax-rule scale that maps its max to 6 or the one that maps it to 4,
      whichever gives the lower sum of |x - q| over the block, 6 on a tie; with a tensor scale,
      the tensor scale's bound is 256 instead of 448, as TE's default).
      floor and even need an exponent-only scale (as e8m0).
    tensor_scale: two-level scaling as NVFP4 (rules amax, 4over6 and ceil with a scale of
    mantissa bits): Transformer Engine's rule, an FP32 per-tensor scale from the tensor's amax
    and each block's scale under it, in TE's float32 steps; a QTensor of such a format carries
    its tensor scale (docs/formats.md, "NVFP4: the tensor scale").
    settle (tensor_scale only): re-round each block with the scale of its rounded max until
    that scale repeats (4over6: each candidate, then the pick), so that rounding values of the
    format again under the same tensor scale gives them back (False, the default: TE's single
    pass).
    The element format always saturates; its rounding is the block's rounding.

    block_shape=(r, c): 2D blocks (tiles) of r x c elements over the *last two dims* of a
    tensor (which needs at least 2 dims): c consecutive elements along ``axis`` (which must be
    one of those two dims, -1 or -2, when the format is applied) and r along the other one. So
    ``block_shape=(16, 16)`` rounds a weight W and W.T alike: W.T's format is the same one with
    axis moved to the other dim (what ``.t()`` of a QTensor does). ``block_size`` is then the
    elements per block, r * c (leave it unset or give r * c); ``axis=None`` is refused. Partial
    tiles at the ends of either dim are smaller blocks, as a 1D partial block.
    scale='fp32' (with scale_rule='amax', DeepSeek-V3's per-block FP32 scales): the scale is
    amax / max_elem rounded to nearest to float32 numbers of 24 - (element bits) significant
    bits, so that element times scale is a float32 exactly (``amax_scale_format``).
    """

    elem: Union[FloatFormat, FixedFormat]
    block_size: Optional[int] = 32
    axis: Optional[int] = -1
    scale: Union[FloatFormat, str] = "e8m0"
    scale_rule: str = "floor"
    rounding: Optional[str] = None
    tensor_scale: bool = False
    block_shape: Optional[tuple] = None
    settle: bool = False

    def __post_init__(self):
        elem = self.elem
        if isinstance(elem, str):
            elem = format(elem)
        if isinstance(elem, BlockFormat):
            raise FormatError("a block format's element format cannot itself be a block format")
        if not isinstance(elem, (FloatFormat, FixedFormat)):
            raise FormatError(f"elem must be a FloatFormat or FixedFormat, got {elem!r}")
        if isinstance(elem, FloatFormat) and not elem.signed:
            raise FormatError("a block's element format must be signed")
        if isinstance(elem, FloatFormat) and elem.specials in _P3109_SPECIALS:
            raise FormatError(
                f"{elem} as a block's element format is not supported: the block kernels keep "
                "-0.0, which P3109 formats do not have; use a format with specials 'fn' or "
                "'none' (as fp4_e2m1)")
        rounding = elem.rounding if self.rounding is None else self.rounding
        _check_rounding(rounding)
        # normalise the element: saturating, rounding carried by the block
        elem = elem.replace(saturate=True, rounding=rounding)
        object.__setattr__(self, "elem", elem)
        object.__setattr__(self, "rounding", rounding)
        scale = format(self.scale) if isinstance(self.scale, str) else self.scale
        if not isinstance(scale, FloatFormat):
            raise FormatError(f"scale must be a FloatFormat (e.g. e8m0 or fp8_e4m3), got {scale!r}")
        if scale.specials in _P3109_SPECIALS:
            raise FormatError(
                f"{scale} as a block's scale format is not supported (P3109 scales); use an "
                "'fn' scale such as e8m0, fp8_e4m3 or ue5m3")
        object.__setattr__(self, "scale", scale)
        if self.block_shape is not None:
            self._check_block_shape()
        if self.block_size is not None:
            _check_int("block_size", self.block_size)
            if self.block_size < 1:
                raise FormatError(
                    f"block_size must be >= 1 (or None), got {_int_str(self.block_size)}")
            if self.block_size > _MAX_INDEX:
                raise FormatError(
                    f"block_size={_int_str(self.block_size)} is longer than any tensor axis can "
                    "be (at most 2**62); for one block per axis use block_size=None")
        if self.axis is not None:
            _check_int("axis", self.axis)
            if not -_MAX_INDEX <= self.axis < _MAX_INDEX:
                raise FormatError(
                    f"axis={_int_str(self.axis)} is no tensor's dim (a dim index, negative from "
                    "the end, or None for the whole tensor)")
        _check_bool("tensor_scale", self.tensor_scale)
        rule = _SCALE_RULE_ALIASES.get(self.scale_rule, self.scale_rule)
        if rule not in SCALE_RULES:
            raise FormatError(
                f"unknown scale_rule {self.scale_rule!r}; expected one of "
                f"{', '.join(SCALE_RULES + tuple(_SCALE_RULE_ALIASES))}")
        object.__setattr__(self, "scale_rule", rule)
        if rule in ("floor", "even") and scale.man != 0:
            raise FormatError(
                f"scale_rule={rule!r} derives a power-of-two scale from the exponent of the "
                f"block's amax: it needs an exponent-only scale format such as e8m0, got {scale} "
                "(whose mantissa bits it would never use); for such a scale use scale_rule="
                "'amax' (nearest, NVFP4), 'ceil' (rounded up: the block max never saturates) or "
                "'4over6'")
        if rule == "4over6":
            if not (isinstance(elem, FloatFormat) and (elem.exp, elem.man, elem.bias,
                                                         elem.subnormals) == (2, 1, 1, True)):
                raise FormatError(
                    f"scale_rule='4over6' maps a block's max to 4 or to 6 of the fp4_e2m1 grid "
                    f"(NVFP4): it needs fp4_e2m1 elements, got {elem}")
            if scale.man == 0:
                raise FormatError(
                    f"scale_rule='4over6' chooses between the scales amax/6 and amax/4, which a "
                    f"power-of-two scale ({scale}) cannot tell apart; use a scale with mantissa "
                    "bits such as fp8_e4m3")
        _check_bool("settle", self.settle)
        if self.settle and not self.tensor_scale:
            raise FormatError(
                "settle=True re-rounds each block of a tensor-scaled format (tensor_scale=True) "
                "until its scale repeats; other block formats always settle: got "
                f"tensor_scale={self.tensor_scale}")
        if self.tensor_scale and self.power_of_two_scales:
            raise FormatError(
                f"tensor_scale=True needs scales with significant bits (scale_rule 'amax', "
                f"'4over6', or 'ceil' with a scale such as fp8_e4m3; NVFP4-style), got "
                f"scale_rule={rule!r} with {scale} scales")
        if not self.power_of_two_scales:
            self._check_amax_rule(elem, scale)
        if self.min_quantum_exp < _F32_MIN_QUANTUM_EXP:
            raise FormatError(
                f"{self}: the smallest element times the smallest scale is below float32's "
                "smallest subnormal 2^-149")

    def replace(self, **changes) -> "BlockFormat":
        """A copy with some fields changed; a new ``block_shape`` brings its own block_size
        (r * c) unless block_size is given too."""
        if changes.get("block_shape") is not None and "block_size" not in changes:
            changes["block_size"] = None
        return dataclasses.replace(self, **changes)

    def _check_block_shape(self) -> None:
        shape = self.block_shape
        if isinstance(shape, str):  # the string form "16x16"
            m = re.fullmatch(r"\s*(\d+)\s*[xX]\s*(\d+)\s*", shape)
            if not m:
                raise FormatError(
                    f"block_shape must be two ints (rows, cols) or 'RxC' such as '16x16', got "
                    f"{shape!r}")
            shape = (int(m.group(1)), int(m.group(2)))
        if not isinstance(shape, (tuple, list)) or len(shape) != 2:
            raise FormatError(
                f"block_shape must be two ints (rows, cols), e.g. (16, 16), got {shape!r} (a 1D "
                "block is block_size=...)")
        for name, v in zip(("rows", "cols"), shape):
            _check_int(f"block_shape {name}", v)
            if not 1 <= v <= _MAX_INDEX:
                raise FormatError(f"block_shape {name} must be 1..2**62, got {_int_str(v)}")
        shape = tuple(shape)
        object.__setattr__(self, "block_shape", shape)
        if self.axis is None:
            raise FormatError(
                f"block_shape={shape[0]}x{shape[1]} tiles the last two dims, with cols along "
                "axis: it needs axis=-1 or -2, not axis=None")
        n = shape[0] * shape[1]
        # 32 is block_size's default (not given); anything else must say the same as the shape
        if self.block_size not in (None, 32, n):
            raise FormatError(
                f"block_shape={shape[0]}x{shape[1]} has {n} elements per block, but "
                f"block_size={_int_str(self.block_size)}; leave block_size unset")
        object.__setattr__(self, "block_size", n)

    @property
    def amax_scale_format(self) -> FloatFormat:
        """The format the amax, ceil and 4over6 rules round a block's scale to: the scale
        format, except a float32 scale ('fp32', DeepSeek-V3's FP32 block scales), which rounds to the float32
        numbers of 24 - (element bits) significant bits that are multiples of 2^(-149 - the
        element's lowest bit exponent), so that element times scale is a float32 exactly: 20
        bits and multiples of 2^-140 for E4M3 elements (:class:`Fp32ScaleGrid`)."""
        s = self.scale
        if (s.exp, s.man, s.bias, s.specials) == (8, _F32_MAN, 127, "ieee") and s.signed:
            man = _F32_MAN - _significant_bits(self.elem)
            elem_q = self.elem.min_quantum_exp
            emin = max(1 - 127, _F32_MIN_QUANTUM_EXP - elem_q + man)
            return Fp32ScaleGrid(8, man, bias=1 - emin, saturate=True)
        return s

    def _check_amax_rule(self, elem, scale) -> None:
        # A value of the format, element times scale (times the tensor scale), must be a float32
        # exactly, or re-rounding it would not give it back (docs/formats.md, idempotence).
        scale = self.amax_scale_format
        p_elem, p_scale = _significant_bits(elem), scale.man + 1
        if p_elem + p_scale > _F32_MAN + 1:
            raise FormatError(
                f"scale_rule={self.scale_rule!r} with {elem} elements ({p_elem} significant "
                f"bits) and {scale} scales ({p_scale}): their products need {p_elem + p_scale} bits, more than the "
                f"float32 carrier's 24; use a scale of at most {_F32_MAN + 1 - p_elem} significant "
                f"bits (e.g. e8m{_F32_MAN - p_elem})")
        if self.tensor_scale and self.tensor_scale_bits < 1:
            raise FormatError(
                f"tensor_scale=True with {elem} elements and {scale} scales: element, scale, "
                f"rounding boundary and a tensor scale of at least 1 bit need "
                f"{p_elem + p_scale + 2} significant bits, more than the float32 carrier's 24")
        if isinstance(elem, FixedFormat) and elem.signed and not elem.symmetric:
            raise FormatError(
                f"scale_rule={self.scale_rule!r} maps a block's amax to the element's max "
                f"{elem.max}, so an element range with one more negative code ({elem}) would let a block round to a "
                "value whose own scale is larger; use symmetric=True")

    @property
    def power_of_two_scales(self) -> bool:
        """Whether the scales come from amax's exponent alone (rules floor, even, and ceil with
        an exponent-only scale format): the element grid shifted by a power of two. Otherwise
        (amax, 4over6, ceil with mantissa bits) the scale is a rounding of amax / max_elem."""
        return self.scale_rule in ("floor", "even") or (self.scale_rule == "ceil"
                                                          and self.scale.man == 0)

    @property
    def tensor_scale_bound(self) -> float:
        """The scale value a tensor scale maps the tensor's amax to: max_scale, or for 4over6
        the largest power of two at most max_scale * 4/6 (256 for fp8_e4m3, TE's 4over6 bound:
        the map-to-4 scale of the tensor's largest block, 1.5 times the map-to-6 one, still
        fits)."""
        if self.scale_rule == "4over6":
            return 2.0 ** math.floor(math.log2(self.scale.max * 4 / 6))
        return self.scale.max

    @property
    def tensor_scale_bits(self) -> int:
        """Significant bits of the per-tensor scale (tensor_scale=True): 23 minus the element's
        and the scale's, so that element values and rounding boundaries times both scales are
        float32s exactly (17 for NVFP4)."""
        return _F32_MAN - _significant_bits(self.elem) - (self.amax_scale_format.man + 1)

    @property
    def tensor_scale_min_exp(self) -> int:
        """The tensor scale is a multiple of 2^this: with the lowest bits of the element
        (emin - man, or -fl) and of the scale (emin - man), and one more for a rounding
        boundary, the products stay at or above float32's 2^-149."""
        elem_q = self.elem.min_quantum_exp
        return -149 - (elem_q + self.amax_scale_format.min_quantum_exp) + 1

    @property
    def scale_emin(self) -> int:
        s = self.scale if self.power_of_two_scales else self.amax_scale_format
        return s.emin if not s.subnormals else s.min_quantum_exp

    @property
    def min_quantum_exp(self) -> int:
        elem_q = self.elem.min_quantum_exp
        return elem_q + self.scale_emin

    @property
    def bits(self) -> float:
        """Bits per value, the shared scale included (e.g. 8.25 for MXFP8)."""
        if self.block_size is None:
            return float(self.elem.bits)
        return self.elem.bits + self.scale.bits / self.block_size

    @property
    def max(self) -> float:
        return self.elem.max * self.scale.max

    @property
    def min_subnormal(self) -> float:
        return 2.0 ** self.min_quantum_exp

    @property
    def min_normal(self) -> float:
        return self.elem.min_normal * self.scale.min_subnormal

    @property
    def emax(self) -> int:
        return self.elem.emax + self.scale.emax

    @property
    def emin(self) -> int:
        return self.elem.emin + self.scale_emin

    @property
    def eps(self) -> float:
        return self.elem.eps

    is_block = True

    @property
    def max_magnitude(self) -> Optional[float]:
        # a per-tensor scale from the tensor's amax: no magnitude is out of reach
        return None if self.tensor_scale else self.max

    @property
    def clips_in_blocks(self) -> bool:
        # False where no finite float32 can lie beyond its block's largest value: the ceil rule
        # with power-of-two scales has amax / X <= max_elem unless X is the scale's max, and
        # with e8m0's 2^127 that is past float32.
        if self.scale_rule == "ceil" and self.power_of_two_scales:
            return min(self.elem.max, -self.elem.lowest) * self.scale.max < _F32_MAX
        return True

    def unsigned_range(self) -> Optional[str]:
        inner = self.elem.unsigned_range()
        return None if inner is None else f"elements in {inner} times the block scale"

    def block_extent(self, ndim: int, dim: int, size: int) -> int:
        if self.tensor_scale or self.axis is None:  # a scale over the whole tensor
            return size
        if not -ndim <= self.axis < ndim:
            return 1  # (such a rounding fails anyway, with its own error)
        axis = self.axis % ndim
        if self.block_shape is not None:
            rows, cols = self.block_shape
            return cols if dim == axis else rows if dim >= ndim - 2 else 1
        return (self.block_size or size) if dim == axis else 1

    def storage_bits(self, shape) -> float:
        # a short last block still has a whole scale
        shape = tuple(shape)
        n = math.prod(shape)
        if n == 0:
            return 0.0
        ndim = len(shape)
        if self.axis is None or ndim == 0:
            blocks = 1
        elif self.block_shape is not None and ndim >= 2:  # tiles of the last two dims
            r, c = self.block_shape
            if self.axis % ndim == ndim - 2:
                r, c = c, r
            rows, cols = shape[-2], shape[-1]
            blocks = (n // (rows * cols)) * -(-rows // r) * -(-cols // c)
        else:
            length = shape[self.axis]
            per_row = 1 if self.block_size is None else -(-length // self.block_size)
            blocks = (n // length) * per_row
        return float(n * self.elem.bits + blocks * self.scale.bits + (32 if self.tensor_scale else 0))

    def __repr__(self) -> str:
        return f"BlockFormat({_to_string(self)})"


# The format families (a new family adds its class here: torch.load and dynamo take these as values)
FORMAT_CLASSES = (FloatFormat, FixedFormat, BlockFormat)


# ---------------------------------------------------------------------------------------------
# IEEE P3109

_P3109_DOMAINS = {"extended": "p3109_extended", "finite": "p3109_finite"}


def p3109(k: int, p: int, signed: bool = True, domain: str = "extended", *,
          saturate: bool = False, rounding: str = "nearest") -> FloatFormat:
    """IEEE P3109's binary{k}p{p}{s|u}{e|f} format: k bits, precision p (the implicit bit
    counted), signed or not, the extended (with Inf) or finite domain; subnormals, no negative
    zero, NaN at the code of -0 (unsigned: the top code), bias 2^(k-p-1) (unsigned: 2^(k-p)).
    saturate=False (overflow gives Inf, or NaN in the finite domain) or True (max, as P3109's
    SatFinite). String form ``binary8p3se`` (P3109's name; gfloat's ``p3109_k8p3se`` parses too).
    Formats whose values the float32 carrier holds: k = 8 for every p, wider k where the
    exponent has at most 8 bits."""
    for name, v in (("k", k), ("p", p)):
        _check_int(name, v)
    _check_bool("signed", signed)
    if domain not in _P3109_DOMAINS:
        raise FormatError(f"P3109 domain must be 'extended' or 'finite', got {domain!r}")
    name = f"binary{k}p{p}{'s' if signed else 'u'}{domain[0]}"
    if k < 2:
        raise FormatError(f"P3109 {name}: a P3109 format has k >= 2 bits, got k={_int_str(k)}")
    top = k - 1 if signed else k
    if not 1 <= p <= top:
        raise FormatError(
            f"P3109 {name}: precision p must be 1..{top} for a {k}-bit {'signed' if signed else 'unsigned'} "
            f"format (the sign{'' if signed else ' (none)'} and p - 1 mantissa bits leave at least "
            f"one exponent bit), got p={_int_str(p)}")
    exp = k - p + (0 if signed else 1)
    bias = 2 ** (k - p - 1) if signed else 2 ** (k - p)
    try:
        return FloatFormat(exp, p - 1, bias=bias, subnormals=True, specials=_P3109_DOMAINS[domain],
                           saturate=saturate, rounding=rounding, signed=signed)
    except FormatError as e:
        raise FormatError(f"P3109 {name} is not a format qtensor can hold: {e}") from None


def _p3109_name(f: FloatFormat) -> Optional[str]:
    """P3109's name of a FloatFormat of one of its shapes (any saturate and rounding), or None."""
    if f.specials not in _P3109_SPECIALS or not f.subnormals:
        return None
    k, p = f.bits, f.man + 1
    if f.bias != (2 ** (k - p - 1) if f.signed else 2 ** (k - p)):
        return None
    return f"binary{k}p{p}{'s' if f.signed else 'u'}{f.specials[6]}"


# ---------------------------------------------------------------------------------------------
# Presets

def _presets() -> dict:
    fp8_e4m3 = FloatFormat(4, 3, specials="fn", saturate=True)
    fp6_e3m2 = FloatFormat(3, 2, specials="none")
    fp6_e2m3 = FloatFormat(2, 3, specials="none")
    fp4_e2m1 = FloatFormat(2, 1, specials="none")
    e8m0 = FloatFormat(8, 0, bias=127, subnormals=False, specials="fn", saturate=False,
                       signed=False)
    fp8_e5m2 = FloatFormat(5, 2)
    int8_mx = FixedFormat(8, 6, symmetric=True)  # MXINT8 elements: k/64, |k| <= 127
    # NVIDIA's UE5M3 scale (PTX ISA and CUDA 13.4 cuda_fp8.h __nv_fp8_ue5m3): 8 bits, no sign,
    # 5 exponent bits (bias 15, subnormals), 3 mantissa bits, no Inf, NaN only 0xFF, max
    # 114688; conversions saturate (__NV_SATFINITE)
    ue5m3 = FloatFormat(5, 3, bias=15, subnormals=True, specials="fn", saturate=True,
                        signed=False)
    p3109_8 = {}
    for signed in (True, False):
        for p in range(1, 8 if signed else 9):
            for domain in _P3109_DOMAINS:
                f = p3109(8, p, signed, domain)
                p3109_8[_p3109_name(f)] = f
    return {
        "fp32": FloatFormat(8, 23),
        "tf32": FloatFormat(8, 10),
        "bf16": FloatFormat(8, 7),
        "fp16": FloatFormat(5, 10),
        "fp8_e4m3": fp8_e4m3,
        "fp8_e5m2": fp8_e5m2,
        "fp6_e3m2": fp6_e3m2,
        "fp6_e2m3": fp6_e2m3,
        "fp4_e2m1": fp4_e2m1,
        "e8m0": e8m0,
        "mxfp8_e4m3": BlockFormat(fp8_e4m3, 32, scale=e8m0),
        "mxfp8_e5m2": BlockFormat(fp8_e5m2, 32, scale=e8m0),
        "mxfp6_e3m2": BlockFormat(fp6_e3m2, 32, scale=e8m0),
        "mxfp6_e2m3": BlockFormat(fp6_e2m3, 32, scale=e8m0),
        "mxfp4_e2m1": BlockFormat(fp4_e2m1, 32, scale=e8m0),
        "mxint8": BlockFormat(int8_mx, 32, scale=e8m0),
        # NVIDIA's NVFP4 (Transformer Engine, arXiv 2509.25149): E4M3 scales of 16 elements
        # under a per-tensor FP32 scale from the tensor's amax; nvfp4_single without the latter
        "nvfp4": BlockFormat(fp4_e2m1, 16, scale=fp8_e4m3, scale_rule="amax", tensor_scale=True),
        "nvfp4_single": BlockFormat(fp4_e2m1, 16, scale=fp8_e4m3, scale_rule="amax"),
        "ue5m3": ue5m3,
        # NVFP4 with UE5M3 block scales (Transformer Engine's prototype; the scale's range,
        # 2^-17..114688, needs no per-tensor scale)
        "nvfp4_ue5m3": BlockFormat(fp4_e2m1, 16, scale=ue5m3, scale_rule="amax"),
        # MXFP4 (E8M0 scales, floor rule) with blocks of 16
        "mxfp4_e2m1_b16": BlockFormat(fp4_e2m1, 16, scale=e8m0),
        # IEEE P3109 binary8 (signed p = 1..7, unsigned p = 1..8; extended and finite domains)
        **p3109_8,
    }


PRESETS = _presets()
_PRESET_NAMES = {f: name for name, f in PRESETS.items()}
ALIASES = {
    "float32": "fp32", "float": "fp32", "bfloat16": "bf16", "float16": "fp16", "half": "fp16",
    "float8_e4m3fn": "fp8_e4m3", "float8_e5m2": "fp8_e5m2",
    "mxfp8": "mxfp8_e4m3", "mxfp6": "mxfp6_e3m2", "mxfp4": "mxfp4_e2m1",
    # the OCP names as everyone writes them (an IEEE-style e4m3 would be max 240, e2m1 max 3)
    "e4m3": "fp8_e4m3", "e5m2": "fp8_e5m2", "e3m2": "fp6_e3m2", "e2m3": "fp6_e2m3",
    "e2m1": "fp4_e2m1", "mxfp4_b16": "mxfp4_e2m1_b16",
}
# Names refused with a reason: they would look like a format but round differently.
_REFUSED = {
    "float8_e8m0fnu": (
        "torch's cast to torch.float8_e8m0fnu is not a rounding qtensor has: it drops the sign, "
        "turns 0 into 2^-127 and rounds every value in (2^-127, 2^-126) up to 2^-126; qtensor's "
        "E8M0 scale format is 'e8m0' (qt.e8m0: round to nearest, 0, negative values and NaN "
        "give NaN)"),
}


# ---------------------------------------------------------------------------------------------
# String form and parsing

_FIELD_DEFAULTS = {
    cls: {f.name: f.default for f in dataclasses.fields(cls)}
    for cls in (FloatFormat, FixedFormat, BlockFormat)
}


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
