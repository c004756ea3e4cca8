"""Fixed point: :class:`FixedFormat`, integers k times 2^-fl."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from .base import (_F32_EMAX, _F32_MIN_QUANTUM_EXP, Format, FormatError, _check_bool,
                   _check_int, _check_rounding, _int_str)


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

    def kernel_args(self) -> tuple:
        return "quantize_fixed", (self.wl, self.fl, self.signed, self.symmetric, self.saturate)

    def element_args(self) -> list:
        return [1, self.wl, self.fl, int(self.signed), int(self.symmetric), self.emax]

    def unsigned_range(self) -> Optional[str]:
        if self.signed:
            return None
        return (f"[0, {self.max:g}] (unsigned: negatives "
                f"{'clamp to 0' if self.saturate else 'wrap around'})")

    def __repr__(self) -> str:
        return f"FixedFormat({self})"


