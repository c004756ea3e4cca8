"""The exact float64 arithmetic of the datapath, shared by the reference, the scaled operands
and the kernel glue: 2^e, floor(log2|x|) with an operand's clamp, the operands' checks."""
from __future__ import annotations

import torch

_EXP_MIN = -126          # float32's minimum normal exponent: the clamp of e(x)
_ZERO_EXP = -100000      # the alignment exponent of a zero term: below every real one
# the minimum normal exponent of an operand's input format (MMA-Sim's dtype_subnormal_exponent):
# a subnormal operand aligns as if its exponent were this one
_DTYPE_EMIN = {torch.float32: -126, torch.bfloat16: -126, torch.float16: -14,
               torch.float8_e4m3fn: -6, torch.float8_e5m2: -14,
               torch.float8_e4m3fnuz: -7, torch.float8_e5m2fnuz: -15}  # fnuz: AMD CDNA3's FP8


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


