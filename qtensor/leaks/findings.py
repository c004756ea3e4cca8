"""Findings and the report: what leak_check records (text only, no tensor references)."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch

from ..tensor.subclass import QTensor

MIXED = "mixed"
PLAIN_RESULT = "plain_result"
PLAIN_OP = "plain_op"
UNREPRESENTABLE = "unrepresentable"
OPTIMIZER = "optimizer"
FUSED = "fused"
KINDS = (MIXED, PLAIN_RESULT, PLAIN_OP, UNREPRESENTABLE, OPTIMIZER, FUSED)

_HEADLINES = {
    MIXED: "a plain floating tensor met QTensors",
    PLAIN_RESULT: "an op on QTensors returned a plain floating tensor",
    PLAIN_OP: "an op computed on plain floating tensors inside a converted model",
    UNREPRESENTABLE: "a QTensor holds values its format cannot represent",
    OPTIMIZER: "after optimizer.step(): a tensor is not in its expected format",
    FUSED: "a fused kernel (or a contraction qtensor has no rule for) multiplied QTensors "
           "without their operand format (mm_fmt)",
}


class LeakError(RuntimeError):
    """Raised by ``leak_check(action="raise")`` at the first finding."""

    def __init__(self, finding: "Finding"):
        super().__init__(finding.message)
        self.finding = finding


class LeakWarning(UserWarning):
    """Issued by ``leak_check(action="warn")``, once per distinct finding."""


@dataclass(frozen=True)
class Location:
    """A source line: the first user frame (outside torch and qtensor)."""

    filename: str
    lineno: int
    function: str

    def __str__(self) -> str:
        return f"{short_path(self.filename)}:{self.lineno} in {self.function}"


def short_path(path: str) -> str:
    """A path relative to the working directory when it lies below it, else as it is."""
    try:
        rel = os.path.relpath(path)
    except ValueError:  # another drive (Windows)
        return path
    return path if rel.startswith("..") else rel


@dataclass(frozen=True)
class TensorInfo:
    """One tensor taking part in a finding."""

    role: str                 # argument name ("self", "other", "out[0]", "grad", ...)
    qtensor: bool
    shape: Tuple[int, ...]
    fmt: Optional[str]        # the QTensor's value format
    dtype: str
    name: Optional[str] = None  # qualified parameter/buffer name, where it is one
    flagged: bool = False     # this tensor is the leak

    def __str__(self) -> str:
        shape = "[" + ", ".join(str(s) for s in self.shape) + "]"
        if self.qtensor:
            s = f"{self.role}: QTensor{shape} {self.fmt}"
        else:
            s = f"{self.role}: plain Tensor{shape} {self.dtype}"
        if self.name:
            s += f" ({self.name})"
        return s + (" <-" if self.flagged else "")


@dataclass(frozen=True)
class Finding:
    """One leak: what, where in the model, which op, which tensors, which source line."""

    kind: str
    op: str
    module: str               # "" outside any module
    phase: str                # "forward", "backward" or "optimizer"
    location: Optional[Location]
    tensors: Tuple[TensorInfo, ...]
    detail: str = ""

    @property
    def where(self) -> str:
        return self.module or "-"

    @property
    def filename(self) -> Optional[str]:
        return self.location.filename if self.location is not None else None

    @property
    def lineno(self) -> Optional[int]:
        return self.location.lineno if self.location is not None else None

    @property
    def message(self) -> str:
        loc = str(self.location) if self.location is not None else "<unknown>"
        lines = [f"leak ({self.kind}): {_HEADLINES[self.kind]}",
                 f"  op: {self.op}", f"  module: {self.where} ({self.phase})",
                 f"  at: {loc}"]
        if self.detail:
            lines.append(f"  {self.detail}")
        for t in self.tensors:
            lines.append(f"    {t}")
        return "\n".join(lines)

    def key(self):
        return (self.kind, self.module, self.op, self.location,
                tuple(t.name or t.role for t in self.tensors if t.flagged))

    def __str__(self) -> str:
        return self.message


class LeakReport:
    """The findings of one ``leak_check`` block, in order; ``summary()`` groups them."""

    def __init__(self, check):  # the leak_check that fills it (for watch())
        self._check = check
        self.findings: List[Finding] = []

    def __len__(self) -> int:
        return len(self.findings)

    def __iter__(self):
        return iter(self.findings)

    def __getitem__(self, i):
        return self.findings[i]

    @property
    def ok(self) -> bool:
        """No findings."""
        return not self.findings

    def of_kind(self, kind: str) -> List[Finding]:
        if kind not in KINDS:
            raise ValueError(f"unknown finding kind {kind!r}; expected one of {', '.join(KINDS)}")
        return [f for f in self.findings if f.kind == kind]

    def watch(self, optimizer: torch.optim.Optimizer) -> None:
        """Check parameters, gradients and state after each ``optimizer.step()``."""
        self._check._watch(optimizer)

    def groups(self):
        """(kind, module, op) -> [count, first finding], in order of first occurrence."""
        out = {}
        for f in self.findings:
            g = out.get((f.kind, f.where, f.op))
            if g is None:
                out[(f.kind, f.where, f.op)] = [1, f]
            else:
                g[0] += 1
        return out

    def summary(self) -> str:
        """A table: kind, module, op, count, first location (one row per distinct leak)."""
        if not self.findings:
            return "leak_check: no leaks"
        groups = self.groups()
        rows = [("kind", "module", "op", "count", "first location")]
        for (kind, where, op), (count, first) in groups.items():
            loc = str(first.location) if first.location is not None else "<unknown>"
            rows.append((kind, where, op, str(count), loc))
        widths = [max(len(r[i]) for r in rows) for i in range(4)]
        lines = [f"leak_check: {len(self.findings)} finding{'s' * (len(self.findings) != 1)}"
                 f" in {len(groups)} place{'s' * (len(groups) != 1)}"]
        for r in rows:
            cells = [r[0].ljust(widths[0]), r[1].ljust(widths[1]), r[2].ljust(widths[2]),
                     r[3].rjust(widths[3]), r[4]]
            lines.append("  ".join(cells).rstrip())
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()

    def __repr__(self) -> str:
        return f"<LeakReport: {len(self.findings)} findings>"


# ---------------------------------------------------------------------------------------------


def tensor_info(role, t, *, flagged, name) -> TensorInfo:
    q = isinstance(t, QTensor)
    return TensorInfo(role, q, tuple(t.shape), str(t.fmt) if q else None,
                      str(t.dtype).replace("torch.", ""), name, flagged)
