"""The argument checks of ``qt.quantize``: the one place that says what x, out, the block axis,
the rounding mode and the generator may be (the reference, the kernel entry points and the fake
kernels all call these).
"""
from __future__ import annotations

from typing import Optional

import torch

from ..formats.block import BlockFormat
from ..formats.base import Format, FormatError, _check_rounding
from ..formats.parse import format as _parse_format

__all__ = ["FLOAT_DTYPES", "KERNEL_DTYPES", "check_input", "check_out", "check_axis",
           "check_op_args",
           "resolve_rounding", "check_generator"]

# The dtypes a format can round (and a QTensor can carry); the compiled kernels take all but
# float64, which goes to the reference.
FLOAT_DTYPES = frozenset((torch.float32, torch.float64, torch.float16, torch.bfloat16))
KERNEL_DTYPES = frozenset((torch.float32, torch.float16, torch.bfloat16))


def check_input(x: torch.Tensor, fmt) -> Format:
    """Validate (x, fmt) and return the parsed format."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"quantize expects a torch.Tensor, got {type(x).__name__}")
    fmt = _parse_format(fmt)
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"quantize to {fmt}: unsupported dtype {x.dtype}; expected one of float32, float64, "
            "float16, bfloat16 (integer and complex tensors have no format to round to)")
    return fmt


def check_out(x: torch.Tensor, out, fmt) -> None:
    """``out`` must be a tensor of x's device, dtype and shape."""
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"quantize to {fmt}: out must be a torch.Tensor, got {type(out).__name__}")
    if out.device != x.device:
        raise ValueError(f"quantize to {fmt}: out is on {out.device} but x is on {x.device}")
    if out.dtype != x.dtype:
        raise TypeError(f"quantize to {fmt}: out has dtype {out.dtype} but x has dtype {x.dtype}")
    if out.shape != x.shape:
        raise ValueError(
            f"quantize to {fmt}: out has shape {tuple(out.shape)} but x has shape {tuple(x.shape)}")


def check_axis(x: torch.Tensor, fmt) -> None:
    """A BlockFormat's axis must be a dim of x (a 0-dim x is one block whatever the axis); a 2D
    block format (block_shape) needs 2+ dims, with its axis one of the last two."""
    if fmt.is_tiled:
        r, c = fmt.block_shape
        if x.dim() < 2:
            raise FormatError(
                f"{fmt}: {r}x{c} blocks tile the last two dims, but x has shape "
                f"{tuple(x.shape)} ({x.dim()} dim{'s' if x.dim() != 1 else ''}); use a 1D block "
                "format (block_size=...) for it")
        if not -x.dim() <= fmt.axis < x.dim() or fmt.axis % x.dim() < x.dim() - 2:
            raise FormatError(
                f"{fmt}: {r}x{c} blocks tile the last two dims, with cols along axis; axis "
                f"{fmt.axis} is not one of them for a tensor of shape {tuple(x.shape)} (use -1 "
                "or -2)")
        return
    if fmt.is_block and fmt.axis is not None and x.dim() > 0:
        if not -x.dim() <= fmt.axis < x.dim():
            raise IndexError(
                f"{fmt}: axis {fmt.axis} is out of range for a tensor of shape {tuple(x.shape)}")


def resolve_rounding(fmt: Format, rounding: Optional[str]) -> str:
    """The rounding mode of a call: ``rounding`` if given (checked), else the format's own."""
    if rounding is None:
        return fmt.rounding
    _check_rounding(rounding)
    return rounding


def check_generator(generator) -> None:
    """A generator must be None or a torch.Generator (of any device: one seed is drawn from it)."""
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(
            f"generator must be a torch.Generator or None, got {type(generator).__name__}")


# The checks the kernels make (csrc/op_common.h check_op and block_args' axis), on fake and real
# tensors alike: the ops' fakes and the Triton launchers (qtensor/gpu) call them

_MAX_DIMS = 16  # kMaxDims of csrc/include/qtensor/args.h
# (block_args in csrc/op_common.h)
_TENSOR_SCALE_REFUSED = (
    "qtensor::quantize_block: tensor_scale=True is not a rule of this op; two-level formats "
    "(nvfp4) round with qtensor::quantize_two_level (Transformer Engine's rule)")


def check_op_args(op: str, x: torch.Tensor, out: torch.Tensor, args: tuple) -> None:
    """csrc/op_common.h check_op on fake tensors: args are the op's arguments after x."""
    torch._check(x.dtype in KERNEL_DTYPES, lambda: (
        f"qtensor::{op}: unsupported dtype {x.dtype}; the kernels take float32, float16 and "
        "bfloat16 (qtensor.quantize sends float64 to the reference implementation)"))
    torch._check(x.dim() <= _MAX_DIMS,
                 lambda: f"qtensor::{op}: at most {_MAX_DIMS} dims, got {x.dim()}")
    torch._check(out.device == x.device,
                 lambda: f"qtensor::{op}: out is on {out.device} but x is on {x.device}")
    torch._check(out.dtype == x.dtype,
                 lambda: f"qtensor::{op}: out has dtype {out.dtype} but x has dtype {x.dtype}")
    torch._check(out.shape == x.shape, lambda: (
        f"qtensor::{op}: out has shape {list(out.shape)} but x has shape {list(x.shape)}"))
    rounding = args[-2]  # every family ends with (rounding, seed)
    torch._check(0 <= rounding < 4 or (
        rounding & 0xFF == 3 and 1 <= rounding >> 8 <= 31), lambda: (
        f"qtensor::{op}: rounding must be 0 (nearest), 1 (nearest_away), 2 (toward_zero), "
        f"3 (stochastic) or 3 + 256 * (32 - N) (stochastic with N = 1..31 random bits), "
        f"got {rounding}"))
    if op == "quantize_block":
        torch._check(not args[7], lambda: _TENSOR_SCALE_REFUSED)
    if op == "quantize_block" and args[3] is not None and x.dim() > 0:
        axis = args[3]
        torch._check_index(-x.dim() <= axis < x.dim(), lambda: (
            f"qtensor::quantize_block: axis {axis} is out of range for a tensor of shape "
            f"{list(x.shape)}"))
