"""The ``__torch_function__`` hook that lets formats and recipes be passed to ``.to()``.

``nn.Module.to`` parses its arguments with ``torch._C._nn._parse_to`` and ``Tensor.to`` with
torch's argument parser; both honour the ``__torch_function__`` protocol: when an argument's
class defines it, torch hands the call to that class instead of refusing the argument. Formats
(:class:`qtensor.formats.base.Format`) and recipes (:class:`qtensor.nn.plans.Recipe`) inherit
:class:`TorchFunctionTarget`, whose classmethod passes these calls to the one handler that
:mod:`qtensor.nn.to_format` registers (it converts the model, or rounds the tensor). No torch code
is patched: only calls with a format or recipe among their arguments come here.

This module sits with formats at the bottom of the import layers, so it imports nothing from
qtensor; the handler is registered by the module above that implements it. A slot, not an
argument: ``model.to(fmt)`` reaches a format through torch, which passes nothing of ours.
"""
from __future__ import annotations

_handler = None  # handler(func, args, kwargs) -> result or NotImplemented


def register_to_handler(handler) -> None:
    """Set the function that implements ``.to(fmt)`` (qtensor.nn.to_format.handle)."""
    global _handler
    _handler = handler


class TorchFunctionTarget:
    """Mixin: torch calls given an instance (``model.to(fmt)``, ``t.to(fmt)``) reach the handler;
    every other torch function runs as if the instance were a plain Python object (a format is an
    argument of an autograd Function under torch.func, of a higher-order op, of gradcheck...)."""

    __slots__ = ()

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = NotImplemented if _handler is None else _handler(func, args, kwargs)
        if out is not NotImplemented:
            return out
        import torch  # (lazy: this module imports nothing at the top, see above)
        with torch._C.DisableTorchFunctionSubclass():  # torch's default __torch_function__
            return func(*args, **kwargs)
