"""Converted models under torch.distributed: wrap order, and the FSDP2 sharded parameters.

The collectives themselves are op rules (``qtensor.dispatch``: a collective on QTensors waits for
its result, then rounds it once into the format). This module holds what concerns a converted
model as a whole:

- :func:`check_unwrapped`: ``qt.convert`` refuses a model already wrapped for data or tensor
  parallelism (DDP, FSDP, ``fully_shard``, DTensor parameters): the wrapper holds references to
  the parameters (DDP's buckets, FSDP's shards) that a conversion would not reach, and the ranks
  would silently diverge. Convert, then wrap.

The reduction rule, the wrap orders and what is not supported: docs/distributed.md.
"""
from __future__ import annotations

import sys

from torch import nn

__all__ = ["check_unwrapped"]


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
