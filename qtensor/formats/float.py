"""Sign/exponent/mantissa floats: :class:`FloatFormat` (IEEE-like, OCP "fn", no special codes,
IEEE P3109's domains, exponent-only scale formats such as E8M0), the FP32 scale grid of block
formats (:class:`Fp32ScaleGrid`) and IEEE P3109's formats by name (:func:`p3109`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .base import (_F32_EMAX, _F32_EXP, _F32_MAN, _F32_MIN_QUANTUM_EXP, Format, FormatError,
                   _check_bool, _check_int, _check_rounding, _int_str)

# p3109_extended / p3109_finite: IEEE P3109's domains (no -0: NaN takes its code, or the top code
# of an unsigned format; extended: the top code is +Inf, and its negative -Inf)
SPECIALS = ("ieee", "fn", "none", "p3109_extended", "p3109_finite")
_P3109_SPECIALS = ("p3109_extended", "p3109_finite")


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

    is_float = True

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

    @property
    def is_p3109(self) -> bool:
        """Whether its special codes are IEEE P3109's (specials p3109_extended/p3109_finite)."""
        return self.specials in _P3109_SPECIALS

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

    def kernel_args(self) -> tuple:
        if self.saturate:
            overflow = 0
        else:
            overflow = 1 if self.has_inf else 2
        # is_unsigned: the kernels' exponent-only formats without zero (E8M0); an unsigned format
        # with zero rounds as a signed one, then the reference's sign_fixup
        return "quantize_float", (self.man, self.emin, self.subnormals, float(self.max), overflow,
                                  not self.has_zero)

    def element_args(self) -> list:
        return [0, self.man, self.emin, int(self.subnormals), 0, self.emax]

    def unsigned_range(self) -> Optional[str]:
        if self.signed:
            return None
        if self.has_zero:  # (UE5M3)
            return f"[0, {self.max:g}] (no sign: negatives give NaN)"
        return f"[2^{self.emin}, 2^{self.emax}] (no sign and no zero: 0 and negatives give NaN)"

    def __repr__(self) -> str:
        return f"FloatFormat({self})"


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


