"""The quantization custom ops and the public entry points ``quantize`` and ``quantize_``.

The ops live in the compiled extension ``qtensor._C`` (schemas in csrc/quantize.cpp, one per
family: ``qtensor::quantize_float``, ``quantize_fixed``, ``quantize_block``, each with ``.out`` and
in-place ``_`` variants; CPU and CUDA kernels). This module registers their fake (meta)
implementations so that torch.compile and FakeTensor work, and the kernels' first-use checks
(:mod:`qtensor.kernels.selfcheck`). The public entry points check their arguments once and round
with :func:`qtensor.kernels.backend.round_payload`, which picks the kernel or the reference
(:mod:`qtensor.kernels.reference`, which the kernels match bit for bit, stochastic rounding
included).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.autograd.forward_ad as _fwad

from . import decompositions, gpu, reference, selfcheck
from .backend import (DRAWN_IN_GRAPH, kernel_ops, kernels_available, op_args, round_payload,  # noqa: F401
                      round_with_scale, rounding_code, seed_arg, seeds_in_graph,
                      stochastic_under_tracing, two_level, two_level_nblocks)
from .checks import check_axis, check_generator, check_input, check_out
from .checks import check_op_args, resolve_rounding
from ..formats.base import stochastic_bits

__all__ = ["quantize", "quantize_", "kernels_available", "op_args", "stochastic_under_tracing"]


# ---------------------------------------------------------------------------------------------
# Fake (meta) implementations: shapes and dtypes, after the checks the kernels make
# (csrc/op_common.h check_op and block_args' axis), so that a bad call fails alike under
# torch.compile and FakeTensor

_check_op_fake = check_op_args  # (the fakes' checks, in qtensor.kernels.checks)


if kernels_available("cpu"):  # (the compiled extension loaded: its ops exist)
    def _register_fakes():
        for family in ("quantize_float", "quantize_fixed", "quantize_block"):
            def functional(x, *args, _op=family):
                _check_op_fake(_op, x, x, args)
                # torch.compile traces the op on fake tensors before inductor picks its
                # decompositions: where enabled (QTENSOR_INDUCTOR_DECOMPOSITIONS=1), inductor
                # gets the rounding as pointwise torch ops that it fuses into the producing
                # kernels (qtensor/kernels/decompositions.py). Registered here, not at import, so that
                # importing qtensor does not import inductor.
                decompositions.register()
                return torch.empty_like(x, memory_format=torch.contiguous_format)

            def out_variant(x, *args, out, _op=family):
                _check_op_fake(_op, x, out, args)

            def inplace(x, *args, _op=family):
                _check_op_fake(_op, x, x, args)

            torch.library.register_fake(f"qtensor::{family}", functional)
            torch.library.register_fake(f"qtensor::{family}.out", out_variant)
            torch.library.register_fake(f"qtensor::{family}_", inplace)

        def two_level_fake(x, *args):
            # (values, decode tensor scale, block scales: one per block where asked for)
            nblocks = two_level_nblocks(x.numel(), args[5]) if args[9] else 0
            return (torch.empty_like(x, memory_format=torch.contiguous_format),
                    x.new_empty((), dtype=torch.float32), x.new_empty(nblocks, dtype=torch.float32))

        def two_level_out_fake(x, *args, out):
            nblocks = two_level_nblocks(x.numel(), args[5]) if args[9] else 0
            return x.new_empty((), dtype=torch.float32), x.new_empty(nblocks, dtype=torch.float32)

        torch.library.register_fake("qtensor::quantize_two_level", two_level_fake)
        torch.library.register_fake("qtensor::quantize_two_level.out", two_level_out_fake)

    _register_fakes()


# ---------------------------------------------------------------------------------------------
# Entry points

def _sample_check(family: str):
    """The first-use check of a quantization kernel family: its sample, kernel vs reference."""
    def check(device: torch.device) -> Optional[str]:
        for x, fmt, rounding, seed in selfcheck.quantize_cases(family, device):
            if fmt.is_two_level:
                got = two_level(x, fmt, rounding, seed, checked=False)
            else:
                name, args = op_args(fmt)
                got = getattr(kernel_ops(x), name)(x, *args, rounding_code(rounding),
                                                   seed_arg(seed))
            found = selfcheck.difference(got, reference.quantize_with_seed(x, fmt, rounding, seed))
            if found is not None:
                return f"{fmt} with rounding={rounding} on {x.dtype}: {found}"
        return None
    return check


for _family in ("scalar", "block", "stochastic", "two_level"):
    selfcheck.register(_family, _sample_check(_family))
if gpu.available() and torch.cuda.is_available() and kernels_available("cpu"):
    gpu.register_cuda_kernels()  # the CUDA kernels of the qtensor:: ops


def _seed(generator: Optional[torch.Generator], rounding: str, fmt=None):
    """The stochastic-rounding seed (0 for other modes); a bad generator is refused either way.
    Under AOTAutograd's tracing (seeds_in_graph): DRAWN_IN_GRAPH."""
    check_generator(generator)
    if stochastic_bits(rounding) is None:
        return 0
    if torch.compiler.is_compiling():  # the seed would be a data-dependent symbolic int
        if generator is None and seeds_in_graph():
            return DRAWN_IN_GRAPH
        raise stochastic_under_tracing(str(fmt))
    return reference.draw_seed(generator)


_OUT_GRAD = ("quantize(): functions with out=... arguments don't support automatic "
             "differentiation, but one of the arguments requires grad; call it under "
             "torch.no_grad(), or without out= (then the result has a straight-through gradient)")


def quantize_with_seed(x: torch.Tensor, fmt, rounding: Optional[str] = None, seed: int = 0, *,
                       out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``quantize`` with an explicit stochastic-rounding seed (as reference.quantize_with_seed)."""
    fmt = check_input(x, fmt)
    return _quantize_checked(x, fmt, resolve_rounding(fmt, rounding), seed, out)


def _quantize_checked(x, fmt, rounding: str, seed, out) -> torch.Tensor:
    """quantize after check_input and resolve_rounding: the rest of its checks, then the back
    end (through autograd where x is differentiable)."""
    if out is not None:
        check_out(x, out, fmt)
    check_axis(x, fmt)
    if _differentiable(x) or (out is not None and _differentiable(out)):
        if out is not None:
            raise RuntimeError(_OUT_GRAD)  # as torch's own out= ops
        return _StraightThrough.apply(x, fmt, rounding, seed)
    return round_payload(x, fmt, rounding=rounding, seed=seed, out=out)


def _differentiable(x: torch.Tensor) -> bool:
    """Whether rounding x must go through autograd: x requires grad (grad mode on), is a
    torch.func transform's wrapper (grad, jvp, vmap), or a forward-mode dual tensor."""
    if x.requires_grad and torch.is_grad_enabled():
        return True
    if torch.compiler.is_dynamo_compiling():
        return False  # (dynamo cannot call the checks below)
    if type(x) is torch.Tensor and torch._C._functorch.is_functorch_wrapped_tensor(x):
        return True
    return _fwad._current_level >= 0 and _fwad.unpack_dual(x).tangent is not None


class _StraightThrough(torch.autograd.Function):
    """Rounding with a straight-through gradient: the incoming gradient passes unchanged
    (identity), also where the format saturates or overflows, as QTensor's own roundings do.
    In the setup_context form, with a generated vmap rule, so that torch.func transforms (grad,
    vmap, jacrev, jvp) run it."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x, fmt, rounding, seed):
        return round_payload(x.detach(), fmt, rounding=rounding, seed=seed)

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, g):
        return g, None, None, None

    @staticmethod
    def jvp(ctx, gx, *_):
        return gx


class _StraightThroughInplace(torch.autograd.Function):
    """quantize_ of a tensor inside an autograd graph: recorded (the version bumps, so saved
    values it changes are caught), with the straight-through gradient of _StraightThrough."""

    @staticmethod
    def forward(x, fmt, rounding, seed):
        return round_payload(x, fmt, rounding=rounding, seed=seed, out=x)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.mark_dirty(inputs[0])

    @staticmethod
    def backward(ctx, g):
        return g, None, None, None


def quantize(x: torch.Tensor, fmt, *, rounding: Optional[str] = None,
             generator: Optional[torch.Generator] = None,
             out: Optional[torch.Tensor] = None, tensor_scale=None) -> torch.Tensor:
    """x rounded to ``fmt`` (a format or its name), as a new plain tensor like x (or into ``out``).

    rounding overrides the format's own mode; generator (a ``torch.Generator`` of any device)
    feeds stochastic rounding with one seed per call (default: torch's default CPU generator, so
    ``torch.manual_seed`` makes it reproducible, and CPU and CUDA give the same result). Uses the
    compiled kernels where they apply, else the reference; both give the same bits.

    Autograd: for an x that requires grad the result has a straight-through gradient, the
    identity (the gradient passes unchanged, also where the format saturates, overflows or
    flushes to zero), as fake quantization and QTensor's own roundings do; torch.func
    transforms (grad, vmap, jacrev, jvp) run it too. ``out=`` does not support autograd (an
    error, as torch's out= ops).

    tensor_scale (two-level formats such as ``nvfp4`` only): round under this FP32 decode tensor
    scale (a positive finite float32) instead of the one TE derives from x's amax; a QTensor x
    of the same format is rounded under its own (``QTensor.tensor_scale``).
    """
    fmt = check_input(x, fmt)
    rounding = resolve_rounding(fmt, rounding)
    if fmt.is_two_level and (
            tensor_scale is not None or getattr(x, "fmt", None) == fmt):
        if out is not None:
            raise ValueError(f"quantize to {fmt}: out= with a tensor scale is not supported")
        if tensor_scale is None:
            tensor_scale = x.tensor_scale
        return quantize_with_scale(x, fmt, rounding=rounding, generator=generator,
                                   tensor_scale=tensor_scale)[0]
    if tensor_scale is not None:
        raise ValueError(f"quantize to {fmt}: tensor_scale is for two-level block formats "
                         "(tensor_scale=True, such as nvfp4)")
    return _quantize_checked(x, fmt, rounding, _seed(generator, rounding, fmt), out)


def quantize_with_scale(x: torch.Tensor, fmt, *, rounding: Optional[str] = None,
                        generator: Optional[torch.Generator] = None, tensor_scale=None,
                        tensor_amax=None):
    """(x rounded to ``fmt``, its FP32 decode tensor scale as a 0-dim float32 tensor) for a
    two-level block format (Transformer Engine's rule; under ``tensor_scale`` if given; with
    the scale of ``tensor_amax``, a whole tensor's amax, for a part of it);
    (quantize(x, fmt), None) for other formats. Straight-through gradient, as ``quantize``."""
    fmt = check_input(x, fmt)
    rounding = resolve_rounding(fmt, rounding)
    if not fmt.is_two_level:
        return quantize(x, fmt, rounding=rounding, generator=generator), None
    check_axis(x, fmt)
    seed = _seed(generator, rounding, fmt)
    xp = x._data if hasattr(x, "_data") else x
    q, s = round_with_scale(xp, fmt, rounding, seed, tensor_scale, tensor_amax=tensor_amax)
    if _differentiable(x):
        q = _Replace.apply(x, q)
    return q, s


class _Replace(torch.autograd.Function):
    """q in place of x, with the straight-through gradient (identity)."""

    @staticmethod
    def forward(ctx, x, q):
        return q.clone()

    @staticmethod
    def backward(ctx, g):
        return g, None


def quantize_(x: torch.Tensor, fmt, *, rounding: Optional[str] = None,
              generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """Round x to ``fmt`` in place and return x.

    Inside an autograd graph (x requires grad, not a leaf) the rounding is recorded, with the
    straight-through gradient of ``quantize``; a leaf that requires grad is refused, as torch's
    in-place ops refuse it."""
    fmt = check_input(x, fmt)
    rounding = resolve_rounding(fmt, rounding)
    check_axis(x, fmt)
    seed = _seed(generator, rounding, fmt)
    if torch.is_grad_enabled() and x.requires_grad:
        if x.is_leaf:
            raise RuntimeError("a leaf Variable that requires grad is being used in an in-place "
                               "operation (qt.quantize_); round it under torch.no_grad()")
        return _StraightThroughInplace.apply(x, fmt, rounding, seed)
    return round_payload(x, fmt, rounding=rounding, seed=seed, out=x)


_INT_OF_WIDTH = {8: torch.int64, 4: torch.int32}


def count_off_format(values: torch.Tensor, fmt, tensor_scale=None) -> int:
    """How many of ``values`` are not values of ``fmt`` (0: the tensor is in the format, as a
    QTensor's payload must be). The values are rounded again, to nearest (a value in format is
    its own rounding in every mode, block formats included: docs/formats.md, "Idempotence"; and
    no random bits are drawn), and compared bit for bit, NaN with any NaN. float16/bfloat16
    values (float8 too) are checked as the float32 values they are. Not checked (0): a tensor-scaled block
    format's tensor holding Inf or NaN, whose tensor scale came from a finite value that a NaN
    block may have replaced (docs/formats.md, the known exception to idempotence). Two-level
    formats (nvfp4): each value must be element x block scale x ``tensor_scale`` (the scale of
    the values' amax when None) in float32 (reference.two_level_valid)."""
    with torch.no_grad():
        v = values.detach()
        if v.is_floating_point() and v.dtype not in (torch.float32, torch.float64):
            v = v.float()  # (exactly)
        fmt = check_input(v, fmt)
        if fmt.is_two_level:
            if not bool(v.isfinite().all()):
                return 0
            s = tensor_scale if tensor_scale is not None else reference.quantize_two_level(
                v, fmt, "nearest")[1]
            return int(v.numel() - reference.two_level_valid(v, s, fmt).sum())
        q = quantize(v, fmt, rounding="nearest")
        ints = _INT_OF_WIDTH[v.element_size()]
        same = (q.view(ints) == v.view(ints)) | (q.isnan() & v.isnan())
        return int(v.numel() - same.sum())
