"""Shards of a whole two-level tensor: local QTensors of a DTensor (FSDP2's sharded parameters,
their gradients and optimizer state) that round as one process rounds the whole tensor.

A two-level format's (nvfp4) tensor scale comes from the whole tensor's amax. Where a DTensor's
shards cut none of the format's blocks, a rank rounds its part as the whole tensor would be:
under the scale of the whole amax, the parts' finite amaxes all-reduced by max (a scalar).

The carrier is an attribute of the local QTensor, ``QTensor._shard`` (a :class:`ShardOf`, None
for a tensor that is not such a shard). DTensor and FSDP2 run in-place ops on the local tensor
object itself and wrap the new local tensors of out-of-place ops; FSDP2 rebuilds a local tensor
only in its shard builders, which qtensor.nn.distributed wraps (and marks there). An attribute
needs no change to the payload, the tensor scale or the traced form of a QTensor: under
torch.compile (fake or functional payloads) it is ignored and ops round as before.

dispatch passes the mark on to what an op on shards gives of the shard's shape (an elementwise op
of shards of one sharding, a move that keeps the shape) and rounds such outputs, and the shards
computed in place, with :func:`round_shard`. Such an op is then a collective: every rank of the
group must run it, as every rank runs a DTensor op. Where the shards cut blocks
(:func:`cuts_blocks`), nothing is marked: qtensor.nn.distributed rounds those tensors whole.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from . import shims as _shims
from ..kernels import backend as _backend
from ..kernels.reference import finite_amax

__all__ = ["ShardOf", "cuts_blocks", "cuts_scale_only", "sharding_of", "mark", "live",
           "round_shard", "of_output", "enter_step", "exit_step", "in_step"]

# The optimizer steps running (qtensor.nn.training's step hooks enter and exit them). Only inside
# one do out-of-place ops on shards (Adam's denominators) round under the whole tensor's scale,
# a collective: outside a step, an op on one rank's shard alone (a log line on rank 0) must not
# wait for the other ranks, so it rounds under a fresh scale of its own and drops the mark.
# A step that raised has ended too (its post-step hook never ran): RunningSteps.
# In-place ops on a shard (clip_grad_norm_'s mul_, an init) are collectives everywhere.
_steps = _shims.RunningSteps()


def enter_step() -> None:
    """An optimizer step begins (called by a pre-step hook)."""
    _steps.enter(levels=2)


def exit_step() -> None:
    """An optimizer step ends (called by a post-step hook)."""
    _steps.exit(levels=2)


def in_step() -> bool:
    return _steps.active()


class ShardOf(NamedTuple):
    """Which sharding a local tensor is a part of: the process group of its (1-D) mesh, the
    placements and the whole tensor's shape."""
    group: object
    placements: tuple
    shape: tuple


def cuts_blocks(fmt, p) -> bool:
    """Whether the shards of the DTensor ``p`` (FSDP2's sharded parameter) cut blocks of
    ``fmt``: rounding a shard on its own would then round parts of a block as blocks. FSDP2
    (torch.chunk) gives each rank ceil(n / world) indices of the sharded dim. A two-level
    format's tensor scale spans the whole tensor: it always counts as cut here."""
    if fmt is None or not fmt.is_block:
        return False
    from torch.distributed.tensor import Shard
    for mesh_dim, placement in enumerate(p.placements):
        if not placement.is_shard():
            continue
        dim = placement.dim % p.dim()
        n = p.shape[dim]
        chunk = -(-n // p.device_mesh.size(mesh_dim))
        extent = fmt.block_extent(p.dim(), dim, n)
        # (a strided shard interleaves its chunks: cut wherever a block spans indices)
        if extent > 1 and n > chunk and (chunk % extent or type(placement) is not Shard):
            return True
    return False


def cuts_scale_only(fmt, p) -> bool:
    """Whether ``fmt`` is two-level and the shards of the DTensor ``p`` (on a 1-D mesh) cut its
    tensor scale (the whole tensor's) but none of its blocks."""
    if fmt is None or not fmt.is_block or not fmt.tensor_scale or p.device_mesh.ndim != 1:
        return False
    try:
        blocks = fmt.replace(tensor_scale=False)
    except ValueError:  # (a FormatError: a rule that needs the tensor scale)
        return False
    return not cuts_blocks(blocks, p)


def sharding_of(fmt, p) -> Optional[ShardOf]:
    """The sharding that a local tensor of the DTensor ``p`` in the two-level ``fmt`` is a
    shard of, where the shards cut only ``fmt``'s tensor scale; else None."""
    if (fmt is None or not fmt.is_two_level or not any(pl.is_shard() for pl in p.placements)
            or not cuts_scale_only(fmt, p)):
        return None
    return ShardOf(p.device_mesh.get_group(), tuple(p.placements), tuple(p.shape))


def mark(local, p) -> None:
    """Mark ``local`` (a local tensor of a DTensor shaped and placed as ``p``) as a shard of the
    whole tensor where it is a two-level QTensor whose tensor scale alone the shards cut."""
    shard = sharding_of(getattr(local, "fmt", None), p)
    if shard is not None:
        local._shard = shard


def live(q) -> Optional[ShardOf]:
    """The sharding of the QTensor ``q`` where it is a marked shard with an eager payload (traced
    payloads round as before: no collective in a graph), else None."""
    shard = q._shard
    if shard is None or type(q._data) is not torch.Tensor or torch.compiler.is_compiling():
        return None
    return shard


def round_shard(x: torch.Tensor, fmt, shard: ShardOf):
    """(x rounded to the two-level ``fmt``, its decode tensor scale): ``x``, this rank's part
    of a whole tensor of ``shard``, rounded as the whole tensor is, under the scale of the
    whole tensor's amax (the parts' finite amaxes all-reduced by max)."""
    amax = finite_amax(x)
    torch.distributed.all_reduce(amax, torch.distributed.ReduceOp.MAX, group=shard.group)
    return _backend.round_with_scale(x, fmt, tensor_amax=amax)


# moves whose output of the input's shape holds the same elements (a shard's again)
_SAME_ELEMENTS = frozenset({"detach", "alias", "view", "_unsafe_view", "view_as", "clone",
                            "contiguous", "_to_copy", "copy", "lift_fresh", "lift_fresh_copy",
                            "zeros_like", "ones_like", "full_like", "empty_like"})


def of_output(func, src, qs, out, rounds: bool) -> Optional[ShardOf]:
    """The sharding of an op's output ``out`` (a payload): that of its format source ``src`` where
    ``src`` is a live shard, ``out`` has its shape, the op is elementwise (or moves the same
    elements) and every other shard among the operands ``qs`` is of the same sharding; for an
    op that rounds its output (``rounds``), only inside an optimizer step."""
    shard = src._shard
    if (shard is None or not isinstance(out, torch.Tensor) or out.shape != src.shape
            or (rounds and not in_step()) or live(src) is None):
        return None
    if (torch.Tag.pointwise not in func.tags
            and func.overloadpacket.__name__ not in _SAME_ELEMENTS):
        return None
    for q in qs:
        if q._shard is not None and q._shard != shard:
            return None
    return shard
