"""How a flattened weight rounds to a format one column at a time, as qt.gptq and
qt.error_diffusion round it: the column ranges that share a block scale, and each block's
scale, decided from the block's current values when it is reached.

Two rules keep the result in the format (re-rounding it with ``qt.quantize`` is the identity,
checked at the end): a block whose rounded values are not a fixed point of the format (rounding
lowered its maximum, so its own scale is smaller, and that scale moves them: NVFP4's amax rule;
MXFP8 E4M3 when the maximum falls below 256 X) is rounded again from its values at the block's
start with that scale, until it is one, as the reference rounding does for the amax rule; and
with a per-tensor scale (NVFP4) the tensor scale is the original weight's, and the element that
held the tensor's largest magnitude takes the format's largest value (sign kept), so that the
rounded tensor has that tensor scale again. Scalar formats round each column alone.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch

from ..formats.base import Format, is_stochastic
from ..kernels.reference import (block_scale, encode_scale, round_scalar64, round_with_scale,
                                 scale_amax, te_block_scale, te_round_with_scale)

__all__ = ["weight_groups"]


def weight_groups(fmt: Format, K: int, run: int) -> List[Tuple[int, int]]:
    """The column ranges [a, b) of a flattened weight (K columns, runs of ``run`` along the
    reduction axis) that share a block scale in ``fmt``; one per column for a scalar format,
    one for the whole matrix for a per-tensor block (axis=None)."""
    if not fmt.is_block:
        return [(j, j + 1) for j in range(K)]
    if fmt.axis is None:
        return [(0, K)]
    bs = min(fmt.block_size or run, run)
    return [(s + g, s + min(g + bs, run)) for s in range(0, K, run) for g in range(0, run, bs)]


class _Grid:
    """The rounding of one flattened weight (out, K) to ``fmt``, a column at a time: group
    ``group`` of a layer's weight ``whole`` (groups, out, K); a tensor scale is the whole
    weight's, and its largest magnitude is pinned in the group that holds it. A per-tensor
    block (axis=None) has one scale for the whole weight, ``whole_scale`` (default: from the
    whole weight's largest magnitude)."""

    def __init__(self, fmt: Format, w0: torch.Tensor, run: int, name: str,
                 whole: Optional[torch.Tensor] = None, group: int = 0,
                 whole_scale: Optional[torch.Tensor] = None):
        self.fmt, self.name = fmt, name
        rounding = getattr(fmt, "rounding", None)
        if rounding is not None and is_stochastic(rounding):
            raise ValueError(f"qtensor.analysis.ptq: {name}'s weight format {fmt} rounds stochastically; "
                             "GPTQ and error diffusion choose each rounding: give a format that "
                             "rounds to nearest (fmt.replace(rounding='nearest'))")
        self.block = fmt.is_block
        if self.block and (fmt.block_shape is not None or fmt.scale_rule == "4over6"):
            what = ("2D blocks (block_shape)" if fmt.block_shape is not None
                    else "the 4over6 scale rule (a block's scale picked by its rounding error)")
            raise ValueError(f"qtensor.analysis.ptq: {name}'s weight format {fmt} has {what}, which "
                             "GPTQ and error diffusion, deciding one column at a time, do not "
                             "support; use a 1D block format")
        if self.block and fmt.axis is None and fmt.scale_rule == "amax":
            raise ValueError(f"qtensor.analysis.ptq: {name}: a per-tensor block format with the amax scale "
                             f"rule ({fmt}) is not supported; block it along an axis")
        if self.block and fmt.axis is None and fmt.tensor_scale:
            raise ValueError(f"qtensor.analysis.ptq: {name}: a per-tensor block format with a tensor "
                             f"scale ({fmt}) is not supported; block it along an axis")
        self.groups = weight_groups(fmt, w0.shape[1], run)
        self.whole_scale = None
        if self.block and fmt.axis is None:
            src = w0 if whole is None else whole
            self.whole_scale = (block_scale(scale_amax(src, fmt, None).reshape(1, 1), fmt)
                                if whole_scale is None else whole_scale)
        self.te, self.pin = None, None
        if self.block and fmt.tensor_scale:
            whole = w0[None] if whole is None else whole
            amax = whole.abs().amax()
            # TE's encode and decode tensor scales, from the largest weight as it is pinned:
            # fl32(max_elem * max_scale * decode), whose own encode scale must be the same one
            # (then rounding the result again takes these scales)
            enc = encode_scale(amax, fmt)
            top_code = torch.tensor(fmt.elem.max * fmt.scale.max, dtype=torch.float32)
            for _ in range(4):
                dec = torch.ones_like(enc) / enc
                top = top_code * dec
                again = encode_scale(top, fmt)
                if bool(again == enc):
                    break
                enc = again
            self.te = (enc, dec)
            g, flat = divmod(int(whole.abs().argmax()), w0.numel())
            if float(amax) > 0 and g == group:
                r, c = divmod(flat, w0.shape[1])
                top = top.to(torch.float64)
                value = torch.copysign(top, w0[r, c])
                self.pin = (r, c, value, self._scale_of(top.reshape(1, 1))[0, 0])

    def _scale_of(self, amax: torch.Tensor) -> torch.Tensor:
        """The block scale (times the tensor scale: TE's rule for two-level formats) of amax."""
        if self.te is not None:
            return te_block_scale(amax, self.fmt, self.te)
        return block_scale(amax, self.fmt)

    def _round_with(self, v: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        if self.te is not None:
            return te_round_with_scale(v, scale, self.fmt, self.fmt.rounding, self.te)
        return round_with_scale(v, scale, self.fmt, self.fmt.rounding)

    def act_order(self, diag: torch.Tensor) -> torch.Tensor:
        """GPTQ's act-order kept to the format's blocks: the permutation of the columns that
        takes the blocks in decreasing order of their largest Hessian diagonal entry, and each
        block's columns in decreasing order of theirs (ties: the original order), so that a
        block's columns stay consecutive and its scale is decided when its first column is
        reached. Each column a block of its own (a scalar format): GPTQ's own act-order.
        The grid's groups and pin become those of the permuted columns."""
        inner = [a + torch.argsort(diag[a:b], descending=True, stable=True)
                 for a, b in self.groups]
        top = torch.stack([diag[a:b].max() for a, b in self.groups])
        order = torch.argsort(top, descending=True, stable=True).tolist()
        perm = torch.cat([inner[i] for i in order])
        sizes = [self.groups[i][1] - self.groups[i][0] for i in order]
        ends = torch.tensor(sizes).cumsum(0).tolist()
        self.groups = [(e - n, e) for e, n in zip(ends, sizes)]
        if self.pin is not None:
            where = int((perm == self.pin[1]).nonzero())
            self.pin = (self.pin[0], where) + self.pin[2:]
        return perm

    def scales(self, cur: torch.Tensor, a: int, b: int) -> Optional[torch.Tensor]:
        """The scale (out, 1) of each row's block [a, b), from its current values ``cur``."""
        if not self.block:
            return None
        if self.whole_scale is not None:  # one scale for the tensor (see _flow)
            return self.whole_scale.expand(len(cur), 1).clone()
        x = self._scale_of(scale_amax(cur, self.fmt, 1))
        if self.pin is not None and a <= self.pin[1] < b:
            x[self.pin[0], 0] = self.pin[3]
        return x

    def round(self, v: torch.Tensor, scale: Optional[torch.Tensor], rows: torch.Tensor,
              c: int) -> torch.Tensor:
        """Column ``c``'s values ``v`` (for the rows ``rows``) rounded with their block scales."""
        if not self.block:
            q = round_scalar64(v, self.fmt, self.fmt.rounding, None, None)
        else:
            q = self._round_with(v, scale[:, 0])
        if self.pin is not None and c == self.pin[1]:
            q = torch.where(rows == self.pin[0], self.pin[2], q)
        if not bool(torch.isfinite(q).all()):
            raise ValueError(f"qtensor.analysis.ptq: {self.name}: a weight overflowed {self.fmt} "
                             "(Inf/NaN); use a format with a wider range")
        return q

    def unsettled(self, q: torch.Tensor, scale: Optional[torch.Tensor], rows: torch.Tensor,
                  a: int, b: int) -> torch.Tensor:
        """The rows (a mask over ``rows``) whose rounded block [a, b) ``q`` is not a fixed point
        of the format: re-rounded with the scale of its own largest value (which can be smaller
        than the one it was rounded with, when rounding lowered the block's maximum), it would
        change; that scale goes into ``scale``. (With a power-of-two scale a halved scale keeps
        the values unless the element's largest value is not 2^(emax+1) minus one ulp, as in
        E4M3, whose 240 doubles to 480 > 448; with the amax rule any smaller scale moves them.)"""
        if not self.block or self.whole_scale is not None:  # (per-tensor: checked in _flow)
            return torch.zeros(len(rows), dtype=torch.bool)
        again = self._scale_of(scale_amax(q, self.fmt, 1))
        moved = (self._round_with(q, again) != q).any(dim=1)
        moved &= (again < scale)[:, 0]
        if self.pin is not None and a <= self.pin[1] < b:
            moved &= rows != self.pin[0]
        scale[moved] = again[moved]
        return moved
