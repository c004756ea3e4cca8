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
with an operand that carries an accumulator sums its products with it. torch.compile and
transposed, grouped or non-2-D convolutions are refused (NotImplementedError).

The model step by step, its sources and the known differences from hardware: docs/accum.md.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Optional

import torch

from . import ops as _ops

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
    if not _kernel_ready(a):
        return accum_matmul_reference(a, b, f)
    batch = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    M, K, N = a.shape[-2], a.shape[-1], b.shape[-1]
    a3 = a.float().expand(*batch, M, K).reshape(-1, M, K)
    b3 = b.float().expand(*batch, K, N).reshape(-1, K, N)
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
            f"{', '.join(CONTRACTIONS)}; matmul, einsum, F.linear, conv2d decompose into "
            "these); drop the QTensor's .accum (or the Recipe's accumulate=) for it")
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
# Convolutions as GEMMs (2-D, groups=1, not transposed). The reduction index runs over (kernel
# row, kernel column, input channel), channels innermost, as an implicit GEMM on NHWC data (and
# as dispatch blocks MX operands: along channels). Other convolutions raise NotImplementedError.

def _conv_check(x, w, stride, padding, dilation, transposed, groups, what):
    if x.dim() != 4 or transposed or groups != 1:
        raise NotImplementedError(
            f"qt.accum: {what} with an accumulator format is emulated for 2-D, non-transposed "
            f"convolutions with groups=1; got a {x.dim() - 2}-D convolution, "
            f"transposed={bool(transposed)}, groups={groups}. Drop the QTensor's .accum (or "
            "the Recipe's accumulate=) for this layer")
    if isinstance(padding, str):
        raise NotImplementedError(f"qt.accum: {what}: string padding {padding!r}")


def _pair(v):
    v = list(v)
    return tuple(v * 2) if len(v) == 1 else tuple(v)


def _cols(x, kh, kw, stride, padding, dilation):
    """(N, kh*kw*C, L): the GEMM operand of a 2-D convolution, channels innermost along K."""
    N, C = x.shape[:2]
    cols = torch.nn.functional.unfold(x, (kh, kw), dilation=dilation, padding=padding,
                                      stride=stride)  # (N, C*kh*kw, L), channel-major
    return cols.view(N, C, kh * kw, -1).transpose(1, 2).reshape(N, kh * kw * C, -1)


def _w_mat(w):
    """(O, kh*kw*C): the weight in the same K order as _cols."""
    O, C, kh, kw = w.shape
    return w.reshape(O, C, kh * kw).transpose(1, 2).reshape(O, kh * kw * C)


def _conv2d(x, w, stride, padding, dilation, f):
    N, _, H, Wd = x.shape
    O, _, kh, kw = w.shape
    Ho = (H + 2 * padding[0] - dilation[0] * (kh - 1) - 1) // stride[0] + 1
    Wo = (Wd + 2 * padding[1] - dilation[1] * (kw - 1) - 1) // stride[1] + 1
    cols = _cols(x, kh, kw, stride, padding, dilation)
    return accum_matmul(_w_mat(w), cols, f).view(N, O, Ho, Wo)


def _conv_forward(uargs, ukwargs, f):
    x, w, bias, stride, padding, dilation, transposed = (list(uargs) + [None] * 9)[:7]
    groups = uargs[8] if len(uargs) > 8 else 1
    _conv_check(x, w, stride, padding, dilation, transposed, groups, "convolution")
    dtype = x.dtype
    out = _conv2d(_f32(x, "convolution"), _f32(w, "convolution"), _pair(stride), _pair(padding),
                  _pair(dilation), f)
    if bias is not None:
        out = out + bias.view(1, -1, 1, 1)
    return out.to(dtype)


def _conv_backward(uargs, ukwargs, f):
    (go, x, w, _bias_sizes, stride, padding, dilation, transposed, _output_padding, groups,
     mask) = uargs[:11]
    _conv_check(x, w, stride, padding, dilation, transposed, groups, "convolution_backward")
    stride, padding, dilation = _pair(stride), _pair(padding), _pair(dilation)
    dtype = go.dtype
    go32, x32, w32 = (_f32(t, "convolution_backward") for t in (go, x, w))
    N, O, Ho, Wo = go.shape
    _, C, kh, kw = w.shape
    gi = gw = gb = None
    if mask[0]:
        # grad_input: the transposed convolution as a forward one over grad_output with zeros
        # inserted between its elements (stride), padded, and the kernel flipped with its
        # channels swapped: a contraction over (kernel position, output channel)
        H, Wd = x.shape[2:]
        pads = []
        for d in range(2):
            k = (kh, kw)[d]
            lo = dilation[d] * (k - 1) - padding[d]
            if lo < 0:
                raise NotImplementedError(
                    "qt.accum: convolution_backward with padding larger than the dilated kernel "
                    "extent is not emulated")
            size = (Ho, Wo)[d]
            full = (size - 1) * stride[d] + 1
            hi = (H, Wd)[d] + dilation[d] * (k - 1) - full - lo
            pads.append((lo, hi))
        z = go32.new_zeros(N, O, (Ho - 1) * stride[0] + 1, (Wo - 1) * stride[1] + 1)
        z[:, :, ::stride[0], ::stride[1]] = go32
        z = torch.nn.functional.pad(z, (pads[1][0], max(pads[1][1], 0),
                                        pads[0][0], max(pads[0][1], 0)))
        z = z[:, :, :z.shape[2] + min(pads[0][1], 0) or None,
              :z.shape[3] + min(pads[1][1], 0) or None]
        wf = w32.flip(2, 3).transpose(0, 1)  # (C, O, kh, kw)
        gi = _conv2d(z, wf, (1, 1), (0, 0), dilation, f).to(dtype)
    if mask[1]:
        # grad_weight: a contraction over (batch, output position)
        cols = _cols(x32, kh, kw, stride, padding, dilation)  # (N, K, L)
        a = go32.reshape(N, O, -1).transpose(0, 1).reshape(O, -1)          # (O, N*L)
        b = cols.transpose(1, 2).reshape(-1, cols.shape[1])                # (N*L, K)
        gw = accum_matmul(a, b, f).view(O, kh * kw, C).transpose(1, 2).reshape(O, C, kh, kw)
        gw = gw.to(dtype)
    if mask[2]:  # grad_bias: a sum of grad_output values, not a contraction
        gb = go.sum((0, 2, 3))
    return (gi, gw, gb)


def as_accum(spec, what: str = "accumulate") -> Optional[AccumFormat]:
    """None, an AccumFormat or a preset name (``"hopper_fp8"``) as an AccumFormat (or None)."""
    if spec is None or isinstance(spec, AccumFormat):
        return spec
    if isinstance(spec, str):
        return _check_accum(spec)
    raise TypeError(f"{what} must be an AccumFormat, a preset name of qt.accum.PRESETS "
                    f"({', '.join(PRESETS)}) or None, got {spec!r}")
