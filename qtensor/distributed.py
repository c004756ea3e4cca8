"""Converted models under torch.distributed: wrap order, and the FSDP2 sharded parameters.

The collectives themselves are op rules (``qtensor.dispatch``: a collective on QTensors waits for
its result, then rounds it once into the format). This module holds what concerns a converted
model as a whole:

- :func:`check_unwrapped`: ``qt.convert`` refuses a model already wrapped for data or tensor
  parallelism (DDP, FSDP, ``fully_shard``, DTensor parameters): the wrapper holds references to
  the parameters (DDP's buckets, FSDP's shards) that a conversion would not reach, and the ranks
  would silently diverge. Convert, then wrap.

- FSDP2 (``fully_shard`` of a converted model): the sharded parameters are DTensors whose local
  tensors are QTensor shards; ``QTensor.fsdp_pre_all_gather``/``fsdp_post_all_gather`` (in
  qtensor.tensor) all-gather their payloads and give the unsharded parameter its formats.
  qt.convert leaves each module a table of its parameters' plans (:func:`remember_plan`); before
  the first all-gather (:func:`on_fsdp_all_gather`) or the first optimizer step
  (:func:`sharded_plan`, for qtensor.training), whichever comes first, the sharded parameter
  gets its plan (so the step hooks keep FP32 masters and optimizer state as in one process) and
  a hook (``register_post_accumulate_grad_hook``, which FSDP2 runs after the reduce-scatter)
  that rounds the reduced gradient shard, an FP32 mean, once into its grad role.

The reduction rule, the wrap orders and what is not supported: docs/distributed.md.
"""
from __future__ import annotations

import sys
import weakref

import torch
from torch import nn

from . import training
from .plans import round_to
from .tensor import QTensor, register_fsdp_hook

__all__ = ["check_unwrapped", "on_fsdp_all_gather"]


def _is_dtensor(t) -> bool:
    mod = sys.modules.get("torch.distributed.tensor")  # not imported: there is no DTensor
    return mod is not None and isinstance(t, mod.DTensor)


def _wrapper_of(model: nn.Module):
    """(what wraps model, how to do it right), or None: the first wrapper found in the model."""
    for name, mod in model.named_modules():
        where = f"submodule {name!r}" if name else "the model"
        cls = type(mod)
        names = {c.__name__ for c in cls.__mro__}
        if "DistributedDataParallel" in names:
            return (f"{where} is a DistributedDataParallel",
                    "qt.convert(model, spec), then DDP(model)")
        if "FullyShardedDataParallel" in names:
            return (f"{where} is a FullyShardedDataParallel (FSDP1, not supported)",
                    "qt.convert(model, spec), then torch.distributed.fsdp.fully_shard(...)")
        if "FSDPModule" in names:
            return (f"{where} is sharded by fully_shard",
                    "qt.convert(model, spec), then fully_shard(...) on its blocks and the root")
    for name, p in model.named_parameters():
        if _is_dtensor(p):
            return (f"parameter {name!r} is a DTensor (parallelize_module, distribute_tensor)",
                    "qt.convert(model, spec), then parallelize_module(...)")
    return None


def check_unwrapped(model: nn.Module) -> None:
    """Raise if ``model`` is already wrapped for distributed training (see the module doc)."""
    found = _wrapper_of(model)
    if found is None:
        return
    what, how = found
    done = [n for n, m in model.named_modules() if getattr(m, "_qt_conversion", None) is not None]
    note = (f" (submodule {done[0]!r} is converted already: the wrapper needs no conversion)"
            if done else "")
    raise TypeError(
        f"qt.convert: {what}: convert, then wrap{note}. Converting a wrapped model would change "
        "the parameters behind the wrapper's back (DDP's gradient buckets and broadcast, FSDP's "
        f"shards), and the ranks would silently diverge. Do {how} (docs/distributed.md).")


# ---------------------------------------------------------------------------------------------
# FSDP2

PLANS_ATTR = "_qt_param_plans"  # on each converted module: {parameter name: TensorPlan}
_planned = weakref.WeakSet()  # the modules that have such a table


def remember_plan(module: nn.Module, name: str, plan) -> None:
    """qt.convert: ``module.<name>`` has ``plan`` (FSDP2 replaces the parameter object later)."""
    module.__dict__.setdefault(PLANS_ATTR, {})[name] = plan
    _planned.add(module)


class _RoundReducedGrad:
    """A sharded parameter's post-accumulate-grad hook: FSDP2 has set its gradient to the
    reduce-scatter's FP32 mean (a DTensor with a plain local shard); round it once into the grad
    role. An accumulated gradient (no resharding between backwards) is a QTensor already: FSDP2
    adds into it in place, which rounds into its format."""

    def __init__(self, plan):
        self.plan = plan

    def __call__(self, p):
        g = p.grad
        local = getattr(g, "_local_tensor", None)
        if local is None or isinstance(local, QTensor) or self.plan.grad.full_precision:
            return
        from torch.distributed.tensor import DTensor
        q = round_to(local, self.plan.grad, name=f"gradient of {self.plan.name}")
        p.grad = DTensor.from_local(q, g.device_mesh, g.placements, run_check=False,
                                    shape=g.shape, stride=g.stride())


def _attach_sharded(p, plan) -> None:
    """Hook FSDP2's sharded parameter ``p`` of a converted one (once)."""
    if p.__dict__.get("_qt_reduced_grad_hook"):
        return
    p.register_post_accumulate_grad_hook(_RoundReducedGrad(plan))
    p._qt_reduced_grad_hook = True
    if not plan.value.full_precision:  # qt.training's step hooks: masters, optimizer state
        p._qt_plan = plan
        training.bump_epoch()


def on_fsdp_all_gather(local: QTensor, module: nn.Module) -> None:
    """FSDP2 is about to all-gather the sharded QTensor ``local`` of ``module``: hook its sharded
    parameter once (see the module doc)."""
    plans = module.__dict__.get(PLANS_ATTR)
    if not plans:
        return
    for name, p in module._parameters.items():
        if getattr(p, "_local_tensor", None) is local:
            plan = plans.get(name)
            if plan is not None:
                _attach_sharded(p, plan)
            return


def sharded_plan(p):
    """The plan of ``p`` if it is FSDP2's sharded parameter of a converted one (hooked now),
    else None: for qt.training, when an optimizer steps it before any all-gather (DCP's
    get_optimizer_state_dict initializes the state with a step)."""
    if p.__dict__.get("_qt_not_sharded_plan") or not isinstance(p._local_tensor, QTensor):
        return None
    for module in list(_planned):
        for name, plan in module.__dict__.get(PLANS_ATTR, {}).items():
            if module._parameters.get(name) is p:
                _attach_sharded(p, plan)
                break
        else:
            continue
        break
    found = getattr(p, "_qt_plan", None)
    if found is None:  # not one, or left in full precision: not looked up again
        p._qt_not_sharded_plan = True
    return found


register_fsdp_hook(on_fsdp_all_gather)
training.register_sharded_plan_lookup(sharded_plan)
