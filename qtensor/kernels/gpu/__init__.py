"""The GPU back end: Triton kernels of every quantization family.

On NVIDIA GPUs Triton's kernels are CUDA kernels, compiled on first use by the triton package
that torch's CUDA wheels already depend on: a GPU install needs no CUDA toolkit. Under Triton's
CPU interpreter (``TRITON_INTERPRET=1``) the same kernels run on CPU tensors, which is how CI
checks them bit for bit against the C++ CPU kernels and the reference (docs/gpu.md).

The entry point of each family is one function taking the arguments of its ``qtensor::`` op
(``quantize_float``, ``quantize_fixed``, ``quantize_block``, ``quantize_two_level``: two-level
formats by Transformer Engine's rule; ``out=`` may be x itself), so a back
end can call it directly; :data:`ops` offers them in the ``torch.ops.qtensor`` form (functional
op, ``.out`` and in-place ``_`` variants) that qtensor.kernels.ops calls for the tensors :func:`takes`.
The functional ops are ``torch.library.triton_op``s where CUDA is present (torch.compile traces
into the kernels), else ``custom_op``s with a fake (the interpreter under torch.compile on CPU).

``accum_matmul`` is the fused (NVIDIA) datapath of ``qt.accum`` (``qtensor::accum_matmul``'s
arguments); ``qt.accum`` calls it as ``ops.accum_matmul`` for the tensors :func:`takes`. AMD
CDNA3's two-stage datapath has no Triton kernel (the reference runs it on CUDA).

Not covered here (the reference rounds them, the same bits): two-level formats whose elements
need the reference's sign fix-up (P3109, unsigned) or whose scale has no zero, as on CPU
(qtensor.kernels.backend._two_level_geom).
"""
from __future__ import annotations

import contextlib
import importlib.util
import os
from typing import List, Optional, Tuple

import torch

__all__ = ["available", "takes", "covers", "force", "ops", "quantize_float", "quantize_fixed",
           "quantize_block", "quantize_two_level", "accum_matmul"]

FAMILIES = ("quantize_float", "quantize_fixed", "quantize_block")
_forced = False


def available() -> bool:
    """Whether triton is importable (it is wherever torch's CUDA wheel is installed)."""
    return importlib.util.find_spec("triton") is not None


def interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def takes(x: torch.Tensor) -> bool:
    """Whether x's device rounds with the Triton kernels: CUDA where triton is installed, and CPU
    inside :func:`force`."""
    dev = x.device.type
    return (dev == "cuda" and _cuda_ready()) or (_forced and dev == "cpu")


_CUDA_READY: Optional[bool] = None


def _cuda_ready() -> bool:
    global _CUDA_READY
    if _CUDA_READY is None:
        _CUDA_READY = available() and torch.cuda.is_available() and not interpreted()
    return _CUDA_READY


def covers(fmt, rounding: str) -> bool:
    """Whether quantize_float, quantize_fixed or quantize_block rounds ``fmt`` (else the
    reference does, with the same bits): not two-level formats, which quantize_two_level rounds
    (qtensor.kernels.backend.two_level)."""
    return not fmt.is_two_level


@contextlib.contextmanager
def force(enabled: bool = True):
    """Round CPU tensors with the Triton kernels (under the interpreter: ``TRITON_INTERPRET=1``
    must be set before triton is first imported), as a CUDA device would: for tests."""
    global _forced
    if enabled and not interpreted():
        raise RuntimeError("qtensor.kernels.gpu.force needs TRITON_INTERPRET=1 in the environment before "
                           "triton is imported (the kernels then run on CPU tensors)")
    before, _forced = _forced, enabled
    try:
        yield
    finally:
        _forced = before


def quantize_float(x, man, emin, subnormals, max, overflow, is_unsigned, rounding, seed, *,
                   out=None):
    """qtensor::quantize_float's arguments, rounded by the Triton kernel (into out, if given)."""
    _check(x, out, "quantize_float", (rounding, seed))
    from . import scalar
    return scalar.quantize_float(x, man, emin, subnormals, max, overflow, is_unsigned, rounding,
                                 seed, out=out)


def quantize_fixed(x, wl, fl, is_signed, symmetric, saturate, rounding, seed, *, out=None):
    """qtensor::quantize_fixed's arguments, rounded by the Triton kernel (into out, if given)."""
    _check(x, out, "quantize_fixed", (rounding, seed))
    from . import scalar
    return scalar.quantize_fixed(x, wl, fl, is_signed, symmetric, saturate, rounding, seed,
                                 out=out)


def quantize_block(x, elem, elem_max, block_size, axis, scale_rule, scale, scale_max,
                   tensor_scale, rounding, seed, *, out=None):
    """qtensor::quantize_block's arguments, rounded by the Triton kernel (into out, if given)."""
    _check(x, out, "quantize_block",
           (elem, elem_max, block_size, axis, scale_rule, scale, scale_max, tensor_scale,
            rounding, seed))
    from . import blocks
    return blocks.quantize_block(x, elem, elem_max, block_size, axis, scale_rule, scale,
                                 scale_max, tensor_scale, rounding, seed, out=out)


def quantize_two_level(x, elem, elem_max, scale_rule, scale, scale_max, geom, bound, settle,
                       tensor_scale, block_scales, rounding, seed, *, out=None):
    """qtensor::quantize_two_level's arguments, rounded by the Triton kernel: (values, decode
    tensor scale, block scales), the values into out if given."""
    _check(x, out, "quantize_two_level", (rounding, seed))
    from . import blocks
    return blocks.quantize_two_level(x, elem, elem_max, scale_rule, scale, scale_max, geom, bound,
                                     settle, tensor_scale, block_scales, rounding, seed, out=out)


def accum_matmul(a, b, chunk, frac_bits, group, align_rounding, acc_in_alignment, acc_man,
                 acc_rounding, promote, e_zero, a_emin, b_emin, acc_emin, acc_emax, a_gexp=None,
                 b_gexp=None, c=None, a_emins=None, b_emins=None):
    """qtensor::accum_matmul's arguments (qtensor.accum.kernel.op_args), summed by the Triton kernel of
    the fused datapath: a (B, M, K) @ b (B, K, N), float32."""
    from . import accum
    return accum.accum_matmul(a, b, chunk, frac_bits, group, align_rounding, acc_in_alignment,
                              acc_man, acc_rounding, promote, e_zero, a_emin, b_emin, acc_emin,
                              acc_emax, a_gexp, b_gexp, c, a_emins, b_emins)


def _check(x, out, op, args):
    from ..checks import check_op_args  # the C++ ops' checks
    check_op_args(op, x, x if out is None else out, args)


# ---------------------------------------------------------------------------------------------
# The ops: registered on first use (importing triton and, on CUDA, compiling nothing yet)

def _float_op(x: torch.Tensor, man: int, emin: int, subnormals: bool, max: float, overflow: int,
              is_unsigned: bool, rounding: int, seed: int) -> torch.Tensor:
    return quantize_float(x, man, emin, subnormals, max, overflow, is_unsigned, rounding, seed)


def _fixed_op(x: torch.Tensor, wl: int, fl: int, is_signed: bool, symmetric: bool,
              saturate: bool, rounding: int, seed: int) -> torch.Tensor:
    return quantize_fixed(x, wl, fl, is_signed, symmetric, saturate, rounding, seed)


def _block_op(x: torch.Tensor, elem: List[int], elem_max: float, block_size: int,
              axis: Optional[int], scale_rule: int, scale: List[int], scale_max: float,
              tensor_scale: bool, rounding: int, seed: int) -> torch.Tensor:
    return quantize_block(x, elem, elem_max, block_size, axis, scale_rule, scale, scale_max,
                          tensor_scale, rounding, seed)


def _two_level_op(x: torch.Tensor, elem: List[int], elem_max: float, scale_rule: int,
                  scale: List[int], scale_max: float, geom: List[int], bound: float,
                  settle: bool, tensor_scale: Optional[torch.Tensor], block_scales: bool,
                  rounding: int, seed: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return quantize_two_level(x, elem, elem_max, scale_rule, scale, scale_max, geom, bound,
                              settle, tensor_scale, block_scales, rounding, seed)


def _two_level_nblocks(x, geom) -> int:
    R, C, tr, tc = geom
    return x.numel() // (R * C) * -(-R // tr) * -(-C // tc)


def _accum_op(a: torch.Tensor, b: torch.Tensor, chunk: int, frac_bits: int, group: int,
              align_rounding: int, acc_in_alignment: bool, acc_man: int, acc_rounding: int,
              promote: int, e_zero: int, a_emin: int, b_emin: int, acc_emin: int, acc_emax: int,
              a_gexp: Optional[torch.Tensor], b_gexp: Optional[torch.Tensor],
              c: Optional[torch.Tensor], a_emins: Optional[torch.Tensor],
              b_emins: Optional[torch.Tensor]) -> torch.Tensor:
    return accum_matmul(a, b, chunk, frac_bits, group, align_rounding, acc_in_alignment, acc_man,
                        acc_rounding, promote, e_zero, a_emin, b_emin, acc_emin, acc_emax, a_gexp,
                        b_gexp, c, a_emins, b_emins)


_FUNCTIONAL = {"quantize_float": _float_op, "quantize_fixed": _fixed_op,
               "quantize_block": _block_op, "quantize_two_level": _two_level_op,
               "accum_matmul": _accum_op}
_registered: dict = {}


def _op(name: str):
    op = _registered.get(name)
    if op is None:
        fn = _FUNCTIONAL[name]
        qual = f"qtensor_gpu::{name}"
        if _cuda_ready():  # traced by torch.compile into the Triton kernels
            op = torch.library.triton_op(qual, fn, mutates_args=())
        else:  # the interpreter: an opaque op with a fake, which inductor on CPU takes
            op = torch.library.custom_op(qual, fn, mutates_args=())

            if name == "accum_matmul":
                @op.register_fake
                def _(a, b, *args):
                    return a.new_empty((a.shape[0], a.shape[1], b.shape[2]))
            elif name == "quantize_two_level":
                @op.register_fake
                def _(x, *args):
                    _check(x, None, "quantize_two_level", args[-2:])
                    n = _two_level_nblocks(x, args[5]) if args[9] else 0
                    return (torch.empty_like(x, memory_format=torch.contiguous_format),
                            x.new_empty((), dtype=torch.float32),
                            x.new_empty(n, dtype=torch.float32))
            else:
                @op.register_fake
                def _(x, *args, _name=name):
                    _check(x, None, _name, args)
                    return torch.empty_like(x, memory_format=torch.contiguous_format)
        op = _registered[name] = op
    return op


class _Family:
    """One family in torch.ops.qtensor's form: op(x, *args), op.out(x, *args, out=...)."""

    def __init__(self, name):
        self._name = name

    def __call__(self, x, *args):
        return _op(self._name)(x, *args)

    def out(self, x, *args, out):
        if torch.compiler.is_compiling():
            out.copy_(self(x, *args))
        else:
            globals()[self._name](x, *args, out=out)

    def inplace(self, x, *args):
        self.out(x, *args, out=x)


class _TwoLevelFamily(_Family):
    """quantize_two_level: op(x, *args) -> (values, decode scale, block scales);
    op.out(x, *args, out=...) -> (decode scale, block scales)."""

    def out(self, x, *args, out):
        if torch.compiler.is_compiling():
            q, s, X = self(x, *args)
            out.copy_(q)
            return s, X
        return quantize_two_level(x, *args, out=out)[1:]


class _Ops:
    """The Triton families under the names qtensor.kernels.ops calls (``name`` and ``name + "_"``)."""

    def __init__(self):
        for name in FAMILIES:
            fam = _Family(name)
            setattr(self, name, fam)
            setattr(self, name + "_", fam.inplace)
        self.quantize_two_level = _TwoLevelFamily("quantize_two_level")

    @staticmethod
    def accum_matmul(a, b, *args):
        return _op("accum_matmul")(a, b, *args)


ops = _Ops()


def register_cuda_kernels() -> None:
    """Make the Triton launchers the CUDA kernels of the compiled ``qtensor::`` ops (their
    ``.out`` and in-place variants too), for callers of torch.ops.qtensor on CUDA tensors."""
    for name in FAMILIES:
        launch = globals()[name]
        torch.library.impl(f"qtensor::{name}", "CUDA")(lambda x, *a, _l=launch: _l(x, *a))
        torch.library.impl(f"qtensor::{name}.out", "CUDA")(
            lambda x, *a, out, _l=launch: (_l(x, *a, out=out), None)[1])
        torch.library.impl(f"qtensor::{name}_", "CUDA")(
            lambda x, *a, _l=launch: (_l(x, *a, out=x), None)[1])
    if hasattr(torch.ops.qtensor, "quantize_two_level"):
        torch.library.impl("qtensor::quantize_two_level", "CUDA")(quantize_two_level)
        torch.library.impl("qtensor::quantize_two_level.out", "CUDA")(
            lambda x, *a, out: quantize_two_level(x, *a, out=out)[1:])
    if hasattr(torch.ops.qtensor, "accum_matmul"):
        torch.library.impl("qtensor::accum_matmul", "CUDA")(accum_matmul)
