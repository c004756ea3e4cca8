"""A converted parameter's FP32 master weight as the optimizer holds it: its state key, whether
the parameter still holds what the optimizer last copied into it, and the epoch that says when
parameters gained or lost plans. What the optimizer's step hooks (qtensor.nn.training) and the
step of FSDP2's sharded parameters (qtensor.nn.distributed) share."""
from __future__ import annotations

import weakref

__all__ = ["MASTER_KEY", "bump_epoch", "epoch", "master_version", "mark_synced", "set_outside"]

MASTER_KEY = "qt_master"  # the optimizer-state key of a parameter's FP32 master

_epoch = [0]  # bumped whenever parameters gain or lose plans (convert, unconvert, re-attach)


def bump_epoch() -> None:
    _epoch[0] += 1


def epoch() -> int:
    return _epoch[0]


def master_version(master) -> int:
    return getattr(master, "_local_tensor", master)._version  # (a DTensor: its shard's)


def mark_synced(p, master) -> None:
    """p holds master now: what p and master are then. p set outside the optimizer differs
    from it (``p.data = x`` replaces the payload, an in-place edit bumps the version)."""
    p._qt_synced = (weakref.ref(master), weakref.ref(getattr(p, "_data", p)), p._version,
                    master_version(master))


def set_outside(p, master) -> bool:
    """Whether p was set since the optimizer last copied master into it (then p's values win),
    and master was not (both set: a checkpoint's load of the model and the optimizer state,
    whose master is what p was rounded from: the master wins)."""
    sig = getattr(p, "_qt_synced", None)
    return sig is not None and sig[0]() is master and (
        sig[1]() is not getattr(p, "_data", p) or sig[2] != p._version) and (
        sig[3] == master_version(master))
