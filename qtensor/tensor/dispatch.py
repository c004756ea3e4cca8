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

import collections
import dataclasses
import functools
from typing import Callable, Optional, Union

import torch
from torch.utils._python_dispatch import return_and_correct_aliasing

from ..accum import lowering as _accum
from . import block_specials as _block_specials
from . import gemm as _gemm
from . import shards as _shards
from ..kernels import backend as _backend
from ..kernels.backend import eager_cpu_kernel as _eager_cpu_kernel, fit_format, with_axis
from ..kernels.checks import FLOAT_DTYPES
from ..kernels.reference import finite_amax
from ..formats.base import Format, is_stochastic

aten = torch.ops.aten
_compiler = torch.compiler  # (its _is_exporting_flag is what is_exporting() returns)

__all__ = ["dispatch", "OPS", "OpRule", "MOVE", "CONTRACT", "rule_of", "FLOAT_DTYPES"]

# Op kinds (those from FOREACH on take paths of their own).
COMPUTE, MOVE_KIND, CONTRACT_KIND, FOREACH, DECOMPOSE, COLLECTIVE = 0, 1, 2, 3, 4, 5

# torch.distributed's op namespaces: functional collectives (DTensor, FSDP2) and c10d's
_COLLECTIVE_NAMESPACES = frozenset({"_c10d_functional", "c10d"})

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
        if getattr(func, "namespace", None) in _COLLECTIVE_NAMESPACES:
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


def quantize(x: torch.Tensor, fmt: Format, keep_layout: bool = True,
             tiles: bool = True) -> torch.Tensor:
    """One rounding of a plain payload tensor to fmt, fitted to its dims (fit_format): the
    op rules' call of the rounding back end (qtensor.kernels.backend.round_payload, whose
    docstring tells keep_layout and tiles)."""
    return _backend.round_payload(x, fit_format(fmt, x.dim()), keep_layout, tiles)


def _round_fresh(out, fmt, func):
    """An op's own new output, an eager CPU tensor that the kernels take (_eager_cpu_kernel),
    rounded to fmt (fitted to it): in place where the kernels can (the same bits as
    ``quantize``, without a second buffer), else by ``quantize``; block formats are watched for
    NaN blocks (qtensor.tensor.block_specials)."""
    block = fmt.is_block
    if (is_stochastic(fmt.rounding) or not out.is_contiguous()
            or out.is_neg() or fmt.is_tiled
            or (block and fmt.axis is not None and out.dim() > 1
                and fmt.axis % out.dim() != out.dim() - 1
                and not _backend.tiles_in_place(out, fmt))):
        before, out = out, _backend.round_payload(out, fmt)
        if block:
            _block_specials.check(before, out, fmt, op=func)
        return out
    if (block and _block_specials.watching() and out.numel()
            and not torch.isfinite(out.sum())):  # an Inf or NaN may spread over its block
        before = out.clone()
        _backend.round_fresh_in_place(out, fmt)
        _block_specials.check(before, out, fmt, op=func)
        return out
    _backend.round_fresh_in_place(out, fmt)
    return out


def _round_inplace(q, func=None) -> None:
    """Round a QTensor's payload in place to its own format (after an in-place op)."""
    data = q._data
    fmt = fit_format(q.fmt, data.dim())
    if fmt.is_two_level:  # computed in place: a fresh tensor scale (a shard's: the whole's)
        shard = _shards.live(q) if q._shard is not None else None
        if shard is not None:
            v, q._tscale = _shards.round_shard(data, fmt, shard)
        else:
            v, q._tscale = _backend.round_with_scale(data, fmt)
        data.copy_(v)
        return
    if (fmt.is_block and _block_specials.watching() and type(data) is torch.Tensor
            and data.numel() and not torch.compiler.is_compiling()
            and not torch.isfinite(data.sum())):  # an Inf or NaN may spread over its block
        before = data.clone()
        _backend.round_payload(data, fmt, out=data)
        _block_specials.check(before, data, fmt, op=func)
        return
    _backend.round_payload(data, fmt, out=data)


# ---------------------------------------------------------------------------------------------
# Unwrapping

def _unwrap_list(seq, qs, cls):
    out = []
    plain = False
    for a in seq:
        if isinstance(a, cls):
            qs.append(a)
            out.append(a._data)
        else:
            if isinstance(a, torch.Tensor) and a.dtype in FLOAT_DTYPES:
                plain = True
            out.append(a)
    return out, plain


def _unwrap(args, kwargs, qs, cls):
    """(args, kwargs) with payloads in place of QTensors (one list level deep, as aten arguments
    are), appended to qs; and whether a plain floating tensor is among them (high-precision
    values meeting QTensors)."""
    plain = False
    uargs = []
    for a in args:
        if isinstance(a, cls):
            qs.append(a)
            uargs.append(a._data)
        elif isinstance(a, (list, tuple)):
            a, p = _unwrap_list(a, qs, cls)
            uargs.append(a)
            plain |= p
        else:
            if isinstance(a, torch.Tensor) and a.dtype in FLOAT_DTYPES:
                plain = True
            uargs.append(a)
    ukwargs = {}
    if kwargs:
        for k, a in kwargs.items():
            if isinstance(a, cls):
                qs.append(a)
                ukwargs[k] = a._data
            elif isinstance(a, (list, tuple)):
                ukwargs[k], p = _unwrap_list(a, qs, cls)
                plain |= p
            else:
                if isinstance(a, torch.Tensor) and a.dtype in FLOAT_DTYPES:
                    plain = True
                ukwargs[k] = a
    return uargs, ukwargs, plain


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
                and not _compiler._is_exporting_flag and a._tscale is None
                and not a.fmt.is_two_level):
            return _single_move(rule.single, func, rule, a, data, args, kwargs, cls)
    if rule.kind >= FOREACH:
        if rule.kind == FOREACH:
            return _dispatch_foreach(func, rule, args, kwargs, cls)
        if rule.kind == DECOMPOSE:
            return func.decompose(*args, **(kwargs or {}))
        return _collective(func, args, kwargs, cls)
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
    if rule.kind != CONTRACT_KIND:
        acc = _accum_of(qs, cls)
    if acc is not None:  # results carry the accumulator on (activations, gradients)
        _set_accum(out, acc, cls)
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


def _set_accum(out, acc, cls):
    if isinstance(out, cls):
        out._accum = acc
    elif isinstance(out, (tuple, list)):
        for o in out:
            _set_accum(o, acc, cls)


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
    if rule.inplace_view:
        if isinstance(args[0], cls):  # t_, unsqueeze_, ...: the block axis moves
            args[0].fmt = fmt
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
    stay; a copy_ over all of d brings its source's scale; other writes under another scale
    round d again under a fresh one."""
    srcs = [t for a in list(args) + list((kwargs or {}).values())
            for t in (a if isinstance(a, (list, tuple)) else (a,))
            if isinstance(t, cls) and t is not d]
    ds = d.tensor_scale
    if all(bool(torch.equal(t.tensor_scale, ds)) for t in srcs):
        return
    if (func.overloadpacket.__name__ == "copy_" and len(srcs) == 1
            and tuple(srcs[0].shape) == tuple(d.shape)):
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
# Collectives (torch.distributed): the values that arrive are the values sent, in format

def _wait_all(out) -> None:
    """Wait for the collective that produces ``out`` (its payloads, or a c10d Work)."""
    wait = torch.ops._c10d_functional.wait_tensor.default
    for o in out if isinstance(out, (tuple, list)) else (out,):
        if isinstance(o, (tuple, list)):
            _wait_all(o)
        elif isinstance(o, torch.Tensor):
            wait(o)
        elif hasattr(o, "wait"):  # a c10d Work (async_op=True, or the sync API before its wait)
            o.wait()


def _collective(func, args, kwargs, cls):
    """A collective on QTensors: run on the payloads, wait for it here (its results must not be
    read, nor rounded, before they have arrived), then round once into the format: a reduction
    sums (or averages) the payloads in their precision (float32) and rounds the result once;
    a gather, broadcast or all-to-all moves values already in format (rounding them again
    changes nothing, unless blocks were regrouped). New outputs keep the formats of the QTensor
    input they come from (of a coalesced op: the input at their index); destinations written in
    place keep their own. Two-level formats: :func:`_two_level_received`. An async collective
    is thus complete on return (its later wait is a no-op)."""
    name = func._opname
    if name == "wait_tensor":  # the output was waited on when it was made
        a = args[0] if args else kwargs["tensor"]
        if isinstance(a, cls):
            func(a._data)
        return a
    if func.namespace == "c10d":
        return _c10d_collective(func, args, kwargs, cls)
    qs = []
    uargs, ukwargs, _plain = _unwrap(args, kwargs, qs, cls)
    out = func(*uargs, **ukwargs)
    _wait_all(out)
    bound = _bound(func, args, kwargs)
    comm = _FunctionalComm(bound)
    kind = _FUNCTIONAL_KINDS.get(name.rstrip("_").removesuffix("_coalesced")
                                 .removesuffix("_out"), "whole")
    coalesced = name.rstrip("_").endswith("_coalesced")
    alias = {id(q._data): q for q in qs}  # an output that is an input's payload is that QTensor
    if name.endswith("_") or "out" in bound:  # written in place (all_reduce_, broadcast_), out=
        written = (list(args[0]) if coalesced else [args[0]]) if name.endswith("_") else [
            bound["out"]]
        sources = written if name.endswith("_") else [args[0]]
        keep = [i for i, q in enumerate(written) if isinstance(q, cls)]
        _into_written(kind, [(written[i], written[i]._data) for i in keep],
                      [sources[i] for i in keep], comm)
        return _aliased(out, alias)
    outs = list(out) if isinstance(out, (tuple, list)) else [out]
    sources = list(args[0]) if coalesced else [qs[0]] * len(outs)
    res = list(outs)
    two = []
    for i, (o, s) in enumerate(zip(outs, sources)):
        if not isinstance(s, cls) or not isinstance(o, torch.Tensor) or o.dtype not in FLOAT_DTYPES:
            continue
        if id(o) in alias:
            res[i] = alias[id(o)]
        elif s.fmt.is_two_level:
            two.append(i)
        else:
            res[i] = _wrap_received(cls, quantize(o, s.fmt), s, o.dim())
    if two:
        fmts = [fit_format(sources[i].fmt, outs[i].dim()) for i in two]
        got = _two_level_received(kind, [outs[i] for i in two], fmts,
                                  [sources[i] for i in two], comm)
        for i, (v, tscale) in zip(two, got):
            res[i] = _wrap_received(cls, v, sources[i], outs[i].dim())
            res[i]._tscale = tscale
    if isinstance(out, (tuple, list)):
        return type(out)(res)
    return res[0]


def _aliased(out, alias):
    """``out`` with the payloads among its tensors replaced by their QTensors."""
    if isinstance(out, (tuple, list)):
        return type(out)(_aliased(o, alias) for o in out)
    return alias.get(id(out), out)


def _wrap_received(cls, values, src, ndim):
    w = cls._wrap(values, fit_format(src.fmt, ndim), src.mm_fmt)
    if src.accum is not None:
        w._accum = src.accum
    return w


# How each functional collective's two-level outputs take their tensor scale (the coalesced,
# in-place and out= forms as their single form): _two_level_received
_FUNCTIONAL_KINDS = {"broadcast": "bcast", "all_gather_into_tensor": "cat",
                     "all_to_all_single": "cat", "reduce_scatter_tensor": "part",
                     "_wrap_tensor_autograd": "same"}
# c10d's ops: the tensors they write are their first argument (send writes none); "from": each
# tensor written is a whole tensor one rank sent (_senders says which)
_C10D_KINDS = {"broadcast_": "bcast", "_allgather_base_": "cat",
               "allgather_into_tensor_coalesced_": "cat", "alltoall_base_": "cat",
               "allgather_": "from", "allgather_coalesced_": "from", "gather_": "from",
               "scatter_": "from", "alltoall_": "from",
               "_reduce_scatter_base_": "part", "reduce_scatter_tensor_coalesced_": "part",
               "reduce_scatter_": "part"}
_P2P = frozenset({"send", "recv_", "recv_any_source_"})


def _bound(func, args, kwargs) -> dict:
    """The arguments of an op call by their schema names (those passed)."""
    bound = dict(zip((a.name for a in func._schema.arguments), args))
    bound.update(kwargs or {})
    return bound


def _c10d_collective(func, args, kwargs, cls):
    """c10d's ops write into their first argument (a tensor, a list, a list of lists), and some
    backends' Work copies its result into it again on every wait() (gloo's reduce-scatter):
    they write into copies of the destinations' payloads, and the destinations get the
    results once; the tensors only read are passed as payloads (a destination's input may be a
    view of it: FSDP's all-gather in place)."""
    pairs = []

    def copy_of(a):  # (scatter, gather, allgather take lists of lists)
        if isinstance(a, (list, tuple)):
            return type(a)(copy_of(x) for x in a)
        if isinstance(a, cls):
            pairs.append((a, a._data.clone()))
            return pairs[-1][1]
        return a

    def payload(a):
        if isinstance(a, (list, tuple)):
            return type(a)(payload(x) for x in a)
        return a._data if isinstance(a, cls) else a
    name = func._opname
    if name == "send":
        uargs = [payload(a) for a in args]
    else:
        uargs = [copy_of(args[0])] + [payload(a) for a in args[1:]]
    out = func(*uargs, **(kwargs or {}))
    if name != "send":  # (a send writes nothing here: it may stay in flight)
        _wait_all(out)
    bound = _bound(func, args, kwargs)
    if name in _P2P:
        return _p2p(name, bound, pairs, out, cls)
    kind = _C10D_KINDS.get(name, "whole")
    dst = args[0]
    if kind == "from":
        pg = _group(bound)
        sent, origins = _senders(name, bound, pg.rank(), pg.size())
        flat = _flat(dst)
        exchange = any(isinstance(t, cls) and t.fmt.is_two_level for t in flat + sent)
        _received_whole(pairs, [o for t, o in zip(flat, origins) if isinstance(t, cls)], sent,
                        _C10dComm(bound, pg.size()), exchange)
    elif pairs and not (name == "reduce_" and _group(bound).rank() != bound["root_rank"]):
        # (a reduce's result is the root's: the other ranks' tensors were only read)
        src = next((bound[k] for k in ("input_tensor", "input", "inputs", "input_tensors")
                    if k in bound), None)
        if kind == "cat":  # each output's input
            sources = [src] if isinstance(dst, cls) else [
                s for q, s in zip(dst, src) if isinstance(q, cls)]
        else:
            sources = [q for q, _c in pairs]
        _into_written(kind, pairs, sources, _C10dComm(bound, _group(bound).size()))
    return _aliased(out, {id(c): q for q, c in pairs})


def _group(bound):
    """The c10d ProcessGroup of an op's ``process_group`` argument."""
    import torch.distributed as dist
    return dist.ProcessGroup.unbox(bound["process_group"])


def _flat(a) -> list:
    if isinstance(a, (list, tuple)):
        return [t for x in a for t in _flat(x)]
    return [a]


def _senders(name, bound, me, world):
    """(the tensors this rank sends, the same number on every rank (None: a rank that sends
    none); for each tensor the op writes, in _flat order: (the rank that sent it, its index
    in that rank's list))."""
    dst = bound["output_tensors"] if "output_tensors" in bound else bound["output_lists"]
    if name == "scatter_":
        ins = bound["input_tensors"]
        return (list(ins[0]) if ins else [None] * world), [(bound["root_rank"], me)]
    if name == "allgather_":  # output_tensors[i][j]: rank j's input_tensors[i]
        return list(bound["input_tensors"]), [(j, i) for i, row in enumerate(dst)
                                              for j, _t in enumerate(row)]
    if name == "allgather_coalesced_":  # output_lists[j][i]: rank j's input_list[i]
        return list(bound["input_list"]), [(j, i) for j, row in enumerate(dst)
                                           for i, _t in enumerate(row)]
    if name == "gather_":  # the root's output_tensors[0][j]: rank j's input_tensors[0]
        return list(bound["input_tensors"]), [(j, 0) for row in dst
                                              for j, _t in enumerate(row)]
    return list(bound["input_tensors"]), [(j, me) for j, _t in enumerate(dst)]  # alltoall_


def _fingerprint(fmt) -> float:
    """A number that tells formats apart across processes (24 bits: exact in float32)."""
    import zlib
    return float(zlib.crc32(str(fmt).encode()) & 0xFFFFFF)


def _sent_scales(sent, device) -> torch.Tensor:
    """[len(sent), 2] float32 on ``device``: each sent tensor's tensor scale and format
    fingerprint (zeros for a tensor that is not a two-level QTensor)."""
    rows = []
    for t in sent:
        if getattr(t, "fmt", None) is not None and t.fmt.is_two_level:
            rows.append(torch.stack([t.tensor_scale.reshape(()).to(torch.float32).cpu(),
                                     torch.tensor(_fingerprint(fit_format(t.fmt, t.dim())))]))
        else:
            rows.append(torch.zeros(2))
    return (torch.stack(rows) if rows else torch.zeros(0, 2)).to(device)


def _as_sent(c, fmt, row):
    """A received whole tensor ``c`` (two-level ``fmt``) as a copy_ of the tensor sent (its
    scale and fingerprint ``row``) gives it in one process: its values under its scale; one not
    of the format: rounded under a fresh scale of its own amax."""
    if bool(row[0] > 0) and float(row[1]) == _fingerprint(fmt):
        return c, row[0].to(device=c.device).clone()
    return _backend.round_with_scale(c, fmt)


def _received_whole(written, origins, sent, comm, exchange) -> None:
    """Collectives whose every output is a whole tensor one rank sent (list all-gather, gather,
    scatter, all-to-all of lists): ``written`` ((destination, the payload it received)) came
    from ``origins`` ((rank, index)); every rank's ``sent`` scales are all-gathered (where
    ``exchange``: any of the op's tensors is two-level, on every rank alike)."""
    table = None
    if exchange:
        dev = next(t.device for t in [c for _q, c in written] + sent + [torch.zeros(())]
                   if isinstance(t, torch.Tensor))  # (a scatter's non-root sends none)
        table = comm.gather(_sent_scales(sent, dev).reshape(-1)).view(comm.world, len(sent), 2)
    for (q, c), (j, i) in zip(written, origins):
        if q.fmt.is_two_level:
            v, q._tscale = _as_sent(c, fit_format(q.fmt, c.dim()), table[j, i])
            q._data.copy_(v)
        else:
            q._data.copy_(quantize(c, q.fmt))


def _p2p(name, bound, pairs, out, cls):
    """send/recv: a two-level QTensor sent is followed by its tensor scale (and format
    fingerprint), which the two-level QTensor that receives it takes with its values. A send
    stays in flight (the Work returned waits for both messages: a batch of isend/irecv in which
    every rank sends first must not wait here); a recv is complete here, its Work a done one
    (gloo's Work of a send or recv must not be waited on twice)."""
    import torch.distributed as dist
    c10d, pg = torch.ops.c10d, bound["process_group"]
    t = bound["tensors"][0]
    if name == "send":
        if not (isinstance(t, cls) and t.fmt.is_two_level):
            return out
        scale = c10d.send.default([_sent_scales([t], t.device)], pg, bound["dst"], bound["tag"])
        return _work_of([out, scale], bound["dst"]).boxed()
    peer = bound["src"] if name == "recv_" else dist.Work.unbox(out)._source_rank()
    for q, c in pairs:
        if q.fmt.is_two_level:
            row = torch.zeros(1, 2, device=c.device)
            _wait_all(c10d.recv_.default([row], pg, peer, bound["tag"]))
            v, q._tscale = _as_sent(c, fit_format(q.fmt, c.dim()), row[0])
            q._data.copy_(v)
        else:
            q._data.copy_(quantize(c, q.fmt))
    return _work_of([], peer).boxed()


def _work_of(works, source_rank):
    """A c10d Work that waits for ``works`` (c10d Works, each once); its source rank: a recv
    from any source asks for it."""
    w = _work_type()()
    w.works, w.source = list(works), source_rank
    _KEPT.append(w)
    return w


# The Python side of a _work_of Work must live until the op's caller holds it (what the
# dispatcher returns is the C++ Work, whose base wait() would block): the last ones are kept
_KEPT = collections.deque(maxlen=64)


@functools.cache
def _work_type():
    import torch.distributed as dist

    class _Works(dist.Work):
        def wait(self, timeout=None):
            while self.works:
                dist.Work.unbox(self.works.pop(0)).wait()
            return True

        def is_completed(self):
            return all(dist.Work.unbox(w).is_completed() for w in self.works)

        def get_future(self):
            self.wait()
            fut = torch.futures.Future()
            fut.set_result(None)
            return fut

        def _source_rank(self):
            return self.source

        source_rank = _source_rank
    return _Works


def _into_written(kind, written, sources, comm) -> None:
    """The QTensors of ``written`` ((destination, the payload it received)) get the received
    values in their formats; ``sources``: what each destination's values come from (its
    tensor scale)."""
    two, two_sources = [], []
    for (q, c), s in zip(written, sources):
        if q.fmt.is_two_level:
            two.append((q, c))
            two_sources.append(s)
        elif c is q._data:
            _round_inplace(q)
        else:
            q._data.copy_(quantize(c, q.fmt))
    if not two:
        return
    outs = [c for _q, c in two]
    fmts = [fit_format(q.fmt, c.dim()) for q, c in two]
    if kind in ("bcast", "same"):  # (in place: the destination is the source)
        two_sources = [q for q, _c in two]
    got = _two_level_received(kind, outs, fmts, two_sources, comm)
    for (q, c), (v, tscale) in zip(two, got):
        if v is not q._data:
            q._data.copy_(v)
        q._tscale = tscale


def _scales_of(tensors, fmts, outs) -> torch.Tensor:
    """The tensor scales of ``tensors`` as one float32 vector, 0 for a tensor without one or not
    of the format its output has (``fmts``, fitted to ``outs``): values no scale of it gives."""
    zero = torch.zeros((), dtype=torch.float32, device=outs[0].device)
    return torch.stack([
        t.tensor_scale.reshape(()).to(torch.float32)
        if (getattr(t, "fmt", None) is not None and t.fmt.is_two_level
            and fit_format(t.fmt, o.dim()) == f) else zero
        for t, f, o in zip(tensors, fmts, outs)])


class _FunctionalComm:
    """The scale collectives of a functional collective, in its group."""

    def __init__(self, bound):
        self.bound = bound

    def gather(self, t):  # [group size, len(t)]
        c10d, b = torch.ops._c10d_functional, self.bound
        size = b.get("group_size")
        if size is None:  # (all_to_all_single names its group only)
            from torch.distributed.distributed_c10d import _resolve_process_group
            size = _resolve_process_group(b["group_name"]).size()
        return c10d.wait_tensor(c10d.all_gather_into_tensor(
            t, size, b["group_name"])).view(size, -1)

    def broadcast(self, t):
        c10d, b = torch.ops._c10d_functional, self.bound
        return c10d.wait_tensor(c10d.broadcast(t.clone(), b["src"], b["group_name"]))


class _C10dComm:
    """The scale collectives of a c10d collective, in its process group."""

    def __init__(self, bound, world):
        self.bound, self.world = bound, world

    def gather(self, t):
        out = t.new_empty(self.world * t.numel())
        _wait_all(torch.ops.c10d._allgather_base_.default(out, t.contiguous(),
                                                          self.bound["process_group"]))
        return out.view(self.world, -1)

    def broadcast(self, t):
        t = t.clone()
        _wait_all(torch.ops.c10d.broadcast_.default([t], self.bound["process_group"],
                                                    self.bound["root_rank"], 0))
        return t


def _two_level_received(kind, outs, fmts, sources, comm):
    """The values and tensor scales of a collective's two-level outputs ``outs`` (received
    payloads, ``fmts`` their formats) as one process holding the whole tensors has them;
    ``sources``: the tensors each output's values come from (their tensor scales).

    - ``bcast``: the source rank's values, under its scale (broadcast with them).
    - ``cat``: an all-gather of parts that share one tensor scale keeps their values and that
      scale (the ranks' scales are gathered too); of parts of different scales, as a cat of
      them: rounded again under one fresh scale (of the gathered amax).
    - ``part``: a reduce-scatter rounds each rank's part under the scale of the whole reduced
      tensor's amax (the parts' amaxes gathered: their max).
    - ``same``: the identity (autograd's wrapper of an output): the source's scale.
    - ``whole`` (all-reduce, a reduce's root): rounded under the scale of their own amax (an
      all-reduce's result is the same on every rank: so is its scale).
    c10d's collectives of whole tensors sent (gather, scatter, lists): :func:`_received_whole`.
    Eager or traced (torch.compile: a choice by the gathered scales is a torch.where)."""
    if kind == "same":
        return [(o, s.tensor_scale) for o, s in zip(outs, sources)]
    if kind == "bcast":
        scales = comm.broadcast(_scales_of(sources, fmts, outs))
        return [(o, scales[i]) for i, o in enumerate(outs)]
    if kind == "part":
        amax = comm.gather(torch.stack([finite_amax(o).reshape(()) for o in outs])).amax(0)
        return [_backend.round_with_scale(o, f, tensor_amax=amax[i])
                for i, (o, f) in enumerate(zip(outs, fmts))]
    if kind != "cat":
        return [_backend.round_with_scale(o, f) for o, f in zip(outs, fmts)]
    gathered = comm.gather(_scales_of(sources, fmts, outs))
    res = []
    for i, (o, f) in enumerate(zip(outs, fmts)):
        col = gathered[:, i]
        bits = col.view(torch.int32)
        same = (bits == bits[:1]).all() & (col[0] > 0)
        if type(o) is torch.Tensor and bool(same):  # eager: no rounding to do
            res.append((o, col[0].clone()))
            continue
        q, fresh = _backend.round_with_scale(o, f)
        if type(o) is torch.Tensor:
            res.append((q, fresh))
        else:  # (traced)
            res.append((torch.where(same, o, q), torch.where(same, col[0], fresh)))
    return res


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
