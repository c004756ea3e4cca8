"""Post-training quantization of a trained model's weights from a calibration batch.

``qt.gptq(model, calib_inputs, spec)`` and ``qt.error_diffusion(model, calib_inputs, spec)``
convert ``model`` in place with ``spec`` (a format F means ``qt.recipes.direct_cast(F)``: the
weights and activations enter every contraction in F, FP32 elsewhere; a ``qt.Recipe`` is used as
given) and replace the weight of every ``nn.Linear``, ``nn.Conv1d/2d/3d`` and
``nn.ConvTranspose1d/2d/3d`` whose contraction rounds it by values chosen to keep the layer's
output on the calibration data:

- GPTQ (Frantar et al. 2022, arXiv 2210.17323): the weight's columns (the reduction axis) are
  rounded one at a time, and the rounding error of each is compensated on the columns not yet
  rounded through the inverse Hessian of the layer's least-squares problem (H = 2 X^T X / N, X
  the layer's input as the contraction receives it in the partly quantized model, damped by
  ``damp`` times its mean diagonal), with lazy batch updates one block at a time. With
  ``act_order=True`` the columns are taken in decreasing order of the Hessian diagonal, kept
  to the format's blocks (:meth:`_Grid.act_order`, docs/analysis.md).
- Error diffusion (after Khodamoradi et al. 2024, arXiv 2410.11203: hyperparameter-free, no
  Hessian, no backpropagation, the quantization error diffused layer by layer): the layer's
  output error on the calibration batch, u = X W^T - X~ Q^T (X the FP32 model's input of the
  layer, X~ the quantized model's, which carries the error of the layers before), is carried
  from column to column; each column is rounded from the value that cancels the most of it,
  v_t = (x~_t . (u + x_t w_t)) / |x~_t|^2 (the greedy path-following rule of Lybrand and Saab
  2021). The paper's method section was not available to this implementation: docs/analysis.md.

Block formats (MX, NVFP4, any ``BlockFormat``): the blocks of a weight lie along its reduction
axis as the contraction rounds it (``in_features`` of a Linear; the input channels of a Conv at
each kernel position), and the columns are processed in that order. The scale of each block is
decided from the block's current values (error-updated weights for GPTQ, the values v for error
diffusion) when the block is reached, then its columns are rounded with it. Two rules keep the
result in the format (re-rounding it with ``qt.quantize`` is the identity, checked at the end):
a block whose rounded values are not a fixed point of the format (rounding lowered its maximum,
so its own scale is smaller, and that scale moves them: NVFP4's amax rule; MXFP8 E4M3 when the
maximum falls below 256 X) is rounded again from its values at the block's start with that
scale, until it is one, as the reference rounding does for the amax rule; and with a per-tensor
scale (NVFP4) the tensor scale is the original weight's, and the element that held the tensor's
largest magnitude takes the format's largest value (sign kept), so that the rounded tensor has
that tensor scale again. Scalar formats round each column alone.

Convolutions are least-squares problems on their patches (the windows of the padded input
under each output position, input channels innermost); a grouped convolution is one problem per
group (its output channels, on the patches of its input channels, with its own Hessian), whose
weights share the tensor scale; a transposed convolution is the forward convolution (stride 1)
of its zero-inserted input with its flipped, transposed kernel, solved as that one (its weight
blocks, along its input channels, are the same; a grouped one whose blocks would span two
groups is left in direct cast). ``nn.Embedding`` is not processed: its lookup is a product with
one-hot rows, whose Hessian is diagonal (the token counts), so that both flows would round each
weight to nearest, its direct cast (GPTQ would also zero the rows of tokens absent from the
calibration data).
"""
from __future__ import annotations

import copy
import math
import warnings
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from ..nn.convert import conversion_of, convert, is_converted, unconvert
from ..nn.gemm_forward import gemm_formats
from ..kernels.backend import round_payload as _round, with_axis
from ..formats.core import Format, is_stochastic
from ..nn.plans import Recipe, _plain, round_to
from ..nn.recipes import direct_cast
from ..kernels.reference import (_round_scalar, block_scale, encode_scale, round_with_scale,
                                 te_block_scale, te_round_with_scale)
from ..tensor.subclass import QTensor

__all__ = ["gptq", "error_diffusion", "weight_groups", "LAYERS"]

LAYERS = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d,
          nn.ConvTranspose3d)


# ---------------------------------------------------------------------------------------------
# The calibration data and the layers' inputs

def _batches(calib_inputs) -> List[tuple]:
    """calib_inputs: a tensor, a tuple of positional arguments, or a list of either."""
    if isinstance(calib_inputs, torch.Tensor):
        return [(calib_inputs,)]
    if isinstance(calib_inputs, tuple):
        return [calib_inputs]
    if isinstance(calib_inputs, list) and calib_inputs:
        return [b if isinstance(b, tuple) else (b,) for b in calib_inputs]
    raise TypeError("calib_inputs: a tensor, a tuple of the model's positional arguments, or a "
                    f"non-empty list of them, got {type(calib_inputs).__name__}")


_CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
_TRANSPOSED = (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)


def _input_axis(mod: nn.Module) -> int:
    """The axis along which the contraction rounds the layer's input (its blocks' axis)."""
    return -1 if isinstance(mod, nn.Linear) else 1


def _weight_axis(mod: nn.Module) -> int:
    """The axis along which the contraction rounds the weight: in_features of a Linear, the
    input channels of a Conv (dim 1 of (O, C/groups, *k)) and of a ConvTranspose (dim 0 of
    (C, O/groups, *k))."""
    return -1 if isinstance(mod, nn.Linear) else 0 if isinstance(mod, _TRANSPOSED) else 1


def _pad(x: torch.Tensor, pads) -> torch.Tensor:
    """x (B, C, *S) zero-padded by (lo, hi) per spatial dim; negative amounts crop."""
    return F.pad(x, [p for lo_hi in reversed(pads) for p in lo_hi])


def _columns(mod: nn.Module, x: torch.Tensor, output_size=None) -> torch.Tensor:
    """The rows (groups, N, K/groups) that multiply each group's flattened weight (see
    :func:`_flat_weight`): a Linear's inputs (one group); a convolution's patches (the windows
    of its padded input under each output position, built with Tensor.unfold on each spatial
    dim, input channels innermost), one set per conv group from that group's channels. A
    transposed convolution is the convolution (stride 1) of its input with zeros inserted
    between the elements (stride - 1 of them), padded by dilation * (k - 1) - padding (and the
    output padding at the end), with the flipped, transposed kernel: its patches are those."""
    x = x.double()
    if isinstance(mod, nn.Linear):
        return x.reshape(1, -1, x.shape[-1])
    nd = len(mod.kernel_size)
    if x.dim() == nd + 1:  # an unbatched input
        x = x.unsqueeze(0)
    k, dil = mod.kernel_size, mod.dilation
    if isinstance(mod, _TRANSPOSED):
        b, c, *size = x.shape
        z = x.new_zeros(b, c, *((n - 1) * s + 1 for n, s in zip(size, mod.stride)))
        z[(..., *(slice(None, None, s) for s in mod.stride))] = x
        op = mod._output_padding(x, output_size, list(mod.stride), list(mod.padding),
                                 list(k), nd, list(dil))
        pads = [(d * (kk - 1) - p, d * (kk - 1) - p + o)
                for kk, d, p, o in zip(k, dil, mod.padding, op)]
        x, stride = z, (1,) * nd
    else:
        pad = (0,) * nd if isinstance(mod.padding, str) else mod.padding  # 'valid'
        pads, stride = [(p, p) for p in pad], mod.stride
    x = _pad(x, pads)
    for i, (kk, s, d) in enumerate(zip(k, stride, dil)):
        x = x.unfold(2 + i, d * (kk - 1) + 1, s)
    win = x[(..., *(slice(None, None, d) for d in dil))]  # (B, C, *L, *k)
    b, c = win.shape[:2]
    g = mod.groups
    win = win.reshape(b, g, c // g, -1, math.prod(k)).permute(1, 0, 3, 4, 2)  # (G, B, L, P, Cg)
    return win.reshape(g, -1, math.prod(k) * (c // g))


def _grouped_kernel(mod: nn.Module, w: torch.Tensor) -> torch.Tensor:
    """A convolution's weight as (groups, O/groups, C/groups, *k), the kernel of each group's
    forward convolution (a ConvTranspose's: transposed and flipped, see :func:`_columns`)."""
    g = mod.groups
    if isinstance(mod, _TRANSPOSED):
        c, og, *k = w.shape
        return w.reshape(g, c // g, og, *k).transpose(1, 2).flip(list(range(3, 3 + len(k))))
    o, cg, *k = w.shape
    return w.reshape(g, o // g, cg, *k)


def _flat_weight(mod: nn.Module, w: torch.Tensor) -> Tuple[torch.Tensor, int]:
    """The weight as matrices (groups, out/groups, K/groups) whose columns run along the
    reduction axis innermost (the blocks' axis), and the length of one run (in_features; a
    Conv's input channels per group)."""
    if isinstance(mod, nn.Linear):
        return w[None], w.shape[1]
    kern = _grouped_kernel(mod, w)
    g, og, cg = kern.shape[:3]
    return kern.reshape(g, og, cg, -1).permute(0, 1, 3, 2).reshape(g, og, -1), cg


def _unflatten_weight(mod: nn.Module, flat: torch.Tensor, shape) -> torch.Tensor:
    if isinstance(mod, nn.Linear):
        return flat[0].reshape(shape)
    k = tuple(_grouped_kernel(mod, torch.empty(shape, device="meta")).shape[3:])
    g, og = flat.shape[:2]
    kern = flat.reshape(g, og, math.prod(k), -1).permute(0, 1, 3, 2).reshape(g, og, -1, *k)
    if isinstance(mod, _TRANSPOSED):
        kern = kern.flip(list(range(3, 3 + len(k)))).transpose(1, 2)
    return kern.reshape(shape)


def _check_layer(name: str, mod: nn.Module, fmt: Optional[Format]) -> Optional[str]:
    """Why this layer cannot be processed (None if it can)."""
    t = _fprop(mod)[2]
    if t is not None and fmt is not None:
        return (f"{name}: its forward GEMM rounds W after a transform ({t}, Recipe.gemm): the "
                "values it rounds are not the weight's, and GPTQ and error diffusion round the "
                "weight itself")
    if isinstance(mod, _CONVS + _TRANSPOSED):
        if mod.padding_mode != "zeros":
            return f"{name}: padding_mode={mod.padding_mode!r} (only 'zeros')"
        if isinstance(mod.padding, str) and mod.padding != "valid":
            return f"{name}: padding={mod.padding!r} (give the padding as numbers)"
    if isinstance(mod, _TRANSPOSED) and mod.groups > 1 and fmt is not None \
            and fmt.is_block and fmt.axis is not None:
        # its weight (C, O/groups, *k) is blocked along C across the groups: a block that
        # straddles two groups holds the weights of two independent least-squares problems
        cg, bs = mod.in_channels // mod.groups, fmt.block_size or mod.in_channels
        if cg % bs:
            return (f"{name}: a grouped transposed convolution whose weight blocks of "
                    f"{bs} along its input channels span its groups ({cg} channels "
                    "each)")
    return None


class _Inputs:
    """Forward pre-hooks that record what given layers receive, over the calibration batches."""

    def __init__(self, model: nn.Module, names: Sequence[str], operand: bool):
        self.model, self.names, self.operand = model, list(names), operand
        self.seen: Dict[str, List[torch.Tensor]] = {n: [] for n in self.names}
        conv = conversion_of(model) if is_converted(model) else None
        self.root_plan = conv.module_plans.get("") if conv is not None else None

    def _hook(self, name, mod):
        def hook(m, args, kwargs):
            if not args or not isinstance(args[0], torch.Tensor):
                raise TypeError(f"qtensor.analysis.ptq: {name} was called without a tensor input")
            x = args[0].detach()
            if name == "" and self.root_plan is not None and not self.root_plan.plain \
                    and not self.root_plan.activation.full_precision:
                # the root's pre-hooks see its inputs before its converted forward rounds them
                x = round_to(x, self.root_plan.activation)
            mm = _fprop(m, x)[0]  # (as the forward GEMM rounds it: Recipe.gemm included)
            xv = _plain(x).float()
            if self.operand and mm is not None:  # the input as this contraction rounds it
                xv = _round(xv, with_axis(mm, _input_axis(m)), keep_layout=False)
            out_size = args[1] if len(args) > 1 else kwargs.get("output_size")  # ConvTranspose
            self.seen[name].append(_columns(m, xv, out_size))
        return hook

    def run(self, batches) -> Dict[str, torch.Tensor]:
        handles = [self.model.get_submodule(n).register_forward_pre_hook(self._hook(n, None),
                                                                         with_kwargs=True)
                   for n in self.names]
        try:
            with torch.no_grad():
                for args in batches:
                    self.model(*args)
        finally:
            for h in handles:
                h.remove()
        out = {}
        for n, xs in self.seen.items():
            if not xs:
                raise ValueError(f"qtensor.analysis.ptq: the layer {n} did not run on the calibration "
                                 "inputs; pass layers=[...] without it")
            out[n] = torch.cat(xs, dim=1)
        return out


# ---------------------------------------------------------------------------------------------
# How a weight matrix rounds, block by block

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
            self.whole_scale = (block_scale(src.abs().amax().reshape(1, 1), fmt)
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
        x = self._scale_of(cur.abs().amax(dim=1, keepdim=True))
        if self.pin is not None and a <= self.pin[1] < b:
            x[self.pin[0], 0] = self.pin[3]
        return x

    def round(self, v: torch.Tensor, scale: Optional[torch.Tensor], rows: torch.Tensor,
              c: int) -> torch.Tensor:
        """Column ``c``'s values ``v`` (for the rows ``rows``) rounded with their block scales."""
        if not self.block:
            q = _round_scalar(v, self.fmt, self.fmt.rounding, None, None)
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
        again = self._scale_of(q.abs().amax(dim=1, keepdim=True))
        moved = (self._round_with(q, again) != q).any(dim=1)
        moved &= (again < scale)[:, 0]
        if self.pin is not None and a <= self.pin[1] < b:
            moved &= rows != self.pin[0]
        scale[moved] = again[moved]
        return moved


# ---------------------------------------------------------------------------------------------
# The two algorithms, on one flattened weight (float64)

def _gptq_matrix(w: torch.Tensor, xq: torch.Tensor, grid: _Grid, damp: float,
                 act_order: bool = False) -> torch.Tensor:
    w = w.clone()
    n = xq.shape[0]
    h = 2.0 * xq.T @ xq / n
    dead = torch.diagonal(h) == 0
    h[dead, dead] = 1.0
    w[:, dead] = 0.0  # an input that is always zero: its weight does not matter (GPTQ)
    perm = None
    if act_order:  # the columns in the order of grid.act_order (the diagonal before damping)
        perm = grid.act_order(torch.diagonal(h).clone())
        w, h = w[:, perm], h[perm][:, perm]
    h += damp * torch.diagonal(h).mean() * torch.eye(h.shape[0], dtype=h.dtype)
    try:
        u = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    except RuntimeError as e:  # torch.linalg.LinAlgError
        raise ValueError(f"qt.gptq: {grid.name}: the damped Hessian is not positive definite "
                         f"({e}); raise damp") from e
    q = torch.zeros_like(w)
    every = torch.arange(w.shape[0])
    for a, b in grid.groups:
        w0 = w[:, a:b].clone()
        scale = grid.scales(w0, a, b)
        err = torch.zeros_like(w0)
        rows = every
        while len(rows):
            wg = w0[rows].clone()
            sc = scale[rows] if scale is not None else None
            for j in range(b - a):
                c = a + j
                qc = grid.round(wg[:, j], sc, rows, c)
                e = (wg[:, j] - qc) / u[c, c]
                wg[:, j + 1:] -= e[:, None] * u[c, c + 1:b][None, :]
                q[rows, c] = qc
                err[rows, j] = e
            lower = grid.unsettled(q[rows, a:b], sc, rows, a, b)
            if scale is not None:
                scale[rows] = sc
            rows = rows[lower]
        w[:, b:] -= err @ u[a:b, b:]
    return q if perm is None else q[:, torch.argsort(perm)]


def _diffusion_matrix(w: torch.Tensor, x: torch.Tensor, xq: torch.Tensor,
                      grid: _Grid) -> torch.Tensor:
    q = torch.zeros_like(w)
    u = torch.zeros(x.shape[0], w.shape[0], dtype=torch.float64)  # the output error, carried
    every = torch.arange(w.shape[0])
    for a, b in grid.groups:
        # within a block the error is carried through the block's Gram matrices (n x n), not
        # the (N x out) error itself: x~_c . u = p_c + sum_{j<c} (g1_cj w_j - g2_cj q_j)
        xg, xqg, wg = x[:, a:b], xq[:, a:b], w[:, a:b].T  # wg: (n, out)
        p = xqg.T @ u
        g1, g2 = xqg.T @ xg, xqg.T @ xqg
        live = torch.diagonal(g2) > 0  # an input always zero in the quantized model: keep w
        d1, d2 = torch.diagonal(g1)[:, None], torch.where(live, torch.diagonal(g2), 1.0)[:, None]
        cur = torch.where(live[:, None], (p + d1 * wg) / d2, wg).T  # the values at the start
        scale = grid.scales(cur, a, b)
        rows = every
        while len(rows):
            qg = torch.zeros(b - a, len(rows), dtype=torch.float64)
            sc = scale[rows] if scale is not None else None
            for j in range(b - a):
                v = wg[j, rows]
                if live[j]:
                    v = (p[j, rows] + g1[j, :j] @ wg[:j, rows] - g2[j, :j] @ qg[:j]
                         + g1[j, j] * v) / g2[j, j]
                qg[j] = grid.round(v, sc, rows, a + j)
            q[rows, a:b] = qg.T
            lower = grid.unsettled(q[rows, a:b], sc, rows, a, b)
            if scale is not None:
                scale[rows] = sc
            rows = rows[lower]
        u += xg @ wg - xqg @ q[:, a:b].T
    return q


# ---------------------------------------------------------------------------------------------
# The model-level flow

def _recipe(spec) -> Recipe:
    return spec if isinstance(spec, Recipe) else direct_cast(spec)


def _fprop(mod: nn.Module, x=None) -> tuple:
    """(x format, W format, transform) of the layer's forward GEMM (``Recipe.gemm`` included);
    a ConvTranspose (no per-GEMM formats): its operands' own formats."""
    used = gemm_formats(mod, getattr(x, "mm_fmt", None), x_plain=not isinstance(x, QTensor))
    if used is not None:
        return used["fprop"]
    w = mod.weight
    return (getattr(x, "mm_fmt", None) if isinstance(x, QTensor) else None,
            w.mm_fmt if isinstance(w, QTensor) else None, None)


def _weight_format(mod: nn.Module) -> Optional[Format]:
    """The format the layer's contraction gives its weight (None: FP32, nothing to do)."""
    w = mod.weight
    if not isinstance(w, QTensor):
        return None
    fmt = _fprop(mod)[1]
    fmt = fmt if fmt is not None else w.fmt
    if fmt.is_fp32:
        return None
    if fmt.is_block:
        fmt = with_axis(fmt, _weight_axis(mod) if fmt.axis is not None else None)
    return fmt


def _layers(model: nn.Module, layers, who: str) -> List[Tuple[str, nn.Module, Format]]:
    chosen, skipped = [], []
    names = None if layers is None else list(layers)
    for name, mod in model.named_modules():
        if names is not None and name not in names:
            continue
        if not isinstance(mod, LAYERS):
            if names is not None and isinstance(mod, nn.Embedding):
                raise ValueError(
                    f"{who}: {name} is an nn.Embedding: its lookup is not a contraction (its "
                    "input is one-hot, the Hessian diagonal), so GPTQ and error diffusion reduce "
                    "to rounding each weight to nearest, the direct cast it already has")
            if names is not None:
                raise ValueError(f"{who}: {name} is a {type(mod).__name__}, not one of "
                                 f"{', '.join(t.__name__ for t in LAYERS)}")
            continue
        fmt = _weight_format(mod)
        why = _check_layer(name, mod, fmt)
        if why is not None:
            if names is not None:
                raise ValueError(f"{who}: cannot process {why}")
            if fmt is not None:
                skipped.append(why)
            continue
        if fmt is not None:
            chosen.append((name, mod, fmt))
    if names is not None:
        missing = set(names) - {n for n, _ in model.named_modules()}
        if missing:
            raise ValueError(f"{who}: no layer named {', '.join(sorted(missing))}")
    if skipped:
        warnings.warn(f"{who}: left in direct cast: {'; '.join(skipped)}", stacklevel=3)
    owners: Dict[int, List[str]] = {}
    for n, m in model.named_modules():
        for p in m.parameters(recurse=False):
            owners.setdefault(id(p), []).append(n)
    for name, mod, _ in chosen:
        others = [n for n in owners.get(id(mod.weight), []) if n != name]
        if others:  # tied weights (a language model's head and its token embedding, say)
            warnings.warn(f"{who}: {name}'s weight is shared with {', '.join(others)}: the "
                          f"values rounded for {name}'s contraction are written into it, and "
                          f"{', '.join(others)} use them too", stacklevel=3)
    return chosen


def _write(mod: nn.Module, name: str, flat: torch.Tensor, fmt: Format, who: str) -> None:
    w = mod.weight
    new = _unflatten_weight(mod, flat, w.shape).float()
    # in the format: the contraction's rounding of the new weight gives it back, bit for bit
    again = _round(new, fmt)
    if not torch.equal(again.view(torch.int32), new.view(torch.int32)):
        raise AssertionError(f"{who}: {name}'s rounded weight is not a fixed point of {fmt}; "
                             "please report this")
    with torch.no_grad():
        w.copy_(new)
    if not torch.equal(_plain(w).view(torch.int32), new.view(torch.int32)):
        raise ValueError(f"{who}: {name}'s weight is stored in {w.fmt}, which does not hold the "
                         f"values rounded to its contraction's format {fmt} (blocked along a "
                         "different axis?); store the weight in FP32 (qt.recipes.direct_cast) "
                         "or in the same blocking")


def _flow(model, calib_inputs, spec, layers, who, quantize_layer, need_fp32_inputs):
    if not isinstance(model, nn.Module):
        raise TypeError(f"{who}: model must be an nn.Module, got {type(model).__name__}")
    if is_converted(model):
        raise ValueError(f"{who} needs the trained model before conversion (it converts it): "
                         "qt.unconvert(model) first")
    batches = _batches(calib_inputs)
    recipe = _recipe(spec)
    # calibration runs in eval mode (no dropout, BatchNorm on its running statistics, which
    # stay as they are); a call that fails leaves the model as it was: unconverted, its values
    saved = {k: v.detach().clone() for k, v in model.state_dict(keep_vars=True).items()}
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        return _flow_eval(model, batches, recipe, layers, who, quantize_layer, need_fp32_inputs)
    except BaseException:
        if is_converted(model):
            unconvert(model)
        with torch.no_grad():
            for k, v in model.state_dict(keep_vars=True).items():
                if k in saved:
                    v.copy_(saved[k])
        raise
    finally:
        for m, training in modes:
            m.training = training


def _flow_eval(model, batches, recipe, layers, who, quantize_layer, need_fp32_inputs):
    fp32_model = copy.deepcopy(model) if need_fp32_inputs else None
    convert(model, recipe)
    todo = _layers(model, layers, who)
    fp32_inputs = (_Inputs(fp32_model, [n for n, _, _ in todo], operand=False).run(batches)
                   if need_fp32_inputs else None)
    order = _execution_order(model, [n for n, _, _ in todo], batches)
    for name, mod, fmt in sorted(todo, key=lambda t: order[t[0]]):
        xq = _Inputs(model, [name], operand=True).run(batches)[name]
        w0 = _plain(mod.weight).detach().double()
        if not bool(torch.isfinite(w0).all()):
            raise ValueError(f"{who}: {name}'s weight has Inf/NaN values")
        flat, run = _flat_weight(mod, w0)  # one least-squares problem per conv group
        x = fp32_inputs[name] if fp32_inputs is not None else None

        def solve(whole_scale=None):
            grids = [_Grid(fmt, flat[g], run, name, whole=flat, group=g,
                           whole_scale=whole_scale) for g in range(flat.shape[0])]
            q = torch.stack([quantize_layer(flat[g], xq[g], x[g] if x is not None else None,
                                            grids[g]) for g in range(flat.shape[0])])
            return q, grids[0].whole_scale

        q, scale = solve()
        while scale is not None:  # a per-tensor block: the whole weight must be a fixed point
            again = block_scale(q.abs().amax().reshape(1, 1), fmt)
            if not bool((again < scale).all()) or torch.equal(
                    round_with_scale(q, again, fmt, fmt.rounding), q):
                break
            q, scale = solve(again)  # rounding lowered its maximum: again with its own scale
        _write(mod, name, q, fmt, who)
    return model


def _execution_order(model, names, batches) -> Dict[str, int]:
    """The order in which the layers first run (the flows process a layer after those that
    feed it, on inputs that already carry their rounding)."""
    order: Dict[str, int] = {}

    def hook(name):
        def h(m, args):
            order.setdefault(name, len(order))
        return h

    handles = [model.get_submodule(n).register_forward_pre_hook(hook(n)) for n in names]
    try:
        with torch.no_grad():
            model(*batches[0])
    finally:
        for h in handles:
            h.remove()
    missing = [n for n in names if n not in order]
    if missing:
        raise ValueError(f"qtensor.analysis.ptq: the layers {', '.join(missing)} did not run on the "
                         "calibration inputs; pass layers=[...] without them")
    return order


def gptq(model: nn.Module, calib_inputs, spec, *, damp: float = 0.01, act_order: bool = False,
         layers: Optional[Sequence[str]] = None) -> nn.Module:
    """GPTQ (Frantar et al. 2022) of a trained model in any format, from a calibration batch.

    Converts ``model`` in place with ``spec`` (a format F: ``qt.recipes.direct_cast(F)``; or a
    ``qt.Recipe``) and replaces the weight of each ``nn.Linear``, ``nn.Conv1d/2d/3d`` and
    ``nn.ConvTranspose1d/2d/3d`` (grouped ones too) whose contraction rounds it (or the
    ``layers`` named) by its GPTQ rounding in that format, layer after layer in the order they
    run, each on its inputs in the model quantized so far (as the contraction receives them:
    rounded to the activation operand format). ``calib_inputs``: a
    tensor, a tuple of positional arguments, or a list of them. ``damp``: the fraction of the
    Hessian's mean diagonal added to it. ``act_order``: GPTQ's act-order (``--act-order`` of
    the reference implementation: the columns in decreasing order of the Hessian diagonal);
    with a block format the blocks are taken in decreasing order of their largest diagonal
    entry and the columns of each block in decreasing order within it, so that every block is
    the format's and its scale is decided when its first column is reached (a scalar format:
    GPTQ's own order). Returns ``model``. See the module docstring and
    docs/analysis.md."""
    if not (isinstance(damp, (int, float)) and damp >= 0):
        raise ValueError(f"qt.gptq: damp must be a number >= 0, got {damp!r}")
    if not isinstance(act_order, bool):
        raise TypeError(f"qt.gptq: act_order must be True or False, got {act_order!r}")
    return _flow(model, calib_inputs, spec, layers, "qt.gptq",
                 lambda w, xq, x, grid: _gptq_matrix(w, xq, grid, float(damp), act_order),
                 False)


def error_diffusion(model: nn.Module, calib_inputs, spec, *,
                    layers: Optional[Sequence[str]] = None) -> nn.Module:
    """Error-diffusion post-training quantization (after arXiv 2410.11203) in any format.

    Converts ``model`` in place with ``spec`` (as :func:`gptq`) and replaces each processed
    layer's weight by values rounded column after column (in block order) so that the layer's
    output error on the calibration batch, against the FP32 model's output of that layer (the
    errors of the layers before included), is diffused into the columns not yet rounded; no
    Hessian, no backpropagation, no hyperparameter. Returns ``model``. See the module docstring
    and docs/analysis.md."""
    return _flow(model, calib_inputs, spec, layers, "qt.error_diffusion",
                 lambda w, xq, x, grid: _diffusion_matrix(w, x, xq, grid), True)
