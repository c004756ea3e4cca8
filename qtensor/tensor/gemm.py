"""Per-GEMM operand formats (``Recipe.gemm``): the tags that dispatch reads.

A converted ``nn.Linear`` / ``nn.Conv1d/2d/3d`` whose recipe has ``gemm`` runs its forward through
``qtensor.nn.gemm_forward.GemmForward``: its input x and weight W enter the op as views tagged with a
:class:`GemmOperand` in place of their ``mm_fmt``. Dispatch (:func:`operand_formats`) reads the
tags: during that forward (``in_fprop()``) each tagged operand is rounded to its
forward format; later (autograd's backward ops on the saved views: ``mm(dY, W)``, ``mm(x^T, dY)``,
``convolution_backward``) a tagged operand is rounded to its backward format and the untagged one
(the gradient dY) to the format the tag gives it. Tags are kept by data movement (the
transposes and reshapes autograd makes) and dropped by every other op (its outputs take the
operand's own ``mm_fmt``), so nothing outside the layer sees them. The backward runs autograd's
own ops, so with every format equal to the roles' ``mm_fmt`` the bits are today's.
Details: docs/convert.md, "Per-GEMM operand formats".
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Optional

__all__ = ["GemmOperand", "in_fprop", "fprop", "operand_formats", "operand_transform"]


@dataclass(frozen=True)
class GemmOperand:
    """The ``mm_fmt`` of a tagged operand: its format in the forward GEMM, in its backward GEMM
    (dgrad for W, wgrad for x), the format of the gradient it meets there (None: the gradient's
    own mm_fmt), and ``base``, the operand's own mm_fmt (what the outputs of ops take);
    ``fprop_t`` / ``bwd_t``: the transform (qtensor.tensor.transforms) of the forward GEMM and of the
    backward one, applied to every operand of that GEMM along K before rounding."""

    fprop: Any
    bwd: Any
    other: Any
    base: Any
    fprop_t: Any = None
    bwd_t: Any = None

    def __str__(self) -> str:
        t = "" if self.fprop_t is None and self.bwd_t is None else (
            f", transforms fprop={self.fprop_t} bwd={self.bwd_t}")
        s = (f"gemm(fprop={self.fprop}, bwd={self.bwd}, grad={self.other}, own={self.base}"
             f"{t})")
        if s not in _BY_TOKEN:  # (the string names the tag in a traced graph: of_token)
            if len(_BY_TOKEN) >= _BY_TOKEN_SIZE:
                _BY_TOKEN.clear()
            _BY_TOKEN[s] = self
        return s


_BY_TOKEN: dict = {}  # str(tag) -> tag; equal strings are equal tags (every field is in it)
_BY_TOKEN_SIZE = 1024


def of_token(token: str) -> GemmOperand:
    """The tag whose string is ``token``: a traced graph builds a QTensor with its formats as
    strings (qtensor.tensor.subclass._graph_kwargs), and a tag's string is made (and recorded) just
    before, while dynamo traces the tagging."""
    tag = _BY_TOKEN.get(token)
    if tag is None:
        raise ValueError(f"unknown per-GEMM operand tag {token!r} (tags exist only inside a "
                         "converted Linear/Conv's forward under Recipe.gemm)")
    return tag


_STATE = threading.local()


def in_fprop() -> bool:
    """Whether the forward GEMM of a GemmForward is running (on this thread)."""
    return getattr(_STATE, "fprop", False)


class fprop:  # noqa: N801  (a context manager)
    """Mark the forward GEMM of a layer (GemmForward) as running."""

    def __enter__(self):
        self.before = in_fprop()
        _STATE.fprop = True

    def __exit__(self, *exc):
        _STATE.fprop = self.before


def _is_fprop(tags) -> bool:
    """Whether a contraction whose operands carry ``tags`` (None: untagged) is a forward GEMM:
    the flag, or every operand tagged (the backward GEMMs have one untagged operand, the
    gradient dY). The second is what a traced graph keeps (the flag is Python state, which
    AOTAutograd's tracing of the graph does not see); GemmForward traces only where both x and
    W are QTensors, so both are tagged there."""
    return in_fprop() or all(t is not None for t in tags)


def operand_formats(ops, fallback) -> Optional[list]:
    """The operand formats of one contraction whose multiplied operands are ``ops`` (QTensors or
    plain tensors), or None when none is tagged. ``fallback(a)``: a's own format (None for a
    plain tensor). In the forward GEMM each tagged operand takes its fprop format; otherwise the
    tagged one its backward format and the others the format the tag gives the gradient."""
    tags = [m if type(m) is GemmOperand else None for m in (getattr(a, "mm_fmt", None) for a in ops)]
    first = next((t for t in tags if t is not None), None)
    if first is None:
        return None
    fprop = _is_fprop(tags)
    out = []
    for a, t in zip(ops, tags):
        if t is not None:
            out.append(t.fprop if fprop else t.bwd)
        elif not fprop and first.other is not None:
            out.append(first.other)
        else:
            out.append(fallback(a))
    return out


def operand_transform(ops):
    """The transform of the contraction whose multiplied operands are ``ops`` (applied to all of
    them along K before rounding), or None: the first tag's forward transform during the forward
    GEMM, else the backward transform of the tagged operand (W: dgrad's, x: wgrad's)."""
    tags = [m if type(m) is GemmOperand else None for m in (getattr(a, "mm_fmt", None) for a in ops)]
    tag = next((t for t in tags if t is not None), None)
    if tag is None:
        return None
    return tag.fprop_t if _is_fprop(tags) else tag.bwd_t
