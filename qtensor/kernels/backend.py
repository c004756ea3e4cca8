"""The rounding back end: :func:`round_payload`, the one internal entry that rounds a plain
payload tensor to a format, and the helpers behind it.

It picks, per call, the torch cast (formats that are exactly a torch dtype), the compiled C++
kernel, the Triton kernel (CUDA), or the pure-PyTorch reference (:mod:`qtensor.kernels.reference`,
which the kernels match bit for bit), and handles 2D tiles, strided block axes, stochastic seeds
and traced (fake/functional) payloads. It validates nothing: the public entry points
(``qt.quantize`` in :mod:`qtensor.kernels.ops`, ``as_qtensor``, the role roundings, ...) check
their arguments once and then call it; ``QTensor.__torch_dispatch__`` calls it with formats it
derived itself (fitted to the payload's dims: :func:`fit_format`).

The compiled extension ``qtensor._C`` is loaded here; :mod:`qtensor.kernels.ops` registers the
fake implementations of its ops and the kernels' first-use checks.
"""
from __future__ import annotations

import importlib
import threading
import warnings
from typing import Optional

import torch

from . import decompositions, gpu, reference, selfcheck
from .checks import KERNEL_DTYPES, check_axis
from ..formats.base import Format, is_stochastic, stochastic_bits
from ..formats.block import SCALE_RULE_CODES
from ..formats.presets import PRESETS

__all__ = ["round_payload", "round_scalar32", "fit_format", "with_axis", "kernels_available",
           "kernel_ops", "op_args", "rounding_code", "seed_arg", "round_float",
           "traced_round_float", "stochastic_under_tracing", "seeds_in_graph", "after",
           "DRAWN_IN_GRAPH", "tiles_in_place", "eager_cpu_kernel", "STRIDED_BLOCKS"]

_ROUNDING_CODE = {"nearest": 0, "nearest_away": 1, "toward_zero": 2, "stochastic": 3}


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
# Format -> op arguments (each family gives its own: Format.kernel_args)

def op_args(fmt: Format) -> tuple:
    """``(op name, arguments after x)`` of the custom op that rounds to ``fmt``."""
    if not isinstance(fmt, Format):
        raise TypeError(f"cannot quantize to {fmt!r}: not a format")
    return fmt.kernel_args()


def seed_arg(seed: int) -> int:
    """The 64-bit seed as the op's signed int64 (the kernels read it back as unsigned)."""
    seed &= (1 << 64) - 1
    return seed - (1 << 64) if seed >= 1 << 63 else seed


# ---------------------------------------------------------------------------------------------
# The traced forms of the scalar roundings: ops of their own that inductor can fuse into the
# producer (qtensor.kernels.decompositions), where a direct call of a qtensor:: op stays extern

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


@torch.library.custom_op("qtensor_dispatch::round_to_dtype", mutates_args=())
def _round_to_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The cast down and back as one opaque op, for traced graphs: inductor must not fuse the
    casts into the producing op (it would, e.g., split addmm into mm + a fused bias add, and
    the float32 bits would differ from eager)."""
    return x.to(dtype).to(x.dtype)


@_round_to_dtype.register_fake
def _(x, dtype):
    decompositions.register_scalar()  # inductor fuses it (qtensor.kernels.decompositions)
    return torch.empty_like(x)


# ---------------------------------------------------------------------------------------------
# Formats derived for a payload, cached by the format object's id (a format's own hash walks
# its fields: a hit is a lookup by id)

_CACHE_SIZE = 4096  # entries of the format caches below, before they start again
_BY_VALUE: dict = {}  # (cache name, fmt, key): the entry that equal formats share


def _shared(cache: dict, name: str, fmt, key, make):
    """``cache[(id(fmt), key)]`` with, on a miss, the entry of an equal format: formats made
    anew per call (strings parsed per call, ``fmt.replace(...)``) share one entry and return the
    same object. Both tables start again past _CACHE_SIZE entries: bounded."""
    shared = (name, fmt, key)
    value = _BY_VALUE.get(shared)
    if value is None:
        value = make()
        if len(_BY_VALUE) > _CACHE_SIZE:
            _BY_VALUE.clear()
        _BY_VALUE[shared] = value
    if len(cache) > _CACHE_SIZE:
        cache.clear()
    cache[(id(fmt), key)] = (fmt, value)  # (fmt kept alive, so its id stays its own)
    return value


_FIT_CACHE: dict = {}


def fit_format(fmt: Format, ndim: int) -> Format:
    """fmt usable on a tensor of ``ndim`` dims: a block axis it lacks becomes the last one. A
    2D block format (block_shape r x c) on fewer than 2 dims becomes the 1D blocks of one row
    of its tiles (c elements, or r with its cols along dim -2); on 2+ dims it is kept (an axis
    that is not one of the last two dims, e.g. a conv weight's K, is a FormatError when
    rounding: tiles along other dims would be a silent other blocking)."""
    if not fmt.is_block or fmt.axis is None:
        return fmt
    if fmt.block_shape is None:
        if -ndim <= fmt.axis < ndim or ndim == 0:
            return fmt
    elif ndim >= 2 and -ndim <= fmt.axis < ndim:
        return fmt  # (an axis that is not one of the last two: round_payload says so, FormatError)
    hit = _FIT_CACHE.get((id(fmt), ndim))
    return hit[1] if hit is not None else _shared(_FIT_CACHE, "fit", fmt, ndim,
                                                  lambda: _fitted(fmt, ndim))


def _fitted(fmt: Format, ndim: int) -> Format:
    if fmt.block_shape is None or ndim >= 2:
        return fmt.replace(axis=-1)
    r, c = fmt.block_shape  # one row of tiles; which of r, c runs along the row: axis -1 or -2
    along_row = c if fmt.axis in (-1, 1) else r  # (1: the last dim of a matrix)
    return fmt.replace(block_shape=None, block_size=along_row, axis=-1)


_AXIS_CACHE: dict = {}


def with_axis(fmt: Format, axis: int) -> Format:
    """A block format blocked along ``axis`` (axis=None formats, per-tensor, are kept)."""
    if not fmt.is_block or fmt.axis is None or fmt.axis == axis:
        return fmt
    hit = _AXIS_CACHE.get((id(fmt), axis))
    return hit[1] if hit is not None else _shared(_AXIS_CACHE, "axis", fmt, axis,
                                                  lambda: fmt.replace(axis=axis))


_KERNEL_CALLS: dict = {}


def _plan(fmt):
    """(whether fmt's own rounding is stochastic, its kernel calls or None) of a format, derived
    once per format object (cached by id: a format's own hash walks all its fields)."""
    hit = _KERNEL_CALLS.get((id(fmt), None))
    return hit[1] if hit is not None else _shared(_KERNEL_CALLS, "kernel", fmt, None,
                                                  lambda: _make_plan(fmt))


def _make_plan(fmt):
    stochastic = is_stochastic(fmt.rounding)
    # (2D tiles have no op of their own)
    return stochastic, None if stochastic or fmt.is_tiled else _kernel_calls(fmt)


_OP_ARGS: dict = {}


def _op_args(fmt):
    """op_args(fmt), derived once per format object (not while dynamo traces: a format it
    made would have to be rebuilt from the cache, which it cannot do)."""
    if torch.compiler.is_dynamo_compiling():
        return op_args(fmt)
    hit = _OP_ARGS.get((id(fmt), None))
    return hit[1] if hit is not None else _shared(_OP_ARGS, "op", fmt, None, lambda: op_args(fmt))


def _kernel_call(fmt, inplace=False):
    """(the op overload's function, trailing args) of the fused kernel for a deterministic
    format in its own rounding (its in-place variant with ``inplace``): building them costs
    more than rounding a small tensor. (The function is OpOverload.__call__'s own, called
    without that frame.)"""
    return _plan(fmt)[1][inplace]


def _kernel_calls(fmt):
    if fmt.is_two_level:  # TE's two-level rule: no fused kernel
        return ((lambda x, *a: _round(x, fmt, fmt.rounding, 0, None), ()),
                (lambda x, *a: _round_(x, fmt, fmt.rounding, 0), ()))
    name, args = op_args(fmt)
    args = (*args, _ROUNDING_CODE[fmt.rounding], 0)
    op, op_ = (getattr(torch.ops.qtensor, name).default._op,
               getattr(torch.ops.qtensor, name + "_").default._op)
    if reference.needs_sign_fixup(fmt):  # P3109, UE5M3: the signed kernel, then the signs
        kernel = op

        def op(x, *a):
            return reference.sign_fixup(x, kernel(x, *a), fmt, fmt.rounding)

        def op_(x, *a):
            return x.copy_(op(x, *a))
    return (op, args), (op_, args)


# Formats that are exactly a torch dtype: rounding a float32 tensor to them is a cast down and
# back (one rounding, round-to-nearest-even, the same bits as the kernel, NaN by position: tested
# in tests/tensor/test_tensor.py), which runs at memory speed. Keyed by the preset objects' ids
# (qt.format and the presets hand out these very objects); an equal format built otherwise takes
# the kernel.
_CAST_DTYPES = {id(PRESETS[name]): dt for name, dt in (
    ("bf16", torch.bfloat16), ("fp16", torch.float16),
    ("fp8_e4m3", torch.float8_e4m3fn), ("fp8_e5m2", torch.float8_e5m2))}
# ... except where the cast is slow: torch's CPU casts to the float8 dtypes convert element by
# element (torch 2.13: 6-35x slower than the quantize_float kernel, which gives the same bits),
# so eager CPU payloads take the kernel for those two.
_SLOW_CPU_CASTS = frozenset({torch.float8_e4m3fn, torch.float8_e5m2})

_CPU_KERNELS = kernels_available("cpu")
_increment_version = getattr(torch._C, "_increment_version", torch.autograd.graph.increment_version)


def eager_cpu_kernel(x) -> bool:
    """Whether x is an eager CPU tensor that the compiled C++ kernels take (not inside
    qtensor.kernels.gpu.force, where the Triton kernels take CPU tensors)."""
    return (_CPU_KERNELS and type(x) is torch.Tensor and x.is_cpu  # (.device costs more)
            and x.dtype in KERNEL_DTYPES and not gpu._forced)


def _traced_float_args(x, fmt):
    """round_float's arguments after x for a traced float32 payload in a scalar float format
    that the short form covers, else None."""
    if (not fmt.is_float or x.dtype is not torch.float32 or type(x) is torch.Tensor
            or reference.needs_sign_fixup(fmt)
            or x.device.type != "cpu" or not _CPU_KERNELS or is_stochastic(fmt.rounding)):
        return None
    args = _kernel_call(fmt)[1][:-1]  # (man, emin, subnormals, max, overflow, unsigned, rounding)
    return args if decompositions.fast_float_applies(*args[:3], args[5], args[6]) else None


# ---------------------------------------------------------------------------------------------
# Seeds of stochastic rounding, eager and traced

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


DRAWN_IN_GRAPH = _DrawnInGraph()
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


def _drawn_seed(x, fmt):
    """The seed of a stochastic rounding of the payload x that names none: drawn from torch's
    default generator (eager), drawn by the graph (seeds_in_graph), else refused (traced)."""
    if type(x) is not torch.Tensor or torch.compiler.is_compiling():
        if seeds_in_graph():
            return DRAWN_IN_GRAPH
        raise stochastic_under_tracing(fmt)
    return reference.draw_seed(None)


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


# ---------------------------------------------------------------------------------------------
# The general rounding: any format, rounding mode, seed, dtype and device

def _use_kernel(x: torch.Tensor, fmt: Format, rounding: str) -> bool:
    if x.dtype not in KERNEL_DTYPES:
        return False
    if fmt.is_two_level:
        return False  # TE's two-level rule: two_level
    if x.device.type == "meta":
        return _C is not None
    if gpu.takes(x):  # the Triton kernels (what they do not cover goes to the reference)
        ok = gpu.covers(fmt, rounding)
    else:
        ok = _C is not None and kernels_available(x.device)
    # on CUDA the family must first agree with the reference there (qtensor/kernels/selfcheck.py)
    return ok and selfcheck.trusted(x.device.type, selfcheck.family(fmt, rounding), x.device)


def _is_traced(x) -> bool:
    """Whether x is a tracing payload (FakeTensor, or a functional wrapper of one): AOTAutograd
    and export traces, where the roundings become graph nodes."""
    if type(x) is torch.Tensor:
        return False
    from torch._subclasses.fake_tensor import is_fake
    return is_fake(x)


def _round_tiles(x, fmt: Format, rounding: str, seed: int, out=None) -> torch.Tensor:
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


def _round(x, fmt: Format, rounding: str, seed, out) -> torch.Tensor:
    """x rounded to fmt by ``rounding`` with ``seed`` (into ``out`` if given), outside autograd."""
    if seed is DRAWN_IN_GRAPH:
        q = torch.ops.qtensor_ops.round_drawn(x.detach(), list(getattr(_AFTER, "tensors", ())),
                                              str(fmt), rounding)
        return q if out is None else out.copy_(q)
    if fmt.is_two_level:
        return two_level(x, fmt, rounding, seed, out=out)
    if fmt.is_tiled:
        return _round_tiles(x, fmt, rounding, seed, out)
    if not _use_kernel(x, fmt, rounding):
        q = reference.quantize_with_seed(x, fmt, rounding, seed)
        return q if out is None else out.copy_(q)
    name, args = _op_args(fmt)
    args = (*args, rounding_code(rounding), seed_arg(seed))
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


def _round_(x, fmt: Format, rounding: str, seed) -> torch.Tensor:
    """x rounded to fmt in place (as _round), outside autograd."""
    if seed is DRAWN_IN_GRAPH:
        with torch.no_grad():
            return x.copy_(_round(x, fmt, rounding, seed, None))
    if fmt.is_two_level:
        with torch.no_grad():  # (in place: the kernel reads each block before writing it)
            if x.is_neg() or x.is_conj() or torch.compiler.is_compiling() or _is_traced(x):
                return x.copy_(two_level(x, fmt, rounding, seed))
            two_level(x, fmt, rounding, seed, out=x)
        if not torch.compiler.is_compiling():
            torch.autograd.graph.increment_version(x)
        return x
    if fmt.is_tiled:
        with torch.no_grad():  # (copy_ bumps x's version)
            return _round_tiles(x, fmt, rounding, seed, out=x)
    if not _use_kernel(x, fmt, rounding):
        with torch.no_grad():
            return x.copy_(reference.quantize_with_seed(x, fmt, rounding, seed))
    if reference.needs_sign_fixup(fmt):
        with torch.no_grad():
            return x.copy_(_round(x, fmt, rounding, seed, None))
    name, args = _op_args(fmt)
    args = (*args, rounding_code(rounding), seed_arg(seed))
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


def two_level(x, fmt: Format, rounding: str, seed, tensor_scale=None, with_scale=False,
              out=None, block_scales=False, checked=True, tensor_amax=None):
    """x rounded to a two-level format by TE's rule (reference.quantize_two_level, the spec): the
    values (into ``out`` if given), or (values, decode tensor scale), and with block_scales each
    block's scale X as the reference gives them. The fused kernel (qtensor::quantize_two_level on
    CPU, the Triton one where qtensor.kernels.gpu takes x) where one takes x, else the reference
    with its scalar roundings by the compiled kernels. checked=False: the kernel without its
    first-use check (qtensor.kernels.selfcheck; the check itself calls it). tensor_amax: the amax
    of a whole tensor that x is a part of (its scale is that tensor's; the reference)."""
    x = x.detach()
    geom = None if seed is DRAWN_IN_GRAPH or tensor_amax is not None else _two_level_geom(x, fmt)
    if geom is not None and checked and not selfcheck.trusted(x.device.type, "two_level",
                                                              x.device):
        geom = None
    if geom is None:
        r = reference.quantize_two_level(x, fmt, rounding, seed, tensor_scale,
                                         rnd=round_scalar32, block_scales=block_scales,
                                         tensor_amax=tensor_amax)
        q = r[0] if out is None else out.copy_(r[0])
    else:
        if fmt.axis is not None and x.dim() > 0:
            check_axis(x, fmt)
        ts = None
        if tensor_scale is not None:
            ts = reference.check_tensor_scale(tensor_scale, fmt).to(x.device)
        elem, elem_max, scale, smax = fmt.elem_scale_args()
        args = (elem, elem_max, SCALE_RULE_CODES[fmt.scale_rule], scale, smax, geom,
                float(fmt.tensor_scale_bound), fmt.settle, ts, block_scales,
                rounding_code(rounding), seed_arg(seed))
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


def two_level_nblocks(numel: int, geom) -> int:
    """How many blocks the two-level kernel rounds for ``numel`` elements laid out as ``geom``."""
    R, C, tr, tc = geom
    return numel // (R * C) * -(-R // tr) * -(-C // tc)


def _two_level_geom(x, fmt: Format):
    """The blocks of x as the two-level kernel takes them, [rows, cols, tr, tc]: the tr x tc
    tiles of x viewed as [-1, rows, cols] (reference.block_layout's and tile_blocks's blocks);
    None where no kernel takes x (the C++ one on CPU, the Triton one where qtensor.kernels.gpu
    takes x; another dtype, an element or scale format it has no rounding for): the reference
    then."""
    kernel = gpu.takes(x) or (_C is not None and x.device.type == "cpu")
    if not kernel or x.dtype not in KERNEL_DTYPES or x.dim() > 16 or x.numel() == 0:
        return None
    if reference.needs_sign_fixup(fmt.elem):
        return None
    # (a scale is rounded as a signed format with zero; FP32 scales' grid: the reference)
    if fmt.fp32_scales or not fmt.amax_scale_format.has_zero:
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


def _two_level_block_scales(X, x, fmt: Format, geom):
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


def round_scalar32(t: torch.Tensor, fmt, rounding: str, index, seed,
                   inplace: bool = False) -> torch.Tensor:
    """reference.round_scalar32 by the compiled kernels (the same bits) where they cover it:
    the two-level rule's scale and element roundings (inplace: into t)."""
    if index is not None or not _use_kernel(t, fmt, rounding):
        return reference.round_scalar32(t, fmt, rounding, index, seed)
    seed = 0 if seed is None else seed
    if inplace and not (torch.compiler.is_compiling() or _is_traced(t)):
        return _round_(t, fmt, rounding, seed)
    return _round(t, fmt, rounding, seed, None)


def round_with_scale(x, fmt: Format, rounding: Optional[str] = None, seed=None,
                     tensor_scale=None, tensor_amax=None):
    """(x rounded to the two-level format fmt, its FP32 decode tensor scale): TE's rule, under
    ``tensor_scale`` if given (else the scale of x's amax; of ``tensor_amax``, a whole tensor's
    amax, for a part of it); rounding and seed as round_payload's."""
    if rounding is None:
        rounding = fmt.rounding
    if seed is None:
        seed = _drawn_seed(x, fmt) if is_stochastic(rounding) else 0
    return two_level(x, fmt, rounding, seed, tensor_scale, with_scale=True,
                     tensor_amax=tensor_amax)


# ---------------------------------------------------------------------------------------------
# Payload layouts: block axes that are not the innermost contiguous dim

# Eager CPU blocks along a strided axis of a dense tensor with another contiguous dim go to the
# kernel as they lie (its tiles: csrc/quantize_cpu.h, blocks_tiled) instead of through a
# transposing copy; False takes the copy (the same bits: tests/kernels/test_strided_blocks.py).
STRIDED_BLOCKS = True


def _strided_blocks(x, fmt, ax):
    """x (a dense eager CPU tensor) rounded to the deterministic 1D-block format fmt along its
    non-innermost axis ax by the kernel's tiles, in x's layout; None where they do not apply."""
    if x.is_contiguous():
        xp, perm = x, None
    else:  # a permutation of a contiguous tensor (e.g. W.mT): round that, permute back
        perm = sorted(range(x.dim()), key=lambda d: (-x.stride(d), d))
        xp = x.permute(perm)
        if not xp.is_contiguous():
            return None
        ax = perm.index(ax)
    n = xp.dim()
    # the tiles need the block axis strided and a contiguous dim besides it (the kernel's lanes:
    # the last dim of size > 1); where the axis is the innermost, the flat kernel is faster
    if ax == n - 1 or not any(xp.size(d) > 1 for d in range(ax + 1, n)):
        return None
    op, args = _kernel_call(with_axis(fmt, ax - n))
    q = op(xp, *args)
    if perm is None:
        return q
    inv = [0] * n
    for i, d in enumerate(perm):
        inv[d] = i
    return q.permute(inv)


def tiles_in_place(out, fmt) -> bool:
    """Whether the in-place kernel rounds the contiguous ``out`` along its non-innermost block
    axis by its tiles (STRIDED_BLOCKS), with no copy: a dim of size > 1 after the axis."""
    ax = fmt.axis % out.dim()
    return (STRIDED_BLOCKS and fmt.scale_rule != "4over6"
            and any(out.size(d) > 1 for d in range(ax + 1, out.dim())))


# ---------------------------------------------------------------------------------------------
# The entry

def round_payload(x: torch.Tensor, fmt: Format, keep_layout: bool = True, tiles: bool = True, *,
                  rounding: Optional[str] = None, seed=None,
                  out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x (a plain tensor of a float dtype) rounded to ``fmt``, which the caller has fitted to
    x's dims (fit_format) and checked; no argument is checked here.

    rounding: the mode, if not fmt's own. seed: the stochastic-rounding seed; None draws one
    from torch's default generator where the mode is stochastic (in the graph under
    AOTAutograd; refused on other traced payloads). out: round into it (``out=x``: in place,
    and x is returned). A rounding mode or a seed given (the public entry points give theirs)
    takes the general rounding (_round: the kernels' functional layout, traced qt.quantize's
    ops); the payload roundings of QTensor ops (seed None, fmt's own mode) also take the torch
    casts and the cached kernel calls, and the layouts below.

    Deterministic payload roundings, not into ``out``, along a block axis other than
    the innermost contiguous one: eager CPU tensors that are dense with another contiguous dim
    (a matrix with blocks along its first dim, a transposed view with blocks along its last) go
    to the kernel as they lie (STRIDED_BLOCKS: tiles across the contiguous dim), the result in
    x's layout. Others are rounded on a view that makes the block axis innermost (a transposing
    copy; the blocks, hence the bits, are the same): keep_layout=False (contraction operands,
    consumed at once) returns that layout as it is; otherwise the result gets x's layout back
    when x was contiguous. tiles=False (convolution operands: convolutions pick their
    algorithm, hence their last bits, by layout) keeps the copy's layout.
    """
    if rounding is None:
        rounding = fmt.rounding
    if seed is not None or rounding != fmt.rounding:  # the caller's seed or mode: the general rounding
        if seed is None:
            seed = _drawn_seed(x, fmt) if is_stochastic(rounding) else 0
        return _round_(x, fmt, rounding, seed) if out is x else _round(x, fmt, rounding, seed, out)
    block = fmt.is_block
    if fmt.is_tiled:
        # a fitted 2D format can still have its axis off the last two dims (a conv weight's K):
        # tiles along other dims would be a silent other blocking
        check_axis(x, fmt)
    if _plan(fmt)[0]:  # stochastic
        seed = _drawn_seed(x, fmt)
        return _round_(x, fmt, rounding, seed) if out is x else _round(x, fmt, rounding, seed, out)
    if out is not None:
        if out is x:
            _round_in_place(x, fmt)
            return x
        return _round(x, fmt, rounding, 0, out)
    if block and fmt.axis is not None and x.dim() > 1:
        ax = fmt.axis % x.dim()
        # (2D tiles: only their own two dims may be swapped)
        if (ax != x.dim() - 1 or not x.is_contiguous()) and (
                fmt.block_shape is None or ax == x.dim() - 2):
            if (STRIDED_BLOCKS and tiles and fmt.block_shape is None and fmt.scale_rule != "4over6"
                    and eager_cpu_kernel(x)):
                q = _strided_blocks(x, fmt, ax)
                if q is not None:
                    return q
            xm = x.movedim(ax, -1)
            inner = with_axis(fmt, -1)
            if not xm.is_contiguous() and eager_cpu_kernel(xm) and fmt.block_shape is None:
                # the copy is ours: round it in place (a second buffer of that size costs
                # more than the rounding, in allocation and page faults)
                xm = xm.contiguous()
                op, args = _kernel_call(inner, inplace=True)
                op(xm, *args)
                q = xm.movedim(-1, ax)
            else:
                q = _round_flat(xm.contiguous(), inner).movedim(-1, ax)
            return q.contiguous() if keep_layout and x.is_contiguous() else q
    return _round_flat(x, fmt)


def _round_flat(x: torch.Tensor, fmt: Format) -> torch.Tensor:
    """x rounded to fmt in its own deterministic mode, in the layout the kernel gives."""
    if fmt.is_tiled:
        return _round(x, fmt, fmt.rounding, 0, None)
    if x.dtype is torch.float32:
        dt = _CAST_DTYPES.get(id(fmt))
        if dt is not None:
            if type(x) is not torch.Tensor:
                return _round_to_dtype(x, dt)  # traced (fake/functional payloads)
            if dt not in _SLOW_CPU_CASTS or not eager_cpu_kernel(x):
                return x.to(dt).to(torch.float32)  # eager
    if _CPU_KERNELS and x.dtype in KERNEL_DTYPES and x.device.type == "cpu" and not gpu._forced:
        if type(x) is not torch.Tensor:  # traced: scalar float formats as a fusable op
            fargs = _traced_float_args(x, fmt)
            if fargs is not None:
                return round_float(x, *fargs)
        op, args = _kernel_call(fmt)
        return op(x, *args)
    return _round(x, fmt, fmt.rounding, 0, None)


def _round_in_place(data, fmt, kernel=None) -> None:
    """data rounded in place to fmt in its own deterministic mode; ``kernel``: whether the
    in-place kernels take it, where the caller knows (an eager CPU tensor, no 2D tiles)."""
    dt = _CAST_DTYPES.get(id(fmt)) if data.dtype is torch.float32 else None
    if kernel is None:
        kernel = eager_cpu_kernel(data) and not fmt.is_tiled
    if dt is not None and not (kernel and dt in _SLOW_CPU_CASTS):
        data.copy_(data.to(dt) if type(data) is torch.Tensor else _round_to_dtype(data, dt))
    elif kernel and data.is_contiguous() and not data.is_neg():
        op, args = _kernel_call(fmt, inplace=True)
        op(data, *args)
        _increment_version((data,))  # (torch.autograd.graph.increment_version's own call)
    elif type(data) is not torch.Tensor and _traced_float_args(data, fmt) is not None:
        data.copy_(round_float(data, *_traced_float_args(data, fmt)))  # traced: fusable
    elif data.is_contiguous():
        _round_(data, fmt, fmt.rounding, 0)
    else:
        data.copy_(round_payload(data, fmt))


def round_fresh_in_place(out, fmt) -> None:
    """An op's own new output ``out`` (contiguous, not a negated view, eager on CPU where the
    kernels take it: eager_cpu_kernel), rounded in place to fmt in its own deterministic mode,
    with no 2D tiles and any block axis either innermost or one tiles_in_place takes."""
    _round_in_place(out, fmt, kernel=True)
