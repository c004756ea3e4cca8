"""leak_check(): prove that no value escaped the emulated precision, or show where one did.

A ``TorchDispatchMode`` watches every aten op (forward, backward, ``optimizer.step()``) and
records a :class:`Finding` per place where a value left its format::

    with qt.leak_check(action="record", optimizer=opt) as report:
        loss_fn(model(x), y).backward(); opt.step()
    print(report.summary())

Kinds (``Finding.kind``): ``"mixed"`` (a plain floating tensor met QTensors), ``"plain_result"``
(an op on QTensors returned a plain tensor), ``"plain_op"`` (plain computation inside a converted
model), ``"unrepresentable"`` (``check_values=True``: a payload not in its format),
``"optimizer"`` (after ``step()``, a parameter, gradient or state not in its expected format),
``"fused"`` (a fused kernel ignored an operand format). Ops issued by qtensor's own code are never
reported; data (loss targets), scalars, empty tensors, ``allow=`` and what a recipe keeps in full
precision are exempt. ``action``: ``"raise"`` (:class:`LeakError`), ``"warn"`` (once per
finding, :class:`LeakWarning`) or ``"record"``. After the block the report holds text only.
The full contract, exemption by exemption: docs/leak_check.md.
"""
from .check import leak_check
from .findings import (FUSED, KINDS, MIXED, OPTIMIZER, PLAIN_OP, PLAIN_RESULT,  # noqa: F401
                       UNREPRESENTABLE, Finding, LeakError, LeakReport, LeakWarning, Location,
                       TensorInfo)

__all__ = ["leak_check", "LeakReport", "Finding", "TensorInfo", "Location", "LeakError",
           "LeakWarning", "KINDS"]
