"""The local errors of a contraction module's GEMMs (qt.analyze's "contractions" and "backward"
tables): its emulated product on the operands it received against (a) the FP32 product of the
unrounded operands, (b) the exact (float64) product of the rounded operands, and (c) the exact
product of the rounded against the unrounded operands (the operands' share).
"""
from __future__ import annotations

import math
from typing import List, Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..nn import gemm_forward
from ..tensor.dispatch import quantize as _round, with_axis
from ..formats.base import is_stochastic
from ..nn.plans import _FP32, _plain
from ..tensor.subclass import QTensor

__all__ = ["CONTRACTIONS", "contraction_errors"]


CONTRACTIONS = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)


def _product(mod: nn.Module, gemm: str, a: torch.Tensor, b: torch.Tensor, x_shape=None,
             w_shape=None) -> torch.Tensor:
    """The GEMM ``gemm`` of a Linear/Conv on its operands in :data:`GEMMS` order (fprop (x, W),
    dgrad (dY, W), wgrad (x, dY)), as autograd runs it (a Linear's wgrad on 2D operands)."""
    if isinstance(mod, nn.Linear):
        if gemm == "fprop":
            return F.linear(a, b)
        if gemm == "dgrad":
            return a @ b
        return b.T @ a  # dW = dY^T x
    if gemm == "fprop":
        return mod._conv_forward(a, b, None)
    nd = len(mod.kernel_size)
    grad = torch.nn.grad
    kw = dict(stride=mod.stride, padding=mod.padding, dilation=mod.dilation, groups=mod.groups)
    if gemm == "dgrad":
        return getattr(grad, f"conv{nd}d_input")(x_shape, b, a, **kw)
    return getattr(grad, f"conv{nd}d_weight")(a, w_shape, b, **kw)


def _operand(x: torch.Tensor, mm, axis: int, transform=None) -> torch.Tensor:
    """x rounded to the operand format as the contraction rounds it (dispatch's blocking), after
    the GEMM's transform along the same axis."""
    if transform is not None:
        x = transform.apply(x, axis)
    if mm is None:
        return x
    return _round(x, with_axis(mm, axis), keep_layout=False)


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    a, ref = a.double(), ref.double()
    den = float(ref.norm())
    num = float((a - ref).norm())
    return num / den if den > 0 else (0.0 if num == 0 else math.inf)


def _nearest(fmt):
    """fmt rounding to nearest where it rounds stochastically (re-rounding values already in
    it: the identity, without drawing random bits)."""
    r = getattr(fmt, "rounding", None)
    return fmt.replace(rounding="nearest") if r is not None and is_stochastic(r) else fmt


def _gemm_row(mod, gemm, a, b, ref_a, ref_b, fa, fb, transform, acc, shapes) -> dict:
    """The local errors of one GEMM (see :func:`contraction_errors`): ``a``, ``b`` its operands
    as it received them, ``ref_a``, ``ref_b`` the unrounded ones (FP32 weight), ``fa``, ``fb``
    their formats, ``transform`` the GEMM's."""
    axes = gemm_forward.reduction_axes(mod)[gemm]
    ra = _operand(a, fa, axes[0], transform)
    rb = _operand(b, fb, axes[1], transform)
    # the emulated GEMM with FP32 outputs (no output rounding), on the operands rounded as
    # above: the same formats and accumulator as in the model (dispatch rounds them again,
    # which leaves them as they are)
    ae = QTensor._wrap(ra.float(), _FP32, _nearest(fa), accum=acc) if (fa or acc) else ra.float()
    be = QTensor._wrap(rb.float(), _FP32, _nearest(fb), accum=acc) if (fb or acc) else rb.float()
    emulated = _plain(_product(mod, gemm, ae, be, *shapes)).double()
    ref32 = _product(mod, gemm, ref_a.float(), ref_b.float(), *shapes)
    exact_rounded = _product(mod, gemm, ra.double(), rb.double(), *shapes)
    exact = _product(mod, gemm, ref_a.double(), ref_b.double(), *shapes)
    t = "" if transform is None else f" ({transform})"
    return {"gemm": gemm, "vs_fp32": _rel(emulated, ref32),
            "vs_exact_rounded": _rel(emulated, exact_rounded), "operands": _rel(exact_rounded, exact),
            "operand_formats": f"{fa or '-'} x {fb or '-'}{t}",
            "accumulator": str(getattr(acc, "name", None) or acc or "FP32")}


def contraction_errors(mod: nn.Module, x: torch.Tensor, weight: torch.Tensor,
                       fp32_weight: torch.Tensor, dy: Optional[torch.Tensor] = None,
                       gemms=("fprop",)) -> List[dict]:
    """The local errors of the GEMMs of one contraction module, one row each (``gemms``: some of
    fprop, dgrad and wgrad; the backward ones need ``dy``): ``x`` the input it received (a
    QTensor with its operand format, or plain), ``weight`` its converted weight, ``fp32_weight``
    the weight before conversion, ``dy`` the gradient of its output as it arrived (bias
    excluded). The operand formats and transforms are those each GEMM uses
    (:func:`qtensor.nn.gemm_forward.gemm_formats`: ``Recipe.gemm`` where it applies)."""
    with torch.no_grad():
        xv = _plain(x).detach().float()
        wv = _plain(weight).detach().float()
        w32 = fp32_weight.detach().float()
        acc = getattr(weight, "accum", None) if isinstance(weight, QTensor) else None
        if acc is None and isinstance(x, QTensor):
            acc = x.accum
        formats = gemm_forward.gemm_formats(
            mod, getattr(x, "mm_fmt", None) if isinstance(x, QTensor) else None,
            getattr(dy, "mm_fmt", None) if isinstance(dy, QTensor) else None,
            x_plain=not isinstance(x, QTensor))
        rows = []
        for gemm in gemms:
            fa, fb, t = formats[gemm]
            if gemm == "fprop":
                ops, shapes = (xv, wv, xv, w32), ()
            else:
                if dy is None:
                    continue
                dv = _plain(dy).detach().float()
                shapes = (tuple(xv.shape), tuple(wv.shape))
                if gemm == "dgrad":
                    ops = (dv, wv, dv, w32)
                elif isinstance(mod, nn.Linear):  # tokens flattened, as autograd's mm has them
                    x2, d2 = xv.reshape(-1, xv.shape[-1]), dv.reshape(-1, dv.shape[-1])
                    ops = (x2, d2, x2, d2)
                else:
                    ops = (xv, dv, xv, dv)
            rows.append(_gemm_row(mod, gemm, *ops, fa, fb, t, acc, shapes))
    return rows
