"""The kernel glue: ``qtensor::accum_matmul`` (C++ on CPU, Triton on CUDA) and the C++ CDNA3
kernel, their fake implementations, arguments and first-use check, with the reference where no
kernel applies."""
from __future__ import annotations

import math
from typing import Optional

import torch

from ..kernels import gpu, selfcheck
from ..kernels import ops as _ops
from ..kernels.backend import kernel_ops
from .exponents import _EXP_MIN, _ZERO_EXP, _check_operands, _group_exps, _operand_emin
from .format import PRESETS, AccumFormat
from .reference import _reference
from .scaled import _scaled

_ROUND_CODE = {"toward_zero": 0, "floor": 1, "nearest": 2}


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
    if gpu.takes(a):
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
            got = kernel_ops(x).accum_matmul(x, y, *op_args(f), None, None, None, None,
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
            and a_gexp is None and b_gexp is None and not gpu.takes(a)
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
    out = kernel_ops(a3).accum_matmul(a3, b3, *op_args(f, a_emin, b_emin), a_gexp, b_gexp,
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


