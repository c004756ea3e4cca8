"""Hardware-faithful accumulation: what a matrix-multiply unit does with the products.

Elsewhere a contraction rounds its operands and accumulates in float32. Tensor cores do not: one
MMA instruction aligns the products of ``chunk`` K-elements (and the running partial sum) to the
largest exponent, keeps ``frac_bits`` fractional bits of each, and normalizes the sum to an
accumulator format; libraries add that partial sum into an FP32 accumulator every ``promote``
instructions. :class:`AccumFormat` describes such a datapath (presets from Volta to Blackwell);
:func:`accum_matmul` computes a matrix product with it (fused C++ kernel), bit for bit equal to
:func:`accum_matmul_reference`, the pure-PyTorch statement of the model (MMA-Sim's
``fused_dot_add``), in which every step is exact in float64.

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

from . import ops as _ops
from . import selfcheck

__all__ = ["AccumFormat", "AccumFormatError", "accum_matmul", "accum_matmul_reference",
           "as_accum", "contract", "PRESETS", "ALIGN_ROUNDINGS", "ACC_ROUNDINGS"]

ALIGN_ROUNDINGS = ("toward_zero", "floor", "nearest")  # nearest: ties to even
ACC_ROUNDINGS = ("toward_zero", "nearest")
_ROUND_CODE = {"toward_zero": 0, "floor": 1, "nearest": 2}
_EXP_MIN = -126          # float32's minimum normal exponent: the clamp of e(x)
_ZERO_EXP = -100000      # the alignment exponent of a zero term: below every real one


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
    """

    chunk: int
    frac_bits: int
    align_rounding: str = "toward_zero"
    acc_in_alignment: bool = True
    acc_man: int = 23
    acc_rounding: str = "toward_zero"
    promote: Optional[int] = None
    group: int = 1
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
        parts.append(f"promote={self.promote}")
        body = f"AccumFormat({', '.join(parts)})"
        return f"{self.name}: {body}" if self.name else body

    __repr__ = __str__


# ---------------------------------------------------------------------------------------------
# Presets. Sources: MMA-Sim (microsoft/MMA-Sim, mmasim/simulator/nv.py: arch_accum_fractional_bits
# Volta 23, Turing/Ampere/Ada 24, Hopper/Blackwell 25; FP8 on Hopper (wgmma) and Ada: 13
# fractional bits and an output truncated to e8m13; kind::mxf4: 35 bits, 16-product groups;
# split-k halves of Ampere's m16n8k16; every normalization truncates), arXiv 2511.10909, and the
# DeepSeek-V3 report, sec. 3.5.2 (Hopper FP8 keeps ~14 bits; promotion to FP32 every 128
# elements = 4 WGMMAs, CUTLASS's default interval). Instruction K: PTX ISA (mma.m8n8k4 on Volta,
# wgmma k16 for f16/bf16 and k32 for FP8, tcgen05 kind::mxf4 k64).
def _preset(name, **kw):
    return AccumFormat(name=name, **kw)


PRESETS = {p.name: p for p in (
    _preset("volta_fp16", chunk=4, frac_bits=23),                         # mma.m8n8k4
    _preset("ampere_fp16", chunk=8, frac_bits=24),  # m16n8k16 runs as two k8 halves (MMA-Sim)
    _preset("ampere_bf16", chunk=8, frac_bits=24),
    _preset("hopper_fp16", chunk=16, frac_bits=25),                       # wgmma k16
    _preset("hopper_bf16", chunk=16, frac_bits=25),
    # wgmma k32 e4m3/e5m2, 13 fractional bits, result truncated to e8m13; CUTLASS promotes the
    # partial into FP32 every 4 instructions (128 K-elements; DeepSeek-V3 sec. 3.5.2)
    _preset("hopper_fp8", chunk=32, frac_bits=13, acc_man=13, promote=4),
    # the same without promotion ("fast accumulation": the whole K in the tensor core)
    _preset("hopper_fp8_fast", chunk=32, frac_bits=13, acc_man=13),
    _preset("blackwell_fp16", chunk=16, frac_bits=25),                    # tcgen05 k16
    _preset("blackwell_bf16", chunk=16, frac_bits=25),
    # tcgen05 kind::mxf4 k64: groups of 16 FP4 products summed exactly, scaled, fused with 35
    # bits. Approximate: see the module doc (alignment by the group sum's own exponent)
    _preset("blackwell_mxfp4", chunk=64, frac_bits=35, group=16),
    # NVFP4 (kind::mxf4nvf4, 16-element blocks, E4M3 scales): MMA-Sim uses the same 35-bit path;
    # same approximation as above
    _preset("blackwell_nvfp4", chunk=64, frac_bits=35, group=16),
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
        if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise TypeError(f"{op}: {n} has dtype {x.dtype}; the accumulator model takes "
                            "float32, float16 or bfloat16 values (float32 carriers)")
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


def _exponent(x: torch.Tensor, clamp: bool) -> torch.Tensor:
    """floor(log2|x|) (clamped below at -126 if clamp); _ZERO_EXP for zeros. x float64."""
    e = torch.frexp(x).exponent.to(torch.int64) - 1
    if clamp:
        e = e.clamp(min=_EXP_MIN)
    return torch.where(x == 0, _ZERO_EXP, e)


def _round(x: torch.Tensor, mode: str) -> torch.Tensor:
    if mode == "toward_zero":
        return torch.trunc(x)
    if mode == "floor":
        return torch.floor(x)
    return torch.round(x)  # ties to even


def _to_acc(v: torch.Tensor, f: AccumFormat) -> torch.Tensor:
    """Step 4: the exact float64 value v rounded to the accumulator format (float64 out)."""
    q = _pow2(_exponent(v, clamp=True).clamp(min=_EXP_MIN) - f.acc_man)
    r = _round(v / q, f.acc_rounding) * q + 0.0  # + 0.0: a zero result is +0
    return torch.where(r.abs() >= 2.0 ** 128, r.sign() * math.inf, r)


def _nonfinite(t: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """The IEEE result of a chunk with a non-finite term (t: terms along dim -2, p: partial)."""
    nan = torch.isnan(t).any(-2) | torch.isnan(p)
    pos = (t == math.inf).any(-2) | (p == math.inf)
    neg = (t == -math.inf).any(-2) | (p == -math.inf)
    out = torch.where(pos, math.inf, -math.inf)
    return torch.where(nan | (pos & neg), math.nan, out).to(t.dtype)


def accum_matmul_reference(a: torch.Tensor, b: torch.Tensor, accum) -> torch.Tensor:
    """a @ b (batched over leading dims) with the accumulator ``accum``: float32 out.

    The statement of the model (module doc); the compiled kernel gives the same bits.
    """
    f = _check_accum(accum)
    _check_operands(a, b, "accum_matmul_reference")
    batch = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    M, K, N = a.shape[-2], a.shape[-1], b.shape[-1]
    a = a.float().expand(*batch, M, K).double()
    b = b.float().expand(*batch, K, N).double()
    ea = _exponent(a, clamp=True)
    eb = _exponent(b, clamp=True)
    shape = (*batch, M, N)
    acc = torch.zeros(shape, dtype=torch.float32, device=a.device)   # the FP32 accumulator
    p = torch.zeros(shape, dtype=torch.float64, device=a.device)     # the instruction partial
    F = f.frac_bits
    for c, k0 in enumerate(range(0, K, f.chunk)):
        k1 = min(k0 + f.chunk, K)
        # 1. the exact products, (..., M, k, N), and their alignment exponents e(a) + e(b)
        t = a[..., :, k0:k1, None] * b[..., None, k0:k1, :]
        et = ea[..., :, k0:k1, None] + eb[..., None, k0:k1, :]
        if f.group > 1:  # exact group sums (sequential float64 adds, exact for FP4 operands)
            k = k1 - k0
            g = -(-k // f.group) * f.group
            if g != k:
                t = torch.nn.functional.pad(t, (0, 0, 0, g - k))
            t = t.unflatten(-2, (g // f.group, f.group))
            s = t[..., 0, :]
            for j in range(1, f.group):
                s = s + t[..., j, :]
            t = s
            et = _exponent(t, clamp=False)
        finite = torch.isfinite(t).all(-2) & torch.isfinite(p)
        t = torch.where(finite[..., None, :], t, 0.0)
        # 2. emax over the nonzero terms (p included when it takes part in the alignment)
        emax = et.amax(-2)
        if f.acc_in_alignment:
            emax = torch.maximum(emax, _exponent(torch.where(finite, p, 0.0), clamp=True))
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
        if f.promote is not None and ((c + 1) % f.promote == 0 or k1 == K):
            acc = acc + p.float()
            p = torch.zeros_like(p)
    out = p.float() if f.promote is None else acc
    return torch.where(torch.isnan(out), math.nan, out)  # one NaN encoding


# ---------------------------------------------------------------------------------------------
# Entry point: the compiled kernel where it applies, else the reference

def _register_fake():
    if _ops._C is None or not hasattr(torch.ops.qtensor, "accum_matmul"):
        return

    @torch.library.register_fake("qtensor::accum_matmul")
    def _(a, b, *args):
        return a.new_empty((a.shape[0], a.shape[1], b.shape[2]))


_register_fake()


def _kernel_ready(a: torch.Tensor) -> bool:
    if _ops._C is None or not hasattr(torch.ops.qtensor, "accum_matmul"):
        return False
    dev = a.device.type
    return dev == "cpu" or (dev == "cuda" and torch._C._dispatch_has_kernel_for_dispatch_key(
        "qtensor::accum_matmul", "CUDA"))


def _sample_check(device: torch.device) -> Optional[str]:
    """The accumulator kernel's first-use check (qtensor/selfcheck.py): every preset, on FP8,
    FP4 and float32 operands with rows of very different ranges, kernel vs reference."""
    g = torch.Generator().manual_seed(0)  # its own generator: the user's stream is untouched
    a = torch.randn(2, 5, 200, generator=g) * torch.exp2(torch.randint(-20, 20, (2, 5, 1),
                                                                        generator=g).float())
    b = torch.randn(2, 200, 7, generator=g)
    a[0, 0, 7], b[1, 3, 2] = math.inf, math.nan
    operands = [(_ops.quantize(a, e), _ops.quantize(b, e)) for e in ("fp8_e4m3", "fp4_e2m1")]
    for x, y in operands + [(a, b)]:
        x, y = x.to(device), y.to(device)
        for f in PRESETS.values():
            got = torch.ops.qtensor.accum_matmul(x, y, *op_args(f))
            found = selfcheck.difference(got, accum_matmul_reference(x, y, f))
            if found is not None:
                return f"accumulator {f.name}: {found}"
    return None


if _ops._C is not None:
    selfcheck.register("accumulator", _sample_check)


def op_args(f: AccumFormat) -> tuple:
    """The arguments of ``qtensor::accum_matmul`` after a and b."""
    return (f.chunk, f.frac_bits, f.group, _ROUND_CODE[f.align_rounding], f.acc_in_alignment,
            f.acc_man, _ROUND_CODE[f.acc_rounding], 0 if f.promote is None else f.promote)


def accum_matmul(a: torch.Tensor, b: torch.Tensor, accum) -> torch.Tensor:
    """a @ b (batched over broadcast leading dims) summed by the datapath ``accum``.

    Float32 result; the fused C++ kernel on CPU (and the CUDA kernel where built), the reference
    elsewhere (same bits).
    """
    f = _check_accum(accum)
    _check_operands(a, b, "accum_matmul")
    # CUDA: the kernel must first agree with the reference there (qtensor/selfcheck.py)
    if not _kernel_ready(a) or not selfcheck.trusted(a.device.type, "accumulator", a.device):
        return accum_matmul_reference(a, b, f)
    batch = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    M, K, N = a.shape[-2], a.shape[-1], b.shape[-1]
    B = math.prod(batch)  # not -1: a zero-size operand leaves -1 ambiguous
    a3 = a.float().expand(*batch, M, K).reshape(B, M, K)
    b3 = b.float().expand(*batch, K, N).reshape(B, K, N)
    out = torch.ops.qtensor.accum_matmul(a3, b3, *op_args(f))
    return out.reshape(*batch, M, N)


# ---------------------------------------------------------------------------------------------
# Contractions of QTensor (qtensor/dispatch.py): the aten contraction ``packet`` on unwrapped,
# operand-rounded arguments, with the products summed by ``f``. Added terms (bias, beta, alpha,
# the activation of _addmm_activation) are applied afterwards in the payload precision, as a
# GEMM epilogue does in FP32.

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


def contract(packet: str, uargs, ukwargs, f: AccumFormat) -> torch.Tensor:
    """The contraction ``packet`` (an aten op name) summed by ``f``; the payload dtype out."""
    if packet not in CONTRACTIONS:
        raise NotImplementedError(
            f"qt.accum: {packet} has no accumulator emulation (supported: "
            f"{', '.join(CONTRACTIONS)}; matmul, einsum, F.linear, F.conv*d and "
            "F.conv_transpose*d decompose into these); drop the QTensor's .accum (or the "
            "Recipe's accumulate=) for it")
    if packet in ("convolution", "_convolution"):
        return _conv_forward(uargs, ukwargs, f)
    if packet == "convolution_backward":
        return _conv_backward(uargs, ukwargs, f)
    out = ukwargs.get("out")
    ukwargs = {k: v for k, v in ukwargs.items() if k != "out"}
    t = [_f32(x, packet) if isinstance(x, torch.Tensor) else x for x in uargs]
    dtype = next(x.dtype for x in uargs if isinstance(x, torch.Tensor))
    if packet in ("mm", "bmm"):
        res = accum_matmul(t[0], t[1], f)
    elif packet in ("dot", "vdot"):
        res = accum_matmul(t[0][None], t[1][:, None], f)[0, 0]
    elif packet == "mv":
        res = accum_matmul(t[0], t[1][:, None], f)[:, 0]
    elif packet == "linear":
        x, w = t[0], t[1]
        bias = _arg(t, ukwargs, 2, "bias", None)
        res = accum_matmul(x[None] if x.dim() == 1 else x, w.t(), f)
        res = _epilogue(res[0] if x.dim() == 1 else res, bias, 1, 1)
    else:  # an added term: (self, mat1, mat2, *, beta, alpha)
        bias, a, b = t[0], t[1], t[2]
        beta = _arg(t, ukwargs, 3, "beta", 1)
        alpha = _arg(t, ukwargs, 4, "alpha", 1)
        if packet == "addmv":
            prod = accum_matmul(a, b[:, None], f)[:, 0]
        elif packet == "addbmm":  # the sum over the batch is one longer contraction
            B, M, K = a.shape
            prod = accum_matmul(a.transpose(0, 1).reshape(M, B * K), b.reshape(B * K, -1), f)
        else:
            prod = accum_matmul(a, b, f)
        res = _epilogue(prod, bias, beta, alpha)
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
# - grad_weight: (batch, output position).

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


def _gemm_conv(xp, w, stride, dilation, groups, size, f):
    """The forward convolution of the padded xp with w (O, C/groups, *k): (N, O, *size)."""
    (O, Cg, *k), N, L = w.shape, xp.shape[0], math.prod(size)
    K = math.prod(k) * Cg
    cols = _cols(xp, k, stride, dilation, groups, size)  # (N, g, L, K)
    b = cols.permute(1, 3, 0, 2).reshape(groups, K, N * L)  # one GEMM per group
    wm = w.reshape(groups, O // groups, Cg, -1).transpose(2, 3).reshape(groups, O // groups, K)
    out = accum_matmul(wm, b, f).reshape(groups, O // groups, N, L)
    return out.permute(2, 0, 1, 3).reshape(N, O, *size)


def _conv(x, w, geo, size, f):
    stride, padding, dilation, groups = geo
    return _gemm_conv(_pad(x, [(p, p) for p in padding]), w, stride, dilation, groups, size, f)


def _conv_transpose(x, w, geo, size, f):
    """The transposed convolution of x (N, C, *S) with w (C, O/groups, *k) to spatial ``size``,
    as the forward convolution over the zero-inserted x (the section comment)."""
    stride, padding, dilation, groups = geo
    N, C, *S = x.shape
    k = w.shape[2:]
    z = x.new_zeros(N, C, *((n - 1) * s + 1 for n, s in zip(S, stride)))
    z[(..., *(slice(None, None, s) for s in stride))] = x
    pads = []
    for i, (kk, d) in enumerate(zip(k, dilation)):
        lo = d * (kk - 1) - padding[i]
        pads.append((lo, size[i] + d * (kk - 1) - z.shape[2 + i] - lo))
    wf = w.unflatten(0, (groups, -1)).transpose(1, 2).flatten(0, 1)  # (O, C/groups, *k)
    wf = wf.flip(list(range(2, wf.dim())))
    return _gemm_conv(_pad(z, pads), wf, (1,) * len(k), dilation, groups, size, f)


def _conv_weight_grad(x, go, k, geo, f):
    """The weight gradient (O, C/groups, *k) of the forward convolution of x (N, C, *S) whose
    output gradient is go (N, O, *So): a contraction over (batch, output position)."""
    stride, padding, dilation, groups = geo
    (N, O, *size), Cg = go.shape, x.shape[1] // groups
    L, P = math.prod(size), math.prod(k)
    cols = _cols(_pad(x, [(p, p) for p in padding]), k, stride, dilation, groups, size)
    b = cols.transpose(0, 1).reshape(groups, N * L, P * Cg)
    a = go.reshape(N, groups, O // groups, L).permute(1, 2, 0, 3)  # (g, O/g, N, L)
    a = a.reshape(groups, O // groups, N * L)
    return accum_matmul(a, b, f).reshape(O, P, Cg).transpose(1, 2).reshape(O, Cg, *k)


_CONV_ARGS = ("input", "weight", "bias", "stride", "padding", "dilation", "transposed",
              "output_padding", "groups")


def _conv_forward(uargs, ukwargs, f):
    x, w, bias, stride, padding, dilation, transposed, output_padding, groups = (
        _arg(uargs, ukwargs, i, n, None) for i, n in enumerate(_CONV_ARGS))
    # torch's own checks (channels, groups, sizes) and output size, on an empty batch
    size = torch.ops.aten.convolution(x[:0], w, None, stride, padding, dilation, transposed,
                                      output_padding, groups).shape[2:]
    nd = w.dim() - 2
    geo = _geometry(stride, padding, dilation, groups, nd)
    x32, w32 = _f32(x, "convolution"), _f32(w, "convolution")
    out = (_conv_transpose if transposed else _conv)(x32, w32, geo, size, f)
    if bias is not None:
        out = out + bias.view(-1, *[1] * nd)
    return out.to(x.dtype)


def _conv_backward(uargs, ukwargs, f):
    (go, x, w, _bias_sizes, stride, padding, dilation, transposed, _output_padding, groups,
     mask) = uargs[:11]
    nd = w.dim() - 2
    geo = _geometry(stride, padding, dilation, groups, nd)
    go32, x32, w32 = (_f32(t, "convolution_backward") for t in (go, x, w))
    gi = gw = gb = None
    if mask[0]:  # the adjoint of the forward map: a transposed convolution, or the converse
        gi = (_conv if transposed else _conv_transpose)(go32, w32, geo, x.shape[2:], f)
        gi = gi.to(go.dtype)
    if mask[1]:  # a transposed convolution's weight is that of the forward map go -> x
        a, b = (go32, x32) if transposed else (x32, go32)
        gw = _conv_weight_grad(a, b, w.shape[2:], geo, f).to(go.dtype)
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
