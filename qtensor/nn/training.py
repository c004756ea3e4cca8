"""Training support for converted models: optimizer state formats, FP32 master weights, loss scaling.

Ordinary ``torch.optim`` optimizers work unchanged on a converted model: every in-place update of
a QTensor parameter rounds into its format with the format's rounding mode. This module adds:

- optimizer state in its own format (``Recipe.optimizer_state``): process-wide ``torch.optim``
  step hooks, which touch only parameters converted by ``qt.convert``, keep every floating,
  non-scalar state tensor of a converted parameter in that role (Adam, AdamW and SGD's momentum
  are created in it before their first step, Adagrad's ``sum`` made in its ``__init__`` is
  made again in it, other state is rounded after each step);
- FP32 master weights (``Recipe(master_weights=True)``): around each ``optimizer.step()`` the
  optimizer updates FP32 copies, kept in its state under :data:`MASTER_KEY`, and the model's
  parameters are copied from them, rounded into their format;
- loss scaling (:class:`LossScaler`): static or dynamic power-of-two scaling of the loss,
  unscaling of the gradients, and skipped steps on overflow.

When to use each, the first step, closures and failed steps: docs/convert.md ("Training support").
"""
from __future__ import annotations

import math
import weakref
from typing import Optional

import torch
from torch.optim.optimizer import (register_optimizer_step_post_hook,
                                   register_optimizer_step_pre_hook)

from . import distributed as _distributed
from ..kernels.ops import quantize
from ..tensor import shards as _shards
from .masters import MASTER_KEY, epoch, mark_synced, set_outside as _set_outside
from .plans import _is_q, _plain, check_scale, round_to
from .spec import as_recipe
from ..warn import warn as _warn

__all__ = ["install_optimizer_hooks", "master_weight", "LossScaler", "check_scale"]

_installed = False


def install_optimizer_hooks() -> None:
    """Register the process-wide optimizer step hooks once (qt.convert calls this)."""
    global _installed
    if not _installed:
        register_optimizer_step_pre_hook(_pre_step)
        register_optimizer_step_post_hook(_post_step)
        _installed = True


def _put_back_sharded(optimizer, copy_back: bool) -> None:
    _distributed.put_back_gathered(optimizer, copy_back)


def _plan(p):
    plan = getattr(p, "_qt_plan", None)
    if plan is None and hasattr(p, "_local_tensor"):  # FSDP2's sharded parameter
        plan = _distributed.sharded_plan(p)
    return plan


def _involved(optimizer) -> bool:
    """Whether any parameter of ``optimizer`` is converted (cached until the next conversion)."""
    n = sum(len(g["params"]) for g in optimizer.param_groups)
    key = (epoch(), n)
    cached = getattr(optimizer, "_qt_involved", None)
    if cached is not None and cached[0] == key:
        return cached[1]
    any_plan = any(_plan(p) is not None for g in optimizer.param_groups for p in g["params"])
    optimizer._qt_involved = (key, any_plan)
    return any_plan


# Optimizers that stepped converted parameters: qt.unconvert gives them plain state again.
_optimizers = weakref.WeakSet()


def _restore(optimizer, copy_back: bool) -> None:
    """Put the model's parameters back into the optimizer (and the masters into its state)."""
    for params, i, p, master in getattr(optimizer, "_qt_swapped", ()):
        params[i] = p
        state = optimizer.state.pop(master, None)
        state = {} if state is None else state  # the same dict: LBFGS holds on to it
        master.grad = None
        state[MASTER_KEY] = master
        optimizer.state[p] = state
        if copy_back:
            with torch.no_grad():
                p.copy_(master)  # rounds into p's format with its rounding mode
            mark_synced(p, master)
    optimizer._qt_swapped = []


def _swap_in(optimizer, reuse_grad_buffers: bool = True) -> None:
    """Put the FP32 masters of converted parameters with master_weights into the optimizer, in
    their parameters' places, with their parameters' gradients and state."""
    swapped = []
    for group in optimizer.param_groups:
        params = group["params"]
        for i, p in enumerate(params):
            plan = _plan(p)
            if plan is None or not plan.master:
                continue
            state = optimizer.state.pop(p, None)
            state = {} if state is None else state
            master = state.pop(MASTER_KEY, None)
            if master is None or _set_outside(p, master):
                master = _plain(p.detach()).to(torch.float32, copy=True)
            for key, value in list(state.items()):
                if _is_q(value):  # made from the parameter in __init__ (Adagrad's "sum"): FP32
                    state[key] = _plain(value.detach()).to(master.dtype, copy=True)
            optimizer.state[master] = state
            master.grad = None if p.grad is None else _master_grad(master, p.grad,
                                                                   reuse_grad_buffers)
            params[i] = master
            swapped.append((params, i, p, master))
    optimizer._qt_swapped = swapped


# master -> its gradient buffer (beside it, not on it: a checkpoint of the optimizer's state
# must not carry it)
_grad_buffers: dict = {}  # id(master) -> (weak reference to it, buffer)


def _master_grad(master, grad, reuse: bool = True):
    """An FP32 copy of the parameter's gradient for its master: into the buffer of the previous
    step where it fits (a new buffer of that size each step costs more, in allocation and page
    faults, than the copy). The master's .grad is None between steps, so nothing else holds it."""
    g = _plain(grad.detach())
    entry = _grad_buffers.get(id(master))
    buf = entry[1] if entry is not None and entry[0]() is master else None
    if (not reuse or buf is None or buf.shape != g.shape or buf.device != g.device
            or buf.dtype != master.dtype or type(g) is not torch.Tensor):
        buf = g.to(master.dtype, copy=True)
        if reuse and type(g) is torch.Tensor:
            key = id(master)
            _grad_buffers[key] = (weakref.ref(master, lambda _r: _grad_buffers.pop(key, None)),
                                  buf)
        return buf
    return buf.copy_(g)


def swapped_masters(optimizer) -> dict:
    """While a step runs on FP32 master weights: id(master) -> the parameter it stands in for."""
    return {id(m): p for _, _, p, m in getattr(optimizer, "_qt_swapped", ())}


class _MasterClosure:
    """The closure given to a step with master weights: the closure evaluates the model, so the
    model's parameters are put back (holding the masters' current values) around each call, and
    the masters get the gradients it computed. If it raises, the model's parameters stay."""

    def __init__(self, optimizer, closure):
        self.optimizer, self.closure = optimizer, closure

    def __call__(self):
        _restore(self.optimizer, copy_back=True)
        loss = self.closure()
        # (a new gradient each call: the step may still hold the previous call's)
        _swap_in(self.optimizer, reuse_grad_buffers=False)
        return loss


def _restore_parameters(optimizer) -> None:
    # before state_dict(): a step that raised may have left the masters in the optimizer
    _restore(optimizer, copy_back=False)
    _put_back_sharded(optimizer, copy_back=False)


class _ZeroGradAfterFailedStep:
    """``optimizer.zero_grad`` of an optimizer with master weights: a step that raised left the
    masters in the optimizer (the post-step hook did not run); put the model's parameters back
    first, so that zero_grad clears the model's gradients."""

    def __init__(self, optimizer):
        self.optimizer = optimizer

    def __call__(self, *args, **kwargs):
        _restore(self.optimizer, copy_back=False)
        _put_back_sharded(self.optimizer, copy_back=False)
        return type(self.optimizer).zero_grad(self.optimizer, *args, **kwargs)


def _pre_step(optimizer, args, kwargs):
    # A step that raised left the masters (or whole tensors) in place: put the parameters back.
    _restore(optimizer, copy_back=False)
    _put_back_sharded(optimizer, copy_back=False)
    _shards.enter_step()
    if not _involved(optimizer):
        return None
    _optimizers.add(optimizer)
    gathered = _distributed.gather_for_step(optimizer)
    if isinstance(optimizer, torch.optim.Adagrad):
        _init_adagrad_state(optimizer)
    _swap_in(optimizer)
    if isinstance(optimizer, torch.optim.Adam):
        _init_adam_state(optimizer)
    elif isinstance(optimizer, torch.optim.SGD):
        _init_sgd_state(optimizer)
    if not optimizer._qt_swapped and not gathered:
        return None
    if "zero_grad" not in optimizer.__dict__:  # once per optimizer
        optimizer.zero_grad = _ZeroGradAfterFailedStep(optimizer)
        optimizer.register_state_dict_pre_hook(_restore_parameters)
    # args is (optimizer, closure?)
    if len(args) > 1 and args[1] is not None:
        return (args[0], _MasterClosure(optimizer, args[1])) + tuple(args[2:]), kwargs
    if kwargs.get("closure") is not None:
        return args, dict(kwargs, closure=_MasterClosure(optimizer, kwargs["closure"]))
    return None


def _state_zeros(p, plan, zero=0.0):
    if hasattr(p, "_local_tensor"):  # a DTensor (FSDP2's sharded parameter): its placements
        zeros = torch.full_like(_plain(p.detach()), zero)
    else:
        zeros = torch.full(p.shape, zero, dtype=p.dtype, device=p.device)
    return round_to(zeros, plan.optimizer_state, name=f"optimizer state of {plan.name}")


def _init_sgd_state(optimizer) -> None:
    # SGD's first step clones the gradient into the momentum buffer. With dampening 0, a buffer
    # of -0.0 in the state role gives the same values (-0.0 * momentum + g is g, signs of zero
    # included), rounded into the role from the first step on. With dampening > 0 the first
    # step (a clone, undamped) differs from the later ones: SGD creates the buffer itself.
    for group in optimizer.param_groups:
        if not group.get("momentum") or group.get("dampening") or group.get("fused"):
            continue
        for p in group["params"]:
            plan = _plan(p)
            if plan is None or plan.master or p.grad is None:
                continue
            state = optimizer.state[p]
            if state.get("momentum_buffer") is None:
                state["momentum_buffer"] = _state_zeros(p, plan, -0.0)


def _init_adagrad_state(optimizer) -> None:
    # Adagrad makes "sum" in __init__ with torch.full_like(p, initial_accumulator_value): a
    # QTensor in the weight format (FP8: 0.1 is 0.1015625). Before its first step it is made
    # again from the exact value, in FP32 for master weights (_swap_in moves it to the
    # master), else in the optimizer_state role.
    for group in optimizer.param_groups:
        if group.get("fused"):
            continue
        for p in group["params"]:
            plan = _plan(p)
            state = optimizer.state.get(p)
            if plan is None or not state or not _is_q(state.get("sum")):
                continue
            if float(state.get("step", 1)) != 0 or torch.is_complex(state["sum"]):
                continue
            value = torch.full(p.shape, float(group["initial_accumulator_value"]),
                               dtype=torch.float32, device=p.device)
            state["sum"] = value if plan.master else round_to(
                value, plan.optimizer_state, name=f"optimizer state 'sum' of {plan.name}")


def _init_adam_state(optimizer) -> None:
    # Create Adam/AdamW state directly in the optimizer_state role (exactly what Adam's lazy
    # init does, zeros, but in the right format), so that the first step is computed in it too.
    flushing = {}
    for group in optimizer.param_groups:
        if group.get("fused") or group.get("capturable"):
            continue
        for p in group["params"]:
            plan = _plan(p)
            if plan is None or plan.master or p.grad is None or optimizer.state.get(p):
                continue
            dtype = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
            state = {"step": torch.tensor(0.0, dtype=dtype, device="cpu"),
                     "exp_avg": _state_zeros(p, plan), "exp_avg_sq": _state_zeros(p, plan)}
            if group.get("amsgrad"):
                state["max_exp_avg_sq"] = _state_zeros(p, plan)
            optimizer.state[p] = state
            if _flushes(group["eps"], plan.optimizer_state.fmt):
                flushing.setdefault((str(plan.optimizer_state.fmt), group["eps"]), []).append(
                    plan.name)
    for (fmt, eps), names in flushing.items():
        _warn(
            f"{type(optimizer).__name__}: eps={eps:g} rounds to 0 next to 1.0 in the "
            f"optimizer_state format {fmt} (of {', '.join(names)}): wherever exp_avg_sq rounds "
            "to 0 the update is 0/0 (NaN). Keep Adam's state in FP32 (optimizer_state=None, or "
            "master_weights=True), as qt.convert(model, fmt) does for such formats.")


def _flushes(eps: float, fmt) -> bool:
    """Whether ``eps`` rounds to 0 in ``fmt`` next to 1.0 (in one block, for block formats)."""
    try:
        values = quantize(torch.tensor([1.0, eps]), fmt)
    except (ValueError, RuntimeError, IndexError):  # a block axis a vector lacks: no verdict
        return False
    return eps > 0 and float(values[1]) == 0.0


def _post_step(optimizer, args, kwargs):
    _shards.exit_step()
    _restore(optimizer, copy_back=True)
    if not _involved(optimizer):
        return
    # Optimizer state into the optimizer_state role. Scalars such as Adam's "step" counter are
    # left alone.
    for group in optimizer.param_groups:
        for p in group["params"]:
            plan = _plan(p)
            if plan is None or plan.master:
                continue
            state = optimizer.state.get(p)
            if not state:
                continue
            role = plan.optimizer_state
            for key, value in list(state.items()):
                if (isinstance(value, torch.Tensor) and value.is_floating_point()
                        and value.dim() > 0 and key != "step"):
                    with torch.no_grad():
                        state[key] = round_to(value.detach(), role,
                                                   name=f"optimizer state {key!r} of {plan.name}")
    _put_back_sharded(optimizer, copy_back=True)


def follow_replaced(moved) -> None:
    """Parameters that qt.convert or qt.unconvert replaced by new objects (``{id(old): (old,
    new)}``): the optimizers known here hold the new ones, with the same state."""
    for optimizer in list(_optimizers):
        _restore(optimizer, copy_back=False)
        for group in optimizer.param_groups:
            params = group["params"]
            for i, p in enumerate(params):
                old_new = moved.get(id(p))
                if old_new is None or old_new[0] is not p or old_new[1] is p:
                    continue
                params[i] = old_new[1]
                if p in optimizer.state:
                    optimizer.state[old_new[1]] = optimizer.state.pop(p)


def unconvert_optimizers(moved) -> None:
    """qt.unconvert: the optimizers that stepped its parameters (``{id(old): (old, new)}``)
    hold the new plain parameters, with plain state in their dtypes and no FP32 masters."""
    follow_replaced(moved)
    new_params = {id(new): new for _old, new in moved.values()}
    for optimizer in list(_optimizers):
        for group in optimizer.param_groups:
            for p in group["params"]:
                if id(p) not in new_params or p not in optimizer.state:
                    continue
                state = optimizer.state[p]
                state.pop(MASTER_KEY, None)
                for key, value in list(state.items()):
                    if not isinstance(value, torch.Tensor) or not value.is_floating_point():
                        continue
                    if _is_q(value) or (value.dim() and value.dtype != p.dtype):
                        with torch.no_grad():  # (FP32 state of masters: the parameter's dtype)
                            value = _plain(value).detach()
                            state[key] = (value.to(p.dtype, copy=True) if value.dim()
                                          else value.clone())


def master_weight(optimizer, param) -> Optional[torch.Tensor]:
    """The FP32 master copy the optimizer keeps for ``param`` (None before the first step)."""
    return optimizer.state.get(param, {}).get(MASTER_KEY)


# ---------------------------------------------------------------------------------------------
# Loss scaling

def _dequantized(t: torch.Tensor) -> torch.Tensor:
    return _plain(t)


def _overflowed(g: torch.Tensor, detect_saturation: bool) -> bool:
    values = _dequantized(g)
    if not bool(torch.isfinite(values).all()):
        return True
    if detect_saturation and _is_q(g):
        fmt = g.fmt
        limit = getattr(fmt, "max", None)
        if limit is not None and math.isfinite(limit) and bool((values.abs() >= limit).any()):
            return True
    return False


class LossScaler:
    """Static or dynamic loss scaling, used like ``torch.amp.GradScaler``::

        scaler = qt.LossScaler(init_scale=2**16, dynamic=True)
        scaler.scale(loss).backward()
        scaler.step(optimizer)      # unscales the gradients; skips the step on Inf/NaN
        scaler.update()

    ``unscale_(optimizer)`` may be called before ``step`` (e.g. to clip gradients). Every scale
    and factor must be a power of two (a ValueError says so otherwise), so that scaling and
    unscaling are exact in float and block formats. Both
    static and dynamic scalers skip steps whose gradients hold Inf or NaN; only the dynamic one
    changes its scale (``backoff_factor`` after an overflow, ``growth_factor`` after
    ``growth_interval`` clean steps, never below ``min_scale``).
    """

    def __init__(self, init_scale: float = 2.0 ** 16, *, dynamic: bool = True,
                 growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, min_scale: float = 2.0 ** -24,
                 detect_saturation: bool = False):
        init_scale = check_scale(init_scale, "LossScaler init_scale")
        growth_factor = check_scale(growth_factor, "LossScaler growth_factor")
        backoff_factor = check_scale(backoff_factor, "LossScaler backoff_factor")
        min_scale = check_scale(min_scale, "LossScaler min_scale")
        if not growth_factor > 1.0:
            raise ValueError(
                f"LossScaler growth_factor must be > 1 (2, 4, ...), got {growth_factor}")
        if not backoff_factor < 1.0:
            raise ValueError(
                f"LossScaler backoff_factor must be < 1 (0.5, 0.25, ...), got {backoff_factor}")
        if isinstance(growth_interval, bool) or not (
                isinstance(growth_interval, int) and growth_interval >= 1):
            raise ValueError(
                f"LossScaler growth_interval must be a positive int, got {growth_interval!r}")
        self._scale = init_scale
        self.dynamic = bool(dynamic)
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.min_scale = min_scale
        self.detect_saturation = bool(detect_saturation)
        self._growth_tracker = 0
        self._per_optimizer = {}  # id(optimizer) -> {"unscaled": bool, "found_inf": bool}
        self.skipped_steps = 0

    @classmethod
    def from_recipe(cls, recipe, **kwargs) -> "LossScaler":
        """The scaler a recipe asks for: its ``loss_scale`` (None: scale 1, static; a number:
        static; "dynamic": dynamic from 2^16). Steps with Inf/NaN gradients are skipped always."""
        recipe = as_recipe(recipe)
        ls = recipe.loss_scale
        if ls is None:
            return cls(1.0, dynamic=False, **kwargs)
        if ls == "dynamic":
            return cls(dynamic=True, **kwargs)
        return cls(float(ls), dynamic=False, **kwargs)

    def get_scale(self) -> float:
        return self._scale

    def scale(self, loss):
        """``loss`` times the current scale (a tensor or a structure of tensors)."""
        if isinstance(loss, torch.Tensor):
            return loss * self._scale
        if isinstance(loss, (list, tuple)):
            return type(loss)(self.scale(x) for x in loss)
        raise TypeError(f"LossScaler.scale expects a tensor, got {type(loss).__name__}")

    def _record(self, optimizer):
        return self._per_optimizer.setdefault(id(optimizer), {"unscaled": False, "found_inf": False})

    def unscale_(self, optimizer) -> None:
        """Divide the gradients of ``optimizer``'s parameters by the scale, in place (rounding
        into each gradient's format), and note whether any was Inf/NaN (or saturated).

        Limitation: the unscaled gradient is rounded into the gradient's *value* format again, so
        loss scaling protects the backward pass (operand formats such as the MX recipes' MXFP6
        gradients with BF16 values, and every intermediate gradient) but not a narrow gradient
        value format itself: there the unscaled values underflow as before. For such formats
        divide the learning rate by ``get_scale()`` instead of unscaling (exact with FP32 master
        weights; examples/demo.py does this)."""
        rec = self._record(optimizer)
        if rec["unscaled"]:
            raise RuntimeError("unscale_() has already been called on this optimizer since the "
                               "last update()")
        inv = 1.0 / self._scale
        found = False
        with torch.no_grad():
            for group in optimizer.param_groups:
                for p in group["params"]:
                    g = p.grad
                    if g is None:
                        continue
                    if _overflowed(g, self.detect_saturation):
                        found = True
                    if inv != 1.0:
                        g.mul_(inv)
        rec["unscaled"] = True
        rec["found_inf"] = found

    def step(self, optimizer, *args, **kwargs):
        """Unscale (if not done yet) and run ``optimizer.step()`` unless a gradient overflowed.
        Returns the step's return value, or None when the step was skipped. A closure is refused
        (as by torch.amp.GradScaler): its gradients would come after the unscaling."""
        if args or kwargs.get("closure") is not None:
            raise TypeError("LossScaler.step does not take a closure (the closure's gradients "
                            "would not be unscaled): call scaler.scale(loss).backward() and then "
                            "scaler.step(optimizer), as with torch.amp.GradScaler")
        rec = self._record(optimizer)
        if not rec["unscaled"]:
            self.unscale_(optimizer)
        if rec["found_inf"]:
            self.skipped_steps += 1
            return None
        return optimizer.step(*args, **kwargs)

    def update(self, new_scale: Optional[float] = None) -> None:
        """Adjust the scale (dynamic only) and reset the per-step records."""
        found = any(r["found_inf"] for r in self._per_optimizer.values())
        self._per_optimizer.clear()
        if new_scale is not None:
            self._scale = check_scale(new_scale, "LossScaler.update new_scale")
            self._growth_tracker = 0
            return
        if not self.dynamic:
            return
        if found:
            self._scale = max(self._scale * self.backoff_factor, self.min_scale)
            self._growth_tracker = 0
        else:
            self._growth_tracker += 1
            if self._growth_tracker >= self.growth_interval:
                self._scale *= self.growth_factor
                self._growth_tracker = 0

    def state_dict(self) -> dict:
        return {"scale": self._scale, "growth_tracker": self._growth_tracker,
                "dynamic": self.dynamic, "growth_factor": self.growth_factor,
                "backoff_factor": self.backoff_factor, "growth_interval": self.growth_interval,
                "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict) -> None:
        self._scale = check_scale(state["scale"], "LossScaler state 'scale'")
        self._growth_tracker = int(state.get("growth_tracker", 0))
        self.dynamic = bool(state.get("dynamic", self.dynamic))
        self.growth_factor = float(state.get("growth_factor", self.growth_factor))
        self.backoff_factor = float(state.get("backoff_factor", self.backoff_factor))
        self.growth_interval = int(state.get("growth_interval", self.growth_interval))
        self.skipped_steps = int(state.get("skipped_steps", 0))

    def __repr__(self) -> str:
        kind = "dynamic" if self.dynamic else "static"
        return f"LossScaler(scale={self._scale:g}, {kind})"
