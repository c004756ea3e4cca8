"""leak_check: the context manager that wires the module tracker, the exemptions, the op
checker and the optimizer checker to a dispatch mode and to module and optimizer hooks."""
from __future__ import annotations

import sys
import warnings
from typing import Iterable

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook as _register_post_step
from torch.optim.optimizer import register_optimizer_step_pre_hook as _register_pre_step
from torch.utils._python_dispatch import TorchDispatchMode

from .exemptions import Exemptions
from .findings import Finding, LeakError, LeakReport, LeakWarning
from .frames import plumbing
from .ops import OpChecker
from .optimizer import OptimizerChecker
from .tracker import Tracker


class _Mode(TorchDispatchMode):
    def __init__(self, check: "leak_check"):
        super().__init__()
        self.check = check

    @plumbing
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        check = self.check
        if check._tracker.pending:
            check._tracker.flush()
        if not isinstance(func, torch._ops.OpOverload) or func.namespace == "qtensor":
            return func(*args, **kwargs)  # qtensor's own kernels; higher-order operators
        frame = sys._getframe(1)
        check._ops.inputs(func, args, kwargs, frame)
        out = func(*args, **kwargs)
        check._ops.inspect(func, args, kwargs, out, frame)
        return out


def _parse_allow(allow):
    tensors, patterns = [], []
    for a in (allow if isinstance(allow, (list, tuple, set, frozenset)) else [allow]):
        if isinstance(a, torch.Tensor):
            tensors.append(a)
        elif isinstance(a, str):
            patterns.append(a)
        else:
            raise TypeError(f"leak_check: allow takes tensors and name patterns (str), "
                            f"got {type(a).__name__}")
    return tensors, patterns


class leak_check:
    """Context manager: watch every op for values that escaped the emulated precision.

    ``with qt.leak_check(action="raise"|"warn"|"record", check_values=False, optimizer=None,
    allow=()) as report:`` -- see the package docstring (and docs/leak_check.md) for what is
    reported. Returns a :class:`LeakReport`.
    """

    def __init__(self, action: str = "raise", check_values: bool = False, optimizer=None,
                 allow: Iterable = ()):
        if action not in ("raise", "warn", "record"):
            raise ValueError(f"leak_check: action must be 'raise', 'warn' or 'record', "
                             f"got {action!r}")
        self.action = action
        self.check_values = bool(check_values)
        self._optimizers = []
        if optimizer is not None:
            opts = optimizer if isinstance(optimizer, (list, tuple)) else [optimizer]
            for o in opts:
                if not isinstance(o, torch.optim.Optimizer):
                    raise TypeError(f"leak_check: optimizer must be a torch.optim.Optimizer "
                                    f"(or a list of them), got {type(o).__name__}")
            self._optimizers = list(opts)
        self._exemptions = Exemptions(*_parse_allow(allow))
        self._tracker = Tracker(self._exemptions)
        self._ops = OpChecker(self.check_values, self._tracker, self._exemptions, self._emit)
        self._optimizer = OptimizerChecker(self.check_values, self._tracker, self._exemptions,
                                           self._emit)
        self.report = LeakReport(self)
        self._handles = []
        self._mode = None
        self._ended = False      # the with-block has ended: the check holds no tensor any more
        self._seen = set()

    def __enter__(self) -> LeakReport:
        if self._ended:
            raise RuntimeError("leak_check: this check has run its block already; make a new "
                               "qt.leak_check(...) for another block")
        mm = torch.nn.modules.module
        self._handles.append(mm.register_module_forward_pre_hook(self._tracker.pre_hook))
        self._handles.append(mm.register_module_forward_hook(self._tracker.post_hook,
                                                             always_call=True))
        self._handles.append(_register_pre_step(self._optimizer.pre_step))
        self._handles.append(_register_post_step(self._optimizer.post_step))
        for o in self._optimizers:
            self._watch(o)
        self._mode = _Mode(self)
        self._mode.__enter__()
        return self.report

    def __exit__(self, *exc):
        try:
            self._tracker.flush()
        finally:
            self._mode.__exit__(*exc)
            for h in self._handles:
                h.remove()
            self._handles.clear()
            self._forget_tensors()
        return False

    def _forget_tensors(self) -> None:
        """Drop every reference to tensors once the block ends: the report keeps only text
        (findings hold names, shapes, formats), and a weakref left on a parameter would make
        torch.utils.swap_tensors (qt.unconvert, module.to with swapping) fail."""
        self._tracker.reset()
        self._exemptions.forget()
        self._ops.forget()
        self._optimizers = []
        self._ended = True

    def _watch(self, optimizer) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"watch: expected a torch.optim.Optimizer, got "
                            f"{type(optimizer).__name__}")
        if self._ended:
            raise RuntimeError("watch: the leak_check block has ended; watch the optimizer "
                               "inside the with-block (or pass optimizer= to leak_check)")
        handle = self._optimizer.watch(optimizer)
        if handle is not None:
            self._handles.append(handle)

    def _emit(self, f: Finding) -> None:
        ex = self._exemptions
        if ex.allow_patterns and (ex.matches(f.module) or ex.matches(f.op)
                                  or ex.matches(f.kind)):
            return
        self.report.findings.append(f)
        if self.action == "raise":
            raise LeakError(f)
        if self.action == "warn":
            key = f.key()
            if key not in self._seen:
                self._seen.add(key)
                loc = f.location
                if loc is not None:  # attributed to the user's line, not to this module
                    warnings.warn_explicit(f.message, LeakWarning, loc.filename, loc.lineno)
                else:
                    warnings.warn(f.message, LeakWarning, stacklevel=2)
