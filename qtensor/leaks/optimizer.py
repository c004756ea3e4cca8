"""The optimizer checker: after ``optimizer.step()``, parameters, gradients and per-element
state in their expected formats (kind ``"optimizer"``)."""
from __future__ import annotations

import sys
import weakref

import torch

from ..nn.convert import plan_of
from ..tensor.subclass import QTensor
from ..nn.training import MASTER_KEY, swapped_masters
from .findings import OPTIMIZER, Finding, tensor_info
from .frames import user_location
from .tensors import is_float
from .values import same_format, sparse_in_format, unrepresentable


class OptimizerChecker:
    def __init__(self, check_values, tracker, exemptions, emit):
        self.check_values = check_values
        self.tracker = tracker
        self.ex = exemptions
        self.emit = emit
        self.watched = weakref.WeakSet()

    def watch(self, optimizer):
        """Hook ``optimizer``'s steps; the hook's handle, None when it is watched already."""
        if optimizer in self.watched:
            return None
        self.watched.add(optimizer)
        # a per-optimizer hook runs before qt.convert's process-wide one, so it sees what the
        # optimizer itself made (convert then rounds the state into its optimizer_state format)
        return optimizer.register_step_post_hook(self.step_hook)

    def pre_step(self, optimizer, args, kwargs):
        """Every optimizer: the gradients and state a recipe keeps in full precision are
        deliberate (the FP32 state the optimizer computes from them too)."""
        self.tracker.steps.enter(levels=1)
        deliberate = self.ex.deliberate
        for group in optimizer.param_groups:
            for p in group["params"]:
                plan = plan_of(p)
                if plan is None:
                    continue
                g = p.grad
                if plan.grad.full_precision and g is not None and not isinstance(g, QTensor):
                    deliberate[g] = True
                if plan.optimizer_state.full_precision or plan.master:
                    for v in optimizer.state.get(p, {}).values():
                        if isinstance(v, torch.Tensor) and not isinstance(v, QTensor):
                            deliberate[v] = True

    def post_step(self, optimizer, args, kwargs):
        self.tracker.steps.exit(levels=1)

    def step_hook(self, optimizer, args, kwargs):
        if self.tracker.pending:
            self.tracker.flush()
        loc = user_location(sys._getframe(1))
        op = f"{type(optimizer).__name__}.step"
        # qt.convert's FP32 master weights stand in for their parameters until its own hook
        # puts the parameters back
        masters = swapped_masters(optimizer)
        params = [masters.get(id(p), p) for g in optimizer.param_groups for p in g["params"]]
        any_q = any(isinstance(p, QTensor) for p in params)
        for gi, group in enumerate(optimizer.param_groups):
            for pi, p in enumerate(group["params"]):
                master = id(p) in masters
                p = masters.get(id(p), p)
                name = self.ex.state_names.get(p) or f"param_groups[{gi}]['params'][{pi}]"
                self._check_param(optimizer, p, name, any_q, op, loc, master)

    def _check_param(self, optimizer, p, name, any_q, op, loc, master=False):
        ex = self.ex
        if ex.is_deliberate(p) or ex.allowed(p) or ex.matches_name(name):
            return
        plan = plan_of(p)  # what qt.convert chose for this parameter
        owner = name.rsplit(".", 1)[0] if "." in name else ""
        if not isinstance(p, QTensor):
            want = plan.value.fmt if plan is not None else None
            if is_float(p) and (want is not None or any_q):
                self._report(op, owner, loc, name, p, "parameter is a plain tensor" + (
                    f", expected {want}" if want is not None else " among QTensor parameters"))
            return
        problems = []  # (role, tensor, why)
        if plan is not None and plan.value.fmt is not None and \
                not same_format(p.fmt, plan.value.fmt):
            problems.append((name, p, f"parameter in {p.fmt}, expected {plan.value.fmt}"))
        g = p.grad
        want_g = None if plan is None else plan.grad.fmt
        if g is not None and (plan is None or want_g is not None):
            if sparse_in_format(g, [want_g or p.fmt]):
                pass  # a sparse gradient (there is no sparse QTensor) with its values in format
            elif not isinstance(g, QTensor):
                problems.append((f"{name}.grad", g, "gradient is a plain tensor" + (
                    f", expected {want_g}" if want_g is not None else "")))
            elif want_g is not None and not same_format(g.fmt, want_g):
                problems.append((f"{name}.grad", g, f"gradient in {g.fmt}, expected {want_g}"))
        state = {} if master else optimizer.state.get(p, {})
        problems += self._state_problems(p, name, plan, g, state)
        if self.check_values:
            checks = [(name, p), (f"{name}.grad", g)] + [
                (f"{name} state[{k!r}]", v) for k, v in state.items()]
            for role, t in checks:
                if isinstance(t, QTensor):
                    bad = unrepresentable(t.payload, t.fmt)
                    if bad is not None:
                        problems.append((role, t, f"{bad[0]} of {t.numel()} values not in "
                                                  f"{t.fmt}; first {bad[2]!r}"))
        for role, t, why in problems:
            self._report(op, owner, loc, role, t, why)

    def _state_problems(self, p, name, plan, g, state) -> list:
        # convert's plan: master weights run the optimizer in FP32 by design; a None
        # optimizer_state leaves the state as the optimizer made it
        if not (plan is None or (not plan.master and plan.optimizer_state.fmt is not None)):
            return []
        want_s = p.fmt if plan is None else plan.optimizer_state.fmt
        # the optimizer makes its state like the parameter (zeros_like) or the gradient
        # (momentum = clone(grad)); convert rounds it into want_s right after this hook
        ok_s = [want_s, p.fmt] + ([g.fmt] if isinstance(g, QTensor) else [])
        problems = []
        for k, v in state.items():
            if not isinstance(v, torch.Tensor) or not is_float(v) or v.dim() == 0:
                continue
            if tuple(v.shape) != tuple(p.shape) or k == MASTER_KEY:
                continue  # not a per-element state of the parameter's values
            role = f"{name} state[{k!r}]"
            if not isinstance(v, QTensor):
                if not self.ex.allowed(v):
                    problems.append((role, v, f"optimizer state {k!r} is a plain tensor, "
                                              f"expected {want_s}"))
            elif not any(same_format(v.fmt, f) for f in ok_s):
                problems.append((role, v, f"optimizer state {k!r} in {v.fmt}, "
                                          f"expected {want_s}"))
        return problems

    def _report(self, op, owner, loc, role, t, why):
        info = tensor_info(role, t, flagged=True, name=None)
        self.emit(Finding(OPTIMIZER, op, owner, "optimizer", loc, (info,), why))
