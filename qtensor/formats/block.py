"""Block formats: :class:`BlockFormat`, runs of elements (float or fixed point) sharing one scale
(MX, NVFP4 with its per-tensor scale, block floating point, 2D tiles), and its scale rules."""
from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from typing import Optional, Union

from .base import (_F32_MAN, _F32_MAX, _F32_MIN_QUANTUM_EXP, _MAX_INDEX, Format, FormatError,
                   _check_bool, _check_int, _check_rounding, _int_str, _significant_bits, parse)
from .fixed import FixedFormat
from .float import _P3109_SPECIALS, FloatFormat, Fp32ScaleGrid

# floor/even: OCP's and torchao's power-of-two scales from amax's exponent; ceil (= torchao's
# RCEIL, also spelled "rceil"): the smallest scale with amax / X <= max_elem; amax: scale =
# Q_scale(amax / max_elem); 4over6: NVFP4 blocks whose max maps to 4 or to 6 (Transformer Engine)
SCALE_RULES = ("floor", "ceil", "amax", "even", "4over6")
# the block ops' codes of the rules (csrc/include/qtensor/args.h, ScaleRule)
SCALE_RULE_CODES = {"floor": 0, "ceil": 1, "amax": 2, "even": 3, "4over6": 4}
_SCALE_RULE_ALIASES = {"rceil": "ceil"}


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
            elem = parse(elem)
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
        scale = parse(self.scale) if isinstance(self.scale, str) else self.scale
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
        if self.fp32_scales:
            man = _F32_MAN - _significant_bits(self.elem)
            elem_q = self.elem.min_quantum_exp
            emin = max(1 - 127, _F32_MIN_QUANTUM_EXP - elem_q + man)
            return Fp32ScaleGrid(8, man, bias=1 - emin, saturate=True)
        return self.scale

    @property
    def fp32_scales(self) -> bool:
        """Whether its scales are float32 numbers (scale='fp32'): the amax rule's then lie on an
        :class:`Fp32ScaleGrid` (``amax_scale_format``)."""
        s = self.scale
        return (s.exp, s.man, s.bias, s.specials) == (8, _F32_MAN, 127, "ieee") and s.signed

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
    def is_two_level(self) -> bool:
        return self.tensor_scale

    @property
    def is_tiled(self) -> bool:
        return self.block_shape is not None

    def kernel_args(self) -> tuple:
        if self.tensor_scale:
            raise ValueError(f"{self}: a two-level format (tensor_scale=True) has no "
                             "quantize_block arguments; qtensor::quantize_two_level rounds it, "
                             "with the block layout of x (qtensor.kernels.backend.two_level; "
                             "elem_scale_args() gives its element and scale arguments)")
        if self.block_shape is not None:
            raise ValueError(f"{self}: 2D blocks have no op of their own; quantize lays the tiles "
                             "out for quantize_block (reference.tile_blocks)")
        elem, elem_max, scale, smax = self.elem_scale_args()
        block_size = 0 if self.block_size is None else self.block_size
        return "quantize_block", (elem, elem_max, block_size, self.axis,
                                  SCALE_RULE_CODES[self.scale_rule], scale, smax, False)

    def elem_scale_args(self) -> tuple:
        """Its element and scale arguments of the block ops (``quantize_block``,
        ``quantize_two_level``): (elem, elem_max, scale, scale_max)."""
        e = self.elem
        s = self.scale if self.power_of_two_scales else self.amax_scale_format
        man, emin, subnormals, smax, overflow, unsigned = s.kernel_args()[1]
        return (e.element_args(), float(e.max),
                [man, emin, s.emax, int(subnormals), overflow, int(unsigned)], smax)

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

    @property
    def no_negative_zero(self) -> bool:
        return self.elem.no_negative_zero  # (the block kernels keep float elements' -0.0)

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
        return f"BlockFormat({self})"


