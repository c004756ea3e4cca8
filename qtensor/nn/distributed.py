"""Converted models under torch.distributed: wrap order, DDP's options, FSDP2's sharded parameters.

The collectives themselves are op rules (``qtensor.tensor.collectives``: a collective on QTensors
waits for its result, then rounds it once into the format). This module holds what concerns a converted
model as a whole:

- :func:`check_unwrapped`: ``qt.convert`` refuses a model already wrapped for data or tensor
  parallelism (DDP, FSDP, ``fully_shard``, DTensor parameters): the wrapper holds references to
  the parameters (DDP's buckets, FSDP's shards) that a conversion would not reach, and the ranks
  would silently diverge. Convert, then wrap.

- DDP (``DDP(qt.convert(model, spec))``) needs nothing for its default options: it copies the
  all-reduced FP32 mean into each QTensor gradient, which rounds it once (the reduction rule).
  :func:`check_ddp_forward` (the converted root's forward, inside a DDP's) refuses the options
  that would make the gradients plain (``gradient_as_bucket_view``, ``mixed_precision``) and,
  under ``find_unused_parameters``/``static_graph``, rounds the plain gradient that DDP creates
  for a parameter unused on this rank but used on another (:class:`_RoundDDPGrads`).

- DDP's broadcasts (its start-up copy of rank 0's parameters and buffers, the buffers again at
  each forward; also DCP's ``broadcast_from_rank0``) go through ``dist._broadcast_coalesced``,
  which flattens all the tensors into one with a ``cat``: of QTensors of different formats (or
  plain tensors among them) that cat would round every value to the first one's format.
  :func:`_broadcast_payloads` (qtensor.tensor.shims wraps it with this) sends the QTensors'
  payloads instead: the values arrive unchanged, bit for bit.

- FSDP2 (``fully_shard`` of a converted model): the sharded parameters are DTensors whose local
  tensors are QTensor shards; ``QTensor.fsdp_pre_all_gather``/``fsdp_post_all_gather`` (in
  qtensor.tensor.subclass) all-gather their payloads and give the unsharded parameter its formats.
  qt.convert leaves each module a table of its parameters' plans (:func:`remember_plan`); before
  the first all-gather (:func:`on_fsdp_all_gather`) or the first optimizer step
  (:func:`sharded_plan`, for qtensor.nn.training), whichever comes first, the sharded parameter
  gets its plan (so the step hooks keep FP32 masters and optimizer state as in one process) and
  a hook (``register_post_accumulate_grad_hook``, which FSDP2 runs after the reduce-scatter)
  that rounds the reduced gradient shard, an FP32 mean, once into its grad role. Where the
  shards cut blocks of a parameter's formats (:func:`cuts_blocks`: a bias sharded along its only
  dim, a format blocked along the sharded dim), the reduced gradient is rounded as a whole
  tensor (gathered) and the optimizer step runs on the whole parameter (:class:`_GatheredStep`).

- Two-level formats (nvfp4): the tensor scale spans the whole tensor. Where the shards cut
  none of its blocks, the sharded parameter, its reduced gradient and its optimizer state are
  marked as shards (qtensor.tensor.shards): every op on them rounds under the whole tensor's
  scale, so they step on their shards; where they cut a block, as cut blocks above. FSDP2's
  shards (built from zeros and a copy of their chunk: :func:`_give_scale`) and the tensors that
  DCP loads into (:func:`_commit_scale`) get the whole parameter's scale (the wrappers of those
  private torch functions are in qtensor.tensor.shims).

- Norms (clip_grad_norm_'s) of sharded DTensors of QTensors are one process's: taken of the
  gathered whole tensor (:func:`_norm_of_whole`, :func:`_stack_of_norms`: DTensor op handlers,
  registered through qtensor.tensor.shims).

The reduction rule, the wrap orders and what is not supported: docs/distributed.md.
"""
from __future__ import annotations

import functools
import sys
import weakref

import torch
from torch import nn

from .masters import MASTER_KEY, bump_epoch, mark_synced, set_outside
from .plans import _plain, round_shard_to, round_to
from ..tensor import shards, shims
from ..tensor.shards import cuts_blocks
from ..tensor.subclass import FSDP_HOOK_ATTR, QTensor

__all__ = ["check_unwrapped", "check_ddp_forward", "on_fsdp_all_gather"]


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
# DDP

_DDP_MODULE = "torch.nn.parallel.distributed"
_ddp_roots = weakref.WeakKeyDictionary()  # DDP -> the converted roots checked in its forward


def check_ddp_forward(model: nn.Module) -> None:
    """The converted root ``model`` starts a forward; inside a DDP's forward (once per DDP):
    refuse the DDP options that lose the gradients' formats, and give the DDPs that may leave a
    parameter unused on a rank (``find_unused_parameters``, ``static_graph``) the fix-up of
    :class:`_RoundDDPGrads`. What DDP does with the formats by default (the reduction rule):
    docs/distributed.md."""
    mod = sys.modules.get(_DDP_MODULE)  # not imported: there is no DDP
    ddp = None if mod is None else mod.DistributedDataParallel._active_ddp_module
    if ddp is None:
        return
    seen = _ddp_roots.get(ddp)
    if seen is None:
        seen = _ddp_roots[ddp] = weakref.WeakSet()
    if model in seen:
        return
    if not any(m is model for m in ddp.module.modules()):
        return  # a converted model that this DDP calls but does not hold: not its parameters
    if ddp.gradient_as_bucket_view:
        raise TypeError(
            "DDP(gradient_as_bucket_view=True) of a converted model is not supported: DDP would "
            "make each gradient a plain FP32 view of its bucket, so the gradients lose their "
            "formats and the all-reduced mean is never rounded into the grad format (the "
            "optimizer would step on unrounded gradients). Use DDP(model) with "
            "gradient_as_bucket_view=False (the default): a converted model's gradients are "
            "QTensors with FP32 payloads, so the views would save no memory here "
            "(docs/distributed.md).")
    if getattr(ddp, "mixed_precision", None) is not None:
        raise TypeError(
            "DDP(mixed_precision=...) of a converted model is not supported: the formats are "
            "the precision (it would replace the QTensor parameters by plain casts). Give the "
            "formats with qt.convert and wrap with DDP(model) (docs/distributed.md).")
    if ddp.find_unused_parameters or ddp.static_graph:
        handle = model.register_forward_hook(_RoundDDPGrads(model, ddp))
        conv = getattr(model, "_qt_conversion", None)
        if conv is not None:
            conv.handles.append(handle)  # qt.unconvert removes it
    seen.add(model)


class _RoundDDPGrads:
    """A converted root's forward hook under a DDP that may find a parameter unused on this rank
    but used on another: DDP then gives it a new plain FP32 gradient (a clone of its bucket: the
    mean, not rounded; the parameters used here have QTensor gradients, into which DDP copies the
    mean, rounding it once). When backward reaches this forward's outputs, queue a callback that
    runs after DDP's own (which writes the gradients at the end of backward) and rounds every
    plain gradient of a converted parameter once into its grad role: the rule."""

    def __init__(self, model, ddp):
        self.model, self.ddp = weakref.ref(model), weakref.ref(ddp)

    def __call__(self, module, args, output):
        ddp = self.ddp()
        if (ddp is None or not torch.is_grad_enabled() or not ddp.require_backward_grad_sync
                or sys.modules[_DDP_MODULE].DistributedDataParallel._active_ddp_module
                is not ddp):
            return None  # no reduction this time (eval, no_sync, called outside this DDP)
        from torch.utils._pytree import tree_leaves
        once = _OnBackward(self.model)  # this forward's: queued once by its first output
        for t in tree_leaves(output):
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(once)
        return None


class _OnBackward:
    def __init__(self, model_ref):
        self.model, self.queued = model_ref, False

    def __call__(self, grad):
        if not self.queued:
            self.queued = True
            engine = torch.autograd.Variable._execution_engine
            # DDP queues its callback when its last bucket is ready, after this one: queue
            # again from inside the callback to run after it
            engine.queue_callback(lambda: engine.queue_callback(self.round_plain_grads))
        return None

    def round_plain_grads(self):
        model = self.model()
        if model is None:
            return
        for mod in model.modules():
            for name, plan in mod.__dict__.get(PLANS_ATTR, {}).items():
                p = mod._parameters.get(name)
                g = None if p is None else p.grad
                if (g is None or isinstance(g, QTensor) or _is_dtensor(g) or g.is_sparse
                        or plan.grad.full_precision):
                    continue
                with torch.no_grad():
                    p.grad = round_to(g, plan.grad, name=f"gradient of {plan.name}")


def _broadcast_payloads(tensors):
    """What ``dist._broadcast_coalesced`` sends for ``tensors`` (qtensor.tensor.shims wraps it),
    None for tensors as they are. It flattens its tensors with one ``cat``, which would round
    values of other formats (and plain ones) to the first QTensor's format: it sends the
    QTensors' payloads instead. Payloads are plain FP32 values, and the source rank's values are
    in their formats: the copies written into the payloads need no rounding. A two-level
    format's FP32 tensor scale travels with its payload (the values are fl32(e X s) under it: a
    receiver keeping its own would hold values that its scale does not give)."""
    if not any(isinstance(t, QTensor) for t in tensors):
        return None
    # into the scale tensors themselves: callers pass detached aliases of the parameters,
    # which share them (as do the tensors a QTensor was sliced from)
    scales = [t.tensor_scale for t in tensors
              if isinstance(t, QTensor) and t.tensor_scale is not None]
    return [t._data if isinstance(t, QTensor) else t for t in tensors] + scales


shims.wrap_broadcast_coalesced(_broadcast_payloads)


# ---------------------------------------------------------------------------------------------
# FSDP2

PLANS_ATTR = "_qt_param_plans"  # on each converted module: {parameter name: TensorPlan}
_planned = weakref.WeakSet()  # the modules that have such a table


def remember_plan(module: nn.Module, name: str, plan, grad_hook) -> None:
    """qt.convert: ``module.<name>`` has ``plan`` (FSDP2 replaces the parameter object later);
    ``grad_hook(plan)`` is the converted parameter's gradient hook, which FSDP2's unsharded
    parameter gets too. The module's QTensors call :func:`on_fsdp_all_gather` before each of
    FSDP2's all-gathers (``QTensor.fsdp_pre_all_gather`` reads it from the module)."""
    module.__dict__.setdefault(PLANS_ATTR, {})[name] = plan
    module.__dict__[FSDP_HOOK_ATTR] = functools.partial(on_fsdp_all_gather, grad_hook=grad_hook)
    _planned.add(module)


def forget_plans(module: nn.Module) -> None:
    """qt.unconvert: what :func:`remember_plan` left on the module."""
    module.__dict__.pop(PLANS_ATTR, None)
    module.__dict__.pop(FSDP_HOOK_ATTR, None)


def _cut_roles(p, plan, roles=("value", "grad", "optimizer_state")) -> bool:
    """Whether the shards of ``p`` cut blocks of a role's format (a two-level format's tensor
    scale alone is no cut here: its shards round under the whole tensor's scale)."""
    return any(cuts_blocks(getattr(plan, r).fmt, p)
               and not shards.cuts_scale_only(getattr(plan, r).fmt, p) for r in roles)


def _local_part(full: torch.Tensor, p) -> torch.Tensor:
    """This rank's part (a copy) of ``full``, a whole tensor shaped as the DTensor ``p``, as the
    local tensor of a DTensor with ``p``'s placements. A QTensor's values are taken as they are
    (they are in its format: no rounding as a shard)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    index = tuple(slice(o, o + n) for o, n in zip(offset, shape))
    if isinstance(full, QTensor):
        part = QTensor._wrap(full._data[index].clone(), full.fmt, full.mm_fmt, accum=full.accum)
        part._tscale = full.tensor_scale  # a two-level part keeps the whole tensor's scale
        shards.mark(part, p)
        return part
    return full[index].clone()


def _sharded_like(full: torch.Tensor, p):
    from torch.distributed.tensor import DTensor
    return DTensor.from_local(_local_part(full, p), p.device_mesh, p.placements,
                              run_check=False, shape=p.shape, stride=p.stride())


class _RoundReducedGrad:
    """A sharded parameter's post-accumulate-grad hook: FSDP2 has set its gradient to the
    reduce-scatter's FP32 mean (a DTensor with a plain local shard); round it once into the grad
    role. An accumulated gradient (no resharding between backwards) is a QTensor already: FSDP2
    adds into it in place, which rounds into its format.

    Where the shards cut blocks of the grad format, the whole mean is gathered, rounded as in
    one process and this rank keeps its part (an earlier gradient to accumulate into was set
    aside by :class:`_SetAsideGrad`: the sum is formed in FP32 on the whole tensor first, as
    the in-place add of one process does). Where they cut a two-level format's tensor scale but
    none of its blocks, the mean (or the sum) stays sharded: one scale of the whole tensor's
    amax (a scalar all-reduce) gives each rank's part the bits of the whole's rounding."""

    def __init__(self, plan):
        self.plan = plan

    def __call__(self, p):
        g = p.grad
        local = getattr(g, "_local_tensor", None)
        if local is None or isinstance(local, QTensor) or self.plan.grad.full_precision:
            return
        from torch.distributed.tensor import DTensor
        name = f"gradient of {self.plan.name}"
        earlier = p.__dict__.pop("_qt_set_aside_grad", None)
        shard = shards.sharding_of(self.plan.grad.fmt, p)
        if shard is not None:
            x = local if earlier is None else _plain(earlier.to_local()) + local
            q = round_shard_to(x, self.plan.grad, shard, name=name)
        elif cuts_blocks(self.plan.grad.fmt, p):
            full = DTensor.from_local(local, g.device_mesh, g.placements, run_check=False,
                                      shape=g.shape, stride=g.stride()).full_tensor()
            if earlier is not None:
                full = _plain(earlier.full_tensor()) + full
            q = _local_part(round_to(full, self.plan.grad, name=name), p)
        else:
            q = round_to(local, self.plan.grad, name=name)
        p.grad = DTensor.from_local(q, g.device_mesh, g.placements, run_check=False,
                                    shape=g.shape, stride=g.stride())


class _SetAsideGrad:
    """A gradient hook of FSDP2's unsharded parameter whose sharded one's grad format is cut by
    the shards: before the reduce-scatter, take the sharded parameter's earlier gradient away,
    so that FSDP2 does not add the new mean into it shard by shard (:class:`_RoundReducedGrad`
    adds them on the whole tensor)."""

    def __init__(self, sharded):
        self.sharded = weakref.ref(sharded)

    def __call__(self, grad):
        p = self.sharded()
        if p is not None and p.grad is not None:
            p._qt_set_aside_grad = p.grad
            p.grad = None
        return None


def _attach_sharded(p, plan) -> None:
    """Hook FSDP2's sharded parameter ``p`` of a converted one (once)."""
    if p.__dict__.get("_qt_reduced_grad_hook"):
        return
    p.register_post_accumulate_grad_hook(_RoundReducedGrad(plan))
    p._qt_reduced_grad_hook = True
    if not plan.value.full_precision:  # qt.training's step hooks: masters, optimizer state
        p._qt_plan = plan
        bump_epoch()


class _HookUnsharded:
    """A forward hook of a module whose converted parameters FSDP2 shards, run before FSDP2's
    post-forward reshard (registered in front): FSDP2's unsharded parameter, a new object that
    it sets on the module for forward and backward, gets the converted parameter's gradient hook
    (qtensor.nn.convert's), once. Each rank's gradient is then in its grad role before the
    reduce-scatter, as in one process; without it a rank would contribute the contraction's
    gradient as is, which a block format may block along another axis (a Linear's weight
    gradient along out_features, its grad role along in_features)."""

    def __init__(self, grad_hook):
        self.grad_hook = grad_hook
        self.plans = {}  # parameter name -> (plan, sharded parameter): those FSDP2 all-gathers

    def __call__(self, module, args, output):
        for name, (plan, sharded) in self.plans.items():
            p = module._parameters.get(name)
            if (p is None or _is_dtensor(p) or not p.requires_grad
                    or p.__dict__.get("_qt_unsharded_hooked")):
                continue
            p.register_hook(self.grad_hook(plan))
            sharded = sharded()
            if sharded is not None and cuts_blocks(plan.grad.fmt, sharded):
                p.register_hook(_SetAsideGrad(sharded))
            p._qt_unsharded_hooked = True
        return None


def _hook_unsharded(module: nn.Module, name: str, plan, sharded, grad_hook) -> None:
    hook = module.__dict__.get("_qt_unsharded_hook")
    if hook is None:
        hook = module.__dict__["_qt_unsharded_hook"] = _HookUnsharded(grad_hook)
        # (first: FSDP2's post-forward hook puts the sharded parameter back)
        module.register_forward_hook(hook, prepend=True)
    hook.plans[name] = (plan, weakref.ref(sharded))


def on_fsdp_all_gather(local: QTensor, module: nn.Module, *, grad_hook) -> None:
    """FSDP2 is about to all-gather the sharded QTensor ``local`` of ``module``: hook its sharded
    parameter and its unsharded one (with ``grad_hook(plan)``) once (see the module doc)."""
    plans = module.__dict__.get(PLANS_ATTR)
    if not plans:
        return
    for name, p in module._parameters.items():
        if getattr(p, "_local_tensor", None) is local:
            plan = plans.get(name)
            if plan is not None:
                _attach_sharded(p, plan)
                _hook_unsharded(module, name, plan, p, grad_hook)
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


def _mark_shards(p, state) -> None:
    """Before a step on the shards of ``p``: its local value, gradient and state tensors are
    marked as shards (qtensor.tensor.shards) where they are two-level, so that every op of the
    update rounds them under the whole tensor's scale (they are marked where they are made;
    this also covers tensors made elsewhere, such as state loaded from a checkpoint)."""
    for t in [p, p.grad] + list((state or {}).values()):
        if _is_dtensor(t) and t.shape == p.shape:
            shards.mark(t._local_tensor, p)


class _GatheredStep:
    """The optimizer step of sharded parameters whose shards cut blocks of their value, grad or
    optimizer-state format (a bias sharded along its only dim, a format blocked along the
    sharded dim or over the whole tensor): every op of the update rounds into those formats,
    and a shard rounded on its own would round parts of a block as blocks. (A two-level
    format's tensor scale alone is no cut: those shards round under the whole tensor's scale,
    qtensor.tensor.shards, and step as they are.) For the step the
    optimizer holds the whole parameter instead (a QTensor with the whole gradient and state,
    gathered from the shards); each rank runs the same update of it, as one process does, and
    keeps its part (the parameter's local values, its state as DTensors of shards)."""

    @staticmethod
    def gather(optimizer) -> bool:
        gathered = []
        for group in optimizer.param_groups:
            params = group["params"]
            for i, p in enumerate(params):
                if not _is_dtensor(p):
                    continue
                plan = getattr(p, "_qt_plan", None) or sharded_plan(p)
                if plan is None:
                    continue
                if not _cut_roles(p, plan):  # stepped on its shards
                    _mark_shards(p, optimizer.state.get(p))
                    continue
                before = optimizer.state.pop(p, None)
                state = {}
                for key, value in (before or {}).items():
                    if key == MASTER_KEY and set_outside(p, value):
                        continue  # p was set outside the optimizer: its values win
                    state[key] = value.full_tensor() if _is_dtensor(value) else value
                with torch.no_grad():
                    whole = p.detach().full_tensor()
                    whole.grad = None if p.grad is None else p.grad.full_tensor()
                whole._qt_plan = plan
                optimizer.state[whole] = state
                params[i] = whole
                gathered.append((params, i, p, whole, before))
        optimizer._qt_gathered = gathered
        return bool(gathered)

    @staticmethod
    def put_back(optimizer, copy_back: bool) -> None:
        """The sharded parameters back into the optimizer: with copy_back, this rank's part of
        each whole parameter and its state; without (a step that raised), as they were."""
        for params, i, p, whole, before in getattr(optimizer, "_qt_gathered", ()):
            params[i] = p
            state = optimizer.state.pop(whole, None) or {}
            whole.grad = None
            if not copy_back:
                if before is not None:
                    optimizer.state[p] = before
                continue
            for key, value in list(state.items()):
                if isinstance(value, torch.Tensor) and value.shape == p.shape and value.dim():
                    state[key] = _sharded_like(value, p)
            optimizer.state[p] = state
            local = p._local_tensor
            part = _local_part(whole, p)
            with torch.no_grad():  # the values are in p's format: its payload takes them as is
                (local._data if isinstance(local, QTensor) else local).copy_(_plain(part))
            if isinstance(local, QTensor) and isinstance(part, QTensor):
                local._tscale = part._tscale  # (two-level: the whole parameter's new scale)
            master = state.get(MASTER_KEY)
            if master is not None:  # as training._restore: what p is once it holds master
                mark_synced(p, master)
        optimizer._qt_gathered = []


def _two_level_scale(t):
    t = getattr(t, "_local_tensor", t)
    if isinstance(t, QTensor) and t.fmt.is_two_level:
        return t.tensor_scale
    return None


def _give_scale(t, scale, sharded) -> None:
    """FSDP2 built the shard ``t`` from zeros (which take a fresh tensor scale, of amax 0) and a
    copy of its chunk of the parameter: it carries the scale its values were rounded with, the
    whole parameter's. The local tensor of ``sharded`` (not FSDP2's flat view of it) is marked
    as a shard (qtensor.tensor.shards)."""
    if isinstance(t, QTensor):
        t._tscale = scale
        if t is sharded._local_tensor:
            shards.mark(t, sharded)


def _commit_scale(dest, tensor) -> None:
    """DCP's load copied the loaded values into ``tensor``, an alias of the state dict's tensor
    ``dest`` (a new wrapper, which took the loaded tensor scale): ``dest`` itself (a DTensor's
    local QTensor) takes it too, or it would keep the fresh model's scale under the loaded
    values."""
    scale = _two_level_scale(tensor)
    if (scale is not None and isinstance(dest, QTensor) and dest is not tensor
            and _two_level_scale(dest) is not None and dest._data.untyped_storage().data_ptr()
            == tensor._data.untyped_storage().data_ptr()):
        dest._tscale = scale


def _sharded_qtensor(t) -> bool:
    return (_is_dtensor(t) and isinstance(t._local_tensor, QTensor)
            and any(pl.is_shard() for pl in t.placements))


def _norm_of_whole(op_call, args, kwargs):
    """A p-norm (``linalg_vector_norm``, ``_foreach_norm``: clip_grad_norm_'s) of a sharded
    DTensor of QTensors, as one process computes it: torch's norm of the whole tensor, rounded
    to its format. DTensor would combine the shards' norms (a partial norm: each shard's norm,
    then its p-th power, their sum and its root, each rounded to the format), and torch's FP32
    reduction over the whole tensor is not one over its parts: the whole tensor is gathered
    (DTensor's Replicate, the values and a two-level tensor scale as they are) and the norm,
    Replicate, computed of it on every rank. Max and min norms (inf, -inf) combine exactly:
    DTensor's own. Where no input is such a DTensor: NotImplemented."""
    x = args[0]
    many = isinstance(x, (list, tuple))
    ord_ = args[1] if len(args) > 1 else kwargs.get("ord", 2)
    if isinstance(ord_, (int, float)) and abs(ord_) == float("inf"):
        return NotImplemented
    tensors = list(x) if many else [x]
    if not any(_sharded_qtensor(t) for t in tensors):
        return NotImplemented
    whole = [_replicated(t) if _sharded_qtensor(t) else t for t in tensors]
    return op_call(whole if many else whole[0], *args[1:], **kwargs)


def _replicated(t):
    from torch.distributed.tensor import Replicate
    return t.redistribute(t.device_mesh, [Replicate()] * t.device_mesh.ndim)


def _stack_of_norms(op_call, args, kwargs):
    """A stack (clip_grad_norm_'s, of the norms) of DTensors among which a QTensor one: the
    partial ones (the norms of sharded plain tensors) are reduced first (DTensor's reduction),
    where DTensor would make the others partial (a replicated QTensor divided by the world
    size's root, rounded to its format). Else NotImplemented."""
    tensors = args[0]
    if not any(_is_dtensor(t) and isinstance(t._local_tensor, QTensor) for t in tensors):
        return NotImplemented
    partial = [_is_dtensor(t) and any(pl.is_partial() for pl in t.placements) for t in tensors]
    if not any(partial):
        return NotImplemented
    return op_call([_replicated(t) if p else t for t, p in zip(tensors, partial)], *args[1:],
                   **kwargs)


# DTensor's norms of sharded QTensors, and their stack (qtensor.tensor.shims)
shims.handle_dtensor_ops((torch.ops.aten.linalg_vector_norm.default,
                          torch.ops.aten._foreach_norm.Scalar), _norm_of_whole)
shims.handle_dtensor_ops((torch.ops.aten.stack.default,), _stack_of_norms)

# torch's private FSDPParam shard builders and DCP's commit_tensor (qtensor.tensor.shims)
shims.wrap_fsdp_shard_builders(_two_level_scale, _give_scale)
shims.wrap_dcp_commit_tensor(_commit_scale)

# qtensor.nn.training's step hooks, around each optimizer step
gather_for_step = _GatheredStep.gather
put_back_gathered = _GatheredStep.put_back
