"""What qt.analyze records of the converted run: every role rounding (through
:func:`qtensor.tensor.flush_warnings.observe`), by role and tensor, summed into one row each
(relative error, SNR, fractions flushed, saturated, clipped by their block's scale, turned NaN),
and the operands of each contraction as its GEMMs round them.
"""
from __future__ import annotations

import math
from typing import Dict

import torch
from torch import nn

from ..tensor import flush_warnings
from ..nn import gemm_forward
from ..tensor.dispatch import quantize as _round, with_axis
from ..nn.plans import _plain
from ..tensor.subclass import QTensor
from .contractions import CONTRACTIONS, _operand


class _TensorStats:
    """Sums over the roundings of one (role, tensor): errors and counts."""

    def __init__(self, role: str, name: str, fmt: str):
        self.role, self.name, self.fmt = role, name, fmt
        self.numel = self.nonzero = self.flushed = self.saturated = self.finite = self.nan = 0
        self.clipped = 0
        self.signal = self.noise = self.clip_lost = self.clip_magnitude = 0.0
        self.calls = 0

    def add(self, before: torch.Tensor, after: torch.Tensor, fmt, source=None,
            clip_fmt=None, rounded=True) -> None:
        """``source``: the tensor rounded to ``after`` (default ``before``; an operand rounding
        rounds the role's rounded value), ``clip_fmt``: fmt as it blocked it; ``rounded=False``:
        ``after`` is no rounding of ``before`` (optimizer state: the clipping is that of
        rounding ``before``)."""
        b, a = before.detach().double(), after.detach().double()
        finite = torch.isfinite(b)
        both = finite & torch.isfinite(a)
        self.signal += float(torch.where(both, b, 0).pow(2).sum())
        self.noise += float(torch.where(both, a - b, 0).pow(2).sum())
        c = flush_warnings.fractions(before, after, fmt)
        self.nonzero += c["nonzero"]
        self.flushed += c["flushed"]
        self.saturated += c["saturated"]
        self.finite += c["finite"]
        self.nan += int((finite & torch.isnan(a)).sum())
        clip = flush_warnings.clipping(before if source is None else source,
                                       fmt if clip_fmt is None else clip_fmt,
                                       after if rounded else None)
        if clip is not None:  # block formats: values beyond their block's largest value
            self.clipped += clip["clipped"]
            self.clip_lost += clip["lost"]
            self.clip_magnitude += clip["magnitude"]
        self.numel += b.numel()
        self.calls += 1

    def row(self) -> dict:
        rel = math.sqrt(self.noise / self.signal) if self.signal > 0 else (
            0.0 if self.noise == 0 else math.inf)
        snr = 10 * math.log10(self.signal / self.noise) if self.noise > 0 else math.inf
        return {"role": self.role, "tensor": self.name, "format": self.fmt, "numel": self.numel,
                "calls": self.calls, "rel_error": rel, "snr_db": snr,
                "flushed": self.flushed / self.nonzero if self.nonzero else 0.0,
                "saturated": self.saturated / self.finite if self.finite else 0.0,
                "clipped": self.clipped / self.finite if self.finite else 0.0,
                "clip_loss": (self.clip_lost / self.clip_magnitude if self.clip_magnitude > 0
                              else 0.0),
                "nan": self.nan / self.numel if self.numel else 0.0}


class _Recorder:
    def __init__(self):
        self.stats: Dict[tuple, _TensorStats] = {}

    def _add(self, role, name, fmt, before, after, source=None, clip_fmt=None, rounded=True):
        key = (role, name)
        if key not in self.stats:
            self.stats[key] = _TensorStats(role, name, str(fmt))
        self.stats[key].add(before, after, fmt, source, clip_fmt, rounded)

    def operand(self, role, name, formats, value):
        """A value that reached its role already in the role's formats (an op rounded it):
        only its operand rounding is measured here."""
        with torch.no_grad():
            mm1 = with_axis(formats.mm_fmt, -1)
            self._add(f"{role} operand", name, formats.mm_fmt, value,
                      _round(value, mm1, keep_layout=False), value, mm1)

    def __call__(self, role, name, formats, before, after):
        with torch.no_grad():
            self._add(role, name, formats.fmt, before, after)
            mm = formats.mm_fmt
            if mm is not None and mm != formats.fmt and after.dim() > 0:
                mm1 = with_axis(mm, -1)
                operand = _round(after, mm1, keep_layout=False)
                self._add(f"{role} operand", name, mm, before, operand, after, mm1)


    def contraction_operands(self, name, mod, x, own_gemms):
        """The operands of contraction ``mod`` (``name``) as its forward GEMM rounds them (after
        its transform): its input ``x`` as it arrived, and its weight where its GEMMs have
        formats of their own (``own_gemms``: Recipe.gemm; they replace the weight role's
        operand row)."""
        used = gemm_forward.gemm_formats(mod, getattr(x, "mm_fmt", None),
                                         x_plain=not isinstance(x, QTensor))
        axes = gemm_forward.reduction_axes(mod)["fprop"]
        mm, wmm, t = used["fprop"]
        if mm is not None:  # the activation operand as this contraction rounds it
            xv = _operand(_plain(x).float(), None, axes[0], t)
            self._add("activation operand", f"input of {name}", mm, xv,
                      _operand(xv, mm, axes[0]), clip_fmt=with_axis(mm, axes[0]))
        if own_gemms:  # its weight operand as its forward GEMM rounds it
            self.stats.pop(("weight operand", f"{name}.weight"), None)
            if wmm is not None:
                wv = _operand(_plain(mod.weight).detach().float(), None, axes[1], t)
                self._add("weight operand", f"{name}.weight", wmm, wv,
                          _operand(wv, wmm, axes[1]), clip_fmt=with_axis(wmm, axes[1]))


def _is_operand_of_a_contraction(stats: "_TensorStats", model: nn.Module) -> bool:
    """False for a parameter's operand-format row when no contraction module uses it as its
    weight (an embedding table, a norm's scale, a bias: their operand format rounds nothing);
    True for every other row."""
    if stats.role not in ("weight operand", "bias operand"):
        return True
    owner, _, attr = stats.name.rpartition(".")
    try:
        mod = model.get_submodule(owner)
    except AttributeError:
        return True
    return isinstance(mod, CONTRACTIONS) and attr == "weight"
