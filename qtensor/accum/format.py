"""Accumulation formats: :class:`AccumFormat` (an MMA datapath: how one contraction sums its
products), its checks, and the presets from Volta to Blackwell and AMD CDNA3."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Optional

ALIGN_ROUNDINGS = ("toward_zero", "floor", "nearest")  # nearest: ties to even
ACC_ROUNDINGS = ("toward_zero", "nearest")
STAGES = ("fused", "cdna3", "cdna3_fp8")
# where the scales of block-scaled operands are applied (accum_matmul's a_scale/b_scale)
SCALES = ("instruction", "promotion", "epilogue")


class AccumFormatError(ValueError):
    """An impossible accumulator description."""


def _check_int(name, value, lo, hi=None):
    if isinstance(value, bool) or not isinstance(value, int):
        raise AccumFormatError(f"AccumFormat.{name} must be an int, got {value!r}")
    if value < lo or (hi is not None and value > hi):
        rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise AccumFormatError(f"AccumFormat.{name} must be {rng}, got {value}")


def _check_choice(name, value, choices):
    if value not in choices:
        raise AccumFormatError(f"AccumFormat.{name} must be one of {choices}, got {value!r}")


@dataclass(frozen=True, repr=False)
class AccumFormat:
    """An MMA datapath: how the products of one contraction are summed (see the module doc).

    chunk: K-elements fused by one instruction. frac_bits: fractional bits each aligned term
    keeps. align_rounding: how the dropped bits go (``toward_zero``, ``floor``, ``nearest``).
    acc_in_alignment: the running partial result is a term of the alignment (NVIDIA: yes).
    acc_man / acc_rounding: the format each instruction's result is normalized to (float32's
    exponent range, ``acc_man`` fractional bits). promote: instructions between additions into
    an FP32 accumulator (None: never). group: products summed exactly before alignment.
    e_zero: the alignment exponent of a zero term (a zero product, an all-zero group, a zero
    partial, a padding slot of a short last chunk) in the max-exponent search (MMA-Sim's
    e_zero); None: zero terms take no part.
    acc_emin / acc_emax: the accumulator format's exponent range (float32's by default; FP16
    output: -14, 15): its subnormal grid, the clamp of the partial's alignment exponent and the
    overflow to inf at 2^(acc_emax + 1).
    stages: ``fused`` (the one-stage alignment above: NVIDIA), or AMD CDNA3's two stages (MMA-Sim's
    MMA_TR_FDPA, ``cdna3``; MMA_GTR_FDPA, ``cdna3_fp8``, whose products are fused as two
    interleaved halves): the products fused with frac_bits bits (truncated), the partial added
    in a second alignment with floor at 32 / frac_bits bits, the sum floored to 31 bits and
    rounded to nearest FP32 (the other fields keep their defaults; on CPU their own kernel,
    csrc/cpu/accum_cdna3.cpp, for frac_bits <= 24).
    scales: where the scales ``a_scale``/``b_scale`` given to accum_matmul (elements unscaled)
    are applied: ``instruction`` (inside the MMA, per K-block: Blackwell's block-scaled
    tcgen05), ``promotion`` (each promotion interval's partial sum of unscaled products is
    added into the FP32 accumulator times a_scale * b_scale: DeepSeek-V3's 1x128 / 128x128 FP8
    scaling on Hopper, a scale per ``chunk * promote`` K-elements) or ``epilogue`` (one scale
    per row of a / column of b, or per tensor, multiplied into the finished sum). Without scale
    tensors every mode gives the same result.
    """

    chunk: int
    frac_bits: int
    align_rounding: str = "toward_zero"
    acc_in_alignment: bool = True
    acc_man: int = 23
    acc_rounding: str = "toward_zero"
    promote: Optional[int] = None
    group: int = 1
    e_zero: Optional[int] = None
    acc_emin: int = -126
    acc_emax: int = 127
    stages: str = "fused"
    scales: str = "instruction"
    name: Optional[str] = dataclasses.field(default=None, compare=False)

    def __post_init__(self):
        _check_int("chunk", self.chunk, 1, 1 << 16)
        _check_int("group", self.group, 1)
        if self.chunk % self.group:
            raise AccumFormatError(
                f"AccumFormat.chunk ({self.chunk}) must be a multiple of group ({self.group})")
        if self.group > 1 and self.chunk // self.group > 256:
            raise AccumFormatError(
                f"AccumFormat: at most 256 groups per chunk, got chunk={self.chunk}, "
                f"group={self.group}")
        _check_int("acc_man", self.acc_man, 0, 23)
        if self.promote is not None:
            _check_int("promote", self.promote, 1)
            if self.promote > 2 ** 31 - 1:  # the kernels' int (a longer interval than K: None)
                raise AccumFormatError(
                    f"AccumFormat.promote must be at most 2**31 - 1 (the kernels take an int; "
                    f"for no promotion before the end use promote=None), got {self.promote}")
        _check_choice("align_rounding", self.align_rounding, ALIGN_ROUNDINGS)
        _check_choice("acc_rounding", self.acc_rounding, ACC_ROUNDINGS)
        if self.e_zero is not None:
            _check_int("e_zero", self.e_zero, -1000, 128)
        _check_choice("stages", self.stages, STAGES)
        _check_choice("scales", self.scales, SCALES)
        if self.scales == "promotion" and self.promote is None:
            raise AccumFormatError("AccumFormat(scales='promotion') needs a promotion interval "
                                   "(promote=...): the scales are applied on promotion")
        if self.stages != "fused" and self.group != 1:
            raise AccumFormatError("AccumFormat: the CDNA3 stages take no groups")
        _check_int("acc_emin", self.acc_emin, -126, 0)
        _check_int("acc_emax", self.acc_emax, 1, 127)
        if not isinstance(self.acc_in_alignment, bool):
            raise AccumFormatError(
                f"AccumFormat.acc_in_alignment must be a bool, got {self.acc_in_alignment!r}")
        # every scaled term is below 2^(frac_bits + 2) (a product's significand is below 4); the
        # sum of the chunk's terms (and p) must stay below 2^53 to be exact in float64
        _check_int("frac_bits", self.frac_bits, 0)
        terms = self.chunk // self.group + 1
        limit = 51 - math.ceil(math.log2(terms))
        if self.frac_bits > limit:
            raise AccumFormatError(
                f"AccumFormat.frac_bits={self.frac_bits} is too wide for chunk={self.chunk}, "
                f"group={self.group}: the exact float64 sum allows at most {limit}")

    def replace(self, **changes) -> "AccumFormat":
        """A copy with some fields changed (validated; the preset name is dropped)."""
        changes.setdefault("name", None)
        return dataclasses.replace(self, **changes)

    def __str__(self) -> str:
        parts = [f"chunk={self.chunk}", f"frac_bits={self.frac_bits}"]
        if self.group != 1:
            parts.append(f"group={self.group}")
        if self.align_rounding != "toward_zero":
            parts.append(f"align_rounding={self.align_rounding}")
        if not self.acc_in_alignment:
            parts.append("acc_in_alignment=False")
        if self.acc_man != 23:
            parts.append(f"acc_man={self.acc_man}")
        if self.acc_rounding != "toward_zero":
            parts.append(f"acc_rounding={self.acc_rounding}")
        if self.e_zero is not None:
            parts.append(f"e_zero={self.e_zero}")
        if self.stages != "fused":
            parts.append(f"stages={self.stages}")
        if self.scales != "instruction":
            parts.append(f"scales={self.scales}")
        if (self.acc_emin, self.acc_emax) != (-126, 127):
            parts.append(f"acc_emin={self.acc_emin}, acc_emax={self.acc_emax}")
        parts.append(f"promote={self.promote}")
        body = f"AccumFormat({', '.join(parts)})"
        return f"{self.name}: {body}" if self.name else body

    __repr__ = __str__


# ---------------------------------------------------------------------------------------------
# Presets. Sources: MMA-Sim v2 (microsoft/MMA-Sim, mmasim/nv_ptx/sim.py: _mma_F_bits
# Volta 23, Turing/Ampere/Ada 24, Hopper/Blackwell 25; FP8 on Hopper (wgmma) and Ada: 13
# fractional bits and an output truncated to e8m13; kind::mxf4: 35 bits, 16-product groups;
# split-k halves of Ampere's m16n8k16; a chunk is _mma_L_max_bytes of operands (Volta 8, Turing
# to Ada 16, Hopper/Blackwell 32); FP32 normalizations truncate, FP16 outputs round to nearest;
# e_zero per architecture and output type), arXiv 2511.10909v2, and the
# DeepSeek-V3 report, sec. 3.5.2 (Hopper FP8 keeps ~14 bits; promotion to FP32 every 128
# elements = 4 WGMMAs, CUTLASS's default interval). Instruction K: PTX ISA (mma.m8n8k4 on Volta,
# wgmma k16 for f16/bf16 and k32 for FP8, tcgen05 kind::mxf4 k64).
def _preset(name, **kw):
    return AccumFormat(name=name, **kw)


PRESETS = {p.name: p for p in (
    # e_zero: MMA-Sim's nv_ptx/sim.py, _mma_e_zero_for_fp32 (Volta -131, Turing/Ampere/Ada -132,
    # Hopper/Blackwell -133; wgmma and tcgen05 -133) and MMA_GST_FDPA's -139 (kind::mxf4)
    _preset("volta_fp16", chunk=4, frac_bits=23, e_zero=-131),            # mma.m8n8k4
    # m16n8k16 runs as two k8 halves (MMA-Sim)
    _preset("ampere_fp16", chunk=8, frac_bits=24, e_zero=-132),
    _preset("ampere_bf16", chunk=8, frac_bits=24, e_zero=-132),
    _preset("hopper_fp16", chunk=16, frac_bits=25, e_zero=-133),          # wgmma k16
    _preset("hopper_bf16", chunk=16, frac_bits=25, e_zero=-133),
    # wgmma k32 e4m3/e5m2, 13 fractional bits, result truncated to e8m13; CUTLASS promotes the
    # partial into FP32 every 4 instructions (128 K-elements; DeepSeek-V3 sec. 3.5.2)
    _preset("hopper_fp8", chunk=32, frac_bits=13, acc_man=13, promote=4, e_zero=-133),
    # the same without promotion ("fast accumulation": the whole K in the tensor core)
    _preset("hopper_fp8_fast", chunk=32, frac_bits=13, acc_man=13, e_zero=-133),
    _preset("blackwell_fp16", chunk=16, frac_bits=25, e_zero=-133),       # tcgen05 k16
    _preset("blackwell_bf16", chunk=16, frac_bits=25, e_zero=-133),
    # tcgen05 kind::mxf4 k64: groups of 16 FP4 products summed exactly, scaled, fused with 35
    # bits; each group aligned at its block-scale exponent (accum_matmul's group exponents)
    _preset("blackwell_mxfp4", chunk=64, frac_bits=35, group=16, e_zero=-139),
    # NVFP4 (kind::mxf4nvf4, 16-element blocks, E4M3 scales): MMA-Sim uses the same 35-bit path
    _preset("blackwell_nvfp4", chunk=64, frac_bits=35, group=16, e_zero=-139),
    # TF32 (operands already tf32: the hardware truncates float32 inputs to tf32, so round them
    # with qt.formats "tf32" and rounding="toward_zero" to match it). mma.m16n8k8 .tf32 on Ampere
    # fuses 16 bytes of operands (4 K-elements), 24 bits; wgmma/tcgen05 k8 .tf32: 8, 25 bits
    _preset("ampere_tf32", chunk=4, frac_bits=24, e_zero=-132),           # mma.m16n8k8.tf32
    _preset("hopper_tf32", chunk=8, frac_bits=25, e_zero=-133),           # wgmma k8 tf32
    _preset("blackwell_tf32", chunk=8, frac_bits=25, e_zero=-133),        # tcgen05 kind::tf32
    # Ada Lovelace mma.m16n8k32 e4m3/e5m2: 16 K-elements fused, 13 bits, output RZ to e8m13
    _preset("ada_fp8", chunk=16, frac_bits=13, acc_man=13, e_zero=-132),
    # tcgen05 kind::f8f6f4 (FP8/FP6/FP4 operands without block scales): 32 K-elements, 25 bits;
    # FP6/FP4 subnormals align at their formats' minimum normal exponents (a_emin/b_emin)
    _preset("blackwell_f8f6f4", chunk=32, frac_bits=25, e_zero=-133),
    # tcgen05 kind::mxf8f6f4 block32 (MXFP8/MXFP6/MXFP4 operands, E8M0 scales): the same 25-bit
    # path, each product at its elements' and scales' exponents (MMA-Sim's MMA_ST_FDPA): on the
    # dequantized operands, an element's clamp is its format's emin plus its block's scale
    # exponent (per-element a_emin/b_emin, from the MX operand format in QTensor contractions)
    _preset("blackwell_mxf8f6f4", chunk=32, frac_bits=25, e_zero=-133),
    # wgmma k32 FP8 with an FP16 accumulator (.f16 D/C): 13 bits, each result rounded to
    # nearest FP16 (MMA-Sim's RNE-FP16), zero terms at -21; the FP16 partial is the next
    # instruction's C
    _preset("hopper_fp8_f16", chunk=32, frac_bits=13, acc_man=10, acc_rounding="nearest",
            acc_emin=-14, acc_emax=15, e_zero=-21),
    # AMD CDNA3 (MI300) v_mfma_f32_*_f16/bf16: 8 products fused with 24 bits, then the partial
    # in a second stage (MMA-Sim amd/sim.py: MMA_TR_FDPA(F=24, F2=31, RNE-FP32, L_max=8))
    _preset("cdna3_fp16", chunk=8, frac_bits=24, stages="cdna3"),
    _preset("cdna3_bf16", chunk=8, frac_bits=24, stages="cdna3"),
    # v_mfma_f32_*_fp8/bf8 (e4m3fnuz/e5m2fnuz): 16 products as two interleaved halves of 8
    # (MMA_GTR_FDPA(F=24, F2=31, RNE-FP32, L_max=16))
    _preset("cdna3_fp8", chunk=16, frac_bits=24, stages="cdna3_fp8"),
)}

def _check_accum(accum) -> AccumFormat:
    if isinstance(accum, str):
        if accum not in PRESETS:
            raise AccumFormatError(
                f"unknown accumulator preset {accum!r}; known: {', '.join(PRESETS)}")
        return PRESETS[accum]
    if not isinstance(accum, AccumFormat):
        raise TypeError(f"accum must be an AccumFormat or a preset name, got {accum!r}")
    return accum



def as_accum(spec, what: str = "accumulate") -> Optional[AccumFormat]:
    """None, an AccumFormat or a preset name (``"hopper_fp8"``) as an AccumFormat (or None)."""
    if spec is None or isinstance(spec, AccumFormat):
        return spec
    if isinstance(spec, str):
        return _check_accum(spec)
    raise TypeError(f"{what} must be an AccumFormat, a preset name of qt.accum.PRESETS "
                    f"({', '.join(PRESETS)}) or None, got {spec!r}")
