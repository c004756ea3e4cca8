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
  qtensor.tensor) all-gather their payloads and give the unsharded parameter its formats. Before
  the first all-gather :func:`on_fsdp_all_gather` finds the sharded parameter and its plan, and
  hooks it (``register_post_accumulate_grad_hook``, which FSDP2 runs after the reduce-scatter):
  the reduced gradient shard, an FP32 mean, is rounded once into the parameter's grad role.

The reduction rule, the wrap orders and what is not supported: docs/distributed.md.
"""
from __future__ import annotations

import sys

import torch
from torch import nn

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


def _check_fsdp_plan(plan) -> None:
    """Refuse what the sharded parameters cannot do yet: qtensor.training's step hooks (FP32
    master copies, optimizer state in its own role) act on QTensor parameters, not on DTensors;
    the optimizer steps the shards in place, in the weight's format."""
    fp32_weight = plan.value.full_precision or str(plan.value.fmt) == "fp32"
    state = plan.optimizer_state
    same_state = (state.full_precision and fp32_weight) or (
        not state.full_precision and plan.value.fmt == state.fmt)
    if (plan.master and not fp32_weight) or not same_state:
        raise NotImplementedError(
            f"fully_shard of a converted model: parameter {plan.name} has weight {plan.value}, "
            f"optimizer_state {state}, master_weights={plan.master}. Under FSDP2 the optimizer "
            "steps the sharded QTensor parameters in place (qt.training's FP32 master copies and "
            "optimizer-state formats do not reach DTensor parameters yet), so this is supported "
            "only where that is the same: FP32 weights (mm_fmt any: qt.recipes.mxfp6, "
            "mxfp4_weights), or master_weights=False with optimizer_state in the weight's format "
            "(qt.convert(model, 'bf16'), qt.recipes.mx_all_*). See docs/distributed.md.")


def on_fsdp_all_gather(local: QTensor, module: nn.Module) -> None:
    """FSDP2 is about to all-gather the sharded QTensor ``local`` of ``module``: hook its sharded
    parameter once (see the module doc)."""
    plans = module.__dict__.get(PLANS_ATTR)
    if not plans:
        return
    for name, p in module._parameters.items():
        if getattr(p, "_local_tensor", None) is local:
            break
    else:
        return  # (not a parameter of module: shared elsewhere)
    if getattr(p, "_qt_reduced_grad_hook", False):
        return
    plan = plans.get(name)
    if plan is None:
        return
    _check_fsdp_plan(plan)
    p.register_post_accumulate_grad_hook(_RoundReducedGrad(plan))
    p._qt_reduced_grad_hook = True


register_fsdp_hook(on_fsdp_all_gather)
