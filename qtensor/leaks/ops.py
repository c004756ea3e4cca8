"""The op checker: one aten op (an :class:`OpEvent`) in, findings out."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch.utils.weak import WeakIdKeyDictionary

from ..tensor import dispatch
from ..tensor.subclass import QTensor
from .findings import FUSED, MIXED, PLAIN_OP, PLAIN_RESULT, UNREPRESENTABLE, Finding, tensor_info
from .frames import ENGINE, QT, TORCH, loss_data, user_location, walk
from .tensors import (COPY_OPS, VALUE_DTYPES, flat_tensors, is_float, named_tensors, outputs,
                      pure_destinations, storage_key)
from .tracker import Context
from .values import moves_checked_values, sparse_in_format, unrepresentable

_LIFTS = frozenset(("lift_fresh", "lift_fresh_copy"))  # torch.tensor(...): a factory
_MATH_SDPA = ("run it under `with torch.nn.attention.sdpa_kernel("
              "torch.nn.attention.SDPBackend.MATH):`, where attention decomposes into bmm and "
              "softmax, each emulated (forward and backward)")
_FASTPATH = ("this is the inference fast path of nn.MultiheadAttention / "
             "nn.TransformerEncoderLayer: call torch.backends.mha.set_fastpath_enabled(False) "
             "and " + _MATH_SDPA)
# Fused kernels that contain contractions, by op packet: how to get them emulated instead
_FUSED_CONTRACTIONS = {
    **{name: _MATH_SDPA for name in (
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_flash_attention_for_cpu_backward",
        "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_efficient_attention_backward",
        "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_cudnn_attention_backward",
        "_scaled_dot_product_fused_attention_overrideable",
        "_scaled_dot_product_fused_attention_overrideable_backward",
        "_scaled_dot_product_attention_math_for_mps", "_flash_attention_forward",
        "_flash_attention_backward", "_efficient_attention_forward",
        "_efficient_attention_backward")},
    "_native_multi_head_attention": _FASTPATH,
    "_transformer_encoder_layer_fwd": _FASTPATH,
}
# Other ops that multiply their operands and sum the products (contractions), by packet: where
# dispatch has no contraction rule for one (qtensor.tensor.dispatch.CONTRACT), it computes on the
# payloads in FP32 like any op and its operand formats are lost, which is reported (F.bilinear's
# _trilinear, quantized and sparse matmuls, backend convolutions; a grouped GEMM before it had
# its rule). Not "fused": no finding asks for a decomposition, the op itself ignores mm_fmt.
_CONTRACTION_OPS = frozenset("""
_grouped_mm grouped_mm_fallback grouped_mm_fallback_backward _scaled_grouped_mm
_scaled_grouped_mm_v2 _scaled_mm _scaled_mm_v2 _int_mm _trilinear _mixed_dtypes_linear
_weight_int8pack_mm _weight_int4pack_mm _weight_int4pack_mm_for_cpu
_weight_int4pack_mm_with_scales_and_zeros _dyn_quant_matmul_4bit mkldnn_linear _sparse_addmm
sparse_sampled_addmm _sparse_sparse_matmul conv_tbc _slow_conv2d_forward slow_conv3d_forward
mkldnn_convolution slow_conv_dilated2d slow_conv_dilated3d slow_conv_transpose2d
slow_conv_transpose3d _conv_depthwise2d conv_depthwise3d cudnn_convolution
cudnn_convolution_transpose miopen_convolution _nnpack_spatial_convolution
""".split())
# Plain ops that count elements (MoE routing: tokens per expert from the expert ids): their
# results are exact counts, not values computed in a precision
_COUNTS = frozenset(("histc", "bincount"))


@dataclass
class OpEvent:
    """One aten op as the dispatch mode saw it."""

    func: Any                       # the OpOverload
    args: tuple
    kwargs: dict
    frame: Any                      # the frame that called the op
    outs: Optional[list] = None     # (role, tensor) of the results; None before the op ran
    ctx: Optional[Context] = None   # where it runs (computed on demand before the op ran)
    named: Optional[list] = field(default=None, repr=False)  # (role, tensor) of the arguments

    def arguments(self) -> list:
        if self.named is None:
            self.named = named_tensors(self.args, self.kwargs, self.func._schema)
        return self.named


class OpChecker:
    def __init__(self, check_values, tracker, exemptions, emit):
        self.check_values = check_values
        self.tracker = tracker
        self.ex = exemptions
        self.emit = emit
        self.checked = WeakIdKeyDictionary()  # QTensor -> version whose values were checked

    def forget(self) -> None:
        self.checked = WeakIdKeyDictionary()

    def inputs(self, func, args, kwargs, frame) -> None:
        """Before the op runs: the values of its QTensor inputs, before they change."""
        if self.check_values:
            self._check_qvalues(OpEvent(func, args, kwargs, frame))

    def inspect(self, func, args, kwargs, out, frame) -> None:
        """After the op ran: everything else."""
        ins = flat_tensors(args, kwargs)  # cheap first pass without names
        has_q = any(isinstance(t, QTensor) for t in ins)
        plain = any(not isinstance(t, QTensor) and t.dtype in VALUE_DTYPES for t in ins)
        ev = OpEvent(func, args, kwargs, frame, outputs(out), self.tracker.context())
        forward = ev.ctx.phase == "forward"
        if plain and forward and torch.is_grad_enabled():
            self.tracker.record_targets(func, args, kwargs, ev.outs)
        if not has_q:
            if plain and forward and not self.tracker.in_step:
                self.ex.propagate_loss_data(ins, ev.outs, frame)
            elif plain and ev.ctx.targets is not None:
                self.ex.propagate_backward_loss_data(ins, ev.outs, ev.ctx.targets)
            if plain and (ev.ctx.converted or self.tracker.in_step):
                self.ex.propagate_deliberate(ins, ev.outs)
            if not ev.ctx.converted:
                return
        if ev.ctx.converted and forward and torch.is_grad_enabled():
            self.tracker.record_tags(ev.outs, ev.ctx.module, frame)
        if has_q:
            self._check_qtensor_op(ev, ins, plain)
        elif plain and func._opname not in _LIFTS:  # plain tensors only, in a converted model
            self._check_plain_op(ev, ins)
        elif ev.outs and any(is_float(t) for _, t in ev.outs):
            self._constant(ev)

    def _check_qtensor_op(self, ev, ins, plain) -> None:
        if self.check_values:
            self._check_qvalues(ev)
        packet = ev.func._opname
        if packet in _FUSED_CONTRACTIONS:
            self._check_fused(ev)
        elif (packet in _CONTRACTION_OPS
              and dispatch.rule_of(ev.func).kind != dispatch.CONTRACT_KIND):
            self._check_fused(ev, f"qtensor has no contraction rule for {ev.func}: it computes "
                                  "it on the payloads in FP32, as one op")
        if packet.startswith("_foreach_"):
            self._check_foreach(ev)
            return
        if plain:
            self._check_mixed(ev)
            return
        fmts = [t.fmt for t in ins if isinstance(t, QTensor)]
        bad = [i for i, (_, t) in enumerate(ev.outs)
               if not isinstance(t, QTensor) and is_float(t) and not sparse_in_format(t, fmts)]
        if bad:
            detail = ""
            if any(ev.outs[i][1].is_complex() for i in bad):
                detail = ("no format is complex: this complex result, and what is computed "
                          "from it, is not emulated (full precision)")
            self._finding(PLAIN_RESULT, ev, flag_out=bad, detail=detail)

    def _constant(self, ev) -> None:
        """A factory (or a cast from integers): a constant; bless it when torch made it,
        remember it when the user did (a 0-dim one is then not taken for a scalar)."""
        direct, _, _ = walk(ev.frame)
        # scalar_tensor: how torch's C++ code makes a tensor of a number (an SDPA mask)
        torch_made = direct in (TORCH, ENGINE) or ev.func._opname == "scalar_tensor"
        made = self.ex.blessed if torch_made else self.ex.user_made
        for _, t in ev.outs:
            if is_float(t) and not isinstance(t, QTensor):
                made[t] = True

    def _check_mixed(self, ev) -> None:
        """(a), and (b) for a plain destination: plain tensors and QTensors in one op."""
        rule = dispatch.rule_of(ev.func)
        if rule.kind == dispatch.MOVE_KIND and rule.mutated:
            pos, name = rule.mutated[0]
            dst = ev.args[pos] if pos < len(ev.args) else ev.kwargs.get(name)
            if isinstance(dst, QTensor):
                return  # plain values written into a QTensor are rounded to its format
        named = ev.arguments()
        dests = pure_destinations(ev.func)
        torch_buffer = False
        for role, t in named:
            if role.split("[")[0] in dests and is_float(t) and not isinstance(t, QTensor):
                # QTensor values written into a buffer torch made (nn.utils.rnn.
                # pad_packed_sequence's C++ code): it is no longer a constant, nor what follows
                torch_buffer |= self.ex.unbless(t)
        fmts = [t.fmt for _, t in named if isinstance(t, QTensor)]
        flagged = [i for i, (role, t) in enumerate(named)
                   if not isinstance(t, QTensor) and is_float(t)
                   and not self.ex.exempt_plain(t, role, ev) and not sparse_in_format(t, fmts)]
        if flagged and ev.ctx.phase == "forward":
            flagged = self._drop_loss_data(ev, flagged)
        if not flagged:
            return
        operands = [i for i in flagged if named[i][0].split("[")[0] not in dests]
        if operands:
            self._finding(MIXED, ev, flag_in=operands)
        else:  # only a plain destination (out=, copy_): QTensor values came back plain
            plain_out = [i for i, (_, t) in enumerate(ev.outs)
                         if not isinstance(t, QTensor) and is_float(t)]
            detail = ("torch's own code copied QTensor values into a plain tensor it made (as "
                      "nn.utils.rnn.pad_packed_sequence does): what it returns, and what is "
                      "computed from it, is full precision; round it back into a format "
                      "(qt.as_qtensor(result, fmt))") if torch_buffer else ""
            self._finding(PLAIN_RESULT, ev, flag_in=flagged, flag_out=plain_out, detail=detail)

    def _drop_loss_data(self, ev, flagged) -> list:
        """Inside a torch.nn.functional loss its target and class weights are data, here and in
        the backward of this op (tagged on its node, as for ops with a target argument)."""
        data = loss_data(ev.frame)
        if data is None:
            return flagged
        named = ev.arguments()
        keys = {i: storage_key(named[i][1]) for i in flagged}
        data_in = [i for i in flagged if keys[i] in data or named[i][1] in self.ex.loss_made]
        if data_in and torch.is_grad_enabled():
            self.tracker.pending.extend((o, None, keys[i]) for _, o in ev.outs for i in data_in)
        return [i for i in flagged if i not in data_in]

    def _check_fused(self, ev, how=None) -> None:
        """(f): a fused kernel (flash attention, MHA's fast path) multiplies inside one op,
        where no operand can be rounded to its mm_fmt; or (``how``: why) a contraction that
        dispatch computes as a plain op."""
        named = ev.arguments()
        with_mm = [i for i, (_, t) in enumerate(named)
                   if isinstance(t, QTensor) and t.mm_fmt is not None]
        if not with_mm:
            return  # value formats only: computed and rounded as one op, like any other
        fmts = sorted({str(named[i][1].mm_fmt) for i in with_mm})
        where = (f"by this op: {how}" if how is not None
                 else f"inside this kernel; to emulate it, {_FUSED_CONTRACTIONS[ev.func._opname]}")
        detail = (f"the operand format {' / '.join(fmts)} of "
                  f"{', '.join(named[i][0] for i in with_mm)} is not applied {where}")
        self._finding(FUSED, ev, flag_in=with_mm, detail=detail)

    def _check_foreach(self, ev) -> None:
        """_foreach_* ops: element i of every list belongs together (per-parameter formats)."""
        args = ev.args
        lists = [(i, a) for i, a in enumerate(args) if isinstance(a, (list, tuple))]
        if not lists:
            return
        names = [a.name for a in ev.func._schema.arguments]
        n = len(lists[0][1])
        singles = [(names[i] if i < len(names) else f"arg{i}", a) for i, a in enumerate(args)
                   if isinstance(a, torch.Tensor)]
        mutated = ev.func._opname in COPY_OPS
        for j in range(n):
            group = [(f"{names[i] if i < len(names) else f'arg{i}'}[{j}]", lst[j])
                     for i, lst in lists if j < len(lst) and isinstance(lst[j], torch.Tensor)]
            group += singles
            if not any(isinstance(t, QTensor) for _, t in group):
                continue
            if mutated and isinstance(group[0][1], QTensor):
                continue  # values copied into a QTensor are rounded
            flagged = [k for k, (role, t) in enumerate(group)
                       if not isinstance(t, QTensor) and is_float(t)
                       and not self.ex.exempt_plain(t, role, ev)]
            if flagged:
                # copied into a plain tensor: QTensor values came back plain
                kind = PLAIN_RESULT if mutated and flagged == [0] else MIXED
                self._finding(kind, ev, named=group, flag_in=flagged, outs=[])

    def _check_plain_op(self, ev, ins) -> None:
        """(c): a computing op on plain floating tensors only, inside a converted model."""
        if not any(is_float(t) and not isinstance(t, QTensor) for _, t in ev.outs):
            return
        _, issuer, _ = walk(ev.frame)
        if issuer == QT:
            return
        if all(t in self.ex.blessed for t in ins if is_float(t)):
            # computing with torch's own constants (a mask from a boolean one, a zero state)
            for _, t in ev.outs:
                if is_float(t):
                    self.ex.blessed[t] = True
            return
        rule = dispatch.rule_of(ev.func)
        if rule.kind == dispatch.MOVE_KIND or rule.is_view:  # (view_as_real: a view too)
            return  # moving plain values is not computing with them; their use is reported
        if ev.func._opname in _COUNTS:
            return
        named = ev.arguments()
        flagged = [i for i, (role, t) in enumerate(named)
                   if is_float(t) and not self.ex.exempt_plain(t, role, ev)]
        if not flagged:
            return
        for _, t in ev.outs:  # a leaked scalar stays a leak downstream
            if is_float(t) and t.dim() == 0:
                self.ex.user_made[t] = True
        self._finding(PLAIN_OP, ev, flag_in=flagged, issuer=issuer)

    def _check_qvalues(self, ev) -> None:
        """(d): the QTensor inputs (before the op ran; not the destinations it overwrites) or
        outputs of an op whose payloads are not in their formats."""
        packet = ev.func._opname
        if ev.outs is None:
            mutated = {n for _, n in dispatch.rule_of(ev.func).mutated}
            cands = [(r, t) for r, t in ev.arguments()
                     if isinstance(t, QTensor) and r.split("[")[0] not in mutated]
        elif packet.startswith("empty") or packet.startswith("new_empty"):
            return  # uninitialised memory
        else:
            cands = [(r, t) for r, t in ev.outs if isinstance(t, QTensor)]
            if cands and moves_checked_values(ev.func, ev.args, ev.kwargs, cands, self.checked):
                for _, t in cands:  # values moved from checked QTensors of the same format
                    if not t.is_inference():
                        self.checked[t] = (t._version, t.payload._version)
                return
        for role, t in cands:
            if not t.is_inference():  # (an inference tensor has no version: check every time)
                ver = (t._version, t.payload._version)
                if self.checked.get(t) == ver:
                    continue
                self.checked[t] = ver
            bad = unrepresentable(t.payload, t.fmt)
            if bad is not None:
                count, i, v, q = bad
                detail = (f"{count} of {t.numel()} values of {role} are not in {t.fmt}; "
                          f"first at flat index {i}: {v!r} (nearest in format: {q!r})")
                where = OpEvent(ev.func, ev.args, ev.kwargs, ev.frame, [],
                                self.tracker.context())
                self._finding(UNREPRESENTABLE, where, named=[(role, t)], flag_in=[0],
                              detail=detail)

    def _finding(self, kind, ev, *, named=None, outs=None, flag_in=(), flag_out=(), detail="",
                 issuer=None) -> None:
        if issuer is None:
            _, issuer, loc = walk(ev.frame)
        else:
            loc = None
        if issuer == QT:
            return  # qtensor's own code (conversion, dequantize, hooks): deliberate
        tag = ev.ctx.tag
        if tag is not None and tag[1] is not None:
            loc = tag[1]  # backward: the forward op whose backward this is
        elif loc is None:
            loc = user_location(ev.frame)
        if named is None:
            named = ev.arguments()
        names = self.ex.state_names
        infos = [tensor_info(role, t, flagged=(i in flag_in), name=names.get(t))
                 for i, (role, t) in enumerate(named)]
        infos += [tensor_info(role, t, flagged=(i in flag_out), name=None)
                  for i, (role, t) in enumerate(ev.outs if outs is None else outs)]
        self.emit(Finding(kind, str(ev.func), ev.ctx.module, ev.ctx.phase, loc, tuple(infos),
                          detail))
