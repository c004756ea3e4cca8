"""The quantization custom ops and their Python entry points ``quantize`` and ``quantize_``.

The ops live in the compiled extension ``qtensor._C`` (schemas in csrc/quantize.cpp, one per
family: ``qtensor::quantize_float``, ``quantize_fixed``, ``quantize_block``, each with ``.out`` and
in-place ``_`` variants; CPU and CUDA kernels). This module registers their fake (meta)
implementations so that torch.compile and FakeTensor work, and routes ``quantize`` to them when
they can take the input (float32/float16/bfloat16 on a device with kernels); everything else
(float64, no compiled extension, a CUDA kernel family that failed its first-use check in
:mod:`qtensor.kernels.selfcheck`) goes through :mod:`qtensor.kernels.reference`, which the kernels match bit for
bit, stochastic rounding included.
"""
from __future__ import annotations

import importlib
import threading
import warnings
from typing import Optional

import torch
import torch.autograd.forward_ad as _fwad

from . import decompositions, gpu, reference, selfcheck
from .checks import KERNEL_DTYPES, check_axis, check_generator, check_input, check_out
from .checks import check_op_args, resolve_rounding
from ..formats.block import BlockFormat
from ..formats.fixed import FixedFormat
from ..formats.float import FloatFormat
from ..formats.base import Format, is_stochastic, stochastic_bits

__all__ = ["quantize", "quantize_", "kernels_available", "op_args", "stochastic_under_tracing"]

_ROUNDING_CODE = {"nearest": 0, "nearest_away": 1, "toward_zero": 2, "stochastic": 3}
_SCALE_RULE_CODE = {"floor": 0, "ceil": 1, "amax": 2, "even": 3, "4over6": 4}


def rounding_code(rounding: str) -> int:
    """The op's rounding argument: the mode's code, and for "stochasticN" 3 + 256 * (32 - N)
    (the random bits dropped; csrc/include/qtensor/round.h, sr_or_mask)."""
    code = _ROUNDING_CODE.get(rounding)
    if code is not None:
        return code
    return _ROUNDING_CODE["stochastic"] + 256 * (32 - stochastic_bits(rounding))

try:
    # import_module, not `from . import _C`: the latter hides the real cause behind "cannot import
    # name '_C' from partially initialized module 'qtensor' (most likely due to a circular import)"
    _C = importlib.import_module("qtensor._C")  # loading it registers the ops
    _LOAD_ERROR: Optional[BaseException] = None
except ImportError as e:  # not built, or built against another torch or Python
    _C = None
    _LOAD_ERROR = e
    warnings.warn(
        f"qtensor: the compiled extension qtensor._C could not be imported ({type(e).__name__}: "
        f"{e}); qt.quantize and QTensor use the pure-PyTorch reference instead, which gives the "
        "same bits but is much slower. Build it with `pip install --no-build-isolation -e .` in "
        "the qtensor checkout (torch installed first; rebuild after changing torch).",
        RuntimeWarning, stacklevel=2)


def kernels_available(device: str | torch.device = "cpu") -> bool:
    """Whether the compiled kernels can run on ``device`` (a device type or device): the C++
    kernels on CPU, the Triton kernels (qtensor.kernels.gpu) on CUDA."""
    dev = torch.device(device).type
    if dev == "cuda":
        return gpu.available()
    return _C is not None and dev == "cpu"


def kernel_ops(x: torch.Tensor):
    """The quantization ops for x's device, in torch.ops.qtensor's form: the Triton kernels
    where qtensor.kernels.gpu takes x (CUDA; CPU inside qtensor.kernels.gpu.force), else the compiled ones."""
    return gpu.ops if gpu.takes(x) else torch.ops.qtensor


# ---------------------------------------------------------------------------------------------
# Format -> op arguments (the one place that knows the op signatures)

def _float_args(f: FloatFormat) -> tuple:
    if f.saturate:
        overflow = 0
    else:
        overflow = 1 if f.has_inf else 2
    # is_unsigned: the kernels' exponent-only formats without zero (E8M0); an unsigned format
    # with zero rounds as a signed one, then reference.sign_fixup
    return (f.man, f.emin, f.subnormals, float(f.max), overflow, not f.has_zero)


def op_args(fmt: Format) -> tuple:
    """``(op name, arguments after x)`` of the custom op that rounds to ``fmt``."""
    if isinstance(fmt, FloatFormat):
        return "quantize_float", _float_args(fmt)
    if isinstance(fmt, FixedFormat):
        return "quantize_fixed", (fmt.wl, fmt.fl, fmt.signed, fmt.symmetric, fmt.saturate)
    if isinstance(fmt, BlockFormat):
        if fmt.block_shape is not None:
            raise ValueError(f"{fmt}: 2D blocks have no op of their own; quantize lays the tiles "
                             "out for quantize_block (reference.tile_blocks)")
        elem, elem_max, scale, smax = _elem_scale_args(fmt)
        block_size = 0 if fmt.block_size is None else fmt.block_size
        return "quantize_block", (elem, elem_max, block_size, fmt.axis,
                                  _SCALE_RULE_CODE[fmt.scale_rule], scale, smax, fmt.tensor_scale)
    raise TypeError(f"cannot quantize to {fmt!r}: not a format")


def _elem_scale_args(fmt: BlockFormat) -> tuple:
    """A block format's element and scale arguments of the block ops: (elem, elem_max, scale,
    scale_max)."""
    e = fmt.elem
    if isinstance(e, FloatFormat):
        elem = [0, e.man, e.emin, int(e.subnormals), 0, e.emax]
    else:
        elem = [1, e.wl, e.fl, int(e.signed), int(e.symmetric), e.emax]
    s = fmt.scale if fmt.power_of_two_scales else fmt.amax_scale_format
    man, emin, subnormals, smax, overflow, unsigned = _float_args(s)
    return elem, float(e.max), [man, emin, s.emax, int(subnormals), overflow, int(unsigned)], smax


def _seed_arg(seed: int) -> int:
    """The 64-bit seed as the op's signed int64 (the kernels read it back as unsigned)."""
    seed &= (1 << 64) - 1
    return seed - (1 << 64) if seed >= 1 << 63 else seed


# ---------------------------------------------------------------------------------------------
# Fake (meta) implementations: shapes and dtypes, after the checks the kernels make
# (csrc/op_common.h check_op and block_args' axis), so that a bad call fails alike under
# torch.compile and FakeTensor

_check_op_fake = check_op_args  # (the fakes' checks, in qtensor.kernels.checks)


if _C is not None:
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

        def two_level(x, *args):
            # (values, decode tensor scale, block scales: one per block where asked for)
            nblocks = _two_level_nblocks(x.numel(), args[5]) if args[9] else 0
            return (torch.empty_like(x, memory_format=torch.contiguous_format),
                    x.new_empty((), dtype=torch.float32), x.new_empty(nblocks, dtype=torch.float32))

        def two_level_out(x, *args, out):
            nblocks = _two_level_nblocks(x.numel(), args[5]) if args[9] else 0
            return x.new_empty((), dtype=torch.float32), x.new_empty(nblocks, dtype=torch.float32)

        torch.library.register_fake("qtensor::quantize_two_level", two_level)
        torch.library.register_fake("qtensor::quantize_two_level.out", two_level_out)

    _register_fakes()


# The traced form of a scalar float rounding (defined here, below which dispatch and
# accum sit, so that qt.quantize under tracing and dispatch share it)

@torch.library.custom_op("qtensor_dispatch::round_float", mutates_args=())
def round_float(x: torch.Tensor, man: int, emin: int, subnormals: bool, max: float,
                overflow: int, is_unsigned: bool, rounding: int) -> torch.Tensor:
    """qtensor::quantize_float (deterministic) as traced graphs call it for float32 payloads:
    an op of its own, whose decomposition inductor fuses into the producer
    (qtensor.kernels.decompositions.round_float) while a direct call of the qtensor:: op stays extern."""
    q = torch.ops.qtensor.quantize_float.default(x, man, emin, subnormals, max, overflow,
                                                 is_unsigned, rounding, 0)
    # x's layout, as the fake (empty_like) and the decomposition (pointwise) give it
    return q if q.stride() == x.stride() else torch.empty_like(x).copy_(q)


@round_float.register_fake
def _(x, man, emin, subnormals, max, overflow, is_unsigned, rounding):
    decompositions.register_scalar()
    return torch.empty_like(x)


def traced_round_float(x, args):
    """quantize_float of a traced payload x with args = (man, emin, subnormals, max, overflow,
    is_unsigned, rounding code) as the fusable round_float, or None where the short form does
    not cover it (the caller then calls the qtensor:: op)."""
    if (x.dtype is not torch.float32 or x.device.type != "cpu" or not kernels_available("cpu")
            or gpu.takes(x)
            or not decompositions.fast_float_applies(*args[:3], args[5], args[6])):
        return None
    return round_float(x, *args)



# ---------------------------------------------------------------------------------------------
# Entry points

def _use_kernel(x: torch.Tensor, fmt: Format, rounding: str) -> bool:
    if x.dtype not in KERNEL_DTYPES:
        return False
    if isinstance(fmt, BlockFormat) and fmt.tensor_scale:
        return False  # TE's two-level rule: _two_level
    if x.device.type == "meta":
        return _C is not None
    if gpu.takes(x):  # the Triton kernels (what they do not cover goes to the reference)
        ok = gpu.covers(fmt, rounding)
    else:
        ok = _C is not None and kernels_available(x.device)
    # on CUDA the family must first agree with the reference there (qtensor/kernels/selfcheck.py)
    return ok and selfcheck.trusted(x.device.type, selfcheck.family(fmt, rounding), x.device)


def _sample_check(family: str):
    """The first-use check of a quantization kernel family: its sample, kernel vs reference."""
    def check(device: torch.device) -> Optional[str]:
        for x, fmt, rounding, seed in selfcheck.quantize_cases(family, device):
            if fmt.is_block and fmt.tensor_scale:
                got = _two_level(x, fmt, rounding, seed, checked=False)
            else:
                name, args = op_args(fmt)
                got = getattr(kernel_ops(x), name)(x, *args, rounding_code(rounding),
                                                   _seed_arg(seed))
            found = selfcheck.difference(got, reference.quantize_with_seed(x, fmt, rounding, seed))
            if found is not None:
                return f"{fmt} with rounding={rounding} on {x.dtype}: {found}"
        return None
    return check


for _family in ("scalar", "block", "stochastic", "two_level"):
    selfcheck.register(_family, _sample_check(_family))
if gpu.available() and torch.cuda.is_available() and _C is not None:
    gpu.register_cuda_kernels()  # the CUDA kernels of the qtensor:: ops


def stochastic_under_tracing(fmt) -> NotImplementedError:
    """The error for stochastic rounding inside torch.compile/torch.export tracing."""
    return NotImplementedError(
        f"QTensor: stochastic rounding ({fmt}) under torch.compile/tracing is not supported: "
        "each rounding draws its seed eagerly from torch's generator, which a traced graph "
        "would freeze into a constant; run stochastic formats eagerly")


def seeds_in_graph() -> bool:
    """Whether a stochastic rounding met now draws its seed inside the graph being traced:
    AOTAutograd's tracing under torch.compile (the backward of a compiled model, the ops of a
    QTensor), where the rounding becomes an op of the graph (_round_drawn) that draws its seed
    from torch's default generator when it runs, as eager draws it (reference.draw_seed). Not while
    dynamo itself traces Python code (that code runs eagerly instead, a graph break) nor under
    torch.export (an exported program would draw anew: refused)."""
    return (torch.compiler.is_compiling() and not torch.compiler.is_dynamo_compiling()
            and not torch.compiler.is_exporting())


class _DrawnInGraph:
    """The seed of a stochastic rounding traced by AOTAutograd (seeds_in_graph): drawn by the
    rounding op itself when the graph runs (_round_drawn)."""


_DRAWN_IN_GRAPH = _DrawnInGraph()
_AFTER = threading.local()  # .tensors: what a rounding drawn in the graph must follow


class after:
    """While tracing (seeds_in_graph): the stochastic roundings made inside depend on
    ``tensors`` (a contraction's operands), so the graph keeps them where eager makes them. A
    rounding of a forward value in a backward GEMM (wgrad's x) would otherwise be moved into the
    forward graph by the partitioner, and its seed drawn in another order than eager's."""

    def __init__(self, tensors):
        self.tensors = [t for t in tensors if isinstance(t, torch.Tensor)]

    def __enter__(self):
        self.before = getattr(_AFTER, "tensors", ())
        _AFTER.tensors = self.tensors

    def __exit__(self, *exc):
        _AFTER.tensors = self.before


def _seed(generator: Optional[torch.Generator], rounding: str, fmt=None):
    """The stochastic-rounding seed (0 for other modes); a bad generator is refused either way.
    Under AOTAutograd's tracing (seeds_in_graph): _DRAWN_IN_GRAPH."""
    check_generator(generator)
    if stochastic_bits(rounding) is None:
        return 0
    if torch.compiler.is_compiling():  # the seed would be a data-dependent symbolic int
        if generator is None and seeds_in_graph():
            return _DRAWN_IN_GRAPH
        raise stochastic_under_tracing(str(fmt))
    return reference.draw_seed(generator)


# nondeterministic_seeded: the graph neither merges two of them (CSE) nor recomputes one
@torch.library.custom_op("qtensor_ops::round_drawn", mutates_args=(),
                         tags=(torch.Tag.nondeterministic_seeded,))
def _round_drawn(x: torch.Tensor, after: list[torch.Tensor], fmt: str,
                 rounding: str) -> torch.Tensor:
    """The stochastic rounding of x to ``fmt`` (its string) with a seed drawn when it runs, from
    torch's default generator as eager draws it (reference.draw_seed): the opaque op of a
    stochastic rounding in a compiled graph. ``after``: tensors it depends on (see after)."""
    from ..formats.parse import format as parse
    return _round(x, parse(fmt), rounding, reference.draw_seed(None), None).contiguous()


@_round_drawn.register_fake
def _(x, after, fmt, rounding):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


_OUT_GRAD = ("quantize(): functions with out=... arguments don't support automatic "
             "differentiation, but one of the arguments requires grad; call it under "
             "torch.no_grad(), or without out= (then the result has a straight-through gradient)")


def quantize_with_seed(x: torch.Tensor, fmt, rounding: Optional[str] = None, seed: int = 0, *,
                       out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``quantize`` with an explicit stochastic-rounding seed (as reference.quantize_with_seed)."""
    fmt = check_input(x, fmt)
    rounding = resolve_rounding(fmt, rounding)
    if out is not None:
        check_out(x, out, fmt)
    check_axis(x, fmt)
    if _differentiable(x) or (out is not None and _differentiable(out)):
        if out is not None:
            raise RuntimeError(_OUT_GRAD)  # as torch's own out= ops
        return _StraightThrough.apply(x, fmt, rounding, seed)
    return _round(x, fmt, rounding, seed, out)


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


def _round_tiles(x, fmt: BlockFormat, rounding: str, seed: int, out=None) -> torch.Tensor:
    """x rounded to a 2D block format (into ``out`` if given): its tiles laid out as 1D blocks
    of r*c for the quantize_block kernel (the same bits as the reference). Stochastic rounding
    goes to the reference: its random bits follow each element's index in x, not in the tiled
    layout."""
    if is_stochastic(rounding) or not _use_kernel(x, fmt, rounding):
        q = reference.quantize_with_seed(x, fmt, rounding, seed)
        return q if out is None else out.copy_(q)
    y, restore, fmt1 = reference.tile_blocks(x.detach(), fmt)
    y = y.contiguous()
    if torch.compiler.is_compiling() or _is_traced(x):
        y = _round(y, fmt1, rounding, seed, None)  # traced: the functional op
    else:
        # (the layout was a view of x: one row of tiles, or r = 1). Storages compared, not
        # data pointers: collectives' outputs (DTensor.full_tensor) have none to read
        if torch._C._is_alias_of(y, x):
            y = y.clone()
        # rounded in place: the tiled copy is ours (one allocation fewer, the kernel's output)
        _round_(y, fmt1, rounding, seed)
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    return restore(y, into=out)


def _is_traced(x) -> bool:
    """Whether x is a tracing payload (FakeTensor, or a functional wrapper of one): AOTAutograd
    and export traces, where the roundings become graph nodes."""
    if type(x) is torch.Tensor:
        return False
    from torch._subclasses.fake_tensor import is_fake
    return is_fake(x)


def _round(x, fmt: Format, rounding: str, seed, out) -> torch.Tensor:
    """quantize_with_seed after its checks, outside autograd."""
    if seed is _DRAWN_IN_GRAPH:
        q = torch.ops.qtensor_ops.round_drawn(x.detach(), list(getattr(_AFTER, "tensors", ())),
                                              str(fmt), rounding)
        return q if out is None else out.copy_(q)
    if isinstance(fmt, BlockFormat) and fmt.tensor_scale:
        return _two_level(x, fmt, rounding, seed, out=out)
    if isinstance(fmt, BlockFormat) and fmt.block_shape is not None:
        return _round_tiles(x, fmt, rounding, seed, out)
    if not _use_kernel(x, fmt, rounding):
        q = reference.quantize_with_seed(x, fmt, rounding, seed)
        return q if out is None else out.copy_(q)
    name, args = op_args(fmt)
    args = (*args, rounding_code(rounding), _seed_arg(seed))
    x = x.detach()
    if reference.needs_sign_fixup(fmt):  # P3109, UE5M3: the signed kernel, then the sign rules
        q = reference.sign_fixup(x, getattr(torch.ops.qtensor, name)(x, *args), fmt, rounding)
        return q if out is None else out.copy_(q)
    if out is None and name == "quantize_float" and (torch.compiler.is_compiling()
                                                      or _is_traced(x)):
        q = traced_round_float(x, args[:-1])  # traced: the op inductor fuses
        if q is not None:
            return q
    kops = kernel_ops(x)
    if out is None:
        return getattr(kops, name)(x, *args)
    if out.is_neg() or out.is_conj():
        # a lazily negated view (complex.conj().imag): torch's math-bit fallback cannot run an
        # out= op that returns nothing (an internal assert, then an abort); copy_ writes it
        return out.copy_(getattr(kops, name)(x, *args))
    getattr(kops, name).out(x, *args, out=out)
    return out


class _StraightThrough(torch.autograd.Function):
    """Rounding with a straight-through gradient: the incoming gradient passes unchanged
    (identity), also where the format saturates or overflows, as QTensor's own roundings do.
    In the setup_context form, with a generated vmap rule, so that torch.func transforms (grad,
    vmap, jacrev, jvp) run it."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x, fmt, rounding, seed):
        return _round(x, fmt, rounding, seed, None)

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
        return _round_(x, fmt, rounding, seed)

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
    if isinstance(fmt, BlockFormat) and fmt.tensor_scale and (
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
    return quantize_with_seed(x, fmt, rounding, _seed(generator, rounding, fmt), out=out)


def quantize_with_scale(x: torch.Tensor, fmt, *, rounding: Optional[str] = None,
                        generator: Optional[torch.Generator] = None, tensor_scale=None,
                        tensor_amax=None):
    """(x rounded to ``fmt``, its FP32 decode tensor scale as a 0-dim float32 tensor) for a
    two-level block format (Transformer Engine's rule; under ``tensor_scale`` if given; with
    the scale of ``tensor_amax``, a whole tensor's amax, for a part of it);
    (quantize(x, fmt), None) for other formats. Straight-through gradient, as ``quantize``."""
    fmt = check_input(x, fmt)
    rounding = resolve_rounding(fmt, rounding)
    if not (isinstance(fmt, BlockFormat) and fmt.tensor_scale):
        return quantize(x, fmt, rounding=rounding, generator=generator), None
    check_axis(x, fmt)
    seed = _seed(generator, rounding, fmt)
    xp = x._data if hasattr(x, "_data") else x
    q, s = _two_level(xp, fmt, rounding, seed, tensor_scale, with_scale=True,
                      tensor_amax=tensor_amax)
    if _differentiable(x):
        q = _Replace.apply(x, q)
    return q, s


def _two_level(x, fmt: BlockFormat, rounding: str, seed, tensor_scale=None, with_scale=False,
               out=None, block_scales=False, checked=True, tensor_amax=None):
    """x rounded to a two-level format by TE's rule (reference.quantize_two_level, the spec): the
    values (into ``out`` if given), or (values, decode tensor scale), and with block_scales each
    block's scale X as the reference gives them. The fused kernel (qtensor::quantize_two_level on
    CPU, the Triton one where qtensor.kernels.gpu takes x) where one takes x, else the reference
    with its scalar roundings by the compiled kernels. checked=False: the kernel without its
    first-use check (qtensor.kernels.selfcheck; the check itself calls it). tensor_amax: the amax
    of a whole tensor that x is a part of (its scale is that tensor's; the reference)."""
    x = x.detach()
    geom = None if seed is _DRAWN_IN_GRAPH or tensor_amax is not None else _two_level_geom(x, fmt)
    if geom is not None and checked and not selfcheck.trusted(x.device.type, "two_level",
                                                              x.device):
        geom = None
    if geom is None:
        r = reference.quantize_two_level(x, fmt, rounding, seed, tensor_scale,
                                         rnd=_round_scalar32, block_scales=block_scales,
                                         tensor_amax=tensor_amax)
        q = r[0] if out is None else out.copy_(r[0])
    else:
        if fmt.axis is not None and x.dim() > 0:
            check_axis(x, fmt)
        ts = None
        if tensor_scale is not None:
            ts = reference.check_tensor_scale(tensor_scale, fmt).to(x.device)
        elem, elem_max, scale, smax = _elem_scale_args(fmt)
        args = (elem, elem_max, _SCALE_RULE_CODE[fmt.scale_rule], scale, smax, geom,
                float(fmt.tensor_scale_bound), fmt.settle, ts, block_scales,
                rounding_code(rounding), _seed_arg(seed))
        op = kernel_ops(x).quantize_two_level
        if out is None or torch.compiler.is_compiling() or _is_traced(x):
            q, s, X = op(x, *args)
            if out is not None:
                q = out.copy_(q)
        else:
            s, X = op.out(x, *args, out=out)
            q = out
        r = (q, s, _two_level_block_scales(X, x, fmt, geom)) if block_scales else (q, s)
    if block_scales:
        return r
    return (q, r[1]) if with_scale else q


def _two_level_nblocks(numel: int, geom) -> int:
    R, C, tr, tc = geom
    return numel // (R * C) * -(-R // tr) * -(-C // tc)


def _two_level_geom(x, fmt: BlockFormat):
    """The blocks of x as the two-level kernel takes them, [rows, cols, tr, tc]: the tr x tc
    tiles of x viewed as [-1, rows, cols] (reference.block_layout's and tile_blocks's blocks);
    None where no kernel takes x (the C++ one on CPU, the Triton one where qtensor.kernels.gpu
    takes x; another dtype, an element or scale format it has no rounding for): the reference
    then."""
    kernel = gpu.takes(x) or (_C is not None and x.device.type == "cpu")
    if not kernel or x.dtype not in KERNEL_DTYPES or x.dim() > 16 or x.numel() == 0:
        return None
    e, sf = fmt.elem, fmt.amax_scale_format
    if isinstance(e, FloatFormat) and reference.needs_sign_fixup(e):
        return None
    if type(sf) is not FloatFormat or not sf.has_zero:  # (rounded as a signed format with zero)
        return None
    if fmt.block_shape is not None:
        if x.dim() < 2:
            return None  # (the reference's error)
        r, c = fmt.block_shape
        if fmt.axis % x.dim() == x.dim() - 2:  # cols along dim -2: the tiles are c x r
            r, c = c, r
        R, C = x.shape[-2], x.shape[-1]
        return [R, C, max(min(r, R), 1), max(min(c, C), 1)]
    n = x.numel()
    if fmt.axis is None or x.dim() == 0:
        return [1, n, 1, n]
    if not -x.dim() <= fmt.axis < x.dim():
        return None  # (the reference's error)
    ax = fmt.axis % x.dim()
    L = x.shape[ax]
    inner = n // (x.shape[:ax].numel() * L)
    bs = max(min(fmt.block_size if fmt.block_size is not None else L, L), 1)
    return [1, L, 1, bs] if inner == 1 else [L, inner, bs, 1]


def _two_level_block_scales(X, x, fmt: BlockFormat, geom):
    """The kernel's block scales ([groups, row blocks, col blocks] flat) in the reference's
    layout: block_layout's (block axis last) or tile_blocks's, with a last dim of 1."""
    R, C, tr, tc = geom
    X = X.reshape(-1, -(-R // tr), -(-C // tc))
    if fmt.block_shape is not None:
        return X.reshape(*x.shape[:-2], X.shape[1], X.shape[2], 1)
    if fmt.axis is None or x.dim() == 0:
        return X.reshape(1, 1, 1)
    ax = fmt.axis % x.dim()
    if tc == 1 and C > 1 or ax != x.dim() - 1:  # [outer, blocks, inner] -> [outer, inner, blocks]
        X = X.transpose(1, 2)
    moved = x.movedim(ax, -1).shape
    return X.reshape(*moved[:-1], -1, 1)


def _round_scalar32(t: torch.Tensor, fmt, rounding: str, index, seed,
                    inplace: bool = False) -> torch.Tensor:
    """reference.round_scalar32 by the compiled kernels (the same bits) where they cover it:
    the two-level rule's scale and element roundings (inplace: into t)."""
    if index is not None or not _use_kernel(t, fmt, rounding):
        return reference.round_scalar32(t, fmt, rounding, index, seed)
    seed = 0 if seed is None else seed
    if inplace and not (torch.compiler.is_compiling() or _is_traced(t)):
        return _round_(t, fmt, rounding, seed)
    return _round(t, fmt, rounding, seed, None)


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
    return _round_(x, fmt, rounding, seed)


def _round_(x, fmt: Format, rounding: str, seed) -> torch.Tensor:
    """quantize_ after its checks, outside autograd."""
    if seed is _DRAWN_IN_GRAPH:
        with torch.no_grad():
            return x.copy_(_round(x, fmt, rounding, seed, None))
    if isinstance(fmt, BlockFormat) and fmt.tensor_scale:
        with torch.no_grad():  # (in place: the kernel reads each block before writing it)
            if x.is_neg() or x.is_conj() or torch.compiler.is_compiling() or _is_traced(x):
                return x.copy_(_two_level(x, fmt, rounding, seed))
            _two_level(x, fmt, rounding, seed, out=x)
        if not torch.compiler.is_compiling():
            torch.autograd.graph.increment_version(x)
        return x
    if isinstance(fmt, BlockFormat) and fmt.block_shape is not None:
        with torch.no_grad():  # (copy_ bumps x's version)
            return _round_tiles(x, fmt, rounding, seed, out=x)
    if not _use_kernel(x, fmt, rounding):
        with torch.no_grad():
            return x.copy_(reference.quantize_with_seed(x, fmt, rounding, seed))
    if reference.needs_sign_fixup(fmt):
        with torch.no_grad():
            return x.copy_(_round(x, fmt, rounding, seed, None))
    name, args = op_args(fmt)
    args = (*args, rounding_code(rounding), _seed_arg(seed))
    if x.is_neg() or x.is_conj():
        # a lazily negated view: torch's math-bit fallback for an in-place op reads a freed
        # tensor (valgrind; a heap corruption now and then): round a copy, copy_ writes it back
        with torch.no_grad():
            x.copy_(getattr(kernel_ops(x), name)(x.detach().resolve_neg(), *args))
    else:
        getattr(kernel_ops(x), name + "_")(x.detach(), *args)
    if not torch.compiler.is_compiling():
        # the op writes through x's data pointer, which autograd does not see: say so, so that
        # a value saved for backward that this changes is an error, not a wrong gradient
        torch.autograd.graph.increment_version(x)
    return x


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
        if isinstance(fmt, BlockFormat) and fmt.tensor_scale:
            if not bool(v.isfinite().all()):
                return 0
            s = tensor_scale if tensor_scale is not None else reference.quantize_two_level(
                v, fmt, "nearest")[1]
            return int(v.numel() - reference.two_level_valid(v, s, fmt).sum())
        q = quantize(v, fmt, rounding="nearest")
        ints = _INT_OF_WIDTH[v.element_size()]
        same = (q.view(ints) == v.view(ints)) | (q.isnan() & v.isnan())
        return int(v.numel() - same.sum())
