"""Hardware-faithful accumulation: what a matrix-multiply unit does with the products.

Elsewhere a contraction rounds its operands and accumulates in float32. Tensor cores do not: one
MMA instruction aligns the products of ``chunk`` K-elements (and the running partial sum) to the
largest exponent, keeps ``frac_bits`` fractional bits of each, and normalizes the sum to an
accumulator format; libraries add that partial sum into an FP32 accumulator every ``promote``
instructions. :class:`AccumFormat` describes such a datapath (presets from Volta to Blackwell);
:func:`accum_matmul` computes a matrix product with it (fused C++ kernel; a Triton kernel on
CUDA), bit for bit equal to
:func:`accum_matmul_reference`, the pure-PyTorch statement of the model (MMA-Sim v2's
``t_fdpa``/``gst_fdpa``: subnormal operands aligned at their format's minimum normal exponent,
zero terms at ``e_zero``, block-scaled groups at their scales' exponents), in which every step is
exact in float64; tests/accum/test_accum_mmasim.py checks every preset against ``mmasim``.

Use: ``qt.Recipe(..., accumulate=qt.accum.hopper_fp8)`` or ``t.accum = ...``: every contraction
with an operand that carries an accumulator sums its products with it, convolutions of every kind
included (1-, 2-, 3-D, grouped, transposed: lowered to GEMMs, see the conv section below).
Under torch.compile the accumulator travels with the QTensor and the kernel is one opaque op.

The model step by step, its sources and the known differences from hardware: docs/accum.md.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Optional

import torch

from ..kernels import ops as _ops
from ..kernels import selfcheck

__all__ = ["AccumFormat", "AccumFormatError", "OperandFormatWarning", "accum_matmul",
           "accum_matmul_reference",
           "as_accum", "contract", "PRESETS", "ALIGN_ROUNDINGS", "ACC_ROUNDINGS"]

ALIGN_ROUNDINGS = ("toward_zero", "floor", "nearest")  # nearest: ties to even
ACC_ROUNDINGS = ("toward_zero", "nearest")
_ROUND_CODE = {"toward_zero": 0, "floor": 1, "nearest": 2}
_EXP_MIN = -126          # float32's minimum normal exponent: the clamp of e(x)
_ZERO_EXP = -100000      # the alignment exponent of a zero term: below every real one
# the minimum normal exponent of an operand's input format (MMA-Sim's dtype_subnormal_exponent):
# a subnormal operand aligns as if its exponent were this one
_DTYPE_EMIN = {torch.float32: -126, torch.bfloat16: -126, torch.float16: -14,
               torch.float8_e4m3fn: -6, torch.float8_e5m2: -14,
               torch.float8_e4m3fnuz: -7, torch.float8_e5m2fnuz: -15}  # fnuz: AMD CDNA3's FP8
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
        if self.align_rounding not in ALIGN_ROUNDINGS:
            raise AccumFormatError(f"AccumFormat.align_rounding must be one of "
                                   f"{ALIGN_ROUNDINGS}, got {self.align_rounding!r}")
        if self.acc_rounding not in ACC_ROUNDINGS:
            raise AccumFormatError(f"AccumFormat.acc_rounding must be one of {ACC_ROUNDINGS}, "
                                   f"got {self.acc_rounding!r}")
        if self.e_zero is not None:
            _check_int("e_zero", self.e_zero, -1000, 128)
        if self.stages not in STAGES:
            raise AccumFormatError(f"AccumFormat.stages must be one of {STAGES}, got "
                                   f"{self.stages!r}")
        if self.scales not in SCALES:
            raise AccumFormatError(f"AccumFormat.scales must be one of {SCALES}, got "
                                   f"{self.scales!r}")
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
globals().update(PRESETS)


def _check_accum(accum) -> AccumFormat:
    if isinstance(accum, str):
        if accum not in PRESETS:
            raise AccumFormatError(
                f"unknown accumulator preset {accum!r}; known: {', '.join(PRESETS)}")
        return PRESETS[accum]
    if not isinstance(accum, AccumFormat):
        raise TypeError(f"accum must be an AccumFormat or a preset name, got {accum!r}")
    return accum


def _check_operands(a, b, op):
    for n, x in (("a", a), ("b", b)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{op}: {n} must be a tensor, got {type(x).__name__}")
        if x.dtype not in _DTYPE_EMIN:
            raise TypeError(f"{op}: {n} has dtype {x.dtype}; the accumulator model takes "
                            "float32, float16, bfloat16 or float8 (e4m3fn, e5m2) values "
                            "(float32 carriers)")
        if x.dim() < 2:
            raise ValueError(f"{op}: {n} must have at least 2 dims (..., rows, cols), got shape "
                             f"{tuple(x.shape)}")
    if a.shape[-1] != b.shape[-2]:
        raise ValueError(f"{op}: a is {tuple(a.shape)} and b is {tuple(b.shape)}: the "
                         "contraction sizes differ")
    if a.device != b.device:
        raise ValueError(f"{op}: a is on {a.device} but b is on {b.device}")


# ---------------------------------------------------------------------------------------------
# The reference: the model in PyTorch float64, vectorized over (batch, M, N), a loop over chunks.

def _pow2(e: torch.Tensor) -> torch.Tensor:
    """2^e exactly, as float64 (e an int64 tensor in the normal range of float64)."""
    return ((e + 1023) << 52).view(torch.float64)


def _exponent(x: torch.Tensor, emin) -> torch.Tensor:
    """floor(log2|x|), clamped below at emin (None: no clamp); _ZERO_EXP for zeros. x float64."""
    e = torch.frexp(x).exponent.to(torch.int64) - 1
    if emin is not None:
        e = e.clamp(min=emin)
    return torch.where(x == 0, _ZERO_EXP, e)


def _operand_emin(x: torch.Tensor, emin):
    """The clamp of an operand's alignment exponent: emin (an int, or an int tensor broadcast to
    x: per-element clamps, as a block format's), else its dtype's minimum normal one."""
    if emin is None:
        return _DTYPE_EMIN[x.dtype]
    if isinstance(emin, torch.Tensor):
        if emin.dtype.is_floating_point or emin.dtype == torch.bool:
            raise ValueError(f"an operand's emin tensor must have an integer dtype, got {emin.dtype}")
        return emin.to(torch.int64).to(x.device).expand(x.shape)
    if isinstance(emin, bool) or not isinstance(emin, int) or not -1000 <= emin <= 127:
        raise ValueError(f"an operand's emin must be an int in [-1000, 127], got {emin!r}")
    return emin


def _round(x: torch.Tensor, mode: str) -> torch.Tensor:
    if mode == "toward_zero":
        return torch.trunc(x)
    if mode == "floor":
        return torch.floor(x)
    return torch.round(x)  # ties to even


def _to_acc(v: torch.Tensor, f: AccumFormat) -> torch.Tensor:
    """Step 4: the exact float64 value v rounded to the accumulator format (float64 out)."""
    q = _pow2(_exponent(v, f.acc_emin).clamp(min=f.acc_emin) - f.acc_man)
    r = _round(v / q, f.acc_rounding) * q + 0.0  # + 0.0: a zero result is +0
    return torch.where(r.abs() >= 2.0 ** (f.acc_emax + 1), r.sign() * math.inf, r)


def _nonfinite(t: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """The IEEE result of a chunk with a non-finite term (t: terms along dim -2, p: partial)."""
    nan = torch.isnan(t).any(-2) | torch.isnan(p)
    pos = (t == math.inf).any(-2) | (p == math.inf)
    neg = (t == -math.inf).any(-2) | (p == -math.inf)
    out = torch.where(pos, math.inf, -math.inf)
    return torch.where(nan | (pos & neg), math.nan, out).to(t.dtype)


def _trunc_fuse(t, et, F):
    """MMA-Sim's truncated fused sum of the nonzero terms t (dim -2) at alignment exponents et:
    (the integer sum of trunc(t * 2^(F - emax)), emax); emax -999 where all are zero."""
    et = torch.where(t == 0, -999, et)
    if et.shape[-2] == 0:  # an empty half (a last chunk of one K-element): its slots are zeros
        return t.sum(-2), torch.full(t.sum(-2).shape, -999, dtype=torch.int64, device=t.device)
    emax = et.amax(-2)  # (all zero, -999: the zeros scaled by 2^1023 at most)
    return torch.trunc(t * _pow2((F - emax).clamp(max=1023))[..., None, :]).sum(-2), emax


def _cdna3_chunk(a, b, ea, eb, p, f):
    """One CDNA3 MFMA step (stages ``cdna3``/``cdna3_fp8``): the new partial from the chunk's
    operands a (..., M, k), b (..., k, N) (float64, alignment exponents ea, eb) and p."""
    F, F2 = f.frac_bits, 31
    t = a[..., :, :, None] * b[..., None, :, :]
    et = ea[..., :, :, None] + eb[..., None, :, :]
    if f.stages == "cdna3":  # a product of 2^128 or more (its significand in [1, 4)) is inf
        over = (et + (t.abs() >= _pow2(et + 1)).long()) >= 128
        t = torch.where(over & torch.isfinite(t), t.sign() * math.inf, t)
    tbad = ~torch.isfinite(t).all(-2)
    pbad = ~torch.isfinite(p)
    tf = torch.where(torch.isfinite(t), t, 0.0)
    if f.stages == "cdna3":
        D, ed = _trunc_fuse(tf, et, F)  # the products' sum: D * 2^(ed - F)
    else:  # two interleaved halves, each fused, then added at F bits of the larger exponent
        De, ee = _trunc_fuse(tf[..., 0::2, :], et[..., 0::2, :], F)
        Do, eo = _trunc_fuse(tf[..., 1::2, :], et[..., 1::2, :], F)
        ed = torch.maximum(ee, eo)  # (an all-zero half, -999: its 0 scaled by 2^-1022 at least)
        D = (torch.floor(De * _pow2((ee - ed).clamp(min=-1022)))
             + torch.floor(Do * _pow2((eo - ed).clamp(min=-1022))))
    pf = torch.where(pbad, 0.0, p)
    ec = torch.where(pf == 0, -126, _exponent(pf, -126))
    ec = torch.where(pbad, -1, ec)  # an inf/NaN partial aligns at -1 (frexp's exponent 0)
    em = torch.maximum(ed, ec)
    if f.stages == "cdna3_fp8":  # a partial 25 or more binades below the products is dropped,
        pbad = pbad & ~(ec < em - F - 1)  # an inf/NaN one too (as MMA-Sim's MMA_GTR_FDPA)
    bad = tbad | pbad
    sd = torch.floor(D * _pow2((ed - F).clamp(min=-1022)) * _pow2(F2 + 1 - em))  # at 2^(em - 32)
    sc = torch.floor(pf * _pow2(F - em))                      # at 2^(em - F)
    if f.stages == "cdna3_fp8":
        sc = torch.where(ec < em - F - 1, 0.0, sc)
    v = sd * _pow2(em - F2 - 1) + sc * _pow2(em - F)
    ev = torch.where(v == 0, 0, _exponent(v, -126))
    r = torch.floor(v * _pow2(F2 - ev)) * _pow2(ev - F2)
    # to nearest FP32 (inf from 2^128); a negative value below its grid gives -0.0, as the MFMA
    new = r.float().double()
    return torch.where(bad, _nonfinite(t, torch.where(pbad, p, 0.0)), new)


def _group_exps(x, want, name):
    """A group-exponent tensor (int) of the shape ``want``, as int64 (None stays None)."""
    if x is None:
        return None
    if not isinstance(x, torch.Tensor) or x.dtype.is_floating_point or x.dtype == torch.bool:
        raise TypeError(f"accum_matmul: {name} must be an integer tensor, got {x!r:.80}")
    try:
        return x.to(torch.int64).expand(want)
    except RuntimeError:
        raise ValueError(f"accum_matmul: {name} has shape {tuple(x.shape)}, expected "
                         f"{tuple(want)} (one exponent per group of K)") from None


def accum_matmul_reference(a: torch.Tensor, b: torch.Tensor, accum, *, a_emin=None, b_emin=None,
                           a_gexp=None, b_gexp=None, c=None, a_scale=None, b_scale=None,
                           a_fmt=None, b_fmt=None, block_size=None) -> torch.Tensor:
    """a @ b (batched over leading dims) with the accumulator ``accum``: float32 out.

    The statement of the model (module doc); the compiled kernel gives the same bits.
    a_emin, b_emin: the minimum normal exponent of each operand's input format (a subnormal
    operand aligns at it; default: from the dtype, -126 for float32 carriers). a_gexp (..., M,
    G) and b_gexp (..., G, N), G = ceil(K / group): with ``group`` > 1, each group's alignment
    exponent is a_gexp + b_gexp (the block scales' exponents, as Blackwell's block-scaled MMA),
    a group whose products are all zero takes e_zero; None: the group sum's own exponent.
    c: the initial accumulator (float32, broadcast to the output): the first instruction's
    accumulator input (with ``scales="promotion"`` and scale tensors: the FP32 accumulator's).
    a_scale, b_scale: the block scales of unscaled operands a, b, applied where ``accum.scales``
    says (see _scaled).
    """
    return _entry(_reference, "accum_matmul_reference", a, b, accum, a_fmt, b_fmt,
                  dict(a_emin=a_emin, b_emin=b_emin, a_gexp=a_gexp, b_gexp=b_gexp, c=c,
                       a_scale=a_scale, b_scale=b_scale, block_size=block_size))


def _reference(a, b, f: AccumFormat, *, a_emin=None, b_emin=None, a_gexp=None, b_gexp=None,
               c=None, a_scale=None, b_scale=None, block_size=None) -> torch.Tensor:
    """accum_matmul_reference after its operands' formats are resolved (_entry)."""
    _check_operands(a, b, "accum_matmul_reference")
    if a_scale is not None or b_scale is not None:
        return _scaled(_reference, a, b, f, a_scale, b_scale,
                       dict(a_emin=a_emin, b_emin=b_emin, a_gexp=a_gexp, b_gexp=b_gexp, c=c),
                       block_size)
    a_emin, b_emin = _operand_emin(a, a_emin), _operand_emin(b, b_emin)
    batch = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    M, K, N = a.shape[-2], a.shape[-1], b.shape[-1]
    G = -(-K // f.group)
    if (a_gexp is None) != (b_gexp is None) or (a_gexp is not None and f.group == 1):
        raise ValueError("accum_matmul: a_gexp and b_gexp go together, with a group format")
    a_gexp = _group_exps(a_gexp, (*batch, M, G), "a_gexp")
    b_gexp = _group_exps(b_gexp, (*batch, G, N), "b_gexp")
    a = a.float().expand(*batch, M, K).double()
    b = b.float().expand(*batch, K, N).double()
    if isinstance(a_emin, torch.Tensor):
        a_emin = a_emin.expand(*batch, M, K)
    if isinstance(b_emin, torch.Tensor):
        b_emin = b_emin.expand(*batch, K, N)
    ea = _exponent(a, a_emin)
    eb = _exponent(b, b_emin)
    shape = (*batch, M, N)
    acc = torch.zeros(shape, dtype=torch.float32, device=a.device)   # the FP32 accumulator
    if c is None:  # the instruction partial
        p = torch.zeros(shape, dtype=torch.float64, device=a.device)
    else:  # c itself, -0.0 included: it is K == 0's output (MMA-Sim's dpa returns C)
        p = c.float().double().to(a.device).expand(shape).clone()
    F = f.frac_bits
    ez = f.e_zero
    for ci, k0 in enumerate(range(0, K, f.chunk)):
        k1 = min(k0 + f.chunk, K)
        if f.stages != "fused":
            p = _cdna3_chunk(a[..., :, k0:k1], b[..., k0:k1, :], ea[..., :, k0:k1],
                             eb[..., k0:k1, :], p, f)
            if f.promote is not None and ((ci + 1) % f.promote == 0 or k1 == K):
                acc, p = acc + p.float(), torch.zeros_like(p)
            continue
        # 1. the exact products, (..., M, k, N), and their alignment exponents e(a) + e(b)
        t = a[..., :, k0:k1, None] * b[..., None, k0:k1, :]
        et = ea[..., :, k0:k1, None] + eb[..., None, k0:k1, :]
        zero = (t == 0).any(-2) | (k1 - k0 < f.chunk)  # a zero term (padding slots included)
        if f.group > 1:  # exact group sums (sequential float64 adds, exact for FP4 operands)
            k = k1 - k0
            g = -(-k // f.group) * f.group
            if g != k:
                t = torch.nn.functional.pad(t, (0, 0, 0, g - k))
            t = t.unflatten(-2, (g // f.group, f.group))
            allzero = (t == 0).all(-2)
            s = t[..., 0, :]
            for j in range(1, f.group):
                s = s + t[..., j, :]
            t = s
            if a_gexp is None:
                et = _exponent(t, None)
                zero = (t == 0).any(-2) | (k1 - k0 < f.chunk)
            else:
                g0 = k0 // f.group
                gn = t.shape[-2]
                et = a_gexp[..., :, g0:g0 + gn, None] + b_gexp[..., None, g0:g0 + gn, :]
                et = torch.where(allzero, _ZERO_EXP, et)
                zero = allzero.any(-2) | (k1 - k0 < f.chunk)
        finite = torch.isfinite(t).all(-2) & torch.isfinite(p)
        t = torch.where(finite[..., None, :], t, 0.0)
        # 2. emax over the nonzero terms (p included when it takes part in the alignment); zero
        # terms at e_zero
        emax = et.amax(-2)
        if f.acc_in_alignment:
            pe = torch.where(finite, p, 0.0)
            emax = torch.maximum(emax, _exponent(pe, f.acc_emin))
            zero = zero | (pe == 0)
        if ez is not None:
            emax = torch.where(zero, torch.clamp(emax, min=ez), emax)
        emax = torch.where(emax < _ZERO_EXP // 2, 0, emax)  # all terms zero: any scale will do
        # 3. each term to F fractional bits of 2^emax, rounded to an integer; 4. summed exactly
        scale = _pow2(F - emax)
        S = _round(t * scale[..., None, :], f.align_rounding).sum(-2)
        if f.acc_in_alignment:
            S = S + _round(torch.where(finite, p, 0.0) * scale, f.align_rounding)
            new = _to_acc(S * _pow2(emax - F), f)
        else:  # 5. the chunk's sum, normalized, then a float32 add into p
            new = (p.float() + _to_acc(S * _pow2(emax - F), f).float()).double()
        nonfinite = _nonfinite(
            a[..., :, k0:k1, None] * b[..., None, k0:k1, :], p)
        p = torch.where(finite, new, nonfinite)
        # 6. promotion into the FP32 accumulator
        if f.promote is not None and ((ci + 1) % f.promote == 0 or k1 == K):
            acc = acc + p.float()
            p = torch.zeros_like(p)
    out = p.float() if f.promote is None or K == 0 else acc  # K == 0: c (or 0) unchanged
    return torch.where(torch.isnan(out), math.nan, out)  # one NaN encoding


# ---------------------------------------------------------------------------------------------
# Block-scaled operands: where the scales are applied (AccumFormat.scales)

def _fma_f32(s: torch.Tensor, p: torch.Tensor, acc: torch.Tensor) -> torch.Tensor:
    """fp32(acc + s * p) with one rounding (the CUDA cores' FFMA that DeepGEMM's promotion
    ``final_accum += scale * accum`` compiles to); s, p, acc float32. s * p is exact in float64
    (two 24-bit significands); the sum is rounded to odd in float64 (TwoSum, then the last bit
    set toward the dropped part), which then rounds to nearest float32 correctly."""
    x, y = acc.double(), s.double() * p.double()
    hi = x + y
    yy = hi - x
    lo = (x - (hi - yy)) + (y - yy)
    even = (hi.view(torch.int64) & 1) == 0
    bump = (lo != 0) & even & torch.isfinite(hi)
    hi = torch.where(bump, torch.nextafter(hi, torch.where(lo > 0, math.inf, -math.inf)), hi)
    return hi.float()


def _scale_emin(s: torch.Tensor) -> Optional[int]:
    """The clamp of positive scales' floor(log2) (E4M3 subnormal scales at -6, as MMA-Sim's
    nvf4)."""
    return -6 if s.dtype == torch.float8_e4m3fn else None


def _scaled(fn, a, b, f: AccumFormat, a_scale, b_scale, kw, block_size=None) -> torch.Tensor:
    """a @ b of unscaled operands a, b with their scales applied where ``f.scales`` says; fn (the
    kernel entry or the reference) computes the unscaled sums.

    - ``instruction`` (Blackwell block-scaled MMA): a_scale (..., M, KB), b_scale (..., KB, N),
      one scale per block of ``block_size`` K-elements (the last block may be shorter; without
      block_size, K / KB where KB divides K, else refused: KB blocks of a ragged K do not say
      their size); a NaN scale (E8M0's NaN code) makes every output it enters NaN, as the
      hardware's; the operands are dequantized (exactly, each K-block's pair of operands shifted
      by opposite powers of two where one would leave float32's range) and
      each product aligns at its elements' and scales' exponents: with groups the group
      exponents are the scales' floor(log2) (a_gexp/b_gexp), without them the scales must be
      powers of two (E8M0) and add to the elements' clamps (a_emin/b_emin).
    - ``promotion`` (DeepSeek-V3 / DeepGEMM on Hopper): a_scale (..., M, KB), b_scale
      (..., KB, N), one per promotion interval of ``chunk * promote`` K-elements (expand a
      128x128 weight block's scale along N); each interval's chain of instructions starts from 0,
      its unscaled partial p is promoted as acc = fp32(acc + fp32(a_scale * b_scale) * p) (one
      FFMA); c starts acc.
    - ``epilogue``: a_scale broadcast to (..., M, 1), b_scale to (..., 1, N) (per tensor or per
      row / column); the whole sum of unscaled products, then fp32(sum * fp32(a_scale * b_scale)).
    """
    if a_scale is None or b_scale is None:
        raise ValueError("accum_matmul: a_scale and b_scale go together (a scale of 1 for an "
                         "operand without scales)")
    for n, x in (("a_scale", a_scale), ("b_scale", b_scale)):
        if not isinstance(x, torch.Tensor) or not x.dtype.is_floating_point:
            raise TypeError(f"accum_matmul: {n} must be a floating-point tensor, got {x!r:.80}")
    a_scale, b_scale = a_scale.to(a.device), b_scale.to(a.device)
    batch = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    M, K, N = a.shape[-2], a.shape[-1], b.shape[-1]
    if f.scales == "epilogue":
        try:
            sa = a_scale.float().expand(*batch, M, 1)
            sb = b_scale.float().expand(*batch, 1, N)
        except RuntimeError:
            raise ValueError(f"accum_matmul: with scales='epilogue' a_scale {tuple(a_scale.shape)}"
                             f" must broadcast to {(*batch, M, 1)} and b_scale "
                             f"{tuple(b_scale.shape)} to {(*batch, 1, N)}") from None
        out = fn(a, b, f, **kw)
        s = (sa.double() * sb.double()).float()
        return (out.double() * s.double()).float()
    if a_scale.dim() < 2 or b_scale.dim() < 2:
        raise ValueError("accum_matmul: a_scale must be (..., M, KB) and b_scale (..., KB, N)")
    KB = a_scale.shape[-1]
    if block_size is not None and (isinstance(block_size, bool) or not isinstance(
            block_size, int) or block_size < 1):
        raise ValueError(f"accum_matmul: block_size must be a positive int, got {block_size!r}")
    if f.scales == "promotion":
        blk = f.chunk * f.promote
        if block_size is not None and block_size != blk:
            raise ValueError(f"accum_matmul: scales='promotion' takes one scale per promotion "
                             f"interval (chunk * promote = {blk} K-elements), got "
                             f"block_size={block_size}")
    elif block_size is not None:
        blk = block_size
    elif KB and K % KB:
        lo, hi = -(-K // KB), (-(-K // (KB - 1)) - 1) if KB > 1 else K
        raise ValueError(
            f"accum_matmul: K={K} with {KB} scale columns: blocks of {lo} to {hi} K-elements "
            f"all give {KB} blocks (the last one shorter), so the block size is ambiguous; "
            f"pass block_size= (e.g. 32 for MX, 16 for NVFP4)")
    else:
        blk = K // KB if KB else 0
    want = -(-K // blk) if blk else 0
    try:
        if KB != want or b_scale.shape[-2] != want:
            raise RuntimeError
        sa = a_scale.expand(*batch, M, want)
        sb = b_scale.expand(*batch, want, N)
    except RuntimeError:
        what = (f"one per {blk} K-elements (chunk * promote)" if f.scales == "promotion"
                else "one per block of K, the same blocks for both")
        raise ValueError(f"accum_matmul: a_scale is {tuple(a_scale.shape)} and b_scale "
                         f"{tuple(b_scale.shape)}; for K={K} expected {(*batch, M, want)} and "
                         f"{(*batch, want, N)} ({what})") from None
    if f.scales == "instruction":
        return _instruction_scaled(fn, a, b, f, sa, sb, blk, kw)
    if kw["a_gexp"] is not None or kw["b_gexp"] is not None:
        raise ValueError("accum_matmul: scales='promotion' takes no a_gexp/b_gexp")
    inner = f.replace(promote=None, scales="instruction")
    c = kw.pop("c")
    kw.pop("a_gexp"), kw.pop("b_gexp")
    acc = (torch.zeros((*batch, M, N), dtype=torch.float32, device=a.device) if c is None
           else c.float().to(a.device).expand(*batch, M, N).clone())  # (-0.0 kept, as _reference)
    nb = K // blk
    xa, xb = a.expand(*batch, M, K), b.expand(*batch, K, N)
    ea, eb = _operand_emin(a, kw["a_emin"]), _operand_emin(b, kw["b_emin"])
    if isinstance(ea, torch.Tensor):
        ea = ea.expand(*batch, M, K)
    if isinstance(eb, torch.Tensor):
        eb = eb.expand(*batch, K, N)

    def cut(x, lo, hi, kdim):  # the K-slice lo:hi of an operand or of its clamps
        return x.narrow(kdim, lo, hi - lo) if isinstance(x, torch.Tensor) else x

    def split_a(x):  # (..., M, nb * blk) -> (..., nb, M, blk)
        return x.unflatten(-1, (nb, blk)).movedim(-2, -3) if isinstance(x, torch.Tensor) else x

    def split_b(x):  # (..., nb * blk, N) -> (..., nb, blk, N)
        return x.unflatten(-2, (nb, blk)) if isinstance(x, torch.Tensor) else x

    parts = []
    if nb:  # every full interval in one batched call: (..., nb, M, N)
        parts.append(fn(split_a(cut(xa, 0, nb * blk, -1)), split_b(cut(xb, 0, nb * blk, -2)),
                        inner, a_emin=split_a(cut(ea, 0, nb * blk, -1)),
                        b_emin=split_b(cut(eb, 0, nb * blk, -2))))
    if K > nb * blk:  # the last, shorter interval
        parts.append(fn(cut(xa, nb * blk, K, -1), cut(xb, nb * blk, K, -2), inner,
                        a_emin=cut(ea, nb * blk, K, -1),
                        b_emin=cut(eb, nb * blk, K, -2)).unsqueeze(-3))
    if parts:
        P = torch.cat(parts, -3) if len(parts) > 1 else parts[0]
        for kb in range(want):
            s = (sa[..., :, kb, None].double() * sb[..., kb, None, :].double()).float()
            acc = _fma_f32(s, P[..., kb, :, :], acc)
    return torch.where(torch.isnan(acc), math.nan, acc)


def _block_shift(ad, bd, blk, nb):
    """Per K-block exponents d (int64, (nb,)): a * 2^-d and b * 2^d keep every product, and
    their exponents' sums, the alignment; chosen (0 where it already fits) to bring both
    operands of a block into float32's normal range, which E8M0 scales at the ends of theirs
    leave (2^127 on a, 2^-127 on b: a's dequantized values overflow float32)."""
    K = ad.shape[-1]

    def ranges(x):  # (hi, lo) of the nonzero values' exponents per block of K (last dim)
        e = _exponent(x, None).reshape(-1, K)
        e = torch.nn.functional.pad(e, (0, nb * blk - K), value=_ZERO_EXP).unflatten(-1, (nb, blk))
        nz = e != _ZERO_EXP
        hi = torch.where(nz, e, -10000).amax((0, 2)) if e.numel() else torch.zeros(nb)
        lo = torch.where(nz, e, 10000).amin((0, 2)) if e.numel() else torch.zeros(nb)
        return hi.long(), lo.long()
    hi_a, lo_a = ranges(ad)
    hi_b, lo_b = ranges(bd.transpose(-1, -2))
    low = torch.maximum(hi_a - 127, -126 - lo_b)   # a below 2^128, b at or above 2^-126
    high = torch.minimum(lo_a + 126, 127 - hi_b)   # a at or above 2^-126, b below 2^128
    d = torch.clamp(torch.zeros_like(low), max=high)
    return torch.maximum(d, low)  # (no d fits both: the exactness check refuses)


def _instruction_scaled(fn, a, b, f, sa, sb, blk, kw):
    """scales='instruction': the dequantized operands with the scales' exponents in the
    alignment (group exponents, or the elements' clamps plus power-of-two scale exponents)."""
    K = a.shape[-1]
    # a NaN scale (E8M0's NaN code): the hardware's products of its block are NaN, whatever
    # the elements; the other outputs are computed with a scale of 1 in its place
    nan_a, nan_b = torch.isnan(sa), torch.isnan(sb)
    clamp_a, clamp_b = _scale_emin(sa), _scale_emin(sb)
    sa, sb = torch.where(nan_a, 1.0, sa.double()), torch.where(nan_b, 1.0, sb.double())
    nb = sa.shape[-1]
    ra = sa.repeat_interleave(blk, -1)[..., :K]
    rb = sb.repeat_interleave(blk, -2)[..., :K, :]
    ad, bd = a.double() * ra, b.double() * rb
    d = _block_shift(ad, bd, blk, nb) if K else torch.zeros(nb, dtype=torch.int64)
    if bool((d != 0).any()):
        ad = ad * _pow2(-d).repeat_interleave(blk)[:K]
        bd = bd * _pow2(d).repeat_interleave(blk)[:K, None]
    a32, b32 = ad.float(), bd.float()
    if not (torch.equal(a32.double(), ad) and torch.equal(b32.double(), bd)):
        raise ValueError("accum_matmul: scales='instruction' needs elements * scales exact in "
                         "float32 (block-scaled formats' elements and scales are)")
    kw = dict(kw)
    ea, eb = _exponent(sa, clamp_a), _exponent(sb, clamp_b)
    pow2_scales = torch.equal(_pow2(ea), sa) and torch.equal(_pow2(eb), sb)
    ea, eb = ea - d, eb + d[:, None]  # (the shifted operands' scales)
    if f.group > 1:
        if kw["a_gexp"] is not None or kw["b_gexp"] is not None:
            raise ValueError("accum_matmul: give the scales or the group exponents, not both")
        if blk % f.group:
            raise ValueError(f"accum_matmul: a scale block ({blk} K-elements) must hold whole "
                             f"groups of {f.group}")
        G = -(-K // f.group)
        kw["a_gexp"] = ea.repeat_interleave(blk // f.group, -1)[..., :G]
        kw["b_gexp"] = eb.repeat_interleave(blk // f.group, -2)[..., :G, :]
    else:  # an element's clamp moves by its block's scale exponent (MMA-Sim's MMA_ST_FDPA)
        if not pow2_scales:
            raise ValueError("accum_matmul: scales='instruction' without groups takes "
                             "power-of-two (E8M0) scales, as tcgen05 kind::mxf8f6f4")
        em_a = _operand_emin(a, kw["a_emin"])
        em_b = _operand_emin(b, kw["b_emin"])
        kw["a_emin"] = em_a + ea.repeat_interleave(blk, -1)[..., :K]
        kw["b_emin"] = em_b + eb.repeat_interleave(blk, -2)[..., :K, :]
    out = fn(a32, b32, f, **kw)
    nan = nan_a.any(-1)[..., :, None] | nan_b.any(-2)[..., None, :]
    return torch.where(nan, math.nan, out) if bool(nan.any()) else out


# ---------------------------------------------------------------------------------------------
# Entry point: the compiled kernel where it applies, else the reference

def _register_fake():
    if not _ops.kernels_available("cpu") or not hasattr(torch.ops.qtensor, "accum_matmul"):
        return

    @torch.library.register_fake("qtensor::accum_matmul")
    def _(a, b, *args):
        return a.new_empty((a.shape[0], a.shape[1], b.shape[2]))

    if hasattr(torch.ops.qtensor, "accum_matmul_cdna3"):
        @torch.library.register_fake("qtensor::accum_matmul_cdna3")
        def _(a, b, *args, **kw):
            return a.new_empty((a.shape[0], a.shape[1], b.shape[2]))


_register_fake()


def _kernel_ready(a: torch.Tensor) -> bool:
    """Whether a kernel sums a's contractions: the Triton one where qtensor.kernels.gpu takes a (CUDA;
    CPU inside qtensor.kernels.gpu.force), else the C++ one on CPU."""
    if _ops.gpu.takes(a):
        return True
    if not _ops.kernels_available("cpu") or not hasattr(torch.ops.qtensor, "accum_matmul"):
        return False
    return a.device.type == "cpu"


def _sample_check(device: torch.device) -> Optional[str]:
    """The accumulator kernel's first-use check (qtensor/kernels/selfcheck.py): every preset, on FP8,
    FP4 and float32 operands with rows of very different ranges, kernel vs reference."""
    g = torch.Generator().manual_seed(0)  # its own generator: the user's stream is untouched
    a = torch.randn(2, 5, 200, generator=g) * torch.exp2(torch.randint(-20, 20, (2, 5, 1),
                                                                        generator=g).float())
    b = torch.randn(2, 200, 7, generator=g)
    a[0, 0, 7], b[1, 3, 2] = math.inf, math.nan
    operands = [(_ops.quantize(a, e), _ops.quantize(b, e)) for e in ("fp8_e4m3", "fp4_e2m1")]
    for x, y in operands + [(a, b)]:
        x, y = x.to(device), y.to(device)
        for f in (p for p in PRESETS.values() if p.stages == "fused"):  # (the kernel's)
            got = _ops.kernel_ops(x).accum_matmul(x, y, *op_args(f), None, None, None, None,
                                                  None)
            found = selfcheck.difference(got, _reference(x, y, f))
            if found is not None:
                return f"accumulator {f.name}: {found}"
    return None


selfcheck.register("accumulator", _sample_check)


def op_args(f: AccumFormat, a_emin: int = _EXP_MIN, b_emin: int = _EXP_MIN) -> tuple:
    """The integer arguments of ``qtensor::accum_matmul`` after a and b (then a_gexp, b_gexp, c)."""
    return (f.chunk, f.frac_bits, f.group, _ROUND_CODE[f.align_rounding], f.acc_in_alignment,
            f.acc_man, _ROUND_CODE[f.acc_rounding], 0 if f.promote is None else f.promote,
            _ZERO_EXP if f.e_zero is None else f.e_zero, a_emin, b_emin, f.acc_emin, f.acc_emax)


class OperandFormatWarning(UserWarning):
    """A hardware preset on operands whose input format nothing states (float32 carriers): the
    result may differ from the hardware's (see accum_matmul)."""


# What each preset's instruction takes, where float32 carriers of such values give other bits
# than the hardware: subnormal operands align at their format's minimum normal exponent (not
# float32's), and block-scaled groups at their scales' exponents. (bf16 and tf32 share float32's
# exponent range: their float32 carriers give the hardware's bits.)
_PRESET_INPUTS = {
    **dict.fromkeys(("volta_fp16", "ampere_fp16", "hopper_fp16", "blackwell_fp16",
                     "cdna3_fp16"), "float16"),
    **dict.fromkeys(("hopper_fp8", "hopper_fp8_fast", "ada_fp8", "hopper_fp8_f16"),
                    "FP8 (e4m3/e5m2)"),
    "blackwell_f8f6f4": "FP8/FP6/FP4", "cdna3_fp8": "FP8 (e4m3fnuz/e5m2fnuz)",
    "blackwell_mxf8f6f4": "MXFP8/MXFP6/MXFP4 (block-scaled)",
    "blackwell_mxfp4": "MXFP4 (block-scaled)", "blackwell_nvfp4": "NVFP4 (block-scaled)",
}


def _operand(x, fmt, name: str, kdim: int, op: str, stated: bool):
    """(values, format) of an operand given as a QTensor (its payload; its operand format
    mm_fmt, else fmt, rounding the payload to mm_fmt as a contraction does; stated: the call
    gives this operand's scales or clamps, which then say what its values are) or as a tensor
    with a format argument (``a_fmt``), whose values must be in that format along K."""
    from ..formats import core as _formats
    # a QTensor (this module sits below qtensor.tensor.subclass: it is known by its format and payload)
    if isinstance(x, torch.Tensor) and hasattr(x, "payload") and hasattr(x, "mm_fmt"):
        q, x = x, x.payload
        if fmt is None and not stated:
            fmt = q.mm_fmt or q.fmt
            if q.mm_fmt is not None:
                x = _ops.quantize(x, _along_k(q.mm_fmt, kdim))
    if fmt is None:
        return x, None
    if isinstance(fmt, str):
        fmt = _formats.format(fmt)
    if not isinstance(fmt, _formats.Format):
        raise TypeError(f"{op}: {name}_fmt must be a format (e.g. qt.fp8_e4m3), got {fmt!r:.80}")
    fmt = getattr(fmt, "base", fmt)
    if (not isinstance(x, torch.Tensor) or not x.dtype.is_floating_point
            or torch.compiler.is_compiling()):  # (no data-dependent check in a graph)
        return x, fmt  # (_check_operands says what is wrong)
    xf = x.float()
    r = _ops.quantize(xf, _along_k(fmt, kdim), rounding="nearest")
    if not torch.equal(torch.where(torch.isnan(xf), 0.0, r).view(torch.int32),
                       torch.where(torch.isnan(xf), 0.0, xf).view(torch.int32)):
        bad = int((r.view(torch.int32) != xf.view(torch.int32)).sum())
        raise ValueError(f"{op}: {name}_fmt={fmt}, but {bad} of {x.numel()} values of {name} "
                         f"are not values of {fmt} (round them first: qt.quantize)")
    return x, fmt


def _along_k(fmt, kdim: int):
    """A block format with its blocks along the operand's K dim."""
    from ..formats.core import BlockFormat
    if isinstance(fmt, BlockFormat) and fmt.block_size and fmt.block_shape is None:
        return fmt.replace(axis=kdim)
    return fmt


class _Fmt:
    """A format holder as _scale_plan reads an operand's QTensor (fmt; no payload)."""

    def __init__(self, fmt):
        self.fmt, self.mm_fmt = fmt, None


def _warn_unstated(f: AccumFormat, a, b, a_fmt, b_fmt, kw, op):
    """Warn where a preset takes operands narrower than float32 and nothing says what the
    float32 (or bfloat16) carriers hold: the hardware's bits need the operands' formats."""
    what = _PRESET_INPUTS.get(f.name)
    if what is None or torch.compiler.is_compiling():  # (a graph takes no warning call)
        return
    scaled = kw.get("a_scale") is not None or kw.get("a_gexp") is not None
    for n, x, fmt in (("a", a, a_fmt), ("b", b, b_fmt)):
        if fmt is not None or _DTYPE_EMIN.get(x.dtype, -126) != -126:
            continue  # a format argument, a QTensor or a narrow dtype says it
        if f.group > 1:
            stated = scaled  # the group exponents come from the scales
        else:
            stated = kw.get(f"{n}_emin") is not None
        if not stated:
            import warnings
            need = (f"{n}_fmt=qt.mxfp4_e2m1 (or {n}_gexp/{n}_scale)" if f.group > 1 else
                    f"{n}_fmt=qt.mxfp8_e4m3 (or {n}_emin per element)" if f.scales ==
                    "instruction" and "block" in what else
                    f"{n}_fmt=... (e.g. qt.fp8_e4m3), a torch float8/float16 dtype or {n}_emin")
            warnings.warn(
                f"{op} with {f.name}, whose instruction takes {what} operands, on {x.dtype} "
                f"values of {n} whose format nothing states: subnormal operands and block "
                f"scales do not align as on the hardware (other bits); say what {n} holds: "
                f"a QTensor, {need}", OperandFormatWarning, stacklevel=4)


def _entry(fn, op, a, b, accum, a_fmt, b_fmt, kw) -> torch.Tensor:
    """The public entry points: the operands' formats (QTensors, a_fmt/b_fmt) into clamps or
    block scales, a warning where a preset's operands are unstated, then fn (_matmul or
    _reference)."""
    from ..formats.core import BlockFormat, FloatFormat
    f = _check_accum(accum)
    # formats given as arguments must be usable as given; a QTensor's, as a contraction's, may
    # leave the values to carry their scales
    explicit = a_fmt is not None or b_fmt is not None
    scaled = any(kw[k] is not None for k in ("a_scale", "b_scale", "a_gexp", "b_gexp"))
    a, a_fmt = _operand(a, a_fmt, "a", -1, op, scaled or kw["a_emin"] is not None)
    b, b_fmt = _operand(b, b_fmt, "b", -2, op, scaled or kw["b_emin"] is not None)
    _check_operands(a, b, op)
    _warn_unstated(f, a, b, a_fmt, b_fmt, kw, op)
    kw = dict(kw)
    blocks = [isinstance(x, BlockFormat) for x in (a_fmt, b_fmt)]
    for n, fmt in (("a", a_fmt), ("b", b_fmt)):
        if isinstance(fmt, FloatFormat) and kw[f"{n}_emin"] is None:
            kw[f"{n}_emin"] = _emin_of(_Fmt(fmt))
    if any(blocks):
        given = [k for k in ("a_scale", "b_scale", "a_gexp", "b_gexp", "block_size")
                 if kw[k] is not None]
        if given:
            raise ValueError(f"{op}: a block format (a_fmt/b_fmt, or a QTensor's) carries its "
                             f"scales in the values; {', '.join(given)} would apply them "
                             f"twice (give the elements with their scales instead)")
        rest = {k: kw[k] for k in ("a_emin", "b_emin", "c")}
        return _block_matmul(a, _Fmt(a_fmt), b, _Fmt(b_fmt), f, rest, fn,
                             op if explicit else None)
    return fn(a, b, f, **kw)


def accum_matmul(a: torch.Tensor, b: torch.Tensor, accum, *, a_emin=None, b_emin=None,
                 a_gexp=None, b_gexp=None, c=None, a_scale=None, b_scale=None, a_fmt=None,
                 b_fmt=None, block_size=None) -> torch.Tensor:
    """a @ b (batched over broadcast leading dims) summed by the datapath ``accum``.

    Float32 result; the fused C++ kernel on CPU, the Triton kernel on CUDA (qtensor.kernels.gpu; the
    fused datapaths), the reference elsewhere (same bits). a_emin, b_emin, a_gexp, b_gexp, c,
    a_scale, b_scale: as accum_matmul_reference (the kernel's fast path takes no c: with one, its double lanes or
    group tiles run; with scale tensors the kernel computes the unscaled sums, per promotion
    interval for ``scales="promotion"``, and PyTorch applies the scales).
    """
    return _entry(_matmul, "accum_matmul", a, b, accum, a_fmt, b_fmt,
                  dict(a_emin=a_emin, b_emin=b_emin, a_gexp=a_gexp, b_gexp=b_gexp, c=c,
                       a_scale=a_scale, b_scale=b_scale, block_size=block_size))


def _matmul(a, b, f: AccumFormat, *, a_emin=None, b_emin=None, a_gexp=None, b_gexp=None,
            c=None, a_scale=None, b_scale=None, block_size=None) -> torch.Tensor:
    """accum_matmul after its operands' formats are resolved (_entry); internal callers, which
    pass the clamps of the formats they know, call it directly."""
    _check_operands(a, b, "accum_matmul")
    if a_scale is not None or b_scale is not None:
        return _scaled(_matmul, a, b, f, a_scale, b_scale,
                       dict(a_emin=a_emin, b_emin=b_emin, a_gexp=a_gexp, b_gexp=b_gexp, c=c),
                       block_size)
    kw = dict(a_emin=a_emin, b_emin=b_emin, a_gexp=a_gexp, b_gexp=b_gexp, c=c)
    if (f.stages != "fused" and a.device.type == "cpu" and _kernel_ready(a) and f.frac_bits <= 24
            and a_gexp is None and b_gexp is None and not _ops.gpu.takes(a)
            and hasattr(torch.ops.qtensor, "accum_matmul_cdna3")):
        return _cdna3_matmul(a, b, f, a_emin, b_emin, c)
    # CUDA: the kernel must first agree with the reference there (qtensor/kernels/selfcheck.py)
    if (not _kernel_ready(a) or f.stages != "fused"  # the kernels have one alignment stage
            or not selfcheck.trusted(a.device.type, "accumulator", a.device)):
        return _reference(a, b, f, **kw)
    a_emin, b_emin = _operand_emin(a, a_emin), _operand_emin(b, b_emin)
    a_emins = b_emins = None
    batch = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    M, K, N = a.shape[-2], a.shape[-1], b.shape[-1]
    B = math.prod(batch)  # not -1: a zero-size operand leaves -1 ambiguous
    G = -(-K // f.group)
    if (a_gexp is None) != (b_gexp is None) or (a_gexp is not None and f.group == 1):
        raise ValueError("accum_matmul: a_gexp and b_gexp go together, with a group format")
    if a_gexp is not None:
        a_gexp = _group_exps(a_gexp, (*batch, M, G), "a_gexp").reshape(B, M, G).to(a.device)
        b_gexp = _group_exps(b_gexp, (*batch, G, N), "b_gexp").reshape(B, G, N).to(a.device)
    if c is not None:
        c = c.float().expand(*batch, M, N).reshape(B, M, N)
    if isinstance(a_emin, torch.Tensor):  # per-element clamps (the scalar one: none)
        a_emins, a_emin = a_emin.expand(*batch, M, K).reshape(B, M, K).int(), -1000
    if isinstance(b_emin, torch.Tensor):
        b_emins, b_emin = b_emin.expand(*batch, K, N).reshape(B, K, N).int(), -1000
    a3 = a.float().expand(*batch, M, K).reshape(B, M, K)
    b3 = b.float().expand(*batch, K, N).reshape(B, K, N)
    out = _ops.kernel_ops(a3).accum_matmul(a3, b3, *op_args(f, a_emin, b_emin), a_gexp, b_gexp,
                                           c, a_emins, b_emins)
    return out.reshape(*batch, M, N)


def _cdna3_matmul(a, b, f: AccumFormat, a_emin, b_emin, c) -> torch.Tensor:
    """The CDNA3 stages on CPU: csrc/cpu/accum_cdna3.cpp (the reference's bits; frac_bits <= 24)."""
    a_emin, b_emin = _operand_emin(a, a_emin), _operand_emin(b, b_emin)
    batch = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    M, K, N = a.shape[-2], a.shape[-1], b.shape[-1]
    B = math.prod(batch)
    a_emins = b_emins = None
    if isinstance(a_emin, torch.Tensor):  # per-element clamps
        a_emins, a_emin = a_emin.expand(*batch, M, K).reshape(B, M, K).int(), -1000
    if isinstance(b_emin, torch.Tensor):
        b_emins, b_emin = b_emin.expand(*batch, K, N).reshape(B, K, N).int(), -1000
    if c is not None:
        c = c.float().expand(*batch, M, N).reshape(B, M, N)
    out = torch.ops.qtensor.accum_matmul_cdna3(
        a.float().expand(*batch, M, K).reshape(B, M, K), b.float().expand(*batch, K, N).reshape(
            B, K, N), f.stages == "cdna3_fp8", f.chunk, f.frac_bits,
        0 if f.promote is None else f.promote, a_emin, b_emin, c, a_emins, b_emins)
    return out.reshape(*batch, M, N)


# ---------------------------------------------------------------------------------------------
# Contractions of QTensor (qtensor/tensor/dispatch.py): the aten contraction ``packet`` on unwrapped,
# operand-rounded arguments, with the products summed by ``f``. The added term beta * C of
# addmm, baddbmm, addbmm, addmv and _addmm_activation, where C has the output's full shape and
# alpha == 1, is the datapath's initial accumulator; a broadcast C (a bias), alpha != 1, linear's
# bias and the activation of _addmm_activation are applied afterwards in the payload precision,
# as a GEMM epilogue does.

def _f32(x: torch.Tensor, packet: str) -> torch.Tensor:
    if x.dtype == torch.float64:
        y = x.float()
        if not torch.equal(y.double(), x):
            raise TypeError(f"qt.accum: {packet} with an accumulator format takes float32 "
                            "values; this float64 payload is not exactly float32")
        return y
    return x


def _arg(uargs, ukwargs, pos, name, default):
    return uargs[pos] if len(uargs) > pos else ukwargs.get(name, default)


def _epilogue(prod, bias, beta, alpha):
    out = prod if alpha == 1 else prod * alpha
    if bias is None or beta == 0:
        return out
    return out + (bias if beta == 1 else bias * beta)


CONTRACTIONS = ("mm", "bmm", "addmm", "_addmm_activation", "baddbmm", "addbmm", "mv", "addmv",
                "dot", "vdot", "linear", "convolution", "_convolution", "convolution_backward")


def _emin_of(x) -> Optional[int]:
    """The minimum normal exponent of an operand's input format (a QTensor's operand format: its
    mm_fmt, else its fmt), where it is one float format; None: from the payload's dtype."""
    from ..formats.core import FloatFormat
    fmt = getattr(x, "mm_fmt", None) or getattr(x, "fmt", None)
    if isinstance(fmt, FloatFormat) and fmt.subnormals:
        return max(min(fmt.emin, 127), -1000)
    return None


def _operand_block_fmt(q):
    """The block format an operand was rounded to (its QTensor's mm_fmt, else fmt), or None."""
    from ..formats.core import BlockFormat, FloatFormat
    fmt = getattr(q, "mm_fmt", None) or getattr(q, "fmt", None)
    fmt = getattr(fmt, "base", fmt)  # a per-GEMM operand tag (qtensor.tensor.gemm)
    if (isinstance(fmt, BlockFormat) and fmt.block_size and isinstance(fmt.elem, FloatFormat)
            and getattr(fmt, "block_shape", None) is None):  # 2D tiles: scales are not runs along K
        return fmt
    return None


def _payload_sources(q, x: torch.Tensor):
    """Where dispatch rounded the operand x from the payload of its QTensor q (q has an operand
    format, mm_fmt): the payload, or its transpose for a 2-D x (linear's weight.t()), as
    candidates of x's shape (the caller checks that rounding one gives x)."""
    data = getattr(q, "_data", None)
    if getattr(q, "mm_fmt", None) is None or not isinstance(data, torch.Tensor):
        return []
    out = [data] if data.shape == x.shape else []
    if data.dim() == 2 and data.t().shape == x.shape:
        out.append(data.t())
    return out


def _block_scales(x: torch.Tensor, fmt, kdim: int, need: str = "value", q=None):
    """The block scales of x, whose values were rounded to the block format fmt along kdim,
    recovered from the values: (X, ts), X the scale-format factor of each block (float64, x's
    shape with kdim cut into blocks), ts the per-tensor scale (a 0-dim float64 tensor; 1.0
    without tensor_scale); None where no scale, or more than one, gives x back exactly (x / (X *
    ts) elements of the element format). need: ``"value"`` (X itself is used: promotion) or
    ``"exponent"`` (only floor(log2 X): group exponents, clamps), which decides when two
    decompositions of a block are a real ambiguity.

    Each rule's scale of the rounded block, derived again from its own maximum rmax
    (docs/formats.md, idempotence; docs/accum.md lists what each rule allows):
    - floor, even: 2^(floor(log2 rmax) - emax_elem) (even's round-half-up of the max never moves
      a value of the element grid, and the quantizer settles a block on the scale of its
      rounded max), clamped to the scale format as the quantizer clamps it;
    - amax (NVFP4, FP32 scales on amax_scale_format's grid) and ceil with mantissa bits: the
      scale format's rounding of rmax / max_elem (the quantizer settles each block on it);
      NVFP4's tensor scale from the rounded tensor's maximum (max_elem * max_scale * ts);
    - ceil with power-of-two scales: the smallest 2^k with rmax / 2^k <= max_elem; a block whose
      rounded max is max_elem * 2^k came from 2^k or from 2^(k+1) (max_elem / 2 is on the
      grid, and the quantizer keeps the scale of the unrounded max): two candidates;
    - 4over6: the amax-rule scales mapping rmax to 6 and to 4: two candidates.
    Of two candidates the one whose elements are exact is the scale; where both are (a block of
    elements on both grids) and they differ in what ``need`` uses, the block is ambiguous: None;
    except for ceil, where q (x's QTensor) gives the payload x was rounded from and rounding it
    again gives x: then the scale of its unrounded blocks, the quantizer's own.
    """
    from ..kernels.reference import scale_candidates
    compiling = torch.compiler.is_compiling()  # no data-dependent branch in a graph
    if fmt is None or x.numel() == 0:
        return None
    if fmt.tensor_scale:
        # values fl32(e * X * s): s the tensor scale the QTensor carries (else TE's of x's
        # amax); the block scales are those of the payloads e * X, a one-level format's values
        s = _two_level_scale(x, fmt, q)
        got = None if compiling else _two_level_source_scales(x, fmt, kdim, s, q)
        if got is not None:
            return got
        p = _unscaled(x, s, fmt)
        if fmt.scale_rule == "amax" and not fmt.settle and not compiling:
            got = _te_block_scales(p, fmt, kdim)
        else:
            got = _block_scales(p, fmt.replace(tensor_scale=False, settle=False), kdim, need)
        return None if got is None else (got[0], s.double())
    bs = fmt.block_size
    d = kdim % x.dim()
    xk = x.float()
    K = xk.shape[d]
    if K % bs:
        xk = torch.nn.functional.pad(xk, (0, 0) * (x.dim() - 1 - d) + (0, -K % bs))
    # in x's own layout (a reduction over a middle dim runs in vectors; no copy of x)
    blocks = xk.unflatten(d, (-1, bs))
    r = d + 1  # the dim of a block's elements
    amax = blocks.abs().amax(r).double()  # exact (float32 values)
    if not compiling and not torch.isfinite(amax).all():  # inf or NaN in some block
        return None
    ts = torch.ones((), dtype=torch.float64, device=x.device)
    cands = [c(amax) for c in scale_candidates(fmt)]
    if fmt.scale_rule == "ceil" and fmt.power_of_two_scales:  # rmax = max_elem * 2^k
        X = cands[0]
        cands.append(torch.where((amax == fmt.elem.max * X) & (X < 2.0 ** fmt.scale.emax),
                                 2 * X, X))
    cands = [torch.where(amax == 0, 1.0, X) for X in cands]  # all-zero block: any scale
    if compiling and len(cands) == 1:  # (no data-dependent branch in a graph: unchecked)
        return cands[0], ts
    if compiling and fmt.scale_rule == "ceil":  # RCEIL's ambiguity needs a branch: values
        return None

    def exact(X, per_block):  # the elements x / Xt round to themselves, e * Xt is exact
        Xt = (X * ts).float().unsqueeze(r)
        pos = Xt > 0  # (a candidate's scale can round to 0: not a scale of a nonzero block)
        if not per_block:
            if not bool(pos.all()):
                return False
            inv = fmt.power_of_two_scales  # (1 / 2^k: exact in float32 for E8M0's range)
            e = _ops.quantize(blocks * (1 / Xt) if inv else blocks / Xt, fmt.elem,
                              rounding="nearest")
            return torch.equal(e * Xt, blocks)
        e = _ops.quantize(blocks / torch.where(pos, Xt, 1.0), fmt.elem, rounding="nearest")
        return ((e * Xt == blocks) & pos).all(r)
    if len(cands) == 1:
        return (cands[0], ts) if exact(cands[0], False) else None
    (X1, X2) = cands
    v1, v2 = exact(X1, True), exact(X2, True)
    if compiling:  # 4over6 in a graph: the exact candidate per block (ties: the first, 6)
        return torch.where(v1, X1, X2), ts
    same = (_exponent(X1, None) == _exponent(X2, None)) if need == "exponent" else X1 == X2
    if not bool((v1 | v2).all()) or bool((v1 & v2 & ~same).any()):
        from ..formats.core import is_stochastic
        if fmt.scale_rule != "ceil" or is_stochastic(fmt.rounding):
            return None
        for src in _payload_sources(q, x):  # RCEIL: the unrounded payload decides
            if torch.equal(_ops.quantize(src, fmt.replace(axis=d)), x):
                s = src.float()
                if K % bs:
                    s = torch.nn.functional.pad(s, (0, 0) * (x.dim() - 1 - d) + (0, -K % bs))
                X = scale_candidates(fmt)[0](s.unflatten(d, (-1, bs)).abs().amax(r).double())
                return (X, ts) if exact(X, False) else None
        return None
    return torch.where(v1, X1, X2), ts


def _two_level_source_scales(x, fmt, kdim: int, s, q):
    """The block scales TE's rule gave x where dispatch rounded x from its QTensor q's payload
    (deterministic rounding): that payload rounded again under the same tensor scale, with its
    scales; None where no payload gives x. (From the values alone a coarse subnormal block scale
    can be ambiguous: ceil's 3 x 2q and 6 x q are one block.)"""
    from ..formats.core import is_stochastic
    from ..kernels.reference import quantize_two_level
    if is_stochastic(fmt.rounding):
        return None
    d = kdim % x.dim()
    for src in _payload_sources(q, x):
        v, s2, X = quantize_two_level(src.detach().float(), fmt.replace(axis=d), fmt.rounding,
                                      tensor_scale=s, rnd=_ops.round_scalar32,
                                      block_scales=True)
        if torch.equal(v.view(torch.int32), x.detach().float().view(torch.int32)):
            X = torch.where(X == 0, 1.0, X)[..., 0].movedim(-1, d)  # all-zero block: any scale
            return X.double(), s.double()
    return None


def _positive_values(f) -> list:
    """The positive values of a FloatFormat, largest first."""
    out = {k / 2 ** f.man * 2.0 ** f.emin for k in range(1, 2 ** f.man)} if f.subnormals else set()
    for e in range(f.emin, f.emax + 1):
        out |= {(1 + k / 2 ** f.man) * 2.0 ** e for k in range(2 ** f.man)}
    return sorted((v for v in out if v <= f.max), reverse=True)


def _te_block_scales(p: torch.Tensor, fmt, kdim: int):
    """The E4M3 block scales (float64, one per block along kdim) of payloads p = e * X of
    Transformer Engine's two-level rule (nearest, not settled), or None where no scale gives a
    block back. TE's X rounds amax / 6 (under the tensor scale) to nearest: in the normal range
    the block's max element is then 6, but a subnormal X is coarse and the max element can be
    4 or 3 (X = 2 or 1 subnormal quanta), so X is pmax / e for the largest element value e
    that gives a scale-format value whose block elements are exact (no two such candidates
    exist for TE's nearest scales: pmax / 6 is never a subnormal quantum's multiple then)."""
    bs = fmt.block_size
    d = kdim % p.dim()
    K = p.shape[d]
    if K % bs:
        p = torch.nn.functional.pad(p, (0, 0) * (p.dim() - 1 - d) + (0, -K % bs))
    blocks = p.float().unflatten(d, (-1, bs))
    r = d + 1
    pmax = blocks.abs().amax(r)
    if not bool(torch.isfinite(pmax).all()):
        return None
    sf = fmt.amax_scale_format.replace(rounding="nearest", saturate=True)
    X = torch.where(pmax == 0, 1.0, 0.0)
    found = pmax == 0
    for e in _positive_values(fmt.elem):
        Xc = pmax / e
        ok = ~found & (Xc > 0) & (_ops.quantize(Xc, sf) == Xc)
        if not bool(ok.any()):
            continue
        Xt = torch.where(ok, Xc, 1.0).unsqueeze(r)
        el = _ops.quantize(blocks / Xt, fmt.elem, rounding="nearest")
        ok &= (el * Xt == blocks).all(r)
        X = torch.where(ok, Xc, X)
        found |= ok
        if bool(found.all()):
            return X.double(), torch.ones((), dtype=torch.float64, device=p.device)
    return None


def _two_level_scale(x: torch.Tensor, fmt, q=None) -> torch.Tensor:
    """The FP32 decode tensor scale of x's values in the two-level format fmt: the one the
    QTensor q carries, else Transformer Engine's from x's amax (0-dim float32)."""
    if q is not None and getattr(q, "fmt", None) == fmt and q.tensor_scale is not None:
        return q.tensor_scale.to(x.device)
    return _ops.quantize_with_scale(x.detach().float(), fmt)[1]


def _unscaled(x: torch.Tensor, s: torch.Tensor, fmt) -> torch.Tensor:
    """x's values without the tensor scale s: the payloads e * X of a two-level format (float32
    exactly; x / s in float32 is not, s being any FP32), x itself (float32) otherwise."""
    if not fmt.tensor_scale:
        return x.float()
    from ..kernels.reference import two_level_payload
    return two_level_payload(x.float(), s, fmt).float()


def _scale_exps(X: torch.Tensor, fmt) -> torch.Tensor:
    """floor(log2 X) of block scales X in the scale format of fmt (a subnormal scale at the
    format's minimum normal exponent, as MMA-Sim's nvf4 takes E4M3 subnormal scales at -6)."""
    return _exponent(X, fmt.scale.emin if fmt.scale.subnormals else None)


def _per_element(X: torch.Tensor, bs: int, kdim: int, K: int) -> torch.Tensor:
    """Per-block values X repeated over their blocks' elements along kdim (K of them)."""
    return X.repeat_interleave(bs, kdim).narrow(kdim, 0, K)


def _mx_emin(x: torch.Tensor, q, kdim: int):
    """Per-element clamps of an MX operand (the element format's minimum normal exponent plus
    the block's scale exponent) where one of its elements is subnormal in its format, else None
    (then its float32 exponents are already the hardware's: no clamp binds)."""
    fmt = _operand_block_fmt(q)
    if fmt is None or not fmt.power_of_two_scales:
        return None
    sc = _block_scales(x, fmt, kdim, "exponent", q)
    if sc is None:
        return None
    E = _scale_exps(sc[0], fmt) + fmt.elem.emin  # per block
    d, bs = kdim % x.dim(), fmt.block_size
    if not torch.compiler.is_compiling():  # (no data-dependent branch in a graph)
        # a subnormal element: 0 < |x| < 2^E, tested per block (float32: 2^E >= 2^-149)
        xk = x.float()
        if xk.shape[d] % bs:
            xk = torch.nn.functional.pad(xk, (0, 0) * (x.dim() - 1 - d) + (0, -xk.shape[d] % bs))
        blocks = xk.unflatten(d, (-1, bs)).abs()
        if not ((blocks < _pow2(E).float().unsqueeze(d + 1)) & (blocks != 0)).any():
            return None
    return _per_element(E, bs, d, x.shape[d])


def _scale_plan(f: AccumFormat, a, qa, b, qb, a_kdim=-1, b_kdim=-2):
    """How the block scales of the operands a, b (rounded to the block formats of the QTensors
    qa, qb along their K dims) reach accum_matmul, where the datapath applies them: (a, b, kw,
    post), accum_matmul(a, b, f, **kw) * post (post: None, or the float32 product of the two
    per-tensor scales, cuBLASLt's alpha).
    - scales="instruction" with groups (blackwell_mxfp4/nvfp4) and both operands block-scaled
      (MX or NVFP4, blocks a multiple of the group): the group exponents of the scales
      (a_gexp/b_gexp); NVFP4's per-tensor scales are divided out of the operands (exactly) and
      multiplied into the result (post), as the hardware takes the E4M3 block scales only;
    - scales="instruction" without groups (blackwell_mxf8f6f4): per-element clamps of MX
      operands (a_emin/b_emin), where a subnormal element makes them bind;
    - scales="promotion" (Hopper FP8 per-block scaling) with both operands' blocks equal to the
      promotion interval (chunk * promote): the elements and their block scales (times the
      tensor scale) as a_scale/b_scale;
    else none: the values carry their scales (each group aligned at its own sum's exponent)."""
    kw, post = {}, None
    fa, fb = _operand_block_fmt(qa), _operand_block_fmt(qb)
    if f.scales == "instruction" and f.group == 1:
        ea, eb = _mx_emin(a, qa, a_kdim), _mx_emin(b, qb, b_kdim)
        if ea is not None:
            kw["a_emin"] = ea
        if eb is not None:
            kw["b_emin"] = eb
        return a, b, kw, post
    if fa is None or fb is None:
        return a, b, kw, post
    if f.scales == "instruction":
        if fa.block_size % f.group or fb.block_size % f.group:
            return a, b, kw, post
        sa = _block_scales(a, fa, a_kdim, "exponent", qa)
        sb = _block_scales(b, fb, b_kdim, "exponent", qb) if sa is not None else None
        if sb is None:
            return a, b, kw, post
        G = -(-a.shape[a_kdim] // f.group)
        kw["a_gexp"] = _scale_exps(sa[0], fa).repeat_interleave(
            fa.block_size // f.group, a_kdim).narrow(a_kdim, 0, G)
        kw["b_gexp"] = _scale_exps(sb[0], fb).repeat_interleave(
            fb.block_size // f.group, b_kdim).narrow(b_kdim, 0, G)
        if fa.tensor_scale or fb.tensor_scale:  # the tensor scales in the epilogue (alpha)
            a, b = _unscaled(a, sa[1], fa), _unscaled(b, sb[1], fb)
            post = sa[1].float() * sb[1].float()
        return a, b, kw, post
    if f.scales == "promotion":
        blk = f.chunk * f.promote
        if fa.block_size != blk or fb.block_size != blk:
            return a, b, kw, post
        sa, sb = _block_scales(a, fa, a_kdim, "value", qa), _block_scales(b, fb, b_kdim,
                                                                        "value", qb)
        if sa is None or sb is None:
            return a, b, kw, post
        Xa, Xb = sa[0], sb[0]
        if fa.tensor_scale or fb.tensor_scale:  # the tensor scales in the epilogue (alpha)
            post = sa[1].float() * sb[1].float()
        K = a.shape[a_kdim]
        # (float32 division: exact, the quotients are the elements)
        a = _unscaled(a, sa[1], fa) / _per_element(Xa.float(), blk, a_kdim % a.dim(), K)
        b = _unscaled(b, sb[1], fb) / _per_element(Xb.float(), blk, b_kdim % b.dim(), K)
        kw = dict(a_scale=Xa.float(), b_scale=Xb.float(), a_emin=fa.elem.emin,
                  b_emin=fb.elem.emin)
    return a, b, kw, post


def _gexps(f: AccumFormat, a, qa, b, qb, a_kdim=-1, b_kdim=-2) -> dict:
    """The accum_matmul keywords of _scale_plan where it leaves the operands as they are."""
    _, _, kw, post = _scale_plan(f, a, qa, b, qb, a_kdim, b_kdim)
    return kw if post is None and "a_scale" not in kw else {}


def _block_matmul(a, qa, b, qb, f: AccumFormat, kw: dict, fn=None, op=None) -> torch.Tensor:
    """fn(a, b, f, **kw) (fn: _matmul, the default, or _reference) with the operands' block
    scales where f applies them (_scale_plan; a is (..., M, K), b (..., K, N)). op (a public
    entry's name): refuse where a group preset gets no group exponents from the formats."""
    a2, b2, extra, post = _scale_plan(f, a, qa, b, qb)
    if op is not None and f.group > 1 and "a_gexp" not in extra:
        raise ValueError(
            f"{op}: {f.name or f} aligns each group of {f.group} products at its block scales' "
            f"exponents, which these operands do not give (both must be block-scaled along K, "
            f"blocks a multiple of {f.group}, each block's scale recoverable from its values): "
            f"a_fmt={_operand_block_fmt(qa)}, b_fmt={_operand_block_fmt(qb)}; pass the "
            f"elements with a_scale/b_scale instead")
    if "a_scale" in extra or post is not None:
        kw = {k: v for k, v in kw.items() if k not in ("a_emin", "b_emin")}
        if post is not None and kw.get("c") is not None:
            # the datapath sums unscaled products, alpha = post scales its result: an initial
            # accumulator C enters as fp32(C / alpha), so that alpha * D is C + A @ B
            kw["c"] = kw["c"].float() / post
    out = (fn or _matmul)(a2, b2, f, **{**kw, **extra})
    return out if post is None else out * post


def contract(packet: str, uargs, ukwargs, f: AccumFormat, qargs=None) -> torch.Tensor:
    """The contraction ``packet`` (an aten op name) summed by ``f``; the payload dtype out.

    qargs: the op's original arguments (QTensors among them), whose formats give each operand's
    minimum normal exponent (MMA-Sim aligns a subnormal operand there)."""
    if packet not in CONTRACTIONS:
        raise NotImplementedError(
            f"qt.accum: {packet} has no accumulator emulation (supported: "
            f"{', '.join(CONTRACTIONS)}; matmul, einsum, F.linear, F.conv*d and "
            "F.conv_transpose*d decompose into these); drop the QTensor's .accum (or the "
            "Recipe's accumulate=) for it")
    q = list(qargs) if qargs is not None else []
    em = [_emin_of(q[i]) if i < len(q) else None for i in range(3)]
    qq = q + [None] * (3 - len(q))
    if packet in ("convolution", "_convolution"):
        return _conv_forward(uargs, ukwargs, f, em, qq)
    if packet == "convolution_backward":
        return _conv_backward(uargs, ukwargs, f, em, qq)
    out = ukwargs.get("out")
    ukwargs = {k: v for k, v in ukwargs.items() if k != "out"}
    t = [_f32(x, packet) if isinstance(x, torch.Tensor) else x for x in uargs]
    dtype = next(x.dtype for x in uargs if isinstance(x, torch.Tensor))
    e01 = dict(a_emin=em[0], b_emin=em[1])
    if packet in ("mm", "bmm"):
        res = _block_matmul(t[0], qq[0], t[1], qq[1], f, e01)
    elif packet in ("dot", "vdot"):
        res = _matmul(t[0][None], t[1][:, None], f, **e01)[0, 0]
    elif packet == "mv":
        res = _matmul(t[0], t[1][:, None], f, **e01)[:, 0]
    elif packet == "linear":
        x, w = t[0], t[1]
        bias = _arg(t, ukwargs, 2, "bias", None)
        x2 = x[None] if x.dim() == 1 else x
        res = _block_matmul(x2, qq[0], w.t(), qq[1], f, e01)
        res = _epilogue(res[0] if x.dim() == 1 else res, bias, 1, 1)
    else:  # an added term: (self, mat1, mat2, *, beta, alpha)
        bias, a, b = t[0], t[1], t[2]
        beta = _arg(t, ukwargs, 3, "beta", 1)
        alpha = _arg(t, ukwargs, 4, "alpha", 1)
        e12 = dict(a_emin=em[1], b_emin=em[2])
        # a C of the output's full shape is an accumulator: beta * C (rounded to float32 once)
        # is the first instruction's accumulator input (an mma's C operand). A broadcast C (a
        # bias: nn.Linear's addmm) and alpha != 1 stay in the epilogue (cuBLASLt's bias epilogue)
        oshape = (a.shape[0],) if packet == "addmv" else (
            (a.shape[1], b.shape[2]) if packet == "addbmm" else (*a.shape[:-1], b.shape[-1]))
        # (the ranks first: a tuple == compares items first, a guard on a dynamic batch size)
        fed = (alpha == 1 and beta != 0 and isinstance(bias, torch.Tensor)
               and bias.dim() == len(oshape) and tuple(bias.shape) == oshape)
        if fed:
            c = (bias if beta == 1 else bias * beta).float()
            e12["c"] = c[:, None] if packet == "addmv" else c
        if packet == "addmv":
            prod = _matmul(a, b[:, None], f, **e12)[:, 0]
        elif packet == "addbmm":  # the sum over the batch is one longer contraction
            B, M, K = a.shape
            prod = _matmul(a.transpose(0, 1).reshape(M, B * K), b.reshape(B * K, -1), f,
                                **e12)
        else:
            prod = _block_matmul(a, qq[1], b, qq[2], f, e12)
        res = prod if fed else _epilogue(prod, bias, beta, alpha)
        if packet == "_addmm_activation":  # ATen's GELU: exact on CPU, tanh (cuBLASLt) on CUDA
            gelu = _arg(t, ukwargs, 5, "use_gelu", False)
            approx = "tanh" if res.is_cuda else "none"
            res = (torch.nn.functional.gelu(res, approximate=approx) if gelu
                   else torch.relu(res))
    res = res.to(dtype)
    if out is not None:
        return out.copy_(res)
    return res


# ---------------------------------------------------------------------------------------------
# Convolutions as GEMMs: 1-, 2- and 3-D, grouped (a batched GEMM over the groups), transposed.
# K orders, as implicit-GEMM kernels run them on channels-last data:
# - forward: (kernel position, input channel of the group), channels innermost (as dispatch
#   blocks MX operands: along channels); padding zeros take their K slots. CUTLASS takes the
#   channels in threadblock-tile blocks outside the kernel-position loop: the same order while
#   C/groups fits one tile.
# - transposed forward and grad_input: the forward convolution over the input with (stride - 1)
#   zeros inserted between its elements, padded by dilation*(kernel-1)-padding (cropped where
#   negative), the kernel flipped and its channel dims swapped: K = (flipped kernel position,
#   channel), as CUTLASS's unity-stride and 3-D strided dgrad iterate it, the inserted zeros
#   loaded as zeros. Zero products move no alignment but take K slots, so they decide which
#   products share an instruction: CUTLASS's 2-D strided dgrad skips them, and ATen's col2im
#   path (a GEMM over channels only, the kernel positions added in float32) sums differently.
# - grad_weight: (batch, output position); (output position, batch) where both operands are
#   block-scaled along the batch (their blocks then are runs of K: _conv_weight_grad).

def _tup(v, nd):
    """A geometry argument (an int, or a list of 1 or nd ints) as nd ints."""
    v = [v] if isinstance(v, int) else list(v)
    return tuple(v * nd) if len(v) == 1 else tuple(v)


def _geometry(stride, padding, dilation, groups, nd):
    """The conv geometry (stride, padding, dilation as nd ints each, groups) of aten's args."""
    return _tup(stride, nd), _tup(padding, nd), _tup(dilation, nd), groups


def _pad(x, pads):
    """x (N, C, *S) zero-padded by (lo, hi) per spatial dim; negative amounts crop."""
    return torch.nn.functional.pad(x, [p for lo_hi in reversed(pads) for p in lo_hi])


def _cols(xp, k, stride, dilation, groups, size):
    """(N, groups, L, P*C/groups): the windows of the padded input xp (N, C, *S) under the
    first ``size`` output positions (L of them), each window in K order (P kernel positions)."""
    for i, (kk, s, d) in enumerate(zip(k, stride, dilation)):
        xp = xp.unfold(2 + i, d * (kk - 1) + 1, s).narrow(2 + i, 0, size[i])
    win = xp[(..., *(slice(None, None, d) for d in dilation))]  # (N, C, *size, *k)
    N, C = win.shape[:2]
    L, P = math.prod(size), math.prod(k)
    win = win.reshape(N, groups, C // groups, L, P).permute(0, 1, 3, 4, 2)
    return win.reshape(N, groups, L, P * (C // groups))


def _conv_operand_scales(f: AccumFormat, n: int, ops):
    """The block scales of a convolution GEMM's operands for the datapath f, each K-group of n
    (f.group, or the promotion interval) inside one block of each operand: ops is two (t, q,
    dim, to) (the a side, then the b side): t the operand's values in their own layout, rounded
    by the block format of the QTensor q along dim (the blocks' own partition: along a conv's
    global channel dim they may cross conv groups), ``to`` maps a t-shaped tensor to the GEMM
    operand (a: (g, M, K), b: (g, K, N)). The caller has checked that the GEMM's K-groups of n
    lie in runs of one block (K = ..., dim innermost in runs of a multiple of n, and the blocks
    a multiple of n). (ts_a, ts_b, per-element X of a, of b, fa, fb) or None."""
    out = []
    for t, q, dim, to in ops:
        fmt = _operand_block_fmt(q)
        if fmt is None or fmt.block_size % n:
            return None
        sc = _block_scales(t, fmt, dim, "exponent" if f.scales == "instruction" else "value",
                           q)
        if sc is None:
            return None
        out.append((sc[1], _per_element(sc[0], fmt.block_size, dim, t.shape[dim]), fmt))
    (ta, Xa, fa), (tb, Xb, fb) = out
    return ta, tb, Xa, Xb, fa, fb


def _conv_scale_plan(f: AccumFormat, n_ok, ops):
    """_scale_plan for a convolution's GEMM; ops: two (t, q, dim, to) as _conv_operand_scales
    takes them; n_ok(n): whether the GEMM's K runs along the blocked dims in runs of a multiple
    of n (K-groups of n inside one kernel position / one output position). Returns the two
    operands' values (their own layouts: unscaled where the scales travel separately), the
    accum_matmul keywords and post (the per-tensor scales' product, or None)."""
    (a, qa, da, to_a), (b, qb, db, to_b) = ops
    kw, post = {}, None
    if f.scales == "instruction" and f.group == 1:  # per-element clamps of MX operands
        ea, eb = _mx_emin(a, qa, da), _mx_emin(b, qb, db)
        if ea is not None:
            kw["a_emin"] = to_a(ea)
        if eb is not None:
            kw["b_emin"] = to_b(eb)
        return a, b, kw, post
    n = f.group if f.scales == "instruction" else (
        f.chunk * f.promote if f.scales == "promotion" else 0)
    if not n or not n_ok(n):
        return a, b, kw, post
    sc = _conv_operand_scales(f, n, ops)
    if sc is None:
        return a, b, kw, post
    ta, tb, Xa, Xb, fa, fb = sc
    if f.scales == "instruction":
        kw["a_gexp"] = to_a(_scale_exps(Xa, fa))[..., ::n]
        kw["b_gexp"] = to_b(_scale_exps(Xb, fb))[..., ::n, :]
        if fa.tensor_scale or fb.tensor_scale:  # the tensor scales in the epilogue (alpha)
            a, b = _unscaled(a, ta, fa), _unscaled(b, tb, fb)
            post = ta.float() * tb.float()
        return a, b, kw, post
    if fa.tensor_scale or fb.tensor_scale:
        post = ta.float() * tb.float()
    # promotion: unscaled elements, a scale per K-block
    kw = dict(a_scale=to_a(Xa)[..., ::n].float(), b_scale=to_b(Xb)[..., ::n, :].float(),
              a_emin=fa.elem.emin, b_emin=fb.elem.emin)
    return (_unscaled(a, ta, fa) / Xa.float(), _unscaled(b, tb, fb) / Xb.float(), kw,
            post)  # (exact)


def _gemm_conv(xp, w, stride, dilation, groups, size, f, em=(None, None), q=(None, None),
               wsrc=None):
    """The forward convolution of the padded xp with w (O, C/groups, *k): (N, O, *size).
    q: the QTensors of (x, w) (their block formats: _conv_scale_plan); wsrc: (w0, dim, wmap)
    where w is wmap(w0) of a weight w0 blocked along its dim (a transposed convolution's
    regrouped, flipped kernel), else w is blocked along its dim 1."""
    (O, Cg, *k), N, L = w.shape, xp.shape[0], math.prod(size)
    K = math.prod(k) * Cg
    w0, wdim, wmap = wsrc if wsrc is not None else (w, 1, lambda t: t)

    def to_b(t):  # (N, C, *S) -> (groups, K, N * L): one GEMM per group
        cols = _cols(t, k, stride, dilation, groups, size)  # (N, g, L, K)
        return cols.permute(1, 3, 0, 2).reshape(groups, K, N * L)

    def to_a(t):  # (O, C/groups, *k) -> (groups, O/groups, K)
        return t.reshape(groups, O // groups, Cg, -1).transpose(2, 3).reshape(
            groups, O // groups, K)

    # K = (kernel position, channel of the group): a K-group of n lies in one position where
    # the group's channels are a multiple of n; the blocks (a multiple of n, from a multiple of
    # n: a group starts at g * Cg) then hold whole K-groups, also where they cross conv groups
    w0, xp, kw, post = _conv_scale_plan(
        f, lambda n: Cg % n == 0,
        ((w0, q[1], wdim, lambda t: to_a(wmap(t))), (xp, q[0], 1, to_b)))
    w = wmap(w0)
    out = _matmul(to_a(w), to_b(xp), f, **{"a_emin": em[1], "b_emin": em[0], **kw})
    if post is not None:
        out = out * post
    out = out.reshape(groups, O // groups, N, L)
    return out.permute(2, 0, 1, 3).reshape(N, O, *size)


def _conv(x, w, geo, size, f, em=(None, None), q=(None, None)):
    """em: the minimum normal exponents of (x, w); q: their QTensors (block formats)."""
    stride, padding, dilation, groups = geo
    return _gemm_conv(_pad(x, [(p, p) for p in padding]), w, stride, dilation, groups, size, f,
                      em, q)


def _conv_transpose(x, w, geo, size, f, em=(None, None), q=(None, None)):
    """The transposed convolution of x (N, C, *S) with w (C, O/groups, *k) to spatial ``size``,
    as the forward convolution over the zero-inserted x (the section comment). w's blocks run
    along its dim 0 (C, across the groups), as dispatch rounds it."""
    stride, padding, dilation, groups = geo
    N, C, *S = x.shape
    k = w.shape[2:]
    z = x.new_zeros(N, C, *((n - 1) * s + 1 for n, s in zip(S, stride)))
    z[(..., *(slice(None, None, s) for s in stride))] = x
    pads = []
    for i, (kk, d) in enumerate(zip(k, dilation)):
        lo = d * (kk - 1) - padding[i]
        pads.append((lo, size[i] + d * (kk - 1) - z.shape[2 + i] - lo))

    def wmap(t):  # (C, O/groups, *k) -> (O, C/groups, *k), flipped
        t = t.unflatten(0, (groups, -1)).transpose(1, 2).flatten(0, 1)
        return t.flip(list(range(2, t.dim())))
    return _gemm_conv(_pad(z, pads), wmap(w), (1,) * len(k), dilation, groups, size, f, em, q,
                      wsrc=(w, 0, wmap))


def _conv_weight_grad(x, go, k, geo, f, em=(None, None), q=(None, None)):
    """The weight gradient (O, C/groups, *k) of the forward convolution of x (N, C, *S) whose
    output gradient is go (N, O, *So): a contraction over (batch, output position). q: the
    QTensors of (x, go), blocked along the batch (dispatch's axis 0 for grad_weight): where
    both are block-scaled for the datapath's K-group / interval of n (1 for the per-element
    clamps of MX operands; the batch and the blocks a multiple of n), K runs (output position,
    batch) instead, the batch innermost, so that each block is a run of K, as a block-scaled
    instruction takes its scales (in batch-outer order a block's elements lie L apart), and the
    scales go with it."""
    stride, padding, dilation, groups = geo
    (N, O, *size), Cg = go.shape, x.shape[1] // groups
    L, P = math.prod(size), math.prod(k)
    xp = _pad(x, [(p, p) for p in padding])

    def to_b(t, batch_inner):  # (N, C, *S) -> (groups, K, P * Cg)
        cols = _cols(t, k, stride, dilation, groups, size)  # (N, g, L, P * Cg)
        cols = cols.permute(1, 2, 0, 3) if batch_inner else cols.transpose(0, 1)
        return cols.reshape(groups, N * L, P * Cg)

    def to_a(t, batch_inner):  # (N, O, *So) -> (groups, O/groups, K)
        t = t.reshape(N, groups, O // groups, L)
        t = t.permute(1, 2, 3, 0) if batch_inner else t.permute(1, 2, 0, 3)
        return t.reshape(groups, O // groups, N * L)

    def n_ok(n):
        return N % n == 0
    inner = f.scales in ("instruction", "promotion") and _conv_operand_block_fits(
        f, n_ok, (q[1], q[0]))
    go, xp, kw, post = _conv_scale_plan(
        f, n_ok if inner else (lambda n: False),
        ((go, q[1], 0, lambda t: to_a(t, inner)), (xp, q[0], 0, lambda t: to_b(t, inner))))
    out = _matmul(to_a(go, inner), to_b(xp, inner), f,
                       **{"a_emin": em[1], "b_emin": em[0], **kw})  # em: of (x, go)
    if post is not None:
        out = out * post
    return out.reshape(O, P, Cg).transpose(1, 2).reshape(O, Cg, *k)


def _conv_operand_block_fits(f: AccumFormat, n_ok, qs) -> bool:
    """Whether both operands (QTensors qs) are block-scaled with blocks of a multiple of the
    datapath's K-group / interval n, and n_ok(n)."""
    n = f.group if f.scales == "instruction" else f.chunk * f.promote  # (MX clamps: 1)
    fmts = [_operand_block_fmt(q) for q in qs]
    return n_ok(n) and all(m is not None and m.block_size % n == 0 for m in fmts)


_CONV_ARGS = ("input", "weight", "bias", "stride", "padding", "dilation", "transposed",
              "output_padding", "groups")


def _conv_forward(uargs, ukwargs, f, em=(None, None, None), q=(None, None, None)):
    x, w, bias, stride, padding, dilation, transposed, output_padding, groups = (
        _arg(uargs, ukwargs, i, n, None) for i, n in enumerate(_CONV_ARGS))
    # torch's own checks (channels, groups, sizes) and output size, on an empty batch
    size = torch.ops.aten.convolution(x[:0], w, None, stride, padding, dilation, transposed,
                                      output_padding, groups).shape[2:]
    nd = w.dim() - 2
    geo = _geometry(stride, padding, dilation, groups, nd)
    x32, w32 = _f32(x, "convolution"), _f32(w, "convolution")
    out = (_conv_transpose if transposed else _conv)(x32, w32, geo, size, f, (em[0], em[1]),
                                                     (q[0], q[1]))
    if bias is not None:
        out = out + bias.view(-1, *[1] * nd)
    return out.to(x.dtype)


def _conv_backward(uargs, ukwargs, f, em=(None, None, None), q=(None, None, None)):
    (go, x, w, _bias_sizes, stride, padding, dilation, transposed, _output_padding, groups,
     mask) = uargs[:11]
    nd = w.dim() - 2
    geo = _geometry(stride, padding, dilation, groups, nd)
    go32, x32, w32 = (_f32(t, "convolution_backward") for t in (go, x, w))
    gi = gw = gb = None
    if mask[0]:  # the adjoint of the forward map: a transposed convolution, or the converse
        gi = (_conv if transposed else _conv_transpose)(go32, w32, geo, x.shape[2:], f,
                                                        (em[0], em[2]), (q[0], q[2]))
        gi = gi.to(go.dtype)
    if mask[1]:  # a transposed convolution's weight is that of the forward map go -> x
        a, b = (go32, x32) if transposed else (x32, go32)
        eab = (em[0], em[1]) if transposed else (em[1], em[0])
        qab = (q[0], q[1]) if transposed else (q[1], q[0])
        gw = _conv_weight_grad(a, b, w.shape[2:], geo, f, eab, qab).to(go.dtype)
    if mask[2]:  # grad_bias: a sum of grad_output values, not a contraction
        gb = go.sum([0, *range(2, go.dim())])
    return (gi, gw, gb)


def as_accum(spec, what: str = "accumulate") -> Optional[AccumFormat]:
    """None, an AccumFormat or a preset name (``"hopper_fp8"``) as an AccumFormat (or None)."""
    if spec is None or isinstance(spec, AccumFormat):
        return spec
    if isinstance(spec, str):
        return _check_accum(spec)
    raise TypeError(f"{what} must be an AccumFormat, a preset name of qt.accum.PRESETS "
                    f"({', '.join(PRESETS)}) or None, got {spec!r}")
