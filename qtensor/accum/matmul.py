"""The public entry points, ``accum_matmul`` and ``accum_matmul_reference``: the operands'
formats (QTensors, ``a_fmt``/``b_fmt``) into clamps or block scales, a warning where a preset's
operands are unstated, then the kernel or the reference."""
from __future__ import annotations

import torch

from ..formats.base import Format
from ..formats.parse import format as _parse_format
from ..kernels import ops as _ops
from . import kernel as _kernel
from .blocks import _block_matmul, _emin_of
from .exponents import _DTYPE_EMIN, _check_operands
from .format import AccumFormat, _check_accum
from .reference import _reference

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
        fmt = _parse_format(fmt)
    if not isinstance(fmt, Format):
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
    if isinstance(fmt, Format) and fmt.is_block and fmt.block_size and fmt.block_shape is None:
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
    blocks = [x is not None and x.is_block for x in (a_fmt, b_fmt)]
    for n, fmt in (("a", a_fmt), ("b", b_fmt)):
        if fmt is not None and fmt.is_float and kw[f"{n}_emin"] is None:
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
    return _entry(_kernel._matmul, "accum_matmul", a, b, accum, a_fmt, b_fmt,
                  dict(a_emin=a_emin, b_emin=b_emin, a_gexp=a_gexp, b_gexp=b_gexp, c=c,
                       a_scale=a_scale, b_scale=b_scale, block_size=block_size))


