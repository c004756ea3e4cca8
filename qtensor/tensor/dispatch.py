"""The op rules of QTensor: which ops move data, which compute, which contract.

``QTensor.__torch_dispatch__`` calls :func:`dispatch`. Every aten op that reaches it is classified
once (the rule is cached per op overload) and handled by one of four paths:

1. non-floating outputs (comparisons, indices, shapes) are returned plain;
2. data-movement ops (``MOVE``) keep values and format; they round only values not already in the
   output's format, and re-round block formats whose blocks they regroup;
3. every other floating op computes on the payloads in high precision and rounds each floating
   output to the output format with one fused kernel (unlisted ops included; unlisted
   CompositeImplicitAutograd ops, which reach dispatch only under torch.export's decompositions,
   are decomposed first, as eager does);
4. contractions (``CONTRACT``) round each operand that has an ``mm_fmt`` along that op's reduction
   dimension, per use, accumulate in the payload precision (or by ``QTensor.accum``) and round
   the output to ``fmt``.

The output takes the format of the first QTensor operand (of the multiplied operands for addmm-like
ops); in-place ops and ``out=`` round into the destination's format. The full rules (mixed
formats, block axes, contraction blockings, the MX linear layer): docs/dispatch.md.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Optional, Union

import torch
from torch.utils._python_dispatch import return_and_correct_aliasing

from ..accum import lowering as _accum
from . import block_specials as _block_specials
from . import collectives as _collectives
from . import gemm as _gemm
from . import shards as _shards
from ..kernels import backend as _backend
from ..kernels.backend import eager_cpu_kernel as _eager_cpu_kernel, fit_format, with_axis
from ..kernels.checks import FLOAT_DTYPES
from ..formats.base import is_stochastic
from .payloads import (quantize, round_fresh as _round_fresh, round_inplace as _round_inplace,
                       unwrap as _unwrap, whole_of as _whole_of)

aten = torch.ops.aten
_compiler = torch.compiler  # (its _is_exporting_flag is what is_exporting() returns)

__all__ = ["dispatch", "OPS", "OpRule", "MOVE", "CONTRACT", "rule_of", "FLOAT_DTYPES"]

# Op kinds (those from FOREACH on take paths of their own).
COMPUTE, MOVE_KIND, CONTRACT_KIND, FOREACH, DECOMPOSE, COLLECTIVE = 0, 1, 2, 3, 4, 5

# How an op's output keeps the block axis of a BlockFormat (OpRule.block).
KEEP, TRANSPOSE, STACK = "keep", "transpose", "stack"


@dataclasses.dataclass(frozen=True)
class OpRule:
    """The table entry of one op (an overload packet: every overload of it, unless noted)."""

    kind: int = COMPUTE  # MOVE_KIND, CONTRACT_KIND or COMPUTE (_foreach_* ops: see Rule)
    # MOVE: overloads that write a Python scalar into the data: they compute (round the value)
    compute_overloads: frozenset = frozenset()
    # MOVE: moves only where move_if(payload args, payload kwargs, source QTensor), else computes
    move_if: Optional[Callable] = None
    # CONTRACT: ((arg position, reduction axis), ...) of the operands rounded to their mm_fmt,
    # the same for the .out overloads; or a function of the args that gives them
    operands: Union[tuple, Callable, None] = None
    # arg positions whose QTensor gives the output format before the first QTensor in arg order
    order: Optional[tuple] = None
    # KEEP: a move that keeps every element's block (a copy, or a reshape _block_axis_out
    # follows); other moves of block-formatted values (cat, index, gather, sort, roll, pooling,
    # ...) may regroup them into blocks they are not representable in (a block's shared scale
    # comes from its largest element), so their outputs are re-rounded. TRANSPOSE: the block
    # axis moves with the data. STACK: the op's dim is a new one.
    block: Optional[str] = None
    # CONTRACT: replaces rounding the operands and running the op (registered by _handles):
    # handler(func, args, payload args, payload kwargs, accumulator or None, the QTensor class)
    # -> output
    handler: Optional[Callable] = None


# Arguments on which a rule depends.
def _same_dtype(args, kwargs, src):  # _to_copy: a dtype change is a cast, which may round
    dt = kwargs.get("dtype")
    return dt is None or dt == src.dtype


def _no_accumulate(args, kwargs, src):  # index_put(self, indices, values, accumulate)
    return not (args[3] if len(args) > 3 else kwargs.get("accumulate", False))


def _zero_pad(args, kwargs, src):  # constant_pad_nd(self, pad, value)
    return (args[2] if len(args) > 2 else kwargs.get("value", 0)) == 0


def _conv_operands(args):  # convolution(input, weight, bias, ..., transposed, ...)
    transposed = bool(args[6]) if len(args) > 6 else False
    return ((0, 1), (1, 0 if transposed else 1))


def _op_table() -> dict:
    """The op rules, by overload packet name: one entry per op. Ops not listed compute."""
    table = {}

    def ops(names, **fields):
        for name in names.split():
            assert name not in table, name
            table[name] = OpRule(**fields)

    # Data movement: floating outputs are values of floating inputs (or zeros), rearranged.
    # Views and reshapes; joins and splits; rearrangements; indexing and scatters; selections;
    # shuffles, pads, max pools, nearest upsampling.
    ops("""
view _reshape_alias view_as expand expand_as broadcast_to slice select narrow narrow_copy squeeze
squeeze_ unsqueeze unsqueeze_ unfold diagonal as_strided as_strided_ movedim moveaxis swapaxes
swapdims flatten unflatten ravel positive conj_physical resolve_conj resolve_neg _conj slice_copy
select_copy unfold_copy diagonal_copy as_strided_copy split_copy split_with_sizes_copy unbind_copy
cat concat concatenate hstack vstack dstack column_stack split split_with_sizes chunk tensor_split
unbind
flip fliplr flipud roll rot90 repeat tile repeat_interleave tril triu tril_ triu_ block_diag diag
diag_embed diagflat
index _unsafe_index _unsafe_masked_index index_select gather take take_along_dim masked_select
embedding index_copy index_copy_ slice_scatter select_scatter diagonal_scatter as_strided_scatter
masked_scatter masked_scatter_ _foreach_copy_
max min amax amin maximum minimum fmax fmin sort msort topk kthvalue median nanmedian mode cummax
cummin
pixel_shuffle pixel_unshuffle channel_shuffle native_channel_shuffle im2col reflection_pad1d
reflection_pad2d reflection_pad3d replication_pad1d replication_pad2d replication_pad3d max_pool1d
max_pool2d max_pool3d max_pool2d_with_indices max_pool3d_with_indices adaptive_max_pool1d
adaptive_max_pool2d adaptive_max_pool3d upsample_nearest1d upsample_nearest2d upsample_nearest3d
_upsample_nearest_exact1d _upsample_nearest_exact2d _upsample_nearest_exact3d
""", kind=MOVE_KIND)
    ops("""
clone contiguous to copy copy_ detach detach_ lift_fresh lift_fresh_copy alias alias_copy
detach_copy view_copy _reshape_copy _unsafe_view reshape expand_copy squeeze_copy unsqueeze_copy
""", kind=MOVE_KIND, block=KEEP)
    ops("t t_ t_copy transpose transpose_ transpose_copy permute permute_copy",
        kind=MOVE_KIND, block=TRANSPOSE)
    ops("stack", kind=MOVE_KIND, block=STACK)
    ops("_stack", block=STACK)  # computes
    # Moves, except the overloads that write a Python scalar into the data: those compute.
    ops("masked_fill masked_fill_ fill_", kind=MOVE_KIND, compute_overloads=frozenset({"Scalar"}))
    ops("index_fill index_fill_", kind=MOVE_KIND, compute_overloads=frozenset({"int_Scalar"}))
    ops("scatter scatter_", kind=MOVE_KIND,
        compute_overloads=frozenset({"value", "value_reduce", "reduce"}))
    ops("where", kind=MOVE_KIND,
        compute_overloads=frozenset({"ScalarOther", "ScalarSelf", "Scalar"}))
    # Moves under a condition on the arguments (else they compute).
    ops("_to_copy", kind=MOVE_KIND, block=KEEP, move_if=_same_dtype)
    ops("index_put index_put_ _index_put_impl_", kind=MOVE_KIND, move_if=_no_accumulate)
    ops("constant_pad_nd", kind=MOVE_KIND, move_if=_zero_pad)

    # Contractions; those with an added term take the multiplied operands' format first.
    ops("mm", kind=CONTRACT_KIND, operands=((0, 1), (1, 0)))
    ops("bmm", kind=CONTRACT_KIND, operands=((0, 2), (1, 1)))
    ops("addmm _addmm_activation", kind=CONTRACT_KIND, operands=((1, 1), (2, 0)), order=(1, 2, 0))
    ops("baddbmm addbmm", kind=CONTRACT_KIND, operands=((1, 2), (2, 1)), order=(1, 2, 0))
    ops("mv", kind=CONTRACT_KIND, operands=((0, 1), (1, 0)))
    ops("addmv", kind=CONTRACT_KIND, operands=((1, 1), (2, 0)), order=(1, 2, 0))
    ops("dot vdot", kind=CONTRACT_KIND, operands=((0, 0), (1, 0)))
    ops("linear", kind=CONTRACT_KIND, operands=((0, -1), (1, 1)))
    ops("convolution _convolution", kind=CONTRACT_KIND, operands=_conv_operands)
    ops("convolution_backward", kind=CONTRACT_KIND)  # its handler: _convolution_backward
    ops("addr", order=(1, 2, 0))
    # grouped GEMMs: torch._grouped_mm and transformers' fallback ops (handlers: qtensor.tensor.grouped;
    # the backward's two outputs take grad_output's format)
    ops("_grouped_mm grouped_mm_fallback", kind=CONTRACT_KIND)
    ops("grouped_mm_fallback_backward", kind=CONTRACT_KIND, order=(3, 0, 1))
    return table


OPS = _op_table()
_COMPUTE_RULE = OpRule()


def _handles(packet):
    """Register the decorated function as the handler of the table entry of ``packet``."""
    def register(fn):
        OPS[packet] = dataclasses.replace(OPS[packet], handler=fn)
        return fn
    return register


@_handles("convolution_backward")
def _convolution_backward(func, args, uargs, ukwargs, acc, cls):
    # convolution_backward(grad_output, input, weight, bias_sizes, stride, padding, dilation,
    #                      transposed, output_padding, groups, output_mask)
    go, inp, w = args[0], args[1], args[2]
    own = [_own_mm_fmt(t, cls) for t in (go, inp, w)]
    # per-GEMM formats (qtensor.tensor.gemm): (grad_output, weight) of grad_input, (grad_output,
    # input) of grad_weight; else each operand's own
    own_mm_fmt = functools.partial(_own_mm_fmt, cls=cls)
    gi_fmts = _gemm.operand_formats((go, w), own_mm_fmt) or [own[0], own[2]]
    gw_fmts = _gemm.operand_formats((go, inp), own_mm_fmt) or [own[0], own[1]]
    gi_t, gw_t = _gemm.operand_transform((go, w)), _gemm.operand_transform((go, inp))
    if acc is not None:
        # the accumulator reads each operand's format from its mm_fmt: the ones of each product
        qargs = {True: _with_mm_fmts(args, (0, 2, 1), gi_fmts + [own[1]], cls),
                 False: _with_mm_fmts(args, (0, 1, 2), gw_fmts + [own[2]], cls)}

        def func(*a, **kw):  # noqa: F811  (the same op, its products summed by acc)
            return _accum.contract("convolution_backward", list(a), kw, acc, qargs[a[10][0]])
    if all(f is None for f in gi_fmts + gw_fmts) and gi_t is None and gw_t is None:
        return func(*uargs, **ukwargs)
    uargs = list(uargs)
    mask = list(uargs[10])
    transposed = bool(uargs[7])

    def rounded(i, fmt, axis, transform):
        x = uargs[i] if transform is None else transform.apply(uargs[i], axis)
        return x if fmt is None else quantize(x, with_axis(fmt, axis), keep_layout=False,
                                              tiles=False)

    gi = gw = gb = None
    if mask[0]:  # grad_input: reduction over output channels
        a = list(uargs)
        a[0], a[2], a[10] = (rounded(0, gi_fmts[0], 1, gi_t),
                             rounded(2, gi_fmts[1], 1 if transposed else 0, gi_t),
                             [True, False, False])
        gi = func(*a, **ukwargs)[0]
    if mask[1]:  # grad_weight: reduction over the batch
        a = list(uargs)
        a[0], a[1], a[10] = (rounded(0, gw_fmts[0], 0, gw_t), rounded(1, gw_fmts[1], 0, gw_t),
                             [False, True, False])
        gw = func(*a, **ukwargs)[1]
    if mask[2]:  # grad_bias: a sum of the grad_output values
        a = list(uargs)
        a[10] = [False, False, True]
        gb = func(*a, **ukwargs)[2]
    return (gi, gw, gb)


# Views of the table, by packet name (for qtensor.leaks and the tests).
MOVE = frozenset(p for p, r in OPS.items() if r.kind == MOVE_KIND)
CONTRACT = {p: r.operands if isinstance(r.operands, tuple) else None
            for p, r in OPS.items() if r.kind == CONTRACT_KIND}
MOVE_IF = {p: r.move_if for p, r in OPS.items() if r.move_if is not None}



class Rule:
    """What dispatch needs to know about one op overload: its table entry ``op`` (the kind
    refined by overload) and its schema's aliasing; computed once, cached."""

    __slots__ = ("kind", "moves", "name", "op", "mutated", "out_alias", "is_view", "inplace_view",
                 "order", "transpose", "returns_void", "dim_pos", "dim_default", "stacks",
                 "call", "single", "aliases_self")

    def __init__(self, func):
        packet = func._opname
        self.name = f"{packet}.{func._overloadname}"
        schema = func._schema
        op = self.op = OPS.get(packet, _COMPUTE_RULE)
        kind = op.kind
        if kind == MOVE_KIND and func._overloadname in op.compute_overloads:
            kind = COMPUTE
        if op is _COMPUTE_RULE and torch._C._dispatch_has_kernel_for_dispatch_key(
                func.name(), "CompositeImplicitAutograd"):
            # eager decomposes it before dispatch (conv2d into convolution, ...); it reaches us
            # only where torch.export keeps it (run_decompositions): decompose it the same way
            kind = DECOMPOSE
        if getattr(func, "namespace", None) in _collectives.NAMESPACES:
            kind = COLLECTIVE
        self.moves = kind == MOVE_KIND  # _foreach_copy_ too, whose kind is FOREACH
        self.kind = FOREACH if packet.startswith("_foreach_") else kind
        # mutated arguments: (position, name); outputs that alias them
        self.mutated = tuple((i, a.name) for i, a in enumerate(schema.arguments)
                             if a.alias_info is not None and a.alias_info.is_write)
        out_alias = []
        for r in schema.returns:
            idx = None
            if r.alias_info is not None and r.alias_info.is_write:
                for i, a in enumerate(schema.arguments):
                    if (a.alias_info is not None and a.alias_info.is_write
                            and set(a.alias_info.before_set) & set(r.alias_info.before_set)):
                        idx = (i, a.name)
                        break
            out_alias.append(idx)
        self.out_alias = tuple(out_alias) if any(x is not None for x in out_alias) else None
        self.returns_void = len(schema.returns) == 0
        self.is_view = bool(func.is_view)
        self.inplace_view = torch.Tag.inplace_view in func.tags
        self.order = op.order
        self.transpose = op.block == TRANSPOSE
        self.dim_pos = next((i for i, a in enumerate(schema.arguments) if a.name == "dim"), None)
        self.dim_default = (None if self.dim_pos is None
                            else schema.arguments[self.dim_pos].default_value)
        self.stacks = op.block == STACK  # its dim is a new one
        # the function that runs the op on payloads: OpOverload.__call__'s own (without its
        # frame), not where a subclass of OpOverload has a __call__ of its own
        self.call = func._op if type(func) is torch._ops.OpOverload else func
        # the fast path (_single_move) of a move whose one tensor argument is self and whose
        # one output is a tensor (views, reshapes, t, detach, clone, ...): the callable that
        # runs it on the payload, and whether its output aliases self (a view: its wrapper
        # must share the input wrapper's storage, as return_and_correct_aliasing makes it)
        self.single, self.aliases_self = None, False
        if (self.kind == MOVE_KIND and op.move_if is None and not self.mutated
                and not self.inplace_view and _one_tensor_in_one_out(schema)):
            if not self.is_view:
                self.single = _PAYLOAD_CALLS.get(self.name, self.call)
            elif _aliases_self_only(func):
                self.single, self.aliases_self = _PAYLOAD_CALLS.get(self.name, self.call), True


def _one_tensor_in_one_out(schema) -> bool:
    """Whether an op's only tensor argument is its first and it returns one tensor."""
    args, rets = schema.arguments, schema.returns
    return (len(rets) == 1 and str(rets[0].type) == "Tensor" and len(args) > 0
            and str(args[0].type) == "Tensor"
            and not any("Tensor" in str(a.type) for a in args[1:]))


def _aliases_self_only(func) -> bool:
    """Whether return_and_correct_aliasing does nothing for a view op but make its output share
    the storage of its first argument (what _single_move does instead)."""
    try:
        from torch.utils._python_dispatch import get_alias_info
        info = get_alias_info(func)
        return (list(info.read_only_alias_match_indexes) == [(0, 0)]
                and info.outs_write_aliases is None and not info.is_inplace_view_op)
    except Exception:  # noqa: BLE001 (another torch: the general path)
        return False


# The payload call of the hottest moves (by overload name): the Tensor method runs the same
# aten overload (tests/tensor/test_dispatch_fast.py checks each) at about half the Python cost of an
# OpOverload call, which parses its arguments against the schema. Other single moves call the
# overload's own function (OpOverload.__call__ without its frame).
_PAYLOAD_CALLS = {
    "view.default": torch.Tensor.view, "t.default": torch.Tensor.t,
    "transpose.int": torch.Tensor.transpose, "permute.default": torch.Tensor.permute,
    "expand.default": torch.Tensor.expand, "detach.default": torch.Tensor.detach,
    "unsqueeze.default": torch.Tensor.unsqueeze, "squeeze.dim": torch.Tensor.squeeze,
    "squeeze.dims": torch.Tensor.squeeze, "squeeze.default": torch.Tensor.squeeze,
    "select.int": torch.Tensor.select, "as_strided.default": torch.Tensor.as_strided,
    "unfold.default": torch.Tensor.unfold, "diagonal.default": torch.Tensor.diagonal,
    "clone.default": torch.Tensor.clone,
}


_RULES: dict = {}


def rule_of(func) -> Rule:
    """The cached rule of an op overload (kept on the overload object: its hash is slow)."""
    r = getattr(func, "_qtensor_rule", None)
    if r is None:
        r = _RULES[func] = Rule(func)
        try:
            func._qtensor_rule = r
        except AttributeError:
            pass
    return r


# ---------------------------------------------------------------------------------------------
# Formats of outputs

def _transposed_fmt(fmt, func, args, in_ndim):
    """(The block axis after transpose/t/permute, whether the values keep their blocks: 1D
    blocks always do; 2D tiles where their two dims stay the last two, e.g. W.t() or
    x.transpose(-1, -2), whose format is the same tiles with the axis on the other dim)."""
    if not fmt.is_block or fmt.axis is None or in_ndim < 2:
        return fmt, True
    ax = fmt.axis % in_ndim
    packet = func._opname
    if packet.startswith("permute"):
        perm = [d % in_ndim for d in args[1]]
    elif packet.startswith("transpose"):
        d0, d1 = args[1] % in_ndim, args[2] % in_ndim
        perm = list(range(in_ndim))
        perm[d0], perm[d1] = d1, d0
    else:  # t
        perm = [1, 0][:in_ndim]
    new = perm.index(ax)
    new_axis = -1 if new == in_ndim - 1 and fmt.axis < 0 else new
    if fmt.block_shape is not None and sorted(perm[-2:]) != [in_ndim - 2, in_ndim - 1]:
        return with_axis(fmt, -1), False  # the tiles' dims are no longer the last two
    return with_axis(fmt, new_axis), True


def _reshaped_axis(in_shape, a, out_shape, block_size):
    """The output dim that holds the same blocks as input dim ``a`` after a reshape, or None.

    Elements keep their row-major order, so dim a spans the flat range of rows [P, P*n). An
    output dim j holds the same blocks if it is that dim (same size, same prefix), or ends where
    it ends and splits it into rows of whole blocks or merges whole-block rows of it.
    """
    n = in_shape[a]
    pre_in = 1
    for d in in_shape[:a]:
        pre_in *= d
    end = pre_in * n
    pre = 1
    found = None
    for j, size in enumerate(out_shape):
        lo, pre = pre, pre * size
        if lo == pre_in and size == n:
            return j
        if (found is None and pre == end and block_size is not None and size and n
                and (size % n == 0 and n % block_size == 0
                     or n % size == 0 and size % block_size == 0)):
            found = j
    return found


def _block_axis_out(fmt, rule, args, kwargs, in_shape, out_shape):
    """(fmt with its block axis where the input's blocks went, whether they survived).

    Reshapes, views and (un)squeeze follow the dimension by shape; ops that remove their
    ``dim`` (reductions, select, unbind) or insert it (stack) shift it; broadcasting ops add
    dims in front (transposes: ``_transposed_fmt``).
    When the blocked dimension is gone (reduced over, or reshaped across blocks) the result is
    blocked along its last dimension and the blocks did not survive (the caller re-rounds).
    """
    nin, nout = len(in_shape), len(out_shape)
    if nin == 0 or tuple(in_shape) == tuple(out_shape):
        return fmt, True
    if fmt.block_shape is not None:  # 2D tiles: kept where the last two dims are unchanged
        if nin >= 2 and nout >= 2 and tuple(in_shape[-2:]) == tuple(out_shape[-2:]):
            return with_axis(fmt, fmt.axis % nin - nin), True
        return (with_axis(fmt, fmt.axis % nin - nin if nout >= 2 else -1),
                False)
    a = fmt.axis % nin
    new = None
    numel_in = numel_out = 1
    for d in in_shape:
        numel_in *= d
    for d in out_shape:
        numel_out *= d
    if nin != nout and numel_in == numel_out:
        new = _reshaped_axis(in_shape, a, out_shape, fmt.block_size)
        kept = new is not None
    else:
        if nin == nout:
            new = a
        elif rule.dim_pos is not None:
            dims = (args[rule.dim_pos] if rule.dim_pos < len(args)
                    else (kwargs or {}).get("dim", rule.dim_default))
            if dims is None or (not isinstance(dims, int) and len(dims) == 0):
                dims = range(nin)  # a full reduction
            elif isinstance(dims, int):
                dims = (dims,)
            if nout < nin and all(isinstance(d, int) for d in dims):  # dims removed
                removed = {d % nin for d in dims}
                if len(removed) == nin - nout and a not in removed:
                    new = a - sum(d < a for d in removed)
            elif nout == nin + 1 and rule.stacks and len(dims) == 1:  # a dim inserted
                new = a + (dims[0] % nout <= a)
        elif nout > nin:  # broadcast: dims are added in front
            new = a + nout - nin
        # the blocks survive only where the blocked dim keeps its length (not cat, index, ...)
        kept = new is not None and out_shape[new] == in_shape[a]
    if new is None:
        return with_axis(fmt, -1), False
    return with_axis(fmt, new - nout if fmt.axis < 0 else new), kept


# ---------------------------------------------------------------------------------------------
# Arguments

def _arg(args, kwargs, pos, name):
    if pos < len(args):
        return args[pos]
    return kwargs.get(name) if kwargs else None


def _first_q(rule, args, qs, cls):
    if rule.order is not None:
        for i in rule.order:
            if i < len(args) and isinstance(args[i], cls):
                return args[i]
    return qs[0]


def _device_error(func, args, kwargs, err, cls):
    """Re-raise a device mismatch naming the QTensors' devices and formats."""
    seen = []
    for a in list(args) + list((kwargs or {}).values()):
        items = a if isinstance(a, (list, tuple)) else (a,)
        for t in items:
            if isinstance(t, torch.Tensor) and t.dim() > 0:
                seen.append(t)
    devices = {t.device for t in seen}
    if len(devices) > 1:
        desc = ", ".join(
            f"QTensor(fmt={t.fmt}, mm_fmt={t.mm_fmt}) on {t.device}" if isinstance(t, cls)
            else f"plain {t.dtype} tensor on {t.device}" for t in seen)
        raise RuntimeError(f"{func}: tensors on different devices: {desc}") from err
    raise err


# ---------------------------------------------------------------------------------------------
# Contractions

# Operand roundings of parameters, kept until the parameter changes: a weight's rounding for
# its contraction is the same on every use while its values are (several microbatches, eval,
# both GEMMs of a weight blocked along the same dimension), so it is computed once. Kept on the
# parameter (QTensor ``_qt_operands``: {(format, view geometry): (versions, payload, rounded)}),
# valid while the parameter's version counter (bumped by every in-place op on it or its views)
# and its payload's (bumped by writes to the payload itself) are unchanged and the payload is the
# same tensor (``p.data = x`` replaces it). Not for stochastic rounding (each use draws anew),
# nor while tracing. Off by default (``CACHE_OPERANDS = True`` turns it on): writers that
# preserve version counters on purpose, FSDP2 refilling its unsharded parameters' storage on
# each all-gather, change a parameter unseen (tests/integrations/test_distributed.py's FSDP2 test trains
# with stale roundings with it on).
CACHE_OPERANDS = False


def _operand_cache_root(a, cls):
    """The parameter QTensor whose values the operand a (it, or a view of it) holds, or None."""
    root = a._base
    if root is None:
        root = a
    return root if getattr(root, "_is_param", False) and type(root) is cls else None


_OPERANDS_PER_TENSOR = 64  # rounded operands cached on one tensor


def _rounded_operand(a, x, fmt, cls, tiles=True):
    """x (the payload of the QTensor operand a) rounded to fmt for one contraction (tiles:
    quantize's)."""
    root = _operand_cache_root(a, cls) if CACHE_OPERANDS else None
    if (root is None or is_stochastic(fmt.rounding) or type(x) is not torch.Tensor
            or torch.compiler.is_compiling()):
        return quantize(x, fmt, keep_layout=False, tiles=tiles)
    base = root._data
    # (views made inside dispatch have no _base: their storage tells; a view of a payload
    # that ``p.data = x`` replaced holds the old storage)
    if x is not base and x.untyped_storage().data_ptr() != base.untyped_storage().data_ptr():
        return quantize(x, fmt, keep_layout=False, tiles=tiles)
    cache = root.__dict__.get("_qt_operands")
    if cache is None:
        cache = root.__dict__["_qt_operands"] = {}
    key = (id(fmt), x.storage_offset(), tuple(x.shape), x.stride(), tiles)
    versions = (root._version, base._version)
    hit = cache.get(key)
    if hit is not None:
        if hit[0] == versions and hit[1] is base and hit[3] is fmt:
            return hit[2]
        if hit[1] is not base:  # p.data = x: every entry is of the old payload
            cache.clear()
    q = quantize(x, fmt, keep_layout=False, tiles=tiles)
    if len(cache) >= _OPERANDS_PER_TENSOR:  # (views or formats made anew per call: bounded)
        cache.clear()
    cache[key] = (versions, base, q, fmt)  # (fmt: keeps it alive, so its id stays its own)
    return q


def _round_operand(args, uargs, pos, axis, cls, tiles=True):
    a = args[pos] if pos < len(args) else None
    if isinstance(a, cls) and a.mm_fmt is not None:
        uargs[pos] = _rounded_operand(a, uargs[pos], with_axis(a.mm_fmt, axis), cls, tiles)


def _own_mm_fmt(a, cls):
    """The operand format of a (None for a plain tensor; a GemmOperand's own format)."""
    if not isinstance(a, cls):
        return None
    m = a.mm_fmt
    return m.base if type(m) is _gemm.GemmOperand else m


def _round_gemm_operands(args, uargs, operands, cls, tiles=True):
    """Round the operands of a contraction one of which has per-GEMM formats (qtensor.tensor.gemm):
    the args with those formats as the operands' mm_fmt (what an accumulator reads), or None
    when none has."""
    ops = [args[pos] if pos < len(args) else None for pos, _axis in operands]
    fmts = _gemm.operand_formats(ops, functools.partial(_own_mm_fmt, cls=cls))
    if fmts is None:
        return None
    transform = _gemm.operand_transform(ops)  # on every operand along K, before rounding
    for (pos, axis), a, fmt in zip(operands, ops, fmts):
        if isinstance(a, torch.Tensor) and a.dtype in FLOAT_DTYPES:
            if transform is not None:
                uargs[pos] = transform.apply(uargs[pos], axis)
            if fmt is not None:
                fa = with_axis(fmt, axis)
                # (a transformed payload is a new tensor: no cache of the parameter's roundings)
                uargs[pos] = (_rounded_operand(a, uargs[pos], fa, cls, tiles)
                              if isinstance(a, cls) and transform is None
                              else quantize(uargs[pos], fa, keep_layout=False, tiles=tiles))
    return _with_mm_fmts(args, [pos for pos, _axis in operands], fmts, cls)


def _with_mm_fmts(args, positions, fmts, cls):
    """args with the QTensors at ``positions`` re-wrapped with the given mm_fmts (the formats
    their payloads were rounded to: qtensor.accum reads an operand's format from its mm_fmt)."""
    args = list(args)
    for pos, fmt in zip(positions, fmts):
        a = args[pos] if pos < len(args) else None
        if isinstance(a, cls):
            args[pos] = cls._wrap(a._data, a.fmt, fmt, accum=a.accum)
    return args


def _accum_of(args, cls):
    """The accumulator of the first QTensor among args that has one (qtensor.accum), or None."""
    for a in args:  # (a loop and ._accum: this runs on every op)
        if isinstance(a, cls) and a._accum is not None:
            return a._accum
    return None


def _contract(func, rule, args, kwargs, uargs, ukwargs, acc, cls):
    """The contraction's result; ``acc``: its operands' accumulator (_accum_of), or None."""
    if torch.compiler.is_compiling():  # (stochastic roundings traced after every operand)
        with _backend.after(uargs):
            return _contract_operands(func, rule, args, kwargs, uargs, ukwargs, acc, cls)
    return _contract_operands(func, rule, args, kwargs, uargs, ukwargs, acc, cls)


def _contract_operands(func, rule, args, kwargs, uargs, ukwargs, acc, cls):
    op = rule.op
    if op.handler is not None:
        return op.handler(func, args, uargs, ukwargs, acc, cls)
    operands = op.operands(args) if callable(op.operands) else op.operands
    # (a convolution picks its algorithm, hence its bits, by its operands' layout: the copy's)
    tiles = "convolution" not in func._opname
    tagged = _round_gemm_operands(args, uargs, operands, cls, tiles)
    if tagged is None:
        for pos, axis in operands:
            _round_operand(args, uargs, pos, axis, cls, tiles)
    else:
        args = tagged
    if acc is not None:  # the products summed by the operands' accumulator
        return _accum.contract(func._opname, uargs, ukwargs, acc, args)
    return func(*uargs, **ukwargs)



# ---------------------------------------------------------------------------------------------
# Output wrapping

def _owns(out, uargs, ukwargs) -> bool:
    """Whether out shares no storage with the tensors among the op's (payload) arguments (an
    op's own buffer, safe to round in place; a schema promises it for a computing op's
    outputs, and this checks it)."""
    ptr = out.untyped_storage().data_ptr()
    if ptr == 0:  # (no storage: nothing to gain)
        return False
    for inputs in (uargs, ukwargs.values()):
        for u in inputs:
            if not isinstance(u, torch.Tensor):
                continue
            if u is out or u.layout != torch.strided or u.is_nested:  # (sparse: no storage)
                return False
            if u.untyped_storage().data_ptr() == ptr:
                return False
    return True


def _wrap_out(cls, out, fmt, mm_fmt, rnd, func=None, fresh=None, tscale=None):
    """Wrap each floating tensor of out (a tensor, or a tuple/list of them); round if rnd.
    ``fresh``: the op's (payload args, payload kwargs) when its outputs are new tensors of its
    own (a computing op, no view, no mutation): those are rounded in place unless one of them
    shares an argument's storage."""
    if isinstance(out, torch.Tensor):
        if out.dtype in FLOAT_DTYPES and out.layout == torch.strided:  # sparse stays plain
            if out.is_nested:  # a QTensor cannot hold one; plain, it would compute in FP32
                raise NotImplementedError(
                    f"QTensor: an op made a nested tensor of QTensor values ({fmt}); nested "
                    "tensors cannot carry a number format. Pad the values instead (a "
                    "converted nn.TransformerEncoder does: it skips its nested fast path)")
            fmt = fit_format(fmt, out.dim())
            if fmt.is_two_level:  # values with their tensor scale (fresh unless one is given)
                if rnd:
                    before, (out, tscale) = out, _backend.round_with_scale(out, fmt,
                                                                           tensor_scale=tscale)
                    _block_specials.check(before, out, fmt, op=func)
                t = cls._wrap(out, fmt, mm_fmt)
                t._tscale = tscale
                return t
            if rnd:
                if fresh is not None and _eager_cpu_kernel(out) and _owns(out, *fresh):
                    out = _round_fresh(out, fmt, func)
                else:
                    before, out = out, _backend.round_payload(out, fmt)
                    if fmt.is_block:
                        _block_specials.check(before, out, fmt, op=func)
            if type(out) is torch.Tensor and not _compiler._is_exporting_flag:
                return cls._wrap_eager(out, fmt, mm_fmt)
            return cls._wrap(out, fmt, mm_fmt)
        return out
    if isinstance(out, (tuple, list)):
        return type(out)(_wrap_out(cls, o, fmt, mm_fmt, rnd, func, fresh, tscale) for o in out)
    return out


# Moves of one eager QTensor take _single_move (False: the general path, the same results:
# tests/tensor/test_dispatch_fast.py compares them).
FAST_MOVES = True


def _single_move(call, func, rule, a, data, args, kwargs, cls):
    """dispatch's fast path for a move of one eager QTensor ``a`` (Rule.single): what the general
    path does for it, with the steps that cannot apply left out (no other operand: no rounding
    unless its blocks are regrouped; one output; no mutation)."""
    out = call(data, *args[1:], **kwargs) if kwargs else call(data, *args[1:])
    fmt = a.fmt
    rnd = False
    if fmt.is_block:
        if fmt.axis is not None:
            fmt, rnd = _block_out(fmt, func, rule, args, kwargs, a, out, False)
        fmt = fit_format(fmt, out.dim())
    if (rnd or out.dtype not in FLOAT_DTYPES or out.layout != torch.strided
            or out.is_nested):  # (as the general path)
        out = _wrap_out(cls, out, fmt, a.mm_fmt, rnd, func)
        if not isinstance(out, cls):
            return out
    else:
        out = cls._wrap_eager(out, fmt, a.mm_fmt)
    if a._accum is not None:
        out._accum = a._accum
    if rule.is_view and fmt.is_block:  # (views of one-level block formats: their root's group)
        out._group = a._views_group()
    if rule.aliases_self:
        torch._functionalize_unsafe_set(out, a)  # (return_and_correct_aliasing's one step)
    return out


def dispatch(func, args, kwargs, cls):
    """QTensor.__torch_dispatch__: run func on payloads by its rule, round, re-wrap."""
    rule = getattr(func, "_qtensor_rule", None)
    if rule is None:
        rule = rule_of(func)
    if rule.single is not None and FAST_MOVES:
        a = args[0]
        data = getattr(a, "_data", None)
        # eager payloads only (traced ones take the general path), not while torch.export
        # traces (QTensor._wrap records the constructions)
        if (type(data) is torch.Tensor and type(a) is cls
                and not _compiler._is_exporting_flag and not a.fmt.is_two_level
                and a._tscale is None):
            return _single_move(rule.single, func, rule, a, data, args, kwargs, cls)
    if rule.kind >= FOREACH:
        if rule.kind == FOREACH:
            return _dispatch_foreach(func, rule, args, kwargs, cls)
        if rule.kind == DECOMPOSE:
            return func.decompose(*args, **(kwargs or {}))
        return _collectives.collective(func, args, kwargs, cls)
    qs = []
    uargs, ukwargs, plain = _unwrap(args, kwargs, qs, cls)
    acc = None
    try:
        if rule.kind == CONTRACT_KIND:
            # derived once: the operands' accumulator sums the products and the result carries
            # it on (a contraction's QTensors are its positional operands; an out= one is not)
            acc = _accum_of(args, cls)
            out = _contract(func, rule, args, kwargs, uargs, ukwargs, acc, cls)
        else:
            out = rule.call(*uargs, **ukwargs)
    except RuntimeError as err:
        if "device" in str(err):
            _device_error(func, args, kwargs, err, cls)
        raise

    src = qs[0] if rule.order is None else _first_q(rule, args, qs, cls)
    fmt, mm_fmt = src.fmt, src.mm_fmt
    if type(mm_fmt) is _gemm.GemmOperand and rule.kind != MOVE_KIND:
        mm_fmt = mm_fmt.base  # per-GEMM tags: kept by data movement only (qtensor.tensor.gemm)
    if rule.kind == MOVE_KIND:
        # values are moved, not computed: round only if they were not all in fmt already
        rnd = plain  # a plain floating tensor is among the inputs
        if not rnd:
            for q in qs:
                if q.fmt is not fmt and q.fmt != fmt:
                    rnd = True
                    break
        cond = rule.op.move_if
        if cond is not None and not rnd:
            rnd = not cond(uargs, ukwargs, src)
    else:
        rnd = True
    if fmt.is_block and fmt.axis is not None:
        fmt, rnd = _block_out(fmt, func, rule, uargs, ukwargs, src, out, rnd)
    tscale = None
    if fmt.is_two_level and rule.kind == MOVE_KIND:
        tscale, rnd = _moved_scale(func, qs, src, plain, rnd, uargs)

    if rule.mutated:
        return _finish_mutation(func, rule, args, kwargs, out, rnd, fmt, mm_fmt, cls)
    fresh = None
    if rnd and rule.kind != MOVE_KIND and not rule.is_view:  # its outputs are its own
        fresh = (uargs, ukwargs)
    shard = _shards.of_output(func, src, qs, out, rnd) if src._shard is not None else None
    if shard is not None and fmt.is_two_level:  # a shard's values: the whole tensor's scale
        if rnd:
            out, tscale = _shards.round_shard(out, fit_format(fmt, out.dim()), shard)
        out = _wrap_out(cls, out, fmt, mm_fmt, False, func, None, tscale)
        out._shard = shard
    else:
        out = _wrap_out(cls, out, fmt, mm_fmt, rnd, func, fresh, tscale)
    if rule.is_view and fmt.is_block:  # views: one scale group, their base's
        _set_on(out, "_group", src._group if fmt.is_two_level else src._views_group(), cls)
    if rule.kind != CONTRACT_KIND:
        acc = _accum_of(qs, cls)
    if acc is not None:  # results carry the accumulator on (activations, gradients)
        _set_on(out, "_accum", acc, cls)
    if rule.is_view and _has_q(out, cls):
        return return_and_correct_aliasing(func, args, kwargs, out)
    return out


# moves that take whole blocks along the block axis (the dim they select along is another)
_ROW_MOVES = frozenset({"index", "_unsafe_index", "index_select", "embedding", "cat", "concat",
                        "concatenate", "stack", "repeat", "tile"})


def _moved_scale(func, qs, src, plain, rnd, uargs):
    """A move of two-level QTensors (nvfp4): (the tensor scale its output keeps, whether to
    round). Inputs that share one tensor scale give it to the output; their values are not
    rounded again where the move takes whole blocks (indexing rows, embedding, cat along
    another dim), so that they never change; blocks regrouped along the block axis are rounded
    again under the shared scale. Different tensor scales, or plain values moved in: the result
    is rounded again under a fresh scale (of its own amax). A copy_ overwrites its destination:
    the destination's old scale has no say (_scale_into gives it the source's)."""
    if func.overloadpacket.__name__ == "copy_" and qs and uargs and qs[0]._data is uargs[0]:
        qs = qs[1:]
    scales = [q.tensor_scale for q in qs if q.fmt.is_two_level]
    if plain or not scales:
        return None, True
    s0 = scales[0]
    if any(s is not s0 and not bool(torch.equal(s, s0)) for s in scales[1:]):
        return None, True
    if rnd and _whole_blocks(func, uargs, src):
        rnd = False
    return s0, rnd


def _whole_blocks(func, uargs, src) -> bool:
    name = func.overloadpacket.__name__
    if name not in _ROW_MOVES or src.dim() == 0:
        return False
    nd = src.dim()
    ax = src.fmt.axis % nd
    if src.fmt.block_shape is not None:
        return False  # (2D tiles: rows are part of the block)
    if name == "embedding":
        return ax == nd - 1
    if name in ("index", "_unsafe_index"):
        idx = uargs[1] if len(uargs) > 1 else ()
        return len(idx) <= ax or idx[ax] is None
    if name == "index_select":
        return uargs[1] % nd != ax
    if name in ("cat", "concat", "concatenate"):
        dim = uargs[1] if len(uargs) > 1 else 0
        return dim % nd != ax
    return name in ("stack", "repeat", "tile") and (
        name == "stack" or (len(uargs) > 1 and list(uargs[1])[-(nd - ax)] == 1))


def _block_out(fmt, func, rule, uargs, ukwargs, src, out, rnd):
    """The output's block format, and whether to round: moved values whose blocks did not
    survive are re-rounded, except by views (they must alias their base)."""
    first = out
    if isinstance(out, (tuple, list)):  # values first (max.dim, sort); a list (split, unbind)
        first = next((o for o in out if isinstance(o, torch.Tensor)), None)
    if not isinstance(first, torch.Tensor):
        return fmt, rnd
    in_shape = src.shape  # the wrapper's: an in-place view op has changed the payload already
    if rule.transpose:
        fmt, kept = _transposed_fmt(fmt, func, uargs, len(in_shape))
        if not kept and not rule.is_view and not rule.inplace_view:
            rnd = True  # (a view must alias its base: its values stay)
        return fmt, rnd
    fmt, kept = _block_axis_out(fmt, rule, uargs, ukwargs, in_shape, first.shape)
    if (rule.kind == MOVE_KIND and not rule.is_view and not rule.inplace_view
            and not ((kept and rule.op.block == KEEP) or _pads_after(func, uargs))):
        rnd = True  # idempotent where the blocks happen to survive
    return fmt, rnd


def _pads_after(func, uargs) -> bool:
    """A zero padding (constant_pad_nd: a move only with value 0) after the last index of each
    dim: every block keeps its elements, its position and its amax, the tensor its amax (an
    uneven DTensor shard, padded before its all-gather, may be a piece of bigger blocks: rounded
    as blocks of its own, its values would change)."""
    if func.overloadpacket.__name__ != "constant_pad_nd" or len(uargs) < 2:
        return False
    pad = list(uargs[1])
    return all(p == 0 for p in pad[0::2]) and all(p >= 0 for p in pad[1::2])


def _set_on(out, name, value, cls):
    """Each QTensor of out (one, or a tuple/list of them) takes value as its attribute name."""
    if isinstance(out, cls):
        setattr(out, name, value)
    elif isinstance(out, (tuple, list)):
        for o in out:
            _set_on(o, name, value, cls)


def _has_q(out, cls):
    if isinstance(out, (tuple, list)):
        return any(isinstance(o, cls) for o in out)
    return isinstance(out, cls)


def _finish_mutation(func, rule, args, kwargs, out, rnd, fmt, mm_fmt, cls):
    """In-place and out= ops: round each QTensor destination into its own format."""
    for pos, name in rule.mutated:
        dst = _arg(args, kwargs, pos, name)
        targets = dst if isinstance(dst, (list, tuple)) else (dst,)
        for d in targets:
            if isinstance(d, cls):
                if tuple(d._data.shape) != tuple(d.shape) and not rule.inplace_view:
                    raise RuntimeError(
                        f"{func}: out= QTensor of shape {tuple(d.shape)} would have to be resized "
                        f"to {tuple(d._data.shape)}; pass an out tensor of the result's shape")
                if rnd or (not rule.inplace_view and _needs_round_into(d, args, kwargs, cls)):
                    _round_inplace(d, func)
                elif d.fmt.is_two_level and not rule.inplace_view:
                    _scale_into(d, func, args, kwargs, cls)
                elif d._group is not None and not rule.inplace_view:
                    # values of d's format, as blocks of their own, moved into a view of a
                    # one-level block format: the blocks of the whole that it cuts round again
                    _round_inplace(d, func, moved=True)
    if rule.inplace_view:
        if isinstance(args[0], cls):  # t_, unsqueeze_, ...: the block axis moves
            args[0].fmt = fmt
            g = args[0]._group
            if g is not None and g.root is args[0]._data:  # (the whole tensor's own payload)
                g.fmt = fmt
        return return_and_correct_aliasing(func, args, kwargs, out)
    if rule.returns_void:
        return None
    if rule.out_alias is None:  # fresh outputs besides the mutation (e.g. batch-norm stats)
        return _wrap_out(cls, out, fmt, mm_fmt, rnd, func)
    res = []
    outs = out if isinstance(out, (tuple, list)) else (out,)
    for o, alias in zip(outs, rule.out_alias):
        res.append(_arg(args, kwargs, alias[0], alias[1]) if alias is not None
                   else _wrap_out(cls, o, fmt, mm_fmt, rnd))
    return res[0] if len(res) == 1 else tuple(res)


def _scale_into(d, func, args, kwargs, cls) -> None:
    """Values of d's format moved into the two-level QTensor d: under d's tensor scale they
    stay; a copy_ brings its source's scale where d is all of the tensor it is a view of (its
    old values are overwritten), or the rest of that tensor is zeros (FSDP2 builds its shards
    so: zeros, then a chunk copied into a view of them; a zero padding keeps values and scale);
    other writes under another scale round the whole tensor again under a fresh one."""
    srcs = [t for a in list(args) + list((kwargs or {}).values())
            for t in (a if isinstance(a, (list, tuple)) else (a,))
            if isinstance(t, cls) and t is not d]
    ds = d.tensor_scale
    if all(bool(torch.equal(t.tensor_scale, ds)) for t in srcs):
        return
    if (func.overloadpacket.__name__ == "copy_" and len(srcs) == 1
            and tuple(srcs[0].shape) == tuple(d.shape)):
        whole, _fmt = _whole_of(d)
        if (whole is d._data or whole.numel() == d.numel()
                or int(torch.count_nonzero(whole)) == int(torch.count_nonzero(d._data))):
            d._tscale = srcs[0].tensor_scale
            return
    _round_inplace(d, func)


def _needs_round_into(dst, args, kwargs, cls) -> bool:
    """A data-movement op writing into dst: do the moved values have dst's format already?"""
    for a in list(args) + list((kwargs or {}).values()):
        items = a if isinstance(a, (list, tuple)) else (a,)
        for t in items:
            if t is dst:
                continue
            if isinstance(t, cls):
                if t.fmt != dst.fmt:
                    return True
            elif isinstance(t, torch.Tensor) and t.dtype in FLOAT_DTYPES:
                return True
    return False


# ---------------------------------------------------------------------------------------------
# _foreach_* ops: element i of every list belongs together (per-parameter formats)

def _dispatch_foreach(func, rule, args, kwargs, cls):
    lists = [a for a in args if isinstance(a, (list, tuple))]
    singles = [a for a in args if isinstance(a, cls)]
    n = len(lists[0]) if lists else 0
    qs = []
    uargs, ukwargs, _ = _unwrap(args, kwargs, qs, cls)
    out = func(*uargs, **ukwargs)
    move = rule.moves

    def source(i):
        for lst in lists:
            if i < len(lst) and isinstance(lst[i], cls):
                return lst[i]
        return singles[0] if singles else None

    if rule.mutated:
        dst_list = _arg(args, kwargs, rule.mutated[0][0], rule.mutated[0][1])
        for i, d in enumerate(dst_list):
            if isinstance(d, cls):
                if not move:
                    _round_inplace(d)
                else:
                    others = [lst[i] for lst in lists if lst is not dst_list and i < len(lst)]
                    if _needs_round_into(d, others, None, cls):
                        _round_inplace(d)
        if rule.returns_void:
            return None
        return dst_list
    res = []
    for i, o in enumerate(out):
        s = source(i) if i < n else None
        if s is None or not isinstance(o, torch.Tensor):
            res.append(o)
        elif (s._shard is not None and s.fmt.is_two_level and o.shape == s.shape
              and _shards.in_step() and _shards.live(s) is not None):  # the whole's scale
            fmt = fit_format(s.fmt, o.dim())
            v, tscale = _shards.round_shard(o, fmt, s._shard)
            res.append(_wrap_out(cls, v, fmt, s.mm_fmt, False, tscale=tscale))
            res[-1]._shard = s._shard
        else:
            res.append(_wrap_out(cls, o, s.fmt, s.mm_fmt, True))
    return type(out)(res) if isinstance(out, tuple) else res
